//! Execute: claim an intent, perform its side effect, record the outcome with its outbox row.
//!
//! Concurrency is bounded globally and per tool, so a slow downstream holds only its own
//! permits; the consumer is never blocked by a call, only by the bounded queue of intents
//! waiting for a permit. A key runs at most once at a time: intents are unique per key and a
//! claim is an atomic `pending → running` transition carrying a fencing epoch.

use std::collections::{HashMap, HashSet};

use std::sync::{Arc, Mutex};
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::action::ActionData;
use crate::config::{Config, ExecutorKind, Tool};
use crate::db::{self, DbError};
use crate::failpoint::crash_point;
use crate::group_commit::{Cohorts, Expected, GroupCommit, GroupError};
use crate::metrics::Metrics;
use crate::outcome::answer::KeyState;
use crate::outcome::finish::FinishStatements;
use crate::outcome::{ErrorCode, OutcomeStatus};
use crate::outcome::{Finish, Settled};
use crate::publish::handoff::Handoff;
use crate::publish::outbox::written_rows;
use crate::retry::Backoff;

pub mod attempt_log;
mod attempts;
mod call;
pub(crate) mod claim;
pub(crate) mod http;
pub(crate) use http::url_args_usable;
mod lease;
mod sql_tool;

use claim::{AttemptEnd, Claimed};

/// Intents that may wait for a permit at once; past this the consumer waits.
const QUEUE_PER_PERMIT: usize = 4;
/// Claims or outcomes per group-commit transaction, and such transactions in flight at once.
const GROUP_MAX: usize = 256;
const GROUP_WORKERS: usize = 2;
/// Finish groups in flight at once: one. Calls that end while a group commits wait for the next
/// group, so groups are larger and commits fewer: at 1,000 actions/s, 1.04-1.08 commits per
/// action against 1.39 with two in flight, Postgres CPU down a tenth, flat out 7,200 actions/s
/// against 6,500-6,800 (`benches/HISTORY.md`).
const FINISH_WORKERS: usize = 1;
/// How long a finish group that has begun to form waits for the calls still under way
/// downstream that started with its results' calls (the same tool's, one after another), so the
/// calls of one batch, which end within a fraction of a millisecond of each other, commit in
/// one group rather than the first to end alone and the rest after it. Other calls (another
/// tool's, or a slow tool's started by earlier batches, always under way) do not hold it.
const FINISH_LINGER: Duration = Duration::from_millis(1);

/// One request to a group commit, its failure as the executor's error.
async fn ask<T: Send + 'static, R: Send + 'static>(
    group: &GroupCommit<T, Result<R, GroupError>>,
    request: T,
) -> Result<R, ExecError> {
    ask_expected(group, request, None).await
}

/// As [`ask`], the request's announcement ([`GroupCommit::expect`]) ending once the group has it.
async fn ask_expected<T: Send + 'static, R: Send + 'static>(
    group: &GroupCommit<T, Result<R, GroupError>>,
    request: T,
    expected: Option<Expected>,
) -> Result<R, ExecError> {
    let gone = || GroupError {
        transient: false,
        message: "executor shut down".into(),
    };
    group
        .call_expected(request, expected)
        .await
        .unwrap_or_else(|| Err(gone()))
        .map_err(ExecError::Group)
}

/// Records a group of http outcomes in one transaction of two round trips: its `begin` with
/// the lock and the finish, its `commit` with the outbox rows, which are then handed to the
/// publishers (no NOTIFY, no read of them back).
async fn finish_group(
    pool: &Pool,
    items: &[Finish],
    handoff: &Handoff,
) -> Result<Vec<Option<KeyState>>, DbError> {
    let open = db::OpenTransaction::new(pool.get().await?);
    let client = open.client();
    let finished = async {
        let statements = FinishStatements::prepare(client).await?;
        let (states, outcomes) = db::begin_with(client, statements.finish(client, items)).await?;
        crash_point!("before-outcome-commit");
        let written =
            db::commit_with(client, statements.insert_outbox_handed(client, &outcomes)).await?;
        Ok::<_, DbError>((states, written_rows(outcomes, written)))
    };
    let finished = finished.await;
    let (states, rows) = open.close(finished).await?;
    crash_point!("after-outcome-commit");
    handoff.hand(rows);
    Ok(states)
}

