//! The contract out: outcome events, their statuses and errors, and stable outcome ids.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const OUTCOME_TYPE: &str = "dev.idem.outcome.v1";
pub const OUTCOME_SOURCE: &str = "idem";
pub const OUTCOME_SPECVERSION: &str = "1.0";
/// Makes a downstream's answer storable: NUL characters dropped, and a body larger than
/// `max_bytes` replaced by a note of its size (outcome events must stay publishable).
pub fn storable_result(v: Value, max_bytes: usize) -> Value {
    fn strip(v: Value) -> Value {
        match v {
            Value::String(s) if s.contains('\0') => Value::String(s.replace('\0', "")),
            Value::Array(items) => Value::Array(items.into_iter().map(strip).collect()),
            Value::Object(m) => Value::Object(
                m.into_iter()
                    .map(|(k, x)| (k.replace('\0', ""), strip(x)))
                    .collect(),
            ),
            other => other,
        }
    }
    let v = strip(v);
    let size = serde_json::to_vec(&v).map_or(0, |b| b.len());
    if size > max_bytes {
        too_large(size as u64, max_bytes)
    } else {
        v
    }
}

/// What is kept of an answer larger than `max_bytes`: its size.
pub fn too_large(bytes: u64, max_bytes: usize) -> Value {
    serde_json::json!({
        "truncated": true,
        "bytes": bytes,
        "note": format!("the downstream's answer was larger than {max_bytes} bytes and is not kept"),
    })
}
/// Status of a key as reported in outcome events.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeStatus {
    Succeeded,
    Failed,
    Unknown,
    PendingApproval,
    Rejected,
}

impl OutcomeStatus {
    pub const ALL: [OutcomeStatus; 5] = [
        OutcomeStatus::Succeeded,
        OutcomeStatus::Failed,
        OutcomeStatus::Unknown,
        OutcomeStatus::PendingApproval,
        OutcomeStatus::Rejected,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            OutcomeStatus::Succeeded => "succeeded",
            OutcomeStatus::Failed => "failed",
            OutcomeStatus::Unknown => "unknown",
            OutcomeStatus::PendingApproval => "pending_approval",
            OutcomeStatus::Rejected => "rejected",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "succeeded" => OutcomeStatus::Succeeded,
            "failed" => OutcomeStatus::Failed,
            "unknown" => OutcomeStatus::Unknown,
            "pending_approval" => OutcomeStatus::PendingApproval,
            "rejected" => OutcomeStatus::Rejected,
            _ => return None,
        })
    }
}

/// Why an action did not succeed: the `error.code` of an outcome event. Each code decides
/// whether a new request may succeed (`retryable`) and what the agent is told to do next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    /// Bad input whose run id could be read.
    SchemaInvalid,
    UnknownTool,
    /// The key could not be derived, or is not a usable key.
    InvalidKey,
    /// An argument the tool's URL is filled with is empty, `.` or `..` (it would change which
    /// resource the path names).
    InvalidArgs,
    /// Same key, different material fields.
    KeyConflict,
    /// A 4xx, or the SQL statement failed: not done.
    DownstreamRejected,
    /// 429/503 on every attempt: not done.
    DownstreamUnavailable,
    /// Could not connect on any attempt: not done.
    DownstreamUnreachable,
    /// May or may not have happened; parked for verification or a person.
    OutcomeUnknown,
    /// A person resolved an unknown key as not done.
    ResolvedFailed,
    ApprovalDenied,
    ApprovalTimeout,
    RunLimitExceeded,
    ReattemptsExceeded,
    /// The key was finished and pruned; a resumed run cannot execute it again.
    StaleResume,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::SchemaInvalid,
        ErrorCode::UnknownTool,
        ErrorCode::InvalidKey,
        ErrorCode::InvalidArgs,
        ErrorCode::KeyConflict,
        ErrorCode::DownstreamRejected,
        ErrorCode::DownstreamUnavailable,
        ErrorCode::DownstreamUnreachable,
        ErrorCode::OutcomeUnknown,
        ErrorCode::ResolvedFailed,
        ErrorCode::ApprovalDenied,
        ErrorCode::ApprovalTimeout,
        ErrorCode::RunLimitExceeded,
        ErrorCode::ReattemptsExceeded,
        ErrorCode::StaleResume,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::SchemaInvalid => "schema_invalid",
            ErrorCode::UnknownTool => "unknown_tool",
            ErrorCode::InvalidKey => "invalid_key",
            ErrorCode::InvalidArgs => "invalid_args",
            ErrorCode::KeyConflict => "key_conflict",
            ErrorCode::DownstreamRejected => "downstream_rejected",
            ErrorCode::DownstreamUnavailable => "downstream_unavailable",
            ErrorCode::DownstreamUnreachable => "downstream_unreachable",
            ErrorCode::OutcomeUnknown => "outcome_unknown",
            ErrorCode::ResolvedFailed => "resolved_failed",
            ErrorCode::ApprovalDenied => "approval_denied",
            ErrorCode::ApprovalTimeout => "approval_timeout",
            ErrorCode::RunLimitExceeded => "run_limit_exceeded",
            ErrorCode::ReattemptsExceeded => "reattempts_exceeded",
            ErrorCode::StaleResume => "stale_resume",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        ErrorCode::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether the same request may succeed later: only when nothing was processed because the
    /// downstream could not take it.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::DownstreamUnavailable | ErrorCode::DownstreamUnreachable
        )
    }

    /// What a rejected action's note tells the agent to do next.
    pub fn next_step(self) -> &'static str {
        match self {
            ErrorCode::RunLimitExceeded => {
                "this run has done all it may with this tool: stop and report"
            }
            ErrorCode::ReattemptsExceeded => "stop and report to a person",
            ErrorCode::StaleResume => "do not retry: ask a person whether it is still needed",
            ErrorCode::ApprovalDenied | ErrorCode::ApprovalTimeout => "do not retry",
            _ => "fix the request before sending it again",
        }
    }

    /// The outcome error of this code.
    pub fn error(self, message: impl Into<String>) -> OutcomeError {
        OutcomeError {
            code: self.as_str().to_string(),
            message: message.into(),
            retryable: self.retryable(),
            fields: None,
        }
    }
}

