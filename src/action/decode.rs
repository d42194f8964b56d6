//! Decoding action messages. Decoding errors carry the dead-letter reason they map to.

use serde_json::Value;

use crate::outcome::ErrorCode;

use super::{ActionData, ActionEvent, Headers, ACTION_TYPE, MAX_ID_BYTES};

/// Why an action message was dead-lettered: the `idem-dlq-reason` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadLetterReason {
    NotJson,
    NotCloudEvent,
    SchemaInvalid,
    UnknownTool,
    Oversize,
    InvalidKey,
    InvalidArgs,
}

impl DeadLetterReason {
    pub const ALL: [DeadLetterReason; 7] = [
        DeadLetterReason::NotJson,
        DeadLetterReason::NotCloudEvent,
        DeadLetterReason::SchemaInvalid,
        DeadLetterReason::UnknownTool,
        DeadLetterReason::Oversize,
        DeadLetterReason::InvalidKey,
        DeadLetterReason::InvalidArgs,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::NotJson => "not_json",
            DeadLetterReason::NotCloudEvent => "not_cloudevent",
            DeadLetterReason::SchemaInvalid => "schema_invalid",
            DeadLetterReason::UnknownTool => "unknown_tool",
            DeadLetterReason::Oversize => "oversize",
            DeadLetterReason::InvalidKey => "invalid_key",
            DeadLetterReason::InvalidArgs => "invalid_args",
        }
    }

    /// The `error.code` of the rejected outcome sent when the run id and key can be read.
    pub fn error_code(self) -> ErrorCode {
        match self {
            DeadLetterReason::UnknownTool => ErrorCode::UnknownTool,
            DeadLetterReason::InvalidKey => ErrorCode::InvalidKey,
            DeadLetterReason::InvalidArgs => ErrorCode::InvalidArgs,
            _ => ErrorCode::SchemaInvalid,
        }
    }
}

/// A message that is not a usable action, with what could still be read of it.
#[derive(Debug, Clone)]
pub struct BadAction {
    pub reason: DeadLetterReason,
    pub detail: String,
    /// Present when the event was readable far enough to answer it.
    pub partial: Option<Box<PartialAction>>,
}

/// What a rejected outcome needs: enough to tell the producer which action failed.
#[derive(Debug, Clone)]
pub struct PartialAction {
    pub event_id: String,
    pub run_id: String,
    pub key: String,
    pub tool: Option<String>,
    pub step: Option<i64>,
    /// The values at fault (JSON pointers into `args`), for the answer's `error.fields`.
    pub fields: Vec<String>,
}

impl BadAction {
    fn new(reason: DeadLetterReason, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
            partial: None,
        }
    }
}

fn header<'a>(headers: &'a Headers<'a>, name: &str) -> Option<&'a [u8]> {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| *v)
}

fn header_str(headers: &Headers<'_>, name: &str) -> Result<Option<String>, BadAction> {
    match header(headers, name) {
        None => Ok(None),
        Some(v) => std::str::from_utf8(v)
            .map(|s| Some(s.to_string()))
            .map_err(|_| {
                BadAction::new(
                    DeadLetterReason::NotCloudEvent,
                    format!("header {name} is not UTF-8"),
                )
            }),
    }
}

/// Decodes one Kafka message. Binary mode when a `ce_specversion` header is present,
/// structured mode otherwise.
/// A Confluent Schema Registry frame: a zero byte, the schema id (4 bytes, big-endian), then
/// the JSON. JSON itself never starts with a zero byte, so the frame cannot be mistaken.
pub fn schema_registry_frame(payload: &[u8]) -> Option<(u32, &[u8])> {
    match payload {
        [0, a, b, c, d, rest @ ..] => Some((u32::from_be_bytes([*a, *b, *c, *d]), rest)),
        _ => None,
    }
}

pub fn decode_action(
    payload: Option<&[u8]>,
    kafka_key: Option<&[u8]>,
    headers: &Headers<'_>,
    max_bytes: usize,
) -> Result<ActionEvent, BadAction> {
    let payload = payload.unwrap_or_default();
    let payload = schema_registry_frame(payload).map_or(payload, |(_, json)| json);
    if payload.len() > max_bytes {
        return Err(BadAction::new(
            DeadLetterReason::Oversize,
            format!(
                "message is {} bytes; the limit is {max_bytes} (relay.max_message_bytes)",
                payload.len()
            ),
        ));
    }
    if let Some(event) = decode_usual(payload, headers) {
        return Ok(event);
    }
    decode_the_long_way(payload, kafka_key, headers)
}

