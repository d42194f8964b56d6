//! Property tests of the contract's pure edges: the decoder, key derivation and the material
//! fingerprint, over arbitrary input. No broker or database.

use idem::action::{decode_action, key, ActionData};
use idem::config::Config;
use proptest::prelude::*;
use serde_json::{json, Value};

fn tool() -> idem::config::Tool {
    Config::from_toml(
        r#"
[[tools]]
name = "send_email"
class = "dangerous"
key = ["run_id", "tool", "business_id", "args.template"]
material = ["args.to", "args.amount"]
executor = { kind = "http", url = "http://127.0.0.1:1/x" }
approval = "none"
"#,
        |_| None,
    )
    .unwrap()
    .tools
    .remove(0)
}

/// Any JSON value, a few levels deep.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(".{0,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary bytes, as payload and as header values, are decoded or refused: never a panic.
    #[test]
    fn the_decoder_never_panics(
        payload in prop::collection::vec(any::<u8>(), 0..512),
        kafka_key in prop::option::of(prop::collection::vec(any::<u8>(), 0..32)),
        header in prop::collection::vec(any::<u8>(), 0..32),
        binary in any::<bool>(),
    ) {
        let headers: Vec<(&str, &[u8])> = if binary {
            vec![("ce_specversion", b"1.0"), ("ce_id", &header), ("ce_type", &header)]
        } else {
            vec![("traceparent", &header)]
        };
        let _ = decode_action(Some(&payload), kafka_key.as_deref(), &headers, 4096);
    }

    /// Arbitrary JSON as an event's data is decoded or refused: never a panic.
    #[test]
    fn arbitrary_data_never_panics(data in json_value()) {
        let body = serde_json::to_vec(&json!({
            "specversion": "1.0", "id": "e", "source": "s",
            "type": idem::action::ACTION_TYPE, "data": data,
        })).unwrap();
        let _ = decode_action(Some(&body), None, &[], 1 << 20);
    }

    /// Derivation never panics, and a derived key is one `validate_key` accepts.
    #[test]
    fn derived_keys_are_valid_keys(
        run in ".{0,40}", business in prop::option::of(".{0,40}"), template in json_value(),
    ) {
        let data: ActionData = serde_json::from_value(json!({
            "run_id": run, "tool": "send_email", "business_id": business,
            "args": {"template": template},
        })).unwrap();
        if let Ok(k) = key::derive_key(&tool(), &data) {
            prop_assert!(key::validate_key(&k).is_ok(), "{k:?}");
        }
    }

    /// A key the producer supplies comes back unchanged when it is valid, and is refused, not
    /// altered, when it is not.
    #[test]
    fn explicit_keys_round_trip(k in ".{0,80}", args in json_value()) {
        let data: ActionData = serde_json::from_value(json!({
            "run_id": "r", "tool": "send_email", "idempotency_key": k,
            "args": {"x": args},
        })).unwrap();
        match key::derive_key(&tool(), &data) {
            Ok(derived) => prop_assert_eq!(derived, k),
            Err(_) => prop_assert!(key::validate_key(&k).is_err()),
        }
    }

    /// The fingerprint is a function of the value: it survives a trip through JSON text, and
    /// an integer and the same amount written as a float are one.
    #[test]
    fn the_fingerprint_is_canonical(v in json_value(), n in -(1i64 << 52)..(1i64 << 52)) {
        let again: Value = serde_json::from_str(&serde_json::to_string(&v).unwrap()).unwrap();
        prop_assert_eq!(key::hash_json(&v), key::hash_json(&again));
        prop_assert_eq!(
            key::hash_json(&json!({"amount": n})),
            key::hash_json(&json!({"amount": n as f64}))
        );
        let tool = tool();
        let int: ActionData = serde_json::from_value(json!({
            "run_id": "r", "tool": "send_email", "args": {"to": "a", "amount": n}})).unwrap();
        let float: ActionData = serde_json::from_value(json!({
            "run_id": "r", "tool": "send_email", "args": {"to": "a", "amount": n as f64}})).unwrap();
        let (a, b) = (key::material(&tool, &int), key::material(&tool, &float));
        prop_assert_eq!(key::hash_json(&Value::Object(a.clone())), key::hash_json(&Value::Object(b.clone())));
        prop_assert!(key::differing_fields(&Value::Object(a), &b).is_empty());
    }
}