// The fields of the structs an outcome event is written from are declared in the order of their
// names: that is the order in which the event's JSON has always listed them (it was built as a
// `serde_json::Value`, whose maps sort their keys), so the bytes published are unchanged.

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeError {
    pub code: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<Vec<String>>,
    pub message: String,
    pub retryable: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutcomeData {
    pub action_event_id: String,
    pub attempts: i32,
    pub duplicate: bool,
    pub error: Option<OutcomeError>,
    pub idempotency_key: String,
    pub note: String,
    pub result: Option<Value>,
    pub run_id: Option<String>,
    pub status: OutcomeStatus,
    pub step: Option<i64>,
    pub tool: Option<String>,
}

/// A ready-to-publish outcome: its stable id, Kafka key and CloudEvents JSON.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub event_id: String,
    pub key: String,
    /// The CloudEvent, serialized once: written to the outbox and sent to Kafka as these bytes.
    pub payload: String,
    pub traceparent: Option<String>,
    /// A status change after the key's first: an earlier outcome of the key may still wait in
    /// the outbox, and this one must not go out before it (checked for the rows a finish hands
    /// to the publishers; a round reading the queue checks every row).
    pub follows: bool,
}

/// An outcome's CloudEvent as it is serialized, its attributes in the order of their names.
#[derive(Serialize)]
struct CloudEvent<'a> {
    data: &'a OutcomeData,
    datacontenttype: &'static str,
    id: &'a str,
    source: &'static str,
    specversion: &'static str,
    subject: &'a str,
    time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    #[serde(rename = "type")]
    kind: &'static str,
}

/// Stable outcome id: the same (key, answer) always gets the same id, so a republished
/// outcome is recognisable and consumers can dedupe on it.
pub fn outcome_id(key: &str, answer: &str) -> String {
    use sha2::{Digest, Sha256};
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut h = Sha256::new();
    h.update(key.as_bytes());
    h.update([0]);
    h.update(answer.as_bytes());
    let digest = h.finalize();
    // The first 16 bytes in hex, grouped 8-4-4-4-12 like a UUID.
    let mut id = String::with_capacity(36);
    for (i, b) in digest[..16].iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            id.push('-');
        }
        id.push(char::from(HEX[usize::from(b >> 4)]));
        id.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    id
}

impl Outcome {
    pub fn new(
        event_id: String,
        data: OutcomeData,
        time: chrono::DateTime<chrono::Utc>,
        traceparent: Option<String>,
    ) -> Self {
        let key = data.idempotency_key.clone();
        // Exported traces: the outcome carries its publish span's context, a child of the
        // action's span.
        let traceparent = if crate::telemetry::enabled() {
            let trace = crate::telemetry::ActionTrace::of(&key, traceparent.as_deref());
            Some(trace.traceparent(trace.child(&format!("publish/{event_id}"))))
        } else {
            traceparent
        };
        let payload = serde_json::to_string(&CloudEvent {
            data: &data,
            datacontenttype: "application/json",
            id: &event_id,
            source: OUTCOME_SOURCE,
            specversion: OUTCOME_SPECVERSION,
            subject: &key,
            time: time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            traceparent: traceparent.as_deref(),
            kind: OUTCOME_TYPE,
        })
        .expect("an outcome serializes");
        Outcome {
            event_id,
            key,
            payload,
            traceparent,
            follows: false,
        }
    }

