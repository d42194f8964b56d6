//! Retention: finished keys past their tool's retention are deleted, leaving tombstones.

use deadpool_postgres::Pool;

use crate::db::DbError;

// Finished keys past retention whose run waits on nothing, in batches. Their deliveries and
// attempts go with them (on delete cascade); a tombstone stays.
const PRUNE_TOOL: &str = "
    with doomed as (
        select i.id from intents i
         where i.tool = $1 and i.status in ('succeeded', 'failed', 'rejected')
           and i.finished_at < now() - make_interval(secs => $2)
           -- Two halves, each a partial index's predicate (intents_open, intents_parked): as
           -- one list of four statuses Postgres read every intent for each candidate.
           and not exists (select 1 from intents j
                            where j.run_id = i.run_id and j.status in ('pending', 'running'))
           and not exists (select 1 from intents j
                            where j.run_id = i.run_id
                              and j.status in ('pending_approval', 'unknown'))
         order by i.id
         limit 1000
         for update skip locked
    ), gone as (
        delete from intents where id in (select id from doomed)
        returning idempotency_key, fingerprint, tool, status, finished_at, class
    ), stones as (
        insert into tombstones (key_hash, fingerprint_hash, tool, status, finished_at, expires_at)
        select encode(sha256(convert_to(idempotency_key, 'UTF8')), 'hex'), fingerprint, tool,
               status, finished_at, now() + make_interval(secs => $3)
          from gone where class <> 'read_only'
        on conflict (key_hash) do update set expires_at = excluded.expires_at
    ), answered as (
        delete from outbox where kafka_key in (select idempotency_key from gone)
           and published_at is not null
    )
    select count(*) from gone";

const PRUNE_TOMBSTONES: &str = "delete from tombstones where expires_at < now()";

const PRUNE_DEAD_LETTER_DELIVERIES: &str = "
    delete from deliveries where intent_id is null and received_at < now() - make_interval(secs => $1)";

/// Deletes expired finished keys (never ones pending approval, unknown or in flight, nor any
/// key of a run that still waits on one), leaving tombstones; returns how many keys went.
pub async fn prune(pool: &Pool, config: &crate::config::Config) -> Result<i64, DbError> {
    let client = pool.get().await?;
    let tombstone = config.relay.tombstone_retention.as_secs_f64();
    let mut total = 0;
    for tool in &config.tools {
        let retention = tool.retention.as_secs_f64();
        loop {
            let n: i64 = client
                .query_one(PRUNE_TOOL, &[&tool.name, &retention, &tombstone])
                .await?
                .get(0);
            total += n;
            if n < 1000 {
                break;
            }
        }
    }
    client.execute(PRUNE_TOMBSTONES, &[]).await?;
    let shortest = config
        .tools
        .iter()
        .map(|t| t.retention)
        .min()
        .unwrap_or(std::time::Duration::from_secs(7 * 86400));
    client
        .execute(PRUNE_DEAD_LETTER_DELIVERIES, &[&shortest.as_secs_f64()])
        .await?;
    Ok(total)
}
