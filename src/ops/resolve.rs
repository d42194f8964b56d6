//! `resolve`: a person settles a key parked `unknown`.

use deadpool_postgres::Pool;
use serde_json::json;

use crate::db::DbError;
use crate::intent::IntentStatus;
use crate::outcome::{finish_parked, Settled};
use crate::outcome::{ErrorCode, OutcomeStatus};

use super::InspectError;

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
    select id, status, fingerprint from intents
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

/// Settles a key parked `unknown`; with `fingerprint`, only if the key still stands for that
/// request. Succeeded and failed publish the key's new outcome (and
/// answer every waiting repeat); retry hands it back to the relays.
pub async fn resolve(
    pool: &Pool,
    schema: &str,
    key: &str,
    how: Resolution,
    by: &str,
    reason: &str,
    fingerprint: Option<&str>,
) -> Result<(), InspectError> {
    let mut client = pool.get().await.map_err(DbError::from)?;
    let tx = client.transaction().await?;
    let Some(row) = tx.query_opt(LOCK_INTENT, &[&key]).await? else {
        return Err(InspectError::NotFound(key.to_string()));
    };
    let (id, status, actual): (i64, String, String) = (row.get(0), row.get(1), row.get(2));
    if let Some(expected) = fingerprint.filter(|f| *f != actual) {
        return Err(InspectError::FingerprintMismatch {
            key: key.to_string(),
            expected: expected.to_string(),
            actual,
        });
    }
    if IntentStatus::parse(&status) != Some(IntentStatus::Unknown) {
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
            error: Some(
                ErrorCode::ResolvedFailed.error(format!("{by} resolved it as not done: {reason}")),
            ),
            attempts: 0,
        }),
        Resolution::Retry => None,
    };
    match settled {
        Some(settled) => {
            if !finish_parked(&tx, id, IntentStatus::Unknown, &settled, &channel).await? {
                return Err(InspectError::NotParked {
                    key: key.to_string(),
                    status: "changing".into(),
                });
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
