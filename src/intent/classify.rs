//! What each message of a batch is: the first sight of a key, or which kind of repeat. Pure: the
//! batch's transaction reads what it needs and acts on the verdicts; nothing here touches the
//! database, so every repeat shape is tested without one.
//!
//! Two questions, asked at two points of [`record_batch`](super::record_batch):
//! - [`arrivals`], before any key is read: was this record, or this event id, seen before, and is
//!   this the first message of its key in the batch?
//! - [`repeat`], after the stored key is read (under a share lock unless it settled recently):
//!   is a repeat the record the key was first recorded from, the producer's retry, a replay, a
//!   model's reworded retry, or a conflict? (A key's first delivery is carried by its intent
//!   row, so the first question does not find it among the deliveries.)

use std::collections::HashSet;

use serde_json::Value;

use crate::action::key;
use crate::config::ToolClass;
use crate::outcome::{ErrorCode, KeyState};

use super::{Incoming, KeyedAction};

/// Why a message arrived, as counted by `idem_deliveries_total{origin}` and shown by `explain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    First,
    /// The same Kafka record again (a consumer restart or rebalance before the offset commit).
    Redelivery,
    /// The same event id in a new record (the producer retried a send).
    ProducerRetry,
    /// A new event id with identical args (an orchestrator retry or a resumed run).
    Replay,
    /// A new event id whose non-material args changed (the model reworded its call).
    ModelRetry,
    /// Same key, different material args: rejected.
    Conflict,
    DeadLetter,
}

impl Origin {
    pub const ALL: [Origin; 7] = [
        Origin::First,
        Origin::Redelivery,
        Origin::ProducerRetry,
        Origin::Replay,
        Origin::ModelRetry,
        Origin::Conflict,
        Origin::DeadLetter,
    ];

    /// The origins that are repeats suppressed (`idem_duplicates_total`).
    pub fn is_duplicate(self) -> bool {
        matches!(
            self,
            Origin::Redelivery | Origin::ProducerRetry | Origin::Replay | Origin::ModelRetry
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Origin::First => "first",
            Origin::Redelivery => "redelivery",
            Origin::ProducerRetry => "producer_retry",
            Origin::Replay => "replay",
            Origin::ModelRetry => "model_retry",
            Origin::Conflict => "conflict",
            Origin::DeadLetter => "dead_letter",
        }
    }
}

/// A Kafka record's address: (topic, partition, offset).
pub(crate) type RecordId = (String, i32, i64);

impl super::Position {
    /// The address of the record this position is.
    pub(crate) fn record_id(&self) -> RecordId {
        (self.topic.clone(), self.partition, self.offset)
    }
}

/// What a message is before any key state is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrival {
    /// This very record was recorded before: logged for `explain`, never executed or answered
    /// again.
    Redelivery,
    /// A message that could not be decoded. `answer`: its key and event id were readable and the
    /// event id is new, so it is answered with the rejection.
    DeadLetter { answer: bool },
    /// The event id was seen before, in another record: the producer retried its send.
    ProducerRetry,
    /// To be inserted: the first message of its key in this batch (a read-only action always is,
    /// since every delivery of one runs anew).
    Candidate,
    /// A later message of a key already a candidate in this batch: judged against the stored
    /// row, like any later repeat.
    SameKey,
}

/// Sorts a batch before any key is read. `seen_records` and `seen_events` are the records and
/// event ids the database already holds among this batch's.
pub(crate) fn arrivals(
    items: &[Incoming],
    seen_records: &HashSet<RecordId>,
    mut seen_events: HashSet<String>,
) -> Vec<Arrival> {
    let mut first_of_key: HashSet<&str> = HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    for item in items {
        let pos = match item {
            Incoming::Action(a) => &a.pos,
            Incoming::Rejected { pos, .. } => pos,
        };
        if seen_records.contains(&pos.record_id()) {
            out.push(Arrival::Redelivery);
            continue;
        }
        out.push(match item {
            Incoming::Rejected { partial, .. } => {
                let event_id = partial.as_ref().map_or("", |p| p.event_id.as_str());
                let answer = partial.is_some() && !seen_events.contains(event_id);
                seen_events.insert(event_id.to_string());
                Arrival::DeadLetter { answer }
            }
            Incoming::Action(a) => {
                if !seen_events.insert(a.event.id.clone()) {
                    Arrival::ProducerRetry
                } else if a.class == ToolClass::ReadOnly || first_of_key.insert(&a.key) {
                    Arrival::Candidate
                } else {
                    Arrival::SameKey
                }
            }
        });
    }
    out
}

