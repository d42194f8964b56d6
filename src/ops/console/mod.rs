//! The operators' console at `/ui/` on the admin listener: keys waiting for a person, one key's
//! whole story with approve / deny / resolve, an overview of the last hour, and search.
//!
//! Behind the admin tokens: a login form opens a signed session cookie (HttpOnly,
//! SameSite=Strict), or a request carries `Authorization: Bearer`. Every form carries the
//! session's CSRF token, and every decision the fingerprint of the request the page showed.
//! Decisions call the same functions as the CLI and the admin API.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Form, Router};
use serde::Deserialize;

use super::admin::AdminState;

mod html;
mod queries;
mod session;

pub use queries::SpanMemory;
use session::{Role, Session};

const STYLESHEET: &str = include_str!("console.css");

/// The console's routes, to be merged into the admin router.
pub fn router() -> Router<AdminState> {
    Router::new()
        .route("/ui", get(|| async { see_other("/ui/") }))
        .route("/ui/", get(waiting))
        .route("/ui/login", get(login_form).post(login))
        .route("/ui/logout", post(logout))
        .route("/ui/overview", get(overview))
        .route("/ui/search", get(search))
        .route("/ui/keys/{key}", get(key))
        .route("/ui/keys/{key}/{decision}", post(decide))
        .route("/ui/assets/console.css", get(stylesheet))
        .layer(axum::middleware::map_response(secure_headers))
}

/// No framing, no scripts, no third-party anything, nothing cached.
async fn secure_headers(mut response: Response) -> Response {
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn see_other(location: &str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, location)]).into_response()
}

fn page(status: StatusCode, body: String) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
        body,
    )
        .into_response()
}

/// The request's session: a bearer token, or a valid session cookie.
fn session_of(s: &AdminState, headers: &HeaderMap) -> Option<Session> {
    session::bearer(&s.tokens, headers).or_else(|| {
        session::cookie(headers, session::COOKIE)
            .and_then(|value| session::read(&s.tokens, value, now_secs()))
    })
}

async fn stylesheet() -> Response {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        STYLESHEET,
    )
        .into_response()
}

async fn login_form(State(s): State<AdminState>) -> Response {
    if s.tokens.admin.is_none() && s.tokens.named.is_empty() && s.tokens.read.is_none() {
        return page(StatusCode::FORBIDDEN, html::login(Some(OFF)));
    }
    page(StatusCode::OK, html::login(None))
}

const OFF: &str = "The console is off: no token is configured. Set IDEM_ADMIN_TOKEN (or IDEM_ADMIN_READ_TOKEN to look only).";

#[derive(Deserialize)]
struct LoginForm {
    token: String,
    #[serde(default)]
    by: String,
}

async fn login(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Form(f): Form<LoginForm>,
) -> Response {
    let Some(cookie) = session::open(&s.tokens, f.token.trim(), &f.by, now_secs()) else {
        tracing::warn!("console login refused: wrong token");
        return page(
            StatusCode::UNAUTHORIZED,
            html::login(Some("That is not a token of this relay.")),
        );
    };
    // Behind a TLS-terminating proxy the cookie travels over HTTPS only.
    let secure = headers
        .get("x-forwarded-proto")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"https"));
    let set = format!(
        "{}={cookie}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={}{}",
        session::COOKIE,
        session::LIFETIME_SECS,
        if secure { "; Secure" } else { "" }
    );
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, "/ui/".to_string()),
            (header::SET_COOKIE, set),
        ],
    )
        .into_response()
}

#[derive(Deserialize)]
struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

async fn logout(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Form(f): Form<CsrfOnly>,
) -> Response {
    if let Some(session) = session_of(&s, &headers) {
        if !csrf_ok(&session, &f.csrf) {
            return csrf_refused(&session);
        }
    }
    let clear = format!(
        "{}=; Path=/ui; HttpOnly; SameSite=Strict; Max-Age=0",
        session::COOKIE
    );
    (
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, "/ui/login".to_string()),
            (header::SET_COOKIE, clear),
        ],
    )
        .into_response()
}

