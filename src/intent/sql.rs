//! The statements that record a batch. Parameters are never formatted in.

pub(crate) const SELECT_SEEN_EVENTS: &str = "
    select action_event_id, source_topic, source_partition, source_offset,
           direct_status is not null as answered_direct
    from deliveries where action_event_id = any($1)";

// A row with a lease owner is recorded claimed (`running`, epoch 1); its attempt row follows
// in the same transaction. The row carries its first delivery (event id, record, schema id):
// no `deliveries` row is written for it (schema migration 13).
macro_rules! insert_intents {
    () => {
        "insert into intents (idempotency_key, tool, class, run_id, step, business_id, args,
                              material, fingerprint, args_hash, action_event_id, source_topic,
                              source_partition, source_offset, schema_id, traceparent, event_time,
                              status, status_seq, lease_owner, lease_expires_at, lease_epoch)
         select k, t, c, r, s, b, a, m, f, h, e, tp, p, o, sc, tr, tm, st, sq, lo,
                case when lo is null then null else now() + make_interval(secs => $20) end,
                case when lo is null then 0 else 1 end
           from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[],
                       $7::jsonb[], $8::jsonb[], $9::text[], $10::text[], $11::text[],
                       $12::text[], $13::int4[], $14::int8[], $15::text[], $16::timestamptz[],
                       $17::text[], $18::int4[], $19::text[], $21::int4[])
                as u(k, t, c, r, s, b, a, m, f, h, e, tp, p, o, tr, tm, st, sq, lo, sc)
         on conflict (idempotency_key) where class <> 'read_only' do nothing
         returning id, idempotency_key, action_event_id, lease_owner"
    };
}

pub(crate) const INSERT_INTENTS: &str = insert_intents!();

// The same, with each claimed row's first call opened in the same statement: for batches where
// no per-run limit can refuse a claimed row after its insert.
pub(crate) const INSERT_INTENTS_OPENING_CALLS: &str = concat!(
    "with i as (",
    insert_intents!(),
    "), a as (
        insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
        select id, idempotency_key, 1, 'call', 'first', lease_owner, 1
          from i where lease_owner is not null
    )
    select id, idempotency_key, action_event_id from i"
);

pub(crate) const OPEN_FIRST_CALLS: &str = "
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
    select id, k, 1, 'call', 'first', $3, 1 from unnest($1::int8[], $2::text[]) as u(id, k)";

// What a repeat is answered from: the columns of its stored key, as read from `intents`, and
// by name once read.
macro_rules! stored_key_columns {
    () => {
        "id, idempotency_key, material::text as material, fingerprint, args_hash,
         action_event_id, source_topic, source_partition, source_offset, status, result,
         error, attempts, run_id, step, tool, coalesce(finished_at, updated_at) as at"
    };
}
macro_rules! stored_key_names {
    () => {
        "id, idempotency_key, material, fingerprint, args_hash, action_event_id, source_topic,
         source_partition, source_offset, status, result, error, attempts, run_id, step, tool, at"
    };
}

// How recently a key must have finished for its repeats to read it without a share lock:
// half the shortest retention a tool may have (`config::MIN_RETENTION`, a test checks), so no
// prune can delete it while the reading transaction is open (its `now()` is when it began).
macro_rules! settled_unlocked {
    () => {
        "12 hours"
    };
}

// The stored state of a batch's repeated keys. A key still open (in flight, parked, or
// finished long ago) is read under a share lock, which orders this batch against a concurrent
// finish of it (either the finish commits first and the locking read returns its version, or
// it waits and then sees our waiting deliveries) and keeps a prune from deleting it before our
// deliveries are written. Every statement that locks several intents locks them in id order,
// so they cannot deadlock. A key settled recently (succeeded, failed or rejected, which nothing
// changes again; finished within `settled_unlocked!()`, which no prune reaches) needs neither, and
// is read without: a share lock writes the row (its header, and about 55 bytes of WAL each: 21.8
// KB for a batch of 384 keys, against 0.2 KB unlocked), and two relays' locks on one row make a
// multixact. Most repeats are of settled keys.
//
// `unpublished` says whether a repeat is answered through the outbox, behind the key's own
// outcomes, rather than straight to Kafka. A key read under the lock counts as unpublished:
// its outbox is read with the statement's snapshot, and when the locking read waited for a
// finish, that finish's outcome (committed since) is not in it. Such keys are those in flight
// (whose repeats wait for the outcome and are answered with it), parked, or settled more than
// `settled_unlocked!()` ago; the usual repeat, of a key settled recently, is not one of them.
//
// The outbox part may be planned as one pass over the queue of unpublished outcomes (and their
// outbox rows) per statement, or as a probe per key. A pass is cheaper while the queue is short
// (3.0 ms for 500 keys, against 4.4 ms probing); the publisher vacuums the queue every two
// seconds, and each vacuum makes every connection plan the statement again for the queue's new
// length, so a backlog turns the plan into probes within seconds (62 ms for 500 keys with
// 100,000 ids queued and the old plan, 4–11 ms once planned again).
pub(crate) const SELECT_STORED_KEYS: &str = concat!(
    "with stored as (
        select ",
    stored_key_columns!(),
    ",
               coalesce(status in ('succeeded', 'failed', 'rejected')
                        and finished_at > now() - interval '",
    settled_unlocked!(),
    "', false) as settled
          from intents
         where idempotency_key = any($1) and class <> 'read_only'
    ), locked as (
        select ",
    stored_key_columns!(),
    "
          from intents
         where id = any(array(select id from stored where not settled))
         order by id
           for share
    ), k as (
        select ",
    stored_key_names!(),
    ", false as locked from stored where settled
        union all
        select ",
    stored_key_names!(),
    ", true from locked
    )
    select ",
    stored_key_names!(),
    ",
           locked
           or exists (select 1 from outbox o
                       where o.kafka_key = k.idempotency_key
                         and o.published_at is null and o.quarantined_at is null
                         and exists (select 1 from outbox_pending p where p.id = o.id))
             as unpublished
      from k"
);

