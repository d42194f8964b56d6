//! `record_batch`: one transaction per consumed batch.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use deadpool_postgres::GenericClient;
use serde_json::Value;
use tokio_postgres::Row;

use crate::config::ToolClass;
use crate::db::DbError;
use crate::gates::{self, count_runs, Counted};
use crate::intent::classify::{self, Arrival, RecordId, Repeat, StoredKey};
use crate::intent::sql::{
    FAILED_REATTEMPTS, INSERT_DELIVERIES, INSERT_INTENTS, INSERT_INTENTS_OPENING_CALLS,
    OPEN_FIRST_CALLS, REJECT_NEW, SELECT_SEEN_EVENTS, SELECT_STORED_KEYS, TOMBSTONED,
};
use crate::intent::Origin;
use crate::intent::{
    BatchResult, Claimant, Incoming, IntentStatus, KeyedAction, KnownKeys, Position,
};
use crate::outcome::answer::{self, KeyState};
use crate::outcome::{ErrorCode, Outcome, OutcomeError, OutcomeStatus};
use crate::publish::outbox::{insert_outbox_prepared, INSERT_OUTBOX_SQL};

#[derive(Default)]
struct DeliveryRows {
    intent_id: Vec<Option<i64>>,
    key: Vec<String>,
    event_id: Vec<String>,
    topic: Vec<String>,
    partition: Vec<i32>,
    offset: Vec<i64>,
    origin: Vec<&'static str>,
    answered: Vec<bool>,
    schema_id: Vec<Option<i32>>,
    /// The status answered straight to Kafka, rather than through the outbox.
    direct: Vec<Option<&'static str>>,
}

impl DeliveryRows {
    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        intent_id: Option<i64>,
        key: &str,
        event_id: &str,
        pos: &Position,
        origin: Origin,
        answered: bool,
    ) {
        self.intent_id.push(intent_id);
        self.key.push(key.to_string());
        self.event_id.push(event_id.to_string());
        self.topic.push(pos.topic.clone());
        self.partition.push(pos.partition);
        self.offset.push(pos.offset);
        self.origin.push(origin.as_str());
        self.answered.push(answered);
        self.schema_id.push(pos.schema_id);
        self.direct.push(None);
    }

    /// Marks the delivery pushed last as answered straight to Kafka, with `status`.
    fn answered_direct(&mut self, status: OutcomeStatus) {
        if let Some(last) = self.direct.last_mut() {
            *last = Some(status.as_str());
        }
    }
}

fn parse_error(v: Option<Value>) -> Option<OutcomeError> {
    v.and_then(|v| serde_json::from_value(v).ok())
}

/// A row of SELECT_STORED_KEYS.
fn stored_key(row: &Row) -> StoredKey {
    let reported = IntentStatus::parse(row.get("status")).and_then(IntentStatus::reported);
    StoredKey {
        id: row.get("id"),
        material_json: row.get("material"),
        fingerprint: row.get("fingerprint"),
        args_hash: row.get("args_hash"),
        reportable: reported.is_some(),
        state: KeyState {
            key: row.get("idempotency_key"),
            run_id: row.get("run_id"),
            step: row.get("step"),
            tool: row.get("tool"),
            status: reported.unwrap_or(OutcomeStatus::Unknown),
            result: row.get("result"),
            error: parse_error(row.get("error")),
            attempts: row.get("attempts"),
            first_event_id: row.get("action_event_id"),
            at: row.get("at"),
        },
        first_record: (
            row.get("source_topic"),
            row.get("source_partition"),
            row.get("source_offset"),
        ),
    }
}

/// The new intents' ids by event id (a key recorded first by another delivery is missing), and
/// the candidates' keys found tombstoned once the insert had run.
type Inserted = (HashMap<String, i64>, HashSet<String>);

