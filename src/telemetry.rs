//! OpenTelemetry traces over OTLP (HTTP, protobuf), off unless `OTEL_EXPORTER_OTLP_ENDPOINT`
//! (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the standard `OTEL_*` variables (headers,
//! timeout, service name, resource attributes, batch processor) are honoured by the SDK.
//!
//! An action's life crosses tasks, batches, group commits and sometimes relays: it is consumed
//! in one batch, executed by a worker, finished in a group commit and published by the outbox
//! loop, possibly after a crash. So its spans are not held open in memory: each stage emits the
//! span it knows (with its own start and end) when it ends, and every span id is derived from
//! the key, so any stage in any relay names the same parent:
//!
//! - `process <actions topic>` (consumer): the action, from its record to its outcome's publish;
//!   its parent is the incoming `traceparent` (the trace id is derived from the key without one);
//! - `record` (its child): the batch transaction that recorded the delivery;
//! - `call <tool>` / `verify <tool>` (client): each attempt; the downstream receives the
//!   attempt's own `traceparent`;
//! - `send <outcomes topic>` (producer): the outcome's publish; the outcome event carries its
//!   context, in the `traceparent` header and attribute.

use std::sync::OnceLock;
use std::time::SystemTime;

use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{
    BatchSpanProcessor, SpanData, SpanEvents, SpanLinks, SpanProcessor,
};
use sha2::{Digest, Sha256};

pub use opentelemetry::trace::SpanKind as Kind;
pub use opentelemetry::KeyValue as Attribute;

struct Exporter {
    processor: BatchSpanProcessor,
    scope: InstrumentationScope,
}

static EXPORTER: OnceLock<Exporter> = OnceLock::new();

/// Whether spans are exported (after [`init`] found an endpoint).
pub fn enabled() -> bool {
    EXPORTER.get().is_some()
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// Starts the exporter when the environment asks for it; `Ok(false)` when it does not. Call
/// once, inside the Tokio runtime (the exporter's HTTP requests run on it).
pub fn init() -> anyhow::Result<bool> {
    let endpoint =
        env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT").or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT"));
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"));
    let Some(endpoint) = endpoint.filter(|_| !disabled) else {
        return Ok(false);
    };
    let protocol =
        env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL").or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
    if let Some(p) = protocol.filter(|p| p != "http/protobuf") {
        anyhow::bail!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={p}: idem exports OTLP over http/protobuf only (port 4318 of a collector, not gRPC's 4317)"
        );
    }
    use opentelemetry_otlp::WithHttpConfig;
    let client = HttpClient {
        client: reqwest::Client::new(),
        runtime: tokio::runtime::Handle::current(),
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(client)
        .build()
        .map_err(|e| anyhow::anyhow!("OTLP exporter to {endpoint}: {e}"))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    let named = env("OTEL_SERVICE_NAME").is_some()
        || env("OTEL_RESOURCE_ATTRIBUTES").is_some_and(|a| a.contains("service.name="));
    if !named {
        resource = resource.with_service_name("idem");
    }
    let mut processor = BatchSpanProcessor::builder(exporter).build();
    processor.set_resource(&resource.build());
    let scope = InstrumentationScope::builder("idem")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build();
    if EXPORTER.set(Exporter { processor, scope }).is_err() {
        anyhow::bail!("telemetry started twice");
    }
    tracing::info!(%endpoint, "exporting traces over OTLP");
    Ok(true)
}

/// Sends what is buffered and stops the exporter (at shutdown).
pub fn shutdown() {
    if let Some(e) = EXPORTER.get() {
        if let Err(err) = e.processor.shutdown() {
            tracing::warn!(error = %err, "OTLP exporter: spans lost at shutdown");
        }
    }
}

