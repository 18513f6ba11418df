//! The limits a target's tasks share: a token-bucket rate limiter (`rate_limit`, on
//! `bucket::TokenBucket`) and a circuit breaker that stops calling a peer that keeps
//! failing (`circuit_breaker`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::bucket::TokenBucket;
use crate::targets::target::TargetError;

/// A token bucket shared by a target's tasks: at most `per_second` events on average, with
/// bursts up to `burst`.
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    bucket: Mutex<TokenBucket>,
}

impl RateLimiter {
    pub fn new(per_second: f64, burst: u32) -> RateLimiter {
        let burst = f64::from(burst.max(1));
        RateLimiter {
            per_second,
            burst,
            bucket: Mutex::new(TokenBucket::full(burst, Instant::now())),
        }
    }

    /// Waits for one token.
    pub async fn acquire(&self) {
        loop {
            let taken = self.bucket.lock().unwrap_or_else(|p| p.into_inner()).take(
                Instant::now(),
                self.per_second,
                self.burst,
            );
            match taken {
                Ok(()) => return,
                Err(wait) => tokio::time::sleep(wait).await,
            }
        }
    }
}

/// Stops calling an endpoint that keeps failing: after `threshold` failures in a row it
/// opens for `open_for` (calls fail at once, retryably), then lets one probe through; the
/// probe's result closes it again or re-opens it.
///
/// A call holds a [`BreakerPermit`] from `admit` to `record`. A probe whose future is
/// dropped (task stopped, lease lost) or that returns before recording gives the half-open
/// slot back when its permit drops; otherwise the breaker would stay half-open for good.
pub struct CircuitBreaker {
    threshold: u32,
    open_for: Duration,
    state: Mutex<BreakerState>,
}

#[derive(Debug, Clone, Copy)]
struct BreakerState {
    breaker: Breaker,
    /// Numbers the probes, so a late drop of an old probe cannot end a newer one.
    probes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breaker {
    Closed { failures: u32 },
    Open { until: Instant },
    Probing { probe: u64 },
}

/// Leave to make one call through a [`CircuitBreaker`]; give its result to `record`.
#[must_use = "record the call's result, or the probe slot is given back unused"]
pub struct BreakerPermit<'a> {
    breaker: &'a CircuitBreaker,
    /// Set when this call is the half-open probe.
    probe: Option<u64>,
}

impl CircuitBreaker {
    pub fn new(threshold: u32, open_for: Duration) -> CircuitBreaker {
        CircuitBreaker {
            threshold: threshold.max(1),
            open_for,
            state: Mutex::new(BreakerState {
                breaker: Breaker::Closed { failures: 0 },
                probes: 0,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BreakerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// May a call go out now? The error says how long until the next probe.
    pub fn admit(&self) -> Result<BreakerPermit<'_>, TargetError> {
        let mut state = self.lock();
        match state.breaker {
            Breaker::Closed { .. } => Ok(BreakerPermit {
                breaker: self,
                probe: None,
            }),
            Breaker::Open { until } => {
                let now = Instant::now();
                if now >= until {
                    state.probes += 1;
                    let probe = state.probes;
                    state.breaker = Breaker::Probing { probe };
                    Ok(BreakerPermit {
                        breaker: self,
                        probe: Some(probe),
                    })
                } else {
                    Err(TargetError {
                        message: "circuit breaker open: the endpoint failed repeatedly".to_string(),
                        retryable: true,
                        status: None,
                        retry_after: Some(until - now),
                    })
                }
            }
            Breaker::Probing { .. } => Err(TargetError {
                message: "circuit breaker half-open: a probe is in flight".to_string(),
                retryable: true,
                status: None,
                retry_after: Some(Duration::from_millis(100)),
            }),
        }
    }

    /// Records a call's result. `healthy` is false only for failures that say the endpoint
    /// is down (network errors, timeouts, 5xx, 429), not for refused events.
    fn record(&self, healthy: bool) {
        let mut state = self.lock();
        state.breaker = match (state.breaker, healthy) {
            (_, true) => Breaker::Closed { failures: 0 },
            (Breaker::Closed { failures }, false) if failures + 1 < self.threshold => {
                Breaker::Closed {
                    failures: failures + 1,
                }
            }
            _ => Breaker::Open {
                until: Instant::now()
                    .checked_add(self.open_for)
                    .unwrap_or_else(Instant::now),
            },
        };
    }

    /// A probe that ended without a result: the endpoint is as unknown as before, so the
    /// next call may probe at once.
    fn abandon(&self, probe: u64) {
        let mut state = self.lock();
        if state.breaker == (Breaker::Probing { probe }) {
            state.breaker = Breaker::Open {
                until: Instant::now(),
            };
        }
    }
}

impl BreakerPermit<'_> {
    /// Ends the call with its result (see [`CircuitBreaker`] for what counts as healthy).
    pub fn record(mut self, healthy: bool) {
        self.probe = None;
        self.breaker.record(healthy);
    }
}

impl std::fmt::Debug for BreakerPermit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BreakerPermit")
            .field("probe", &self.probe)
            .finish()
    }
}

