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

// Share locks order this batch against a concurrent finish of the same keys: either the finish
// commits first and we see its status, or it waits and then sees our waiting deliveries. Every
// statement that locks several intents locks them in id order, so they cannot deadlock.
//
// `unpublished` may be planned as one pass over the queue of unpublished outcomes (and their
// outbox rows) per statement, or as a probe per key. A pass is cheaper while the queue is short
// (3.0 ms for 500 keys, against 4.4 ms probing); the publisher vacuums the queue every two
// seconds, and each vacuum makes every connection plan the statement again for the queue's new
// length, so a backlog turns the plan into probes within seconds (62 ms for 500 keys with
// 100,000 ids queued and the old plan, 4–11 ms once planned again).
pub(crate) const SELECT_KEYS_FOR_SHARE: &str = "
    select id, idempotency_key, material::text as material, fingerprint, args_hash,
           action_event_id, source_topic, source_partition, source_offset, status, result,
           error, attempts, run_id, step, tool,
           coalesce(finished_at, updated_at) as at,
           exists (select 1 from outbox o
                    where o.kafka_key = intents.idempotency_key
                      and o.published_at is null and o.quarantined_at is null
                      and exists (select 1 from outbox_pending p where p.id = o.id))
             as unpublished
    from intents
    where idempotency_key = any($1) and class <> 'read_only'
    order by id
    for share";

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
    use super::SELECT_SEEN_EVENTS;
    use crate::db::plans::{rows_read, Fresh};

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
