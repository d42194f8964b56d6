//! Outcome events as their readers need them: the status, the stored result, and one plain
//! sentence for the model that asked, so it knows whether to try again.

use chrono::{DateTime, Utc};
use serde_json::Value;

use crate::outcome::{outcome_id, ErrorCode, Outcome, OutcomeData, OutcomeError, OutcomeStatus};

/// What is known of a key when an outcome is written.
#[derive(Debug, Clone)]
pub struct KeyState {
    pub key: String,
    pub run_id: String,
    pub step: Option<i64>,
    pub tool: String,
    pub status: OutcomeStatus,
    pub result: Option<Value>,
    pub error: Option<OutcomeError>,
    pub attempts: i32,
    /// The action event that created the key.
    pub first_event_id: String,
    /// When the key reached its status.
    pub at: DateTime<Utc>,
}

/// `t` as `HH:MM:SS UTC` (what `%H:%M:%S UTC` formats, without parsing that format for every
/// answer).
fn clock(t: DateTime<Utc>) -> String {
    use chrono::Timelike;
    format!("{:02}:{:02}:{:02} UTC", t.hour(), t.minute(), t.second())
}

/// A short reference to the first result for the note: the downstream's id when it gave one.
fn reference(state: &KeyState) -> String {
    state
        .result
        .as_ref()
        .and_then(|r| r.get("id"))
        .and_then(Value::as_str)
        .map_or_else(
            || format!("action {}", state.first_event_id),
            str::to_string,
        )
}

fn first_note(state: &KeyState) -> String {
    match state.status {
        OutcomeStatus::Succeeded if state.attempts <= 1 => {
            format!("Done at {} ({}).", clock(state.at), reference(state))
        }
        OutcomeStatus::Succeeded => format!(
            "Done at {} ({}) after {} attempts.",
            clock(state.at),
            reference(state),
            state.attempts
        ),
        OutcomeStatus::Failed => {
            let (msg, retryable) = state
                .error
                .as_ref()
                .map_or(("the downstream refused it", false), |e| {
                    (e.message.as_str(), e.retryable)
                });
            if retryable {
                format!("Failed: {msg}. It was not done; it may succeed later with a new request.")
            } else {
                format!("Failed: {msg}. It was not done; change the request before trying again.")
            }
        }
        OutcomeStatus::Unknown => {
            "Outcome unknown, verification pending: do not retry; a person will check.".to_string()
        }
        OutcomeStatus::PendingApproval => "Waiting for approval; do not retry.".to_string(),
        OutcomeStatus::Rejected => {
            let msg = state
                .error
                .as_ref()
                .map_or("rejected", |e| e.message.as_str());
            let next = state
                .error
                .as_ref()
                .and_then(|e| ErrorCode::parse(&e.code))
                .map_or(ErrorCode::SchemaInvalid.next_step(), ErrorCode::next_step);
            format!("Rejected: {msg}. Nothing was done; {next}.")
        }
    }
}

fn duplicate_note(state: &KeyState) -> String {
    match state.status {
        OutcomeStatus::Succeeded => format!(
            "Already done at {} ({}); not repeated. Do not retry.",
            clock(state.at),
            reference(state)
        ),
        OutcomeStatus::Failed => format!(
            "Already tried at {} and it failed; not repeated. Do not send the same request again.",
            clock(state.at)
        ),
        OutcomeStatus::Unknown => {
            "Already sent once and its outcome is unknown; not repeated. Do not retry: a person will check."
                .to_string()
        }
        OutcomeStatus::PendingApproval => "Already waiting for approval; do not retry.".to_string(),
        OutcomeStatus::Rejected => "Already rejected; not repeated.".to_string(),
    }
}

fn data(state: &KeyState, action_event_id: &str, duplicate: bool, note: String) -> OutcomeData {
    OutcomeData {
        idempotency_key: state.key.clone(),
        run_id: Some(state.run_id.clone()),
        step: state.step,
        tool: Some(state.tool.clone()),
        action_event_id: action_event_id.to_string(),
        status: state.status,
        result: state.result.clone(),
        error: state.error.clone(),
        duplicate,
        attempts: state.attempts,
        note,
    }
}

/// The key's own outcome for status change number `seq`, answering its first action event.
pub fn status_change(state: &KeyState, seq: i32, traceparent: Option<String>) -> Outcome {
    let mut outcome = Outcome::new(
        // The first event id keeps read-only intents (one per delivery, same key) apart.
        outcome_id(
            &state.key,
            &format!("status:{}:{seq}", state.first_event_id),
        ),
        data(state, &state.first_event_id, false, first_note(state)),
        state.at,
        traceparent,
    );
    outcome.follows = seq > 1;
    outcome
}

/// The answer to a later action event for the same key: the stored result, marked duplicate.
pub fn duplicate(state: &KeyState, action_event_id: &str, traceparent: Option<String>) -> Outcome {
    Outcome::new(
        outcome_id(&state.key, &format!("answer:{action_event_id}")),
        data(state, action_event_id, true, duplicate_note(state)),
        Utc::now(),
        traceparent,
    )
}

