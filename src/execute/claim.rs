//! Claims, attempts and leases: who may run an intent now, and what each try did.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use tokio_postgres::{GenericClient, Row};

use crate::db::DbError;
use crate::intent::IntentStatus;

/// An intent claimed for execution.
#[derive(Debug, Clone)]
pub struct Claimed {
    pub id: i64,
    pub key: String,
    pub tool: String,
    pub run_id: String,
    pub step: Option<i64>,
    pub business_id: Option<String>,
    pub args: Map<String, Value>,
    pub traceparent: Option<String>,
    /// Event time, or when the intent was recorded.
    pub started: DateTime<Utc>,
    /// Downstream calls made before this claim.
    pub attempts: i32,
    /// The fencing token: writes are refused once another claim has been made.
    pub epoch: i64,
    /// An earlier call may have happened: verify before calling.
    pub needs_verify: bool,
    /// How long ago the key's last call started (database clock), when it had one: a
    /// verification answering "not done" concludes only once that call's deadline has passed.
    pub since_call: Option<Duration>,
    /// Why this claim calls: `first`, `recovery` or `manual`.
    pub reason: String,
    /// The attempt row the claim opened (a call, or a verification when `needs_verify`).
    pub seq: i32,
    /// When this relay made the claim: for a claim made at record, read before the recording
    /// transaction began (Postgres dates the lease from that transaction's start), so the age
    /// it gives is never short.
    pub claimed_at: std::time::Instant,
}

/// A claim made when its intent was recorded and sent within this long needs no fence before
/// its first call: its lease (seconds) cannot have run out, and its attempt's start (the
/// claim's time) precedes the send by at most this much. Recovery adds it to a call's timeout
/// before concluding that a call with that start can no longer be in flight.
pub const FRESH_CLAIM: Duration = Duration::from_millis(100);

/// Whether a claim made when its intent was recorded, `age` ago by this relay's monotonic clock
/// (read before the recording transaction began, so never short), may make its first call
/// without re-checking its lease in Postgres. Either of two arguments holds it:
/// - `age` is at most [`FRESH_CLAIM`]: recovery's deadline for that call already allows for it;
/// - the call ends, sent now and timing out at `timeout`, within the first half of the lease
///   taken at the claim. No other relay takes a key over before its lease runs out, so nobody
///   can verify or call it while this call may be in flight, and a takeover finds that call's
///   deadline long past. The other half is the slack for what this check cannot see: clocks
///   that run at slightly different rates, and a pause of the process between this check and
///   the send (the fence statement leaves a paused relay a similar slack: the lease it renews,
///   less the call's timeout).
///
/// A claim that waited longer (a busy tool, a relay paused with claims queued) is fenced.
pub fn sends_unfenced(age: Duration, lease: Duration, timeout: Duration) -> bool {
    age <= FRESH_CLAIM || age + timeout <= lease / 2
}

impl Claimed {
    /// A row of CLAIM_MANY.
    fn from_row(row: &Row) -> Self {
        Claimed {
            id: row.get("id"),
            key: row.get("idempotency_key"),
            tool: row.get("tool"),
            run_id: row.get("run_id"),
            step: row.get("step"),
            business_id: row.get("business_id"),
            args: match row.get("args") {
                Value::Object(m) => m,
                _ => Map::new(),
            },
            traceparent: row.get("traceparent"),
            started: row.get("started"),
            attempts: row.get("attempts"),
            epoch: row.get("lease_epoch"),
            needs_verify: row.get("needs_verify"),
            reason: row.get("next_reason"),
            since_call: row
                .get::<_, Option<f64>>("since_call")
                .map(|s| Duration::from_secs_f64(s.max(0.0))),
            seq: row.get("seq"),
            claimed_at: std::time::Instant::now(),
        }
    }
}

/// How an attempt ended, for the attempt log.
#[derive(Debug, Clone)]
pub struct AttemptEnd {
    pub seq: i32,
    pub classification: &'static str,
    pub http_status: Option<i32>,
    pub error: Option<String>,
    pub latency_ms: f64,
}

// Fenced like every write of a claim: a relay that lost its lease cannot start another call.
// An UPDATE, not a read: it waits for a concurrent takeover and re-checks the epoch and the
// lease after it, so a relay that slept past its lease cannot start another call. It renews the
// lease for the call it opens.
const BEGIN_ATTEMPT: &str = "
    with i as (
        update intents set lease_expires_at = now() + make_interval(secs => $6)
         where id = $1 and lease_epoch = $2 and status = 'running' and lease_expires_at > now()
        returning id, idempotency_key
    )
    insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
    select i.id, i.idempotency_key,
           coalesce((select max(seq) from attempts where intent_id = i.id), 0) + 1, $3, $4, $5, $2
      from i
    returning seq";

