//! Postgres state transitions: record intents (batched), claim, finish with outbox rows, recover.
//! Queries are constants next to the code that runs them; parameters are never formatted in.

use std::collections::{HashMap, HashSet};

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use tokio_postgres::{GenericClient, Transaction};

use crate::answer::{self, KeyState};
use crate::config::{Tool, ToolClass};
use crate::db::DbError;
use crate::event::{ActionEvent, Outcome, OutcomeError, OutcomeStatus, PartialAction};
use crate::key;
use crate::metrics::Origin;

/// Where a message was read from.
#[derive(Debug, Clone)]
pub struct Position {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
}

/// One consumed message, decoded as far as it could be.
#[derive(Debug)]
pub enum Incoming {
    Action(Box<KeyedAction>),
    /// Dead-lettered; answered with a rejection when its run id and key were readable.
    Rejected {
        pos: Position,
        partial: Option<PartialAction>,
        code: &'static str,
        message: String,
    },
}

/// A valid action with its key and fingerprints.
#[derive(Debug)]
pub struct KeyedAction {
    pub pos: Position,
    pub event: ActionEvent,
    pub key: String,
    pub tool: String,
    pub class: ToolClass,
    pub material: Map<String, Value>,
    pub fingerprint: String,
    pub args_hash: String,
}

impl KeyedAction {
    pub fn new(pos: Position, event: ActionEvent, tool: &Tool, key: String) -> Self {
        let material = key::material(tool, &event.data);
        let fingerprint = key::hash_json(&Value::Object(material.clone()));
        let args_hash = key::hash_json(&Value::Object(event.data.args.clone()));
        KeyedAction {
            pos,
            key,
            tool: tool.name.clone(),
            class: tool.class,
            material,
            fingerprint,
            args_hash,
            event,
        }
    }
}

/// What a batch transaction decided, for the consumer to act on after commit.
#[derive(Debug, Default)]
pub struct BatchResult {
    /// Intents created by this batch: hand them to the executor.
    pub new_intents: Vec<(i64, String)>,
    /// (tool, origin) of each message, for metrics.
    pub origins: Vec<(String, Origin)>,
    /// How many outcome rows were written.
    pub answers: usize,
}

const SELECT_SEEN_EVENTS: &str = "
    select action_event_id, source_topic, source_partition, source_offset
    from deliveries where action_event_id = any($1)";

const INSERT_INTENTS: &str = "
    insert into intents (idempotency_key, tool, class, run_id, step, business_id, args, material,
                         fingerprint, args_hash, action_event_id, source_topic, source_partition,
                         source_offset, traceparent, event_time)
    select * from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[],
                         $7::jsonb[], $8::jsonb[], $9::text[], $10::text[], $11::text[], $12::text[],
                         $13::int4[], $14::int8[], $15::text[], $16::timestamptz[])
    on conflict (idempotency_key) where class <> 'read_only' do nothing
    returning id, idempotency_key, action_event_id";

// Share locks order this batch against a concurrent finish of the same keys: either the finish
// commits first and we see its status, or it waits and then sees our waiting deliveries.
const SELECT_KEYS_FOR_SHARE: &str = "
    select id, idempotency_key, material, fingerprint, args_hash, action_event_id, status, result,
           error, attempts, run_id, step, tool, coalesce(finished_at, updated_at)
    from intents
    where idempotency_key = any($1) and class <> 'read_only'
    order by idempotency_key
    for share";

const INSERT_DELIVERIES: &str = "
    insert into deliveries (intent_id, idempotency_key, action_event_id, source_topic,
                            source_partition, source_offset, origin, answered)
    select * from unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::int8[],
                         $7::text[], $8::bool[])";

const INSERT_OUTBOX: &str = "
    insert into outbox (event_id, kafka_key, payload, traceparent)
    select * from unnest($1::text[], $2::text[], $3::jsonb[], $4::text[])
    on conflict (event_id) do nothing";

const NOTIFY: &str = "select pg_notify($1, '')";

/// The LISTEN/NOTIFY channel of one schema's outbox.
pub fn outbox_channel(schema: &str) -> String {
    format!("idem_outbox_{schema}")
}

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

/// Stored state of an existing key, as the batch sees it.
struct ExistingKey {
    id: i64,
    material: Value,
    fingerprint: String,
    args_hash: String,
    state: KeyState,
    reportable: bool,
}

fn parse_error(v: Option<Value>) -> Option<OutcomeError> {
    v.and_then(|v| serde_json::from_value(v).ok())
}

