//! A deterministic fake downstream that counts side effects: what the tests measure against,
//! and what the example config points at (`idem fake-downstream`), so users can rehearse.
//!
//! - `POST /v1/{tool}` performs one effect for the request's `Idempotency-Key` and answers
//!   `{"id": "eff_N", "key": …, "tool": …}`; `?delay_ms=N` delays every answer of that URL.
//! - `GET /v1/effects/{key}`: 200 with the first effect's result, 404 when none (verify).
//! - `GET /_counts`: `{"total": N, "requests": M, "by_key": {key: n}}`.
//! - `POST /_script` `{"key": "k" (optional), "steps": [..]}`: the next requests (for that key,
//!   or any) behave as scripted, one step each: `"ok"`, `{"delay_ms": N}`, `"effect_then_timeout"`,
//!   `"effect_then_500"`, `"effect_then_drop"`, `"effect_then_stream"` (a 200 whose body runs
//!   for 50 MiB), `"fail_500"`, `"drop"`, `{"status": N}` (no effect),
//!   `{"status": 429, "retry_after": S}`.
//!
//!   With `"verify": true` the steps script the verify endpoint instead: `{"status": N}` answers N
//!   (503: inconclusive), anything else answers as usual.
//! - `GET /_counts` also counts verifications: `"verifications": N`.
//!
//! With `honor_key`, a repeated key returns its first result without a new effect, like a
//! well-behaved API; without it (the default) every request performs an effect.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum Step {
    Named(String),
    Delay {
        delay_ms: u64,
    },
    /// Answers with a redirect to `location`, performing nothing. (Before `Status`: untagged
    /// variants are tried in order, and this one has a field more.)
    Redirect {
        status: u16,
        location: String,
    },
    Status {
        status: u16,
        #[serde(default)]
        retry_after: Option<u64>,
    },
}

#[derive(Default)]
struct Inner {
    honor_key: bool,
    total: u64,
    requests: u64,
    by_key: HashMap<String, u64>,
    first_result: HashMap<String, Value>,
    script_any: VecDeque<Step>,
    script_by_key: HashMap<String, VecDeque<Step>>,
    /// Scripted answers of the verify endpoint, per key.
    verify_script: HashMap<String, VecDeque<Step>>,
    verifications: u64,
    /// Bytes of `effect_then_stream` bodies the relay has taken so far.
    streamed: u64,
    /// The `traceparent` header of the last request per key.
    traceparents: HashMap<String, String>,
}

#[derive(Clone, Default)]
pub struct FakeDownstream {
    inner: Arc<Mutex<Inner>>,
}

impl FakeDownstream {
    /// Bytes of `effect_then_stream` bodies handed to the connection so far.
    pub fn streamed_bytes(&self) -> u64 {
        self.inner.lock().expect("not poisoned").streamed
    }

    pub fn new(honor_key: bool) -> Self {
        let d = FakeDownstream::default();
        d.inner.lock().expect("not poisoned").honor_key = honor_key;
        d
    }