// Never over an end already written: recovery may have closed it `abandoned` meanwhile, and
// what it read then is what the history says. A claim made at record opened its attempt then,
// and may have waited in the queue before sending (see `sends_unfenced`): the start becomes the
// send's time, as the measured latency dates it (only ever later, which makes a later
// recovery's wait for that call's deadline longer, never shorter).
const END_ATTEMPT: &str = "
    update attempts set ended_at = now(), classification = $3, http_status = $4, error = $5,
                        latency_ms = $6::float8,
                        started_at = case when $6::float8 > 0
                            then greatest(started_at,
                                          now() - make_interval(secs => $6::float8 / 1000))
                            else started_at end
     where intent_id = $1 and seq = $2 and ended_at is null";

/// Opens the next attempt row; `None` when the claim was lost.
pub async fn begin_attempt(
    client: &impl GenericClient,
    c: &Claimed,
    kind: &str,
    reason: &str,
    owner: &str,
    lease_secs: f64,
) -> Result<Option<i32>, DbError> {
    Ok(client
        .query_opt(
            BEGIN_ATTEMPT,
            &[&c.id, &c.epoch, &kind, &reason, &owner, &lease_secs],
        )
        .await?
        .map(|r| r.get(0)))
}

// A claim whose call never started, given back: the attempt it opened is closed as not sent.
const UNCLAIM: &str = "
    with i as (
        update intents set status = 'pending', lease_owner = null, lease_expires_at = null,
                           lease_epoch = lease_epoch + 1, updated_at = now()
         where id = $1 and lease_epoch = $2 and status = 'running'
        returning id
    )
    update attempts set ended_at = now(), classification = 'not_sent',
                        error = 'the relay stopped before this call'
     where intent_id in (select id from i) and seq = $3";

/// Releases a claim whose call did not start, for another relay to claim.
pub async fn unclaim(client: &impl GenericClient, c: &Claimed) -> Result<(), DbError> {
    client.execute(UNCLAIM, &[&c.id, &c.epoch, &c.seq]).await?;
    Ok(())
}

pub async fn end_attempt(
    client: &impl GenericClient,
    intent_id: i64,
    end: &AttemptEnd,
) -> Result<(), DbError> {
    client
        .execute(
            END_ATTEMPT,
            &[
                &intent_id,
                &end.seq,
                &end.classification,
                &end.http_status,
                &end.error,
                &end.latency_ms,
            ],
        )
        .await?;
    Ok(())
}

// Only the claims whose calls are still running here: a claim whose task died lapses, and
// recovery takes it over.
const EXTEND_LEASES: &str = "
    with locked as materialized (
        select id from intents where id = any($2) and lease_owner = $1 order by id for update
    )
    update intents i set lease_expires_at = now() + make_interval(secs => $3)
      from locked l
     where i.id = l.id and i.lease_owner = $1 and i.status = 'running'";

/// Keeps this relay's live claims alive while their calls run.
pub async fn extend_leases(
    client: &impl GenericClient,
    owner: &str,
    ids: &[i64],
    lease_secs: f64,
) -> Result<u64, DbError> {
    Ok(client
        .execute(EXTEND_LEASES, &[&owner, &ids, &lease_secs])
        .await?)
}

// Many claims in one statement (and one commit). Each claim and the attempt row it opens
// commit together: there is never a call without a durable record that it began.
const CLAIM_MANY: &str = "
    with locked as materialized (
        select id from intents where id = any($1) order by id for update
    ), c as (
        update intents i
           set status = 'running', lease_owner = $2,
               lease_expires_at = now() + make_interval(secs => $3),
               lease_epoch = i.lease_epoch + 1, updated_at = now()
          from locked l
         where i.id = l.id and i.status = 'pending'
        returning i.id, i.idempotency_key, i.tool, i.run_id, i.step, i.business_id, i.args,
                  i.traceparent, coalesce(i.event_time, i.created_at) as started,
                  i.attempts, i.lease_epoch, i.needs_verify, i.next_reason,
                  (select extract(epoch from now() - max(p.started_at))::float8
                     from attempts p where p.intent_id = i.id and p.kind = 'call') as since_call
    ), a as (
        insert into attempts (intent_id, idempotency_key, seq, kind, reason, owner, lease_epoch)
        select c.id, c.idempotency_key,
               coalesce((select max(seq) from attempts where intent_id = c.id), 0) + 1,
               case when c.needs_verify then 'verify' else 'call' end,
               c.next_reason, $2, c.lease_epoch
          from c
        returning intent_id, seq
    )
    select c.*, a.seq from c join a on a.intent_id = c.id";

/// Claims every pending intent of `ids` at once; the others are missing from the answer.
pub async fn claim_many(
    client: &impl GenericClient,
    ids: &[i64],
    owner: &str,
    lease_secs: f64,
) -> Result<HashMap<i64, Claimed>, DbError> {
    let rows = client
        .query(CLAIM_MANY, &[&ids, &owner, &lease_secs])
        .await?;
    Ok(rows
        .iter()
        .map(|row| {
            let c = Claimed::from_row(row);
            (c.id, c)
        })
        .collect())
}

