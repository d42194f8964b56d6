//! Postgres state transitions: record intents (batched), claim, finish with outbox rows, recover.
//! Queries are constants next to the code that runs them; parameters are never formatted in.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use deadpool_postgres::Transaction;
use serde_json::{Map, Value};
use tokio_postgres::GenericClient;

use crate::answer::{self, KeyState};
use crate::attempt_log;
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
    /// The gates this action must pass before it may execute.
    pub gates: Gates,
    /// Claim it in the batch transaction that records it ([`Tool::claims_at_record`]).
    pub claim_at_record: bool,
}

/// Per-action gates, decided from the tool's config when the action is decoded.
#[derive(Debug, Clone, Default)]
pub struct Gates {
    /// Park it `pending_approval` instead of executing.
    pub approval: bool,
    /// Distinct intents of this tool per run.
    pub max_per_run: Option<u32>,
    /// Distinct intents per run across tools.
    pub run_cap: Option<u32>,
    /// Failed intents per (run, tool, business id) before new ones are refused.
    pub max_reattempts: Option<u32>,
}

impl Gates {
    pub fn of(tool: &Tool, data: &crate::event::ActionData, run_cap: Option<u32>) -> Self {
        let approval = match &tool.approval {
            crate::config::Approval::None => false,
            crate::config::Approval::Required => true,
            crate::config::Approval::Above { field, threshold } => {
                match key::field(data, field).to_json() {
                    Value::Number(n) => n.as_f64().is_none_or(|v| v > *threshold),
                    Value::String(s) => s.parse::<f64>().map_or(true, |v| v > *threshold),
                    // Absent or not a number: nothing shows it is small enough.
                    _ => true,
                }
            }
        };
        Gates {
            approval,
            max_per_run: tool.max_per_run,
            run_cap,
            max_reattempts: tool.max_reattempts,
        }
    }
}

impl KeyedAction {
    pub fn new(pos: Position, event: ActionEvent, tool: &Tool, key: String, gates: Gates) -> Self {
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
            gates,
            claim_at_record: tool.claims_at_record(),
        }
    }

    /// The claim [`record_batch`] makes when it records this action claimed.
    fn claimed(&self, id: i64) -> Claimed {
        let d = &self.event.data;
        Claimed {
            id,
            key: self.key.clone(),
            tool: self.tool.clone(),
            run_id: d.run_id.clone(),
            step: d.step,
            business_id: d.business_id.clone(),
            args: d.args.clone(),
            action_event_id: self.event.id.clone(),
            traceparent: self.event.traceparent.clone(),
            started: self.event_time().unwrap_or_else(Utc::now),
            attempts: 0,
            epoch: 1,
            needs_verify: false,
            since_call: None,
            reason: "first".into(),
            seq: 1,
        }
    }

    fn event_time(&self) -> Option<DateTime<Utc>> {
        self.event
            .time
            .as_deref()
            .and_then(|t| DateTime::parse_from_rfc3339(t).ok())
            .map(|t| t.with_timezone(&Utc))
    }

    /// The key's state for an outcome decided in the batch itself.
    fn state(&self, status: OutcomeStatus, error: Option<OutcomeError>) -> KeyState {
        KeyState {
            key: self.key.clone(),
            run_id: self.event.data.run_id.clone(),
            step: self.event.data.step,
            tool: self.tool.clone(),
            status,
            result: None,
            error,
            attempts: 0,
            first_event_id: self.event.id.clone(),
            at: Utc::now(),
        }
    }
}

fn gate_error(code: &str, message: String) -> OutcomeError {
    OutcomeError {
        code: code.to_string(),
        message,
        retryable: false,
        fields: None,
    }
}

/// The relay that claims intents as it records them.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    pub owner: &'a str,
    pub lease_secs: f64,
}

/// What a batch transaction decided, for the consumer to act on after commit.
#[derive(Debug, Default)]
pub struct BatchResult {
    /// Intents created by this batch, to be claimed by the executor.
    pub new_intents: Vec<(i64, String)>,
    /// Intents created and claimed by this batch, each with its first call's attempt open.
    pub claimed: Vec<Claimed>,
    /// (tool, origin) of each message, for metrics.
    pub origins: Vec<(String, Origin)>,
    /// How many outcome rows were written.
    pub answers: usize,
    /// (tool, error code) of the actions a gate refused.
    pub rejections: Vec<(String, &'static str)>,
}

const SELECT_SEEN_EVENTS: &str = "
    select action_event_id, source_topic, source_partition, source_offset
    from deliveries where action_event_id = any($1)";

// A row with a lease owner is recorded claimed (`running`, epoch 1); its attempt row follows
// in the same transaction.
macro_rules! insert_intents {
    () => {
        "insert into intents (idempotency_key, tool, class, run_id, step, business_id, args,
                              material, fingerprint, args_hash, action_event_id, source_topic,
                              source_partition, source_offset, traceparent, event_time, status,
                              status_seq, lease_owner, lease_expires_at, lease_epoch)
         select k, t, c, r, s, b, a, m, f, h, e, tp, p, o, tr, tm, st, sq, lo,
                case when lo is null then null else now() + make_interval(secs => $20) end,
                case when lo is null then 0 else 1 end
           from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[],
                       $7::jsonb[], $8::jsonb[], $9::text[], $10::text[], $11::text[],
                       $12::text[], $13::int4[], $14::int8[], $15::text[], $16::timestamptz[],
                       $17::text[], $18::int4[], $19::text[])
                as u(k, t, c, r, s, b, a, m, f, h, e, tp, p, o, tr, tm, st, sq, lo)
         on conflict (idempotency_key) where class <> 'read_only' do nothing
         returning id, idempotency_key, action_event_id, lease_owner"
    };
}

