//! Outbox rows: written with the state change they announce, read by the publisher, and
//! dequeued (`outbox_pending`) once Kafka acknowledged them.

use deadpool_postgres::GenericClient;
use deadpool_postgres::Transaction;

use crate::db::{DbError, JsonbText};
use crate::intent::sql::INSERT_OUTBOX;
use crate::outcome::Outcome;

/// The LISTEN/NOTIFY channel of one schema's outbox.
pub fn outbox_channel(schema: &str) -> String {
    format!("idem_outbox_{schema}")
}

pub(crate) use crate::intent::sql::INSERT_OUTBOX as INSERT_OUTBOX_SQL;

pub(crate) async fn insert_outbox(
    tx: &Transaction<'_>,
    outcomes: &[Outcome],
    channel: &str,
) -> Result<usize, DbError> {
    let statement = tx.prepare_cached(INSERT_OUTBOX).await?;
    insert_outbox_prepared(tx, &statement, outcomes, channel).await
}

/// [`insert_outbox`] with its statement prepared (`INSERT_OUTBOX_SQL`): the request goes out
/// when the future is first polled.
pub(crate) async fn insert_outbox_prepared(
    tx: &impl deadpool_postgres::GenericClient,
    statement: &tokio_postgres::Statement,
    outcomes: &[Outcome],
    channel: &str,
) -> Result<usize, DbError> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    let (ids, keys, payloads, traces) = columns(outcomes);
    let row = tx
        .query_one(statement, &[&ids, &keys, &payloads, &traces, &channel])
        .await?;
    Ok(row.get::<_, i64>(0) as usize)
}

/// The outbox insert's parameters, one array per column: event ids, Kafka keys, payloads (as
/// serialized), trace contexts.
type Columns<'a> = (
    Vec<&'a str>,
    Vec<&'a str>,
    Vec<JsonbText<'a>>,
    Vec<Option<&'a str>>,
);

fn columns(outcomes: &[Outcome]) -> Columns<'_> {
    (
        outcomes.iter().map(|o| o.event_id.as_str()).collect(),
        outcomes.iter().map(|o| o.key.as_str()).collect(),
        outcomes.iter().map(|o| JsonbText(&o.payload)).collect(),
        outcomes.iter().map(|o| o.traceparent.as_deref()).collect(),
    )
}