fn unavailable(session: &Session, e: impl std::fmt::Display) -> Response {
    tracing::warn!(error = %e, "console request failed on the database");
    page(
        StatusCode::SERVICE_UNAVAILABLE,
        html::problem(
            Some(session),
            "Database unavailable",
            "The database is unavailable; the relay's log has the detail.",
        ),
    )
}

#[derive(Deserialize)]
struct WaitingQuery {
    #[serde(default)]
    tool: String,
    #[serde(default)]
    run: String,
}

async fn waiting(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(q): Query<WaitingQuery>,
) -> Response {
    let Some(session) = session_of(&s, &headers) else {
        return see_other("/ui/login");
    };
    match queries::waiting(&s.pool, q.tool.trim(), q.run.trim()).await {
        Ok(rows) => {
            let tools: Vec<String> = s
                .catalogue
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t["name"].as_str().map(str::to_string))
                .collect();
            let timeout = |tool: &str| s.approval_timeouts.get(tool).copied();
            page(
                StatusCode::OK,
                html::waiting(
                    &session,
                    &rows,
                    &tools,
                    q.tool.trim(),
                    q.run.trim(),
                    &timeout,
                ),
            )
        }
        Err(e) => unavailable(&session, e),
    }
}

#[derive(Deserialize)]
struct SearchQuery {
    #[serde(default)]
    q: String,
}

async fn search(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(q): Query<SearchQuery>,
) -> Response {
    let Some(session) = session_of(&s, &headers) else {
        return see_other("/ui/login");
    };
    let q = q.q.trim();
    // A single exact match goes straight to the key.
    match queries::search(&s.pool, q).await {
        Ok(found) if found.rows.len() == 1 && found.rows[0].key == q => {
            see_other(&format!("/ui/keys/{}", html::enc(q)))
        }
        Ok(found) => page(
            StatusCode::OK,
            html::search(&session, q, &found.rows, found.cut_short),
        ),
        Err(e) => unavailable(&session, e),
    }
}

async fn overview(State(s): State<AdminState>, headers: HeaderMap) -> Response {
    let Some(session) = session_of(&s, &headers) else {
        return see_other("/ui/login");
    };
    match queries::overview(&s.pool, &s.overview_span).await {
        Ok(o) => page(
            StatusCode::OK,
            html::overview(&session, &o, s.metrics.consumer_lag_total()),
        ),
        Err(e) => unavailable(&session, e),
    }
}

#[derive(Deserialize)]
struct KeyQuery {
    #[serde(default)]
    done: String,
}

async fn key(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(key): Path<String>,
    Query(q): Query<KeyQuery>,
) -> Response {
    let Some(session) = session_of(&s, &headers) else {
        return see_other("/ui/login");
    };
    let notice = match q.done.as_str() {
        "approved" => Some((
            "ok",
            "Approved: it runs once, with the request shown below.",
        )),
        "denied" => Some(("ok", "Denied: it never runs.")),
        "resolved" => Some(("ok", "Resolved.")),
        _ => None,
    };
    key_page(&s, &session, &key, StatusCode::OK, notice).await
}

async fn key_page(
    s: &AdminState,
    session: &Session,
    key: &str,
    status: StatusCode,
    notice: Option<(&str, &str)>,
) -> Response {
    match crate::ops::explain(&s.pool, key).await {
        Ok(e) => page(status, html::key(session, &e, notice)),
        Err(e @ crate::ops::InspectError::NotFound(_)) => page(
            StatusCode::NOT_FOUND,
            html::problem(Some(session), "No such key", &e.to_string()),
        ),
        Err(e) => unavailable(session, e),
    }
}

/// Whether a form carries its session's CSRF token (a bearer request needs none).
fn csrf_ok(session: &Session, given: &str) -> bool {
    match &session.csrf {
        None => true,
        Some(expected) => super::admin::constant_time_eq(expected.as_bytes(), given.as_bytes()),
    }
}

fn csrf_refused(session: &Session) -> Response {
    tracing::warn!("console form refused: missing or wrong CSRF token");
    page(
        StatusCode::FORBIDDEN,
        html::problem(
            Some(session),
            "Refused",
            "This form did not carry this session's CSRF token, so it may not come from this console. Nothing was changed; reload the page and try again.",
        ),
    )
}

