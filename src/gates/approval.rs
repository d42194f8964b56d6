//! Human approval: a person's decision on a key parked `pending_approval`, and the timeout
//! that rejects keys nobody decided on.

use deadpool_postgres::Pool;

use crate::db::DbError;
use crate::intent::IntentStatus;
use crate::outcome::{finish_parked, Settled};
use crate::outcome::{ErrorCode, OutcomeStatus};

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

crate::db::from_postgres!(DecideError);

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
    if IntentStatus::parse(&status) != Some(IntentStatus::PendingApproval) {
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
                error: Some(ErrorCode::ApprovalDenied.error(format!("{by} denied it: {reason}"))),
                attempts: 0,
            };
            let channel = crate::publish::outbox::outbox_channel(schema);
            let parked = IntentStatus::PendingApproval;
            if !finish_parked(&tx, id, parked, &settled, &channel).await? {
                return Err(DecideError::NotPending {
                    key: key.to_string(),
                    status: "changing".into(),
                });
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

/// Rejects keys that waited for approval longer than their tool's `approval_timeout`: up to 500
/// of a tool's per transaction, their decisions and finishes pipelined, so the keys are held
/// locked for a few round trips rather than four each (a repeat of one waits for the lock).
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
        let reason = format!("nobody decided within {}s", tool.approval_timeout.as_secs());
        let settled = Settled {
            status: OutcomeStatus::Rejected,
            result: None,
            error: Some(ErrorCode::ApprovalTimeout.error(reason.clone())),
            attempts: 0,
        };
        let due = tx.query(EXPIRED_APPROVALS, &[&tool.name, &timeout]).await?;
        let (open, reason, settled, channel) = (&tx, &reason, &settled, &channel);
        let expire = due.iter().map(|row| async move {
            let (id, key, fp): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
            open.execute(
                RECORD_DECISION,
                &[&id, &key, &fp, &"expired", &"idem", reason],
            )
            .await?;
            finish_parked(open, id, IntentStatus::PendingApproval, settled, channel).await
        });
        let mut failure = None;
        for result in futures::future::join_all(expire).await {
            match result {
                Ok(finished) => expired += usize::from(finished),
                // After one statement fails, every one pipelined behind it fails as "current
                // transaction is aborted": report the one that failed first.
                Err(e) if failure.as_ref().is_none_or(DbError::follows_a_failure) => {
                    failure = Some(e)
                }
                Err(_) => {}
            }
        }
        if let Some(e) = failure {
            return Err(e);
        }
        tx.commit().await?;
    }
    Ok(expired)
}
