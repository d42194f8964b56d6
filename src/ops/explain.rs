//! `explain`: everything known about one key, as JSON and as tables a person reads.

use deadpool_postgres::Pool;
use serde_json::{json, Value};

use crate::db::DbError;

use super::InspectError;

const INTENT: &str = "
    select id, idempotency_key, tool, class, run_id, step, business_id, status, attempts,
           result, error, action_event_id, created_at::text, finished_at::text, lease_owner,
           lease_epoch, needs_verify, fingerprint
      from intents where idempotency_key = $1 and class <> 'read_only'";

const APPROVALS: &str = "
    select decision, decided_by, reason, fingerprint, at::text
      from approvals where idempotency_key = $1 order by id";

const DELIVERIES: &str = "
    select action_event_id, source_partition, source_offset, origin, answered, received_at::text
      from deliveries where idempotency_key = $1 order by id";

const ATTEMPTS: &str = "
    select seq, kind, reason, owner, lease_epoch, started_at::text, ended_at::text,
           classification, http_status, error, latency_ms
      from attempts where idempotency_key = $1 order by seq";

const RESOLUTIONS: &str = "
    select from_status, resolved_as, resolved_by, reason, at::text
      from resolutions where idempotency_key = $1 order by id";

const OUTCOMES: &str = "
    select event_id, payload->'data'->>'action_event_id', payload->'data'->>'status',
           (payload->'data'->>'duplicate')::bool, payload->'data'->>'note', created_at::text,
           published_at::text
      from outbox where kafka_key = $1 order by id";

/// Everything known about one key, as JSON.
pub async fn explain(pool: &Pool, key: &str) -> Result<Value, InspectError> {
    let client = pool.get().await.map_err(DbError::from)?;
    let Some(i) = client.query_opt(INTENT, &[&key]).await? else {
        return Err(InspectError::NotFound(key.to_string()));
    };
    let deliveries: Vec<Value> = client
        .query(DELIVERIES, &[&key])
        .await?
        .iter()
        .map(|r| {
            json!({"action_event_id": r.get::<_, String>(0), "partition": r.get::<_, i32>(1),
                   "offset": r.get::<_, i64>(2), "origin": r.get::<_, String>(3),
                   "answered": r.get::<_, bool>(4), "received_at": r.get::<_, String>(5)})
        })
        .collect();
    let attempts: Vec<Value> = client
        .query(ATTEMPTS, &[&key])
        .await?
        .iter()
        .map(|r| {
            json!({"seq": r.get::<_, i32>(0), "kind": r.get::<_, String>(1), "reason": r.get::<_, String>(2),
                   "owner": r.get::<_, String>(3), "lease_epoch": r.get::<_, i64>(4),
                   "started_at": r.get::<_, String>(5), "ended_at": r.get::<_, Option<String>>(6),
                   "result": r.get::<_, Option<String>>(7), "http_status": r.get::<_, Option<i32>>(8),
                   "error": r.get::<_, Option<String>>(9), "latency_ms": r.get::<_, Option<f64>>(10)})
        })
        .collect();
    let resolutions: Vec<Value> = client
        .query(RESOLUTIONS, &[&key])
        .await?
        .iter()
        .map(|r| {
            json!({"from": r.get::<_, String>(0), "as": r.get::<_, String>(1), "by": r.get::<_, String>(2),
                   "reason": r.get::<_, String>(3), "at": r.get::<_, String>(4)})
        })
        .collect();
    let approvals: Vec<Value> = client
        .query(APPROVALS, &[&key])
        .await?
        .iter()
        .map(|r| {
            json!({"decision": r.get::<_, String>(0), "by": r.get::<_, String>(1), "reason": r.get::<_, String>(2),
                   "fingerprint": r.get::<_, String>(3), "at": r.get::<_, String>(4)})
        })
        .collect();
    let outcomes: Vec<Value> = client
        .query(OUTCOMES, &[&key])
        .await?
        .iter()
        .map(|r| {
            json!({"event_id": r.get::<_, String>(0), "action_event_id": r.get::<_, Option<String>>(1),
                   "status": r.get::<_, Option<String>>(2), "duplicate": r.get::<_, Option<bool>>(3),
                   "note": r.get::<_, Option<String>>(4), "recorded_at": r.get::<_, String>(5),
                   "published_at": r.get::<_, Option<String>>(6)})
        })
        .collect();
    Ok(json!({
        "idempotency_key": i.get::<_, String>(1),
        "tool": i.get::<_, String>(2),
        "class": i.get::<_, String>(3),
        "run_id": i.get::<_, String>(4),
        "step": i.get::<_, Option<i64>>(5),
        "business_id": i.get::<_, Option<String>>(6),
        "status": i.get::<_, String>(7),
        "attempts": i.get::<_, i32>(8),
        "result": i.get::<_, Option<Value>>(9),
        "error": i.get::<_, Option<Value>>(10),
        "first_action_event_id": i.get::<_, String>(11),
        "recorded_at": i.get::<_, String>(12),
        "finished_at": i.get::<_, Option<String>>(13),
        "lease_owner": i.get::<_, Option<String>>(14),
        "lease_epoch": i.get::<_, i64>(15),
        "needs_verify": i.get::<_, bool>(16),
        "fingerprint": i.get::<_, String>(17),
        "approvals": approvals,
        "deliveries": deliveries,
        "calls": attempts,
        "resolutions": resolutions,
        "outcomes": outcomes,
    }))
}

