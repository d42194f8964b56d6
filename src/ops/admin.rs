//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the process runs) and
//! `/readyz` (Kafka and Postgres are reachable).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deadpool_postgres::Pool;

use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};

use crate::config::Secret;
use crate::metrics::Metrics;

#[derive(Clone)]
pub struct AdminState {
    pub metrics: Arc<Metrics>,
    pub pool: Pool,
    /// Set once topics exist and the consumer is subscribed; cleared when all brokers are down.
    pub kafka_up: Arc<AtomicBool>,
    /// Who may read and who may change state.
    pub tokens: Arc<Tokens>,
    pub schema: String,
    /// The configured tools, as `GET /v1/tools` shows them.
    pub catalogue: Arc<serde_json::Value>,
    /// The MCP server of `/mcp`: the tools, and its Kafka clients once first called.
    pub mcp: Arc<crate::mcp::Shared>,
    /// Each gated tool's `approval_timeout`, for the console's deadlines.
    pub approval_timeouts: Arc<std::collections::HashMap<String, Duration>>,
    /// The shorter span the console's overview last fell back to.
    pub overview_span: Arc<crate::ops::console::SpanMemory>,
}

/// The bearer tokens of the `/v1/` endpoints.
pub struct Tokens {
    /// The shared admin token: reads and changes; the body's `by` says who decided.
    pub admin: Option<Secret>,
    /// Named admin tokens: reads and changes, recorded under the token's name.
    pub named: Vec<crate::config::NamedToken>,
    /// Reads only.
    pub read: Option<Secret>,
    /// The listener is on a loopback address: without any token, reads are served there only.
    pub loopback: bool,
}

/// Who a request is, by its bearer token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// The shared admin token.
    Admin,
    /// A named admin token.
    Named(String),
    Reader,
    /// No `Authorization` header.
    Anonymous,
    /// A token that is none of them.
    Wrong,
}

/// Who made a decision, as it is recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decider {
    /// The shared token does not say who holds it: the body's `by` does.
    Shared,
    /// The token's name; a `by` naming somebody else is refused.
    Named(String),
}

impl Tokens {
    pub(crate) fn caller(&self, headers: &HeaderMap) -> Caller {
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Caller::Anonymous;
        };
        let given = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        self.caller_of(given)
    }

    /// Who holds the token `given`.
    pub(crate) fn caller_of(&self, given: &str) -> Caller {
        let matches = |t: &Secret| constant_time_eq(given.as_bytes(), t.expose().as_bytes());
        // Every token is compared, so the time taken does not tell which one was near.
        let named = self.named.iter().fold(None, |found, n| {
            if matches(&n.token) {
                Some(n.name.clone())
            } else {
                found
            }
        });
        if self.admin.as_ref().is_some_and(matches) {
            Caller::Admin
        } else if let Some(name) = named {
            Caller::Named(name)
        } else if self.read.as_ref().is_some_and(matches) {
            Caller::Reader
        } else {
            Caller::Wrong
        }
    }

    pub(crate) fn any_admin(&self) -> bool {
        self.admin.is_some() || !self.named.is_empty()
    }

    /// `/v1/` reads: any token; without any token configured, only on a loopback listener.
    fn may_read(&self, headers: &HeaderMap) -> Result<(), AdminError> {
        let none_configured = !self.any_admin() && self.read.is_none();
        match self.caller(headers) {
            Caller::Admin | Caller::Named(_) | Caller::Reader => Ok(()),
            Caller::Anonymous if none_configured && self.loopback => Ok(()),
            Caller::Anonymous if none_configured => Err(error(
                StatusCode::FORBIDDEN,
                "reads on a listener that is not loopback need a token: set IDEM_ADMIN_READ_TOKEN or IDEM_ADMIN_TOKEN",
            )),
            Caller::Anonymous | Caller::Wrong => Err(unauthorized()),
        }
    }

    /// Changes of state: an admin token only; off when none is configured.
    fn may_change(&self, headers: &HeaderMap) -> Result<Decider, AdminError> {
        if !self.any_admin() {
            return Err(error(
                StatusCode::FORBIDDEN,
                "admin actions are off: set IDEM_ADMIN_TOKEN, IDEM_ADMIN_TOKEN_FILE or IDEM_ADMIN_TOKENS_FILE to turn them on",
            ));
        }
        match self.caller(headers) {
            Caller::Admin => Ok(Decider::Shared),
            Caller::Named(name) => Ok(Decider::Named(name)),
            Caller::Reader => Err(error(
                StatusCode::FORBIDDEN,
                "the read-only token cannot change state",
            )),
            Caller::Anonymous | Caller::Wrong => Err(unauthorized()),
        }
    }
}

