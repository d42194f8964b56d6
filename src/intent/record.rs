//! `record_batch`: one transaction per consumed batch.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use deadpool_postgres::Transaction;
use serde_json::Value;
use tokio_postgres::Row;

use crate::db::DbError;
use crate::gates::{self, count_runs, Counted};
use crate::intent::classify::{self, Arrival, Repeat, StoredKey};
use crate::intent::sql::{
    FAILED_REATTEMPTS, INSERT_DELIVERIES, INSERT_INTENTS, INSERT_INTENTS_OPENING_CALLS,
    OPEN_FIRST_CALLS, REJECT_NEW, SELECT_KEYS_FOR_SHARE, SELECT_SEEN_EVENTS, TOMBSTONED,
};
use crate::intent::Origin;
use crate::intent::{BatchResult, Claimant, Incoming, IntentStatus, KeyedAction, Position};
use crate::outcome::answer::{self, KeyState};
use crate::outcome::{ErrorCode, Outcome, OutcomeError, OutcomeStatus};
use crate::publish::outbox::insert_outbox;

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
    }
}

fn parse_error(v: Option<Value>) -> Option<OutcomeError> {
    v.and_then(|v| serde_json::from_value(v).ok())
}

/// A row of SELECT_KEYS_FOR_SHARE.
fn stored_key(row: &Row) -> StoredKey {
    let reported = IntentStatus::parse(row.get("status")).and_then(IntentStatus::reported);
    StoredKey {
        id: row.get("id"),
        material: row.get("material"),
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
    }
}

/// Inserts the candidate intents in one statement, one array per column; the unique key
/// index decides who is first. `limited`: some of them count against per-run limits, so their
/// first calls are opened only once counted. Returns the new intents' ids by event id (a key
/// recorded first by another delivery is missing).
async fn insert_intents(
    tx: &Transaction<'_>,
    acts: &[&KeyedAction],
    claimant: Claimant<'_>,
    limited: bool,
) -> Result<HashMap<String, i64>, DbError> {
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
    let rows = tx
        .query(
            &tx.prepare_cached(insert).await?,
            &[
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
            ],
        )
        .await?;
    // Read-only rows never conflict, so map returned rows back by event id.
    Ok(rows
        .iter()
        .map(|r| (r.get::<_, String>(2), r.get::<_, i64>(0)))
        .collect())
}

