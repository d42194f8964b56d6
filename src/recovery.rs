//! Recovery: intents whose claim ran out or that waited too long are handed on, as the attempt
//! log decides.

use std::collections::HashMap;
use std::time::Duration;

use deadpool_postgres::Transaction;
use tokio_postgres::GenericClient;

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{ExecutorKind, ToolClass};
use crate::db::DbError;
use crate::execute::attempt_log;
use crate::execute::Executor;
use crate::intent::IntentStatus;
use crate::outcome::ErrorCode;
use crate::outcome::{FinishError, Guard, OutcomeStatus, Settled};

/// Intents left behind: recorded but never claimed (a relay died before dispatching them), or
/// claimed by a relay whose lease ran out.
///
/// Ordered by `id + 0`, an expression no index gives: by `id`, the plan could walk the primary
/// key for the first `$2` matches, and a sweep usually finds none, so whenever the open intents
/// were a percent or more of the table (a young table, a high `concurrency`) every sweep read
/// the whole table. The open ones are found through their partial index and sorted; locks are still
/// taken in id order.
const SELECT_ORPHANS: &str = "
    select id, status, class, tool
      from intents
     where ((status = 'pending' and updated_at < now() - make_interval(secs => $1))
            or (status = 'running' and lease_expires_at < now()))
       and id <> all($3)
     order by id + 0
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
            was_running: IntentStatus::parse(r.get("status")) == Some(IntentStatus::Running),
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

/// Keys by status: parked (waiting for a person) and open (recorded, not yet settled). Two
/// halves, each the predicate of a partial index (`intents_open`, `intents_parked`), so the
/// count reads only those keys: as one `in` list of four statuses Postgres scanned every
/// intent, every sweep (seconds of CPU each with 4 million finished keys).
const PARKED: &str = "
    select status, count(*) from intents where status in ('pending', 'running') group by status
    union all
    select status, count(*) from intents where status in ('pending_approval', 'unknown')
     group by status";

