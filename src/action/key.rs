//! Idempotency keys and request fingerprints.
//!
//! A key names *one intended effect*. When the orchestrator sends none, the tool's key template
//! joins fields the model does not write freely (run id, tool, business id, a template name).
//! The material fingerprint covers the fields whose change under the same key is a conflict;
//! the args hash covers everything, so a repeat can be told apart as a replay (identical) or a
//! model retry (reworded).

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::action::ActionData;
use crate::config::{FieldPath, Tool};

pub const MAX_KEY_BYTES: usize = 255;

/// Why a key cannot be used; becomes a `rejected` outcome with code `invalid_key`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("key field {0} is missing from the action")]
    MissingField(String),
    #[error("key field {0} must be a string or a number")]
    NotScalar(String),
    #[error("key is empty")]
    Empty,
    #[error("key is {0} bytes; at most 255 are allowed")]
    TooLong(usize),
    #[error("key contains a control or non-printable character")]
    NotPrintable,
    #[error("key contains an e-mail address; keep personal data out of keys")]
    ContainsEmail,
}

/// Reads a field of an action: `run_id`, `tool`, `step`, `business_id` or `args.a.b`.
pub fn field<'a>(data: &'a ActionData, path: &FieldPath) -> FieldValue<'a> {
    match path.0.as_str() {
        "run_id" => FieldValue::Str(&data.run_id),
        "tool" => FieldValue::Str(&data.tool),
        "step" => data.step.map_or(FieldValue::Missing, FieldValue::Int),
        "business_id" => data
            .business_id
            .as_deref()
            .map_or(FieldValue::Missing, FieldValue::Str),
        other => {
            let rest = other.strip_prefix("args.").unwrap_or(other);
            let mut parts = rest.split('.');
            let first = parts.next().unwrap_or_default();
            let mut cur = data.args.get(first);
            for p in parts {
                cur = cur.and_then(|v| v.get(p));
            }
            cur.map_or(FieldValue::Missing, FieldValue::Json)
        }
    }
}

pub enum FieldValue<'a> {
    Missing,
    Str(&'a str),
    Int(i64),
    Json(&'a Value),
}

impl FieldValue<'_> {
    pub fn to_json(&self) -> Value {
        match self {
            FieldValue::Missing => Value::Null,
            FieldValue::Str(s) => Value::String((*s).to_string()),
            FieldValue::Int(i) => Value::from(*i),
            FieldValue::Json(v) => (*v).clone(),
        }
    }
}

/// The key of an action: the orchestrator's own, or the tool's template filled in.
pub fn derive_key(tool: &Tool, data: &ActionData) -> Result<String, KeyError> {
    let key = match &data.idempotency_key {
        Some(k) => k.clone(),
        None => {
            let mut parts = Vec::with_capacity(tool.key.len());
            for path in &tool.key {
                let part = match field(data, path) {
                    FieldValue::Missing | FieldValue::Json(Value::Null) => {
                        return Err(KeyError::MissingField(path.0.clone()))
                    }
                    FieldValue::Str(s) => s.to_string(),
                    FieldValue::Int(i) => i.to_string(),
                    FieldValue::Json(Value::String(s)) => s.clone(),
                    FieldValue::Json(Value::Number(n)) => n.to_string(),
                    FieldValue::Json(_) => return Err(KeyError::NotScalar(path.0.clone())),
                };
                parts.push(part);
            }
            parts.join(":")
        }
    };
    validate_key(&key)?;
    Ok(key)
}

pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(KeyError::TooLong(key.len()));
    }
    if key.chars().any(|c| c.is_control() || c == '\u{FFFD}') {
        return Err(KeyError::NotPrintable);
    }
    if contains_email(key) {
        return Err(KeyError::ContainsEmail);
    }
    Ok(())
}

/// `local@domain.tld`, with the usual characters on each side.
fn contains_email(s: &str) -> bool {
    let local_char = |c: char| c.is_alphanumeric() || "._%+-".contains(c);
    let domain_char = |c: char| c.is_alphanumeric() || ".-".contains(c);
    s.match_indices('@').any(|(at, _)| {
        let before = s[..at].chars().next_back().is_some_and(local_char);
        let domain: String = s[at + 1..]
            .chars()
            .take_while(|c| domain_char(*c))
            .collect();
        let dotted = domain.rsplit_once('.').is_some_and(|(host, tld)| {
            !host.is_empty() && tld.len() >= 2 && tld.chars().all(char::is_alphabetic)
        });
        before && dotted
    })
}

