//! Recording intents: a batch of consumed actions becomes intents, deliveries and answers in one
//! transaction; the consumer stores offsets only after it commits.

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};

use crate::action::key;
use crate::action::{ActionEvent, DeadLetterReason, PartialAction};
use crate::config::{Tool, ToolClass};
use crate::outcome::answer::KeyState;
use crate::outcome::{OutcomeError, OutcomeStatus};

use crate::execute::claim::Claimed;
use crate::gates::Gates;

pub(crate) mod classify;
mod known;
pub(crate) mod record;
pub(crate) mod sql;
mod status;

pub use classify::Origin;
pub use known::KnownKeys;
pub use record::record_batch;
pub use status::IntentStatus;

/// Where a message was read from.
#[derive(Debug, Clone)]
pub struct Position {
    pub topic: String,
    pub partition: i32,
    pub offset: i64,
    /// The Schema Registry id of a framed payload (Confluent's JSON Schema serializer).
    pub schema_id: Option<i32>,
}

/// One consumed message, decoded as far as it could be.
// The common variant is boxed already; a rejection is rare and lives one batch.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Incoming {
    Action(Box<KeyedAction>),
    /// Dead-lettered; answered with a rejection when its run id and key were readable.
    Rejected {
        pos: Position,
        partial: Option<PartialAction>,
        reason: DeadLetterReason,
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

impl KeyedAction {
    pub fn new(pos: Position, event: ActionEvent, tool: &Tool, key: String, gates: Gates) -> Self {
        let material = key::material(tool, &event.data);
        let fingerprint = key::hash_object(&material);
        let args_hash = key::hash_object(&event.data.args);
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
    fn claimed(&self, id: i64, since: std::time::Instant) -> Claimed {
        let d = &self.event.data;
        Claimed {
            id,
            key: self.key.clone(),
            tool: self.tool.clone(),
            run_id: d.run_id.clone(),
            step: d.step,
            business_id: d.business_id.clone(),
            args: d.args.clone(),
            traceparent: self.event.traceparent.clone(),
            started: self.event_time().unwrap_or_else(Utc::now),
            attempts: 0,
            epoch: 1,
            needs_verify: false,
            since_call: None,
            reason: "first".into(),
            seq: 1,
            claimed_at: since,
        }
    }

    /// Whether its tool's reattempt gate reads the failed intents of its business action
    /// before the insert (it refuses what it finds over the limit, a repeat included).
    fn reattempt_gated(&self) -> bool {
        self.gates.max_reattempts.is_some() && self.event.data.business_id.is_some()
    }

    /// Whether a repeat of a key this relay knows is recorded may skip the intent insert (see
    /// [`KnownKeys`]): not for a read-only tool, whose key is not unique, nor for a
    /// [reattempt-gated](Self::reattempt_gated) one.
    fn may_skip_insert(&self) -> bool {
        self.class != ToolClass::ReadOnly && !self.reattempt_gated()
    }

    /// Recorded parked, waiting for a person's approval.
    fn parked_at_record(&self) -> bool {
        self.gates.approval && self.class != ToolClass::ReadOnly
    }

    /// Recorded claimed by the relay that records it, its first call opened.
    fn claimed_at_record(&self) -> bool {
        !self.parked_at_record() && self.claim_at_record
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

/// The relay that claims intents as it records them.
#[derive(Debug, Clone, Copy)]
pub struct Claimant<'a> {
    pub owner: &'a str,
    pub lease_secs: f64,
    /// Read before the recording transaction began: Postgres dates each lease from that
    /// transaction's start, so a claim's age counted from here is never short.
    pub since: std::time::Instant,
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
    /// How many answers were written to the outbox or are to be sent directly.
    pub answers: usize,
    /// Answers to repeats of settled keys whose outcomes are all published: sent straight to
    /// Kafka, and the batch's offsets stored only once Kafka acknowledged them.
    pub direct: Vec<crate::outcome::Outcome>,
    /// (tool, error code) of the actions a gate refused.
    pub rejections: Vec<(String, &'static str)>,
    /// Keys the transaction recorded or found recorded, remembered once it has committed.
    recorded_keys: Vec<String>,
}
