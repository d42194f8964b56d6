//! Group commit: many callers' requests, one transaction. Each caller awaits its own answer;
//! a few workers keep several groups in flight so commits overlap.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Mutex, Notify};

/// A request's failure, shared by every request of the group it was committed in.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct GroupError {
    /// Retrying may succeed (the database was unreachable, a deadlock).
    pub transient: bool,
    pub message: String,
}

impl From<&crate::db::DbError> for GroupError {
    fn from(e: &crate::db::DbError) -> Self {
        GroupError {
            transient: e.is_transient(),
            message: e.to_string(),
        }
    }
}

/// A request as sent: its answer's channel, its announcement (ended once a worker has it, so
/// what is still announced has not reached one), and when it was sent.
struct Item<T, R> {
    request: T,
    reply: oneshot::Sender<R>,
    expected: Option<Expected>,
    sent: tokio::time::Instant,
}

pub struct GroupCommit<T, R> {
    tx: mpsc::Sender<Item<T, R>>,
    /// Notified as an announcement ends.
    changed: Arc<Notify>,
}

/// Requests of one kind (a tool's calls, which tend to end together), as announced by
/// [`GroupCommit::expect`]: a group waits only for the announced requests of the cohorts of
/// the requests it holds, so a slow tool's calls under way do not hold a fast one's results.
#[derive(Clone, Default)]
pub struct Cohort(Arc<AtomicUsize>);

impl Cohort {
    /// Announced requests of this cohort not yet received by a worker.
    fn announced(&self) -> usize {
        self.0.load(Ordering::Acquire)
    }

    /// The same cohort (not merely one of the same kind).
    pub fn same(&self, other: &Cohort) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// The cohorts of several kinds of request (tools): a kind's new request joins its current
/// cohort when it starts within `window` of the one before it, and begins a new cohort
/// otherwise. The calls one batch starts (one after another, within microseconds, or a little
/// more on a busy host) are one cohort, and a slow tool's calls started by earlier batches are
/// others, so a group holding one slow result waits for the slow calls of its batch alone.
pub struct Cohorts {
    window: Duration,
    /// Each kind's current cohort, and when its last request started (none yet: `None`).
    current:
        std::collections::HashMap<String, std::sync::Mutex<(Cohort, Option<std::time::Instant>)>>,
}

impl Cohorts {
    pub fn new<'a>(kinds: impl IntoIterator<Item = &'a str>, window: Duration) -> Self {
        let current = kinds
            .into_iter()
            .map(|k| (k.to_string(), std::sync::Mutex::default()))
            .collect();
        Cohorts { window, current }
    }

    /// The cohort of a request of `kind` starting at `now` (`None`: a kind not known).
    pub fn of(&self, kind: &str, now: std::time::Instant) -> Option<Cohort> {
        let mut current = self.current.get(kind)?.lock().expect("not poisoned");
        let (cohort, last) = &mut *current;
        if last.is_some_and(|last| now.saturating_duration_since(last) > self.window) {
            *cohort = Cohort::default();
        }
        *last = Some(now);
        Some(cohort.clone())
    }
}

/// A request on its way: while any of its cohort is, a group holding one of that cohort waits
/// for it, up to the group's linger. Dropped when a worker receives its request, or when it
/// is given up.
pub struct Expected {
    cohort: Cohort,
    changed: Arc<Notify>,
}

impl Drop for Expected {
    fn drop(&mut self) {
        self.cohort.0.fetch_sub(1, Ordering::AcqRel);
        self.changed.notify_one();
    }
}