/// The material fields' values, by field name (null where absent).
pub fn material(tool: &Tool, data: &ActionData) -> Map<String, Value> {
    tool.material
        .iter()
        .map(|p| (p.0.clone(), field(data, p).to_json()))
        .collect()
}

/// Hash of canonical JSON: object keys sorted (serde_json's map keeps them so) and numbers
/// by value (see [`canonical`]), so equal values hash equal.
pub fn hash_json(v: &Value) -> String {
    hashed(|bytes| write_canonical(v, bytes))
}

/// [`hash_json`] of the object `m`, without building a value of it.
pub fn hash_object(m: &Map<String, Value>) -> String {
    hashed(|bytes| write_object(m, bytes))
}

/// The first 16 bytes of the SHA-256 of what `write` writes, in hex.
fn hashed(write: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut bytes = Vec::with_capacity(256);
    write(&mut bytes);
    hex::encode(&Sha256::digest(&bytes)[..16])
}

/// The integer a float with no fraction stands for (`5.0`, `1e2`), when an integer holds it
/// exactly; `None` for an integer already, a fraction, or a float past 2^53.
fn integral(n: &serde_json::Number) -> Option<i64> {
    match n.as_f64() {
        Some(f)
            if !n.is_i64()
                && !n.is_u64()
                && f.fract() == 0.0
                && f.abs() < 9.007_199_254_740_992e15 =>
        {
            Some(f as i64)
        }
        _ => None,
    }
}

/// The value with every number written the one way RFC 8785 writes it: a float with no
/// fraction that an integer holds exactly (`5.0`, `1e2`) becomes that integer, so `5` and
/// `5.0` are one amount. Integers past 2^53 stay as sent: reading them as doubles, as JSON
/// canonicalization does, would make two different amounts one.
pub fn canonical(v: &Value) -> Value {
    match v {
        Value::Number(n) => integral(n).map_or_else(|| v.clone(), Value::from),
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        Value::Object(m) => {
            Value::Object(m.iter().map(|(k, x)| (k.clone(), canonical(x))).collect())
        }
        other => other.clone(),
    }
}

/// Writes `serde_json::to_vec(&canonical(v))` without the copy: every action hashes its
/// arguments and its material fields, and the copy had been most of that cost.
fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    let written = match v {
        Value::Number(n) => match integral(n) {
            Some(i) => serde_json::to_writer(&mut *out, &i),
            None => serde_json::to_writer(&mut *out, n),
        },
        Value::Array(items) => {
            out.push(b'[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(x, out);
            }
            out.push(b']');
            Ok(())
        }
        Value::Object(m) => {
            write_object(m, out);
            Ok(())
        }
        other => serde_json::to_writer(&mut *out, other),
    };
    written.expect("json values serialize");
}

fn write_object(m: &Map<String, Value>, out: &mut Vec<u8>) {
    out.push(b'{');
    for (i, (k, x)) in m.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut *out, k).expect("strings serialize");
        out.push(b':');
        write_canonical(x, out);
    }
    out.push(b'}');
}