pub(crate) const INSERT_DELIVERIES: &str = "
    insert into deliveries (intent_id, idempotency_key, action_event_id, source_topic,
                            source_partition, source_offset, origin, answered, schema_id,
                            direct_status)
    select * from unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::int8[],
                         $7::text[], $8::bool[], $9::int4[], $10::text[])";

// The publisher is woken (NOTIFY, delivered at commit) only when a row was new.
// Outcome events into the outbox; an event already there is not written again.
macro_rules! insert_outbox {
    () => {
        "insert into outbox (event_id, kafka_key, payload, traceparent)
         select * from unnest($1::text[], $2::text[], $3::jsonb[], $4::text[])
         on conflict (event_id) do nothing"
    };
}

// Counts the rows written and notifies the publishers ($5, the schema's channel) when any was.
pub(crate) const INSERT_OUTBOX: &str = concat!(
    "with o as (",
    insert_outbox!(),
    " returning 1)
    select n, case when n > 0 then pg_notify($5, '') end
      from (select count(*) as n from o) c"
);

// The same without the NOTIFY, returning the rows written, for a writer that hands them to the
// publishers in memory once committed (`publish::handoff`).
pub(crate) const INSERT_OUTBOX_HANDED: &str = concat!(insert_outbox!(), " returning id, event_id");

// Keys whose intent was pruned: a run resumed past retention must not execute them as new.
pub(crate) const TOMBSTONED: &str = "
    select k from unnest($1::text[]) as k
     where exists (select 1 from tombstones t
                    where t.key_hash = encode(sha256(convert_to(k, 'UTF8')), 'hex')
                      and t.expires_at > now())";

pub(crate) const FAILED_REATTEMPTS: &str = "
    select i.run_id, i.tool, i.business_id, count(*) as failed
      from intents i
      join unnest($1::text[], $2::text[], $3::text[]) as q(run_id, tool, business_id)
        on i.run_id = q.run_id and i.tool = q.tool and i.business_id = q.business_id
     where i.status = 'failed'
     group by 1, 2, 3";

pub(crate) const REJECT_NEW: &str = "
    update intents set status = 'rejected', error = $2, finished_at = now(), updated_at = now(),
                       lease_owner = null, lease_expires_at = null
     where id = $1";

#[cfg(test)]
mod tests {
    use super::{SELECT_SEEN_EVENTS, SELECT_STORED_KEYS};
    use crate::db::plans::{rows_read, Fresh};

    /// Five keys: `k1` running (a finish may change it), `k2` succeeded and `k3` failed just
    /// now, `k4` succeeded 13 hours ago (past `settled_unlocked!()`, nearer a prune), `k5` unknown
    /// (a person may resolve it). Answers a second connection to the schema, for the other side
    /// of a race.
    async fn five_keys(db: &Fresh) -> deadpool_postgres::Object {
        db.intents(5, "'running'", "g = 1").await;
        db.pg
            .batch_execute(
                "update intents set status = 'succeeded', finished_at = now(),
                                    result = '{\"id\": \"eff\"}'
                  where idempotency_key = 'k2';
                 update intents set status = 'failed', finished_at = now() where idempotency_key = 'k3';
                 update intents set status = 'succeeded', finished_at = now() - interval '13 hours'
                  where idempotency_key = 'k4';
                 update intents set status = 'unknown' where idempotency_key = 'k5';",
            )
            .await
            .expect("statuses");
        let other = crate::db::data_path_pool(&db.cfg).expect("pool");
        other.get().await.expect("connection")
    }

    const KEYS: [&str; 5] = ["k1", "k2", "k3", "k4", "k5"];