/// The explanation as tables a person reads.
pub fn render(e: &Value) -> String {
    let s = |v: &Value| match v {
        Value::Null => "-".to_string(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let mut out = format!(
        "key {}  tool {} ({})  run {}  status {}  calls {}  request {}\n",
        s(&e["idempotency_key"]),
        s(&e["tool"]),
        s(&e["class"]),
        s(&e["run_id"]),
        s(&e["status"]),
        s(&e["attempts"]),
        s(&e["fingerprint"])
    );
    let deliveries = e["deliveries"].as_array().map_or(0, Vec::len);
    out.push_str(&format!(
        "\ndeliveries ({deliveries}): how many times it was asked, and why\n"
    ));
    out.push_str("  received_at                    partition  offset  origin          event\n");
    for d in e["deliveries"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "  {:<30} {:>9} {:>7}  {:<15} {}\n",
            s(&d["received_at"]),
            s(&d["partition"]),
            s(&d["offset"]),
            s(&d["origin"]),
            s(&d["action_event_id"])
        ));
    }
    out.push_str("\nattempts: every call and verification downstream\n");
    out.push_str("  seq  kind    reason           result        http  latency_ms  owner (epoch)\n");
    for a in e["calls"].as_array().into_iter().flatten() {
        let latency = a["latency_ms"]
            .as_f64()
            .map_or("-".into(), |l| format!("{l:.1}"));
        out.push_str(&format!(
            "  {:>3}  {:<6}  {:<15}  {:<12}  {:>4}  {:>10}  {} ({})\n",
            s(&a["seq"]),
            s(&a["kind"]),
            s(&a["reason"]),
            s(&a["result"]),
            s(&a["http_status"]),
            latency,
            s(&a["owner"]),
            s(&a["lease_epoch"])
        ));
        if let Some(err) = a["error"].as_str() {
            out.push_str(&format!("       {err}\n"));
        }
    }
    for a in e["approvals"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "\n{} by {} at {} (request {}): {}\n",
            s(&a["decision"]),
            s(&a["by"]),
            s(&a["at"]),
            s(&a["fingerprint"]),
            s(&a["reason"])
        ));
    }
    for r in e["resolutions"].as_array().into_iter().flatten() {
        out.push_str(&format!(
            "\nresolved {} → {} by {} at {}: {}\n",
            s(&r["from"]),
            s(&r["as"]),
            s(&r["by"]),
            s(&r["at"]),
            s(&r["reason"])
        ));
    }
    out.push_str("\noutcome events\n");
    for o in e["outcomes"].as_array().into_iter().flatten() {
        let dup = if o["duplicate"] == true {
            " (duplicate)"
        } else {
            ""
        };
        out.push_str(&format!(
            "  {}  {}{} answering {}  published {}\n    {}\n",
            s(&o["event_id"]),
            s(&o["status"]),
            dup,
            s(&o["action_event_id"]),
            s(&o["published_at"]),
            s(&o["note"])
        ));
    }
    out
}