    /// Serves on `listener` until `shutdown`.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: CancellationToken,
    ) -> std::io::Result<()> {
        use axum::serve::ListenerExt;
        // Without TCP_NODELAY, Nagle and delayed ACKs add tens of milliseconds to small answers.
        let listener = listener.tap_io(|tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, self.router())
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await
    }

    /// Binds `addr` and serves in the background; returns the bound address.
    pub async fn spawn(
        self,
        addr: SocketAddr,
        shutdown: CancellationToken,
    ) -> std::io::Result<SocketAddr> {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        tokio::spawn(self.serve(listener, shutdown));
        Ok(bound)
    }

    pub fn router(&self) -> Router {
        Router::new()
            .route("/v1/{tool}", post(effect))
            .route("/v1/effects/{key}", get(verify))
            .route("/_counts", get(counts))
            .route("/_script", post(script))
            .with_state(self.clone())
    }

    /// Effects performed for `key`.
    pub fn effects(&self, key: &str) -> u64 {
        self.inner
            .lock()
            .expect("not poisoned")
            .by_key
            .get(key)
            .copied()
            .unwrap_or(0)
    }

    pub fn total_effects(&self) -> u64 {
        self.inner.lock().expect("not poisoned").total
    }

    pub fn requests(&self) -> u64 {
        self.inner.lock().expect("not poisoned").requests
    }

    /// Keys that saw more than one effect.
    pub fn repeated_keys(&self) -> Vec<(String, u64)> {
        let inner = self.inner.lock().expect("not poisoned");
        let mut v: Vec<_> = inner
            .by_key
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(k, n)| (k.clone(), *n))
            .collect();
        v.sort();
        v
    }

    /// The `traceparent` the last request for `key` carried.
    pub fn traceparent(&self, key: &str) -> Option<String> {
        self.inner
            .lock()
            .expect("not poisoned")
            .traceparents
            .get(key)
            .cloned()
    }

    pub fn distinct_keys(&self) -> usize {
        self.inner.lock().expect("not poisoned").by_key.len()
    }

    /// Scripts the next requests for `key` (or for any key).
    pub fn script(&self, key: Option<&str>, steps: Vec<Step>) {
        let mut inner = self.inner.lock().expect("not poisoned");
        match key {
            Some(k) => inner
                .script_by_key
                .entry(k.to_string())
                .or_default()
                .extend(steps),
            None => inner.script_any.extend(steps),
        }
    }

    /// Scripts the next verifications of `key`.
    pub fn script_verify(&self, key: &str, steps: Vec<Step>) {
        self.inner
            .lock()
            .expect("not poisoned")
            .verify_script
            .entry(key.to_string())
            .or_default()
            .extend(steps);
    }

    /// Verification requests served.
    pub fn verifications(&self) -> u64 {
        self.inner.lock().expect("not poisoned").verifications
    }

    fn next_step(&self, key: &str) -> Step {
        let mut inner = self.inner.lock().expect("not poisoned");
        inner.requests += 1;
        if let Some(step) = inner
            .script_by_key
            .get_mut(key)
            .and_then(VecDeque::pop_front)
        {
            return step;
        }
        inner
            .script_any
            .pop_front()
            .unwrap_or(Step::Named("ok".into()))
    }

    /// Performs one effect (or replays the first, with `honor_key`).
    fn perform(&self, key: &str, tool: &str) -> Value {
        let mut inner = self.inner.lock().expect("not poisoned");
        if inner.honor_key {
            if let Some(first) = inner.first_result.get(key) {
                return first.clone();
            }
        }
        inner.total += 1;
        let n = inner.total;
        *inner.by_key.entry(key.to_string()).or_default() += 1;
        let result = json!({"id": format!("eff_{n}"), "key": key, "tool": tool});
        inner
            .first_result
            .entry(key.to_string())
            .or_insert_with(|| result.clone());
        result
    }
}

#[derive(Deserialize)]
struct EffectQuery {
    delay_ms: Option<u64>,
}