/// Records one batch of consumed messages in a single transaction. Only after it commits may the
/// consumer store these messages' offsets.
pub async fn record_batch(
    tx: &Transaction<'_>,
    items: &[Incoming],
    channel: &str,
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
    let event_ids: Vec<String> = items.iter().filter_map(event_id_of).collect();
    let mut seen_records = HashSet::new();
    let mut seen_events = HashSet::new();
    for row in tx.query(SELECT_SEEN_EVENTS, &[&event_ids]).await? {
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
    // Index of items that still need their key's state, after the insert.
    let mut pending: Vec<(usize, Origin)> = Vec::new();
    let mut first_of_key: HashMap<&str, usize> = HashMap::new();
    let mut to_insert: Vec<usize> = Vec::new();

    for (i, item) in items.iter().enumerate() {
        let pos = pos_of(item);
        if seen_records.contains(&(pos.topic.clone(), pos.partition, pos.offset)) {
            let (tool, key, event_id) = match item {
                Incoming::Action(a) => (a.tool.clone(), a.key.as_str(), a.event.id.as_str()),
                Incoming::Rejected { partial, .. } => (
                    String::new(),
                    partial.as_ref().map_or("", |p| p.key.as_str()),
                    partial.as_ref().map_or("", |p| p.event_id.as_str()),
                ),
            };
            // Logged for explain; never executed or answered again.
            deliveries.push(None, key, event_id, &pos, Origin::Redelivery, true);
            result.origins.push((tool, Origin::Redelivery));
            continue;
        }
        match item {
            Incoming::Rejected {
                pos,
                partial,
                code,
                message,
            } => {
                let key = partial.as_ref().map_or("", |p| p.key.as_str());
                let event_id = partial.as_ref().map_or("", |p| p.event_id.as_str());
                deliveries.push(None, key, event_id, pos, Origin::DeadLetter, true);
                if let Some(p) = partial {
                    if !seen_events.contains(&p.event_id) {
                        outbox.push(answer::rejected_input(
                            &p.key,
                            &p.run_id,
                            p.tool.clone(),
                            p.step,
                            &p.event_id,
                            code,
                            message,
                            None,
                        ));
                    }
                }
                result.origins.push((
                    partial
                        .as_ref()
                        .and_then(|p| p.tool.clone())
                        .unwrap_or_default(),
                    Origin::DeadLetter,
                ));
                seen_events.insert(event_id.to_string());
            }
            Incoming::Action(a) => {
                if !seen_events.insert(a.event.id.clone()) {
                    pending.push((i, Origin::ProducerRetry));
                    continue;
                }
                if a.class == ToolClass::ReadOnly {
                    to_insert.push(i);
                    continue;
                }
                match first_of_key.get(a.key.as_str()) {
                    None => {
                        first_of_key.insert(&a.key, i);
                        to_insert.push(i);
                    }
                    // Classified against the stored row below, like any later repeat.
                    Some(_) => pending.push((i, Origin::Replay)),
                }
            }
        }
    }

    // 2. Insert candidate intents; the unique key index decides who is first.
    let mut created: HashMap<usize, i64> = HashMap::new();
    if !to_insert.is_empty() {
        let acts: Vec<&KeyedAction> = to_insert
            .iter()
            .map(|i| match &items[*i] {
                Incoming::Action(a) => a.as_ref(),
                Incoming::Rejected { .. } => unreachable!("only actions are inserted"),
            })
            .collect();
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
        let traces: Vec<Option<String>> =
            acts.iter().map(|a| a.event.traceparent.clone()).collect();
        let times: Vec<Option<DateTime<Utc>>> = acts
            .iter()
            .map(|a| {
                a.event
                    .time
                    .as_deref()
                    .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
                    .map(|t| t.with_timezone(&Utc))
            })
            .collect();
        let rows = tx
            .query(
                INSERT_INTENTS,
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
                ],
            )
            .await?;
        // Read-only rows never conflict, so map returned rows back by event id.
        let by_event: HashMap<String, i64> = rows
            .iter()
            .map(|r| (r.get::<_, String>(2), r.get::<_, i64>(0)))
            .collect();
        for i in to_insert {
            let Incoming::Action(a) = &items[i] else {
                continue;
            };
            match by_event.get(&a.event.id) {
                Some(id) => {
                    created.insert(i, *id);
                    result.new_intents.push((*id, a.tool.clone()));
                    deliveries.push(Some(*id), &a.key, &a.event.id, &a.pos, Origin::First, false);
                    result.origins.push((a.tool.clone(), Origin::First));
                }
                // Another delivery recorded this key first.
                None => pending.push((i, Origin::Replay)),
            }
        }
    }

    // 3. Repeats: compare with the stored key, answer now or wait for it to resolve.
    if !pending.is_empty() {
        let keys: Vec<String> = pending
            .iter()
            .filter_map(|(i, _)| match &items[*i] {
                Incoming::Action(a) => Some(a.key.clone()),
                Incoming::Rejected { .. } => None,
            })
            .collect();
        let mut existing: HashMap<String, ExistingKey> = HashMap::new();
        for row in tx.query(SELECT_KEYS_FOR_SHARE, &[&keys]).await? {
            let status: String = row.get(6);
            let reported = OutcomeStatus::parse(&status);
            let state = KeyState {
                key: row.get(1),
                run_id: row.get(10),
                step: row.get(11),
                tool: row.get(12),
                status: reported.unwrap_or(OutcomeStatus::Unknown),
                result: row.get(7),
                error: parse_error(row.get(8)),
                attempts: row.get(9),
                first_event_id: row.get(5),
                at: row.get(13),
            };
            existing.insert(
                state.key.clone(),
                ExistingKey {
                    id: row.get(0),
                    material: row.get(2),
                    fingerprint: row.get(3),
                    args_hash: row.get(4),
                    reportable: reported.is_some(),
                    state,
                },
            );
        }
        for (i, hint) in pending {
            let Incoming::Action(a) = &items[i] else {
                continue;
            };
            if a.class == ToolClass::ReadOnly {
                // A producer retry of a read-only action: its first delivery is answered.
                deliveries.push(
                    None,
                    &a.key,
                    &a.event.id,
                    &a.pos,
                    Origin::ProducerRetry,
                    true,
                );
                result.origins.push((a.tool.clone(), Origin::ProducerRetry));
                continue;
            }
            let Some(k) = existing.get(&a.key) else {
                // Cannot happen: the key was inserted in this transaction or before it.
                tracing::error!(key = %a.key, "repeat of a key with no stored intent");
                continue;
            };
            if hint == Origin::ProducerRetry {
                deliveries.push(
                    Some(k.id),
                    &a.key,
                    &a.event.id,
                    &a.pos,
                    Origin::ProducerRetry,
                    true,
                );
                result.origins.push((a.tool.clone(), Origin::ProducerRetry));
                continue;
            }
            if k.fingerprint != a.fingerprint {
                let fields = key::differing_fields(&k.material, &a.material);
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
                continue;
            }
            let origin = if k.args_hash == a.args_hash {
                Origin::Replay
            } else {
                Origin::ModelRetry
            };
            if k.reportable {
                outbox.push(answer::duplicate(
                    &k.state,
                    &a.event.id,
                    a.event.traceparent.clone(),
                ));
            }
            deliveries.push(
                Some(k.id),
                &a.key,
                &a.event.id,
                &a.pos,
                origin,
                k.reportable,
            );
            result.origins.push((a.tool.clone(), origin));
        }
    }

    // 4. Every delivery, so repeats can be classified and explained later.
    if !deliveries.key.is_empty() {
        let d = &deliveries;
        tx.execute(
            INSERT_DELIVERIES,
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
        .await?;
    }
    // 5. Immediate answers.
    result.answers = insert_outbox(tx, &outbox, channel).await?;
    Ok(result)
}

async fn insert_outbox(
    tx: &Transaction<'_>,
    outcomes: &[Outcome],
    channel: &str,
) -> Result<usize, DbError> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    let ids: Vec<&str> = outcomes.iter().map(|o| o.event_id.as_str()).collect();
    let keys: Vec<&str> = outcomes.iter().map(|o| o.key.as_str()).collect();
    let payloads: Vec<&Value> = outcomes.iter().map(|o| &o.payload).collect();
    let traces: Vec<Option<&str>> = outcomes.iter().map(|o| o.traceparent.as_deref()).collect();
    let n = tx
        .execute(INSERT_OUTBOX, &[&ids, &keys, &payloads, &traces])
        .await?;
    if n > 0 {
        tx.execute(NOTIFY, &[&channel]).await?;
    }
    Ok(n as usize)
}