/// The exporter's HTTP, on the relay's own reqwest and Tokio runtime: the batch processor
/// calls it from its own thread, outside the runtime.
#[derive(Debug)]
struct HttpClient {
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for HttpClient {
    async fn send_bytes(
        &self,
        request: opentelemetry_http::Request<opentelemetry_http::Bytes>,
    ) -> Result<
        opentelemetry_http::Response<opentelemetry_http::Bytes>,
        opentelemetry_http::HttpError,
    > {
        let client = self.client.clone();
        let request = reqwest::Request::try_from(request.map(reqwest::Body::from))?;
        self.runtime
            .spawn(async move {
                let response = client.execute(request).await?;
                let mut answer =
                    opentelemetry_http::Response::builder().status(response.status().as_u16());
                for (name, value) in response.headers() {
                    answer = answer.header(name.as_str(), value.as_bytes());
                }
                let body = response.bytes().await?;
                Ok::<_, opentelemetry_http::HttpError>(answer.body(body)?)
            })
            .await?
    }
}

/// When each recent action was first consumed here, so its span starts there (the record span
/// is its first child). Bounded: the oldest entries go first. A key finished by another relay
/// (after a crash) starts its span at the intent's creation instead.
struct Starts {
    at: std::collections::HashMap<String, SystemTime>,
    /// Insertion order, for eviction; entries already read stay until they come up.
    order: std::collections::VecDeque<(String, SystemTime)>,
}

const STARTS_KEPT: usize = 100_000;

static STARTS: std::sync::Mutex<Option<Starts>> = std::sync::Mutex::new(None);

/// Notes that the action keyed `key` was consumed at `at` (the first time wins).
pub fn action_consumed(key: &str, at: SystemTime) {
    let mut guard = STARTS.lock().unwrap_or_else(|e| e.into_inner());
    let starts = guard.get_or_insert_with(|| Starts {
        at: Default::default(),
        order: Default::default(),
    });
    if starts.at.contains_key(key) {
        return;
    }
    if starts.order.len() >= STARTS_KEPT {
        if let Some((old, when)) = starts.order.pop_front() {
            if starts.at.get(&old) == Some(&when) {
                starts.at.remove(&old);
            }
        }
    }
    starts.at.insert(key.to_string(), at);
    starts.order.push_back((key.to_string(), at));
}

/// When the action keyed `key` was consumed here, forgotten as it is read.
pub fn consumed_at(key: &str) -> Option<SystemTime> {
    let mut guard = STARTS.lock().unwrap_or_else(|e| e.into_inner());
    let starts = guard.as_mut()?;
    starts.at.remove(key)
}

/// The trace one action belongs to, and the ids of its spans.
#[derive(Debug, Clone)]
pub struct ActionTrace {
    key: String,
    trace_id: TraceId,
    /// The incoming `traceparent`'s span: the action span's parent.
    parent: Option<SpanId>,
    flags: TraceFlags,
}

/// SHA-256 of `parts`, each followed by a zero byte: the source of every derived id.
fn digest(parts: &[&str]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p.as_bytes());
        h.update([0]);
    }
    h.finalize().into()
}

/// A span id derived from what it stands for, so every stage names the same span.
fn derived_span_id(parts: &[&str]) -> SpanId {
    let mut id = [0u8; 8];
    id.copy_from_slice(&digest(parts)[..8]);
    if id == [0; 8] {
        id[7] = 1;
    }
    SpanId::from_bytes(id)
}

/// `traceparent` (W3C Trace Context, version 00): trace id, parent span id and flags.
fn parse_traceparent(t: &str) -> Option<(TraceId, SpanId, TraceFlags)> {
    let mut parts = t.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00" || trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
        return None;
    }
    let trace = TraceId::from_hex(trace)
        .ok()
        .filter(|t| *t != TraceId::INVALID)?;
    let span = SpanId::from_hex(span)
        .ok()
        .filter(|s| *s != SpanId::INVALID)?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    Some((trace, span, TraceFlags::new(flags)))
}