/// [`finish_group`] for a group's results, each answered: one result the database refuses
/// is finished alone, so it does not fail the others.
async fn finish_each(
    pool: &Pool,
    items: &[Finish],
    handoff: &Handoff,
) -> Vec<Result<Option<KeyState>, GroupError>> {
    match finish_group(pool, items, handoff).await {
        Ok(states) => states.into_iter().map(Ok).collect(),
        Err(e) if e.refuses_data() && items.len() > 1 => {
            let mut answers = Vec::with_capacity(items.len());
            for item in items {
                answers.push(
                    match finish_group(pool, std::slice::from_ref(item), handoff).await {
                        Ok(mut states) => Ok(states.pop().flatten()),
                        Err(e) => Err(GroupError::from(&e)),
                    },
                );
            }
            answers
        }
        Err(e) => vec![Err(GroupError::from(&e)); items.len()],
    }
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
    let mut backoff = Backoff::waiting(Duration::from_millis(50));
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(ExecError::Db(e)) if e.is_transient() => {
                metrics.postgres_unavailable(stage);
                WAIT.retrying(stage, &e);
            }
            Err(ExecError::Group(e)) if e.transient => {
                metrics.postgres_unavailable(stage);
                WAIT.retrying(stage, &e.message);
            }
            Err(e) => return Err(e),
        }
        tokio::time::sleep(backoff.after_failure()).await;
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

pub(crate) struct Executor {
    /// The data path's connections: claims, attempts and outcomes.
    pool: Pool,
    /// A small pool of its own for lease renewal and recovery, so they always get a connection
    /// however busy the data path is.
    pub(crate) control: Pool,
    /// Places for sql tools' statements, fewer than the data path's connections: their
    /// transactions never take every connection from recording and claiming.
    sql_slots: Arc<Semaphore>,
    pub(crate) config: Arc<Config>,
    /// Tools by name, shared with the tasks that call them.
    pub(crate) tools: HashMap<String, Arc<Tool>>,
    /// Each tool's `concurrency`: a slow downstream holds only its own places.
    tool_permits: HashMap<String, Arc<Semaphore>>,
    /// Each tool's calls under way, in cohorts of those started together (each within the
    /// finish linger of the one before): a finish group waits only for the cohorts of the
    /// results it holds, so neither another tool's calls nor a slow tool's started by earlier
    /// batches hold it.
    finish_cohorts: Cohorts,
    /// The relay's `concurrency`: calls in flight at once, over all tools.
    permits: Arc<Semaphore>,
    /// Bounds intents waiting for a permit; the consumer waits on it, never on a call.
    queue: Arc<Semaphore>,
    /// Calls done downstream whose outcomes are being recorded.
    recording: Arc<Semaphore>,
    /// The http clients: one shared, so connections are reused, and one per tool with its own
    /// `executor.tls`.
    http: http::Clients,
    pub(crate) metrics: Arc<Metrics>,
    /// This relay's name as a lease owner (its instance id).
    pub(crate) owner: String,
    /// How long a claim holds without renewal; renewed every third of it.
    lease: Duration,
    /// The outbox's LISTEN/NOTIFY channel, notified with each outcome.
    pub(crate) channel: String,
    /// Intents queued or running here, so recovery does not queue them twice.
    local: Mutex<HashSet<i64>>,
    /// Set at shutdown: queued intents are left pending for the next relay instead of starting.
    stopping: std::sync::atomic::AtomicBool,
    /// Group commit of claims.
    claims: GroupCommit<i64, Result<Option<Claimed>, GroupError>>,
    /// Group commit of http outcomes.
    finishes: GroupCommit<Finish, Result<Option<KeyState>, GroupError>>,
    /// Group commit of the lease re-checks made before a queued claim's first send.
    fences: GroupCommit<crate::execute::claim::Fence, Result<bool, GroupError>>,
    /// Every queued or running call, so shutdown can wait for them (up to its grace) and abort
    /// the rest.
    tasks: Mutex<JoinSet<()>>,
}