// ------------------------------------------------------------------ executor

/// An intent claimed for execution.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: i64,
    pub key: String,
    pub tool: String,
    pub run_id: String,
    pub step: Option<i64>,
    pub business_id: Option<String>,
    pub args: Map<String, Value>,
    pub action_event_id: String,
    pub traceparent: Option<String>,
    /// Event time, or when the intent was recorded.
    pub started: DateTime<Utc>,
    /// Downstream calls made before this claim.
    pub attempts: i32,
    /// The fencing token: writes are refused once another claim has been made.
    pub epoch: i64,
    /// An earlier call may have happened: verify before calling.
    pub needs_verify: bool,
    /// Why this claim calls: `first`, `recovery` or `manual`.
    pub reason: String,
    /// The attempt row the claim opened (a call, or a verification when `needs_verify`).
    pub seq: i32,
}

// The claim and the attempt row it opens commit together: there is never a call without a
// durable record that it began.
const CLAIM: &str = "
    with c as (
        update intents
           set status = 'running', lease_owner = $2,
               lease_expires_at = now() + make_interval(secs => $3),
               lease_epoch = lease_epoch + 1, updated_at = now()
         where id = $1 and status = 'pending'
        returning id, idempotency_key, tool, run_id, step, business_id, args, action_event_id,
                  traceparent, coalesce(event_time, created_at) as started, attempts, lease_epoch,
                  needs_verify, next_reason
    ), a as (
        insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
        select c.id, c.idempotency_key,
               coalesce((select max(seq) from attempts where intent_id = c.id), 0) + 1,
               case when c.needs_verify then 'verify' else 'call' end,
               c.next_reason, $2, c.lease_epoch
          from c
        returning seq
    )
    select c.*, a.seq from c, a";

