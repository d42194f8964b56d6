use std::time::{Duration, Instant};

use serde_json::Value;

use crate::config::Tool;
use crate::db::DbError;
use crate::outcome::answer::KeyState;
use crate::outcome::{Finish, FinishError, Guard, Settled};
use crate::outcome::{OutcomeError, OutcomeStatus};

use crate::execute::claim::{AttemptEnd, Claimed};

use super::sql_tool::run_sql;
use super::*;

impl Executor {
    /// Re-checks a queued claim's lease and epoch just before its first send.
    pub(super) async fn fence(&self, c: &Claimed) -> Result<(), ExecError> {
        let item = crate::execute::claim::Fence {
            id: c.id,
            epoch: c.epoch,
            seq: c.seq,
        };
        if with_retry(&self.metrics, "fence", || ask(&self.fences, item)).await? {
            Ok(())
        } else {
            Err(ExecError::Fenced)
        }
    }

    pub(super) fn unknown(&self, tool: &Tool, why: &str, calls: i32) -> Settled {
        self.metrics.unknown_outcome(&tool.name);
        Settled::new(
            OutcomeStatus::Unknown,
            None,
            Some(ErrorCode::OutcomeUnknown.error(why.to_string())),
            calls,
        )
    }

    /// Opens the next attempt row; a lost claim ends the call here.
    pub(super) async fn begin(
        &self,
        c: &Claimed,
        kind: &str,
        reason: &str,
    ) -> Result<i32, ExecError> {
        with_retry(&self.metrics, "begin attempt", || async {
            let client = self.pool.get().await.map_err(DbError::from)?;
            crate::execute::claim::begin_attempt(
                &**client,
                c,
                kind,
                reason,
                &self.owner,
                self.lease.as_secs_f64(),
            )
            .await?
            .ok_or(ExecError::Fenced)
        })
        .await
    }

    pub(super) async fn unclaim(&self, c: &Claimed) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        crate::execute::claim::unclaim(&**client, c).await
    }

    pub(super) async fn end(&self, c: &Claimed, end: AttemptEnd) -> Result<(), ExecError> {
        with_retry(&self.metrics, "end attempt", || async {
            let client = self.pool.get().await.map_err(DbError::from)?;
            crate::execute::claim::end_attempt(&**client, c.id, &end).await?;
            Ok(())
        })
        .await
    }

    /// Records a call's result, grouped with other calls' results into one transaction.
    pub(super) async fn record(
        &self,
        c: &Claimed,
        settled: Settled,
        end: Option<AttemptEnd>,
        expected: Option<Expected>,
    ) -> Result<(), ExecError> {
        // Moved into the first try: `with_retry` calls its closure once per try.
        let expected = std::sync::Mutex::new(expected);
        let item = Finish {
            id: c.id,
            epoch: c.epoch,
            settled: settled.clone(),
            end,
        };
        let state = with_retry(&self.metrics, "record", || {
            let expected = expected.lock().expect("not poisoned").take();
            ask_expected(&self.finishes, item.clone(), expected)
        })
        .await?
        .ok_or(ExecError::Fenced)?;
        self.metrics.postgres_wrote();
        self.recorded(c, &settled, &state, false);
        Ok(())
    }

    /// The sql executor: the statement runs in the transaction that records its outcome, so
    /// the effect and its record commit together or not at all.
    pub(super) async fn record_sql(&self, c: &Claimed, tool: &Tool) -> Result<(), ExecError> {
        let _slot = self
            .sql_slots
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        let mut client = self.pool.get().await.map_err(DbError::from)?;
        let tx = client.transaction().await.map_err(DbError::from)?;
        let started = Instant::now();
        let settled = run_sql(&tx, tool, c).await?;
        let class = if settled.status == OutcomeStatus::Succeeded {
            "succeeded"
        } else {
            "failed"
        };
        let detail = settled.error.as_ref().map(|e| e.message.clone());
        let end = AttemptEnd::new(c.seq, class, None, detail, started.elapsed());
        crash_point!("before-outcome-commit");
        let state = match crate::outcome::finish(
            &tx,
            c.id,
            Guard::Claim(c.epoch),
            &settled,
            Some(&end),
            &self.channel,
        )
        .await
        {
            Ok(state) => state,
            Err(FinishError::Fenced(_)) => return Err(ExecError::Fenced),
            Err(FinishError::Db(e)) => return Err(ExecError::Db(e)),
        };
        tx.commit().await.map_err(DbError::from)?;
        crash_point!("after-outcome-commit");
        self.recorded(c, &settled, &state, true);
        Ok(())
    }

    pub(super) fn recorded(&self, c: &Claimed, settled: &Settled, state: &KeyState, sql: bool) {
        if sql && settled.status == OutcomeStatus::Succeeded {
            self.metrics.side_effect(&state.tool);
        }
        self.metrics.outcome(&state.tool, settled.status.as_str());
        self.metrics.attempts(state.attempts.max(0) as u32);
        if let Some(e) = &settled.error {
            if settled.status == OutcomeStatus::Rejected {
                self.metrics.rejection(&state.tool, &e.code, 1);
            }
        }
        let latency = (chrono::Utc::now() - c.started).num_milliseconds().max(0) as f64 / 1000.0;
        self.metrics.action_latency(&state.tool, latency);
        tracing::info!(
            status = settled.status.as_str(),
            attempts = state.attempts,
            "outcome recorded"
        );
    }
}

impl Settled {
    /// The effect certainly did not happen and the retry budget is spent: failed, retryable.
    pub(super) fn not_done(code: ErrorCode, message: String, calls: i32) -> Self {
        Settled::new(
            OutcomeStatus::Failed,
            None,
            Some(code.error(message)),
            calls,
        )
    }

    pub(crate) fn new(
        status: OutcomeStatus,
        result: Option<Value>,
        error: Option<OutcomeError>,
        attempts: i32,
    ) -> Self {
        Settled {
            status,
            result,
            error,
            attempts,
        }
    }
}

impl AttemptEnd {
    pub(super) fn new(
        seq: i32,
        classification: &'static str,
        http_status: Option<i32>,
        error: Option<String>,
        took: Duration,
    ) -> Self {
        AttemptEnd {
            seq,
            classification,
            http_status,
            error,
            latency_ms: took.as_secs_f64() * 1000.0,
        }
    }

    /// An attempt that ended before anything was sent, and why.
    pub(super) fn unsent(seq: i32, classification: &'static str, why: &str) -> Self {
        AttemptEnd::new(seq, classification, None, Some(why.into()), Duration::ZERO)
    }
}