/// Same key, different material fields: nothing executed.
pub fn conflict(
    state: &KeyState,
    action_event_id: &str,
    step: Option<i64>,
    fields: Vec<String>,
    traceparent: Option<String>,
) -> Outcome {
    let list = fields.join(", ");
    let error = OutcomeError {
        fields: Some(fields),
        ..ErrorCode::KeyConflict.error(format!(
            "key {} was already used for a request with different {list}",
            state.key
        ))
    };
    let note = format!(
        "Rejected: this key was already used with a different {list}; nothing was done. If this is a different action, give it a new business id."
    );
    let mut d = data(state, action_event_id, false, note);
    d.status = OutcomeStatus::Rejected;
    d.result = None;
    d.error = Some(error);
    d.step = step;
    Outcome::new(
        outcome_id(&state.key, &format!("answer:{action_event_id}")),
        d,
        Utc::now(),
        traceparent,
    )
}

/// A new action a gate refused before it was recorded (stale resume, too many reattempts).
pub fn rejected_gate(state: &KeyState, traceparent: Option<String>) -> Outcome {
    let mut d = data(state, &state.first_event_id, false, first_note(state));
    d.result = None;
    Outcome::new(
        outcome_id(&state.key, &format!("answer:{}", state.first_event_id)),
        d,
        state.at,
        traceparent,
    )
}

/// Bad input whose run id and key could still be read.
pub fn rejected_input(
    p: &crate::action::PartialAction,
    code: ErrorCode,
    message: &str,
    traceparent: Option<String>,
) -> Outcome {
    let d = OutcomeData {
        idempotency_key: p.key.clone(),
        run_id: Some(p.run_id.clone()),
        step: p.step,
        tool: p.tool.clone(),
        action_event_id: p.event_id.clone(),
        status: OutcomeStatus::Rejected,
        result: None,
        error: Some(OutcomeError {
            fields: (!p.fields.is_empty()).then(|| p.fields.clone()),
            ..code.error(message)
        }),
        duplicate: false,
        attempts: 0,
        note: format!(
            "Rejected: {message}. Nothing was done; fix the request before sending it again."
        ),
    };
    Outcome::new(
        outcome_id(&p.key, &format!("answer:{}", p.event_id)),
        d,
        Utc::now(),
        traceparent,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_clock_reads_as_the_strftime_format_did() {
        for secs in [
            0,
            1,
            59,
            61,
            3_599,
            3_600,
            43_261,
            86_399,
            86_400,
            1_764_892_800,
            1_780_000_321,
        ] {
            for nanos in [0, 999_999_999] {
                let t = DateTime::from_timestamp(secs, nanos).unwrap();
                assert_eq!(clock(t), t.format("%H:%M:%S UTC").to_string(), "{t}");
            }
        }
    }

    fn state(status: OutcomeStatus) -> KeyState {
        KeyState {
            key: "run_42:send_email:order_8812".into(),
            run_id: "run_42".into(),
            step: Some(4),
            tool: "send_email".into(),
            status,
            result: Some(json!({"id": "msg_1041"})),
            error: None,
            attempts: 1,
            first_event_id: "evt-1".into(),
            at: "2026-12-02T10:00:03Z".parse().unwrap(),
        }
    }

    #[test]
    fn duplicate_of_success_says_do_not_retry() {
        let o = duplicate(&state(OutcomeStatus::Succeeded), "evt-2", None).json();
        let d = &o["data"];
        assert_eq!(d["status"], "succeeded");
        assert_eq!(d["duplicate"], true);
        assert_eq!(d["action_event_id"], "evt-2");
        assert_eq!(d["result"]["id"], "msg_1041");
        assert_eq!(
            d["note"],
            "Already done at 10:00:03 UTC (msg_1041); not repeated. Do not retry."
        );
        assert_eq!(o["subject"], "run_42:send_email:order_8812");
    }

    #[test]
    fn status_change_ids_are_stable() {
        let s = state(OutcomeStatus::Succeeded);
        assert_eq!(
            status_change(&s, 1, None).event_id,
            status_change(&s, 1, None).event_id
        );
        assert_eq!(
            status_change(&s, 1, None).payload,
            status_change(&s, 1, None).payload
        );
        assert_ne!(
            status_change(&s, 1, None).event_id,
            status_change(&s, 2, None).event_id
        );
    }

    #[test]
    fn conflict_names_fields() {
        let o = conflict(
            &state(OutcomeStatus::Succeeded),
            "evt-3",
            Some(5),
            vec!["args.to".into()],
            None,
        )
        .json();
        let d = &o["data"];
        assert_eq!(d["status"], "rejected");
        assert_eq!(d["error"]["code"], "key_conflict");
        assert_eq!(d["error"]["fields"], json!(["args.to"]));
        assert_eq!(d["duplicate"], false);
    }
}
