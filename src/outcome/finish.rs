//! Finishing intents: the outcome, its outbox row and the answers to waiting repeats, fenced
//! by the lease epoch.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use deadpool_postgres::{GenericClient, Transaction};
use serde_json::Value;
use tokio_postgres::Row;

use crate::db::DbError;
use crate::execute::claim::{end_attempt, AttemptEnd};
use crate::intent::IntentStatus;
use crate::outcome::answer::{self, KeyState};
use crate::outcome::Outcome;
use crate::outcome::{OutcomeError, OutcomeStatus};
use crate::publish::outbox::{insert_outbox, insert_outbox_handed, INSERT_OUTBOX_HANDED_SQL};

/// The settled state of a call.
#[derive(Debug, Clone)]
pub struct Settled {
    pub status: OutcomeStatus,
    pub result: Option<Value>,
    pub error: Option<OutcomeError>,
    /// Downstream attempts made under this claim.
    pub attempts: i32,
}

// A person's decision on a parked key: no claim to fence against, only the parked status.
const FINISH_PARKED: &str = "
    update intents
       set status = $2, result = $3, error = $4, attempts = attempts + $5,
           status_seq = status_seq + 1, lease_epoch = lease_epoch + 1,
           needs_verify = false, next_reason = 'first', updated_at = now(), finished_at = now()
     where id = $1 and status = $6
    returning idempotency_key, run_id, step, tool, action_event_id, attempts, status_seq,
              finished_at, traceparent";

/// What a finish must hold to be written.
#[derive(Debug, Clone, Copy)]
pub enum Guard {
    /// The claim with this epoch still owns the intent.
    Claim(i64),
    /// The intent is parked with this status (`unknown`, `pending_approval`) and a person
    /// decides it.
    Parked(IntentStatus),
}

const ANSWER_WAITING: &str = "
    update deliveries set answered = true
     where intent_id = $1 and not answered
    returning action_event_id";

/// An intent as a finish statement returns it (FINISH_PARKED, FINISH_MANY).
struct FinishedRow {
    key: String,
    run_id: String,
    step: Option<i64>,
    tool: String,
    first_event_id: String,
    attempts: i32,
    /// The number of this status change: its outcome event's id is derived from it.
    status_seq: i32,
    finished_at: DateTime<Utc>,
    traceparent: Option<String>,
}

impl FinishedRow {
    fn from_row(row: &Row) -> Self {
        FinishedRow {
            key: row.get("idempotency_key"),
            run_id: row.get("run_id"),
            step: row.get("step"),
            tool: row.get("tool"),
            first_event_id: row.get("action_event_id"),
            attempts: row.get("attempts"),
            status_seq: row.get("status_seq"),
            finished_at: row.get("finished_at"),
            traceparent: row.get("traceparent"),
        }
    }

    /// The key's state once `settled` is recorded.
    fn state(&self, settled: &Settled) -> KeyState {
        KeyState {
            key: self.key.clone(),
            run_id: self.run_id.clone(),
            step: self.step,
            tool: self.tool.clone(),
            status: settled.status,
            result: settled.result.clone(),
            error: settled.error.clone(),
            attempts: self.attempts,
            first_event_id: self.first_event_id.clone(),
            at: self.finished_at,
        }
    }
}

