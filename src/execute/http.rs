//! The http executor: one call of a downstream, classified by what is known of its effect.

use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::action::key;
use crate::config::{ExecutorKind, FieldPath, HttpExecutor, StatusClass, Tool};

/// What one HTTP attempt tells about the effect.
#[derive(Debug)]
pub enum Attempt {
    Succeeded(Value),
    /// The downstream refused; the effect certainly did not happen.
    Failed {
        status: u16,
        body: Value,
    },
    /// Nothing was processed (429/503 and friends); may be retried, after `retry_after` if given.
    Retry {
        status: u16,
        retry_after: Option<Duration>,
    },
    /// The request never reached the downstream (connection refused, DNS, connect timeout).
    NotSent(String),
    /// The request was sent and the effect may have happened: timeout, reset, 5xx.
    Ambiguous {
        reason: String,
        status: Option<u16>,
    },
}

impl Attempt {
    /// Label for `idem_retries_total{reason}`.
    pub fn retry_reason(&self) -> &'static str {
        match self {
            Attempt::Retry { status: 429, .. } => "throttled",
            Attempt::Retry { .. } => "unavailable",
            Attempt::NotSent(_) => "not_sent",
            Attempt::Ambiguous { .. } => "ambiguous",
            _ => "none",
        }
    }
}

/// The clients calls and verifications go out on.
pub(crate) struct Clients {
    /// Tools without `executor.tls`: one pool of connections for all of them.
    shared: reqwest::Client,
    /// Tools with their own CA or client certificate.
    by_tool: std::collections::HashMap<String, reqwest::Client>,
}

impl Clients {
    pub(crate) fn new(config: &crate::config::Config) -> Clients {
        let idle = config.relay.concurrency;
        let by_tool = config
            .tools
            .iter()
            .filter_map(|t| match &t.executor {
                ExecutorKind::Http(HttpExecutor { tls: Some(tls), .. }) => {
                    Some((t.name.clone(), client(Some(tls), idle)))
                }
                _ => None,
            })
            .collect();
        Clients {
            shared: client(None, idle),
            by_tool,
        }
    }

    pub(crate) fn of(&self, tool: &Tool) -> &reqwest::Client {
        self.by_tool.get(&tool.name).unwrap_or(&self.shared)
    }
}

fn client(tls: Option<&crate::config::ToolTls>, idle: usize) -> reqwest::Client {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(5))
        // A 3xx is the downstream's answer, never a re-send of the effect to another host.
        .redirect(reqwest::redirect::Policy::none())
        .pool_max_idle_per_host(idle);
    if let Some(tls) = tls {
        // Both were parsed when the config was loaded.
        if let Some(pem) = &tls.ca_pem {
            for ca in reqwest::Certificate::from_pem_bundle(pem).expect("checked at load") {
                builder = builder.add_root_certificate(ca);
            }
        }
        if let Some(pem) = &tls.identity_pem {
            builder = builder.identity(reqwest::Identity::from_pem(pem).expect("checked at load"));
        }
    }
    builder.build().expect("http client builds")
}