impl ActionTrace {
    /// The trace of the action keyed `key` whose event carried `traceparent`.
    pub fn of(key: &str, traceparent: Option<&str>) -> Self {
        match traceparent.and_then(parse_traceparent) {
            Some((trace_id, parent, flags)) => Self {
                key: key.to_string(),
                trace_id,
                parent: Some(parent),
                flags,
            },
            None => {
                let mut id = [0u8; 16];
                id.copy_from_slice(&digest(&["idem/trace", key])[..16]);
                Self {
                    key: key.to_string(),
                    trace_id: TraceId::from_bytes(id),
                    parent: None,
                    flags: TraceFlags::SAMPLED,
                }
            }
        }
    }

    /// The action span's id.
    pub fn action_span(&self) -> SpanId {
        derived_span_id(&["idem/action", &self.key])
    }

    /// The id of the action's child span named `what` (e.g. `call/3`, `publish/<event id>`).
    pub fn child(&self, what: &str) -> SpanId {
        derived_span_id(&["idem/child", &self.key, what])
    }

    /// The `traceparent` that makes `span` of this trace the parent.
    pub fn traceparent(&self, span: SpanId) -> String {
        format!("00-{}-{}-{:02x}", self.trace_id, span, self.flags.to_u8())
    }

    /// Exports the action span itself (its id and parent are the trace's own).
    pub fn emit_action(&self, span: Span) {
        self.emit(self.action_span(), self.parent, span);
    }

    /// Exports one child span `id` of the action.
    pub fn emit_child(&self, id: SpanId, span: Span) {
        self.emit(id, Some(self.action_span()), span);
    }

    fn emit(&self, id: SpanId, parent: Option<SpanId>, span: Span) {
        let Some(exporter) = EXPORTER.get() else {
            return;
        };
        // Parent-based sampling: an unsampled incoming trace stays unsampled.
        if !self.flags.is_sampled() {
            return;
        }
        let mut attributes = span.attributes;
        attributes.push(KeyValue::new("idem.key", self.key.clone()));
        exporter.processor.on_end(SpanData {
            span_context: SpanContext::new(
                self.trace_id,
                id,
                self.flags,
                false,
                TraceState::default(),
            ),
            parent_span_id: parent.unwrap_or(SpanId::INVALID),
            parent_span_is_remote: parent.is_some() && parent == self.parent,
            span_kind: span.kind,
            name: span.name.into(),
            start_time: span.start,
            end_time: span.end.max(span.start),
            attributes,
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: match span.error {
                Some(description) => Status::error(description),
                None => Status::Unset,
            },
            instrumentation_scope: exporter.scope.clone(),
        });
    }
}

/// One span as a stage knows it when it ends.
pub struct Span {
    pub name: String,
    pub kind: SpanKind,
    pub start: SystemTime,
    pub end: SystemTime,
    pub attributes: Vec<KeyValue>,
    /// Set for a span that failed: its status is an error with this description.
    pub error: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_incoming_trace_is_kept_and_ids_are_stable() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = ActionTrace::of("run-1:send_email:o1", Some(tp));
        assert_eq!(t.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent.unwrap().to_string(), "00f067aa0ba902b7");
        let again = ActionTrace::of("run-1:send_email:o1", Some(tp));
        assert_eq!(t.action_span(), again.action_span());
        assert_eq!(t.child("call/1"), again.child("call/1"));
        assert_ne!(t.child("call/1"), t.child("call/2"));
        let child = t.traceparent(t.child("call/1"));
        assert!(
            child.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{child}"
        );
        assert!(child.ends_with("-01"));
        assert_eq!(parse_traceparent(&child).unwrap().1, t.child("call/1"));
    }

    #[test]
    fn without_a_valid_traceparent_the_trace_comes_from_the_key() {
        for bad in [
            None,
            Some("garbage"),
            Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
        ] {
            let t = ActionTrace::of("k", bad);
            assert_eq!(t.parent, None);
            assert_eq!(t.trace_id, ActionTrace::of("k", None).trace_id);
            assert_ne!(t.trace_id, ActionTrace::of("other", None).trace_id);
            assert!(t.flags.is_sampled());
        }
        let unsampled = ActionTrace::of(
            "k",
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"),
        );
        assert!(!unsampled.flags.is_sampled());
    }
}