const INSERT_INTENTS: &str = insert_intents!();

// The same, with each claimed row's first call opened in the same statement: for batches where
// no per-run limit can refuse a claimed row after its insert.
const INSERT_INTENTS_OPENING_CALLS: &str = concat!(
    "with i as (",
    insert_intents!(),
    "), a as (
        insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
        select id, idempotency_key, 1, 'call', 'first', lease_owner, 1
          from i where lease_owner is not null
    )
    select id, idempotency_key, action_event_id from i"
);

const OPEN_FIRST_CALLS: &str = "
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
    select id, k, 1, 'call', 'first', $3, 1 from unnest($1::int8[], $2::text[]) as u(id, k)";

// Share locks order this batch against a concurrent finish of the same keys: either the finish
// commits first and we see its status, or it waits and then sees our waiting deliveries. Every
// statement that locks several intents locks them in id order, so they cannot deadlock.
const SELECT_KEYS_FOR_SHARE: &str = "
    select id, idempotency_key, material, fingerprint, args_hash, action_event_id, status, result,
           error, attempts, run_id, step, tool, coalesce(finished_at, updated_at)
    from intents
    where idempotency_key = any($1) and class <> 'read_only'
    order by id
    for share";

const INSERT_DELIVERIES: &str = "
    insert into deliveries (intent_id, idempotency_key, action_event_id, source_topic,
                            source_partition, source_offset, origin, answered)
    select * from unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::int4[], $6::int8[],
                         $7::text[], $8::bool[])";

// The publisher is woken (NOTIFY, delivered at commit) only when a row was new.
const INSERT_OUTBOX: &str = "
    with o as (
        insert into outbox (event_id, kafka_key, payload, traceparent)
        select * from unnest($1::text[], $2::text[], $3::jsonb[], $4::text[])
        on conflict (event_id) do nothing
        returning 1
    )
    select n, case when n > 0 then pg_notify($5, '') end
      from (select count(*) as n from o) c";

// Keys whose intent was pruned: a run resumed past retention must not execute them as new.
const TOMBSTONED: &str = "
    select k from unnest($1::text[]) as k
     where exists (select 1 from tombstones t
                    where t.key_hash = encode(sha256(convert_to(k, 'UTF8')), 'hex')
                      and t.expires_at > now())";

const FAILED_REATTEMPTS: &str = "
    select i.run_id, i.tool, i.business_id, count(*)
      from intents i
      join unnest($1::text[], $2::text[], $3::text[]) as q(run_id, tool, business_id)
        on i.run_id = q.run_id and i.tool = q.tool and i.business_id = q.business_id
     where i.status = 'failed'
     group by 1, 2, 3";

// Counted in the transaction that records the intents: two relays cannot both take the last
// slot, since the counter row is locked until commit.
const COUNT_RUN: &str = "
    insert into run_counts (run_id, tool, n)
    select * from unnest($1::text[], $2::text[], $3::int4[])
    on conflict (run_id, tool) do update set n = run_counts.n + excluded.n
    returning run_id, tool, n";