/// A recorded key as a repeat is judged against it.
#[derive(Debug)]
pub(crate) struct StoredKey {
    pub id: i64,
    /// Its material fields as stored (`jsonb` as text), parsed only when a repeat's fingerprint
    /// differs ([`StoredKey::material`]): most repeats only compare fingerprints.
    pub material_json: String,
    pub fingerprint: String,
    pub args_hash: String,
    pub state: KeyState,
    /// Its status is one outcome events report (not a row still being recorded).
    pub reportable: bool,
    /// The record its first delivery came in, whose event id is `state.first_event_id`.
    pub first_record: RecordId,
}

impl StoredKey {
    /// The stored material fields (`null` if the text is not JSON, which Postgres' `jsonb` never
    /// gives: then every incoming field differs).
    fn material(&self) -> Value {
        serde_json::from_str(&self.material_json).unwrap_or(Value::Null)
    }
}

/// What a repeat is, once its stored key is read.
#[derive(Debug)]
pub(crate) enum Repeat<'k> {
    /// The very record the key was first recorded from: logged for `explain`, never executed or
    /// answered again (its answer is the key's own outcome).
    Redelivery,
    /// The producer's retry of an event already answered: logged, not answered again. `intent`
    /// is the stored key's id (none for a read-only action, which has no one key).
    ProducerRetry { intent: Option<i64> },
    /// The key was refused by a gate earlier in this batch: answered with the same refusal.
    Refused { code: ErrorCode, message: &'k str },
    /// No stored key, and no refusal: it was recorded in this transaction or before it, and only
    /// prune deletes intents (leaving a tombstone). The batch is recorded again from the start.
    Vanished,
    /// Same key, different material fields: rejected, naming the fields.
    Conflict {
        stored: &'k StoredKey,
        fields: Vec<String>,
    },
    /// A duplicate: answered with the stored outcome when it is reportable (`answered`), else
    /// when the key finishes.
    Duplicate {
        stored: &'k StoredKey,
        origin: Origin,
        answered: bool,
    },
}

/// Judges a repeat. `hint` is [`Origin::ProducerRetry`] for an [`Arrival::ProducerRetry`], else
/// [`Origin::Replay`]; `refused` is the refusal (code, message) a gate gave this key earlier in
/// the batch.
pub(crate) fn repeat<'k>(
    hint: Origin,
    action: &KeyedAction,
    stored: Option<&'k StoredKey>,
    refused: Option<&'k (ErrorCode, String)>,
) -> Repeat<'k> {
    // A read-only action is a repeat only as a producer retry: every other delivery of one is
    // recorded anew.
    if hint == Origin::ProducerRetry || action.class == ToolClass::ReadOnly {
        let intent = stored
            .map(|k| k.id)
            .filter(|_| action.class != ToolClass::ReadOnly);
        return Repeat::ProducerRetry { intent };
    }
    let Some(stored) = stored else {
        return match refused {
            Some((code, message)) => Repeat::Refused {
                code: *code,
                message,
            },
            None => Repeat::Vanished,
        };
    };
    // The key's first event again: the same request, whatever it holds now.
    if stored.state.first_event_id == action.event.id {
        return if stored.first_record == action.pos.record_id() {
            Repeat::Redelivery
        } else {
            Repeat::ProducerRetry {
                intent: Some(stored.id),
            }
        };
    }
    // A key is the tool's own: the same key sent to another tool is not a repeat of it (the
    // answer would be another tool's result).
    if stored.state.tool != action.tool {
        return Repeat::Conflict {
            stored,
            fields: vec!["tool".into()],
        };
    }
    if stored.fingerprint != action.fingerprint {
        let fields = key::differing_fields(&stored.material(), &action.material);
        return Repeat::Conflict { stored, fields };
    }
    let origin = if stored.args_hash == action.args_hash {
        Origin::Replay
    } else {
        Origin::ModelRetry
    };
    Repeat::Duplicate {
        stored,
        origin,
        answered: stored.reportable,
    }
}