fn unauthorized() -> AdminError {
    tracing::warn!("admin request refused: missing or wrong bearer token");
    error(StatusCode::UNAUTHORIZED, "missing or wrong bearer token")
}

/// A database error as the caller sees it: the detail (SQL, host names) goes to the log only.
fn unavailable(e: impl std::fmt::Display) -> AdminError {
    tracing::warn!(error = %e, "admin request failed on the database");
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the database is unavailable; the relay's log has the detail",
    )
}

/// Decisions are small: a larger body is refused before it is read.
const MAX_BODY_BYTES: usize = 16 * 1024;

pub fn router(state: AdminState) -> Router {
    let shared = state.mcp.clone();
    let mcp = StreamableHttpService::new(
        move || Ok(crate::mcp::IdemMcp::http(shared.clone())),
        Arc::new(LocalSessionManager::default()),
        // Every request needs an admin token (below), so the Host check that guards an
        // unauthenticated local server from DNS rebinding is not needed, and would refuse the
        // names a cluster reaches the relay by.
        StreamableHttpServerConfig::default()
            .disable_allowed_hosts()
            .with_max_request_body_bytes(MAX_MCP_BODY_BYTES),
    );
    let mcp = Router::new()
        .route_service("/mcp", mcp)
        .layer(axum::middleware::from_fn_with_state(
            state.tokens.clone(),
            mcp_guard,
        ));
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/v1/actions/{key}", get(explain))
        .route("/v1/tools", get(tools))
        // `approve` or `deny`; `resolve` (below) is matched first, being a fixed segment.
        .route("/v1/actions/{key}/{decision}", post(approve_or_deny))
        .route("/v1/actions/{key}/resolve", post(resolve))
        .merge(super::console::router())
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
        .merge(mcp)
}

/// A `tools/call` is the largest MCP request: its arguments.
const MAX_MCP_BODY_BYTES: usize = 1024 * 1024;