impl<T: Send + 'static, R: Send + 'static> GroupCommit<T, R> {
    /// Starts `workers` tasks, each taking up to `max` waiting requests at a time and handing
    /// them to `run`, which answers each in order. A group forms from whatever is waiting: no
    /// request waits for others to arrive.
    pub fn spawn<F, Fut>(max: usize, workers: usize, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send,
    {
        Self::spawn_lingering(max, workers, Duration::ZERO, run)
    }

    /// As [`GroupCommit::spawn`], but a group that has begun to form waits, up to `linger`
    /// after its first request was sent, for the requests announced by [`GroupCommit::expect`]
    /// in its requests' cohorts and not received yet, so calls that end together commit
    /// together.
    pub fn spawn_lingering<F, Fut>(max: usize, workers: usize, linger: Duration, run: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Vec<R>> + Send,
    {
        let (tx, rx) = mpsc::channel::<Item<T, R>>(max * workers * 2);
        let rx = Arc::new(Mutex::new(rx));
        let run = Arc::new(run);
        let changed = Arc::new(Notify::new());
        for _ in 0..workers {
            let (rx, run, changed) = (rx.clone(), run.clone(), changed.clone());
            tokio::spawn(async move {
                loop {
                    let items = {
                        let mut rx = rx.lock().await;
                        match gather(&mut rx, max, linger, &changed).await {
                            Some(items) => items,
                            None => return,
                        }
                    };
                    let (requests, replies): (Vec<T>, Vec<oneshot::Sender<R>>) =
                        items.into_iter().map(|i| (i.request, i.reply)).unzip();
                    let answers = run(requests).await;
                    debug_assert_eq!(answers.len(), replies.len(), "one answer per request");
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(answer);
                    }
                }
            });
        }
        GroupCommit { tx, changed }
    }

    /// Announces a request of `cohort` that will come (a call under way whose result will be
    /// sent): a group holding a request of that cohort waits for it, up to its linger.
    pub fn expect(&self, cohort: &Cohort) -> Expected {
        cohort.0.fetch_add(1, Ordering::AcqRel);
        Expected {
            cohort: cohort.clone(),
            changed: self.changed.clone(),
        }
    }

    /// Sends one request and waits for its answer; `None` once the workers are gone. Its
    /// announcement, if it had one, ends once a worker has it.
    pub async fn call_expected(&self, request: T, expected: Option<Expected>) -> Option<R> {
        let (reply, answer) = oneshot::channel();
        let item = Item {
            request,
            reply,
            expected,
            sent: tokio::time::Instant::now(),
        };
        self.tx.send(item).await.ok()?;
        answer.await.ok()
    }
}

/// The next group: the first request waiting (`None` once every sender is gone) and what else
/// is waiting, then, with a linger, the announced requests of its cohorts as they come, until
/// none is announced, the group is full, or the linger from the first one's send is over. A
/// request's announcement ends as it is received: what is still announced is on its way or
/// given up.
async fn gather<T, R>(
    rx: &mut mpsc::Receiver<Item<T, R>>,
    max: usize,
    linger: Duration,
    changed: &Notify,
) -> Option<Vec<Item<T, R>>> {
    // The cohorts of the requests in the group, each once.
    let mut cohorts: Vec<Cohort> = Vec::new();
    let received = |mut item: Item<T, R>, cohorts: &mut Vec<Cohort>| {
        if let Some(expected) = item.expected.take() {
            if !cohorts.iter().any(|c| c.same(&expected.cohort)) {
                cohorts.push(expected.cohort.clone());
            }
        }
        item
    };
    let first = received(rx.recv().await?, &mut cohorts);
    // From the first request's send: one that queued while the group before committed has
    // waited already.
    let deadline = first.sent + linger;
    let mut items = Vec::with_capacity(max);
    items.push(first);
    loop {
        while items.len() < max {
            match rx.try_recv() {
                Ok(item) => items.push(received(item, &mut cohorts)),
                Err(_) => break,
            }
        }
        if items.len() >= max || linger.is_zero() || cohorts.iter().all(|c| c.announced() == 0) {
            return Some(items);
        }
        tokio::select! {
            item = rx.recv() => match item {
                Some(item) => items.push(received(item, &mut cohorts)),
                None => return Some(items),
            },
            _ = changed.notified() => {}
            _ = tokio::time::sleep_until(deadline) => return Some(items),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_caller_gets_its_own_answer_and_groups_form() {
        let sizes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = sizes.clone();
        let b = Arc::new(GroupCommit::spawn(10, 1, move |xs: Vec<u32>| {
            seen.lock().unwrap().push(xs.len());
            async move {
                tokio::task::yield_now().await;
                xs.into_iter().map(|x| x * 2).collect()
            }
        }));
        let calls = (0..100).map(|i| {
            let b = b.clone();
            async move { (i, b.call_expected(i, None).await.unwrap()) }
        });
        for (i, doubled) in futures::future::join_all(calls).await {
            assert_eq!(doubled, i * 2);
        }
        let sizes = sizes.lock().unwrap();
        assert_eq!(sizes.iter().sum::<usize>(), 100);
        assert!(sizes.iter().all(|n| *n <= 10));
        assert!(sizes.len() < 100, "requests were grouped: {sizes:?}");
    }

    /// The size of each group committed, in order.
    type Sizes = Arc<std::sync::Mutex<Vec<usize>>>;

    /// A group commit that answers each request with itself and records its groups' sizes.
    fn sizes_of(linger: Duration) -> (Arc<GroupCommit<u32, u32>>, Sizes) {
        let sizes = Sizes::default();
        let seen = sizes.clone();
        let b = GroupCommit::spawn_lingering(10, 1, linger, move |xs: Vec<u32>| {
            seen.lock().unwrap().push(xs.len());
            async move { xs }
        });
        (Arc::new(b), sizes)
    }

    const DEADLINE: Duration = Duration::from_secs(10);

    #[tokio::test]
    async fn a_group_waits_for_the_requests_announced() {
        // A linger far longer than the test's deadline: only the last announced request's
        // arrival can let the group go.
        let (b, sizes) = sizes_of(Duration::from_secs(600));
        let cohort = Cohort::default();
        let announced: Vec<Expected> = (0..3).map(|_| b.expect(&cohort)).collect();
        let calls = announced.into_iter().enumerate().map(|(i, expected)| {
            let b = b.clone();
            async move {
                // Each request is sent a little after the one before it.
                tokio::time::sleep(Duration::from_millis(20 * i as u64)).await;
                b.call_expected(i as u32, Some(expected)).await
            }
        });
        let answers = tokio::time::timeout(DEADLINE, futures::future::join_all(calls))
            .await
            .expect("answered");
        assert_eq!(answers, vec![Some(0), Some(1), Some(2)]);
        assert_eq!(*sizes.lock().unwrap(), vec![3], "one group of the three");
    }

    #[tokio::test]
    async fn a_request_given_up_or_none_announced_does_not_hold_a_group() {
        let (b, sizes) = sizes_of(Duration::from_secs(600));
        // Nothing announced: a lone request goes at once.
        let alone = tokio::time::timeout(DEADLINE, b.call_expected(1, None)).await;
        assert_eq!(alone.expect("not held"), Some(1));
        // Two announced, one given up (its call failed before it had a result to send).
        let cohort = Cohort::default();
        let (sent, given_up) = (b.expect(&cohort), b.expect(&cohort));
        let waiting = {
            let b = b.clone();
            tokio::spawn(async move { b.call_expected(2, Some(sent)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "the group waits for the one announced"
        );
        drop(given_up);
        let answer = tokio::time::timeout(DEADLINE, waiting).await;
        assert_eq!(answer.expect("released").unwrap(), Some(2));
        assert_eq!(*sizes.lock().unwrap(), vec![1, 1]);
    }

    #[tokio::test]
    async fn a_group_waits_no_longer_than_its_linger() {
        let (b, sizes) = sizes_of(Duration::from_millis(50));
        let cohort = Cohort::default();
        let _never_sent = b.expect(&cohort);
        let started = tokio::time::Instant::now();
        let answer =
            tokio::time::timeout(DEADLINE, b.call_expected(7, Some(b.expect(&cohort)))).await;
        assert_eq!(answer.expect("the linger ended the wait"), Some(7));
        assert!(
            started.elapsed() >= Duration::from_millis(50),
            "the group waited for the one announced"
        );
        assert_eq!(*sizes.lock().unwrap(), vec![1]);
    }

    #[tokio::test]
    async fn another_cohorts_requests_under_way_do_not_hold_a_group() {
        let (b, sizes) = sizes_of(Duration::from_secs(600));
        let (slow, fast) = (Cohort::default(), Cohort::default());
        // A slow tool's call under way, and a fast tool's two calls.
        let _under_way = b.expect(&slow);
        let (first, second) = (b.expect(&fast), b.expect(&fast));
        let waiting = {
            let b = b.clone();
            tokio::spawn(async move { b.call_expected(1, Some(first)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !waiting.is_finished(),
            "the group waits for its own cohort's call"
        );
        let answers = tokio::time::timeout(
            DEADLINE,
            futures::future::join(waiting, b.call_expected(2, Some(second))),
        )
        .await
        .expect("not held by the other cohort's call");
        assert_eq!((answers.0.unwrap(), answers.1), (Some(1), Some(2)));
        assert_eq!(*sizes.lock().unwrap(), vec![2]);
    }

    #[tokio::test]
    async fn a_group_holding_two_cohorts_waits_for_both() {
        let (b, sizes) = sizes_of(Duration::from_secs(600));
        let (one, other) = (Cohort::default(), Cohort::default());
        let (a1, a2, b1, b2) = (
            b.expect(&one),
            b.expect(&one),
            b.expect(&other),
            b.expect(&other),
        );
        let first = {
            let b = b.clone();
            tokio::spawn(async move {
                futures::future::join(b.call_expected(1, Some(a1)), b.call_expected(2, Some(b1)))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(a2);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            !first.is_finished(),
            "the group still waits for the other cohort's call"
        );
        let (answers, last) = tokio::time::timeout(
            DEADLINE,
            futures::future::join(first, b.call_expected(3, Some(b2))),
        )
        .await
        .expect("released once both cohorts are in");
        assert_eq!((answers.unwrap(), last), ((Some(1), Some(2)), Some(3)));
        assert_eq!(*sizes.lock().unwrap(), vec![3]);
    }

    #[test]
    fn a_kinds_cohort_holds_the_requests_started_one_after_another() {
        let window = Duration::from_millis(1);
        let cohorts = Cohorts::new(["fast", "slow"], window);
        let t0 = std::time::Instant::now();
        let first = cohorts.of("slow", t0).expect("a known kind");
        // A batch's calls, each within the window of the one before: one cohort, however long
        // the batch took to start them all.
        let mut at = t0;
        for _ in 0..4 {
            at += window * 3 / 4;
            assert!(first.same(&cohorts.of("slow", at).unwrap()));
        }
        let fast = cohorts.of("fast", t0).unwrap();
        assert!(!first.same(&fast), "each kind its own");
        let later = cohorts.of("slow", at + window * 2).unwrap();
        assert!(!first.same(&later), "a later batch's calls: another cohort");
        assert!(cohorts.of("unknown", t0).is_none());
    }
}