pub async fn claim(
    client: &impl GenericClient,
    id: i64,
    owner: &str,
    lease_secs: f64,
) -> Result<Option<Claimed>, DbError> {
    let Some(row) = client.query_opt(CLAIM, &[&id, &owner, &lease_secs]).await? else {
        return Ok(None);
    };
    let args: Value = row.get(6);
    Ok(Some(Claimed {
        id: row.get(0),
        key: row.get(1),
        tool: row.get(2),
        run_id: row.get(3),
        step: row.get(4),
        business_id: row.get(5),
        args: match args {
            Value::Object(m) => m,
            _ => Map::new(),
        },
        action_event_id: row.get(7),
        traceparent: row.get(8),
        started: row.get(9),
        attempts: row.get(10),
        epoch: row.get(11),
        needs_verify: row.get(12),
        reason: row.get(13),
        seq: row.get(14),
    }))
}

/// How an attempt ended, for the attempt log.
#[derive(Debug, Clone)]
pub struct AttemptEnd {
    pub seq: i32,
    pub classification: &'static str,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub latency_ms: f64,
}

// Fenced like every write of a claim: a relay that lost its lease cannot start another call.
const BEGIN_ATTEMPT: &str = "
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
    select i.id, i.idempotency_key,
           coalesce((select max(seq) from attempts where intent_id = i.id), 0) + 1, $3, $4, $5, $2
      from intents i
     where i.id = $1 and i.lease_epoch = $2 and i.status = 'running'
    returning seq";

const END_ATTEMPT: &str = "
    update attempts set ended_at = now(), classification = $3, http_status = $4, error = $5,
                        latency_ms = $6
     where intent_id = $1 and seq = $2";

/// Opens the next attempt row; `None` when the claim was lost.
pub async fn begin_attempt(
    client: &impl GenericClient,
    c: &Claimed,
    kind: &str,
    reason: &str,
    owner: &str,
) -> Result<Option<i32>, DbError> {
    Ok(client
        .query_opt(BEGIN_ATTEMPT, &[&c.id, &c.epoch, &kind, &reason, &owner])
        .await?
        .map(|r| r.get(0)))
}

pub async fn end_attempt(
    client: &impl GenericClient,
    intent_id: i64,
    end: &AttemptEnd,
) -> Result<(), DbError> {
    client
        .execute(
            END_ATTEMPT,
            &[
                &intent_id,
                &end.seq,
                &end.classification,
                &end.http_status,
                &end.error,
                &end.latency_ms,
            ],
        )
        .await?;
    Ok(())
}

const EXTEND_LEASES: &str = "
    update intents set lease_expires_at = now() + make_interval(secs => $2)
     where lease_owner = $1 and status = 'running'";

