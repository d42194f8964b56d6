//! Recovery: intents whose claim ran out or that waited too long are handed on, as the attempt
//! log decides.

use std::collections::HashMap;
use std::time::Duration;

use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;

use crate::attempt_log;
use crate::db::DbError;

/// Intents left behind: recorded but never claimed (a relay died before dispatching them), or
/// claimed by a relay whose lease ran out.
const SELECT_ORPHANS: &str = "
    select id, status, class, tool
      from intents
     where ((status = 'pending' and updated_at < now() - make_interval(secs => $1))
            or (status = 'running' and lease_expires_at < now()))
       and id <> all($3)
     order by id
     limit $2
     for update skip locked";

// A claim that ran out: its open attempts were abandoned mid-way. What they may have done is
// read back from the history by the attempt log's rule.
const ABANDON_ATTEMPTS: &str = "
    update attempts set ended_at = now(), classification = 'abandoned'
     where intent_id = any($1) and ended_at is null";

// Every attempt of the orphans, in order, with its age by the database's clock.
const SELECT_HISTORY: &str = "
    select intent_id, kind, classification,
           extract(epoch from now() - started_at)::float8 as age_secs
      from attempts
     where intent_id = any($1)
     order by intent_id, seq";

// Hands an orphan to the next claim with the attempt log's verdict: verify first or call, and
// the calls that count against the retry budget.
pub(crate) const REQUEUE: &str = "
    update intents set status = 'pending', lease_owner = null, lease_expires_at = null,
                       lease_epoch = lease_epoch + 1, updated_at = now(),
                       next_reason = case when status = 'running' then 'recovery' else next_reason end,
                       needs_verify = $2, attempts = greatest(attempts, $3)
     where id = $1";

const TAKE_OVER: &str = "
    update intents set status = 'running', lease_owner = $2, lease_epoch = lease_epoch + 1,
                       attempts = greatest(attempts, $3)
     where id = $1
    returning lease_epoch";

#[derive(Debug)]
pub struct Orphan {
    pub id: i64,
    /// The claim ran out.
    pub was_running: bool,
    pub class: String,
    pub tool: String,
}

/// Lists orphans (locking them for this transaction) without changing them.
pub async fn orphans(
    tx: &Transaction<'_>,
    min_pending_age_secs: f64,
    limit: i64,
    skip: &[i64],
) -> Result<Vec<Orphan>, DbError> {
    Ok(tx
        .query(SELECT_ORPHANS, &[&min_pending_age_secs, &limit, &skip])
        .await?
        .iter()
        .map(|r| Orphan {
            id: r.get("id"),
            was_running: r.get::<_, String>("status") == "running",
            class: r.get("class"),
            tool: r.get("tool"),
        })
        .collect())
}

/// Closes the attempts dead claims left open.
pub async fn abandon_attempts(tx: &Transaction<'_>, ids: &[i64]) -> Result<(), DbError> {
    tx.execute(ABANDON_ATTEMPTS, &[&ids]).await?;
    Ok(())
}

/// The attempt log of each of `ids`, in order.
pub async fn histories(
    tx: &Transaction<'_>,
    ids: &[i64],
) -> Result<HashMap<i64, Vec<attempt_log::Past>>, DbError> {
    let mut out: HashMap<i64, Vec<attempt_log::Past>> = HashMap::new();
    for r in tx.query(SELECT_HISTORY, &[&ids]).await? {
        let classification: Option<String> = r.get("classification");
        out.entry(r.get("intent_id"))
            .or_default()
            .push(attempt_log::Past {
                kind: attempt_log::Kind::parse(r.get("kind")),
                ended: classification.as_deref().map(|c| {
                    // An unknown word is read as the worst case: it may have happened.
                    attempt_log::Ended::parse(c).unwrap_or(attempt_log::Ended::Abandoned)
                }),
                age: Duration::from_secs_f64(r.get::<_, f64>("age_secs").max(0.0)),
            });
    }
    Ok(out)
}

/// Makes an orphan claimable again, with what the attempt log says its next claim does.
pub async fn requeue(
    tx: &Transaction<'_>,
    id: i64,
    verdict: &attempt_log::Verdict,
) -> Result<(), DbError> {
    let verify = matches!(verdict.next, attempt_log::Next::Verify { .. });
    tx.execute(REQUEUE, &[&id, &verify, &verdict.calls]).await?;
    Ok(())
}

/// Takes over an orphan, fencing out its old owner; returns the new epoch.
pub async fn take_over(
    tx: &Transaction<'_>,
    id: i64,
    owner: &str,
    calls: i32,
) -> Result<i64, DbError> {
    Ok(tx
        .query_one(TAKE_OVER, &[&id, &owner, &calls])
        .await?
        .get(0))
}

const PARKED: &str = "select status, count(*) from intents where status in ('unknown', 'pending_approval') group by status";

pub async fn parked_counts(client: &impl GenericClient) -> Result<Vec<(String, i64)>, DbError> {
    Ok(client
        .query(PARKED, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

// -------------------------------------------------------------------- outbox