impl Executor {
    pub fn new(
        config: Arc<Config>,
        pool: Pool,
        control: Pool,
        metrics: Arc<Metrics>,
        handoff: Arc<Handoff>,
    ) -> Arc<Self> {
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
        let finish_cohorts =
            Cohorts::new(config.tools.iter().map(|t| t.name.as_str()), FINISH_LINGER);
        let http = http::Clients::new(&config);
        let owner = config.relay.instance_id.clone();
        let lease = config.relay.lease.as_secs_f64();
        let channel = crate::publish::outbox::outbox_channel(&config.postgres.schema);
        let claims = {
            let (pool, owner) = (pool.clone(), owner.clone());
            GroupCommit::spawn(GROUP_MAX, GROUP_WORKERS, move |ids: Vec<i64>| {
                let (pool, owner) = (pool.clone(), owner.clone());
                async move {
                    let claimed = async {
                        let client = pool.get().await?;
                        crate::execute::claim::claim_many(&**client, &ids, &owner, lease).await
                    }
                    .await;
                    match claimed {
                        Ok(mut map) => ids.iter().map(|id| Ok(map.remove(id))).collect(),
                        Err(e) => vec![Err(GroupError::from(&e)); ids.len()],
                    }
                }
            })
        };
        let fences = {
            let pool = pool.clone();
            GroupCommit::spawn(
                GROUP_MAX,
                GROUP_WORKERS,
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
                            Err(e) => vec![Err(GroupError::from(&e)); items.len()],
                        }
                    }
                },
            )
        };
        let finishes = {
            let pool = pool.clone();
            GroupCommit::spawn_lingering(
                GROUP_MAX,
                FINISH_WORKERS,
                FINISH_LINGER,
                move |items: Vec<Finish>| {
                    let (pool, handoff) = (pool.clone(), handoff.clone());
                    async move { finish_each(&pool, &items, &handoff).await }
                },
            )
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
            finish_cohorts,
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

    /// Claim (group-committed with other claims) unless claimed already, call, record (group-committed with
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
        // Instrumented, not entered: a span entered across an await is left on the thread while
        // the task sleeps, and other actions' log lines would carry it.
        self.execute_claimed(claimed, waited, permits)
            .instrument(span)
            .await
    }

    /// Calls and records a claimed intent, inside its action's span.
    async fn execute_claimed(
        &self,
        claimed: Claimed,
        waited: bool,
        permits: CallPermits,
    ) -> Result<(), ExecError> {
        let Some(tool) = self.tools.get(&claimed.tool).cloned() else {
            let settled = Settled {
                status: OutcomeStatus::Rejected,
                result: None,
                error: Some(
                    ErrorCode::UnknownTool
                        .error(format!("tool {} is no longer configured", claimed.tool)),
                ),
                attempts: 0,
            };
            let end = AttemptEnd::unsent(claimed.seq, "failed", "tool not configured");
            return self.record(&claimed, settled, Some(end), None).await;
        };
        self.metrics.inflight.inc();
        match &tool.executor {
            ExecutorKind::Http(_) => {
                let mut announced = self.announce(&claimed.tool);
                let called = self
                    .call_http(&tool, &claimed, waited, &mut announced)
                    .await;
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
                self.record(&claimed, settled, Some(end), announced).await
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

    /// Announces to the finish groups the result of a call of `tool` starting now, in the
    /// cohort of the calls starting with it.
    pub(super) fn announce(&self, tool: &str) -> Option<Expected> {
        self.finish_cohorts
            .of(tool, std::time::Instant::now())
            .map(|c| self.finishes.expect(&c))
    }

    /// The intents queued or running here, now.
    pub(crate) fn local_ids(&self) -> Vec<i64> {
        self.local
            .lock()
            .expect("not poisoned")
            .iter()
            .copied()
            .collect()
    }

    /// Whether this intent is queued or running here.
    pub(crate) fn is_local(&self, id: i64) -> bool {
        self.local.lock().expect("not poisoned").contains(&id)
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
    Group(GroupError),
}

crate::db::from_postgres!(ExecError);

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
