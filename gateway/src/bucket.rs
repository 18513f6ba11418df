//! The token bucket behind the gateway's in-process rate limits: a target's delivery rate
//! (`targets::limits::RateLimiter`) and the ingress buckets per bus and webhook source
//! (`ingress::ratelimit::LocalLimiter`). It sits at the bottom of the house, beside
//! `values`: it imports nothing of Sluice, so both floors above may share it.

use std::time::{Duration, Instant};

/// Tokens left and when they were counted. The bucket refills at `per_second` up to
/// `burst` and starts full; the rate and the size are the caller's, given at each `take`.
#[derive(Debug, Clone, Copy)]
pub struct TokenBucket {
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// A full bucket of `burst` tokens, counted at `now`.
    pub fn full(burst: f64, now: Instant) -> TokenBucket {
        TokenBucket {
            tokens: burst,
            at: now,
        }
    }

    /// Refills the bucket up to `now`, then takes one token: `Err(wait)` when there is none,
    /// `wait` being the time until the next one (`per_second` must be greater than 0).
    pub fn take(&mut self, now: Instant, per_second: f64, burst: f64) -> Result<(), Duration> {
        let refilled =
            (self.tokens + now.duration_since(self.at).as_secs_f64() * per_second).min(burst);
        self.at = now;
        if refilled >= 1.0 {
            self.tokens = refilled - 1.0;
            Ok(())
        } else {
            self.tokens = refilled;
            Err(Duration::from_secs_f64((1.0 - refilled) / per_second))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_gives_its_burst_then_refills_at_its_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::full(2.0, start);
        assert_eq!(bucket.take(start, 10.0, 2.0), Ok(()));
        assert_eq!(bucket.take(start, 10.0, 2.0), Ok(()));
        let wait = bucket.take(start, 10.0, 2.0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        // Half a token later: still none, half the wait.
        let later = start + Duration::from_millis(50);
        let wait = bucket.take(later, 10.0, 2.0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.05).abs() < 1e-9, "{wait:?}");
        // Long idle: refills to the burst, not beyond.
        let idle = start + Duration::from_secs(60);
        for _ in 0..2 {
            assert_eq!(bucket.take(idle, 10.0, 2.0), Ok(()));
        }
        assert!(bucket.take(idle, 10.0, 2.0).is_err());
    }
}