/// Records one batch of consumed messages in a single transaction. Only after it commits may the
/// consumer store these messages' offsets.
pub async fn record_batch(
    tx: &Transaction<'_>,
    items: &[Incoming],
    channel: &str,
    claimant: Claimant<'_>,
) -> Result<BatchResult, DbError> {
    let mut result = BatchResult::default();
    let pos_of = |i: &Incoming| match i {
        Incoming::Action(a) => a.pos.clone(),
        Incoming::Rejected { pos, .. } => pos.clone(),
    };
    let event_id_of = |i: &Incoming| match i {
        Incoming::Action(a) => Some(a.event.id.clone()),
        Incoming::Rejected { partial, .. } => partial.as_ref().map(|p| p.event_id.clone()),
    };

    // 1. Which records and event ids were seen before: redeliveries and producer retries.
    //    Sent together with the tombstone check of every key (step 2), in one round trip.
    let event_ids: Vec<String> = items.iter().filter_map(event_id_of).collect();
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
    let (seen_rows, stale_rows) = futures::try_join!(
        tx.query(&seen_statement, &seen_params),
        tx.query(&tombstoned, &stale_params)
    )?;
    let stale: HashSet<String> = stale_rows.iter().map(|r| r.get(0)).collect();
    let mut seen_records = HashSet::new();
    let mut seen_events = HashSet::new();
    for row in seen_rows {
        let event: String = row.get(0);
        seen_records.insert((
            row.get::<_, String>(1),
            row.get::<_, i32>(2),
            row.get::<_, i64>(3),
        ));
        seen_events.insert(event);
    }

    let mut deliveries = DeliveryRows::default();
    let mut outbox: Vec<Outcome> = Vec::new();
    // Actions that still need their key's state, after the insert.
    let mut pending: Vec<(&KeyedAction, Origin)> = Vec::new();
    let mut to_insert: Vec<&KeyedAction> = Vec::new();

    let arrivals = classify::arrivals(items, &seen_records, seen_events);
    for (item, arrival) in items.iter().zip(arrivals) {
        if arrival == Arrival::Redelivery {
            let (tool, key, event_id) = match item {
                Incoming::Action(a) => (a.tool.clone(), a.key.as_str(), a.event.id.as_str()),
                Incoming::Rejected { partial, .. } => (
                    String::new(),
                    partial.as_ref().map_or("", |p| p.key.as_str()),
                    partial.as_ref().map_or("", |p| p.event_id.as_str()),
                ),
            };
            // Logged for explain; never executed or answered again.
            deliveries.push(None, key, event_id, &pos_of(item), Origin::Redelivery, true);
            result.origins.push((tool, Origin::Redelivery));
            continue;
        }
        match item {
            Incoming::Rejected {
                pos,
                partial,
                reason,
                message,
            } => {
                let key = partial.as_ref().map_or("", |p| p.key.as_str());
                let event_id = partial.as_ref().map_or("", |p| p.event_id.as_str());
                deliveries.push(None, key, event_id, pos, Origin::DeadLetter, true);
                if let (Some(p), Arrival::DeadLetter { answer: true }) = (partial, arrival) {
                    outbox.push(answer::rejected_input(
                        &p.key,
                        &p.run_id,
                        p.tool.clone(),
                        p.step,
                        &p.event_id,
                        reason.error_code(),
                        message,
                        None,
                    ));
                }
                result.origins.push((
                    partial
                        .as_ref()
                        .and_then(|p| p.tool.clone())
                        .unwrap_or_default(),
                    Origin::DeadLetter,
                ));
            }
            Incoming::Action(a) => match arrival {
                Arrival::ProducerRetry => pending.push((a, Origin::ProducerRetry)),
                // Classified against the stored row below, like any later repeat.
                Arrival::SameKey => pending.push((a, Origin::Replay)),
                // A candidate (the only other verdict an action gets).
                _ => to_insert.push(a),
            },
        }
    }

    // 2. Gates that refuse a new key before it is recorded: a pruned key coming back (a run
    //    resumed past retention), and too many failed attempts at the same business action.
    // Keys refused here are not recorded: a repeat of one later in this batch gets the same
    // refusal (step 5).
    let mut refused: HashMap<&str, (ErrorCode, String)> = HashMap::new();
    if !to_insert.is_empty() {
        let reattempt_keys: Vec<&KeyedAction> = to_insert
            .iter()
            .copied()
            .filter(|a| a.gates.max_reattempts.is_some() && a.event.data.business_id.is_some())
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
                failed.insert((r.get(0), r.get(1), r.get(2)), r.get(3));
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
            let state = a.state(OutcomeStatus::Rejected, Some(code.error(message)));
            outbox.push(answer::rejected_gate(&state, a.event.traceparent.clone()));
            deliveries.push(None, &a.key, &a.event.id, &a.pos, Origin::First, true);
            result.origins.push((a.tool.clone(), Origin::First));
            result.rejections.push((a.tool.clone(), code.as_str()));
            false
        });
    }

    // 3. Insert candidate intents; the unique key index decides who is first. Intents that
    //    need a person's approval are recorded parked and answered as such.
    if !to_insert.is_empty() {
        let acts: &[&KeyedAction] = &to_insert;
        // Without per-run limits nothing refuses a claimed row once inserted: its first call
        // is opened by the insert itself.
        let limited = acts
            .iter()
            .any(|a| a.gates.max_per_run.is_some() || a.gates.run_cap.is_some());
        let by_event = insert_intents(tx, acts, claimant, limited).await?;
        let mut recorded: Vec<(&KeyedAction, i64)> = Vec::new();
        for &a in &to_insert {
            match by_event.get(&a.event.id) {
                Some(id) => {
                    deliveries.push(Some(*id), &a.key, &a.event.id, &a.pos, Origin::First, true);
                    result.origins.push((a.tool.clone(), Origin::First));
                    recorded.push((a, *id));
                }
                // Another delivery recorded this key first.
                None => pending.push((a, Origin::Replay)),
            }
        }

        // 4. Per-run limits, counted with the insert: the N+1-th distinct intent is refused.
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
                outbox.push(answer::status_change(
                    &state,
                    1,
                    a.event.traceparent.clone(),
                ));
                result
                    .rejections
                    .push((a.tool.clone(), ErrorCode::RunLimitExceeded.as_str()));
            } else if a.parked_at_record() {
                let state = a.state(OutcomeStatus::PendingApproval, None);
                outbox.push(answer::status_change(
                    &state,
                    1,
                    a.event.traceparent.clone(),
                ));
            } else if a.claimed_at_record() {
                result.claimed.push(a.claimed(id));
            } else {
                result.new_intents.push((id, a.tool.clone()));
            }
        }
        if limited && !result.claimed.is_empty() {
            let ids: Vec<i64> = result.claimed.iter().map(|c| c.id).collect();
            let keys: Vec<&str> = result.claimed.iter().map(|c| c.key.as_str()).collect();
            tx.execute(
                &tx.prepare_cached(OPEN_FIRST_CALLS).await?,
                &[&ids, &keys, &claimant.owner],
            )
            .await?;
        }
    }

    // 5. Repeats: compare with the stored key, answer now or wait for it to resolve.
    if !pending.is_empty() {
        let keys: Vec<&str> = pending.iter().map(|(a, _)| a.key.as_str()).collect();
        let mut existing: HashMap<String, StoredKey> = HashMap::new();
        for row in tx
            .query(&tx.prepare_cached(SELECT_KEYS_FOR_SHARE).await?, &[&keys])
            .await?
        {
            let stored = stored_key(&row);
            existing.insert(stored.state.key.clone(), stored);
        }
        for (a, hint) in pending {
            let stored = existing.get(&a.key);
            match classify::repeat(hint, a, stored, refused.get(a.key.as_str())) {
                Repeat::ProducerRetry { intent } => {
                    // The first delivery of this event id is answered already.
                    deliveries.push(
                        intent,
                        &a.key,
                        &a.event.id,
                        &a.pos,
                        Origin::ProducerRetry,
                        true,
                    );
                    result.origins.push((a.tool.clone(), Origin::ProducerRetry));
                }
                Repeat::Refused { code, message } => {
                    let error = code.error(message);
                    let state = a.state(OutcomeStatus::Rejected, Some(error));
                    outbox.push(answer::rejected_gate(&state, a.event.traceparent.clone()));
                    deliveries.push(None, &a.key, &a.event.id, &a.pos, Origin::First, true);
                    result.origins.push((a.tool.clone(), Origin::First));
                    result.rejections.push((a.tool.clone(), code.as_str()));
                }
                // Recorded again from the start rather than leave it unanswered.
                Repeat::Vanished => return Err(DbError::Vanished(a.key.clone())),
                Repeat::Conflict { stored: k, fields } => {
                    deliveries.push(
                        Some(k.id),
                        &a.key,
                        &a.event.id,
                        &a.pos,
                        Origin::Conflict,
                        true,
                    );
                    outbox.push(answer::conflict(
                        &k.state,
                        &a.event.id,
                        a.event.data.step,
                        fields,
                        a.event.traceparent.clone(),
                    ));
                    result.origins.push((a.tool.clone(), Origin::Conflict));
                }
                Repeat::Duplicate {
                    stored: k,
                    origin,
                    answered,
                } => {
                    if answered {
                        outbox.push(answer::duplicate(
                            &k.state,
                            &a.event.id,
                            a.event.traceparent.clone(),
                        ));
                    }
                    deliveries.push(Some(k.id), &a.key, &a.event.id, &a.pos, origin, answered);
                    result.origins.push((a.tool.clone(), origin));
                }
            }
        }
    }

    // 6. Every delivery, so repeats can be classified and explained later; and 7. the immediate
    //    answers, sent together.
    let d = &deliveries;
    let record_deliveries = async {
        if d.key.is_empty() {
            return Ok(0);
        }
        let statement = tx.prepare_cached(INSERT_DELIVERIES).await?;
        tx.execute(
            &statement,
            &[
                &d.intent_id,
                &d.key,
                &d.event_id,
                &d.topic,
                &d.partition,
                &d.offset,
                &d.origin,
                &d.answered,
            ],
        )
        .await
        .map_err(DbError::from)
    };
    let (_, answers) = futures::try_join!(record_deliveries, insert_outbox(tx, &outbox, channel))?;
    result.answers = answers;
    Ok(result)
}