const REJECT_NEW: &str = "
    update intents set status = 'rejected', error = $2, finished_at = now(), updated_at = now(),
                       lease_owner = null, lease_expires_at = null
     where id = $1";

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

    // 2. Gates that refuse a new key before it is recorded: a pruned key coming back (a run
    //    resumed past retention), and too many failed attempts at the same business action.
    let action_of = |i: usize| match &items[i] {
        Incoming::Action(a) => a.as_ref(),
        Incoming::Rejected { .. } => unreachable!("only actions are inserted"),
    };
    // Keys refused here are not recorded: a repeat of one later in this batch gets the same
    // refusal (step 5).
    let mut refused: HashMap<&str, (&'static str, String)> = HashMap::new();
    if !to_insert.is_empty() {
        let reattempt_keys: Vec<&KeyedAction> = to_insert
            .iter()
            .map(|i| action_of(*i))
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
        to_insert.retain(|i| {
            let a = action_of(*i);
            let refusal = if stale.contains(&a.key) {
                Some(("stale_resume", format!(
                    "key {} belongs to an action finished and pruned after its retention; a resumed run cannot execute it again",
                    a.key
                )))
            } else {
                let tried = a.event.data.business_id.as_ref().and_then(|b| {
                    failed.get(&(a.event.data.run_id.clone(), a.tool.clone(), b.clone()))
                });
                match (a.gates.max_reattempts, tried) {
                    (Some(max), Some(n)) if *n >= i64::from(max) => Some(("reattempts_exceeded", format!(
                        "{n} attempts at this {} for {} already failed (the limit is {max}); stop and report instead of trying again",
                        a.tool,
                        a.event.data.business_id.as_deref().unwrap_or("")
                    ))),
                    _ => None,
                }
            };
            let Some((code, message)) = refusal else { return true };
            refused.insert(a.key.as_str(), (code, message.clone()));
            let state = a.state(OutcomeStatus::Rejected, Some(gate_error(code, message)));
            outbox.push(answer::rejected_gate(&state, a.event.traceparent.clone()));
            deliveries.push(None, &a.key, &a.event.id, &a.pos, Origin::First, true);
            result.origins.push((a.tool.clone(), Origin::First));
            result.rejections.push((a.tool.clone(), code));
            false
        });
    }

    // 3. Insert candidate intents; the unique key index decides who is first. Intents that
    //    need a person's approval are recorded parked and answered as such.
    if !to_insert.is_empty() {
        let acts: Vec<&KeyedAction> = to_insert.iter().map(|i| action_of(*i)).collect();
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
        let times: Vec<Option<DateTime<Utc>>> = acts.iter().map(|a| a.event_time()).collect();
        let parked = |a: &KeyedAction| a.gates.approval && a.class != ToolClass::ReadOnly;
        let claims = |a: &KeyedAction| !parked(a) && a.claim_at_record;
        let statuses: Vec<&str> = acts
            .iter()
            .map(|a| {
                if parked(a) {
                    "pending_approval"
                } else if claims(a) {
                    "running"
                } else {
                    "pending"
                }
            })
            .collect();
        let seqs: Vec<i32> = acts.iter().map(|a| i32::from(parked(a))).collect();
        let owners: Vec<Option<&str>> = acts
            .iter()
            .map(|a| claims(a).then_some(claimant.owner))
            .collect();
        // Without per-run limits nothing refuses a claimed row once inserted: its first call
        // is opened by the insert itself.
        let limited = acts
            .iter()
            .any(|a| a.gates.max_per_run.is_some() || a.gates.run_cap.is_some());
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
        let by_event: HashMap<String, i64> = rows
            .iter()
            .map(|r| (r.get::<_, String>(2), r.get::<_, i64>(0)))
            .collect();
        let mut recorded: Vec<(&KeyedAction, i64)> = Vec::new();
        for i in &to_insert {
            let a = action_of(*i);
            match by_event.get(&a.event.id) {
                Some(id) => {
                    deliveries.push(Some(*id), &a.key, &a.event.id, &a.pos, Origin::First, true);
                    result.origins.push((a.tool.clone(), Origin::First));
                    recorded.push((a, *id));
                }
                // Another delivery recorded this key first.
                None => pending.push((*i, Origin::Replay)),
            }
        }

        // 4. Per-run limits, counted with the insert: the N+1-th distinct intent is refused.
        let over = count_runs(tx, &recorded).await?;
        for (a, id) in recorded {
            if let Some(message) = over.get(&id) {
                let error = gate_error("run_limit_exceeded", message.clone());
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
                    .push((a.tool.clone(), "run_limit_exceeded"));
            } else if parked(a) {
                let state = a.state(OutcomeStatus::PendingApproval, None);
                outbox.push(answer::status_change(
                    &state,
                    1,
                    a.event.traceparent.clone(),
                ));
            } else if claims(a) {
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
        let keys: Vec<String> = pending
            .iter()
            .filter_map(|(i, _)| match &items[*i] {
                Incoming::Action(a) => Some(a.key.clone()),
                Incoming::Rejected { .. } => None,
            })
            .collect();
        let mut existing: HashMap<String, ExistingKey> = HashMap::new();
        for row in tx
            .query(&tx.prepare_cached(SELECT_KEYS_FOR_SHARE).await?, &[&keys])
            .await?
        {
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
            // A producer retry: the first delivery of this event id is answered already. (A
            // read-only action is here only as one: it is recorded anew on every other delivery.)
            if hint == Origin::ProducerRetry || a.class == ToolClass::ReadOnly {
                let intent = existing
                    .get(&a.key)
                    .map(|k| k.id)
                    .filter(|_| a.class != ToolClass::ReadOnly);
                deliveries.push(
                    intent,
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
                if let Some((code, message)) = refused.get(a.key.as_str()) {
                    let error = gate_error(code, message.clone());
                    let state = a.state(OutcomeStatus::Rejected, Some(error));
                    outbox.push(answer::rejected_gate(&state, a.event.traceparent.clone()));
                    deliveries.push(None, &a.key, &a.event.id, &a.pos, Origin::First, true);
                    result.origins.push((a.tool.clone(), Origin::First));
                    result.rejections.push((a.tool.clone(), code));
                    continue;
                }
                // The key was inserted in this transaction or before it, and nothing deletes
                // an intent but prune, which keeps a tombstone: if it is gone all the same,
                // the batch is recorded again from the start rather than leave it unanswered.
                return Err(DbError::Vanished(a.key.clone()));
            };
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

/// Counts newly recorded intents against their tool's and their run's limits; returns the ids
/// over a limit, with the reason.
async fn count_runs(
    tx: &Transaction<'_>,
    recorded: &[(&KeyedAction, i64)],
) -> Result<HashMap<i64, String>, DbError> {
    // (run, tool or "*") → (limit, this batch's intents, in order)
    let mut groups: std::collections::BTreeMap<(String, String), (u32, Vec<i64>)> =
        Default::default();
    for (a, id) in recorded {
        if a.class == ToolClass::ReadOnly {
            continue;
        }
        let run = a.event.data.run_id.clone();
        if let Some(limit) = a.gates.max_per_run {
            groups
                .entry((run.clone(), a.tool.clone()))
                .or_insert((limit, Vec::new()))
                .1
                .push(*id);
        }
        if let Some(limit) = a.gates.run_cap {
            groups
                .entry((run, "*".to_string()))
                .or_insert((limit, Vec::new()))
                .1
                .push(*id);
        }
    }
    let mut over = HashMap::new();
    if groups.is_empty() {
        return Ok(over);
    }
    // Sorted (a BTreeMap), so two relays lock the counter rows in the same order.
    let runs: Vec<&str> = groups.keys().map(|k| k.0.as_str()).collect();
    let tools: Vec<&str> = groups.keys().map(|k| k.1.as_str()).collect();
    let adds: Vec<i32> = groups.values().map(|g| g.1.len() as i32).collect();
    for row in tx
        .query(
            &tx.prepare_cached(COUNT_RUN).await?,
            &[&runs, &tools, &adds],
        )
        .await?
    {
        let key: (String, String) = (row.get(0), row.get(1));
        let total: i32 = row.get(2);
        let (limit, ids) = &groups[&key];
        let before = total - ids.len() as i32;
        for (k, id) in ids.iter().enumerate() {
            let n = before + k as i32 + 1;
            if n > *limit as i32 {
                let scope = if key.1 == "*" {
                    "actions".to_string()
                } else {
                    format!("{} actions", key.1)
                };
                over.entry(*id).or_insert_with(|| {
                    format!(
                        "run {} may record at most {limit} {scope}; this would be number {n}",
                        key.0
                    )
                });
            }
        }
    }
    Ok(over)
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
    let statement = tx.prepare_cached(INSERT_OUTBOX).await?;
    let row = tx
        .query_one(&statement, &[&ids, &keys, &payloads, &traces, &channel])
        .await?;
    Ok(row.get::<_, i64>(0) as usize)
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
    /// How long ago the key's last call started (database clock), when it had one: a
    /// verification answering "not done" concludes only once that call's deadline has passed.
    pub since_call: Option<Duration>,
    /// Why this claim calls: `first`, `recovery` or `manual`.
    pub reason: String,
    /// The attempt row the claim opened (a call, or a verification when `needs_verify`).
    pub seq: i32,
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
// An UPDATE, not a read: it waits for a concurrent takeover and re-checks the epoch and the
// lease after it, so a relay that slept past its lease cannot start another call. It renews the
// lease for the call it opens.
const BEGIN_ATTEMPT: &str = "
    with i as (
        update intents set lease_expires_at = now() + make_interval(secs => $6)
         where id = $1 and lease_epoch = $2 and status = 'running' and lease_expires_at > now()
        returning id, idempotency_key
    )
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
    select i.id, i.idempotency_key,
           coalesce((select max(seq) from attempts where intent_id = i.id), 0) + 1, $3, $4, $5, $2
      from i
    returning seq";

// Never over an end already written: recovery may have closed it `abandoned` meanwhile, and
// what it read then is what the history says.
const END_ATTEMPT: &str = "
    update attempts set ended_at = now(), classification = $3, http_status = $4, error = $5,
                        latency_ms = $6
     where intent_id = $1 and seq = $2 and ended_at is null";

/// Opens the next attempt row; `None` when the claim was lost.
pub async fn begin_attempt(
    client: &impl GenericClient,
    c: &Claimed,
    kind: &str,
    reason: &str,
    owner: &str,
    lease_secs: f64,
) -> Result<Option<i32>, DbError> {
    Ok(client
        .query_opt(
            BEGIN_ATTEMPT,
            &[&c.id, &c.epoch, &kind, &reason, &owner, &lease_secs],
        )
        .await?
        .map(|r| r.get(0)))
}

// A claim whose call never started, given back: the attempt it opened is closed as not sent.
const UNCLAIM: &str = "
    with i as (
        update intents set status = 'pending', lease_owner = null, lease_expires_at = null,
                           lease_epoch = lease_epoch + 1, updated_at = now()
         where id = $1 and lease_epoch = $2 and status = 'running'
        returning id
    )
    update attempts set ended_at = now(), classification = 'not_sent',
                        error = 'the relay stopped before this call'
     where intent_id in (select id from i) and seq = $3";

/// Releases a claim whose call did not start, for another relay to claim.
pub async fn unclaim(client: &impl GenericClient, c: &Claimed) -> Result<(), DbError> {
    client.execute(UNCLAIM, &[&c.id, &c.epoch, &c.seq]).await?;
    Ok(())
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

// Only the claims whose calls are still running here: a claim whose task died lapses, and
// recovery takes it over.
const EXTEND_LEASES: &str = "
    with locked as materialized (
        select id from intents where id = any($2) and lease_owner = $1 order by id for update
    )
    update intents i set lease_expires_at = now() + make_interval(secs => $3)
      from locked l
     where i.id = l.id and i.lease_owner = $1 and i.status = 'running'";

/// Keeps this relay's live claims alive while their calls run.
pub async fn extend_leases(
    client: &impl GenericClient,
    owner: &str,
    ids: &[i64],
    lease_secs: f64,
) -> Result<u64, DbError> {
    Ok(client
        .execute(EXTEND_LEASES, &[&owner, &ids, &lease_secs])
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

// A person's decision on a parked key: no claim to fence against, only the parked status.
const FINISH_PARKED: &str = "
    update intents
       set status = $2, result = $3, error = $4, attempts = attempts + $5,
           status_seq = status_seq + 1, lease_epoch = lease_epoch + 1,
           needs_verify = false, next_reason = 'first', updated_at = now(), finished_at = now()
     where id = $1 and status = $6
    returning idempotency_key, run_id, step, tool, action_event_id, attempts, status_seq,
              finished_at, traceparent";

/// What a finish must hold to be written.
#[derive(Debug, Clone, Copy)]
pub enum Guard {
    /// The claim with this epoch still owns the intent.
    Claim(i64),
    /// The intent is parked with this status (`unknown`, `pending_approval`) and a person
    /// decides it.
    Parked(&'static str),
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
    let parked = match guard {
        Guard::Parked(status) => status,
        Guard::Claim(_) => "",
    };
    if let Guard::Claim(epoch) = guard {
        let item = Finish {
            id,
            epoch,
            settled: settled.clone(),
            end: last_attempt.cloned(),
        };
        return finish_many(tx, &[item], channel)
            .await?
            .pop()
            .flatten()
            .ok_or(FinishError::Fenced(id));
    }
    let row = tx
        .query_opt(
            FINISH_PARKED,
            &[
                &id,
                &settled.status.as_str(),
                &settled.result,
                &error,
                &settled.attempts,
                &parked,
            ],
        )
        .await?
        .ok_or(FinishError::Fenced(id))?;
    if let Some(end) = last_attempt {
        end_attempt(&**tx, id, end).await?;
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
    select id, status, class, tool
      from intents
     where ((status = 'pending' and updated_at < now() - make_interval(secs => $1))
            or (status = 'running' and lease_expires_at < now()))
       and id <> all($3)
     order by id
     limit $2
     for update skip locked";

// A claim that ran out: its open attempts were abandoned mid-way. What they may have done is
// read back from the history by the attempt log's rule.
const ABANDON_ATTEMPTS: &str = "
    update attempts set ended_at = now(), classification = 'abandoned'
     where intent_id = any($1) and ended_at is null";

// Every attempt of the orphans, in order, with its age by the database's clock.
const SELECT_HISTORY: &str = "
    select intent_id, kind, classification,
           extract(epoch from now() - started_at)::float8 as age_secs
      from attempts
     where intent_id = any($1)
     order by intent_id, seq";

// Hands an orphan to the next claim with the attempt log's verdict: verify first or call, and
// the calls that count against the retry budget.
const REQUEUE: &str = "
    update intents set status = 'pending', lease_owner = null, lease_expires_at = null,
                       lease_epoch = lease_epoch + 1, updated_at = now(),
                       next_reason = case when status = 'running' then 'recovery' else next_reason end,
                       needs_verify = $2, attempts = greatest(attempts, $3)
     where id = $1";

const TAKE_OVER: &str = "
    update intents set status = 'running', lease_owner = $2, lease_epoch = lease_epoch + 1,
                       attempts = greatest(attempts, $3)
     where id = $1
    returning lease_epoch";

#[derive(Debug)]
pub struct Orphan {
    pub id: i64,
    /// The claim ran out.
    pub was_running: bool,
    pub class: String,
    pub tool: String,
}

/// Lists orphans (locking them for this transaction) without changing them.
pub async fn orphans(
    tx: &Transaction<'_>,
    min_pending_age_secs: f64,
    limit: i64,
    skip: &[i64],
) -> Result<Vec<Orphan>, DbError> {
    Ok(tx
        .query(SELECT_ORPHANS, &[&min_pending_age_secs, &limit, &skip])
        .await?
        .iter()
        .map(|r| Orphan {
            id: r.get("id"),
            was_running: r.get::<_, String>("status") == "running",
            class: r.get("class"),
            tool: r.get("tool"),
        })
        .collect())
}

/// Closes the attempts dead claims left open.
pub async fn abandon_attempts(tx: &Transaction<'_>, ids: &[i64]) -> Result<(), DbError> {
    tx.execute(ABANDON_ATTEMPTS, &[&ids]).await?;
    Ok(())
}

/// The attempt log of each of `ids`, in order.
pub async fn histories(
    tx: &Transaction<'_>,
    ids: &[i64],
) -> Result<HashMap<i64, Vec<attempt_log::Past>>, DbError> {
    let mut out: HashMap<i64, Vec<attempt_log::Past>> = HashMap::new();
    for r in tx.query(SELECT_HISTORY, &[&ids]).await? {
        let classification: Option<String> = r.get("classification");
        out.entry(r.get("intent_id"))
            .or_default()
            .push(attempt_log::Past {
                kind: attempt_log::Kind::parse(r.get("kind")),
                ended: classification.as_deref().map(|c| {
                    // An unknown word is read as the worst case: it may have happened.
                    attempt_log::Ended::parse(c).unwrap_or(attempt_log::Ended::Abandoned)
                }),
                age: Duration::from_secs_f64(r.get::<_, f64>("age_secs").max(0.0)),
            });
    }
    Ok(out)
}

/// Makes an orphan claimable again, with what the attempt log says its next claim does.
pub async fn requeue(
    tx: &Transaction<'_>,
    id: i64,
    verdict: &attempt_log::Verdict,
) -> Result<(), DbError> {
    let verify = matches!(verdict.next, attempt_log::Next::Verify { .. });
    tx.execute(REQUEUE, &[&id, &verify, &verdict.calls]).await?;
    Ok(())
}

/// Takes over an orphan, fencing out its old owner; returns the new epoch.
pub async fn take_over(
    tx: &Transaction<'_>,
    id: i64,
    owner: &str,
    calls: i32,
) -> Result<i64, DbError> {
    Ok(tx
        .query_one(TAKE_OVER, &[&id, &owner, &calls])
        .await?
        .get(0))
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
     where published_at is null and quarantined_at is null
     order by id
     limit $1
     for update skip locked";

const MARK_PUBLISHED: &str = "update outbox set published_at = now() where id = any($1)";

const QUARANTINE: &str = "
    update outbox set quarantined_at = now(), quarantine_reason = $2 where id = $1";

/// Sets aside an outbox row the producer refuses for good, with the reason.
pub async fn quarantine(tx: &Transaction<'_>, id: i64, reason: &str) -> Result<(), DbError> {
    tx.execute(QUARANTINE, &[&id, &reason]).await?;
    Ok(())
}

const OUTBOX_LAG: &str = "
    select count(*), coalesce(extract(epoch from now() - min(created_at))::float8, 0)
      from outbox where published_at is null and quarantined_at is null";

pub async fn unpublished(tx: &Transaction<'_>, limit: i64) -> Result<Vec<OutboxRow>, DbError> {
    Ok(tx
        .query(&tx.prepare_cached(SELECT_UNPUBLISHED).await?, &[&limit])
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
    tx.execute(&tx.prepare_cached(MARK_PUBLISHED).await?, &[&ids])
        .await?;
    Ok(())
}

pub async fn outbox_lag(client: &impl GenericClient) -> Result<(i64, f64), DbError> {
    let row = client.query_one(OUTBOX_LAG, &[]).await?;
    Ok((row.get(0), row.get(1)))
}

// ------------------------------------------------------------- group commit

// Many claims in one statement (and one commit). Each claim and the attempt row it opens
// commit together: there is never a call without a durable record that it began.
const CLAIM_MANY: &str = "
    with locked as materialized (
        select id from intents where id = any($1) order by id for update
    ), c as (
        update intents i
           set status = 'running', lease_owner = $2,
               lease_expires_at = now() + make_interval(secs => $3),
               lease_epoch = i.lease_epoch + 1, updated_at = now()
          from locked l
         where i.id = l.id and i.status = 'pending'
        returning i.id, i.idempotency_key, i.tool, i.run_id, i.step, i.business_id, i.args,
                  i.action_event_id, i.traceparent, coalesce(i.event_time, i.created_at) as started,
                  i.attempts, i.lease_epoch, i.needs_verify, i.next_reason,
                  (select extract(epoch from now() - max(p.started_at))::float8
                     from attempts p where p.intent_id = i.id and p.kind = 'call') as since_call
    ), a as (
        insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
        select c.id, c.idempotency_key,
               coalesce((select max(seq) from attempts where intent_id = c.id), 0) + 1,
               case when c.needs_verify then 'verify' else 'call' end,
               c.next_reason, $2, c.lease_epoch
          from c
        returning intent_id, seq
    )
    select c.*, a.seq from c join a on a.intent_id = c.id";

/// Claims every pending intent of `ids` at once; the others are missing from the answer.
pub async fn claim_many(
    client: &impl GenericClient,
    ids: &[i64],
    owner: &str,
    lease_secs: f64,
) -> Result<HashMap<i64, Claimed>, DbError> {
    let rows = client
        .query(CLAIM_MANY, &[&ids, &owner, &lease_secs])
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let args: Value = row.get(6);
            let c = Claimed {
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
                since_call: row
                    .get::<_, Option<f64>>(14)
                    .map(|s| Duration::from_secs_f64(s.max(0.0))),
                seq: row.get(15),
            };
            (c.id, c)
        })
        .collect())
}

// Claims that waited in the local queue, re-checked just before their first send: the epoch
// is still theirs and the lease has not run out (a relay paused past its lease has lost the
// key to recovery, which may be verifying or calling it). Each lease is renewed for the call,
// and the call's attempt restarts its clock, so its deadline counts from the send.
const FENCE_MANY: &str = "
    with locked as materialized (
        select id from intents where id = any($1) order by id for update
    ), f as (
        update intents i set lease_expires_at = now() + make_interval(secs => $4)
          from locked l, unnest($1::int8[], $2::int8[]) as u(id, epoch)
         where i.id = l.id and u.id = i.id and i.lease_epoch = u.epoch
           and i.status = 'running' and i.lease_expires_at > now()
        returning i.id
    ), a as (
        update attempts a set started_at = now()
          from unnest($1::int8[], $3::int4[]) as u(id, seq)
         where a.intent_id = u.id and a.seq = u.seq and a.ended_at is null
           and u.id = any(array(select id from f))
    )
    select id from f";

/// One claim to re-check before its first send.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    pub id: i64,
    pub epoch: i64,
    pub seq: i32,
}

/// Re-checks many claims at once; answers which still hold.
pub async fn fence_many(
    client: &deadpool_postgres::Client,
    items: &[Fence],
    lease_secs: f64,
) -> Result<HashSet<i64>, DbError> {
    let ids: Vec<i64> = items.iter().map(|f| f.id).collect();
    let epochs: Vec<i64> = items.iter().map(|f| f.epoch).collect();
    let seqs: Vec<i32> = items.iter().map(|f| f.seq).collect();
    let statement = client.prepare_cached(FENCE_MANY).await?;
    Ok(client
        .query(&statement, &[&ids, &epochs, &seqs, &lease_secs])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// One finished call for [`finish_many`].
#[derive(Debug, Clone)]
pub struct Finish {
    pub id: i64,
    pub epoch: i64,
    pub settled: Settled,
    pub end: Option<AttemptEnd>,
}

// The group's intents, locked in id order, so concurrent groups and lease renewals cannot
// deadlock. A statement of its own: the one after it takes its snapshot once these locks are
// held, so it sees every repeat recorded (by a batch holding a share lock) before them.
const LOCK_MANY: &str = "select id from intents where id = any($1) order by id for update";

// Every outcome of the group in one statement: the intents (fenced by epoch), their attempts
// closed, and the repeats that waited for them marked answered (their event ids returned, to be
// answered from the outbox). The status a claimed row must still have is a parameter ($7,
// always 'running'): with a literal, a generic (prepared) plan may scan every running intent
// through `intents_open` instead of looking the ids up by primary key.
const FINISH_MANY: &str = "
    with f as (
        update intents i
           set status = u.status, result = u.result, error = u.error,
               attempts = i.attempts + u.attempts, status_seq = i.status_seq + 1,
               lease_owner = null, lease_expires_at = null, needs_verify = false,
               next_reason = 'first', updated_at = now(), finished_at = now()
          from unnest($1::int8[], $2::int8[], $3::text[], $4::jsonb[], $5::jsonb[], $6::int4[])
               as u(id, epoch, status, result, error, attempts)
         where i.id = u.id and i.lease_epoch = u.epoch and i.status = $7
        returning i.id, i.idempotency_key, i.run_id, i.step, i.tool, i.action_event_id,
                  i.attempts, i.status_seq, i.finished_at, i.traceparent
    ), e as (
        update attempts a
           set ended_at = now(), classification = u.classification, http_status = u.http_status,
               error = u.error, latency_ms = u.latency_ms
          from unnest($8::int8[], $9::int4[], $10::text[], $11::int4[], $12::text[], $13::float8[])
               as u(intent_id, seq, classification, http_status, error, latency_ms)
         where a.intent_id = u.intent_id and a.seq = u.seq
           and u.intent_id = any(array(select id from f))
    ), w as (
        update deliveries set answered = true
         where intent_id = any(array(select id from f)) and not answered
        returning intent_id, action_event_id
    )
    select f.*, (select array_agg(w.action_event_id) from w where w.intent_id = f.id)
      from f";

/// Records many calls' results in the caller's transaction: the same as [`finish`] for each,
/// in three statements for all (the lock and the finish pipelined, then the outbox). An item
/// whose claim was lost is `None` and writes nothing.
pub async fn finish_many(
    tx: &Transaction<'_>,
    items: &[Finish],
    channel: &str,
) -> Result<Vec<Option<KeyState>>, DbError> {
    let ids: Vec<i64> = items.iter().map(|f| f.id).collect();
    let epochs: Vec<i64> = items.iter().map(|f| f.epoch).collect();
    let statuses: Vec<&str> = items.iter().map(|f| f.settled.status.as_str()).collect();
    let results: Vec<Option<Value>> = items.iter().map(|f| f.settled.result.clone()).collect();
    let errors: Vec<Option<Value>> = items
        .iter()
        .map(|f| {
            f.settled
                .error
                .as_ref()
                .map(|e| serde_json::to_value(e).expect("error serializes"))
        })
        .collect();
    let attempts: Vec<i32> = items.iter().map(|f| f.settled.attempts).collect();
    let ends: Vec<(i64, &AttemptEnd)> = items
        .iter()
        .filter_map(|f| f.end.as_ref().map(|e| (f.id, e)))
        .collect();
    let end_ids: Vec<i64> = ends.iter().map(|(id, _)| *id).collect();
    let seqs: Vec<i32> = ends.iter().map(|(_, e)| e.seq).collect();
    let classes: Vec<&str> = ends.iter().map(|(_, e)| e.classification).collect();
    let http: Vec<Option<i32>> = ends.iter().map(|(_, e)| e.http_status).collect();
    let errs: Vec<Option<&str>> = ends.iter().map(|(_, e)| e.error.as_deref()).collect();
    let latencies: Vec<f64> = ends.iter().map(|(_, e)| e.latency_ms).collect();
    let (lock, finish) =
        futures::try_join!(tx.prepare_cached(LOCK_MANY), tx.prepare_cached(FINISH_MANY))?;
    let lock_params = [&ids as _];
    let finish_params: [&(dyn tokio_postgres::types::ToSql + Sync); 13] = [
        &ids, &epochs, &statuses, &results, &errors, &attempts, &"running", &end_ids, &seqs,
        &classes, &http, &errs, &latencies,
    ];
    // Pipelined: one round trip, executed in order.
    let (_, rows) = futures::try_join!(
        tx.query(&lock, &lock_params),
        tx.query(&finish, &finish_params)
    )?;
    let by_id: HashMap<i64, &Finish> = items.iter().map(|f| (f.id, f)).collect();
    let mut finished: HashMap<i64, KeyState> = HashMap::with_capacity(rows.len());
    let mut outcomes = Vec::with_capacity(rows.len());
    for row in &rows {
        let id: i64 = row.get(0);
        let f = by_id[&id];
        let state = KeyState {
            key: row.get(1),
            run_id: row.get(2),
            step: row.get(3),
            tool: row.get(4),
            status: f.settled.status,
            result: f.settled.result.clone(),
            error: f.settled.error.clone(),
            attempts: row.get(6),
            first_event_id: row.get(5),
            at: row.get(8),
        };
        let traceparent: Option<String> = row.get(9);
        outcomes.push(answer::status_change(
            &state,
            row.get(7),
            traceparent.clone(),
        ));
        let waiting: Option<Vec<String>> = row.get(10);
        for event_id in waiting.unwrap_or_default() {
            if event_id != state.first_event_id {
                outcomes.push(answer::duplicate(&state, &event_id, traceparent.clone()));
            }
        }
        finished.insert(id, state);
    }
    insert_outbox(tx, &outcomes, channel).await?;
    Ok(items.iter().map(|f| finished.remove(&f.id)).collect())
}
