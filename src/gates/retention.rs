//! Retention: finished keys past their tool's retention are deleted, leaving tombstones.
//!
//! Pruning is paced: it deletes in small batches and pauses after each, so that it keeps a
//! Postgres connection busy for at most `relay.prune_share` of the time. A backlog of a million
//! expired keys is then worked off over minutes beside live traffic instead of taking the
//! database's CPU and disk for the seconds it would take flat out.

use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use tokio_util::sync::CancellationToken;

use crate::db::DbError;

/// Keys (or rows) deleted per statement: one statement's locks and WAL stay small.
const BATCH: i64 = 250;

// Finished keys past retention whose run waits on nothing, in batches. Their deliveries and
// attempts go with them (a trigger on intents, schema migration 12); a tombstone stays.
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
         limit $4
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
        delete from outbox o where kafka_key in (select idempotency_key from gone)
           and o.quarantined_at is null
           and not exists (select 1 from outbox_pending p where p.id = o.id)
    )
    select count(*) from gone";

const PRUNE_TOMBSTONES: &str = "
    with gone as (
        delete from tombstones where key_hash in (
            select key_hash from tombstones where expires_at < now() limit $1)
        returning 1
    )
    select count(*) from gone";

const PRUNE_DEAD_LETTER_DELIVERIES: &str = "
    with gone as (
        delete from deliveries where id in (
            select id from deliveries
             where intent_id is null and received_at < now() - make_interval(secs => $1)
             limit $2)
        returning 1
    )
    select count(*) from gone";

/// Keeps a batch loop to its share of the time: after a batch that took `t`, a pause of
/// `t × (1 − share) / share`.
struct Pace {
    share: f64,
    stop: CancellationToken,
}

impl Pace {
    fn pause_after(&self, batch: Duration) -> Duration {
        batch.mul_f64((1.0 - self.share) / self.share)
    }

    /// Runs `batch` (which answers how many rows it deleted) until it deletes fewer than
    /// [`BATCH`] or the pace is stopped; answers the rows deleted.
    async fn drain<F, Fut>(&self, mut batch: F) -> Result<i64, DbError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<i64, DbError>>,
    {
        let mut total = 0;
        loop {
            let started = Instant::now();
            let n = batch().await?;
            total += n;
            if n < BATCH {
                return Ok(total);
            }
            tokio::select! {
                _ = self.stop.cancelled() => return Ok(total),
                _ = tokio::time::sleep(self.pause_after(started.elapsed())) => {}
            }
        }
    }
}

/// Deletes expired finished keys (never ones pending approval, unknown or in flight, nor any
/// key of a run that still waits on one), leaving tombstones; returns how many keys went.
/// Paced by `relay.prune_share`; `stop` ends it between two batches.
pub async fn prune(
    pool: &Pool,
    config: &crate::config::Config,
    stop: &CancellationToken,
) -> Result<i64, DbError> {
    let client = pool.get().await?;
    let pace = Pace {
        share: config.relay.prune_share,
        stop: stop.clone(),
    };
    let tombstone = config.relay.tombstone_retention.as_secs_f64();
    let mut total = 0;
    for tool in &config.tools {
        let retention = tool.retention.as_secs_f64();
        let statement = client.prepare_cached(PRUNE_TOOL).await?;
        total += pace
            .drain(|| async {
                let row = client
                    .query_one(&statement, &[&tool.name, &retention, &tombstone, &BATCH])
                    .await?;
                Ok(row.get::<_, i64>(0))
            })
            .await?;
    }
    pace.drain(|| async {
        Ok(client
            .query_one(PRUNE_TOMBSTONES, &[&BATCH])
            .await?
            .get::<_, i64>(0))
    })
    .await?;
    let shortest = config
        .tools
        .iter()
        .map(|t| t.retention)
        .min()
        .unwrap_or(Duration::from_secs(7 * 86400))
        .as_secs_f64();
    pace.drain(|| async {
        Ok(client
            .query_one(PRUNE_DEAD_LETTER_DELIVERIES, &[&shortest, &BATCH])
            .await?
            .get::<_, i64>(0))
    })
    .await?;
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_is_followed_by_a_pause_that_keeps_it_to_its_share() {
        let pace = |share| Pace {
            share,
            stop: CancellationToken::new(),
        };
        let batch = Duration::from_millis(20);
        assert_eq!(pace(0.1).pause_after(batch), Duration::from_millis(180));
        assert_eq!(pace(0.5).pause_after(batch), batch);
        assert_eq!(pace(1.0).pause_after(batch), Duration::ZERO);
    }
}
