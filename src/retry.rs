//! Backoff between tries.

use std::time::Duration;

use rand::Rng;

use crate::config::RetryPolicy;

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