/// A structured-mode action event whose attributes and data are all as they should be, read
/// straight into its fields: most events are. `None` for anything else (binary mode, a missing,
/// empty or mistyped attribute, a field given twice, an escaped NUL, data that does not check),
/// which [`decode_the_long_way`] reads again to say what is wrong, or to accept it: the two agree
/// on every event this accepts (a property test compares them).
fn decode_usual(payload: &[u8], headers: &Headers<'_>) -> Option<ActionEvent> {
    #[derive(serde::Deserialize)]
    struct Usual {
        specversion: String,
        id: String,
        source: String,
        #[serde(rename = "type")]
        ty: String,
        #[serde(default)]
        time: Option<String>,
        #[serde(default)]
        traceparent: Option<String>,
        data: ActionData,
    }
    if binary_mode(headers) {
        return None;
    }
    // A NUL can only come escaped; the long way names where (or finds it was a `\\u0000`).
    if payload.windows(6).any(|w| w == br"\u0000") {
        return None;
    }
    let event: Usual = serde_json::from_slice(payload).ok()?;
    let attributes_hold = event.specversion == "1.0"
        && !event.id.is_empty()
        && !event.source.is_empty()
        && event.ty == ACTION_TYPE;
    if !attributes_hold || check_data(&event.id, &event.data).is_err() {
        return None;
    }
    let traceparent = match event.traceparent {
        Some(t) => Some(t),
        None => header_str(headers, "traceparent").ok()?,
    };
    if traceparent
        .as_deref()
        .is_some_and(|t| !valid_traceparent(t))
    {
        return None;
    }
    Some(ActionEvent {
        id: event.id,
        source: event.source,
        time: event.time,
        traceparent,
        data: event.data,
    })
}

/// [`decode_action`] for an event [`decode_usual`] did not accept: the whole message read as JSON
/// first, then each attribute and the data checked in turn, so the error says what is wrong.
fn decode_the_long_way(
    payload: &[u8],
    kafka_key: Option<&[u8]>,
    headers: &Headers<'_>,
) -> Result<ActionEvent, BadAction> {
    let body: Value = serde_json::from_slice(payload).map_err(|e| {
        BadAction::new(
            DeadLetterReason::NotJson,
            format!("payload is not JSON: {e}"),
        )
    })?;

    let Envelope {
        id,
        source,
        ty,
        specversion,
        time,
        traceparent,
        data,
    } = envelope(body, headers)?;

    let need = |v: Option<String>, name: &str| {
        v.filter(|s| !s.is_empty()).ok_or_else(|| {
            BadAction::new(
                DeadLetterReason::NotCloudEvent,
                format!("required CloudEvents attribute {name} is missing or empty"),
            )
        })
    };
    let specversion = need(specversion, "specversion")?;
    if specversion != "1.0" {
        return Err(BadAction::new(
            DeadLetterReason::NotCloudEvent,
            format!("specversion is {specversion:?}; only 1.0 is understood"),
        ));
    }
    let id = need(id, "id")?;
    let source = need(source, "source")?;
    let ty = need(ty, "type")?;

    let data = data.unwrap_or(Value::Null);
    // Read what we can before validating, so a schema-invalid event can still be answered.
    let partial = partial_from(&id, &data, kafka_key).map(Box::new);
    let fail = |reason, detail: String| BadAction {
        reason,
        detail,
        partial: partial.clone(),
    };
    if ty != ACTION_TYPE {
        return Err(fail(
            DeadLetterReason::SchemaInvalid,
            format!("type is {ty:?}; expected {ACTION_TYPE:?}"),
        ));
    }
    if let Some(path) = find_nul(&data, "data") {
        return Err(fail(
            DeadLetterReason::SchemaInvalid,
            format!("{path} contains a NUL character, which cannot be stored"),
        ));
    }
    let data: ActionData = serde_json::from_value(data)
        .map_err(|e| fail(DeadLetterReason::SchemaInvalid, format!("data: {e}")))?;
    check_data(&id, &data).map_err(|detail| fail(DeadLetterReason::SchemaInvalid, detail))?;
    if let Some(traceparent) = &traceparent {
        if !valid_traceparent(traceparent) {
            return Err(fail(
                DeadLetterReason::SchemaInvalid,
                format!("traceparent {traceparent:?} is not W3C trace context"),
            ));
        }
    }
    Ok(ActionEvent {
        id,
        source,
        time,
        traceparent,
        data,
    })
}