// Claims that waited in the local queue, re-checked just before their first send: the epoch
// is still theirs and the lease has not run out (a relay paused past its lease has lost the
// key to recovery, which may be verifying or calling it). Each lease is renewed for the call,
// and the call's attempt restarts its clock, so its deadline counts from the send.
//
// The status is a parameter ($5, `running`): as a literal it matched the partial index of open
// intents, and a plan made while few ran (a new schema) read every running intent through that
// index on each later fence, for a connection's life.
const FENCE_MANY: &str = "
    with locked as materialized (
        select id from intents where id = any($1) order by id for update
    ), f as (
        update intents i set lease_expires_at = now() + make_interval(secs => $4)
          from locked l, unnest($1::int8[], $2::int8[]) as u(id, epoch)
         where i.id = l.id and u.id = i.id and i.lease_epoch = u.epoch
           and i.status = $5 and i.lease_expires_at > now()
        returning i.id
    ), a as (
        update attempts a set started_at = now()
          from unnest($1::int8[], $3::int4[]) as u(id, seq)
         where a.intent_id = u.id and a.seq = u.seq and a.ended_at is null
           and u.id = any(array(select id from f))
    )
    select id from f";

/// One claim to re-check before its first send.
#[derive(Debug, Clone, Copy)]
pub struct Fence {
    pub id: i64,
    pub epoch: i64,
    pub seq: i32,
}

/// Re-checks many claims at once; answers which still hold.
pub async fn fence_many(
    client: &deadpool_postgres::Client,
    items: &[Fence],
    lease_secs: f64,
) -> Result<HashSet<i64>, DbError> {
    let ids: Vec<i64> = items.iter().map(|f| f.id).collect();
    let epochs: Vec<i64> = items.iter().map(|f| f.epoch).collect();
    let seqs: Vec<i32> = items.iter().map(|f| f.seq).collect();
    let statement = client.prepare_cached(FENCE_MANY).await?;
    Ok(client
        .query(
            &statement,
            &[
                &ids,
                &epochs,
                &seqs,
                &lease_secs,
                &IntentStatus::Running.as_str(),
            ],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn a_fresh_claim_is_sent_unfenced_whatever_its_lease() {
        assert!(sends_unfenced(FRESH_CLAIM, S(3), S(30)));
        assert!(!sends_unfenced(
            FRESH_CLAIM + Duration::from_millis(1),
            S(3),
            S(30)
        ));
    }

    #[test]
    fn a_queued_claim_is_sent_unfenced_while_its_call_ends_well_inside_the_lease() {
        // 30 s lease, 10 s timeout: the call must end within the lease's first 15 s.
        assert!(sends_unfenced(Duration::from_millis(5_000), S(30), S(10)));
        assert!(!sends_unfenced(Duration::from_millis(5_001), S(30), S(10)));
        // A relay paused past its lease is always fenced.
        assert!(!sends_unfenced(S(31), S(30), S(1)));
        // A timeout as long as the lease leaves only the fresh-claim allowance.
        assert!(!sends_unfenced(Duration::from_millis(200), S(30), S(30)));
    }

    // A claim waiting past its fresh window is fenced before its first send, by a statement
    // each connection prepares once and keeps planned. Planned while no intent was running (a
    // new schema), the plan must still look up the claims' own rows once thousands run.
    #[tokio::test]
    async fn fencing_claims_reads_their_rows_whatever_ran_when_it_was_planned() {
        use crate::db::plans::{rows_read, Fresh};
        let db = Fresh::new().await;
        let fence = |ids: &str, epochs: &str, seqs: &str| {
            format!("execute f('{{{ids}}}', '{{{epochs}}}', '{{{seqs}}}', 30, 'running')")
        };
        let prepare = format!("prepare f(int8[], int8[], int4[], float8, text) as {FENCE_MANY}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        db.rows(&format!("begin; {}; rollback", fence("1", "1", "1")))
            .await;
        // Five thousand claims running, fifteen thousand keys finished.
        let running = "g % 4 = 0";
        let status = format!("case when {running} then 'running' else 'succeeded' end");
        db.intents(20_000, &status, running).await;

        // Ten running claims fenced, one of them (id 40) lost to another epoch.
        let read = fence(
            "4,8,12,16,20,24,28,32,36,40",
            "1,1,1,1,1,1,1,1,1,2",
            "1,1,1,1,1,1,1,1,1,1",
        );
        let fenced = db.rows(&format!("begin; {read}; rollback")).await;
        let mut ids: Vec<i64> = fenced.iter().map(|r| r[0].1.parse().unwrap()).collect();
        ids.sort();
        assert_eq!(ids, [4, 8, 12, 16, 20, 24, 28, 32, 36]);
        let plan = db.explain(&read).await;
        let n = rows_read(&plan, "intents");
        assert!(
            n <= 20.0,
            "fencing 10 claims read {n} intents (locked, then updated): {plan:#}"
        );
        db.drop().await;
    }
}