/// Writes outcome events to the outbox without a NOTIFY, for rows the caller hands to the
/// publishers once its transaction committed: the id of each row written, by event id (an
/// event already in the outbox is not written again, and not returned). The request goes out
/// when the future is first polled; `statement` is `INSERT_OUTBOX_HANDED_SQL`, prepared.
pub(crate) async fn insert_outbox_handed(
    client: &impl deadpool_postgres::GenericClient,
    statement: &tokio_postgres::Statement,
    outcomes: &[Outcome],
) -> Result<Vec<(i64, String)>, DbError> {
    if outcomes.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, keys, payloads, traces) = columns(outcomes);
    Ok(client
        .query(statement, &[&ids, &keys, &payloads, &traces])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

pub(crate) use crate::intent::sql::INSERT_OUTBOX_HANDED as INSERT_OUTBOX_HANDED_SQL;

/// The outbox rows that `written` (from [`insert_outbox_handed`]) says were written, built from
/// the outcomes they were written from, in the order written.
pub(crate) fn written_rows(outcomes: Vec<Outcome>, written: Vec<(i64, String)>) -> Vec<OutboxRow> {
    let mut by_event: std::collections::HashMap<String, Outcome> = outcomes
        .into_iter()
        .map(|o| (o.event_id.clone(), o))
        .collect();
    written
        .into_iter()
        .filter_map(|(id, event_id)| {
            let o = by_event.remove(&event_id)?;
            Some(OutboxRow {
                id,
                live: true,
                event_id: o.event_id,
                key: o.key,
                payload: o.payload,
                traceparent: o.traceparent,
                written_here: true,
                follows: o.follows,
            })
        })
        .collect()
}

#[derive(Debug)]
pub struct OutboxRow {
    pub id: i64,
    /// Still to publish; `false` for a queued row another relay published or quarantined.
    pub live: bool,
    pub event_id: String,
    pub key: String,
    /// The CloudEvent's JSON: as the outcome was serialized for a row handed over; for a row
    /// read from the queue, as Postgres writes the stored `jsonb` (its own key order) made
    /// compact again ([`compact`]).
    pub payload: String,
    pub traceparent: Option<String>,
    /// Handed over from the [`Outcome`] it was written from, so its CloudEvents id and subject
    /// are `event_id` and `key` (and the other attributes idem's own); a row read from the
    /// queue may have been written by hand, and its headers are read from its JSON.
    pub written_here: bool,
    /// Handed over from a status change after its key's first ([`Outcome::follows`]): sent only
    /// once no earlier row of its key waits in the queue. (A round reading the queue checks
    /// every row it reads.)
    pub follows: bool,
}

// The oldest queued rows (schema migration 9), locked; a queued row whose outbox row is already
// published or quarantined (by a relay of an earlier version) comes back too, `live` false, so
// the round drops it from the queue.
//
// The queue's ids are read first, then their outbox rows by id, so the read costs the rows it
// returns whatever the planner estimates: as a join, the generic plan starts from the outbox
// once the queue holds about a quarter of it (a backlog while Kafka was down) and every round
// walks the published rows in id order before reaching a queued one. The queue's rows are
// locked too (two relays' rounds take disjoint ids) and the outbox rows still are (relays of
// the previous version lock those alone).
//
// A key's outcomes go out in the order they were written (ids: a key's rows are written under
// its intent's lock, so its ids follow the commits; a read-only tool's calls share a key but
// not an intent, and answer different action events, which are not ordered with each other:
// holding them back too costs nothing). The rows another round holds are skipped
// (`held`: queued before this round's last, not this round's), and this round's later rows of
// the same keys come back `behind`: the round leaves them queued (locked until its commit) for
// a later round. Sent now, they could overtake the held row (that round's send failed and puts
// it back, or it sends after this one). The held rows' keys are read once, by id; usually
// nothing is held and that is a read of the queue's ids this round locked already. `held` has
// a row per key, so the outer join finds a row's in one probe, not a walk of `held` per row.
const SELECT_UNPUBLISHED: &str = "
    with mine as materialized (
             select id from outbox_pending order by id limit $1 for update skip locked),
         held as materialized (
             select o.kafka_key, min(o.id) as first
               from outbox o
              where o.id = any(array(
                    select id from outbox_pending where id < (select max(id) from mine)
                    except select id from mine))
              group by o.kafka_key)
    select o.id, o.event_id, o.kafka_key, o.payload::text as payload, o.traceparent,
           o.published_at is null and o.quarantined_at is null as live,
           coalesce(h.first < o.id, false) as behind
      from outbox o left join held h on h.kafka_key = o.kafka_key
     where o.id = any(array(select id from mine))
     order by o.id
       for update of o skip locked";

// Published: out of the queue. The outbox row itself is not written (migration 11): an update
// of a wide row that is not HOT, it rewrote the outcome and every index entry.
const DEQUEUE: &str = "delete from outbox_pending where id = any($1)";

// Handed rows (`publish::handoff`) taken out of the queue before they are sent, so the row
// locks of the delete keep every other round off them until the commit: the rows returned are
// this round's to send. Rows another round holds are skipped, not waited for; rows already out
// of the queue (another round published them) are not returned.
const DEQUEUE_HANDED: &str = "
    delete from outbox_pending
     where id = any(array(select id from outbox_pending where id = any($1)
                           for update skip locked))
    returning id";

// Of the keys of handed rows that follow an earlier status change ($1), those with a queued row
// before this round's last row ($3) that is not this round's ($2): that row goes first, so the
// round leaves these keys' rows queued. By the key's index: a key has a row per status change
// and per repeat answered through the outbox.
const KEYS_BEHIND: &str = "
    select distinct o.kafka_key
      from outbox o
     where o.kafka_key = any($1) and o.id < $3 and o.id <> all($2)
       and exists (select 1 from outbox_pending p where p.id = o.id)";

// Handed rows taken out of the queue that Kafka did not acknowledge: back in, for a poll.
const REQUEUE: &str =
    "insert into outbox_pending (id) select unnest($1::int8[]) on conflict do nothing";

const QUARANTINE: &str = "
    with dequeued as (delete from outbox_pending where id = $1)
    update outbox set quarantined_at = now(), quarantine_reason = $2 where id = $1";

/// Sets aside an outbox row the producer refuses for good, with the reason.
pub async fn quarantine(client: &impl GenericClient, id: i64, reason: &str) -> Result<(), DbError> {
    client.execute(QUARANTINE, &[&id, &reason]).await?;
    Ok(())
}

/// How many outbox rows wait to be published (the queue's length), and the age of the oldest
/// (the first of the queue's oldest hundred ids that is still to publish). The outbox is read
/// by id only, whatever the planner estimates (see `SELECT_UNPUBLISHED`).
pub(crate) const OUTBOX_LAG: &str = "
    select (select count(*) from outbox_pending),
           coalesce(extract(epoch from now() - (
               select min(o.created_at) from outbox o
                where o.id = any(array(select id from outbox_pending order by id limit 100))
                  and o.published_at is null and o.quarantined_at is null))::float8, 0)";

/// Drops from the head of the queue ids whose outbox row is gone (deleted by hand, or pruned
/// before a relay that knows the queue met it): the publisher reads the queue's oldest ids
/// first, so enough of them would fill its every round. Only the oldest thousand are looked
/// at, and none is locked but those deleted, so rows that are there keep their order.
///
/// Each id is looked up in the outbox by a scalar subquery, run per id, which the planner
/// cannot turn into a join. As a `not exists`, the plan depended on the tables' statistics: with
/// those of a small outbox (a new schema's, until its first analyze) it was a merge join walking
/// the outbox's primary key from its start to the newest queued id (100,000 rows, 29 ms, for
/// ten queued ids), every two seconds.
pub(crate) const DROP_ORPHANS: &str = "
    delete from outbox_pending
     where id = any(array(
           select p.id from (select id from outbox_pending order by id limit 1000) p
            where (select true from outbox o where o.id = p.id) is null))";

/// Vacuums the queue of unpublished rows, so the publisher's reads do not walk the entries of
/// rows published since (autovacuum visits a table at most once a minute): its index always
/// (`index_cleanup`), never truncating (an exclusive lock), and not at all while another
/// vacuum holds the table (`skip_locked`). Refused with a warning, and harmless, when the
/// relay's role does not own the table.
pub(crate) const VACUUM_QUEUE: &str =
    "vacuum (skip_locked, truncate false, index_cleanup on) outbox_pending";

/// The statements of a publisher's round, prepared on its connection so its transaction can
/// send its `begin` with the select and its `commit` with the dequeue.
pub(crate) struct RoundStatements {
    select: tokio_postgres::Statement,
    dequeue: tokio_postgres::Statement,
    dequeue_handed: tokio_postgres::Statement,
    requeue: tokio_postgres::Statement,
    keys_behind: tokio_postgres::Statement,
}

impl RoundStatements {
    pub(crate) async fn prepare(client: &impl GenericClient) -> Result<Self, DbError> {
        let (select, dequeue, dequeue_handed, requeue, keys_behind) = futures::try_join!(
            client.prepare_cached(SELECT_UNPUBLISHED),
            client.prepare_cached(DEQUEUE),
            client.prepare_cached(DEQUEUE_HANDED),
            client.prepare_cached(REQUEUE),
            client.prepare_cached(KEYS_BEHIND)
        )?;
        Ok(RoundStatements {
            select,
            dequeue,
            dequeue_handed,
            requeue,
            keys_behind,
        })
    }

    /// The keys among `rows`' (handed rows) that must wait: a row of theirs [`OutboxRow::follows`]
    /// an earlier status change, and a row of the key before `rows`' last, not one of them, is
    /// still queued. No statement when no row follows another.
    pub(crate) async fn keys_behind(
        &self,
        client: &impl GenericClient,
        rows: &[OutboxRow],
    ) -> Result<std::collections::HashSet<String>, DbError> {
        let keys: std::collections::HashSet<&str> = rows
            .iter()
            .filter(|r| r.follows)
            .map(|r| r.key.as_str())
            .collect();
        if keys.is_empty() {
            return Ok(Default::default());
        }
        let keys: Vec<&str> = keys.into_iter().collect();
        let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
        let last = ids.iter().copied().max().unwrap_or_default();
        Ok(client
            .query(&self.keys_behind, &[&keys, &ids, &last])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect())
    }

    /// Takes handed rows out of the queue, locked until the commit: the ids this round may
    /// send (not those another round holds or published already).
    pub(crate) async fn dequeue_handed(
        &self,
        client: &impl GenericClient,
        ids: &[i64],
    ) -> Result<std::collections::HashSet<i64>, DbError> {
        Ok(client
            .query(&self.dequeue_handed, &[&ids])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect())
    }

    /// Puts ids taken out by [`Self::dequeue_handed`] back in the queue. The request goes out
    /// when the future is first polled.
    pub(crate) async fn requeue(
        &self,
        client: &impl GenericClient,
        ids: &[i64],
    ) -> Result<(), DbError> {
        if !ids.is_empty() {
            client.execute(&self.requeue, &[&ids]).await?;
        }
        Ok(())
    }

    /// Locks up to `limit` unpublished rows, oldest first, skipping those another round holds:
    /// the rows to send, and how many were left queued behind a held row of their key.
    pub(crate) async fn unpublished(
        &self,
        client: &impl GenericClient,
        limit: i64,
    ) -> Result<(Vec<OutboxRow>, usize), DbError> {
        let read = client.query(&self.select, &[&limit]).await?;
        let (behind, rows): (Vec<_>, Vec<_>) = read.iter().partition(|r| r.get("behind"));
        let rows = rows
            .iter()
            .map(|r| OutboxRow {
                id: r.get("id"),
                live: r.get("live"),
                event_id: r.get("event_id"),
                key: r.get("kafka_key"),
                payload: compact(r.get("payload")),
                traceparent: r.get("traceparent"),
                written_here: false,
                follows: false,
            })
            .collect();
        Ok((rows, behind.len()))
    }

    /// Drops rows from the queue: those Kafka acknowledged, which makes them published, and
    /// the queued rows found published or quarantined already. The request goes out when the
    /// future is first polled.
    pub(crate) async fn dequeue(
        &self,
        client: &impl GenericClient,
        ids: &[i64],
    ) -> Result<(), DbError> {
        client.execute(&self.dequeue, &[&ids]).await?;
        Ok(())
    }
}

/// `json` without the whitespace between its tokens, the rest unchanged. Postgres writes a
/// `jsonb` with a space after every `:` and `,`: an outcome read back from the queue goes out
/// no larger than it was written, as the producer's batches are sized for.
pub(crate) fn compact(json: &str) -> String {
    let mut out = String::with_capacity(json.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in json.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if matches!(c, ' ' | '\t' | '\n' | '\r') {
            continue;
        } else if c == '"' {
            in_string = true;
        }
        out.push(c);
    }
    out
}

pub async fn outbox_lag(
    client: &impl tokio_postgres::GenericClient,
) -> Result<(i64, f64), DbError> {
    let row = client.query_one(OUTBOX_LAG, &[]).await?;
    Ok((row.get(0), row.get(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compact_json_keeps_every_token_and_drops_only_the_space_between_them() {
        use proptest::prelude::*;
        // Spaces, quotes, backslashes and the structural characters inside strings and keys.
        let values = crate::arbitrary::json("[ \"\\\\\t\na-z:,{}\\[\\]]*");
        proptest!(|(v in values)| {
            let spaced = serde_json::to_string_pretty(&v).unwrap();
            prop_assert_eq!(compact(&spaced), serde_json::to_string(&v).unwrap());
        });
        assert_eq!(
            compact(r#"{"a": "x, \"y\": z", "b": [1, 2]}"#),
            r#"{"a":"x, \"y\": z","b":[1,2]}"#
        );
    }

    // Two rounds in a backlog (two relays, or a relay's two publishers): the second finds the
    // queue's head held by the first. It takes the next rows, leaves queued those whose keys
    // have a held row before them, and reads the held rows' keys once, by id, not once for each
    // of its own rows.
    #[tokio::test]
    async fn a_round_behind_a_held_head_holds_back_those_keys_and_reads_the_head_once() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        let prepare = format!("prepare s(int8) as {SELECT_UNPUBLISHED}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        db.rows("begin; execute s(1000); rollback").await;
        // 3,000 queued rows; row g has key k(g mod 1500), so the first 1,500 and the next
        // share keys. The holder takes the first 1,000, keys k1..k1000.
        db.pg
            .batch_execute(
                "insert into outbox (event_id, kafka_key, payload)
                 select 'o' || g, 'k' || (g % 1500), '{}' from generate_series(1, 3000) g",
            )
            .await
            .expect("fill");
        let holder = crate::db::data_path_pool(&db.cfg)
            .expect("pool")
            .get()
            .await
            .expect("connection");
        holder
            .batch_execute("begin; select id from outbox_pending order by id limit 1000 for update")
            .await
            .expect("hold");

        let read = db.rows("begin; execute s(1000); rollback").await;
        let key = |r: &Vec<(String, String)>| -> i64 { r[2].1[1..].parse().expect("k<n>") };
        // Rows 1,001–2,000: those of keys k1..k500 (rows 1,501–2,000 but 1,500's k0) wait.
        let (behind, sent): (Vec<_>, Vec<_>) = read.iter().partition(|r| r[6].1 == "t");
        assert_eq!(sent.len(), 500, "rows 1,001–1,499 and 1,500");
        assert!(sent.iter().all(|r| !(1..=1000).contains(&key(r))));
        assert!(behind.iter().all(|r| (1..=500).contains(&key(r))));
        assert_eq!(behind.len(), 500);
        let plan = db.explain("execute s(1000)").await;
        let n = rows_read(&plan, "outbox");
        assert!(
            n <= 2_100.0,
            "a round behind 1,000 held rows read {n} outbox rows for its 1,000: {plan:#}"
        );
        holder.batch_execute("rollback").await.expect("let go");
        db.drop().await;
    }

    // The publisher drops orphans (queued ids without an outbox row) every two seconds. A plan
    // made on a new schema's empty outbox, run once the outbox has grown (statistics that lag
    // the table), must still look up only the queue's head.
    #[tokio::test]
    async fn dropping_orphans_reads_the_queue_head_whatever_the_outbox_held_at_planning() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        let prepare = format!("prepare d as {DROP_ORPHANS}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        db.rows("begin; execute d; rollback").await;
        // Twenty thousand outcomes, all but the last ten published; five orphans at the head.
        db.pg
            .batch_execute(
                "insert into outbox (event_id, kafka_key, payload)
                 select 'o' || g, 'k' || g, '{}' from generate_series(1, 20000) g;
                 delete from outbox_pending
                  where id not in (select id from outbox order by id desc limit 10);
                 insert into outbox_pending (id) select -g from generate_series(1, 5) g;",
            )
            .await
            .expect("fill");

        let left = db
            .rows("begin; execute d; select count(*) as n from outbox_pending; rollback")
            .await;
        assert_eq!(
            left[0][0].1, "10",
            "the five orphans dropped, the ten queued kept"
        );
        let plan = db.explain("execute d").await;
        let n = rows_read(&plan, "outbox");
        assert!(
            n <= 15.0,
            "dropping orphans read {n} outbox rows for 15 queued: {plan:#}"
        );
        db.drop().await;
    }

    // Handed rows whose keys follow an earlier status change ask which of those keys still
    // have an earlier row queued, through the outbox's index by key. The generic plan, made on
    // an empty outbox, must probe the index for the keys asked, not walk the outbox's ids below
    // the round's last (as it did with a hash index on the key, a draft of stop 44).
    #[tokio::test]
    async fn a_rounds_keys_behind_are_found_by_key_whatever_the_outbox_held_at_planning() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        let prepare = format!("prepare b(text[], int8[], int8) as {KEYS_BEHIND}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let ask = "execute b('{k1,k2,k3}', '{}', 1)";
        assert!(db.rows(ask).await.is_empty(), "planned on an empty outbox");
        // 20,000 outcomes of 10,000 keys (two each, ids g and g + 10,000), all queued.
        db.pg
            .batch_execute(
                "insert into outbox (event_id, kafka_key, payload)
                 select 'o' || g, 'k' || ((g - 1) % 10000 + 1), '{}'
                   from generate_series(1, 20000) g",
            )
            .await
            .expect("fill");

        // 100 keys handed with their second rows (ids 10,001–10,100), the round's last 10,100.
        let keys: Vec<String> = (1..=100).map(|k| format!("k{k}")).collect();
        let ids: Vec<String> = (10_001..=10_100).map(|i| i.to_string()).collect();
        let ask = format!(
            "execute b('{{{}}}', '{{{}}}', 10100)",
            keys.join(","),
            ids.join(",")
        );
        let behind = db.rows(&ask).await;
        assert_eq!(behind.len(), 100, "each key's first row is queued before");
        let plan = db.explain(&ask).await;
        let n = rows_read(&plan, "outbox");
        assert!(
            n <= 250.0,
            "100 keys' rows read {n} outbox rows (20,000 queued, 10,100 below the last): {plan:#}"
        );
        db.drop().await;
    }
}
