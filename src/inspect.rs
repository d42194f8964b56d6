//! What people do with keys: `explain` (every delivery, attempt, decision and outcome of one
//! key, in one answer) and `resolve` (settle a key parked `unknown`, recording who and why).

use deadpool_postgres::Pool;
use serde_json::{json, Value};

use crate::db::DbError;
use crate::outcome::{FinishError, Guard, Settled};
use crate::outcome::{OutcomeError, OutcomeStatus};

#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    #[error("no intent with key {0:?}")]
    NotFound(String),
    #[error("key {key:?} is {status}, not unknown: only parked keys are resolved")]
    NotParked { key: String, status: String },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<tokio_postgres::Error> for InspectError {
    fn from(e: tokio_postgres::Error) -> Self {
        InspectError::Db(DbError::Postgres(e))
    }
}

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

/// How a person settles a parked key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// It happened (checked downstream): record success.
    Succeeded,
    /// It did not happen and must not: record failure.
    Failed,
    /// It did not happen: call again (the same key goes downstream).
    Retry,
}

impl Resolution {
    pub fn as_str(self) -> &'static str {
        match self {
            Resolution::Succeeded => "succeeded",
            Resolution::Failed => "failed",
            Resolution::Retry => "retry",
        }
    }
}

const LOCK_INTENT: &str = "
    select id, status from intents
     where idempotency_key = $1 and class <> 'read_only'
     for update";

// Backdated so the next recovery sweep (in any relay) claims it at once.
const REQUEUE: &str = "
    update intents set status = 'pending', next_reason = 'manual', needs_verify = false,
                       lease_owner = null, lease_expires_at = null, lease_epoch = lease_epoch + 1,
                       updated_at = now() - interval '1 hour'
     where id = $1";

// A person who resolves `retry` looked downstream and says the effect did not happen: that is
// written into the attempt log as a concluded verification, so the attempt log's rule (which
// recovery follows) allows the next call.
const RECORD_MANUAL_NOT_DONE: &str = "
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch,
                          ended_at, classification, error)
    select i.id, i.idempotency_key,
           coalesce((select max(seq) from attempts where intent_id = i.id), 0) + 1,
           'verify', 'manual', $2, i.lease_epoch, now(), 'not_done', $3
      from intents i where i.id = $1";

const RECORD_RESOLUTION: &str = "
    insert into resolutions (intent_id, idempotency_key, from_status, resolved_as, resolved_by, reason)
    values ($1, $2, $3, $4, $5, $6)";

/// Settles a key parked `unknown`. Succeeded and failed publish the key's new outcome (and
/// answer every waiting repeat); retry hands it back to the relays.
pub async fn resolve(
    pool: &Pool,
    schema: &str,
    key: &str,
    how: Resolution,
    by: &str,
    reason: &str,
) -> Result<(), InspectError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = client.transaction().await?;
    let Some(row) = tx.query_opt(LOCK_INTENT, &[&key]).await? else {
        return Err(InspectError::NotFound(key.to_string()));
    };
    let (id, status): (i64, String) = (row.get(0), row.get(1));
    if status != "unknown" {
        return Err(InspectError::NotParked {
            key: key.to_string(),
            status,
        });
    }
    let channel = crate::publish::outbox::outbox_channel(schema);
    let settled = match how {
        Resolution::Succeeded => Some(Settled {
            status: OutcomeStatus::Succeeded,
            result: Some(json!({"resolved_by": by, "reason": reason})),
            error: None,
            attempts: 0,
        }),
        Resolution::Failed => Some(Settled {
            status: OutcomeStatus::Failed,
            result: None,
            error: Some(OutcomeError {
                code: "resolved_failed".into(),
                message: format!("{by} resolved it as not done: {reason}"),
                retryable: false,
                fields: None,
            }),
            attempts: 0,
        }),
        Resolution::Retry => None,
    };
    match settled {
        Some(settled) => {
            match crate::outcome::finish(
                &tx,
                id,
                Guard::Parked("unknown"),
                &settled,
                None,
                &channel,
            )
            .await
            {
                Ok(_) => {}
                Err(FinishError::Fenced(_)) => {
                    return Err(InspectError::NotParked {
                        key: key.to_string(),
                        status: "changing".into(),
                    })
                }
                Err(FinishError::Db(e)) => return Err(e.into()),
            }
        }
        None => {
            let note = format!("{by} resolved it as not done: {reason}");
            tx.execute(RECORD_MANUAL_NOT_DONE, &[&id, &by, &note])
                .await?;
            tx.execute(REQUEUE, &[&id]).await?;
        }
    }
    tx.execute(
        RECORD_RESOLUTION,
        &[&id, &key, &status, &how.as_str(), &by, &reason],
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

// ------------------------------------------------------------------ approvals

/// A person's decision on a key waiting for approval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Approve,
    Deny,
}