#[cfg(test)]
mod tests {
    use chrono::Utc;
    use serde_json::{json, Map};

    use super::*;
    use crate::action::{ActionData, ActionEvent, DeadLetterReason, PartialAction};
    use crate::gates::Gates;
    use crate::intent::Position;
    use crate::outcome::OutcomeStatus;

    fn pos(offset: i64) -> Position {
        Position {
            schema_id: None,
            topic: "actions".into(),
            partition: 0,
            offset,
        }
    }

    fn object(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("an object")
    }

    /// An action of key `key` with event id `event` at `offset`; `to` is its material field.
    fn action(offset: i64, event: &str, key: &str, to: &str, note: &str) -> KeyedAction {
        let args = object(json!({"to": to, "note": note}));
        let material = object(json!({"args.to": to}));
        KeyedAction {
            pos: pos(offset),
            event: ActionEvent {
                id: event.into(),
                source: "agent".into(),
                time: None,
                traceparent: None,
                data: ActionData {
                    run_id: "r1".into(),
                    tool: "send_email".into(),
                    args: args.clone(),
                    step: None,
                    business_id: None,
                    idempotency_key: None,
                },
            },
            key: key.into(),
            tool: "send_email".into(),
            class: ToolClass::Dangerous,
            fingerprint: key::hash_object(&material),
            args_hash: key::hash_object(&args),
            material,
            gates: Gates::default(),
            claim_at_record: false,
        }
    }

    fn read_only(mut a: KeyedAction) -> KeyedAction {
        a.class = ToolClass::ReadOnly;
        a
    }

    fn incoming(a: KeyedAction) -> Incoming {
        Incoming::Action(Box::new(a))
    }

    fn rejected(offset: i64, event: Option<&str>) -> Incoming {
        Incoming::Rejected {
            pos: pos(offset),
            partial: event.map(|e| PartialAction {
                fields: Vec::new(),
                event_id: e.into(),
                run_id: "r1".into(),
                key: "k-bad".into(),
                tool: None,
                step: None,
            }),
            reason: DeadLetterReason::SchemaInvalid,
            message: "bad".into(),
        }
    }

    fn stored_from(a: &KeyedAction, id: i64, reportable: bool) -> StoredKey {
        StoredKey {
            id,
            material_json: Value::Object(a.material.clone()).to_string(),
            fingerprint: a.fingerprint.clone(),
            args_hash: a.args_hash.clone(),
            state: KeyState {
                key: a.key.clone(),
                run_id: "r1".into(),
                step: None,
                tool: a.tool.clone(),
                status: OutcomeStatus::Succeeded,
                result: None,
                error: None,
                attempts: 1,
                first_event_id: a.event.id.clone(),
                at: Utc::now(),
            },
            reportable,
            first_record: a.pos.record_id(),
        }
    }

    #[test]
    fn a_new_key_is_a_candidate_and_its_later_messages_are_judged_as_repeats() {
        let items = vec![
            incoming(action(0, "e1", "k1", "a@x", "hi")),
            incoming(action(1, "e2", "k1", "a@x", "hello")),
            incoming(action(2, "e3", "k2", "b@x", "hi")),
        ];
        let v = arrivals(&items, &HashSet::new(), HashSet::new());
        assert_eq!(
            v,
            [Arrival::Candidate, Arrival::SameKey, Arrival::Candidate]
        );
    }