/// Names of the material fields whose values differ.
pub fn differing_fields(stored: &Value, incoming: &Map<String, Value>) -> Vec<String> {
    let empty = Map::new();
    let stored = stored.as_object().unwrap_or(&empty);
    let mut names: Vec<String> = stored
        .keys()
        .chain(incoming.keys())
        .filter(|k| {
            let value = |m: &Map<String, Value>| m.get(*k).map_or(Value::Null, canonical);
            value(stored) != value(incoming)
        })
        .cloned()
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use serde_json::json;

    fn tool() -> Tool {
        Config::from_toml(
            r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id", "args.template"]
material = ["args.to", "args.template"]
executor = { kind = "http", url = "http://127.0.0.1:1/x" }
"#,
            |_| None,
        )
        .unwrap()
        .tools
        .remove(0)
    }

    fn data(v: Value) -> ActionData {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn template_key_ignores_free_text() {
        let a = data(
            json!({"run_id": "run_42", "tool": "send_email", "business_id": "order_8812",
            "args": {"to": "x", "template": "refund_approved", "subject": "Your refund"}}),
        );
        let b = data(
            json!({"run_id": "run_42", "tool": "send_email", "business_id": "order_8812", "step": 5,
            "args": {"to": "x", "template": "refund_approved", "subject": "About your refund!"}}),
        );
        let t = tool();
        assert_eq!(
            derive_key(&t, &a).unwrap(),
            "run_42:send_email:order_8812:refund_approved"
        );
        assert_eq!(derive_key(&t, &a), derive_key(&t, &b));
        assert_eq!(
            hash_json(&Value::Object(material(&t, &a))),
            hash_json(&Value::Object(material(&t, &b)))
        );
        assert_ne!(
            hash_json(&Value::Object(a.args.clone())),
            hash_json(&Value::Object(b.args.clone()))
        );
    }

    /// Fingerprints are stored: a hash must never change with how it is computed. The same
    /// bytes as before the writer, and a pinned value.
    #[test]
    fn the_canonical_writer_writes_what_the_canonical_copy_serializes() {
        use proptest::prelude::*;
        proptest!(|(v in crate::arbitrary::json(".*"))| {
            let mut written = Vec::new();
            write_canonical(&v, &mut written);
            prop_assert_eq!(written, serde_json::to_vec(&canonical(&v)).unwrap());
            if let Value::Object(m) = &v {
                prop_assert_eq!(hash_object(m), hash_json(&v));
            }
        });
        // sha256(`{"a":5,"b":[1,"x\"y",{"c":null,"d":true}]}`), first 16 bytes.
        assert_eq!(
            hash_json(&json!({"b": [1, "x\"y", {"d": true, "c": null}], "a": 5.0})),
            "1313a2d940bed01f7e2d3a3b61220122"
        );
    }

    #[test]
    fn numbers_are_compared_by_value() {
        assert_eq!(hash_json(&json!({"a": 5})), hash_json(&json!({"a": 5.0})));
        assert_eq!(
            hash_json(&json!([100])),
            hash_json(&serde_json::from_str::<Value>("[1e2]").unwrap())
        );
        assert_ne!(hash_json(&json!(5)), hash_json(&json!(5.5)));
        assert_ne!(hash_json(&json!(5)), hash_json(&json!("5")));
        // Past 2^53 two integers stay two amounts.
        assert_ne!(
            hash_json(&json!(9_007_199_254_740_993_u64)),
            hash_json(&json!(9_007_199_254_740_992_u64))
        );
        let stored = json!({"args.amount": 5});
        let mut incoming = Map::new();
        incoming.insert("args.amount".into(), json!(5.0));
        assert!(differing_fields(&stored, &incoming).is_empty());
    }

    #[test]
    fn explicit_key_wins() {
        let d = data(
            json!({"run_id": "r", "tool": "send_email", "args": {}, "idempotency_key": "orch-1"}),
        );
        assert_eq!(derive_key(&tool(), &d).unwrap(), "orch-1");
    }

    #[test]
    fn missing_key_field_is_named() {
        let d = data(json!({"run_id": "r", "tool": "send_email", "args": {"template": "t"}}));
        assert_eq!(
            derive_key(&tool(), &d),
            Err(KeyError::MissingField("business_id".into()))
        );
    }

    #[test]
    fn keys_are_bounded_printable_and_free_of_emails() {
        assert_eq!(validate_key(&"k".repeat(255)), Ok(()));
        assert_eq!(validate_key(&"k".repeat(256)), Err(KeyError::TooLong(256)));
        assert_eq!(validate_key("a\nb"), Err(KeyError::NotPrintable));
        assert_eq!(validate_key(""), Err(KeyError::Empty));
        assert_eq!(
            validate_key("run:send:ada@example.com"),
            Err(KeyError::ContainsEmail)
        );
        assert_eq!(
            validate_key("run:send:Ada.Lovelace+x@mail.example.org:t"),
            Err(KeyError::ContainsEmail)
        );
        assert_eq!(validate_key("run@2:step@3"), Ok(()));
        assert_eq!(validate_key("team@home"), Ok(()));
    }

    #[test]
    fn differing_fields_are_listed() {
        let stored = json!({"args.to": "a", "args.template": "t"});
        let mut incoming = Map::new();
        incoming.insert("args.to".into(), json!("b"));
        incoming.insert("args.template".into(), json!("t"));
        assert_eq!(
            differing_fields(&stored, &incoming),
            vec!["args.to".to_string()]
        );
    }
}