#[derive(Debug, thiserror::Error)]
pub enum DecideError {
    #[error("no intent with key {0:?}")]
    NotFound(String),
    #[error("key {key:?} is {status}, not waiting for approval (decided before, or never gated)")]
    NotPending { key: String, status: String },
    #[error("key {key:?} now stands for request {actual}, not {expected}: look at it again before deciding")]
    FingerprintMismatch {
        key: String,
        expected: String,
        actual: String,
    },
    #[error(transparent)]
    Db(#[from] DbError),
}

impl From<tokio_postgres::Error> for DecideError {
    fn from(e: tokio_postgres::Error) -> Self {
        DecideError::Db(DbError::Postgres(e))
    }
}

const LOCK_FOR_DECISION: &str = "
    select id, status, fingerprint from intents
     where idempotency_key = $1 and class <> 'read_only'
     for update";

const RECORD_DECISION: &str = "
    insert into approvals (intent_id, idempotency_key, fingerprint, decision, decided_by, reason)
    values ($1, $2, $3, $4, $5, $6)
    on conflict (intent_id) do nothing";

// Backdated so the next recovery sweep (in any relay) claims it at once.
const RELEASE_APPROVED: &str = "
    update intents set status = 'pending', updated_at = now() - interval '1 hour'
     where id = $1 and status = 'pending_approval'";

/// Approves or denies a key parked `pending_approval`. The decision is bound to the request's
/// material fingerprint (pass the one you looked at to be sure it is still the same); exactly one
/// decision is ever recorded per intent, whatever races it.
pub async fn decide(
    pool: &Pool,
    schema: &str,
    key: &str,
    decision: Decision,
    by: &str,
    reason: &str,
    fingerprint: Option<&str>,
) -> Result<(), DecideError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = client.transaction().await?;
    let Some(row) = tx.query_opt(LOCK_FOR_DECISION, &[&key]).await? else {
        return Err(DecideError::NotFound(key.to_string()));
    };
    let (id, status, actual): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
    if status != "pending_approval" {
        return Err(DecideError::NotPending {
            key: key.to_string(),
            status,
        });
    }
    if let Some(expected) = fingerprint.filter(|f| *f != actual) {
        return Err(DecideError::FingerprintMismatch {
            key: key.to_string(),
            expected: expected.to_string(),
            actual,
        });
    }
    let word = match decision {
        Decision::Approve => "approved",
        Decision::Deny => "denied",
    };
    let n = tx
        .execute(RECORD_DECISION, &[&id, &key, &actual, &word, &by, &reason])
        .await?;
    if n == 0 {
        return Err(DecideError::NotPending {
            key: key.to_string(),
            status: "decided".into(),
        });
    }
    match decision {
        Decision::Approve => {
            tx.execute(RELEASE_APPROVED, &[&id]).await?;
        }
        Decision::Deny => {
            let settled = Settled {
                status: OutcomeStatus::Rejected,
                result: None,
                error: Some(OutcomeError {
                    code: "approval_denied".into(),
                    message: format!("{by} denied it: {reason}"),
                    retryable: false,
                    fields: None,
                }),
                attempts: 0,
            };
            let channel = crate::publish::outbox::outbox_channel(schema);
            match crate::outcome::finish(
                &tx,
                id,
                Guard::Parked("pending_approval"),
                &settled,
                None,
                &channel,
            )
            .await
            {
                Ok(_) => {}
                Err(FinishError::Fenced(_)) => {
                    return Err(DecideError::NotPending {
                        key: key.to_string(),
                        status: "changing".into(),
                    })
                }
                Err(FinishError::Db(e)) => return Err(e.into()),
            }
        }
    }
    tx.commit().await?;
    tracing::info!(
        key,
        decision = word,
        by,
        reason,
        "approval decision recorded"
    );
    Ok(())
}

