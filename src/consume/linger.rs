//! How long a batch waits for more messages: [`BatchLinger`] applied to the rate actions
//! have been arriving at, and a sleep finer than Tokio's timer for the wait's gap.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::config::BatchLinger;

/// A batch this large no longer waits for more under [`BatchLinger::WhileBusy`]. At 16 a
/// burst of 30 (the benchmark at 3,000/s) went as two batches, each with its own recording,
/// finish and publishing transactions; at 64, as one, for 10-22 % less CPU per action on the
/// box and a p50 no higher (`benches/HISTORY.md`, stop 40).
const FILLED: usize = 64;

/// How a batch that begins now waits for more messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Wait {
    /// In all, from the batch's first message (zero: no wait).
    pub most: Duration,
    /// After the last message read: the wait ends once no message has come for this long
    /// (`None`: it lasts `most`).
    pub gap: Option<Duration>,
    /// The wait ends once the batch holds this many.
    pub until: usize,
}

/// The recent rate of action messages, from the batches read.
#[derive(Debug, Default)]
pub(super) struct Arrivals {
    /// When the last batch began (its first message was read).
    last: Option<Instant>,
    /// Messages per second, smoothed over the last few batches.
    per_second: f64,
}

impl Arrivals {
    /// How the batch beginning now waits for more messages (`max`: the batch size).
    pub(super) fn linger(&self, policy: BatchLinger, max: usize) -> Wait {
        match policy {
            BatchLinger::Fixed(most) => Wait {
                most,
                gap: None,
                until: max,
            },
            // Waiting pays when another action is due within it, and only while the batch is
            // small: a transaction's fixed cost is spread thin over FILLED actions.
            BatchLinger::WhileBusy { most, gap } if self.per_second * most.as_secs_f64() >= 1.0 => {
                Wait {
                    most,
                    gap: Some(gap),
                    until: max.min(FILLED),
                }
            }
            BatchLinger::WhileBusy { .. } => Wait {
                most: Duration::ZERO,
                gap: None,
                until: max,
            },
        }
    }

    /// A batch of `len` messages that began `at` (its first message read): its messages
    /// arrived since the batch before began.
    pub(super) fn batch(&mut self, at: Instant, len: usize) {
        if let Some(last) = self.last.replace(at) {
            // A microsecond at least, so a batch at the same instant counts as a fast one.
            let gap = at.duration_since(last).as_secs_f64().max(1e-6);
            let sample = len as f64 / gap;
            // Half the weight on the newest batch: a stream that begins is met within a few
            // batches, and one that ends holds at most the next lone action.
            self.per_second = 0.5 * self.per_second + 0.5 * sample;
        }
    }
}

type Request = (std::time::Instant, oneshot::Sender<()>);

/// Sleeps to within tens of microseconds, where Tokio's timer turns once a millisecond (a
/// 500 µs sleep there lasts one to two milliseconds, longer than the gap it measures). One
/// thread keeps the deadline. The consume loop owns it and awaits one sleep at a time (the
/// `&mut self`), so a request that comes while the thread waits means the one it waits for
/// was given up (a message came first), and the thread turns to the newer.
pub(super) struct FineSleep {
    /// `None` when the thread could not be started: Tokio's timer then measures the gap.
    requests: Option<mpsc::Sender<Request>>,
}