/// The CloudEvents attributes and data of a message, in either mode, not yet checked.
struct Envelope {
    id: Option<String>,
    source: Option<String>,
    ty: Option<String>,
    specversion: Option<String>,
    time: Option<String>,
    traceparent: Option<String>,
    data: Option<Value>,
}

/// Reads the attributes from `ce_*` headers (binary mode) or from the JSON object itself
/// (structured mode).
fn envelope(body: Value, headers: &Headers<'_>) -> Result<Envelope, BadAction> {
    if binary_mode(headers) {
        Ok(Envelope {
            id: header_str(headers, "ce_id")?,
            source: header_str(headers, "ce_source")?,
            ty: header_str(headers, "ce_type")?,
            specversion: header_str(headers, "ce_specversion")?,
            time: header_str(headers, "ce_time")?,
            traceparent: header_str(headers, "ce_traceparent")?
                .or(header_str(headers, "traceparent")?),
            data: Some(body),
        })
    } else {
        let Value::Object(mut event) = body else {
            return Err(BadAction::new(
                    DeadLetterReason::NotCloudEvent,
                    "payload is not a JSON object with CloudEvents attributes, and there are no ce_* headers",
                ));
        };
        if !event.contains_key("specversion") {
            return Err(BadAction::new(
                    DeadLetterReason::NotCloudEvent,
                    "no specversion attribute (structured mode) and no ce_specversion header (binary mode)",
                ));
        }
        let mut text = |name: &str| -> Result<Option<String>, BadAction> {
            match event.remove(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s)),
                Some(_) => Err(BadAction::new(
                    DeadLetterReason::NotCloudEvent,
                    format!("attribute {name} must be a string"),
                )),
            }
        };
        let id = text("id")?;
        let source = text("source")?;
        let ty = text("type")?;
        let specversion = text("specversion")?;
        let time = text("time")?;
        let traceparent = match text("traceparent")? {
            Some(t) => Some(t),
            None => header_str(headers, "traceparent")?,
        };
        Ok(Envelope {
            id,
            source,
            ty,
            specversion,
            time,
            traceparent,
            data: event.remove("data"),
        })
    }
}

/// Whether a message is in binary mode, by the Kafka protocol binding: a content-type of
/// application/cloudevents… is structured mode, whatever ce_* headers ride along; otherwise
/// ce_* headers make it binary mode.
fn binary_mode(headers: &Headers<'_>) -> bool {
    let structured =
        header(headers, "content-type").is_some_and(|v| v.starts_with(b"application/cloudevents"));
    !structured && header(headers, "ce_specversion").is_some()
}

/// The checks on an action's data that its schema cannot say: sizes, NULs, empty names.
fn check_data(id: &str, data: &ActionData) -> Result<(), String> {
    for (name, value) in [
        ("id", Some(id)),
        ("data.run_id", Some(data.run_id.as_str())),
        ("data.tool", Some(data.tool.as_str())),
        ("data.business_id", data.business_id.as_deref()),
    ] {
        if value.is_some_and(|v| v.len() > MAX_ID_BYTES || v.contains('\0')) {
            return Err(format!(
                "{name} must be at most {MAX_ID_BYTES} bytes, without NUL"
            ));
        }
    }
    if data.run_id.is_empty() {
        return Err("data.run_id must not be empty".into());
    }
    if data.tool.is_empty() {
        return Err("data.tool must not be empty".into());
    }
    if data.step.is_some_and(|s| s < 0) {
        return Err("data.step must be >= 0".into());
    }
    Ok(())
}