#[derive(Deserialize)]
struct DecisionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    reason: String,
    #[serde(default)]
    fingerprint: String,
    #[serde(default)]
    by: String,
    #[serde(default, rename = "as")]
    resolution: String,
}

async fn decide(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((key, decision)): Path<(String, String)>,
    Form(f): Form<DecisionForm>,
) -> Response {
    let Some(session) = session_of(&s, &headers) else {
        return see_other("/ui/login");
    };
    if !csrf_ok(&session, &f.csrf) {
        return csrf_refused(&session);
    }
    if !session.role.can_decide() {
        return page(
            StatusCode::FORBIDDEN,
            html::problem(
                Some(&session),
                "Refused",
                "The read-only token cannot decide.",
            ),
        );
    }
    match record(&s, &session, &key, &decision, &f).await {
        Ok(done) => {
            tracing::info!(%key, by = %decider(&session, &f), %decision, "console decision recorded");
            see_other(&format!("/ui/keys/{}?done={done}", html::enc(&key)))
        }
        Err((StatusCode::SERVICE_UNAVAILABLE, e)) => unavailable(&session, e),
        Err((status, message)) => {
            key_page(&s, &session, &key, status, Some(("error", &message))).await
        }
    }
}

/// Who a decision is recorded under: the token's name, or the name given at login (or in the
/// form) for the shared admin token.
fn decider(session: &Session, f: &DecisionForm) -> String {
    match &session.role {
        Role::Admin { by } if by.is_empty() => f.by.trim().to_string(),
        role => role.by().to_string(),
    }
}

/// Records one decision; what to say on the key page afterwards, or why it was refused.
async fn record(
    s: &AdminState,
    session: &Session,
    key: &str,
    decision: &str,
    f: &DecisionForm,
) -> Result<&'static str, (StatusCode, String)> {
    let bad = |m: &str| Err((StatusCode::BAD_REQUEST, m.to_string()));
    let by = decider(session, f);
    if by.is_empty() {
        return bad("Say who decides: your name is recorded with the decision.");
    }
    let reason = f.reason.trim();
    if reason.is_empty() {
        return bad("A reason is required: it is recorded with the decision.");
    }
    if f.fingerprint.is_empty() {
        return bad("The form did not say which request it decides on; reload the page.");
    }
    let fingerprint = Some(f.fingerprint.as_str());
    match decision {
        "approve" | "deny" => {
            let (d, done) = if decision == "approve" {
                (crate::gates::Decision::Approve, "approved")
            } else {
                (crate::gates::Decision::Deny, "denied")
            };
            use crate::gates::DecideError as E;
            crate::gates::decide(&s.pool, &s.schema, key, d, &by, reason, fingerprint)
                .await
                .map(|()| done)
                .map_err(|e| match e {
                    E::NotFound(_) => (StatusCode::NOT_FOUND, e.to_string()),
                    E::NotPending { .. } | E::FingerprintMismatch { .. } => {
                        (StatusCode::CONFLICT, e.to_string())
                    }
                    E::Db(_) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                })
        }
        "resolve" => {
            let how = match f.resolution.as_str() {
                "succeeded" => crate::ops::Resolution::Succeeded,
                "failed" => crate::ops::Resolution::Failed,
                "retry" => crate::ops::Resolution::Retry,
                _ => return bad("Resolve as succeeded, failed or retry."),
            };
            use crate::ops::InspectError as E;
            crate::ops::resolve(&s.pool, &s.schema, key, how, &by, reason, fingerprint)
                .await
                .map(|()| "resolved")
                .map_err(|e| match e {
                    E::NotFound(_) => (StatusCode::NOT_FOUND, e.to_string()),
                    E::NotParked { .. } | E::FingerprintMismatch { .. } => {
                        (StatusCode::CONFLICT, e.to_string())
                    }
                    E::Db(_) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
                })
        }
        _ => Err((
            StatusCode::NOT_FOUND,
            "No such decision: approve, deny or resolve.".into(),
        )),
    }
}
