//! The contract in: action events (CloudEvents 1.0, structured or binary mode), decoded, keyed
//! and fingerprinted.

use serde::Deserialize;
use serde_json::{Map, Value};

pub mod decode;
pub mod key;

pub use decode::{
    decode_action, schema_registry_frame, BadAction, DeadLetterReason, PartialAction,
};

pub const ACTION_TYPE: &str = "dev.idem.action.v1";
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";
/// Longest event id, run id, tool name or business id accepted.
pub const MAX_ID_BYTES: usize = 255;
/// A decoded action event.
#[derive(Debug, Clone)]
pub struct ActionEvent {
    pub id: String,
    pub source: String,
    pub time: Option<String>,
    pub traceparent: Option<String>,
    pub data: ActionData,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionData {
    pub run_id: String,
    pub tool: String,
    pub args: Map<String, Value>,
    #[serde(default)]
    pub step: Option<i64>,
    #[serde(default)]
    pub business_id: Option<String>,
    #[serde(default)]
    pub idempotency_key: Option<String>,
}

/// Kafka headers of one message, as (name, value) pairs.
pub type Headers<'a> = [(&'a str, &'a [u8])];