pub async fn parked_counts(client: &impl GenericClient) -> Result<Vec<(String, i64)>, DbError> {
    Ok(client
        .query(PARKED, &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

/// Finds intents left behind by a crash or an expired lease and finishes them. Safe in every
/// relay at once: rows are locked with SKIP LOCKED.
pub async fn run(executor: Arc<Executor>, interval: Duration, shutdown: CancellationToken) {
    loop {
        match sweep(&executor).await {
            Ok(n) if n > 0 => tracing::info!(recovered = n, "recovered intents"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "recovery sweep failed"),
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// One sweep: orphans are requeued with the attempt log's verdict, or parked `unknown`.
pub async fn sweep(executor: &Arc<Executor>) -> Result<usize, DbError> {
    let x = executor;
    let expired = crate::gates::expire_approvals(&x.control, &x.config).await?;
    if expired > 0 {
        tracing::info!(expired, "approvals timed out");
    }
    let mut client = x.control.get().await?;
    if let Ok(counts) = parked_counts(&**client).await {
        for status in IntentStatus::PARKED {
            let n = counts
                .iter()
                .find(|(s, _)| s == status.as_str())
                .map_or(0, |(_, n)| *n);
            x.metrics.parked(status.as_str(), n);
        }
        let open: i64 = counts
            .iter()
            .filter(|(s, _)| s == "pending" || s == "running")
            .map(|(_, n)| n)
            .sum();
        x.metrics.intents_pending.set(open);
    }
    let tx = client.transaction().await?;
    // This relay's own queue is skipped in SQL, so a long local backlog cannot hide a
    // lapsed claim from the sweep.
    let local = x.local_ids();
    let orphans = orphans(&tx, 2.0, 500, &local).await?;
    let lapsed: Vec<i64> = orphans
        .iter()
        .filter(|o| o.was_running)
        .map(|o| o.id)
        .collect();
    if !lapsed.is_empty() {
        abandon_attempts(&tx, &lapsed).await?;
    }
    let ids: Vec<i64> = orphans.iter().map(|o| o.id).collect();
    let mut histories = histories(&tx, &ids).await?;
    let mut redispatch = Vec::new();
    for o in &orphans {
        if x.is_local(o.id) {
            continue;
        }
        let tool = x.tools.get(&o.tool);
        let dangerous_http = o.class == ToolClass::Dangerous.as_str()
            && tool.is_none_or(|t| matches!(t.executor, ExecutorKind::Http(_)));
        let can_verify = tool.is_some_and(|t| t.verify.is_some());
        let history = histories.remove(&o.id).unwrap_or_default();
        // The one rule: what the next claim does follows from the durable history alone.
        let verdict = attempt_log::next_step(&history, dangerous_http);
        if matches!(verdict.next, attempt_log::Next::Verify { .. }) && !can_verify {
            // A call may have happened, and nothing can tell. Parked for a person.
            let epoch = take_over(&tx, o.id, &x.owner, verdict.calls).await?;
            let settled = Settled::new(
                OutcomeStatus::Unknown,
                None,
                Some(
                    ErrorCode::OutcomeUnknown
                        .error("the relay running this call stopped before recording its result"),
                ),
                0,
            );
            match crate::outcome::finish(&tx, o.id, Guard::Claim(epoch), &settled, None, &x.channel)
                .await
            {
                Ok(_) => {
                    x.metrics.unknown_outcome(&o.tool);
                    x.metrics.outcome(&o.tool, OutcomeStatus::Unknown.as_str());
                }
                Err(FinishError::Fenced(_)) => {}
                Err(FinishError::Db(e)) => return Err(e),
            }
        } else {
            requeue(&tx, o.id, &verdict).await?;
            redispatch.push((o.id, o.tool.clone()));
        }
    }
    tx.commit().await?;
    for (id, tool) in &redispatch {
        x.dispatch(*id, tool).await;
    }
    Ok(orphans.len())
}

#[cfg(test)]
mod tests {
    use super::SELECT_ORPHANS;
    use crate::db::plans::{rows_read, Fresh};

    // Every sweep looks for orphans, and there are usually none. Ordered by id with a limit,
    // the plan could walk the primary key hoping to meet the limit early, reading every intent
    // to find none, whenever the open intents were a percent or more of the table (a young
    // table, a high `concurrency`).
    #[tokio::test]
    async fn the_sweep_for_orphans_reads_open_intents_not_the_table() {
        let db = Fresh::new().await;
        // Forty-eight thousand finished keys, a thousand claims running under a live lease,
        // a thousand recorded just now: open, and none of them an orphan.
        let status = "case when g % 50 = 0 then 'running'
                           when g % 50 = 1 then 'pending' else 'succeeded' end";
        db.intents(50_000, status, "g % 50 = 0").await;
        db.pg
            .batch_execute("analyze intents")
            .await
            .expect("analyze");
        let prepare = format!("prepare o(float8, int8, int8[]) as {SELECT_ORPHANS}");
        db.pg.batch_execute(&prepare).await.expect("prepare");
        let sweep = "execute o(60, 100, '{}')";

        let orphans = db.rows(&format!("begin; {sweep}; rollback")).await;
        assert!(orphans.is_empty(), "{orphans:?}");
        let plan = db.explain(sweep).await;
        let n = rows_read(&plan, "intents");
        assert!(
            n <= 2_000.0,
            "a sweep read {n} intents to find none among 2,000 open: {plan:#}"
        );

        // Orphans are still found, the lowest ids first, as many as asked for.
        db.pg
            .batch_execute(
                "update intents set lease_expires_at = now() - interval '1 second'
                  where id in (300, 5000, 150);
                 update intents set updated_at = now() - interval '1 hour'
                  where id in (2001, 51);",
            )
            .await
            .expect("orphans");
        let orphans = db.rows("begin; execute o(60, 4, '{}'); rollback").await;
        let ids: Vec<&str> = orphans.iter().map(|r| r[0].1.as_str()).collect();
        assert_eq!(ids, ["51", "150", "300", "2001"]);
        db.drop().await;
    }
}