/// A body that fails after the status line: the client sees the connection cut mid-response.
/// A 200 whose body goes on for 50 MiB (chunked, no length), counting what was taken.
fn stream_without_end(d: FakeDownstream) -> Response {
    const CHUNK: usize = 64 * 1024;
    const TOTAL: u64 = 50 << 20;
    let stream = futures::stream::unfold(0u64, move |sent| {
        let d = d.clone();
        async move {
            if sent >= TOTAL {
                return None;
            }
            d.inner.lock().expect("not poisoned").streamed += CHUNK as u64;
            let chunk = axum::body::Bytes::from(vec![b' '; CHUNK]);
            Some((Ok::<_, std::io::Error>(chunk), sent + CHUNK as u64))
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

fn cut_off() -> Response {
    let stream = futures::stream::once(async {
        Err::<axum::body::Bytes, std::io::Error>(std::io::Error::other("cut"))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-length", "100")
        .body(Body::from_stream(stream))
        .expect("valid response")
}

async fn effect(
    State(d): State<FakeDownstream>,
    Path(tool): Path<String>,
    Query(q): Query<EffectQuery>,
    headers: HeaderMap,
    _body: axum::body::Bytes,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if let Some(t) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        d.inner
            .lock()
            .expect("not poisoned")
            .traceparents
            .insert(key.clone(), t.to_string());
    }
    if let Some(ms) = q.delay_ms {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let step = d.next_step(&key);
    match step {
        Step::Delay { delay_ms } => {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
            Json(d.perform(&key, &tool)).into_response()
        }
        Step::Status {
            status,
            retry_after,
        } => {
            let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut r =
                (code, Json(json!({"error": format!("scripted {status}")}))).into_response();
            if let Some(s) = retry_after {
                r.headers_mut()
                    .insert("retry-after", s.to_string().parse().expect("digits"));
            }
            r
        }
        Step::Redirect { status, location } => {
            let code = StatusCode::from_u16(status).unwrap_or(StatusCode::TEMPORARY_REDIRECT);
            let mut r = code.into_response();
            if let Ok(v) = location.parse() {
                r.headers_mut().insert("location", v);
            }
            r
        }
        Step::Named(name) => match name.as_str() {
            "effect_then_timeout" => {
                d.perform(&key, &tool);
                tokio::time::sleep(Duration::from_secs(3600)).await;
                StatusCode::GATEWAY_TIMEOUT.into_response()
            }
            "effect_then_500" => {
                d.perform(&key, &tool);
                (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response()
            }
            "effect_then_drop" => {
                d.perform(&key, &tool);
                cut_off()
            }
            "effect_then_stream" => {
                d.perform(&key, &tool);
                stream_without_end(d.clone())
            }
            "fail_500" => (StatusCode::INTERNAL_SERVER_ERROR, "internal error").into_response(),
            "drop" => cut_off(),
            _ => Json(d.perform(&key, &tool)).into_response(),
        },
    }
}

async fn verify(State(d): State<FakeDownstream>, Path(key): Path<String>) -> Response {
    let mut inner = d.inner.lock().expect("not poisoned");
    inner.verifications += 1;
    let step = inner
        .verify_script
        .get_mut(&key)
        .and_then(VecDeque::pop_front);
    if let Some(Step::Status { status, .. }) = step {
        let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return (code, Json(json!({"error": format!("scripted {status}")}))).into_response();
    }
    match inner.first_result.get(&key) {
        Some(r) => Json(r.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such effect"})),
        )
            .into_response(),
    }
}

async fn counts(State(d): State<FakeDownstream>) -> Json<Value> {
    let inner = d.inner.lock().expect("not poisoned");
    Json(json!({
        "total": inner.total,
        "requests": inner.requests,
        "verifications": inner.verifications,
        "by_key": inner.by_key
    }))
}

#[derive(Deserialize)]
struct ScriptBody {
    key: Option<String>,
    steps: Vec<Step>,
    #[serde(default)]
    verify: bool,
}

async fn script(State(d): State<FakeDownstream>, Json(body): Json<ScriptBody>) -> StatusCode {
    match (body.verify, body.key.as_deref()) {
        (true, Some(key)) => d.script_verify(key, body.steps),
        (true, None) => return StatusCode::UNPROCESSABLE_ENTITY,
        (false, key) => d.script(key, body.steps),
    }
    StatusCode::NO_CONTENT
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_steps_read_from_json() {
        let steps: Vec<Step> = serde_json::from_value(json!([
            "effect_then_500",
            {"delay_ms": 5},
            {"status": 503, "retry_after": 1},
            {"status": 307, "location": "http://elsewhere/v1/x"},
        ]))
        .unwrap();
        assert_eq!(
            steps,
            [
                Step::Named("effect_then_500".into()),
                Step::Delay { delay_ms: 5 },
                Step::Status {
                    status: 503,
                    retry_after: Some(1)
                },
                Step::Redirect {
                    status: 307,
                    location: "http://elsewhere/v1/x".into()
                },
            ]
        );
    }
}
