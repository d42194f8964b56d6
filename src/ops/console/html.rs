//! The console's pages, rendered on the server: plain HTML and one stylesheet, no script.
//! Everything that comes from data goes through [`esc`].

use std::fmt::Write;
use std::time::Duration;

use serde_json::Value;

use super::queries::{KeyRow, Overview};
use super::session::Session;

/// HTML-escapes text for element content and quoted attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Percent-encodes a path segment or query value (everything but RFC 3986's unreserved).
pub fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// A JSON value as text: strings bare, everything else as JSON.
fn show(v: &Value) -> String {
    match v {
        Value::Null => "–".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `95` → `1m 35s`.
pub fn age(secs: f64) -> String {
    let s = secs.max(0.0) as u64;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m {}s", s / 60, s % 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

fn badge(status: &str) -> String {
    format!(
        r#"<span class="badge {}">{}</span>"#,
        esc(status),
        esc(status)
    )
}

/// The page around `body`: title, navigation, who is logged in, and the logout form.
pub fn layout(title: &str, session: Option<&Session>, body: &str) -> String {
    let nav = match session {
        Some(s) => format!(
            r#"<nav><a href="/ui/">Waiting</a> <a href="/ui/overview">Overview</a>
<form class="search" method="get" action="/ui/search"><input name="q" placeholder="key, run id or business id" aria-label="search"><button>Search</button></form>
<span class="who">{}</span>{}</nav>"#,
            esc(&s.role.describe()),
            match &s.csrf {
                Some(csrf) => format!(
                    r#"<form method="post" action="/ui/logout" class="logout"><input type="hidden" name="csrf" value="{}"><button>Log out</button></form>"#,
                    esc(csrf)
                ),
                None => String::new(),
            }
        ),
        None => String::new(),
    };
    format!(
        r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{} · idem</title><link rel="stylesheet" href="/ui/assets/console.css"></head>
<body><header><a class="brand" href="/ui/">idem</a>{nav}</header><main>
<h1>{}</h1>
{body}
</main></body></html>"#,
        esc(title),
        esc(title)
    )
}

fn banner(kind: &str, text: &str) -> String {
    format!(
        r#"<p class="banner {kind}" role="status">{}</p>"#,
        esc(text)
    )
}

pub fn login(message: Option<&str>) -> String {
    let body = format!(
        r#"{}<form method="post" action="/ui/login" class="login">
<label>Token <input type="password" name="token" autocomplete="current-password" required autofocus></label>
<label>Your name <input name="by" autocomplete="name" placeholder="recorded with your decisions"></label>
<p class="hint">An admin token decides; the read-only token sees. With the shared admin token, decisions are recorded under the name given here.</p>
<button>Log in</button></form>"#,
        message.map(|m| banner("error", m)).unwrap_or_default()
    );
    layout("Log in", None, &body)
}

/// A page that only says what went wrong.
pub fn problem(session: Option<&Session>, title: &str, message: &str) -> String {
    layout(title, session, &banner("error", message))
}

fn key_table(rows: &[KeyRow], deadline: &dyn Fn(&KeyRow) -> Option<String>) -> String {
    if rows.is_empty() {
        return r#"<p class="empty">Nothing here.</p>"#.to_string();
    }
    let mut t = String::from(
        "<table class=\"keys\"><thead><tr><th>key</th><th>status</th><th>tool</th><th>run</th>\
         <th>business id</th><th>recorded (UTC)</th><th>age</th><th>approval deadline</th></tr></thead><tbody>",
    );
    for r in rows {
        let _ = write!(
            t,
            r#"<tr><td><a href="/ui/keys/{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"#,
            enc(&r.key),
            esc(&r.key),
            badge(&r.status),
            esc(&r.tool),
            esc(&r.run_id),
            esc(r.business_id.as_deref().unwrap_or("–")),
            esc(&r.recorded_at),
            age(r.age_secs),
            esc(&deadline(r).unwrap_or_else(|| "–".into())),
        );
    }
    t.push_str("</tbody></table>");
    t
}

/// Keys waiting for a person, oldest first, with filters by tool and run.
pub fn waiting(
    session: &Session,
    rows: &[KeyRow],
    tools: &[String],
    tool: &str,
    run: &str,
    approval_timeout: &dyn Fn(&str) -> Option<Duration>,
) -> String {
    let mut options = String::from(r#"<option value="">every tool</option>"#);
    for t in tools {
        let _ = write!(
            options,
            r#"<option value="{}"{}>{}</option>"#,
            esc(t),
            if t == tool { " selected" } else { "" },
            esc(t)
        );
    }
    let deadline = |r: &KeyRow| -> Option<String> {
        if r.status != "pending_approval" {
            return None;
        }
        let timeout = approval_timeout(&r.tool)?.as_secs_f64();
        let left = timeout - r.age_secs;
        Some(if left > 0.0 {
            format!("in {}", age(left))
        } else {
            "due now".into()
        })
    };
    let body = format!(
        r#"<p class="hint">Keys waiting for approval or parked <em>unknown</em>, oldest first.</p>
<form method="get" action="/ui/" class="filters"><label>Tool <select name="tool">{options}</select></label>
<label>Run <input name="run" value="{}"></label><button>Filter</button></form>
{}"#,
        esc(run),
        key_table(rows, &deadline)
    );
    layout("Waiting", Some(session), &body)
}

pub fn search(session: &Session, q: &str, rows: &[KeyRow], cut_short: bool) -> String {
    let note = if cut_short {
        banner(
            "error",
            &format!(
                "The search by run id or business id walks the keys newest first and stopped after {} s: older keys were not looked at. An exact key is always found.",
                super::queries::SEARCH_BUDGET.as_secs()
            ),
        )
    } else {
        String::new()
    };
    let body = format!(
        r#"{note}<p class="hint">Keys whose key, run id or business id is <code>{}</code>, newest first.</p>{}"#,
        esc(q),
        key_table(rows, &|_| None)
    );
    layout("Search", Some(session), &body)
}

/// "the last hour", "the last 5 minutes", "the last minute": the span an overview counted.
fn last_span(secs: i64) -> String {
    match secs {
        3600 => "the last hour".into(),
        60 => "the last minute".into(),
        s if s % 60 == 0 => format!("the last {} minutes", s / 60),
        s => format!("the last {s} seconds"),
    }
}

pub fn overview(session: &Session, o: &Overview, consumer_lag: i64) -> String {
    let span = last_span(o.counts.span_secs);
    let shorter = if o.counts.span_secs < super::queries::OVERVIEW_SPANS[0] {
        format!(
            r#"<p class="hint">Counting the last hour took longer than {} s (its keys are many): these are the counts of {}.</p>"#,
            super::queries::OVERVIEW_BUDGET.as_secs(),
            esc(&span)
        )
    } else {
        String::new()
    };
    let mut tools: Vec<&str> = o
        .counts
        .by_tool_status
        .iter()
        .map(|(t, _, _)| t.as_str())
        .collect();
    tools.dedup();
    let statuses = [
        "pending",
        "running",
        "pending_approval",
        "succeeded",
        "failed",
        "unknown",
        "rejected",
    ];
    let mut t = String::from("<table><thead><tr><th>tool</th>");
    for s in statuses {
        let _ = write!(t, "<th>{}</th>", esc(s));
    }
    t.push_str("</tr></thead><tbody>");
    for tool in &tools {
        let _ = write!(t, "<tr><td>{}</td>", esc(tool));
        for s in statuses {
            let n = o
                .counts
                .by_tool_status
                .iter()
                .find(|(tt, ss, _)| tt == tool && ss == s)
                .map_or(0, |(_, _, n)| *n);
            let _ = write!(t, "<td class=\"num\">{n}</td>");
        }
        t.push_str("</tr>");
    }
    if tools.is_empty() {
        let _ = write!(
            t,
            r#"<tr><td colspan="{}" class="empty">No keys recorded in {}.</td></tr>"#,
            statuses.len() + 1,
            esc(&span)
        );
    }
    t.push_str("</tbody></table>");
    let mut origins =
        String::from("<table><thead><tr><th>origin</th><th>deliveries</th></tr></thead><tbody>");
    for (origin, n) in &o.counts.by_origin {
        let _ = write!(
            origins,
            r#"<tr><td>{}</td><td class="num">{n}</td></tr>"#,
            esc(origin)
        );
    }
    if o.counts.by_origin.is_empty() {
        origins.push_str(r#"<tr><td colspan="2" class="empty">None.</td></tr>"#);
    }
    origins.push_str("</tbody></table>");
    let mut leases = String::from(
        "<table><thead><tr><th>relay</th><th>keys running</th><th>latest lease expiry (UTC)</th></tr></thead><tbody>",
    );
    for (owner, n, until) in &o.leases {
        let _ = write!(
            leases,
            r#"<tr><td>{}</td><td class="num">{n}</td><td>{}</td></tr>"#,
            esc(owner),
            esc(until)
        );
    }
    if o.leases.is_empty() {
        leases.push_str(r#"<tr><td colspan="3" class="empty">No relay holds a lease.</td></tr>"#);
    }
    leases.push_str("</tbody></table>");
    let body = format!(
        r#"<section><h2>Keys recorded in {span_h}, by tool and status</h2>{shorter}{t}</section>
<section><h2>Deliveries in {span_h}, by origin</h2><p class="hint">Everything but <code>first</code> is a repeat idem answered instead of executing.</p>{origins}</section>
<section><h2>Now</h2><dl class="facts"><dt>Outbox lag</dt><dd>{} outcome events unpublished, oldest {}</dd>
<dt>Consumer lag (this relay)</dt><dd>{consumer_lag} actions not yet consumed</dd></dl>
<h3>Relays holding leases</h3>{leases}</section>"#,
        o.outbox_pending,
        age(o.outbox_oldest_secs),
        span_h = esc(&span),
    );
    layout("Overview", Some(session), &body)
}

/// A form's hidden fields: the CSRF token (cookie sessions) and the fingerprint it is bound to.
fn hidden(session: &Session, fingerprint: &str) -> String {
    let mut h = format!(
        r#"<input type="hidden" name="fingerprint" value="{}">"#,
        esc(fingerprint)
    );
    if let Some(csrf) = &session.csrf {
        let _ = write!(
            h,
            r#"<input type="hidden" name="csrf" value="{}">"#,
            esc(csrf)
        );
    }
    h
}

fn decision_forms(session: &Session, e: &Value) -> String {
    let status = e["status"].as_str().unwrap_or_default();
    if !matches!(status, "pending_approval" | "unknown") {
        return String::new();
    }
    if !session.role.can_decide() {
        return r#"<p class="hint">The read-only token sees this key; deciding needs an admin token.</p>"#.into();
    }
    let key = enc(e["idempotency_key"].as_str().unwrap_or_default());
    let fp = e["fingerprint"].as_str().unwrap_or_default();
    let hidden = hidden(session, fp);
    let by = if session.role.by().is_empty() {
        r#"<label>Your name <input name="by" required></label>"#
    } else {
        ""
    };
    let reason = r#"<label>Reason <textarea name="reason" required rows="2"></textarea></label>"#;
    let bound = format!(
        r#"<p class="hint">Bound to request <code>{}</code>: if the key stands for another request by then, the decision is refused.</p>"#,
        esc(fp)
    );
    if status == "pending_approval" {
        format!(
            r#"<section class="decide"><h2>Decide</h2>{bound}
<form method="post" action="/ui/keys/{key}/approve" class="approve">{hidden}{by}{reason}<button>Approve</button></form>
<form method="post" action="/ui/keys/{key}/deny" class="deny">{hidden}{by}{reason}<button>Deny</button></form></section>"#
        )
    } else {
        format!(
            r#"<section class="decide"><h2>Resolve</h2><p class="hint">Check downstream first: did it happen?</p>{bound}
<form method="post" action="/ui/keys/{key}/resolve" class="resolve">{hidden}{by}
<label>It <select name="as"><option value="succeeded">happened (succeeded)</option><option value="failed">did not happen, and must not (failed)</option><option value="retry">did not happen: call again with the same key (retry)</option></select></label>
{reason}<button>Resolve</button></form></section>"#
        )
    }
}

fn rows_table(items: &Value, columns: &[(&str, &str)]) -> String {
    let items = items.as_array().map(Vec::as_slice).unwrap_or_default();
    if items.is_empty() {
        return r#"<p class="empty">None.</p>"#.into();
    }
    let mut t = String::from("<table><thead><tr>");
    for (_, title) in columns {
        let _ = write!(t, "<th>{}</th>", esc(title));
    }
    t.push_str("</tr></thead><tbody>");
    for item in items {
        t.push_str("<tr>");
        for (field, _) in columns {
            let _ = write!(t, "<td>{}</td>", esc(&show(&item[*field])));
        }
        t.push_str("</tr>");
    }
    t.push_str("</tbody></table>");
    t
}

/// Everything known about one key, and the forms to decide on it.
pub fn key(session: &Session, e: &Value, notice: Option<(&str, &str)>) -> String {
    let material = e["material"].as_object();
    let mut args = String::from(
        "<table class=\"args\"><thead><tr><th>argument</th><th>value</th><th></th></tr></thead><tbody>",
    );
    for (name, value) in e["args"].as_object().into_iter().flatten() {
        let path = format!("args.{name}");
        let is_material = material.is_some_and(|m| m.contains_key(&path));
        let _ = write!(
            args,
            r#"<tr{}><td>{}</td><td><code>{}</code></td><td>{}</td></tr>"#,
            if is_material {
                r#" class="material""#
            } else {
                ""
            },
            esc(name),
            esc(&value.to_string()),
            if is_material { "material" } else { "" }
        );
    }
    args.push_str("</tbody></table>");
    let mut other_material = String::new();
    for (path, value) in material.into_iter().flatten() {
        if !path.starts_with("args.") {
            let _ = write!(
                other_material,
                "<li><code>{}</code> = <code>{}</code></li>",
                esc(path),
                esc(&value.to_string())
            );
        }
    }
    if !other_material.is_empty() {
        other_material =
            format!("<p>Material fields beside the arguments:</p><ul>{other_material}</ul>");
    }
    let facts = [
        ("status", badge(e["status"].as_str().unwrap_or_default())),
        (
            "tool",
            format!("{} ({})", esc(&show(&e["tool"])), esc(&show(&e["class"]))),
        ),
        ("run", esc(&show(&e["run_id"]))),
        ("business id", esc(&show(&e["business_id"]))),
        ("step", esc(&show(&e["step"]))),
        ("recorded", esc(&show(&e["recorded_at"]))),
        ("finished", esc(&show(&e["finished_at"]))),
        ("calls", esc(&show(&e["attempts"]))),
        (
            "lease",
            format!(
                "{} (epoch {})",
                esc(&show(&e["lease_owner"])),
                esc(&show(&e["lease_epoch"]))
            ),
        ),
        (
            "result",
            format!("<code>{}</code>", esc(&show(&e["result"]))),
        ),
        ("error", format!("<code>{}</code>", esc(&show(&e["error"])))),
    ];
    let mut dl = String::from(r#"<dl class="facts">"#);
    for (k, v) in facts {
        let _ = write!(dl, "<dt>{k}</dt><dd>{v}</dd>");
    }
    dl.push_str("</dl>");
    let notice = notice
        .map(|(kind, text)| banner(kind, text))
        .unwrap_or_default();
    let body = format!(
        r#"{notice}<p class="key"><code>{}</code></p>{dl}
<section><h2>Request</h2><p>Fingerprint <code class="fingerprint">{}</code>; <span class="material-mark">material</span> fields are what a repeat must match and what an approver decides on.</p>{args}{other_material}</section>
{}
<section><h2>Deliveries</h2><p class="hint">Every time this was asked, and what caused the repeat.</p>{}</section>
<section><h2>Attempts</h2>{}</section>
<section><h2>Decisions</h2>{}{}</section>
<section><h2>Outcome events</h2>{}</section>"#,
        esc(&show(&e["idempotency_key"])),
        esc(&show(&e["fingerprint"])),
        decision_forms(session, e),
        rows_table(
            &e["deliveries"],
            &[
                ("received_at", "received"),
                ("origin", "origin"),
                ("action_event_id", "event id"),
                ("partition", "partition"),
                ("offset", "offset"),
                ("answered", "answered"),
            ]
        ),
        rows_table(
            &e["calls"],
            &[
                ("seq", "#"),
                ("kind", "kind"),
                ("reason", "why"),
                ("started_at", "start"),
                ("ended_at", "end"),
                ("result", "result"),
                ("http_status", "HTTP"),
                ("latency_ms", "ms"),
                ("owner", "relay"),
                ("lease_epoch", "epoch"),
                ("error", "error"),
            ]
        ),
        rows_table(
            &e["approvals"],
            &[
                ("at", "at"),
                ("decision", "decision"),
                ("by", "by"),
                ("reason", "reason"),
                ("fingerprint", "for request"),
            ]
        ),
        rows_table(
            &e["resolutions"],
            &[
                ("at", "at"),
                ("from", "from"),
                ("as", "resolved as"),
                ("by", "by"),
                ("reason", "reason"),
            ]
        ),
        rows_table(
            &e["outcomes"],
            &[
                ("recorded_at", "recorded"),
                ("published", "published"),
                ("status", "status"),
                ("duplicate", "duplicate"),
                ("action_event_id", "answers event"),
                ("note", "note"),
            ]
        ),
    );
    layout("Key", Some(session), &body)
}

#[cfg(test)]
mod tests {
    use super::super::session::Role;
    use super::*;
    use serde_json::json;

    fn admin() -> Session {
        Session {
            role: Role::Admin { by: "Ana".into() },
            csrf: Some("c5rf".into()),
        }
    }

    fn explained(status: &str) -> Value {
        json!({
            "idempotency_key": "run-1:refund:o<1>", "tool": "refund", "class": "dangerous",
            "run_id": "run-1", "status": status, "fingerprint": "fp-1",
            "args": {"order_id": "o<1>", "amount": 120, "memo": "x"},
            "material": {"args.order_id": "o<1>", "args.amount": 120},
            "deliveries": [{"origin": "first", "action_event_id": "e1"}],
            "calls": [], "approvals": [], "resolutions": [], "outcomes": [],
        })
    }

    #[test]
    fn escaping_and_encoding() {
        assert_eq!(
            esc(r#"<a href="x">'&"#),
            "&lt;a href=&quot;x&quot;&gt;&#39;&amp;"
        );
        assert_eq!(enc("run 1:tool/ü"), "run%201%3Atool%2F%C3%BC");
        assert_eq!(age(95.0), "1m 35s");
        assert_eq!(age(7300.0), "2h 1m");
    }

    #[test]
    fn the_overview_names_the_span_it_counted() {
        let mut o = Overview {
            counts: super::super::queries::Counts {
                span_secs: 3600,
                by_tool_status: vec![("refund".into(), "succeeded".into(), 3)],
                by_origin: vec![("first".into(), 3)],
            },
            outbox_pending: 0,
            outbox_oldest_secs: 0.0,
            leases: vec![],
        };
        let hour = overview(&admin(), &o, 0);
        assert!(hour.contains("Keys recorded in the last hour, by tool and status"));
        assert!(hour.contains("Deliveries in the last hour, by origin"));
        assert!(!hour.contains("took longer"), "{hour}");
        o.counts.span_secs = 300;
        let shorter = overview(&admin(), &o, 0);
        assert!(shorter.contains("Keys recorded in the last 5 minutes, by tool and status"));
        assert!(shorter.contains("Deliveries in the last 5 minutes, by origin"));
        assert!(
            shorter.contains(
                "Counting the last hour took longer than 2 s (its keys are many): these are the \
                 counts of the last 5 minutes."
            ),
            "{shorter}"
        );
        assert_eq!(last_span(60), "the last minute");
    }

    #[test]
    fn the_key_page_marks_material_fields_and_binds_forms_to_the_fingerprint() {
        let page = key(&admin(), &explained("pending_approval"), None);
        assert!(page.contains("o&lt;1&gt;"), "data is escaped");
        assert!(!page.contains("o<1>"));
        assert!(
            page.contains(r#"<tr class="material"><td>amount</td>"#),
            "{page}"
        );
        assert!(page.contains(r#"<tr><td>memo</td>"#), "{page}");
        assert!(page.contains(r#"action="/ui/keys/run-1%3Arefund%3Ao%3C1%3E/approve""#));
        assert!(page.contains(r#"name="fingerprint" value="fp-1""#));
        assert!(page.contains(r#"name="csrf" value="c5rf""#));
        // The name is known from the login: not asked again.
        assert!(!page.contains(r#"name="by""#));
    }

    #[test]
    fn a_reader_sees_no_forms_and_an_unknown_key_offers_resolve() {
        let reader = Session {
            role: Role::Reader,
            csrf: Some("c".into()),
        };
        let page = key(&reader, &explained("pending_approval"), None);
        assert!(!page.contains("/approve"));
        assert!(page.contains("read-only token"));
        let unknown = key(&admin(), &explained("unknown"), None);
        assert!(unknown.contains("/resolve"));
        assert!(!unknown.contains("/approve"));
        let done = key(&admin(), &explained("succeeded"), None);
        assert!(!done.contains("<form method=\"post\" action=\"/ui/keys"));
    }
}