/// Inserts the candidate intents in one statement, one array per column; the unique key
/// index decides who is first. `limited`: some of them count against per-run limits, so their
/// first calls are opened only once counted.
///
/// Behind the insert, in the same round trip, the candidates' tombstones are read again. A key
/// being pruned meanwhile is deleted by a transaction that has written its tombstone but not
/// committed: a read before the insert cannot see that tombstone, and the insert waits for the
/// deleting transaction, then finds the key free once it commits. The read after the insert
/// (a statement of its own, so a snapshot taken after that wait) sees the tombstone; a caller
/// that finds one must not commit what it inserted.
async fn insert_intents(
    tx: &impl GenericClient,
    acts: &[&KeyedAction],
    claimant: Claimant<'_>,
    limited: bool,
) -> Result<Inserted, DbError> {
    let col =
        |f: &dyn Fn(&KeyedAction) -> String| acts.iter().map(|a| f(a)).collect::<Vec<String>>();
    let keys = col(&|a| a.key.clone());
    let tools = col(&|a| a.tool.clone());
    let classes = col(&|a| a.class.as_str().to_string());
    let runs = col(&|a| a.event.data.run_id.clone());
    let steps: Vec<Option<i64>> = acts.iter().map(|a| a.event.data.step).collect();
    let business: Vec<Option<String>> = acts
        .iter()
        .map(|a| a.event.data.business_id.clone())
        .collect();
    let args: Vec<Value> = acts
        .iter()
        .map(|a| Value::Object(a.event.data.args.clone()))
        .collect();
    let material: Vec<Value> = acts
        .iter()
        .map(|a| Value::Object(a.material.clone()))
        .collect();
    let fps = col(&|a| a.fingerprint.clone());
    let hashes = col(&|a| a.args_hash.clone());
    let events = col(&|a| a.event.id.clone());
    let topics = col(&|a| a.pos.topic.clone());
    let partitions: Vec<i32> = acts.iter().map(|a| a.pos.partition).collect();
    let offsets: Vec<i64> = acts.iter().map(|a| a.pos.offset).collect();
    let schema_ids: Vec<Option<i32>> = acts.iter().map(|a| a.pos.schema_id).collect();
    let traces: Vec<Option<String>> = acts.iter().map(|a| a.event.traceparent.clone()).collect();
    let times: Vec<Option<DateTime<Utc>>> = acts.iter().map(|a| a.event_time()).collect();
    let statuses: Vec<&str> = acts
        .iter()
        .map(|a| {
            if a.parked_at_record() {
                IntentStatus::PendingApproval
            } else if a.claimed_at_record() {
                IntentStatus::Running
            } else {
                IntentStatus::Pending
            }
            .as_str()
        })
        .collect();
    let seqs: Vec<i32> = acts
        .iter()
        .map(|a| i32::from(a.parked_at_record()))
        .collect();
    let owners: Vec<Option<&str>> = acts
        .iter()
        .map(|a| a.claimed_at_record().then_some(claimant.owner))
        .collect();
    let insert = if limited {
        INSERT_INTENTS
    } else {
        INSERT_INTENTS_OPENING_CALLS
    };
    let (insert, tombstoned) =
        futures::try_join!(tx.prepare_cached(insert), tx.prepare_cached(TOMBSTONED))?;
    // Both prepared, so each goes out when first polled: the insert, then the read.
    let insert_params: [&(dyn tokio_postgres::types::ToSql + Sync); 21] = [
        &keys,
        &tools,
        &classes,
        &runs,
        &steps,
        &business,
        &args,
        &material,
        &fps,
        &hashes,
        &events,
        &topics,
        &partitions,
        &offsets,
        &traces,
        &times,
        &statuses,
        &seqs,
        &owners,
        &claimant.lease_secs,
        &schema_ids,
    ];
    let stale_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&keys];
    let (rows, stale_rows) = futures::try_join!(
        tx.query(&insert, &insert_params),
        tx.query(&tombstoned, &stale_params)
    )?;
    // Read-only rows never conflict, so map returned rows back by event id.
    let ids = rows
        .iter()
        .map(|r| (r.get::<_, String>(2), r.get::<_, i64>(0)))
        .collect();
    Ok((ids, stale_rows.iter().map(|r| r.get("k")).collect()))
}