fn partial_from(event_id: &str, data: &Value, kafka_key: Option<&[u8]>) -> Option<PartialAction> {
    let run_id = data
        .get("run_id")?
        .as_str()
        .filter(|s| !s.is_empty())?
        .to_string();
    let key = data
        .get("idempotency_key")
        .and_then(Value::as_str)
        .map(str::to_string)
        // The producer keys its messages by the idempotency key (or the run id).
        .or_else(|| {
            kafka_key
                .and_then(|k| std::str::from_utf8(k).ok())
                .map(str::to_string)
        })
        .filter(|k| crate::action::key::validate_key(k).is_ok())
        .unwrap_or_else(|| run_id.clone());
    let storable = |s: &str| s.len() <= MAX_ID_BYTES && !s.contains('\0');
    if !storable(&run_id) || !storable(event_id) {
        return None;
    }
    Some(PartialAction {
        fields: Vec::new(),
        event_id: event_id.to_string(),
        run_id,
        key,
        tool: data.get("tool").and_then(Value::as_str).map(str::to_string),
        step: data.get("step").and_then(Value::as_i64),
    })
}

/// The first string (or object key) holding a NUL, which Postgres cannot store.
pub fn find_nul(v: &Value, path: &str) -> Option<String> {
    // The path below `v` is built only on the way back from a find: most events have none,
    // and formatting every field's path had cost each one an allocation per field.
    fn below(v: &Value) -> Option<String> {
        match v {
            Value::String(s) => s.contains('\0').then(String::new),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(i, x)| below(x).map(|rest| format!("[{i}]{rest}"))),
            Value::Object(m) => m.iter().find_map(|(k, x)| {
                if k.contains('\0') {
                    Some(String::new())
                } else {
                    below(x).map(|rest| format!(".{k}{rest}"))
                }
            }),
            _ => None,
        }
    }
    below(v).map(|rest| format!("{path}{rest}"))
}