/// Keeps this relay's claims alive while their calls run.
pub async fn extend_leases(
    client: &impl GenericClient,
    owner: &str,
    lease_secs: f64,
) -> Result<u64, DbError> {
    Ok(client
        .execute(EXTEND_LEASES, &[&owner, &lease_secs])
        .await?)
}

/// The settled state of a call.
#[derive(Debug, Clone)]
pub struct Settled {
    pub status: OutcomeStatus,
    pub result: Option<Value>,
    pub error: Option<OutcomeError>,
    /// Downstream attempts made under this claim.
    pub attempts: i32,
}

const FINISH: &str = "
    update intents
       set status = $3, result = $4, error = $5, attempts = attempts + $6,
           status_seq = status_seq + 1, lease_owner = null, lease_expires_at = null,
           needs_verify = false, next_reason = 'first', updated_at = now(), finished_at = now()
     where id = $1 and lease_epoch = $2 and status = 'running'
    returning idempotency_key, run_id, step, tool, action_event_id, attempts, status_seq,
              finished_at, traceparent";

// A person's decision on a parked key: no claim to fence against, only the parked status.
const FINISH_PARKED: &str = "
    update intents
       set status = $3, result = $4, error = $5, attempts = attempts + $6,
           status_seq = status_seq + 1, lease_epoch = lease_epoch + 1,
           needs_verify = false, next_reason = 'first', updated_at = now(), finished_at = now()
     where id = $1 and status = 'unknown' and $2::int8 is not null
    returning idempotency_key, run_id, step, tool, action_event_id, attempts, status_seq,
              finished_at, traceparent";

/// What a finish must hold to be written.
#[derive(Debug, Clone, Copy)]
pub enum Guard {
    /// The claim with this epoch still owns the intent.
    Claim(i64),
    /// The intent is parked `unknown` (a person resolves it).
    Parked,
}

const ANSWER_WAITING: &str = "
    update deliveries set answered = true
     where intent_id = $1 and not answered
    returning action_event_id";

/// Why a finish was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    /// Another claim owns the intent now: this write is late and must not land.
    #[error("lease lost: intent {0} was claimed again")]
    Fenced(i64),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<tokio_postgres::Error> for FinishError {
    fn from(e: tokio_postgres::Error) -> Self {
        FinishError::Db(DbError::Postgres(e))
    }
}

/// Records a call's result, its outcome event and the answers to every delivery waiting on
/// the key, in the caller's transaction, fenced by the claim's epoch.
pub async fn finish(
    tx: &Transaction<'_>,
    id: i64,
    guard: Guard,
    settled: &Settled,
    last_attempt: Option<&AttemptEnd>,
    channel: &str,
) -> Result<KeyState, FinishError> {
    let error = settled
        .error
        .as_ref()
        .map(|e| serde_json::to_value(e).expect("error serializes"));
    let (query, epoch) = match guard {
        Guard::Claim(epoch) => (FINISH, epoch),
        Guard::Parked => (FINISH_PARKED, 0),
    };
    let row = tx
        .query_opt(
            query,
            &[
                &id,
                &epoch,
                &settled.status.as_str(),
                &settled.result,
                &error,
                &settled.attempts,
            ],
        )
        .await?
        .ok_or(FinishError::Fenced(id))?;
    if let Some(end) = last_attempt {
        end_attempt(tx, id, end).await?;
    }
    let state = KeyState {
        key: row.get(0),
        run_id: row.get(1),
        step: row.get(2),
        tool: row.get(3),
        status: settled.status,
        result: settled.result.clone(),
        error: settled.error.clone(),
        attempts: row.get(5),
        first_event_id: row.get(4),
        at: row.get(7),
    };
    let seq: i32 = row.get(6);
    let traceparent: Option<String> = row.get(8);
    let mut outcomes = vec![answer::status_change(&state, seq, traceparent.clone())];
    for row in tx.query(ANSWER_WAITING, &[&id]).await? {
        let event_id: String = row.get(0);
        if event_id != state.first_event_id {
            outcomes.push(answer::duplicate(&state, &event_id, traceparent.clone()));
        }
    }
    insert_outbox(tx, &outcomes, channel).await?;
    Ok(state)
}

// ------------------------------------------------------------------ recovery

/// Intents left behind: recorded but never claimed (a relay died before dispatching them), or
/// claimed by a relay whose lease ran out.
const SELECT_ORPHANS: &str = "
    select id, status, class, tool, lease_epoch,
           exists (select 1 from attempts a
                    where a.intent_id = intents.id and a.kind = 'call' and a.ended_at is null)
      from intents
     where (status = 'pending' and updated_at < now() - make_interval(secs => $1))
        or (status = 'running' and lease_expires_at < now())
     order by id
     limit $2
     for update skip locked";

