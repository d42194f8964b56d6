//! Strategies for the property tests over JSON that the crate's modules share.

use proptest::prelude::*;
use serde_json::Value;

/// Any JSON value: numbers of every kind serde_json writes differently (integers, unsigned,
/// floats, whole floats), nested arrays and objects four levels deep, its strings and object
/// keys drawn from the regular expression `strings`.
pub(crate) fn json(strings: &'static str) -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>()
            .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
        (-1_000_000i64..1_000_000).prop_map(|i| Value::from(i as f64)),
        strings.prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 64, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::btree_map(strings, inner, 0..8)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}