    #[test]
    fn a_record_seen_before_is_a_redelivery_whatever_it_holds() {
        let items = vec![
            incoming(action(7, "e1", "k1", "a@x", "hi")),
            rejected(8, Some("e9")),
        ];
        let seen: HashSet<RecordId> =
            [("actions".to_string(), 0, 7), ("actions".to_string(), 0, 8)]
                .into_iter()
                .collect();
        let v = arrivals(&items, &seen, HashSet::new());
        assert_eq!(v, [Arrival::Redelivery, Arrival::Redelivery]);
    }

    #[test]
    fn an_event_id_seen_before_or_earlier_in_the_batch_is_a_producer_retry() {
        let items = vec![
            incoming(action(0, "e1", "k1", "a@x", "hi")),
            incoming(action(1, "e2", "k2", "a@x", "hi")),
            incoming(action(2, "e2", "k2", "a@x", "hi")),
        ];
        let before: HashSet<String> = ["e1".to_string()].into_iter().collect();
        let v = arrivals(&items, &HashSet::new(), before);
        assert_eq!(
            v,
            [
                Arrival::ProducerRetry,
                Arrival::Candidate,
                Arrival::ProducerRetry
            ]
        );
    }

    #[test]
    fn a_read_only_action_is_a_candidate_on_every_new_event_id() {
        let items = vec![
            incoming(read_only(action(0, "e1", "k1", "a@x", "hi"))),
            incoming(read_only(action(1, "e2", "k1", "a@x", "hi"))),
            incoming(read_only(action(2, "e2", "k1", "a@x", "hi"))),
        ];
        let v = arrivals(&items, &HashSet::new(), HashSet::new());
        assert_eq!(
            v,
            [
                Arrival::Candidate,
                Arrival::Candidate,
                Arrival::ProducerRetry
            ]
        );
    }

    #[test]
    fn a_dead_letter_is_answered_once_per_readable_event_id() {
        let items = vec![
            rejected(0, Some("e1")),
            rejected(1, Some("e1")),
            rejected(2, None),
            rejected(3, Some("e2")),
        ];
        let before: HashSet<String> = ["e2".to_string()].into_iter().collect();
        let v = arrivals(&items, &HashSet::new(), before);
        assert_eq!(
            v,
            [
                Arrival::DeadLetter { answer: true },
                Arrival::DeadLetter { answer: false },
                Arrival::DeadLetter { answer: false },
                Arrival::DeadLetter { answer: false },
            ]
        );
    }

    #[test]
    fn an_action_whose_event_id_a_dead_letter_used_is_a_producer_retry() {
        let items = vec![
            rejected(0, Some("e1")),
            incoming(action(1, "e1", "k1", "a@x", "hi")),
        ];
        let v = arrivals(&items, &HashSet::new(), HashSet::new());
        assert_eq!(
            v,
            [Arrival::DeadLetter { answer: true }, Arrival::ProducerRetry]
        );
    }

    /// A verdict in a few words, for comparing: the variant, the stored key's id, and its
    /// details.
    fn said(r: Repeat<'_>) -> String {
        match r {
            Repeat::Redelivery => "redelivery".into(),
            Repeat::ProducerRetry { intent } => format!("producer retry of {intent:?}"),
            Repeat::Refused { code, message } => format!("refused {}: {message}", code.as_str()),
            Repeat::Vanished => "vanished".into(),
            Repeat::Conflict { stored, fields } => {
                format!("conflict with {} on {fields:?}", stored.id)
            }
            Repeat::Duplicate {
                stored,
                origin,
                answered,
            } => format!(
                "{} of {}, {}",
                origin.as_str(),
                stored.id,
                if answered { "answered" } else { "waits" }
            ),
        }
    }