impl FineSleep {
    pub(super) fn start() -> Self {
        let (requests, incoming) = mpsc::channel::<Request>();
        let started = std::thread::Builder::new()
            .name("idem-linger".into())
            .spawn(move || {
                let mut current = None;
                loop {
                    let (deadline, done) = match current.take() {
                        Some(r) => r,
                        None => match incoming.recv() {
                            Ok(r) => r,
                            // The consume loop is gone.
                            Err(_) => return,
                        },
                    };
                    let now = std::time::Instant::now();
                    if deadline > now && !done.is_closed() {
                        match incoming.recv_timeout(deadline - now) {
                            Ok(newer) => {
                                current = Some(newer);
                                continue;
                            }
                            Err(RecvTimeoutError::Timeout) => {}
                            Err(RecvTimeoutError::Disconnected) => return,
                        }
                    }
                    let _ = done.send(());
                }
            });
        match started {
            Ok(_) => FineSleep {
                requests: Some(requests),
            },
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the batch linger's thread; its gap is measured in whole milliseconds");
                FineSleep { requests: None }
            }
        }
    }

    /// Resolves at `deadline`.
    pub(super) async fn until(&mut self, deadline: Instant) {
        let (done, slept) = oneshot::channel();
        match &self.requests {
            Some(requests) if requests.send((deadline.into_std(), done)).is_ok() => {
                let _ = slept.await;
            }
            _ => tokio::time::sleep_until(deadline).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUTO: BatchLinger = BatchLinger::AUTO;
    const MOST: Duration = Duration::from_millis(2);

    /// Batches of `len` every `gap`, from `start`; returns the time after the last.
    fn feed(a: &mut Arrivals, start: Instant, gap: Duration, len: usize, n: u32) -> Instant {
        let mut at = start;
        for _ in 0..n {
            a.batch(at, len);
            at += gap;
        }
        at
    }

    #[test]
    fn a_trickle_is_not_held_and_a_stream_lingers() {
        let t0 = Instant::now();
        let mut a = Arrivals::default();
        assert_eq!(a.linger(AUTO, 500).most, Duration::ZERO, "nothing seen yet");
        // 100 actions/s, one per batch: one due in 2 ms is a fifth of an action.
        let t1 = feed(&mut a, t0, Duration::from_millis(10), 1, 20);
        assert_eq!(a.linger(AUTO, 500).most, Duration::ZERO);
        // 1,000 actions/s, five per 5 ms batch: two are due in 2 ms.
        let t2 = feed(&mut a, t1, Duration::from_millis(5), 5, 5);
        let BatchLinger::WhileBusy { gap, .. } = AUTO else {
            panic!("auto lingers while busy")
        };
        let busy = |until| Wait {
            most: MOST,
            gap: Some(gap),
            until,
        };
        assert_eq!(a.linger(AUTO, 500), busy(FILLED));
        assert_eq!(a.linger(AUTO, 10), busy(10));
        // Back to a trickle: the stream's rate is forgotten within a few batches.
        feed(&mut a, t2, Duration::from_millis(50), 1, 4);
        assert_eq!(a.linger(AUTO, 500).most, Duration::ZERO);
    }

    #[test]
    fn a_fixed_linger_is_kept_whatever_the_rate() {
        let mut a = Arrivals::default();
        let fixed = BatchLinger::Fixed(Duration::from_millis(5));
        let whole = Wait {
            most: Duration::from_millis(5),
            gap: None,
            until: 500,
        };
        assert_eq!(a.linger(fixed, 500), whole);
        feed(&mut a, Instant::now(), Duration::from_secs(1), 1, 3);
        assert_eq!(a.linger(fixed, 500), whole);
        assert_eq!(
            a.linger(BatchLinger::Fixed(Duration::ZERO), 500).most,
            Duration::ZERO
        );
    }

    #[tokio::test]
    async fn a_fine_sleep_ends_at_its_deadline_and_a_given_up_one_holds_nothing() {
        let mut sleep = FineSleep::start();
        let deadline = Instant::now() + Duration::from_micros(300);
        sleep.until(deadline).await;
        assert!(Instant::now() >= deadline);
        // A sleep given up (a message came first) must not hold the next one: the thread turns
        // to the newer request at once instead of waiting out the old deadline.
        let far = Instant::now() + Duration::from_secs(600);
        assert!(
            tokio::time::timeout(Duration::from_millis(10), sleep.until(far))
                .await
                .is_err()
        );
        let near = Instant::now() + Duration::from_millis(1);
        tokio::time::timeout(Duration::from_secs(60), sleep.until(near))
            .await
            .expect("the newer sleep ends long before the given-up one's deadline");
        assert!(Instant::now() >= near);
    }
}
