//! One backoff for every retry loop: calls, verification, and work waiting for Postgres or the
//! dead-letter topic.

use std::time::Duration;

use rand::Rng;

use crate::config::RetryPolicy;

/// Exponential backoff with full jitter: the wait before try `n + 1` is drawn from
/// `[0, min(cap, initial · 2^(n-1))]`, so relays retrying together spread out. A `Retry-After`
/// from the downstream is honoured up to the cap.
#[derive(Debug, Clone)]
pub struct Backoff {
    initial: Duration,
    cap: Duration,
    /// Tries made so far, for [`Backoff::after_failure`].
    tries: u32,
}

impl Backoff {
    pub fn new(initial: Duration, cap: Duration) -> Self {
        Backoff {
            initial,
            cap,
            tries: 0,
        }
    }

    /// A tool's retry policy.
    pub fn of(policy: &RetryPolicy) -> Self {
        Backoff::new(policy.initial_backoff, policy.max_backoff)
    }

    /// Waiting for a dependency to come back (Postgres, the dead-letter topic): from `initial`
    /// up to 5 s.
    pub fn waiting(initial: Duration) -> Self {
        Backoff::new(initial, Duration::from_secs(5))
    }

    /// The wait after `tries` tries have failed.
    pub fn delay(&self, tries: u32, retry_after: Option<Duration>) -> Duration {
        if let Some(after) = retry_after {
            return after.min(self.cap);
        }
        let exp = self
            .initial
            .saturating_mul(1u32 << tries.saturating_sub(1).min(20))
            .min(self.cap);
        let ms = exp.as_millis() as u64;
        Duration::from_millis(rand::rng().random_range(0..=ms))
    }

    /// Counts one more failed try and returns the wait before the next.
    pub fn after_failure(&mut self) -> Duration {
        self.tries = self.tries.saturating_add(1);
        self.delay(self.tries, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded_and_honours_retry_after() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        for tries in 1..30 {
            assert!(b.delay(tries, None) <= Duration::from_secs(1));
        }
        assert!(b.delay(1, None) <= Duration::from_millis(100));
        assert_eq!(
            b.delay(1, Some(Duration::from_millis(700))),
            Duration::from_millis(700)
        );
        assert_eq!(
            b.delay(1, Some(Duration::from_secs(60))),
            Duration::from_secs(1)
        );
    }

    #[test]
    fn the_jitter_spans_the_whole_window() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        // Try 4 waits up to 800 ms; of 200 draws, some fall in each half.
        let draws: Vec<Duration> = (0..200).map(|_| b.delay(4, None)).collect();
        assert!(draws.iter().all(|d| *d <= Duration::from_millis(800)));
        assert!(draws.iter().any(|d| *d < Duration::from_millis(400)));
        assert!(draws.iter().any(|d| *d > Duration::from_millis(400)));
    }

    #[test]
    fn after_failure_counts_tries_up_to_the_cap() {
        let mut b = Backoff::waiting(Duration::from_millis(50));
        for _ in 0..40 {
            assert!(b.after_failure() <= Duration::from_secs(5));
        }
        assert_eq!(b.tries, 40);
    }
}