    /// The CloudEvent, parsed back (for tests: the relay itself never reads its own JSON).
    #[cfg(test)]
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.payload).expect("an outcome is JSON")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_reads_back_and_only_unavailability_is_retryable() {
        for c in ErrorCode::ALL {
            assert_eq!(ErrorCode::parse(c.as_str()), Some(c));
            assert_eq!(c.error("m").code, c.as_str());
        }
        let retryable: Vec<&str> = ErrorCode::ALL
            .into_iter()
            .filter(|c| c.retryable())
            .map(ErrorCode::as_str)
            .collect();
        assert_eq!(
            retryable,
            ["downstream_unavailable", "downstream_unreachable"]
        );
        assert_eq!(ErrorCode::parse("not_json"), None);
    }

    #[test]
    fn outcome_ids_are_stable_and_distinct() {
        assert_eq!(outcome_id("k", "status:1"), outcome_id("k", "status:1"));
        assert_ne!(outcome_id("k", "status:1"), outcome_id("k", "status:2"));
        assert_ne!(outcome_id("k", "status:1"), outcome_id("k2", "status:1"));
        assert_eq!(outcome_id("k", "x").len(), 36);
        // Consumers dedupe on these ids across versions of the relay: they never change.
        assert_eq!(
            outcome_id("k", "status:1"),
            "0694edb5-d2c8-55f5-cc98-7e3732ef56a2"
        );
        assert_eq!(
            outcome_id("run_42:send_email:order_8812", "answer:evt-2"),
            "0a258982-8cc9-8137-f531-7576373083d7"
        );
    }

    /// How an outcome event was written before it was serialized from typed fields: a
    /// `serde_json::Value` built by `json!`, its maps' keys sorted.
    fn as_a_value(event_id: &str, data: &OutcomeData, time: &str, trace: Option<&str>) -> Value {
        let mut payload = serde_json::json!({
            "specversion": "1.0",
            "type": OUTCOME_TYPE,
            "source": OUTCOME_SOURCE,
            "id": event_id,
            "subject": data.idempotency_key,
            "time": time,
            "datacontenttype": "application/json",
            "data": data,
        });
        if let Some(t) = trace {
            payload["traceparent"] = Value::String(t.to_string());
        }
        payload
    }

    /// Outcome events are published and stored: serializing them from typed fields must write
    /// the bytes the `Value` they were built as before wrote, for any data.
    #[test]
    fn an_outcome_is_written_as_it_was_when_built_as_a_value() {
        use proptest::prelude::*;
        let results = crate::arbitrary::json(".*");
        let errors = prop::option::of((
            ".*",
            prop::option::of(prop::collection::vec(".*", 0..3)),
            ".*",
            any::<bool>(),
        ));
        let strings = (".*", prop::option::of(".*"), prop::option::of(".*"), ".*");
        let numbers = (prop::option::of(any::<i64>()), any::<i32>(), any::<bool>());
        let status = prop::sample::select(OutcomeStatus::ALL.to_vec());
        let trace = prop::option::of("[0-9a-f-]{1,55}");
        proptest!(|(
            (key, run_id, tool, note) in strings,
            (step, attempts, duplicate) in numbers,
            status in status,
            result in prop::option::of(results),
            error in errors,
            trace in trace,
            event_id in ".*",
        )| {
            let data = OutcomeData {
                action_event_id: format!("evt-{event_id}"),
                attempts,
                duplicate,
                error: error.map(|(code, fields, message, retryable)| OutcomeError {
                    code,
                    fields,
                    message,
                    retryable,
                }),
                idempotency_key: key.clone(),
                note,
                result,
                run_id,
                status,
                step,
                tool,
            };
            let time = chrono::DateTime::from_timestamp_millis(1_733_500_000_123).unwrap();
            let before = as_a_value(&event_id, &data, "2024-12-06T15:46:40.123Z", trace.as_deref());
            let outcome = Outcome::new(event_id.clone(), data, time, trace.clone());
            prop_assert_eq!(&outcome.payload, &serde_json::to_string(&before).unwrap());
            prop_assert_eq!(outcome.key, key);
        });
    }
}