/// Why a finish was not recorded.
#[derive(Debug, thiserror::Error)]
pub enum FinishError {
    /// Another claim owns the intent now: this write is late and must not land.
    #[error("lease lost: intent {0} was claimed again")]
    Fenced(i64),
    #[error(transparent)]
    Db(#[from] DbError),
}

crate::db::from_postgres!(FinishError);

/// Records a call's result, its outcome event and the answers to every delivery waiting on
/// the key, in the caller's transaction, fenced by the claim's epoch.
pub async fn finish(
    tx: &Transaction<'_>,
    id: i64,
    guard: Guard,
    settled: &Settled,
    last_attempt: Option<&AttemptEnd>,
    channel: &str,
) -> Result<KeyState, FinishError> {
    let error = settled
        .error
        .as_ref()
        .map(|e| serde_json::to_value(e).expect("error serializes"));
    let parked = match guard {
        Guard::Parked(status) => status.as_str(),
        Guard::Claim(_) => "",
    };
    if let Guard::Claim(epoch) = guard {
        let item = Finish {
            id,
            epoch,
            settled: settled.clone(),
            end: last_attempt.cloned(),
        };
        return finish_many(tx, &[item], channel)
            .await?
            .pop()
            .flatten()
            .ok_or(FinishError::Fenced(id));
    }
    let row = tx
        .query_opt(
            FINISH_PARKED,
            &[
                &id,
                &settled.status.as_str(),
                &settled.result,
                &error,
                &settled.attempts,
                &parked,
            ],
        )
        .await?
        .ok_or(FinishError::Fenced(id))?;
    if let Some(end) = last_attempt {
        end_attempt(&**tx, id, end).await?;
    }
    let finished = FinishedRow::from_row(&row);
    let state = finished.state(settled);
    let traceparent = finished.traceparent;
    let mut outcomes = vec![answer::status_change(
        &state,
        finished.status_seq,
        traceparent.clone(),
    )];
    for row in tx.query(ANSWER_WAITING, &[&id]).await? {
        let event_id: String = row.get(0);
        if event_id != state.first_event_id {
            outcomes.push(answer::duplicate(&state, &event_id, traceparent.clone()));
        }
    }
    insert_outbox(tx, &outcomes, channel).await?;
    Ok(state)
}

/// One finished call for [`FinishStatements::finish`].
#[derive(Debug, Clone)]
pub struct Finish {
    pub id: i64,
    pub epoch: i64,
    pub settled: Settled,
    pub end: Option<AttemptEnd>,
}

// The group's intents, locked in id order, so concurrent groups and lease renewals cannot
// deadlock. A statement of its own: the one after it takes its snapshot once these locks are
// held, so it sees every repeat recorded (by a batch holding a share lock) before them.
const LOCK_MANY: &str = "select id from intents where id = any($1) order by id for update";

// Every outcome of the group in one statement: the intents (fenced by epoch), their attempts
// closed, and the repeats that waited for them marked answered (their event ids returned, to be
// answered from the outbox). The status a claimed row must still have is a parameter ($7,
// always 'running'): with a literal, a generic (prepared) plan may scan every running intent
// through `intents_open` instead of looking the ids up by primary key.
const FINISH_MANY: &str = "
    with f as (
        update intents i
           set status = u.status, result = u.result, error = u.error,
               attempts = i.attempts + u.attempts, status_seq = i.status_seq + 1,
               lease_owner = null, lease_expires_at = null, needs_verify = false,
               next_reason = 'first', updated_at = now(), finished_at = now()
          from unnest($1::int8[], $2::int8[], $3::text[], $4::jsonb[], $5::jsonb[], $6::int4[])
               as u(id, epoch, status, result, error, attempts)
         where i.id = u.id and i.lease_epoch = u.epoch and i.status = $7
        returning i.id, i.idempotency_key, i.run_id, i.step, i.tool, i.action_event_id,
                  i.attempts, i.status_seq, i.finished_at, i.traceparent
    ), e as (
        update attempts a
           set ended_at = now(), classification = u.classification, http_status = u.http_status,
               error = u.error, latency_ms = u.latency_ms,
               -- The send's time (see END_ATTEMPT): a claim made at record may have queued.
               started_at = case when u.latency_ms > 0
                   then greatest(a.started_at, now() - make_interval(secs => u.latency_ms / 1000))
                   else a.started_at end
          from unnest($8::int8[], $9::int4[], $10::text[], $11::int4[], $12::text[], $13::float8[])
               as u(intent_id, seq, classification, http_status, error, latency_ms)
         where a.intent_id = u.intent_id and a.seq = u.seq
           and u.intent_id = any(array(select id from f))
    ), w as (
        update deliveries set answered = true
         where intent_id = any(array(select id from f)) and not answered
        returning intent_id, action_event_id
    )
    select f.*, (select array_agg(w.action_event_id) from w where w.intent_id = f.id) as waiting
      from f";

/// Settles a key a person (or its approval timeout) decided while it was parked with status
/// `parked`. `Ok(false)`: it is parked no longer (another decision came first).
pub async fn finish_parked(
    tx: &Transaction<'_>,
    id: i64,
    parked: IntentStatus,
    settled: &Settled,
    channel: &str,
) -> Result<bool, DbError> {
    match finish(tx, id, Guard::Parked(parked), settled, None, channel).await {
        Ok(_) => Ok(true),
        Err(FinishError::Fenced(_)) => Ok(false),
        Err(FinishError::Db(e)) => Err(e),
    }
}

/// Records many calls' results in the caller's transaction: the same as [`finish`] for each,
/// in three statements for all (the lock and the finish pipelined, then the outbox). An item
/// whose claim was lost is `None` and writes nothing.
async fn finish_many(
    tx: &Transaction<'_>,
    items: &[Finish],
    channel: &str,
) -> Result<Vec<Option<KeyState>>, DbError> {
    let statements = FinishStatements::prepare(tx).await?;
    let (states, outcomes) = statements.finish(tx, items).await?;
    insert_outbox(tx, &outcomes, channel).await?;
    Ok(states)
}

/// The statements of a group's finish, prepared on one connection, so a transaction opened by
/// hand can send its `begin` with the first and its `commit` with the last
/// ([`crate::db::begin_with`], [`crate::db::commit_with`]).
pub(crate) struct FinishStatements {
    lock: tokio_postgres::Statement,
    finish: tokio_postgres::Statement,
    outbox: tokio_postgres::Statement,
}

impl FinishStatements {
    pub(crate) async fn prepare(client: &impl GenericClient) -> Result<Self, DbError> {
        let (lock, finish, outbox) = futures::try_join!(
            client.prepare_cached(LOCK_MANY),
            client.prepare_cached(FINISH_MANY),
            client.prepare_cached(INSERT_OUTBOX_HANDED_SQL)
        )?;
        Ok(FinishStatements {
            lock,
            finish,
            outbox,
        })
    }