    #[test]
    fn identical_args_are_a_replay_and_reworded_ones_a_model_retry() {
        let stored = stored_from(&action(0, "e1", "k1", "a@x", "hi"), 41, true);
        let replay = action(1, "e2", "k1", "a@x", "hi");
        let reworded = action(2, "e3", "k1", "a@x", "hello there");
        let judge = |a: &KeyedAction| said(repeat(Origin::Replay, a, Some(&stored), None));
        assert_eq!(judge(&replay), "replay of 41, answered");
        assert_eq!(judge(&reworded), "model_retry of 41, answered");
    }

    #[test]
    fn a_duplicate_of_a_key_still_being_recorded_waits_for_its_answer() {
        let stored = stored_from(&action(0, "e1", "k1", "a@x", "hi"), 41, false);
        let replay = action(1, "e2", "k1", "a@x", "hi");
        let v = repeat(Origin::Replay, &replay, Some(&stored), None);
        assert_eq!(said(v), "replay of 41, waits");
    }

    #[test]
    fn different_material_fields_are_a_conflict_naming_them() {
        let stored = stored_from(&action(0, "e1", "k1", "a@x", "hi"), 41, true);
        let other = action(1, "e2", "k1", "b@x", "hi");
        let v = repeat(Origin::Replay, &other, Some(&stored), None);
        assert_eq!(said(v), r#"conflict with 41 on ["args.to"]"#);
    }

    #[test]
    fn the_same_key_under_another_tool_is_a_conflict_naming_the_tool() {
        let stored = stored_from(&action(0, "e1", "k1", "a@x", "hi"), 41, true);
        let mut other = action(1, "e2", "k1", "a@x", "hi");
        other.tool = "refund".into();
        let v = repeat(Origin::Replay, &other, Some(&stored), None);
        assert_eq!(said(v), r#"conflict with 41 on ["tool"]"#);
    }

    #[test]
    fn a_producer_retry_is_logged_against_the_stored_key_but_a_read_only_one_against_none() {
        let stored = stored_from(&action(0, "e1", "k1", "a@x", "hi"), 41, true);
        // Even with other material: the event id is the same, so it is the same request.
        let retry = action(1, "e1", "k1", "b@x", "hi");
        let ro = read_only(action(1, "e1", "k1", "a@x", "hi"));
        let pr = Origin::ProducerRetry;
        assert_eq!(
            said(repeat(pr, &retry, Some(&stored), None)),
            "producer retry of Some(41)"
        );
        assert_eq!(
            said(repeat(pr, &ro, Some(&stored), None)),
            "producer retry of None"
        );
        assert_eq!(
            said(repeat(pr, &retry, None, None)),
            "producer retry of None"
        );
    }

    #[test]
    fn the_keys_first_event_again_is_a_redelivery_in_its_record_and_else_a_producer_retry() {
        let first = action(0, "e1", "k1", "a@x", "hi");
        let stored = stored_from(&first, 41, false);
        let replay = Origin::Replay;
        assert_eq!(
            said(repeat(replay, &first, Some(&stored), None)),
            "redelivery"
        );
        // The same event id in another record, even with other material.
        let resent = action(5, "e1", "k1", "b@x", "hi");
        assert_eq!(
            said(repeat(replay, &resent, Some(&stored), None)),
            "producer retry of Some(41)"
        );
        let mut elsewhere = action(0, "e1", "k1", "a@x", "hi");
        elsewhere.pos.partition = 3;
        assert_eq!(
            said(repeat(replay, &elsewhere, Some(&stored), None)),
            "producer retry of Some(41)"
        );
    }

    #[test]
    fn a_key_without_a_row_is_refused_again_or_else_vanished() {
        let a = action(1, "e2", "k1", "a@x", "hi");
        let refusal = (ErrorCode::StaleResume, "pruned".to_string());
        let v = repeat(Origin::Replay, &a, None, Some(&refusal));
        assert_eq!(said(v), "refused stale_resume: pruned");
        assert_eq!(said(repeat(Origin::Replay, &a, None, None)), "vanished");
    }
}