/// `/mcp`: calling a tool changes state, so an admin token (shared or named) is required.
async fn mcp_guard(
    State(tokens): State<Arc<Tokens>>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match tokens.may_change(request.headers()) {
        Ok(_) => next.run(request).await,
        Err(refused) => refused.into_response(),
    }
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

async fn explain(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> Response {
    if let Err(refused) = s.tokens.may_read(&headers) {
        return refused.into_response();
    }
    match crate::ops::explain(&s.pool, &key).await {
        Ok(e) => Json(e).into_response(),
        Err(e @ crate::ops::InspectError::NotFound(_)) => (
            StatusCode::NOT_FOUND,
            Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
        Err(e) => unavailable(e).into_response(),
    }
}

async fn tools(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    if let Err(refused) = s.tokens.may_read(&headers) {
        return refused.into_response();
    }
    Json(s.catalogue.as_ref().clone()).into_response()
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, String) {
    let postgres = tokio::time::timeout(Duration::from_secs(2), async {
        let client = s.pool.get().await.ok()?;
        client.simple_query("select 1").await.ok()
    })
    .await
    .ok()
    .flatten()
    .is_some();
    let kafka = s.kafka_up.load(Ordering::Relaxed);
    // Reachable is not enough: a read-only or full database answers `select 1` and refuses
    // every intent.
    let writable = s.metrics.postgres_is_writable();
    let body = format!(
        "postgres: {}\nkafka: {}\n",
        match (postgres, writable) {
            (false, _) => "unreachable",
            (true, false) => "refusing writes",
            (true, true) => "ok",
        },
        if kafka { "ok" } else { "unreachable" }
    );
    if postgres && writable && kafka {
        (StatusCode::OK, body)
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, body)
    }
}

/// What a person sends with a decision; `by` (or the token's name) and `reason` are recorded.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct DecisionBody {
    /// Who decides: required with the shared token; with a named token, optional and, when
    /// given, the token's name.
    #[serde(default)]
    by: Option<String>,
    reason: String,
    /// The material fingerprint the person looked at (from explain); checked when given.
    #[serde(default)]
    fingerprint: Option<String>,
    /// For resolve: `succeeded`, `failed` or `retry`.
    #[serde(default, rename = "as")]
    resolution: Option<String>,
}

/// A decision as it is recorded: who and why.
struct Decision {
    by: String,
    reason: String,
    fingerprint: Option<String>,
    resolution: Option<String>,
}

/// An admin request refused, as the JSON `{"error": …}` it answers with.
struct AdminError {
    status: StatusCode,
    message: String,
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        (
            self.status,
            Json(serde_json::json!({"error": self.message})),
        )
            .into_response()
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> AdminError {
    AdminError {
        status,
        message: message.into(),
    }
}

/// Equal without an early exit: the time taken does not tell how much of a guess was right.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn body(bytes: &[u8], decider: Decider) -> Result<Decision, AdminError> {
    let b: DecisionBody = serde_json::from_slice(bytes).map_err(|e| {
        error(
            StatusCode::BAD_REQUEST,
            format!("body must be {{\"by\": …, \"reason\": …}}: {e}"),
        )
    })?;
    if b.reason.trim().is_empty() {
        return Err(error(StatusCode::BAD_REQUEST, "reason must not be empty"));
    }
    let by = match (decider, b.by) {
        (Decider::Named(name), None) => name,
        (Decider::Named(name), Some(by)) if by == name => name,
        (Decider::Named(name), Some(by)) => {
            return Err(error(
                StatusCode::FORBIDDEN,
                format!("the token is {name}'s; it cannot decide as `{by}`"),
            ))
        }
        (Decider::Shared, Some(by)) if !by.trim().is_empty() => by,
        (Decider::Shared, _) => {
            return Err(error(
                StatusCode::BAD_REQUEST,
                "by must name who decides (the shared admin token does not say)",
            ))
        }
    };
    Ok(Decision {
        by,
        reason: b.reason,
        fingerprint: b.fingerprint,
        resolution: b.resolution,
    })
}

/// A decision's body, once the caller is authorized.
fn authorized_body(
    s: &AdminState,
    headers: &HeaderMap,
    bytes: &[u8],
) -> Result<Decision, AdminError> {
    let decider = s.tokens.may_change(headers)?;
    body(bytes, decider)
}

async fn decide(
    s: AdminState,
    headers: HeaderMap,
    key: String,
    bytes: axum::body::Bytes,
    decision: crate::gates::Decision,
) -> Response {
    let b = match authorized_body(&s, &headers, &bytes) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    use crate::gates::DecideError as E;
    match crate::gates::decide(
        &s.pool,
        &s.schema,
        &key,
        decision,
        &b.by,
        &b.reason,
        b.fingerprint.as_deref(),
    )
    .await
    {
        Ok(()) => (
            StatusCode::OK,
            Json(serde_json::json!({"key": key, "decided": true})),
        )
            .into_response(),
        Err(e @ E::NotFound(_)) => error(StatusCode::NOT_FOUND, e.to_string()).into_response(),
        Err(e @ (E::NotPending { .. } | E::FingerprintMismatch { .. })) => {
            error(StatusCode::CONFLICT, e.to_string()).into_response()
        }
        Err(e @ E::Db(_)) => unavailable(e).into_response(),
    }
}

async fn approve_or_deny(
    State(s): State<AdminState>,
    Path((key, decision)): Path<(String, String)>,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Response {
    let decision = match decision.as_str() {
        "approve" => crate::gates::Decision::Approve,
        "deny" => crate::gates::Decision::Deny,
        _ => return StatusCode::NOT_FOUND.into_response(),
    };
    decide(s, headers, key, bytes, decision).await
}

async fn resolve(
    State(s): State<AdminState>,
    Path(key): Path<String>,
    headers: HeaderMap,
    bytes: axum::body::Bytes,
) -> Response {
    let b = match authorized_body(&s, &headers, &bytes) {
        Ok(b) => b,
        Err(r) => return r.into_response(),
    };
    use crate::ops::{InspectError as E, Resolution};
    let how = match b.resolution.as_deref() {
        Some("succeeded") => Resolution::Succeeded,
        Some("failed") => Resolution::Failed,
        Some("retry") => Resolution::Retry,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "\"as\" must be succeeded, failed or retry",
            )
            .into_response()
        }
    };
    match crate::ops::resolve(
        &s.pool,
        &s.schema,
        &key,
        how,
        &b.by,
        &b.reason,
        b.fingerprint.as_deref(),
    )
    .await
    {
        Ok(()) => (
            StatusCode::OK,
            Json(serde_json::json!({"key": key, "resolved": how.as_str()})),
        )
            .into_response(),
        Err(e @ E::NotFound(_)) => error(StatusCode::NOT_FOUND, e.to_string()).into_response(),
        Err(e @ (E::NotParked { .. } | E::FingerprintMismatch { .. })) => {
            error(StatusCode::CONFLICT, e.to_string()).into_response()
        }
        Err(e @ E::Db(_)) => unavailable(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn token_comparison() {
        assert!(super::constant_time_eq(
            b"secret-token-123",
            b"secret-token-123"
        ));
        assert!(!super::constant_time_eq(
            b"secret-token-123",
            b"secret-token-124"
        ));
        assert!(!super::constant_time_eq(b"secret", b"secret-token-123"));
    }
}