    // A repeat's read of its stored key locks what a finish, a resolution or a prune may still
    // change or delete, and only that: another transaction may lock the recently settled keys,
    // and none of the others, while the read's transaction is open.
    #[tokio::test]
    async fn a_repeat_locks_the_keys_still_open_and_reads_the_recently_settled_without() {
        let db = Fresh::new().await;
        let other = five_keys(&db).await;
        db.pg.batch_execute("begin").await.expect("begin");
        let statement = db.pg.prepare(SELECT_STORED_KEYS).await.expect("prepare");
        let rows = db
            .pg
            .query(&statement, &[&KEYS.to_vec()])
            .await
            .expect("read");
        let mut read: Vec<String> = rows.iter().map(|r| r.get("idempotency_key")).collect();
        read.sort();
        assert_eq!(read, KEYS, "every stored key is read");
        let free = other
            .query(
                "select idempotency_key from intents where idempotency_key = any($1)
                  order by id for update skip locked",
                &[&KEYS.to_vec()],
            )
            .await
            .expect("lock");
        let free: Vec<String> = free.iter().map(|r| r.get(0)).collect();
        assert_eq!(
            free,
            ["k2", "k3"],
            "only the keys settled recently are left unlocked"
        );
        db.pg.batch_execute("rollback").await.expect("rollback");
        let half: bool = db
            .pg
            .query_one(
                "select $1::text::interval * 2 <= make_interval(secs => $2)",
                &[
                    &settled_unlocked!(),
                    &(crate::config::MIN_RETENTION.as_secs() as f64),
                ],
            )
            .await
            .expect("compare")
            .get(0);
        assert!(
            half,
            "{} is at most half the shortest retention",
            settled_unlocked!()
        );
        db.drop().await;
    }

    // A repeat of a key whose finish holds its lock waits for the finish, and answers from the
    // finished row, not from the running one its statement began with; the finish's outcome,
    // written to the outbox after the statement began, counts as unpublished, so the repeat is
    // answered behind it (through the outbox), not straight to Kafka ahead of it.
    #[tokio::test]
    async fn a_repeat_of_a_key_being_finished_reads_the_finished_row() {
        let db = Fresh::new().await;
        let finisher = five_keys(&db).await;
        finisher
            .batch_execute(
                "begin;
                 select id from intents where idempotency_key = 'k1' for update;
                 update intents set status = 'succeeded', finished_at = now(),
                                    status_seq = status_seq + 1
                  where idempotency_key = 'k1';
                 insert into outbox (event_id, kafka_key, payload) values ('o1', 'k1', '{}');",
            )
            .await
            .expect("finish begun");
        let statement = db.pg.prepare(SELECT_STORED_KEYS).await.expect("prepare");
        let reader: i32 = db
            .pg
            .query_one("select pg_backend_pid()", &[])
            .await
            .expect("pid")
            .get(0);
        let keys = KEYS.to_vec();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&keys];
        let read = db.pg.query(&statement, &params);
        let commit = async {
            // The read is waiting for the finish's lock once Postgres says so.
            let waits = "select count(*) from pg_locks where pid = $1 and not granted";
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let n: i64 = finisher
                    .query_one(waits, &[&reader])
                    .await
                    .expect("locks")
                    .get(0);
                if n > 0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "the read never waited"
                );
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
            finisher.batch_execute("commit").await.expect("commit");
        };
        let (rows, ()) = tokio::join!(read, commit);
        let rows = rows.expect("read");
        let k1 = rows
            .iter()
            .find(|r| r.get::<_, String>("idempotency_key") == "k1")
            .expect("k1 read");
        assert_eq!(k1.get::<_, String>("status"), "succeeded");
        assert!(
            k1.get::<_, bool>("unpublished"),
            "the finish's outcome is still in the outbox"
        );
        db.drop().await;
    }

    // Every action message's event id is looked up among the deliveries (a redelivered record
    // is told by it), through a hash index since migration 16. A hash index serves
    // `= any($1)` only through a bitmap scan, one probe per id: the data path's generic plan,
    // made while the table was empty, must take it once the deliveries have grown, and read
    // the rows of the ids found, not the table.
    #[tokio::test]
    async fn a_batchs_seen_event_read_probes_the_event_index_for_each_id() {
        let db = Fresh::new().await;
        let prepare = format!("prepare p(text[]) as {SELECT_SEEN_EVENTS}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let ids: Vec<String> = (49_996..50_496).map(|g| format!("e{g}")).collect();
        let batch = format!("execute p('{{{}}}')", ids.join(","));
        let batch = batch.as_str();
        assert!(db.rows(batch).await.is_empty(), "planned on no deliveries");
        db.pg
            .batch_execute(
                "insert into deliveries (intent_id, idempotency_key, action_event_id,
                                         source_topic, source_partition, source_offset,
                                         origin, answered)
                 select g, 'k' || g, 'e' || g, 'actions', 0, g, 'replay', true
                   from generate_series(1, 50000) g",
            )
            .await
            .expect("fill");

        let found = db.rows(batch).await;
        let ids: Vec<&str> = found.iter().map(|r| r[0].1.as_str()).collect();
        assert_eq!(ids.len(), 5, "e49996 to e50000 of 500 ids: {ids:?}");
        let plan = db.explain(batch).await;
        let n = rows_read(&plan, "deliveries");
        assert!(
            n <= 10.0,
            "500 ids, 5 of them among 50,000 deliveries, read {n} deliveries: {plan:#}"
        );
        assert!(
            plan.to_string()
                .contains(r#""Index Name":"deliveries_event""#),
            "the read goes through the event index: {plan:#}"
        );
        db.drop().await;
    }
}
