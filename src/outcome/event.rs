//! The contract out: outcome events, their statuses and errors, and stable outcome ids.

use serde::{Deserialize, Serialize};
use serde_json::Value;

pub const OUTCOME_TYPE: &str = "dev.idem.outcome.v1";
pub const OUTCOME_SOURCE: &str = "idem";
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
        serde_json::json!({
            "truncated": true,
            "bytes": size,
            "note": format!("the downstream's answer was larger than {max_bytes} bytes and is not kept"),
        })
    } else {
        v
    }
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OutcomeError {
    pub code: String,
    pub message: String,
    pub retryable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields: Option<Vec<String>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OutcomeData {
    pub idempotency_key: String,
    pub run_id: Option<String>,
    pub step: Option<i64>,
    pub tool: Option<String>,
    pub action_event_id: String,
    pub status: OutcomeStatus,
    pub result: Option<Value>,
    pub error: Option<OutcomeError>,
    pub duplicate: bool,
    pub attempts: i32,
    pub note: String,
}

/// A ready-to-publish outcome: its stable id, Kafka key and CloudEvents JSON.
#[derive(Debug, Clone)]
pub struct Outcome {
    pub event_id: String,
    pub key: String,
    pub payload: Value,
    pub traceparent: Option<String>,
}

/// Stable outcome id: the same (key, answer) always gets the same id, so a republished
/// outcome is recognisable and consumers can dedupe on it.
pub fn outcome_id(key: &str, answer: &str) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(key.as_bytes());
    h.update([0]);
    h.update(answer.as_bytes());
    let digest = h.finalize();
    let hex = hex::encode(&digest[..16]);
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl Outcome {
    pub fn new(
        event_id: String,
        data: OutcomeData,
        time: chrono::DateTime<chrono::Utc>,
        traceparent: Option<String>,
    ) -> Self {
        let key = data.idempotency_key.clone();
        let mut payload = serde_json::json!({
            "specversion": "1.0",
            "type": OUTCOME_TYPE,
            "source": OUTCOME_SOURCE,
            "id": event_id,
            "subject": key,
            "time": time.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "datacontenttype": "application/json",
            "data": data,
        });
        if let Some(t) = &traceparent {
            payload["traceparent"] = Value::String(t.clone());
        }
        Outcome {
            event_id,
            key,
            payload,
            traceparent,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcome_ids_are_stable_and_distinct() {
        assert_eq!(outcome_id("k", "status:1"), outcome_id("k", "status:1"));
        assert_ne!(outcome_id("k", "status:1"), outcome_id("k", "status:2"));
        assert_ne!(outcome_id("k", "status:1"), outcome_id("k2", "status:1"));
        assert_eq!(outcome_id("k", "x").len(), 36);
    }
}
