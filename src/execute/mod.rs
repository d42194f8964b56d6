//! Execute: claim an intent, perform its side effect, record the outcome with its outbox row.
//!
//! Concurrency is bounded globally and per tool, so a slow downstream holds only its own
//! permits; the consumer is never blocked by a call, only by the bounded queue of intents
//! waiting for a permit. A key runs at most once at a time: intents are unique per key and a
//! claim is an atomic `pending → running` transition carrying a fencing epoch.

use std::collections::{HashMap, HashSet};

/// A named step boundary where crash tests kill the relay: with the `failpoints` feature and
/// `FAILPOINTS=name=return`, the process aborts there, as abruptly as `kill -9`.
macro_rules! crash_point {
    ($name:literal) => {
        fail::fail_point!($name, |_| {
            tracing::error!(failpoint = $name, "failpoint: aborting");
            std::process::abort()
        })
    };
}
pub(crate) use crash_point;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use deadpool_postgres::Pool;
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::action::key;
use crate::action::ActionData;
use crate::attempt_log;
use crate::batch::{BatchError, Batcher};
use crate::config::{Config, Executor as ExecutorKind, RetryPolicy, SqlParam, Tool, ToolClass};
use crate::db::{self, DbError, DATA_PATH_STATEMENT_TIMEOUT_MS};
use crate::http::{self, Attempt, Verified};
use crate::metrics::Metrics;
use crate::outcome::answer::KeyState;
use crate::outcome::{Finish, FinishError, Guard, Settled};
use crate::outcome::{OutcomeError, OutcomeStatus};

pub mod claim;

use claim::{AttemptEnd, Claimed};

/// Intents that may wait for a permit at once; past this the consumer waits.
const QUEUE_PER_PERMIT: usize = 4;
/// Claims or outcomes per group-commit transaction, and such transactions in flight at once.
const BATCH: usize = 256;
const BATCH_WORKERS: usize = 2;

/// One request to a group-commit batcher, its failure as the executor's error.
async fn ask<T: Send + 'static, R: Send + 'static>(
    batcher: &Batcher<T, Result<R, BatchError>>,
    request: T,
) -> Result<R, ExecError> {
    let gone = || BatchError {
        transient: false,
        message: "executor shut down".into(),
    };
    batcher
        .call(request)
        .await
        .unwrap_or_else(|| Err(gone()))
        .map_err(ExecError::Batch)
}

/// Records a group of http outcomes in one transaction.
async fn finish_group(
    pool: &Pool,
    items: &[Finish],
    channel: &str,
) -> Result<Vec<Option<KeyState>>, DbError> {
    let mut client = pool.get().await?;
    let tx = client.transaction().await?;
    let states = crate::outcome::finish_many(&tx, items, channel).await?;
    crash_point!("before-outcome-commit");
    tx.commit().await?;
    crash_point!("after-outcome-commit");
    Ok(states)
}