impl Drop for BreakerPermit<'_> {
    fn drop(&mut self) {
        if let Some(probe) = self.probe.take() {
            self.breaker.abandon(probe);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_opens_then_probes() {
        let b = CircuitBreaker::new(2, Duration::from_millis(30));
        assert!(b.admit().is_ok());
        b.record(false);
        assert!(b.admit().is_ok());
        b.record(false);
        let e = b.admit().unwrap_err();
        assert!(e.retryable && e.retry_after.is_some());
        std::thread::sleep(Duration::from_millis(40));
        let probe = b.admit().expect("one probe goes through");
        assert!(b.admit().is_err(), "only one");
        probe.record(true);
        assert!(b.admit().is_ok());
    }

    /// Opens `b` (threshold 1) and waits until it lets a probe through.
    fn open_and_wait(b: &CircuitBreaker) {
        b.admit().unwrap().record(false);
        assert!(b.admit().is_err(), "open");
        std::thread::sleep(Duration::from_millis(25));
    }

    #[test]
    fn a_dropped_probe_releases_the_half_open_state() {
        let b = CircuitBreaker::new(1, Duration::from_millis(20));
        open_and_wait(&b);
        let probe = b.admit().expect("probe");
        assert!(b.admit().is_err(), "half-open while the probe is out");
        drop(probe);
        let next = b.admit().expect("a new probe may go at once");
        assert!(b.admit().is_err(), "and again only one");
        next.record(true);
        assert!(b.admit().is_ok(), "closed");
    }

    #[tokio::test]
    async fn a_cancelled_probe_call_releases_the_half_open_state() {
        let b = CircuitBreaker::new(1, Duration::from_millis(20));
        open_and_wait(&b);
        // A call that takes its permit, then is cancelled mid-flight (task stop, lease lost).
        let call = async {
            let permit = b.admit()?;
            std::future::pending::<()>().await;
            permit.record(true);
            Ok::<(), TargetError>(())
        };
        let cancelled = tokio::time::timeout(Duration::from_millis(10), call).await;
        assert!(cancelled.is_err(), "the call was cut off");
        assert!(b.admit().is_ok(), "the probe slot is free again");
    }

    #[test]
    fn a_late_drop_of_an_old_probe_does_not_end_a_newer_one() {
        let b = CircuitBreaker::new(1, Duration::from_millis(20));
        open_and_wait(&b);
        let old = b.admit().expect("probe");
        // A closed-state call admitted earlier reports a failure meanwhile: open again.
        b.record(false);
        std::thread::sleep(Duration::from_millis(25));
        let newer = b.admit().expect("newer probe");
        drop(old);
        assert!(b.admit().is_err(), "the newer probe still holds the slot");
        newer.record(false);
        assert!(b.admit().is_err(), "open after the failed probe");
    }
}