fn valid_traceparent(t: &str) -> bool {
    let parts: Vec<&str> = t.split('-').collect();
    let hex = |s: &str, n: usize| {
        s.len() == n && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    };
    parts.len() == 4
        && hex(parts[0], 2)
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MAX: usize = 1 << 20;

    fn structured(data: Value) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "specversion": "1.0", "id": "evt-1", "source": "agent", "type": ACTION_TYPE, "data": data
        }))
        .unwrap()
    }

    /// The usual way accepts exactly what the long way accepts, and reads it the same, for any
    /// event in structured mode without a field given twice or a `\\u0000` in it (those take
    /// the long way whatever they hold); binary mode always takes the long way.
    #[test]
    fn the_usual_way_and_the_long_way_agree() {
        use proptest::prelude::*;
        // Mostly valid, so that most events are ones the usual way takes.
        let names = prop_oneof![8 => "[a-z_]{1,6}", 1 => ".{0,3}", 1 => Just("a\0b".to_string())];
        let text = || {
            prop_oneof![
                4 => Just(Value::Null),
                1 => any::<i64>().prop_map(Value::from),
                2 => "[a-z0-9.:-]{0,8}".prop_map(Value::from),
                4 => Just(Value::from("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")),
            ]
        };
        let data = (
            (
                names.clone(),
                names.clone(),
                prop::option::of(names.clone()),
            ),
            prop::option::of(prop_oneof![
                8 => (0..1_000_000i64).prop_map(Value::from),
                1 => any::<i64>().prop_map(Value::from),
                1 => Just(json!(2.5)),
                1 => Just(json!("3")),
            ]),
            // Now and then a NUL, which no check of the data's fields would see.
            prop::collection::btree_map(
                "[a-z\"\\\\ \u{0}]{0,3}",
                crate::arbitrary::json("[a-z\"\\\\ \u{0}]{0,3}"),
                0..4,
            ),
            prop::option::of(prop_oneof![
                Just(json!(null)),
                Just(json!("k")),
                Just(json!(7))
            ]),
            prop::bool::weighted(0.1),
        )
            .prop_map(|((run, tool, business), step, args, key, extra)| {
                let mut d = json!({"run_id": run, "tool": tool, "args": args});
                if let Some(b) = business {
                    d["business_id"] = json!(b);
                }
                if let Some(s) = step {
                    d["step"] = s;
                }
                if let Some(k) = key {
                    d["idempotency_key"] = k;
                }
                if extra {
                    d["unexpected"] = json!(1);
                }
                d
            });
        let attributes = (
            prop_oneof![8 => Just(json!("1.0")), 1 => Just(json!("0.3")), 1 => Just(json!(1))],
            prop_oneof![8 => Just(json!("evt-1")), 1 => Just(json!("")), 1 => Just(json!(5))],
            prop_oneof![8 => Just(ACTION_TYPE.to_string()), 1 => Just("other".to_string())],
            text(),
            text(),
            prop::bool::weighted(0.9),
        );
        let headers = prop_oneof![
            4 => Just(vec![]),
            2 => Just(vec![("content-type", &b"application/cloudevents+json"[..])]),
            1 => Just(vec![("ce_specversion", &b"1.0"[..])]),
            1 => Just(vec![(
                "traceparent",
                &b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"[..],
            )]),
            1 => Just(vec![("traceparent", &b"nope"[..])]),
        ];
        let usual_taken = std::sync::atomic::AtomicUsize::new(0);
        proptest!(ProptestConfig::with_cases(1024), |(
            data in data,
            (specversion, id, ty, time, trace, source) in attributes,
            headers in headers,
            data_present in prop::bool::weighted(0.9),
        )| {
            let mut event = json!({"specversion": specversion, "id": id, "type": ty});
            if source {
                event["source"] = json!("agent");
            }
            if !time.is_null() {
                event["time"] = time;
            }
            if !trace.is_null() {
                event["traceparent"] = trace;
            }
            if data_present {
                event["data"] = data;
            }
            let bytes = serde_json::to_vec(&event).unwrap();
            let usual = decode_usual(&bytes, &headers);
            let long = decode_the_long_way(&bytes, None, &headers);
            let comparable = !binary_mode(&headers) && !bytes.windows(6).any(|w| w == br"\u0000");
            if usual.is_some() {
                usual_taken.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            match (&usual, &long) {
                (Some(u), Ok(l)) => prop_assert_eq!(format!("{u:?}"), format!("{l:?}")),
                (Some(u), Err(e)) => prop_assert!(false, "usual took {u:?}, long refused: {}", e.detail),
                (None, Ok(_)) => prop_assert!(!comparable, "only the long way took {event}"),
                (None, Err(_)) => {}
            }
        });
        // Not vacuous: many of the events went the usual way, and a plain one does.
        let taken = usual_taken.into_inner();
        // About 57 of 1,024 on average; fewer than 25 would be four standard deviations off.
        assert!(taken >= 25, "only {taken} of the events went the usual way");
        let plain = structured(json!({"run_id": "r", "tool": "t", "args": {}}));
        assert!(decode_usual(&plain, &[]).is_some());
    }

    #[test]
    fn structured_mode_decodes() {
        let body = structured(
            json!({"run_id": "r1", "tool": "send_email", "args": {"to": "a"}, "step": 4}),
        );
        let e = decode_action(Some(&body), None, &[], MAX).unwrap();
        assert_eq!(e.id, "evt-1");
        assert_eq!(e.data.run_id, "r1");
        assert_eq!(e.data.step, Some(4));
        assert_eq!(e.data.args["to"], "a");
    }

    #[test]
    fn a_nul_is_named_by_its_path() {
        let nested = json!({"args": {"to": "a", "items": [{"note": "ok"}, {"note": "x\u{0}y"}]}});
        assert_eq!(
            find_nul(&nested, "data").as_deref(),
            Some("data.args.items[1].note")
        );
        // A key holding a NUL is named by the object it is in.
        let key = json!({"args": {"a\u{0}b": 1}});
        assert_eq!(find_nul(&key, "data").as_deref(), Some("data.args"));
        assert_eq!(
            find_nul(&json!({"args": {"to": ["a", 1, null]}}), "data"),
            None
        );

        let body = structured(json!({"run_id": "r1", "tool": "t", "args": {"to": "\u{0}"}}));
        let e = decode_action(Some(&body), None, &[], MAX).unwrap_err();
        assert_eq!(
            e.detail,
            "data.args.to contains a NUL character, which cannot be stored"
        );
    }

    #[test]
    fn binary_mode_decodes() {
        let body = serde_json::to_vec(&json!({"run_id": "r1", "tool": "t", "args": {}})).unwrap();
        let headers: Vec<(&str, &[u8])> = vec![
            ("ce_specversion", b"1.0"),
            ("ce_id", b"evt-9"),
            ("ce_source", b"agent"),
            ("ce_type", ACTION_TYPE.as_bytes()),
            ("content-type", b"application/json"),
        ];
        let e = decode_action(Some(&body), None, &headers, MAX).unwrap();
        assert_eq!(e.id, "evt-9");
        assert_eq!(e.data.tool, "t");
    }

    /// The Kafka protocol binding decides the mode by content-type: a structured event that
    /// also carries ce_* headers (some producers copy them) is read from its body.
    #[test]
    fn a_structured_content_type_wins_over_ce_headers() {
        let body = structured(json!({"run_id": "r1", "tool": "t", "args": {}}));
        let headers: Vec<(&str, &[u8])> = vec![
            (
                "content-type",
                b"application/cloudevents+json; charset=utf-8",
            ),
            ("ce_specversion", b"1.0"),
            ("ce_id", b"header-id"),
        ];
        let e = decode_action(Some(&body), None, &headers, MAX).unwrap();
        assert_eq!(e.id, "evt-1", "the body's id, not the header's");
        assert_eq!(e.data.run_id, "r1");
    }

    #[test]
    fn a_schema_registry_frame_is_stripped_and_its_id_read() {
        let json = structured(json!({"run_id": "r1", "tool": "t", "args": {}}));
        let mut framed = vec![0, 0, 0, 1, 44];
        framed.extend_from_slice(&json);
        assert_eq!(schema_registry_frame(&framed).map(|(id, _)| id), Some(300));
        assert_eq!(
            schema_registry_frame(&json),
            None,
            "plain JSON has no frame"
        );
        assert_eq!(
            schema_registry_frame(&[0, 1, 2]),
            None,
            "too short to be a frame"
        );
        let e = decode_action(Some(&framed), None, &[], MAX).unwrap();
        assert_eq!(e.id, "evt-1");
    }

    #[test]
    fn each_bad_input_has_its_reason() {
        let cases: Vec<(Vec<u8>, DeadLetterReason)> = vec![
            (b"not json {".to_vec(), DeadLetterReason::NotJson),
            (b"[1,2]".to_vec(), DeadLetterReason::NotCloudEvent),
            (
                br#"{"hello":"world"}"#.to_vec(),
                DeadLetterReason::NotCloudEvent,
            ),
            (
                br#"{"specversion":"0.3","id":"x","source":"s","type":"t"}"#.to_vec(),
                DeadLetterReason::NotCloudEvent,
            ),
            (
                structured(json!({"run_id": "r1", "tool": "t"})),
                DeadLetterReason::SchemaInvalid,
            ),
            (
                structured(json!({"run_id": "r1", "tool": "t", "args": [], "extra": 1})),
                DeadLetterReason::SchemaInvalid,
            ),
            (
                structured(json!({"run_id": "r1", "tool": "t", "args": {"x": "a\u{0}b"}})),
                DeadLetterReason::SchemaInvalid,
            ),
            (
                structured(json!({"run_id": "r".repeat(300), "tool": "t", "args": {}})),
                DeadLetterReason::SchemaInvalid,
            ),
            (
                structured(json!({"run_id": "r1", "tool": "t", "args": {"x": "a\u{0}b"}})),
                DeadLetterReason::SchemaInvalid,
            ),
            (
                structured(json!({"run_id": "r".repeat(300), "tool": "t", "args": {}})),
                DeadLetterReason::SchemaInvalid,
            ),
            (vec![b' '; MAX + 1], DeadLetterReason::Oversize),
        ];
        for (body, reason) in cases {
            let e = decode_action(Some(&body), None, &[], MAX).unwrap_err();
            assert_eq!(
                e.reason,
                reason,
                "{}",
                String::from_utf8_lossy(&body[..body.len().min(80)])
            );
            assert!(!e.detail.is_empty());
        }
    }

    #[test]
    fn schema_invalid_keeps_what_it_could_read() {
        let body = structured(json!({"run_id": "r1", "tool": "t", "idempotency_key": "k1"}));
        let e = decode_action(Some(&body), None, &[], MAX).unwrap_err();
        let p = e.partial.expect("partial");
        assert_eq!(
            (p.run_id.as_str(), p.key.as_str(), p.event_id.as_str()),
            ("r1", "k1", "evt-1")
        );
    }

    #[test]
    fn traceparent_is_checked() {
        assert!(valid_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        ));
        assert!(!valid_traceparent("00-xyz-00f067aa0ba902b7-01"));
    }
}
