//! How long a batch waits for more messages: [`BatchLinger`] applied to the rate actions
//! have been arriving at.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::BatchLinger;

/// A batch this large no longer waits for more under [`BatchLinger::WhileBusy`].
const FILLED: usize = 16;

/// The recent rate of action messages, from the batches read.
#[derive(Debug, Default)]
pub(super) struct Arrivals {
    /// When the last batch began (its first message was read).
    last: Option<Instant>,
    /// Messages per second, smoothed over the last few batches.
    per_second: f64,
}

impl Arrivals {
    /// How long the batch beginning now waits for more messages, and while it holds fewer
    /// than how many (`max`, the batch size, for a fixed linger).
    pub(super) fn linger(&self, policy: BatchLinger, max: usize) -> (Duration, usize) {
        match policy {
            BatchLinger::Fixed(d) => (d, max),
            // Waiting pays when another action is due within it, and only while the batch is
            // small: a transaction's fixed cost is spread thin over FILLED actions, and a
            // busier stream brings batches that size without waiting (at 3,000/s they held
            // about 20 on the benchmark machine, and a linger only added to p50).
            BatchLinger::WhileBusy(d) if self.per_second * d.as_secs_f64() >= 1.0 => {
                (d, max.min(FILLED))
            }
            BatchLinger::WhileBusy(_) => (Duration::ZERO, max),
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

#[cfg(test)]
mod tests {
    use super::*;

    const AUTO: BatchLinger = BatchLinger::WhileBusy(Duration::from_millis(2));

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
        assert_eq!(a.linger(AUTO, 500).0, Duration::ZERO, "nothing seen yet");
        // 100 actions/s, one per batch: one due in 2 ms is a fifth of an action.
        let t1 = feed(&mut a, t0, Duration::from_millis(10), 1, 20);
        assert_eq!(a.linger(AUTO, 500).0, Duration::ZERO);
        // 1,000 actions/s, five per 5 ms batch: two are due in 2 ms.
        let t2 = feed(&mut a, t1, Duration::from_millis(5), 5, 5);
        assert_eq!(a.linger(AUTO, 500), (Duration::from_millis(2), FILLED));
        assert_eq!(a.linger(AUTO, 10), (Duration::from_millis(2), 10));
        // Back to a trickle: the stream's rate is forgotten within a few batches.
        feed(&mut a, t2, Duration::from_millis(50), 1, 4);
        assert_eq!(a.linger(AUTO, 500).0, Duration::ZERO);
    }

    #[test]
    fn a_fixed_linger_is_kept_whatever_the_rate() {
        let mut a = Arrivals::default();
        let fixed = BatchLinger::Fixed(Duration::from_millis(5));
        assert_eq!(a.linger(fixed, 500), (Duration::from_millis(5), 500));
        feed(&mut a, Instant::now(), Duration::from_secs(1), 1, 3);
        assert_eq!(a.linger(fixed, 500), (Duration::from_millis(5), 500));
        assert_eq!(
            a.linger(BatchLinger::Fixed(Duration::ZERO), 500).0,
            Duration::ZERO
        );
    }
}
