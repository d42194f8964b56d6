//! How long a batch waits for more messages: [`BatchLinger`] applied to the rate actions
//! have been arriving at.

use std::time::Duration;

use tokio::time::Instant;

use crate::config::BatchLinger;

/// The recent rate of action messages, from the batches read.
#[derive(Debug, Default)]
pub(super) struct Arrivals {
    /// When the last batch began (its first message was read).
    last: Option<Instant>,
    /// Messages per second, smoothed over the last few batches.
    per_second: f64,
}

impl Arrivals {
    /// How long the batch beginning now waits for more messages.
    pub(super) fn linger(&self, policy: BatchLinger) -> Duration {
        match policy {
            BatchLinger::Fixed(d) => d,
            // Waiting pays when another action is due within it.
            BatchLinger::WhileBusy(d) if self.per_second * d.as_secs_f64() >= 1.0 => d,
            BatchLinger::WhileBusy(_) => Duration::ZERO,
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
        assert_eq!(a.linger(AUTO), Duration::ZERO, "nothing seen yet");
        // 100 actions/s, one per batch: one due in 2 ms is a fifth of an action.
        let t1 = feed(&mut a, t0, Duration::from_millis(10), 1, 20);
        assert_eq!(a.linger(AUTO), Duration::ZERO);
        // 1,000 actions/s, five per 5 ms batch: two are due in 2 ms.
        let t2 = feed(&mut a, t1, Duration::from_millis(5), 5, 5);
        assert_eq!(a.linger(AUTO), Duration::from_millis(2));
        // Back to a trickle: the stream's rate is forgotten within a few batches.
        feed(&mut a, t2, Duration::from_millis(50), 1, 4);
        assert_eq!(a.linger(AUTO), Duration::ZERO);
    }

    #[test]
    fn a_fixed_linger_is_kept_whatever_the_rate() {
        let mut a = Arrivals::default();
        let fixed = BatchLinger::Fixed(Duration::from_millis(5));
        assert_eq!(a.linger(fixed), Duration::from_millis(5));
        feed(&mut a, Instant::now(), Duration::from_secs(1), 1, 3);
        assert_eq!(a.linger(fixed), Duration::from_millis(5));
        assert_eq!(a.linger(BatchLinger::Fixed(Duration::ZERO)), Duration::ZERO);
    }
}