/// Records one batch of consumed messages in a single transaction, which it opens and commits
/// itself on `tx` (a connection outside any transaction): the `begin` goes out with the first
/// reads and the `commit` with the last writes, two round trips fewer than a transaction
/// object's. On an error the transaction may still be open or aborted: the caller rolls it back
/// (or discards the connection). Only after it commits may the consumer store these messages'
/// offsets.
///
/// A repeat of a key in `known` is read as stored without first being offered to the intent
/// insert. When that read finds the key gone (pruned since it was remembered), the batch's keys
/// are forgotten and the batch recorded again from the start, the usual way: one round more, at
/// most.
pub async fn record_batch(
    tx: &impl GenericClient,
    items: &[Incoming],
    channel: &str,
    claimant: Claimant<'_>,
    known: &KnownKeys,
) -> Result<BatchResult, DbError> {
    loop {
        let recorded = async {
            if let Some(recorded) = record_speculating(tx, items, channel, claimant, known).await? {
                return Ok(recorded);
            }
            // Again only when a key of the batch was pruned while it was recorded
            // (`insert_intents`): the next reading sees that tombstone, so each round has one
            // fewer key to lose this way.
            loop {
                if let Some(recorded) =
                    record_reading_first(tx, items, channel, claimant, known).await?
                {
                    return Ok(recorded);
                }
            }
        };
        match recorded.await {
            Ok(mut recorded) => {
                known.remember(std::mem::take(&mut recorded.recorded_keys));
                return Ok(recorded);
            }
            Err(DbError::Vanished(key)) if known.contains(&key) => {
                tracing::debug!(%key, "a known key is gone (pruned): recorded again");
                tx.batch_execute("rollback").await?;
                // Every key of the batch, not only the one found gone: a run resumed past
                // retention may send many, and each would cost a round. Those still stored are
                // found again through the insert and remembered once more.
                for item in items {
                    if let Incoming::Action(a) = item {
                        known.forget(&a.key);
                    }
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// [`record_batch`]'s long way: what the batch's reads find decides what is inserted. `None`
/// when a key was pruned while the transaction waited to insert it (rolled back).
async fn record_reading_first(
    tx: &impl GenericClient,
    items: &[Incoming],
    channel: &str,
    claimant: Claimant<'_>,
    known: &KnownKeys,
) -> Result<Option<BatchResult>, DbError> {
    let mut rec = Recording::default();
    // 1. Which records and event ids were seen before: redeliveries and producer retries. The
    // reads take no locks and see what is committed, in the transaction or not (read
    // committed), so they need not wait for the `begin`; every write comes after both.
    let seen = crate::db::begin_with(tx, seen_before(tx, items, true)).await?;
    let arrivals = classify::arrivals(items, &seen.records, seen.events);
    let (mut to_insert, mut pending, again) = rec.sort(items, arrivals, &seen.direct, known);
    // 2. Gates that refuse a new key before it is recorded.
    let refused = refuse_before_record(tx, &mut rec, &mut to_insert, &seen.stale).await?;
    // 3. and 4. New intents, and the per-run limits counted with them.
    if !to_insert.is_empty() {
        let limited = limited(&to_insert);
        let (by_event, pruned) = insert_intents(tx, &to_insert, claimant, limited).await?;
        if !pruned.is_empty() {
            tracing::debug!(
                pruned = pruned.len(),
                "keys pruned while recorded: recorded again"
            );
            tx.batch_execute("rollback").await?;
            return Ok(None);
        }
        record_new(tx, &mut rec, &to_insert, by_event, claimant, &mut pending).await?;
    }
    // 5. Repeats, against the stored key, and the direct answers of records read again.
    if !pending.is_empty() || !again.is_empty() {
        let rows = read_keys(tx, &repeated_keys(&pending, &again)).await?;
        answer_repeats(rows, &mut rec, pending, again, &refused)?;
    }
    // 6. and 7. Every delivery and the immediate answers, and the commit.
    rec.write_and_commit(tx, channel).await.map(Some)
}

/// [`record_batch`] one round trip shorter, for the usual batch: nothing in it seen before, no
/// key pruned. The batch is classified as if the reads of seen events and tombstones (step 1)
/// found nothing, and the intent insert that follows from that goes out with them, behind the
/// `begin`: Postgres runs them in that order, as in the longer path, only without waiting for
/// the reads' answers in between. When a read did find something (a redelivery, a producer
/// retry, a pruned key), the insert was built on a wrong premise: the transaction is rolled
/// back and `None` returned, for the longer path. Batches whose gates read the database before
/// the insert (failed reattempts) are not speculated on (`None` at once). A batch of known keys
/// only has nothing to insert: the read of their stored state goes out behind the read of seen
/// events, in the same round trip.
async fn record_speculating(
    tx: &impl GenericClient,
    items: &[Incoming],
    channel: &str,
    claimant: Claimant<'_>,
    known: &KnownKeys,
) -> Result<Option<BatchResult>, DbError> {
    let mut rec = Recording::default();
    let arrivals = classify::arrivals(items, &HashSet::new(), HashSet::new());
    let (mut to_insert, mut pending, again) = rec.sort(items, arrivals, &HashSet::new(), known);
    let reads_before_insert = to_insert.iter().any(|a| a.reattempt_gated());
    if (to_insert.is_empty() && pending.is_empty()) || reads_before_insert {
        return Ok(None);
    }
    // Pure with no tombstone and no failed reattempt: no read.
    let refused = refuse_before_record(tx, &mut rec, &mut to_insert, &HashSet::new()).await?;
    if to_insert.is_empty() && pending.is_empty() {
        return Ok(None);
    }
    let limited = limited(&to_insert);
    let insert = async {
        if to_insert.is_empty() {
            return Ok((HashMap::new(), HashSet::new()));
        }
        insert_intents(tx, &to_insert, claimant, limited).await
    };
    // A batch whose actions are all known keys inserts nothing, so no lock of its own comes
    // before the read of their stored state: that read goes out behind the read of seen events,
    // in the same round trip.
    let keys = if to_insert.is_empty() {
        repeated_keys(&pending, &again)
    } else {
        Vec::new()
    };
    let read = async {
        if keys.is_empty() {
            return Ok(None);
        }
        read_keys(tx, &keys).await.map(Some)
    };
    // The tombstones are read behind the insert only (`insert_intents`), which sees those it
    // would have seen before it too.
    let (seen, (by_event, pruned), read) = crate::db::begin_with(tx, async {
        futures::try_join!(seen_before(tx, items, false), insert, read)
    })
    .await?;
    if !(seen.records.is_empty() && seen.events.is_empty() && pruned.is_empty()) {
        tracing::debug!(
            redelivered = seen.records.len(),
            retried = seen.events.len(),
            pruned = pruned.len(),
            "the batch had been seen in part: recorded again without speculating"
        );
        tx.batch_execute("rollback").await?;
        return Ok(None);
    }
    debug_assert!(
        again.is_empty(),
        "no record is read again when none was seen"
    );
    if !to_insert.is_empty() {
        record_new(tx, &mut rec, &to_insert, by_event, claimant, &mut pending).await?;
    }
    if !pending.is_empty() {
        let rows = match read {
            Some(rows) => rows,
            None => read_keys(tx, &repeated_keys(&pending, &again)).await?,
        };
        answer_repeats(rows, &mut rec, pending, again, &refused)?;
    }
    rec.write_and_commit(tx, channel).await.map(Some)
}

/// Whether any candidate counts against a per-run limit, so its first call is opened only once
/// counted.
fn limited(to_insert: &[&KeyedAction]) -> bool {
    to_insert
        .iter()
        .any(|a| a.gates.max_per_run.is_some() || a.gates.run_cap.is_some())
}

/// What one batch's transaction writes besides its intents, gathered as it is classified.
#[derive(Default)]
struct Recording {
    /// Every message of the batch but a new intent's first (which the intent row carries), so
    /// repeats can be classified and explained later.
    deliveries: DeliveryRows,
    /// Answers sent at once through the outbox: refusals, conflicts, parked and rejected input,
    /// and duplicates of keys with an outcome still unpublished.
    outbox: Vec<Outcome>,
    result: BatchResult,
}

/// Actions sorted by what the batch does with them: candidates to insert, repeats (with the
/// origin they are classified from) that need their key's stored state, and records read again
/// whose first reading was answered straight to Kafka (answered again, under the same id).
type Sorted<'a> = (
    Vec<&'a KeyedAction>,
    Vec<(&'a KeyedAction, Origin)>,
    Vec<&'a KeyedAction>,
);

impl Recording {
    /// A delivery of `a`, counted under its tool and origin.
    fn delivered(&mut self, intent: Option<i64>, a: &KeyedAction, origin: Origin, answered: bool) {
        self.deliveries
            .push(intent, &a.key, &a.event.id, &a.pos, origin, answered);
        self.result.origins.push((a.tool.clone(), origin));
    }

    /// The first delivery of the new intent `id`: carried by the intent row (its event id and
    /// record), so only counted, but for a read-only tool, whose key is not unique: only a row
    /// of its own tells a redelivery of it from a new call (schema migration 13).
    fn first_delivered(&mut self, id: i64, a: &KeyedAction) {
        if a.class == ToolClass::ReadOnly {
            self.delivered(Some(id), a, Origin::First, true);
        } else {
            self.result.origins.push((a.tool.clone(), Origin::First));
        }
    }

    /// A gate refused `a` before it was recorded: answered rejected, its key left unrecorded.
    fn refuse(&mut self, a: &KeyedAction, code: ErrorCode, message: String) {
        let state = a.state(OutcomeStatus::Rejected, Some(code.error(message)));
        self.outbox
            .push(answer::rejected_gate(&state, a.event.traceparent.clone()));
        self.delivered(None, a, Origin::First, true);
        self.result.rejections.push((a.tool.clone(), code.as_str()));
    }

    /// Answers a duplicate of `k` with its stored result: through the outbox behind the key's
    /// own outcomes when one is still `unpublished`, else straight to Kafka (`true`).
    fn answer_duplicate(&mut self, k: &StoredKey, a: &KeyedAction, unpublished: bool) -> bool {
        let answer = answer::duplicate(&k.state, &a.event.id, a.event.traceparent.clone());
        if unpublished {
            self.outbox.push(answer);
        } else {
            self.result.direct.push(answer);
        }
        !unpublished
    }

    /// Logs redeliveries and rejected input (answering the rejected input that can be
    /// answered), and sorts the actions left into candidates and repeats: a candidate whose key
    /// is `known` is a repeat already.
    fn sort<'a>(
        &mut self,
        items: &'a [Incoming],
        arrivals: Vec<Arrival>,
        direct: &HashSet<RecordId>,
        known: &KnownKeys,
    ) -> Sorted<'a> {
        let mut to_insert = Vec::new();
        let mut pending = Vec::new();
        let mut again = Vec::new();
        for (item, arrival) in items.iter().zip(arrivals) {
            match item {
                Incoming::Action(a) => match arrival {
                    // Logged for explain; never executed again. Answered again only when its
                    // answer went straight to Kafka, which may not have acknowledged it.
                    Arrival::Redelivery => {
                        self.delivered(None, a, Origin::Redelivery, true);
                        if direct.contains(&a.pos.record_id()) {
                            again.push(&**a);
                        }
                    }
                    Arrival::ProducerRetry => pending.push((&**a, Origin::ProducerRetry)),
                    // Classified against the stored row, like any later repeat.
                    Arrival::SameKey => pending.push((&**a, Origin::Replay)),
                    // What the insert's conflict would have found.
                    _ if a.may_skip_insert() && known.contains(&a.key) => {
                        pending.push((&**a, Origin::Replay))
                    }
                    // A candidate (the only other verdict an action gets).
                    _ => to_insert.push(&**a),
                },
                Incoming::Rejected {
                    pos,
                    partial,
                    reason,
                    message,
                } => {
                    let key = partial.as_ref().map_or("", |p| p.key.as_str());
                    let event_id = partial.as_ref().map_or("", |p| p.event_id.as_str());
                    let tool = partial.as_ref().and_then(|p| p.tool.clone());
                    if arrival == Arrival::Redelivery {
                        self.deliveries
                            .push(None, key, event_id, pos, Origin::Redelivery, true);
                        self.result
                            .origins
                            .push((String::new(), Origin::Redelivery));
                        continue;
                    }
                    self.deliveries
                        .push(None, key, event_id, pos, Origin::DeadLetter, true);
                    if let (Some(p), Arrival::DeadLetter { answer: true }) = (partial, arrival) {
                        self.outbox.push(answer::rejected_input(
                            p,
                            reason.error_code(),
                            message,
                            None,
                        ));
                    }
                    self.result
                        .origins
                        .push((tool.unwrap_or_default(), Origin::DeadLetter));
                }
            }
        }
        (to_insert, pending, again)
    }

    /// Writes every delivery and the immediate answers, and commits, in one round trip. The
    /// statements are prepared first: each request goes out when its future is first polled, in
    /// order, so the `commit` can only follow them (a statement that fails aborts the
    /// transaction, and the `commit` then rolls it back; the failure is what is returned).
    async fn write_and_commit(
        self,
        tx: &impl GenericClient,
        channel: &str,
    ) -> Result<BatchResult, DbError> {
        let Recording {
            deliveries: d,
            outbox,
            mut result,
        } = self;
        result.answers = result.direct.len();
        let (deliveries_statement, outbox_statement) = futures::try_join!(
            tx.prepare_cached(INSERT_DELIVERIES),
            tx.prepare_cached(INSERT_OUTBOX_SQL)
        )?;
        let record_deliveries = async {
            if d.key.is_empty() {
                return Ok(0);
            }
            tx.execute(
                &deliveries_statement,
                &[
                    &d.intent_id,
                    &d.key,
                    &d.event_id,
                    &d.topic,
                    &d.partition,
                    &d.offset,
                    &d.origin,
                    &d.answered,
                    &d.schema_id,
                    &d.direct,
                ],
            )
            .await
            .map_err(DbError::from)
        };
        let (_, answers) = crate::db::commit_with(tx, async {
            futures::try_join!(
                record_deliveries,
                insert_outbox_prepared(tx, &outbox_statement, &outbox, channel)
            )
        })
        .await?;
        result.answers += answers;
        Ok(result)
    }
}

/// What the database already knows about a batch's messages.
struct Seen {
    /// (topic, partition, offset) of records delivered before: redeliveries.
    records: HashSet<RecordId>,
    /// Those of them answered straight to Kafka.
    direct: HashSet<RecordId>,
    /// Event ids recorded before: producer retries.
    events: HashSet<String>,
    /// Keys pruned past retention that left a tombstone.
    stale: HashSet<String>,
}

/// The records and event ids seen before, and (`tombstones`) the tombstone check of every key,
/// in one round trip.
async fn seen_before(
    tx: &impl GenericClient,
    items: &[Incoming],
    tombstones: bool,
) -> Result<Seen, DbError> {
    let event_ids: Vec<String> = items
        .iter()
        .filter_map(|i| match i {
            Incoming::Action(a) => Some(a.event.id.clone()),
            Incoming::Rejected { partial, .. } => partial.as_ref().map(|p| p.event_id.clone()),
        })
        .collect();
    let action_keys: Vec<&str> = items
        .iter()
        .filter_map(|i| match i {
            Incoming::Action(a) => Some(a.key.as_str()),
            Incoming::Rejected { .. } => None,
        })
        .collect();
    let (seen_statement, tombstoned) = futures::try_join!(
        tx.prepare_cached(SELECT_SEEN_EVENTS),
        tx.prepare_cached(TOMBSTONED)
    )?;
    let (seen_params, stale_params) = ([&event_ids as _], [&action_keys as _]);
    let stale = async {
        if tombstones {
            tx.query(&tombstoned, &stale_params).await
        } else {
            Ok(Vec::new())
        }
    };
    let (seen_rows, stale_rows) =
        futures::try_join!(tx.query(&seen_statement, &seen_params), stale)?;
    let mut seen = Seen {
        records: HashSet::new(),
        direct: HashSet::new(),
        events: HashSet::new(),
        stale: stale_rows.iter().map(|r| r.get("k")).collect(),
    };
    for row in seen_rows {
        let record: RecordId = (
            row.get("source_topic"),
            row.get("source_partition"),
            row.get("source_offset"),
        );
        if row.get::<_, bool>("answered_direct") {
            seen.direct.insert(record.clone());
        }
        seen.records.insert(record);
        seen.events.insert(row.get("action_event_id"));
    }
    Ok(seen)
}

/// Refuses new keys before they are recorded: a pruned key coming back (a run resumed past
/// retention), and too many failed attempts at the same business action. A refused key is not
/// recorded, so a repeat of it later in the batch gets the same refusal (`answer_repeats`).
async fn refuse_before_record<'a>(
    tx: &impl GenericClient,
    rec: &mut Recording,
    to_insert: &mut Vec<&'a KeyedAction>,
    stale: &HashSet<String>,
) -> Result<HashMap<&'a str, (ErrorCode, String)>, DbError> {
    let mut refused = HashMap::new();
    if to_insert.is_empty() {
        return Ok(refused);
    }
    let reattempt_keys: Vec<&KeyedAction> = to_insert
        .iter()
        .copied()
        .filter(|a| a.reattempt_gated())
        .collect();
    let mut failed: HashMap<(String, String, String), i64> = HashMap::new();
    if !reattempt_keys.is_empty() {
        let runs: Vec<&str> = reattempt_keys
            .iter()
            .map(|a| a.event.data.run_id.as_str())
            .collect();
        let tools: Vec<&str> = reattempt_keys.iter().map(|a| a.tool.as_str()).collect();
        let biz: Vec<&str> = reattempt_keys
            .iter()
            .map(|a| a.event.data.business_id.as_deref().unwrap_or(""))
            .collect();
        for r in tx.query(FAILED_REATTEMPTS, &[&runs, &tools, &biz]).await? {
            failed.insert(
                (r.get("run_id"), r.get("tool"), r.get("business_id")),
                r.get("failed"),
            );
        }
    }
    to_insert.retain(|&a| {
        let failed_before = a.event.data.business_id.as_ref().and_then(|b| {
            failed
                .get(&(a.event.data.run_id.clone(), a.tool.clone(), b.clone()))
                .copied()
        });
        let refusal = gates::refusal(
            &a.key,
            &a.tool,
            a.event.data.business_id.as_deref(),
            &a.gates,
            stale.contains(&a.key),
            failed_before,
        );
        let Some((code, message)) = refusal else {
            return true;
        };
        refused.insert(a.key.as_str(), (code, message.clone()));
        rec.refuse(a, code, message);
        false
    });
    Ok(refused)
}

/// Follows the candidates' insert (`by_event`, from [`insert_intents`]: the unique key index
/// decided who is first; a key recorded first by another delivery becomes a repeat), then
/// counts per-run limits with the insert: the N+1-th distinct intent is refused. Intents that
/// need a person's approval are recorded parked and answered as such.
async fn record_new<'a>(
    tx: &impl GenericClient,
    rec: &mut Recording,
    to_insert: &[&'a KeyedAction],
    by_event: HashMap<String, i64>,
    claimant: Claimant<'_>,
    pending: &mut Vec<(&'a KeyedAction, Origin)>,
) -> Result<(), DbError> {
    // Without per-run limits nothing refuses a claimed row once inserted: its first call is
    // opened by the insert itself.
    let limited = limited(to_insert);
    let mut recorded: Vec<(&KeyedAction, i64)> = Vec::new();
    for &a in to_insert {
        match by_event.get(&a.event.id) {
            Some(id) => {
                rec.first_delivered(*id, a);
                if a.class != ToolClass::ReadOnly {
                    rec.result.recorded_keys.push(a.key.clone());
                }
                recorded.push((a, *id));
            }
            None => pending.push((a, Origin::Replay)),
        }
    }

    let counted: Vec<Counted> = recorded
        .iter()
        .map(|(a, id)| Counted {
            id: *id,
            run_id: &a.event.data.run_id,
            tool: &a.tool,
            class: a.class,
            gates: &a.gates,
        })
        .collect();
    let over = count_runs(tx, &counted).await?;
    for (a, id) in recorded {
        if let Some(message) = over.get(&id) {
            let error = ErrorCode::RunLimitExceeded.error(message.clone());
            tx.execute(
                REJECT_NEW,
                &[&id, &serde_json::to_value(&error).expect("serializes")],
            )
            .await?;
            let state = a.state(OutcomeStatus::Rejected, Some(error));
            rec.outbox.push(answer::status_change(
                &state,
                1,
                a.event.traceparent.clone(),
            ));
            rec.result
                .rejections
                .push((a.tool.clone(), ErrorCode::RunLimitExceeded.as_str()));
        } else if a.parked_at_record() {
            let state = a.state(OutcomeStatus::PendingApproval, None);
            rec.outbox.push(answer::status_change(
                &state,
                1,
                a.event.traceparent.clone(),
            ));
        } else if a.claimed_at_record() {
            rec.result.claimed.push(a.claimed(id, claimant.since));
        } else {
            rec.result.new_intents.push((id, a.tool.clone()));
        }
    }
    let claimed = &rec.result.claimed;
    if limited && !claimed.is_empty() {
        let ids: Vec<i64> = claimed.iter().map(|c| c.id).collect();
        let keys: Vec<&str> = claimed.iter().map(|c| c.key.as_str()).collect();
        tx.execute(
            &tx.prepare_cached(OPEN_FIRST_CALLS).await?,
            &[&ids, &keys, &claimant.owner],
        )
        .await?;
    }
    Ok(())
}

/// The stored state of `keys`, those not settled recently under a share lock
/// (`SELECT_STORED_KEYS`).
async fn read_keys(tx: &impl GenericClient, keys: &[&str]) -> Result<Vec<Row>, DbError> {
    let statement = tx.prepare_cached(SELECT_STORED_KEYS).await?;
    Ok(tx.query(&statement, &[&keys]).await?)
}

/// The keys [`answer_repeats`] reads: the repeats' and those of records read again.
fn repeated_keys<'a>(
    pending: &[(&'a KeyedAction, Origin)],
    again: &[&'a KeyedAction],
) -> Vec<&'a str> {
    pending
        .iter()
        .map(|(a, _)| a.key.as_str())
        .chain(again.iter().map(|a| a.key.as_str()))
        .collect()
}

/// Compares each repeat with its stored key (`rows`, from [`read_keys`]) and answers it now, or
/// leaves it to be answered when the key resolves. A duplicate of a key whose outcomes are all
/// published is answered straight to Kafka (its offset waits for the acknowledgement);
/// otherwise through the outbox, behind the key's own outcomes. `again`: records read again
/// whose first answer went straight to Kafka, answered again under the same event id.
fn answer_repeats(
    rows: Vec<Row>,
    rec: &mut Recording,
    pending: Vec<(&KeyedAction, Origin)>,
    again: Vec<&KeyedAction>,
    refused: &HashMap<&str, (ErrorCode, String)>,
) -> Result<(), DbError> {
    let mut existing: HashMap<String, StoredKey> = HashMap::new();
    let mut unpublished: HashSet<String> = HashSet::new();
    for row in rows {
        let stored = stored_key(&row);
        if row.get::<_, bool>("unpublished") {
            unpublished.insert(stored.state.key.clone());
        }
        rec.result.recorded_keys.push(stored.state.key.clone());
        existing.insert(stored.state.key.clone(), stored);
    }
    for a in again {
        match existing.get(&a.key) {
            Some(k) if k.reportable => {
                rec.answer_duplicate(k, a, unpublished.contains(&a.key));
            }
            // Pruned since (past retention), or never settled: nothing to answer from.
            _ => {
                tracing::debug!(key = %a.key, "a record read again has no settled key to answer from")
            }
        }
    }
    for (a, hint) in pending {
        let stored = existing.get(&a.key);
        match classify::repeat(hint, a, stored, refused.get(a.key.as_str())) {
            // The first delivery of this event id is answered already.
            Repeat::ProducerRetry { intent } => {
                rec.delivered(intent, a, Origin::ProducerRetry, true)
            }
            // The record the key was first recorded from: logged, like any redelivery.
            Repeat::Redelivery => rec.delivered(None, a, Origin::Redelivery, true),
            Repeat::Refused { code, message } => rec.refuse(a, code, message.to_string()),
            // Recorded again from the start rather than leave it unanswered.
            Repeat::Vanished => return Err(DbError::Vanished(a.key.clone())),
            Repeat::Conflict { stored: k, fields } => {
                rec.delivered(Some(k.id), a, Origin::Conflict, true);
                rec.outbox.push(answer::conflict(
                    &k.state,
                    &a.event.id,
                    a.event.data.step,
                    fields,
                    a.event.traceparent.clone(),
                ));
            }
            Repeat::Duplicate {
                stored: k,
                origin,
                answered,
            } => {
                rec.delivered(Some(k.id), a, origin, answered);
                if answered && rec.answer_duplicate(k, a, unpublished.contains(&a.key)) {
                    rec.deliveries.answered_direct(k.state.status);
                }
            }
        }
    }
    Ok(())
}