/// Retries work the database cannot do now (down, read-only, out of space) with backoff, for
/// as long as it takes: every write of a claim is fenced by its epoch, so a write that comes
/// back after another relay took the key over is refused, never applied twice. A call's result
/// is never dropped because Postgres was briefly away. Shutdown aborts the wait (the lease then
/// lapses and recovery reads the attempt log).
async fn with_retry<T, F, Fut>(metrics: &Metrics, stage: &'static str, f: F) -> Result<T, ExecError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<T, ExecError>>,
{
    static WAIT: db::WaitLog = db::WaitLog::new();
    let mut backoff = Duration::from_millis(50);
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(ExecError::Db(e)) if e.is_transient() => {
                metrics.postgres_unavailable(stage);
                WAIT.retrying(stage, &e);
            }
            Err(ExecError::Batch(e)) if e.transient => {
                metrics.postgres_unavailable(stage);
                WAIT.retrying(stage, &e.message);
            }
            Err(e) => return Err(e),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// What a call holds while it runs downstream: a place among all calls and among its tool's.
struct CallPermits {
    _global: OwnedSemaphorePermit,
    _tool: Option<OwnedSemaphorePermit>,
}

/// An intent to execute: recorded and still to be claimed, or claimed when it was recorded.
enum Work {
    Pending(i64),
    Claimed(Box<Claimed>),
}

impl Work {
    fn id(&self) -> i64 {
        match self {
            Work::Pending(id) => *id,
            Work::Claimed(c) => c.id,
        }
    }
}

pub struct Executor {
    pool: Pool,
    /// A small pool of its own for lease renewal and recovery, so they always get a connection
    /// however busy the data path is.
    control: Pool,
    /// Places for sql tools' statements, fewer than the data path's connections: their
    /// transactions never take every connection from recording and claiming.
    sql_slots: Arc<Semaphore>,
    config: Arc<Config>,
    tools: HashMap<String, Arc<Tool>>,
    tool_permits: HashMap<String, Arc<Semaphore>>,
    permits: Arc<Semaphore>,
    queue: Arc<Semaphore>,
    /// Calls done downstream whose outcomes are being recorded.
    recording: Arc<Semaphore>,
    http: reqwest::Client,
    metrics: Arc<Metrics>,
    owner: String,
    lease: Duration,
    channel: String,
    /// Intents queued or running here, so recovery does not queue them twice.
    local: Mutex<HashSet<i64>>,
    /// Set at shutdown: queued intents are left pending for the next relay instead of starting.
    stopping: std::sync::atomic::AtomicBool,
    /// Group commit of claims and of http outcomes.
    claims: Batcher<i64, Result<Option<Claimed>, BatchError>>,
    finishes: Batcher<Finish, Result<Option<KeyState>, BatchError>>,
    /// Group commit of the lease re-checks made before a queued claim's first send.
    fences: Batcher<crate::execute::claim::Fence, Result<bool, BatchError>>,
    tasks: Mutex<JoinSet<()>>,
}

impl Executor {
    pub fn new(config: Arc<Config>, pool: Pool, control: Pool, metrics: Arc<Metrics>) -> Arc<Self> {
        let tools: HashMap<String, Arc<Tool>> = config
            .tools
            .iter()
            .map(|t| (t.name.clone(), Arc::new(t.clone())))
            .collect();
        let tool_permits = config
            .tools
            .iter()
            .map(|t| (t.name.clone(), Arc::new(Semaphore::new(t.concurrency))))
            .collect();
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            .pool_max_idle_per_host(config.relay.concurrency)
            .build()
            .expect("http client builds");
        let owner = config.relay.instance_id.clone();
        let lease = config.relay.lease.as_secs_f64();
        let channel = crate::publish::outbox::outbox_channel(&config.postgres.schema);
        let claims = {
            let (pool, owner) = (pool.clone(), owner.clone());
            Batcher::spawn(BATCH, BATCH_WORKERS, move |ids: Vec<i64>| {
                let (pool, owner) = (pool.clone(), owner.clone());
                async move {
                    let claimed = async {
                        let client = pool.get().await?;
                        crate::execute::claim::claim_many(&**client, &ids, &owner, lease).await
                    }
                    .await;
                    match claimed {
                        Ok(mut map) => ids.iter().map(|id| Ok(map.remove(id))).collect(),
                        Err(e) => vec![Err(BatchError::from(&e)); ids.len()],
                    }
                }
            })
        };
        let fences = {
            let pool = pool.clone();
            Batcher::spawn(
                BATCH,
                BATCH_WORKERS,
                move |items: Vec<crate::execute::claim::Fence>| {
                    let pool = pool.clone();
                    async move {
                        let held = async {
                            let client = pool.get().await?;
                            crate::execute::claim::fence_many(&client, &items, lease).await
                        }
                        .await;
                        match held {
                            Ok(held) => items.iter().map(|f| Ok(held.contains(&f.id))).collect(),
                            Err(e) => vec![Err(BatchError::from(&e)); items.len()],
                        }
                    }
                },
            )
        };
        let finishes = {
            let (pool, channel) = (pool.clone(), channel.clone());
            Batcher::spawn(BATCH, BATCH_WORKERS, move |items: Vec<Finish>| {
                let (pool, channel) = (pool.clone(), channel.clone());
                async move {
                    match finish_group(&pool, &items, &channel).await {
                        Ok(states) => states.into_iter().map(Ok).collect(),
                        // One result the database refuses must not fail the others.
                        Err(e) if e.refuses_data() && items.len() > 1 => {
                            let mut answers = Vec::with_capacity(items.len());
                            for item in &items {
                                answers.push(
                                    match finish_group(&pool, std::slice::from_ref(item), &channel)
                                        .await
                                    {
                                        Ok(mut states) => Ok(states.pop().flatten()),
                                        Err(e) => Err(BatchError::from(&e)),
                                    },
                                );
                            }
                            answers
                        }
                        Err(e) => vec![Err(BatchError::from(&e)); items.len()],
                    }
                }
            })
        };
        Arc::new(Executor {
            control,
            sql_slots: Arc::new(Semaphore::new(
                config.postgres.pool_size.saturating_sub(2).max(1),
            )),
            config: config.clone(),
            claims,
            finishes,
            fences,
            pool,
            tools,
            tool_permits,
            permits: Arc::new(Semaphore::new(config.relay.concurrency)),
            queue: Arc::new(Semaphore::new(config.relay.concurrency * QUEUE_PER_PERMIT)),
            recording: Arc::new(Semaphore::new(config.relay.concurrency)),
            http,
            metrics,
            owner,
            lease: config.relay.lease,
            channel,
            local: Mutex::new(HashSet::new()),
            stopping: std::sync::atomic::AtomicBool::new(false),
            tasks: Mutex::new(JoinSet::new()),
        })
    }

    /// Queues an intent for execution, waiting while the queue is full.
    pub async fn dispatch(self: &Arc<Self>, id: i64, tool: &str) {
        if !self.local.lock().expect("not poisoned").insert(id) {
            return;
        }
        self.enqueue(Work::Pending(id), tool.to_string()).await;
    }

    /// Counts intents claimed elsewhere (in the batch that recorded them) as this relay's, so
    /// their leases are renewed while they wait for [`Executor::dispatch_claimed`].
    pub fn hold(&self, ids: impl IntoIterator<Item = i64>) {
        self.local.lock().expect("not poisoned").extend(ids);
    }

    /// Queues an intent already claimed by this relay (and held), waiting while the queue is
    /// full.
    pub async fn dispatch_claimed(self: &Arc<Self>, claimed: Claimed) {
        let tool = claimed.tool.clone();
        self.enqueue(Work::Claimed(Box::new(claimed)), tool).await;
    }

    async fn enqueue(self: &Arc<Self>, work: Work, tool: String) {
        let slot = self
            .queue
            .clone()
            .acquire_owned()
            .await
            .expect("queue semaphore never closes");
        let this = self.clone();
        let id = work.id();
        let mut tasks = self.tasks.lock().expect("not poisoned");
        // Reap finished tasks so the set stays the size of the work in flight.
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move {
            this.run(work, &tool, slot).await;
            this.local.lock().expect("not poisoned").remove(&id);
        });
    }

    async fn run(&self, work: Work, tool: &str, slot: OwnedSemaphorePermit) {
        let tool_permit = match self.tool_permits.get(tool) {
            Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
            None => None,
        };
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("never closed");
        drop(slot);
        let permits = CallPermits {
            _global: permit,
            _tool: tool_permit,
        };
        let id = work.id();
        if self.stopping.load(std::sync::atomic::Ordering::Relaxed) {
            // Left for the next relay: a pending one as it is, a claimed one released, since
            // its call certainly did not start.
            if let Work::Claimed(c) = &work {
                if let Err(e) = self.unclaim(c).await {
                    tracing::warn!(intent = id, error = %e, "cannot release an unstarted claim; recovery will verify it");
                }
            }
            return;
        }
        match self.execute(work, permits).await {
            Ok(()) => {}
            Err(ExecError::Fenced) => {
                tracing::warn!(
                    intent = id,
                    "lease lost to another relay; result not recorded"
                );
            }
            // The claim lapses without renewal and recovery settles the intent.
            Err(e) => {
                tracing::error!(intent = id, error = %e, "giving up on the database; recovery will settle it");
            }
        }
    }

    /// Claim (batched with other claims) unless claimed already, call, record (batched with
    /// other records).
    async fn execute(&self, work: Work, permits: CallPermits) -> Result<(), ExecError> {
        let (claimed, waited) = match work {
            Work::Claimed(c) => (*c, true),
            Work::Pending(id) => {
                match with_retry(&self.metrics, "claim", || ask(&self.claims, id)).await? {
                    Some(c) => (c, false),
                    None => return Ok(()), // somebody else has it, or it is already settled
                }
            }
        };
        let span = tracing::info_span!("action", key = %claimed.key, tool = %claimed.tool, run_id = %claimed.run_id);
        let _enter = span.enter();
        let Some(tool) = self.tools.get(&claimed.tool).cloned() else {
            let settled = Settled {
                status: OutcomeStatus::Rejected,
                result: None,
                error: Some(error(
                    "unknown_tool",
                    format!("tool {} is no longer configured", claimed.tool),
                    false,
                )),
                attempts: 0,
            };
            let end = AttemptEnd::new(
                claimed.seq,
                "failed",
                None,
                Some("tool not configured".into()),
                Duration::ZERO,
            );
            return self.record(&claimed, settled, Some(end)).await;
        };
        self.metrics.inflight.inc();
        match &tool.executor {
            ExecutorKind::Http(_) => {
                let called = self.call_http(&tool, &claimed, waited).await;
                self.metrics.inflight.dec();
                let (settled, end) = called?;
                // The downstream is done with this call: the next one starts while this outcome
                // is recorded. Calls waiting to be recorded are bounded too; a call holds its
                // permits until it has a place among them.
                let _recording = self
                    .recording
                    .clone()
                    .acquire_owned()
                    .await
                    .expect("never closed");
                drop(permits);
                self.record(&claimed, settled, Some(end)).await
            }
            ExecutorKind::Sql(_) => {
                // The statement runs in the outcome transaction: recording is the call.
                let result =
                    with_retry(&self.metrics, "record", || self.record_sql(&claimed, &tool)).await;
                self.metrics.inflight.dec();
                result
            }
        }
    }

    /// Runs the http call with the tool's retry policy, logging every attempt. Retries only
    /// when the effect certainly did not happen, or when the tool is idempotent; an ambiguous
    /// result of a dangerous tool is verified downstream, or parked `unknown`. `waited`: the
    /// claim was made when the intent was recorded and waited in the queue since, so its lease
    /// is re-checked before the first send.
    async fn call_http(
        &self,
        tool: &Tool,
        c: &Claimed,
        waited: bool,
    ) -> Result<(Settled, AttemptEnd), ExecError> {
        let ExecutorKind::Http(exec) = &tool.executor else {
            unreachable!("http tool")
        };
        let data = action_data(c);
        let url = http::fill_url(&exec.url, &c.key, &data);
        let verify_url = tool
            .verify
            .as_ref()
            .map(|v| http::fill_url(&v.url, &c.key, &data));
        let mut seq = c.seq;
        let mut verifying = c.needs_verify;
        let mut calls = 0;
        let mut verifications = 0;
        // Until the last call that may have happened has run out its timeout, the downstream
        // may still be processing it: a "not done" before then concludes nothing.
        let mut deadline = if c.needs_verify {
            c.since_call
                .map(|age| Instant::now() + exec.timeout.saturating_sub(age))
        } else {
            None
        };
        let reason = c.reason.clone();
        let why_next = |calls: i32| {
            if calls == 0 {
                reason.clone()
            } else {
                "transport_retry".to_string()
            }
        };
        loop {
            if verifying {
                let (v, url) = (tool.verify.as_ref(), verify_url.as_deref());
                let (Some(v), Some(url)) = (v, url) else {
                    let end = AttemptEnd::new(
                        seq,
                        "inconclusive",
                        None,
                        Some("no verify configured".into()),
                        Duration::ZERO,
                    );
                    return Ok((
                        self.unknown(tool, "no verify is configured for this tool", calls),
                        end,
                    ));
                };
                crash_point!("before-verify");
                let (verified, status, took) = http::verify(&self.http, v, url, &c.key).await;
                let status = status.map(i32::from);
                let verified = match (verified, deadline) {
                    (Verified::NotDone, Some(d)) if Instant::now() < d => Verified::Premature(d),
                    (v, _) => v,
                };
                match verified {
                    Verified::Done(result) => {
                        self.metrics.verification(&tool.name, "done");
                        self.metrics.side_effect(&tool.name);
                        let end = AttemptEnd::new(seq, "done", status, None, took);
                        return Ok((
                            Settled::new(OutcomeStatus::Succeeded, Some(result), None, calls),
                            end,
                        ));
                    }
                    Verified::NotDone => {
                        self.metrics.verification(&tool.name, "not_done");
                        let end = AttemptEnd::new(seq, "not_done", status, None, took);
                        if c.attempts + calls >= tool.retry.max_attempts as i32 {
                            // The outcome transaction closes this attempt.
                            return Ok((
                                Settled::not_done(
                                    "downstream_unavailable",
                                    format!(
                                        "not done after {} attempts (verified)",
                                        c.attempts + calls
                                    ),
                                    calls,
                                ),
                                end,
                            ));
                        }
                        self.end(c, end).await?;
                        // Certainly not done: safe to call again.
                        seq = self.begin(c, "call", &why_next(calls)).await?;
                        verifying = false;
                        self.metrics.retry(&tool.name, "verified_not_done");
                        continue;
                    }
                    Verified::Premature(until) => {
                        self.metrics.verification(&tool.name, "inconclusive");
                        let detail = "not done so far, but the call may still be in flight until its timeout";
                        self.end(
                            c,
                            AttemptEnd::new(seq, "inconclusive", status, Some(detail.into()), took),
                        )
                        .await?;
                        crash_point!("verify-backoff");
                        tokio::time::sleep_until(until.into()).await;
                        seq = self.begin(c, "verify", &why_next(calls)).await?;
                        continue;
                    }
                    Verified::Inconclusive(detail) => {
                        verifications += 1;
                        self.metrics.verification(&tool.name, "inconclusive");
                        if verifications >= v.max_attempts {
                            let end = AttemptEnd::new(
                                seq,
                                "inconclusive",
                                status,
                                Some(detail.clone()),
                                took,
                            );
                            return Ok((self.unknown(tool, &format!("verification inconclusive after {verifications} tries: {detail}"), calls), end));
                        }
                        self.end(
                            c,
                            AttemptEnd::new(seq, "inconclusive", status, Some(detail), took),
                        )
                        .await?;
                        crash_point!("verify-backoff");
                        tokio::time::sleep(backoff(
                            &RetryPolicy {
                                max_attempts: v.max_attempts,
                                initial_backoff: v.backoff,
                                max_backoff: v.backoff * 16,
                            },
                            verifications,
                            None,
                        ))
                        .await;
                        seq = self.begin(c, "verify", &why_next(calls)).await?;
                        continue;
                    }
                }
            }

            if c.attempts + calls >= tool.retry.max_attempts as i32 {
                // Earlier claims spent the budget (calls that may have happened count, and
                // verification said they did not).
                let message = format!(
                    "not done, and the {} calls allowed were all made",
                    tool.retry.max_attempts
                );
                let end = AttemptEnd::new(
                    seq,
                    "not_sent",
                    None,
                    Some("retry budget spent".into()),
                    Duration::ZERO,
                );
                return Ok((
                    Settled::not_done("downstream_unavailable", message, calls),
                    end,
                ));
            }
            if waited && calls == 0 && seq == c.seq {
                // Claimed when recorded, then queued: the claim must still be ours.
                self.fence(c).await?;
            }
            calls += 1;
            deadline = Some(Instant::now() + exec.timeout);
            let (attempt, took) = http::call(
                &self.http,
                exec,
                &url,
                &c.key,
                &c.args,
                c.traceparent.as_deref(),
            )
            .await;
            self.metrics
                .side_effect_duration(&tool.name, took.as_secs_f64());
            let end = AttemptEnd::new(
                seq,
                attempt.classification(),
                attempt.http_status().map(i32::from),
                attempt.detail(),
                took,
            );
            let spent = c.attempts + calls >= tool.retry.max_attempts as i32;
            let wait = match &attempt {
                Attempt::Succeeded(result) => {
                    self.metrics.side_effect(&tool.name);
                    return Ok((
                        Settled::new(OutcomeStatus::Succeeded, Some(result.clone()), None, calls),
                        end,
                    ));
                }
                Attempt::Failed { status, body } => {
                    let settled = Settled::new(
                        OutcomeStatus::Failed,
                        Some(body.clone()),
                        Some(error(
                            "downstream_rejected",
                            format!("the downstream answered {status}"),
                            false,
                        )),
                        calls,
                    );
                    return Ok((settled, end));
                }
                Attempt::Retry {
                    status,
                    retry_after,
                } => {
                    if spent {
                        let message = format!(
                            "the downstream answered {status} on each of {} attempts",
                            c.attempts + calls
                        );
                        return Ok((
                            Settled::not_done("downstream_unavailable", message, calls),
                            end,
                        ));
                    }
                    backoff(&tool.retry, calls as u32, *retry_after)
                }
                Attempt::NotSent(why) => {
                    if spent {
                        let message = format!("{why} (after {} attempts)", c.attempts + calls);
                        return Ok((
                            Settled::not_done("downstream_unreachable", message, calls),
                            end,
                        ));
                    }
                    backoff(&tool.retry, calls as u32, None)
                }
                Attempt::Ambiguous { reason: why, .. } => {
                    if tool.class == ToolClass::Dangerous {
                        // Never a blind retry of a dangerous write: look downstream first.
                        if tool.verify.is_none() {
                            return Ok((self.unknown(tool, why, calls), end));
                        }
                        self.end(c, end).await?;
                        seq = self.begin(c, "verify", "transport_retry").await?;
                        verifying = true;
                        continue;
                    }
                    if spent {
                        return Ok((self.unknown(tool, why, calls), end));
                    }
                    backoff(&tool.retry, calls as u32, None)
                }
            };
            self.metrics.retry(&tool.name, attempt.retry_reason());
            tracing::info!(
                attempt = calls,
                wait_ms = wait.as_millis() as u64,
                reason = attempt.retry_reason(),
                "retrying"
            );
            self.end(c, end).await?;
            tokio::time::sleep(wait).await;
            seq = self.begin(c, "call", "transport_retry").await?;
        }
    }

    /// Re-checks a queued claim's lease and epoch just before its first send.
    async fn fence(&self, c: &Claimed) -> Result<(), ExecError> {
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

    fn unknown(&self, tool: &Tool, why: &str, calls: i32) -> Settled {
        self.metrics.unknown_outcome(&tool.name);
        Settled::new(
            OutcomeStatus::Unknown,
            None,
            Some(error("outcome_unknown", why.to_string(), false)),
            calls,
        )
    }

    /// Opens the next attempt row; a lost claim ends the call here.
    async fn begin(&self, c: &Claimed, kind: &str, reason: &str) -> Result<i32, ExecError> {
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

    async fn unclaim(&self, c: &Claimed) -> Result<(), DbError> {
        let client = self.pool.get().await?;
        crate::execute::claim::unclaim(&**client, c).await
    }

    async fn end(&self, c: &Claimed, end: AttemptEnd) -> Result<(), ExecError> {
        with_retry(&self.metrics, "end attempt", || async {
            let client = self.pool.get().await.map_err(DbError::from)?;
            crate::execute::claim::end_attempt(&**client, c.id, &end).await?;
            Ok(())
        })
        .await
    }

    /// Records a call's result, grouped with other calls' results into one transaction.
    async fn record(
        &self,
        c: &Claimed,
        settled: Settled,
        end: Option<AttemptEnd>,
    ) -> Result<(), ExecError> {
        let item = Finish {
            id: c.id,
            epoch: c.epoch,
            settled: settled.clone(),
            end,
        };
        let state = with_retry(&self.metrics, "record", || {
            ask(&self.finishes, item.clone())
        })
        .await?
        .ok_or(ExecError::Fenced)?;
        self.metrics.postgres_wrote();
        self.recorded(c, &settled, &state, false);
        Ok(())
    }

    /// The sql executor: the statement runs in the transaction that records its outcome, so
    /// the effect and its record commit together or not at all.
    async fn record_sql(&self, c: &Claimed, tool: &Tool) -> Result<(), ExecError> {
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

    fn recorded(&self, c: &Claimed, settled: &Settled, state: &KeyState, sql: bool) {
        if sql && settled.status == OutcomeStatus::Succeeded {
            self.metrics.side_effect(&state.tool);
        }
        self.metrics.outcome(&state.tool, settled.status.as_str());
        self.metrics.attempts(state.attempts.max(0) as u32);
        if let Some(e) = &settled.error {
            if settled.status == OutcomeStatus::Rejected {
                self.metrics.rejection(&state.tool, &e.code);
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

    /// Extends the leases of every call this relay runs, until cancelled.
    pub async fn keep_leases(self: Arc<Self>, shutdown: CancellationToken) {
        let every = self.lease / 3;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let ids: Vec<i64> = self
                .local
                .lock()
                .expect("not poisoned")
                .iter()
                .copied()
                .collect();
            match self.control.get().await {
                Ok(client) => {
                    if let Err(e) = crate::execute::claim::extend_leases(
                        &**client,
                        &self.owner,
                        &ids,
                        self.lease.as_secs_f64(),
                    )
                    .await
                    {
                        tracing::warn!(error = %e, "cannot extend leases");
                    }
                }
                Err(e) => tracing::warn!(error = %e, "cannot extend leases"),
            }
        }
    }

    /// Finds intents left behind by a crash or an expired lease and finishes them. Safe in every
    /// relay at once: rows are locked with SKIP LOCKED.
    pub async fn recover(self: Arc<Self>, interval: Duration, shutdown: CancellationToken) {
        loop {
            match self.recover_once().await {
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

    pub async fn recover_once(self: &Arc<Self>) -> Result<usize, DbError> {
        let expired = crate::inspect::expire_approvals(&self.control, &self.config).await?;
        if expired > 0 {
            tracing::info!(expired, "approvals timed out");
        }
        let mut client = self.control.get().await?;
        if let Ok(counts) = crate::recovery::parked_counts(&**client).await {
            for status in ["unknown", "pending_approval"] {
                let n = counts
                    .iter()
                    .find(|(s, _)| s == status)
                    .map_or(0, |(_, n)| *n);
                self.metrics.parked(status, n);
            }
        }
        let tx = client.transaction().await?;
        // This relay's own queue is skipped in SQL, so a long local backlog cannot hide a
        // lapsed claim from the sweep.
        let local: Vec<i64> = self
            .local
            .lock()
            .expect("not poisoned")
            .iter()
            .copied()
            .collect();
        let orphans = crate::recovery::orphans(&tx, 2.0, 500, &local).await?;
        let lapsed: Vec<i64> = orphans
            .iter()
            .filter(|o| o.was_running)
            .map(|o| o.id)
            .collect();
        if !lapsed.is_empty() {
            crate::recovery::abandon_attempts(&tx, &lapsed).await?;
        }
        let ids: Vec<i64> = orphans.iter().map(|o| o.id).collect();
        let mut histories = crate::recovery::histories(&tx, &ids).await?;
        let mut redispatch = Vec::new();
        for o in &orphans {
            if self.local.lock().expect("not poisoned").contains(&o.id) {
                continue;
            }
            let tool = self.tools.get(&o.tool);
            let dangerous_http = o.class == ToolClass::Dangerous.as_str()
                && tool.is_none_or(|t| matches!(t.executor, ExecutorKind::Http(_)));
            let can_verify = tool.is_some_and(|t| t.verify.is_some());
            let history = histories.remove(&o.id).unwrap_or_default();
            // The one rule: what the next claim does follows from the durable history alone.
            let verdict = attempt_log::next_step(&history, dangerous_http);
            if matches!(verdict.next, attempt_log::Next::Verify { .. }) && !can_verify {
                // A call may have happened, and nothing can tell. Parked for a person.
                let epoch =
                    crate::recovery::take_over(&tx, o.id, &self.owner, verdict.calls).await?;
                let settled = Settled::new(
                    OutcomeStatus::Unknown,
                    None,
                    Some(error(
                        "outcome_unknown",
                        "the relay running this call stopped before recording its result".into(),
                        false,
                    )),
                    0,
                );
                match crate::outcome::finish(
                    &tx,
                    o.id,
                    Guard::Claim(epoch),
                    &settled,
                    None,
                    &self.channel,
                )
                .await
                {
                    Ok(_) => {
                        self.metrics.unknown_outcome(&o.tool);
                        self.metrics.outcome(&o.tool, "unknown");
                    }
                    Err(FinishError::Fenced(_)) => {}
                    Err(FinishError::Db(e)) => return Err(e),
                }
            } else {
                crate::recovery::requeue(&tx, o.id, &verdict).await?;
                redispatch.push((o.id, o.tool.clone()));
            }
        }
        tx.commit().await?;
        for (id, tool) in &redispatch {
            self.dispatch(*id, tool).await;
        }
        Ok(orphans.len())
    }

    /// From now on queued intents are left for the next relay instead of started.
    pub fn stop_starting(&self) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits for queued and running calls, up to `grace`; what is left is aborted and its
    /// lease left to expire, so recovery (here or in another relay) settles it.
    pub async fn drain(&self, grace: Duration) {
        self.stop_starting();
        let mut tasks = std::mem::take(&mut *self.tasks.lock().expect("not poisoned"));
        let deadline = tokio::time::Instant::now() + grace;
        loop {
            match tokio::time::timeout_at(deadline, tasks.join_next()).await {
                Ok(Some(_)) => continue,
                Ok(None) => return,
                Err(_) => {
                    tracing::warn!(
                        left = tasks.len(),
                        "shutdown grace over; leaving calls to recovery"
                    );
                    tasks.abort_all();
                    // Their leases must lapse now, not be renewed while shutdown finishes.
                    self.local.lock().expect("not poisoned").clear();
                    return;
                }
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ExecError {
    #[error("fenced")]
    Fenced,
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Batch(BatchError),
}

impl From<tokio_postgres::Error> for ExecError {
    fn from(e: tokio_postgres::Error) -> Self {
        ExecError::Db(DbError::Postgres(e))
    }
}

impl Settled {
    /// The effect certainly did not happen and the retry budget is spent: failed, retryable.
    fn not_done(code: &str, message: String, calls: i32) -> Self {
        Settled::new(
            OutcomeStatus::Failed,
            None,
            Some(error(code, message, true)),
            calls,
        )
    }

    fn new(
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
    fn new(
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
}

pub(crate) fn error(code: &str, message: String, retryable: bool) -> OutcomeError {
    OutcomeError {
        code: code.into(),
        message,
        retryable,
        fields: None,
    }
}

fn action_data(c: &Claimed) -> ActionData {
    ActionData {
        run_id: c.run_id.clone(),
        tool: c.tool.clone(),
        args: c.args.clone(),
        step: c.step,
        business_id: c.business_id.clone(),
        idempotency_key: Some(c.key.clone()),
    }
}

/// Exponential backoff with full jitter; a `Retry-After` is honoured up to the cap.
pub fn backoff(policy: &RetryPolicy, attempt: u32, retry_after: Option<Duration>) -> Duration {
    if let Some(after) = retry_after {
        return after.min(policy.max_backoff);
    }
    let exp = policy
        .initial_backoff
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(20))
        .min(policy.max_backoff);
    let ms = exp.as_millis() as u64;
    Duration::from_millis(rand::rng().random_range(0..=ms))
}

/// Runs a sql tool's statement inside the outcome transaction, under a savepoint so a failing
/// statement becomes a `failed` outcome instead of aborting the record.
async fn run_sql(
    tx: &tokio_postgres::Transaction<'_>,
    tool: &Tool,
    c: &Claimed,
) -> Result<Settled, ExecError> {
    let ExecutorKind::Sql(exec) = &tool.executor else {
        unreachable!("sql tool")
    };
    let data = action_data(c);
    let values: Vec<Value> = exec
        .params
        .iter()
        .map(|p| match p {
            SqlParam::Key => Value::String(c.key.clone()),
            SqlParam::Field(f) => key::field(&data, f).to_json(),
        })
        .collect();
    // Parameters travel as text and are cast by the statement (`$2::numeric`), so any column
    // type works without idem knowing it.
    let texts: Vec<Option<String>> = values
        .iter()
        .map(|v| match v {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            other => Some(other.to_string()),
        })
        .collect();
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = texts
        .iter()
        .map(|t| t as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    // The tool's own statement plans with the server's settings, not the data path's, and is
    // bounded by the tool's timeout (a whole number of milliseconds, not user text).
    tx.batch_execute(&format!(
        "savepoint idem_tool; set local enable_seqscan = on; set local plan_cache_mode = auto; \
         set local statement_timeout = {}",
        exec.timeout.as_millis().max(1)
    ))
    .await?;
    let started = Instant::now();
    let typed = tx
        .prepare_typed(
            &exec.statement,
            &vec![tokio_postgres::types::Type::TEXT; texts.len()],
        )
        .await;
    let outcome = match typed {
        Ok(stmt) => tx.query(&stmt, &params).await,
        Err(e) => Err(e),
    };
    let settled = match outcome {
        Ok(rows) => {
            tx.batch_execute(&format!(
                "release savepoint idem_tool; set local statement_timeout = {DATA_PATH_STATEMENT_TIMEOUT_MS}"
            ))
            .await?;
            let result = rows.first().map(row_json).unwrap_or(Value::Null);
            Settled::new(OutcomeStatus::Succeeded, Some(result), None, 1)
        }
        Err(e) => {
            tx.batch_execute(&format!(
                "rollback to savepoint idem_tool; set local statement_timeout = {DATA_PATH_STATEMENT_TIMEOUT_MS}"
            ))
            .await?;
            let state = db::sqlstate(&e).unwrap_or_default();
            Settled::new(
                OutcomeStatus::Failed,
                None,
                Some(error(
                    "downstream_rejected",
                    format!(
                        "the statement failed with SQLSTATE {state}: {}",
                        e.as_db_error()
                            .map_or_else(|| e.to_string(), |d| d.message().to_string())
                    ),
                    false,
                )),
                1,
            )
        }
    };
    tracing::debug!(
        took_ms = started.elapsed().as_millis() as u64,
        "sql executed"
    );
    Ok(settled)
}

/// A result row as a JSON object; each column read as text (`::text` in the statement for
/// exotic types), JSON columns kept as JSON.
fn row_json(row: &tokio_postgres::Row) -> Value {
    use tokio_postgres::types::Type;
    let mut m = serde_json::Map::new();
    fn get<'a, T>(row: &'a tokio_postgres::Row, i: usize) -> Value
    where
        T: tokio_postgres::types::FromSql<'a> + serde::Serialize,
    {
        row.try_get::<_, Option<T>>(i)
            .ok()
            .flatten()
            .map_or(Value::Null, |v| json!(v))
    }
    for (i, col) in row.columns().iter().enumerate() {
        let v = match *col.type_() {
            Type::JSON | Type::JSONB => get::<Value>(row, i),
            Type::INT2 => get::<i16>(row, i),
            Type::INT4 => get::<i32>(row, i),
            Type::INT8 => get::<i64>(row, i),
            Type::BOOL => get::<bool>(row, i),
            Type::FLOAT8 => get::<f64>(row, i),
            _ => get::<String>(row, i),
        };
        m.insert(col.name().to_string(), v);
    }
    Value::Object(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_honours_retry_after() {
        let p = RetryPolicy {
            max_attempts: 5,
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(1),
        };
        for attempt in 1..30 {
            assert!(backoff(&p, attempt, None) <= Duration::from_secs(1));
        }
        assert!(backoff(&p, 1, None) <= Duration::from_millis(100));
        assert_eq!(
            backoff(&p, 1, Some(Duration::from_millis(700))),
            Duration::from_millis(700)
        );
        assert_eq!(
            backoff(&p, 1, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }
}
