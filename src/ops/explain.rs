//! `explain`: everything known about one key, as JSON and as tables a person reads.

use deadpool_postgres::Pool;
use serde_json::Value;

use crate::db::DbError;

use super::InspectError;

/// The whole explanation, built by Postgres in one statement: every field is named here, once,
/// next to the column it comes from.
const EXPLAIN: &str = "
    select json_build_object(
        'idempotency_key', i.idempotency_key,
        'tool', i.tool,
        'class', i.class,
        'run_id', i.run_id,
        'step', i.step,
        'business_id', i.business_id,
        'status', i.status,
        'attempts', i.attempts,
        'result', i.result,
        'error', i.error,
        'first_action_event_id', i.action_event_id,
        'recorded_at', i.created_at::text,
        'finished_at', i.finished_at::text,
        'lease_owner', i.lease_owner,
        'lease_epoch', i.lease_epoch,
        'needs_verify', i.needs_verify,
        'fingerprint', i.fingerprint,
        'args', i.args,
        'material', i.material,
        'approvals', coalesce((
            select json_agg(json_build_object(
                       'decision', decision, 'by', decided_by, 'reason', reason,
                       'fingerprint', fingerprint, 'at', at::text) order by id)
              from approvals where intent_id = i.id), '[]'),
        'deliveries', coalesce((
            -- In the order they came: by the time of the transaction that recorded them, and
            -- within one by record.
            select json_agg(d.delivery order by d.at, d.carried desc, d.p, d.o, d.id) from (
                -- The first delivery is carried by the intent (schema migration 13), unless a
                -- relay of an earlier version wrote it as a row. Its answer is the key's own
                -- outcome.
                select true as carried, i.created_at as at, i.source_partition as p,
                       i.source_offset as o, 0::int8 as id, json_build_object(
                       'action_event_id', i.action_event_id, 'partition', i.source_partition,
                       'offset', i.source_offset, 'origin', 'first', 'answered', true,
                       'schema_id', i.schema_id,
                       'received_at', i.created_at::text) as delivery
                 where not exists (select 1 from deliveries f
                                    where f.intent_id = i.id and f.origin = 'first')
                union all
                select false, received_at, source_partition, source_offset, id, json_build_object(
                       'action_event_id', action_event_id, 'partition', source_partition,
                       'offset', source_offset, 'origin', origin, 'answered', answered,
                       'schema_id', schema_id,
                       'received_at', received_at::text)
                  from deliveries
                 where intent_id = i.id
                    -- A dead-lettered delivery has no intent, only the key it named.
                    or (intent_id is null and idempotency_key = i.idempotency_key)) d), '[]'),
        'calls', coalesce((
            select json_agg(json_build_object(
                       'seq', seq, 'kind', kind, 'reason', reason, 'owner', owner,
                       'lease_epoch', lease_epoch, 'started_at', started_at::text,
                       'ended_at', ended_at::text, 'result', classification,
                       'http_status', http_status, 'error', error, 'latency_ms', latency_ms)
                       order by seq)
              from attempts where intent_id = i.id), '[]'),
        'resolutions', coalesce((
            select json_agg(json_build_object(
                       'from', from_status, 'as', resolved_as, 'by', resolved_by,
                       'reason', reason, 'at', at::text) order by id)
              from resolutions where idempotency_key = i.idempotency_key), '[]'),
        'outcomes', coalesce((
            select json_agg(o.outcome order by o.at, o.id) from (
                select created_at as at, id, json_build_object(
                       'event_id', event_id,
                       'action_event_id', payload->'data'->>'action_event_id',
                       'status', payload->'data'->>'status',
                       'duplicate', (payload->'data'->>'duplicate')::bool,
                       'note', payload->'data'->>'note',
                       'recorded_at', created_at::text,
                       -- Kafka acknowledged it: out of the queue, not set aside.
                       'published', quarantined_at is null and not exists (
                           select 1 from outbox_pending p where p.id = outbox.id),
                       'quarantine_reason', quarantine_reason,
                       'direct', false) as outcome
                  from outbox where kafka_key = i.idempotency_key
                union all
                -- Repeats answered straight to Kafka keep no outbox row: their answers' ids are
                -- derived as the relay derives them (see outcome_id).
                select received_at, id, json_build_object(
                       'event_id', encode(substring(sha256(
                           convert_to(idempotency_key, 'UTF8') || '\\x00'::bytea
                           || convert_to('answer:' || action_event_id, 'UTF8')) from 1 for 16),
                           'hex')::uuid::text,
                       'action_event_id', action_event_id,
                       'status', direct_status,
                       'duplicate', true,
                       'note', 'sent straight to Kafka with the stored result (no outbox row)',
                       'recorded_at', received_at::text,
                       'published', null,
                       'quarantine_reason', null,
                       'direct', true)
                  from deliveries
                 where intent_id = i.id and direct_status is not null) o), '[]'))
      from intents i
     where i.idempotency_key = $1 and i.class <> 'read_only'";

/// Everything known about one key, as JSON.
pub async fn explain(pool: &Pool, key: &str) -> Result<Value, InspectError> {
    let client = pool.get().await.map_err(DbError::from)?;
    match client.query_opt(EXPLAIN, &[&key]).await? {
        Some(row) => Ok(row.get(0)),
        None => Err(InspectError::NotFound(key.to_string())),
    }
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
    // What was asked: the material fields (what an approver decides on) and every argument.
    out.push_str(&format!(
        "\nrequest: material {}  args {}\n",
        s(&e["material"]),
        s(&e["args"])
    ));
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
        let publication = match (&o["published"], &o["quarantine_reason"]) {
            (Value::Bool(true), _) => "published".to_string(),
            (_, Value::String(reason)) => format!("quarantined: {reason}"),
            (Value::Bool(false), _) => "not published yet".to_string(),
            _ => "sent straight to Kafka".to_string(),
        };
        out.push_str(&format!(
            "  {}  {}{} answering {}  {}\n    {}\n",
            s(&o["event_id"]),
            s(&o["status"]),
            dup,
            s(&o["action_event_id"]),
            publication,
            s(&o["note"])
        ));
    }
    out
}