const EXPIRED_APPROVALS: &str = "
    select id, idempotency_key, fingerprint from intents
     where status = 'pending_approval' and tool = $1
       and created_at < now() - make_interval(secs => $2)
     order by id
     limit 500
     for update skip locked";

/// Rejects keys that waited for approval longer than their tool's `approval_timeout`.
pub async fn expire_approvals(
    pool: &Pool,
    config: &crate::config::Config,
) -> Result<usize, DbError> {
    let channel = crate::publish::outbox::outbox_channel(&config.postgres.schema);
    let mut expired = 0;
    for tool in config
        .tools
        .iter()
        .filter(|t| t.approval != crate::config::Approval::None)
    {
        let mut client = pool.get().await?;
        let tx = client.transaction().await?;
        let timeout = tool.approval_timeout.as_secs_f64();
        for row in tx.query(EXPIRED_APPROVALS, &[&tool.name, &timeout]).await? {
            let (id, key, fp): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
            let reason = format!("nobody decided within {}s", tool.approval_timeout.as_secs());
            tx.execute(
                RECORD_DECISION,
                &[&id, &key, &fp, &"expired", &"idem", &reason],
            )
            .await?;
            let settled = Settled {
                status: OutcomeStatus::Rejected,
                result: None,
                error: Some(OutcomeError {
                    code: "approval_timeout".into(),
                    message: reason,
                    retryable: false,
                    fields: None,
                }),
                attempts: 0,
            };
            match crate::outcome::finish(
                &tx,
                id,
                Guard::Parked("pending_approval"),
                &settled,
                None,
                &channel,
            )
            .await
            {
                Ok(_) => expired += 1,
                Err(FinishError::Fenced(_)) => {}
                Err(FinishError::Db(e)) => return Err(e),
            }
        }
        tx.commit().await?;
    }
    Ok(expired)
}

// -------------------------------------------------------------------- prune

// Finished keys past retention whose run waits on nothing, in batches. Their deliveries and
// attempts go with them (on delete cascade); a tombstone stays.
const PRUNE_TOOL: &str = "
    with doomed as (
        select i.id from intents i
         where i.tool = $1 and i.status in ('succeeded', 'failed', 'rejected')
           and i.finished_at < now() - make_interval(secs => $2)
           and not exists (select 1 from intents j
                            where j.run_id = i.run_id
                              and j.status in ('pending', 'running', 'unknown', 'pending_approval'))
         order by i.id
         limit 1000
         for update skip locked
    ), gone as (
        delete from intents where id in (select id from doomed)
        returning idempotency_key, fingerprint, tool, status, finished_at, class
    ), stones as (
        insert into tombstones (key_hash, fingerprint_hash, tool, status, finished_at, expires_at)
        select encode(sha256(convert_to(idempotency_key, 'UTF8')), 'hex'), fingerprint, tool,
               status, finished_at, now() + make_interval(secs => $3)
          from gone where class <> 'read_only'
        on conflict (key_hash) do update set expires_at = excluded.expires_at
    ), answered as (
        delete from outbox where kafka_key in (select idempotency_key from gone)
           and published_at is not null
    )
    select count(*) from gone";

const PRUNE_TOMBSTONES: &str = "delete from tombstones where expires_at < now()";

const PRUNE_DEAD_LETTER_DELIVERIES: &str = "
    delete from deliveries where intent_id is null and received_at < now() - make_interval(secs => $1)";

/// Deletes expired finished keys (never ones pending approval, unknown or in flight, nor any
/// key of a run that still waits on one), leaving tombstones; returns how many keys went.
pub async fn prune(pool: &Pool, config: &crate::config::Config) -> Result<i64, DbError> {
    let client = pool.get().await?;
    let tombstone = config.relay.tombstone_retention.as_secs_f64();
    let mut total = 0;
    for tool in &config.tools {
        let retention = tool.retention.as_secs_f64();
        loop {
            let n: i64 = client
                .query_one(PRUNE_TOOL, &[&tool.name, &retention, &tombstone])
                .await?
                .get(0);
            total += n;
            if n < 1000 {
                break;
            }
        }
    }
    client.execute(PRUNE_TOMBSTONES, &[]).await?;
    let shortest = config
        .tools
        .iter()
        .map(|t| t.retention)
        .min()
        .unwrap_or(std::time::Duration::from_secs(7 * 86400));
    client
        .execute(PRUNE_DEAD_LETTER_DELIVERIES, &[&shortest.as_secs_f64()])
        .await?;
    Ok(total)
}