    /// Locks the group's intents and finishes those whose claim still holds, in one round
    /// trip: each item's key state (`None` when its claim was lost) and the outcome events to
    /// write ([`Self::insert_outbox`]), the status changes and the answers to waiting repeats.
    pub(crate) async fn finish(
        &self,
        client: &impl GenericClient,
        items: &[Finish],
    ) -> Result<(Vec<Option<KeyState>>, Vec<Outcome>), DbError> {
        let ids: Vec<i64> = items.iter().map(|f| f.id).collect();
        let epochs: Vec<i64> = items.iter().map(|f| f.epoch).collect();
        let statuses: Vec<&str> = items.iter().map(|f| f.settled.status.as_str()).collect();
        let results: Vec<Option<Value>> = items.iter().map(|f| f.settled.result.clone()).collect();
        let errors: Vec<Option<Value>> = items
            .iter()
            .map(|f| {
                f.settled
                    .error
                    .as_ref()
                    .map(|e| serde_json::to_value(e).expect("error serializes"))
            })
            .collect();
        let attempts: Vec<i32> = items.iter().map(|f| f.settled.attempts).collect();
        let ends: Vec<(i64, &AttemptEnd)> = items
            .iter()
            .filter_map(|f| f.end.as_ref().map(|e| (f.id, e)))
            .collect();
        let end_ids: Vec<i64> = ends.iter().map(|(id, _)| *id).collect();
        let seqs: Vec<i32> = ends.iter().map(|(_, e)| e.seq).collect();
        let classes: Vec<&str> = ends.iter().map(|(_, e)| e.classification).collect();
        let http: Vec<Option<i32>> = ends.iter().map(|(_, e)| e.http_status).collect();
        let errs: Vec<Option<&str>> = ends.iter().map(|(_, e)| e.error.as_deref()).collect();
        let latencies: Vec<f64> = ends.iter().map(|(_, e)| e.latency_ms).collect();
        let lock_params = [&ids as _];
        let finish_params: [&(dyn tokio_postgres::types::ToSql + Sync); 13] = [
            &ids,
            &epochs,
            &statuses,
            &results,
            &errors,
            &attempts,
            &IntentStatus::Running.as_str(),
            &end_ids,
            &seqs,
            &classes,
            &http,
            &errs,
            &latencies,
        ];
        // Pipelined: one round trip, executed in order.
        let (_, rows) = futures::try_join!(
            client.query(&self.lock, &lock_params),
            client.query(&self.finish, &finish_params)
        )?;
        let by_id: HashMap<i64, &Finish> = items.iter().map(|f| (f.id, f)).collect();
        let mut finished: HashMap<i64, KeyState> = HashMap::with_capacity(rows.len());
        let mut outcomes = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: i64 = row.get("id");
            let f = by_id[&id];
            let returned = FinishedRow::from_row(row);
            let state = returned.state(&f.settled);
            let traceparent = returned.traceparent;
            outcomes.push(answer::status_change(
                &state,
                returned.status_seq,
                traceparent.clone(),
            ));
            let waiting: Option<Vec<String>> = row.get("waiting");
            for event_id in waiting.unwrap_or_default() {
                if event_id != state.first_event_id {
                    outcomes.push(answer::duplicate(&state, &event_id, traceparent.clone()));
                }
            }
            finished.insert(id, state);
        }
        let states = items.iter().map(|f| finished.remove(&f.id)).collect();
        Ok((states, outcomes))
    }

    /// Writes the group's outcome events to the outbox, for the caller to hand to the
    /// publishers once committed: the id of each row written, by event id. The request goes
    /// out when the future is first polled.
    pub(crate) async fn insert_outbox_handed(
        &self,
        client: &impl GenericClient,
        outcomes: &[Outcome],
    ) -> Result<Vec<(i64, String)>, DbError> {
        insert_outbox_handed(client, &self.outbox, outcomes).await
    }
}