// A claim that ran out: its open attempts were abandoned mid-way.
const ABANDON_ATTEMPTS: &str = "
    update attempts set ended_at = now(), classification = 'abandoned'
     where intent_id = $1 and ended_at is null";

const RELEASE: &str = "
    update intents set status = 'pending', lease_owner = null, lease_expires_at = null,
                       lease_epoch = lease_epoch + 1, updated_at = now(),
                       next_reason = 'recovery', needs_verify = needs_verify or $2
     where id = $1";

const TAKE_OVER: &str = "
    update intents set lease_owner = $2, lease_epoch = lease_epoch + 1
     where id = $1
    returning lease_epoch";

#[derive(Debug)]
pub struct Orphan {
    pub id: i64,
    /// The claim ran out.
    pub was_running: bool,
    pub class: String,
    pub tool: String,
    /// A call began and its end was never recorded: it may have happened.
    pub open_call: bool,
}

/// Lists orphans (locking them for this transaction) without changing them.
pub async fn orphans(
    tx: &Transaction<'_>,
    min_pending_age_secs: f64,
    limit: i64,
) -> Result<Vec<Orphan>, DbError> {
    Ok(tx
        .query(SELECT_ORPHANS, &[&min_pending_age_secs, &limit])
        .await?
        .iter()
        .map(|r| Orphan {
            id: r.get(0),
            was_running: r.get::<_, String>(1) == "running",
            class: r.get(2),
            tool: r.get(3),
            open_call: r.get(5),
        })
        .collect())
}

/// Closes the attempts a dead claim left open.
pub async fn abandon_attempts(tx: &Transaction<'_>, id: i64) -> Result<(), DbError> {
    tx.execute(ABANDON_ATTEMPTS, &[&id]).await?;
    Ok(())
}

/// Makes an expired claim claimable again; with `verify`, the next claim looks downstream
/// before it calls.
pub async fn release(tx: &Transaction<'_>, id: i64, verify: bool) -> Result<(), DbError> {
    tx.execute(RELEASE, &[&id, &verify]).await?;
    Ok(())
}

/// Takes over an expired claim, fencing out its old owner; returns the new epoch.
pub async fn take_over(tx: &Transaction<'_>, id: i64, owner: &str) -> Result<i64, DbError> {
    Ok(tx.query_one(TAKE_OVER, &[&id, &owner]).await?.get(0))
}

const PARKED: &str = "select status, count(*) from intents where status in ('unknown', 'pending_approval') group by status";

pub async fn parked_counts(client: &impl GenericClient) -> Result<Vec<(String, i64)>, DbError> {
    Ok(client
        .query(PARKED, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

// -------------------------------------------------------------------- outbox

#[derive(Debug)]
pub struct OutboxRow {
    pub id: i64,
    pub event_id: String,
    pub key: String,
    pub payload: Value,
    pub traceparent: Option<String>,
}

const SELECT_UNPUBLISHED: &str = "
    select id, event_id, kafka_key, payload, traceparent from outbox
     where published_at is null
     order by id
     limit $1
     for update skip locked";

const MARK_PUBLISHED: &str = "update outbox set published_at = now() where id = any($1)";

const OUTBOX_LAG: &str = "
    select count(*), coalesce(extract(epoch from now() - min(created_at))::float8, 0)
      from outbox where published_at is null";

pub async fn unpublished(tx: &Transaction<'_>, limit: i64) -> Result<Vec<OutboxRow>, DbError> {
    Ok(tx
        .query(SELECT_UNPUBLISHED, &[&limit])
        .await?
        .iter()
        .map(|r| OutboxRow {
            id: r.get(0),
            event_id: r.get(1),
            key: r.get(2),
            payload: r.get(3),
            traceparent: r.get(4),
        })
        .collect())
}

pub async fn mark_published(tx: &Transaction<'_>, ids: &[i64]) -> Result<(), DbError> {
    tx.execute(MARK_PUBLISHED, &[&ids]).await?;
    Ok(())
}

pub async fn outbox_lag(client: &impl GenericClient) -> Result<(i64, f64), DbError> {
    let row = client.query_one(OUTBOX_LAG, &[]).await?;
    Ok((row.get(0), row.get(1)))
}
