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
//
// Oldest first, in the order of the index of finished keys (`intents_finished`: tool, time).
// Ordered by id, a generic plan (or one made on statistics taken during a backlog) walked the
// primary key for the first expired keys, through every key of every tool, locking what it met:
// the last batches after a backlog read the whole table (87,180 intents for 100, in the test).
// The locks skip what others hold, so their order cannot deadlock.
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
         order by i.finished_at
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

// Rows another relay's pass is deleting are skipped, not waited for (and then found gone). The
// batch is read once, before the delete (`any(array(…))`, as the dead letters').
const PRUNE_TOMBSTONES: &str = "
    with gone as (
        delete from tombstones where key_hash = any(array(
            select key_hash from tombstones where expires_at < now() limit $1
               for update skip locked))
        returning 1
    )
    select count(*) from gone";

// The expired dead letters by age (`deliveries_dead_letters`), then each deleted by its id: as
// `id in (select …)` Postgres could join the batch's ids to a scan of every delivery. Rows
// another relay's pass is deleting are skipped, as the tombstones'.
const PRUNE_DEAD_LETTER_DELIVERIES: &str = "
    with gone as (
        delete from deliveries where id = any(array(
            select id from deliveries
             where intent_id is null and received_at < now() - make_interval(secs => $1)
             order by received_at
             limit $2
               for update skip locked))
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

    // A relay prunes in batches, on a statement it prepares once; after five runs Postgres may
    // keep a generic plan for it. Once a backlog of expired keys is worked off, a batch finds
    // the last few among keys not yet expired: it must read those few, not walk every intent
    // (holding the locks it took meanwhile, which repeats of those keys would wait for).
    #[tokio::test]
    async fn a_prune_batch_reads_the_expired_keys_not_every_intent() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        // A hundred thousand keys of five tools finished over eight days, each with its
        // published outcome, analyzed; then the expired ones pruned (and those an hour from
        // expiring) but the last hundred of one tool, whose outcomes are left as well.
        db.intents(100_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "update intents set tool = 'tool' || (id % 5), run_id = 'r' || (id % 20000),
                                    finished_at = now() - make_interval(secs => (100000 - id) * 6.912);
                 insert into outbox (event_id, kafka_key, payload)
                 select 'o' || id, idempotency_key, '{}' from intents;
                 delete from outbox_pending;
                 analyze intents, outbox;
                 delete from intents where finished_at < now() - interval '167 hours'
                    and id not in (select id from intents
                                    where tool = 'tool0'
                                      and finished_at < now() - interval '169 hours'
                                    order by id desc limit 100);",
            )
            .await
            .expect("fill");
        // Pruning runs on the general pool: the server's settings, and the generic plan it may
        // keep after five runs.
        let prepare = format!(
            "set enable_seqscan = on; set plan_cache_mode = force_generic_plan;
             prepare p(text, float8, float8, int8) as {PRUNE_TOOL}"
        );
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let week = 7.0 * 86_400.0;
        let batch = format!("execute p('tool0', {week}, {week}, 250)");

        let pruned = db
            .rows(&format!(
                "begin; {batch}; select count(*) as left from outbox; rollback"
            ))
            .await;
        assert_eq!(pruned[0][0].1, "100");
        assert_eq!(
            pruned[1][0].1, "99900",
            "the 100 keys' outcomes pruned with them"
        );
        let plan = db.explain(&batch).await;
        let n = rows_read(&plan, "intents");
        assert!(
            n <= 250.0,
            "a batch read {n} intents to prune the last 100 expired of 87,500: {plan:#}"
        );
        // Their outcomes go with them, found by key.
        let n = rows_read(&plan, "outbox");
        assert!(
            n <= 250.0,
            "a batch read {n} outbox rows to prune the outcomes of 100 keys of 100,000: {plan:#}"
        );
        db.drop().await;
    }

    // A person's decisions (resolutions) go with their pruned key by a foreign key's cascade:
    // for each pruned key Postgres deletes its resolutions, which must be found by index, not
    // by reading every decision ever made.
    #[tokio::test]
    async fn pruning_a_key_finds_its_resolutions_by_index() {
        use crate::db::plans::Fresh;
        let db = Fresh::new().await;
        // Six thousand finished keys, the 250 oldest past a week's retention; five thousand
        // decisions recorded on the others. The relay prunes on the server's settings.
        db.intents(6_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "update intents set finished_at = now() - case when id <= 250
                                    then interval '30 days' else interval '1 minute' end;
                 insert into resolutions (intent_id, idempotency_key, from_status, resolved_as,
                                          resolved_by, reason)
                 select id, idempotency_key, 'unknown', 'succeeded', 'ops', 'checked downstream'
                   from intents where id > 1000;
                 analyze intents, resolutions;
                 set enable_seqscan = on; set plan_cache_mode = auto;",
            )
            .await
            .expect("fill");
        let prepare = format!("prepare p(text, float8, float8, int8) as {PRUNE_TOOL}");
        db.pg.batch_execute(&prepare).await.expect("prepare");

        let read = db
            .rows(
                "begin;
                 execute p('send_email', 604800, 604800, 250);
                 select seq_tup_read, coalesce(idx_scan, 0) as idx_scan
                   from pg_stat_xact_user_tables
                  where relname = 'resolutions' and schemaname = current_schema();
                 rollback",
            )
            .await;
        assert_eq!(read[0][0].1, "250", "the batch pruned the 250 expired keys");
        let (scanned, probes) = (&read[1][0].1, &read[1][1].1);
        assert_eq!(
            (scanned.as_str(), probes.as_str()),
            ("0", "250"),
            "pruning 250 keys read {scanned} resolutions sequentially, probed {probes} times"
        );
        db.drop().await;
    }

    // Dead letters are pruned at the shortest retention. Most passes find none or a few past it
    // among many still kept (a burst of poison messages is kept for days): a pass must read
    // those few, not every dead letter within retention, nor the deliveries of live keys.
    #[tokio::test]
    async fn a_dead_letter_prune_reads_the_expired_dead_letters_not_every_one() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        // Eight days of deliveries, in the order they came: 50,000, every fifth a dead letter
        // (10,000), the others repeats of 20,000 live keys. All but the last hundred dead
        // letters past a week are pruned already. (No delivery is within seconds of the week.)
        db.intents(20_000, "'succeeded'", "false").await;
        db.pg
            .batch_execute(
                "insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset,
                                         origin, answered, received_at)
                 select case when g % 5 <> 0 then g % 20000 + 1 end, 'k' || (g % 20000 + 1),
                        'd' || g, 'actions', 0, g,
                        case when g % 5 = 0 then 'dead_letter' else 'replay' end, true,
                        now() - make_interval(secs => (50000 - g) * 13.824 + 6.9)
                   from generate_series(1, 50000) g;
                 delete from deliveries
                  where intent_id is null and received_at < now() - interval '7 days'
                    and id not in (select id from deliveries
                                    where intent_id is null
                                      and received_at < now() - interval '7 days'
                                    order by id desc limit 100);
                 analyze intents, deliveries;
                 set enable_seqscan = on; set plan_cache_mode = auto;",
            )
            .await
            .expect("fill");
        let prepare = format!("prepare p(float8, int8) as {PRUNE_DEAD_LETTER_DELIVERIES}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let batch = "execute p(604800, 250)";

        let pruned = db.rows(&format!("begin; {batch}; rollback")).await;
        assert_eq!(pruned[0][0].1, "100", "the hundred expired dead letters");
        let plan = db.explain(batch).await;
        let n = rows_read(&plan, "deliveries");
        assert!(
            n <= 500.0,
            "pruning the last 100 expired dead letters read {n} deliveries (8,750 dead letters \
             within retention, 40,000 deliveries of live keys): {plan:#}"
        );
        db.drop().await;
    }

    // Tombstones outlive their keys by `tombstone_retention`, so a schema that has pruned
    // millions of keys keeps millions of them. A pass that finds the last few expired must read
    // those few.
    #[tokio::test]
    async fn a_tombstone_prune_reads_the_expired_tombstones_not_every_one() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        db.pg
            .batch_execute(
                "insert into tombstones (key_hash, fingerprint_hash, tool, status, expires_at)
                 select md5('k' || g), 'f', 'send_email', 'succeeded',
                        now() + make_interval(secs => (g - 100) * 60 - 30)
                   from generate_series(1, 50000) g;
                 analyze tombstones;
                 set enable_seqscan = on; set plan_cache_mode = auto;",
            )
            .await
            .expect("fill");
        let prepare = format!("prepare p(int8) as {PRUNE_TOMBSTONES}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let batch = "execute p(250)";

        let pruned = db.rows(&format!("begin; {batch}; rollback")).await;
        assert_eq!(pruned[0][0].1, "100", "the hundred expired tombstones");
        let plan = db.explain(batch).await;
        let n = rows_read(&plan, "tombstones");
        assert!(
            n <= 500.0,
            "pruning the last 100 expired tombstones read {n} of 50,000: {plan:#}"
        );
        db.drop().await;
    }

    // Every relay prunes, each on its own schedule. Two passes at once over the same expired
    // rows must take different ones: the second waiting on the first's row locks, then finding
    // those rows gone, would count a short batch and stop as if it had caught up.
    #[tokio::test]
    async fn two_passes_at_once_prune_different_rows() {
        use crate::db::plans::Fresh;
        let db = Fresh::new().await;
        db.pg
            .batch_execute(
                "insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset,
                                         origin, answered, received_at)
                 select null, 'k' || g, 'd' || g, 'actions', 0, g, 'dead_letter', true,
                        now() - interval '8 days' + make_interval(secs => g)
                   from generate_series(1, 20) g;
                 insert into tombstones (key_hash, fingerprint_hash, tool, status, expires_at)
                 select md5('k' || g), 'f', 'send_email', 'succeeded',
                        now() - make_interval(secs => g)
                   from generate_series(1, 20) g;",
            )
            .await
            .expect("fill");
        let other_pool = crate::db::pool(&db.cfg).expect("pool");
        let other = other_pool.get().await.expect("a second connection");
        // Pruning's pool: the server's settings, and no lock timeout of its own, so the test
        // sets one to fail rather than hang when the second pass waits.
        for c in [&db.pg, &other] {
            c.batch_execute(
                "set enable_seqscan = on; set plan_cache_mode = auto; set lock_timeout = '10s'",
            )
            .await
            .expect("settings");
        }
        for (name, prune, types, params) in [
            (
                "dead letters",
                PRUNE_DEAD_LETTER_DELIVERIES,
                "float8, int8",
                "604800, 10",
            ),
            ("tombstones", PRUNE_TOMBSTONES, "int8", "10"),
        ] {
            let prepare = format!("deallocate all; prepare p({types}) as {prune}");
            for c in [&db.pg, &other] {
                c.batch_execute(&prepare).await.expect("prepare");
            }
            // The first pass holds its batch, uncommitted.
            let first = db.rows(&format!("begin; execute p({params})")).await;
            assert_eq!(first[0][0].1, "10", "{name}: the first pass's batch");
            // The second takes the other ten, at once.
            let second = other
                .query_one(&format!("execute p({params})"), &[])
                .await
                .unwrap_or_else(|e| panic!("{name}: the second pass waited for the first: {e:?}"));
            assert_eq!(
                second.get::<_, i64>(0),
                10,
                "{name}: the second pass's batch"
            );
            db.pg.batch_execute("commit").await.expect("commit");
        }
        let left = db
            .rows("select (select count(*) from deliveries), (select count(*) from tombstones)")
            .await;
        assert_eq!((left[0][0].1.as_str(), left[0][1].1.as_str()), ("0", "0"));
        db.drop().await;
    }
}