/// Fills `{key}` and `{args.x}` placeholders, URL-encoded.
pub fn fill_url(template: &str, idem_key: &str, data: &crate::action::ActionData) -> String {
    let mut out = String::with_capacity(template.len() + idem_key.len());
    let mut rest = template;
    while let Some(start) = rest.find('{') {
        let Some(len) = rest[start..].find('}') else {
            break;
        };
        out.push_str(&rest[..start]);
        let name = &rest[start + 1..start + len];
        let value = if name == "key" {
            idem_key.to_string()
        } else {
            placeholder_value(data, name)
        };
        out.push_str(&percent_encode(&value));
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    out
}

fn placeholder_value(data: &crate::action::ActionData, name: &str) -> String {
    match key::field(data, &FieldPath(name.to_string())).to_json() {
        Value::String(s) => s,
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Refuses arguments that would change which resource a tool's URL path names: a path
/// placeholder filled with `.` or `..` (a browser-style client or proxy resolves them: a refund
/// of order `..` is a call of the collection) or with nothing (`/orders//refund`). The error
/// names the placeholder. Query placeholders may be anything.
pub fn url_args_usable(tool: &Tool, data: &crate::action::ActionData) -> Result<(), String> {
    let ExecutorKind::Http(exec) = &tool.executor else {
        return Ok(());
    };
    let templates =
        std::iter::once(exec.url.as_str()).chain(tool.verify.as_ref().map(|v| v.url.as_str()));
    for template in templates {
        let path = template.split(['?', '#']).next().unwrap_or(template);
        for name in crate::config::placeholders(path) {
            if name == "key" {
                continue;
            }
            let value = placeholder_value(data, &name);
            if matches!(value.as_str(), "" | "." | "..") {
                return Err(format!(
                    "{name} is {value:?}; a value filling the URL path of tool {} must not be empty, \".\" or \"..\"",
                    tool.name
                ));
            }
        }
    }
    Ok(())
}

fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Results are kept and copied into every outcome event of the key: at most this large.
pub const MAX_RESULT_BYTES: usize = 256 * 1024;

/// A response body, read no further than [`MAX_RESULT_BYTES`].
enum Body {
    Whole(Vec<u8>),
    /// Larger than the cap: the rest was never read and the connection is dropped, so a
    /// downstream that streams without end costs the relay the cap, not its memory.
    Cut {
        bytes: u64,
    },
}

async fn read_capped(mut resp: reqwest::Response) -> Result<Body, reqwest::Error> {
    let cap = MAX_RESULT_BYTES as u64;
    if let Some(declared) = resp.content_length().filter(|n| *n > cap) {
        return Ok(Body::Cut { bytes: declared });
    }
    let mut whole = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        whole.extend_from_slice(&chunk);
        if whole.len() as u64 > cap {
            return Ok(Body::Cut {
                bytes: whole.len() as u64,
            });
        }
    }
    Ok(Body::Whole(whole))
}

fn body_value(status: u16, body: &Body) -> Value {
    match body {
        Body::Cut { bytes } => crate::outcome::too_large(*bytes, MAX_RESULT_BYTES),
        Body::Whole(bytes) => {
            let v = match serde_json::from_slice::<Value>(bytes) {
                Ok(v) => v,
                Err(_) => json!({"status": status, "body": String::from_utf8_lossy(bytes)}),
            };
            crate::outcome::storable_result(v, MAX_RESULT_BYTES)
        }
    }
}

fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let v = headers.get(reqwest::header::RETRY_AFTER)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

impl Attempt {
    /// The attempt log's classification.
    pub fn classification(&self) -> &'static str {
        match self {
            Attempt::Succeeded(_) => "succeeded",
            Attempt::Failed { .. } => "failed",
            Attempt::Retry { .. } => "retry",
            Attempt::NotSent(_) => "not_sent",
            Attempt::Ambiguous { .. } => "ambiguous",
        }
    }

    pub fn http_status(&self) -> Option<u16> {
        match self {
            Attempt::Failed { status, .. } | Attempt::Retry { status, .. } => Some(*status),
            Attempt::Ambiguous { status, .. } => *status,
            _ => None,
        }
    }

    pub fn detail(&self) -> Option<String> {
        match self {
            Attempt::NotSent(r) | Attempt::Ambiguous { reason: r, .. } => Some(r.clone()),
            _ => None,
        }
    }
}

/// One attempt. The key goes downstream as `Idempotency-Key`, the same on every attempt.
pub async fn call(
    client: &reqwest::Client,
    exec: &HttpExecutor,
    url: &str,
    idem_key: &str,
    args: &Map<String, Value>,
    traceparent: Option<&str>,
) -> (Attempt, Duration) {
    let started = Instant::now();
    let mut req = client
        .request(exec.method.clone(), url)
        .timeout(exec.timeout)
        .header("Idempotency-Key", idem_key)
        .json(args);
    for (k, v) in &exec.headers {
        req = req.header(k, v);
    }
    if let Some(t) = traceparent {
        req = req.header("traceparent", t);
    }
    let attempt = match req.send().await {
        Err(e) => classify_error(&e),
        Ok(resp) => {
            let status = resp.status().as_u16();
            let after = retry_after(resp.headers());
            let class = exec.status.classify(status);
            match read_capped(resp).await {
                // The status line arrived but the body did not: for a success that is a reset
                // mid-response, and the effect may well have happened.
                Err(e) if class == StatusClass::Succeeded => Attempt::Ambiguous {
                    reason: format!("status {status} but the response body was cut off: {e}"),
                    status: Some(status),
                },
                Err(_) => classify_status(class, status, after, &Body::Whole(Vec::new())),
                Ok(body) => classify_status(class, status, after, &body),
            }
        }
    };
    (attempt, started.elapsed())
}

fn classify_status(
    class: StatusClass,
    status: u16,
    after: Option<Duration>,
    body: &Body,
) -> Attempt {
    match class {
        StatusClass::Succeeded => Attempt::Succeeded(body_value(status, body)),
        StatusClass::Failed => Attempt::Failed {
            status,
            body: body_value(status, body),
        },
        StatusClass::Retry => Attempt::Retry {
            status,
            retry_after: after,
        },
        StatusClass::Unknown => Attempt::Ambiguous {
            reason: format!("downstream answered {status}"),
            status: Some(status),
        },
    }
}

fn classify_error(e: &reqwest::Error) -> Attempt {
    // A connect error (refused, unreachable, connect timeout) means nothing was sent.
    if e.is_connect() {
        return Attempt::NotSent(format!("cannot connect: {e}"));
    }
    if e.is_builder() {
        return Attempt::NotSent(format!("request could not be built: {e}"));
    }
    let reason = if e.is_timeout() {
        "timed out after the request was sent".to_string()
    } else {
        format!("connection failed after the request was sent: {e}")
    };
    Attempt::Ambiguous {
        reason,
        status: None,
    }
}

/// What a verification tells about the effect.
#[derive(Debug)]
pub enum Verified {
    /// 200: it happened; the body is its result.
    Done(Value),
    /// 404: it did not happen.
    NotDone,
    /// Anything else: ask again later.
    Inconclusive(String),
    /// 404 while the call may still be in flight (before its start plus the tool's timeout):
    /// concludes nothing until this instant.
    Premature(Instant),
}

/// Asks the downstream whether the effect of `idem_key` happened.
pub async fn verify(
    client: &reqwest::Client,
    v: &crate::config::Verify,
    url: &str,
    idem_key: &str,
    traceparent: Option<&str>,
) -> (Verified, Option<u16>, Duration) {
    let started = Instant::now();
    let mut req = client
        .request(v.method.clone(), url)
        .timeout(v.timeout)
        .header("Idempotency-Key", idem_key);
    if let Some(t) = traceparent {
        req = req.header("traceparent", t);
    }
    let resp = req.send().await;
    let (verified, status) = match resp {
        Err(e) => (
            Verified::Inconclusive(format!("verify request failed: {e}")),
            None,
        ),
        Ok(r) => {
            let status = r.status().as_u16();
            match status {
                200 => match read_capped(r).await {
                    Ok(b) => (Verified::Done(body_value(status, &b)), Some(status)),
                    Err(e) => (
                        Verified::Inconclusive(format!("verify body cut off: {e}")),
                        Some(status),
                    ),
                },
                404 => (Verified::NotDone, Some(status)),
                other => (
                    Verified::Inconclusive(format!("verify answered {other}")),
                    Some(status),
                ),
            }
        }
    };
    (verified, status, started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_placeholders_are_encoded() {
        let data: crate::action::ActionData = serde_json::from_value(json!({
            "run_id": "r", "tool": "t", "args": {"order": "a/b c", "n": 5}
        }))
        .unwrap();
        assert_eq!(
            fill_url("http://x/v1/{args.order}/{key}?n={args.n}", "r:t:1", &data),
            "http://x/v1/a%2Fb%20c/r%3At%3A1?n=5"
        );
    }

    #[test]
    fn path_placeholders_refuse_dot_dotdot_and_empty_and_queries_do_not() {
        let config = crate::config::Config::from_toml(
            r#"
[[tools]]
name = "refund"
class = "dangerous"
key = ["args.order"]
approval = "none"
[tools.executor]
kind = "http"
url = "http://x/v1/orders/{args.order}/refund?note={args.note}"
[tools.verify]
url = "http://x/v1/refunds/{args.ref}"
"#,
            |_| None,
        )
        .unwrap();
        let tool = &config.tools[0];
        let data = |args: Value| -> crate::action::ActionData {
            serde_json::from_value(json!({"run_id": "r", "tool": "refund", "args": args})).unwrap()
        };
        let ok = data(json!({"order": "o-1", "note": "", "ref": "a.b"}));
        assert!(url_args_usable(tool, &ok).is_ok());
        for bad in [
            json!({"order": "..", "ref": "x"}),
            json!({"order": ".", "ref": "x"}),
            json!({"order": "", "ref": "x"}),
            json!({"ref": "x"}),
            json!({"order": "o-1", "ref": ".."}),
        ] {
            let e = url_args_usable(tool, &data(bad.clone())).unwrap_err();
            assert!(e.contains("args.") && e.contains("refund"), "{bad}: {e}");
        }
    }

    fn whole(bytes: &[u8]) -> Body {
        Body::Whole(bytes.to_vec())
    }

    #[test]
    fn a_cut_body_is_kept_as_its_size() {
        let v = body_value(200, &Body::Cut { bytes: 50 << 20 });
        assert_eq!(v["truncated"], true);
        assert_eq!(v["bytes"], 50u64 << 20);
    }

    #[test]
    fn statuses_map_to_attempts() {
        assert!(
            matches!(classify_status(StatusClass::Succeeded, 200, None, &whole(b"{\"id\":1}")), Attempt::Succeeded(v) if v["id"] == 1)
        );
        assert!(
            matches!(classify_status(StatusClass::Succeeded, 204, None, &whole(b"")), Attempt::Succeeded(v) if v["status"] == 204)
        );
        assert!(matches!(
            classify_status(StatusClass::Failed, 422, None, &whole(b"no")),
            Attempt::Failed { status: 422, .. }
        ));
        assert!(matches!(
            classify_status(StatusClass::Retry, 429, Some(Duration::from_secs(2)), &whole(b"")),
            Attempt::Retry { status: 429, retry_after: Some(d) } if d == Duration::from_secs(2)
        ));
        assert!(matches!(
            classify_status(StatusClass::Unknown, 500, None, &whole(b"")),
            Attempt::Ambiguous {
                status: Some(500),
                ..
            }
        ));
    }
}
