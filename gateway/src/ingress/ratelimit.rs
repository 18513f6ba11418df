//! Ingress rate limits: a token bucket per bus and per webhook source, counted in requests.
//! Standalone the buckets live in the process; distributed they live in Redis (one atomic
//! script per request, on Redis's clock), so the limit holds for the cluster, not per
//! replica. A request over the limit gets `429` with `Retry-After`; nothing is stored.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use crate::bucket::TokenBucket;
use crate::store::StoreError;

/// `rate_limit = { per_second = 100, burst = 200 }`.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitConfig {
    /// Requests per second, sustained.
    pub per_second: f64,
    /// Requests that may come at once (the bucket's size); default: one second's worth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub burst: Option<u32>,
}

impl RateLimitConfig {
    pub fn check(&self) -> Result<(), String> {
        if !(self.per_second.is_finite() && self.per_second > 0.0 && self.per_second <= 1e6) {
            return Err("rate_limit.per_second must be greater than 0 and at most 1000000".into());
        }
        if self.burst == Some(0) {
            return Err("rate_limit.burst must be at least 1".into());
        }
        Ok(())
    }

    pub fn burst(&self) -> f64 {
        self.burst
            .map_or_else(|| self.per_second.ceil().max(1.0), f64::from)
    }
}

/// Takes one token from the bucket `scope`; `Ok(None)` when allowed, `Ok(Some(wait))` when
/// the bucket is empty (`wait` until the next token).
#[async_trait]
pub trait Limiter: Send + Sync {
    async fn take(
        &self,
        scope: &str,
        limit: &RateLimitConfig,
    ) -> Result<Option<Duration>, StoreError>;
}

/// The buckets of one process (standalone).
#[derive(Default)]
pub struct LocalLimiter {
    buckets: Mutex<HashMap<String, TokenBucket>>,
}

#[async_trait]
impl Limiter for LocalLimiter {
    async fn take(
        &self,
        scope: &str,
        limit: &RateLimitConfig,
    ) -> Result<Option<Duration>, StoreError> {
        let now = Instant::now();
        let burst = limit.burst();
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let bucket = buckets
            .entry(scope.to_string())
            .or_insert_with(|| TokenBucket::full(burst, now));
        Ok(bucket.take(now, limit.per_second, burst).err())
    }
}

/// The buckets of a cluster, in Redis (`store::redis::RedisBuckets`: one atomic script per
/// request, on Redis's clock).
pub struct RedisLimiter {
    buckets: crate::store::redis::RedisBuckets,
}

impl RedisLimiter {
    pub fn new(redis: crate::store::redis::Redis) -> RedisLimiter {
        RedisLimiter {
            buckets: crate::store::redis::RedisBuckets::new(redis),
        }
    }
}

#[async_trait]
impl Limiter for RedisLimiter {
    async fn take(
        &self,
        scope: &str,
        limit: &RateLimitConfig,
    ) -> Result<Option<Duration>, StoreError> {
        self.buckets
            .take(scope, limit.per_second, limit.burst())
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_bucket_allows_its_burst_then_one_request_per_refill() {
        let limiter = LocalLimiter::default();
        let limit = RateLimitConfig {
            per_second: 10.0,
            burst: Some(3),
        };
        for _ in 0..3 {
            assert_eq!(limiter.take("b", &limit).await.unwrap(), None);
        }
        let wait = limiter.take("b", &limit).await.unwrap().expect("empty");
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        // Another scope has its own bucket.
        assert_eq!(limiter.take("other", &limit).await.unwrap(), None);
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert_eq!(limiter.take("b", &limit).await.unwrap(), None);
        assert!(limiter.take("b", &limit).await.unwrap().is_some());
    }

    #[test]
    fn limits_are_checked() {
        let bad = RateLimitConfig {
            per_second: 0.0,
            burst: None,
        };
        assert!(bad.check().is_err());
        let ok = RateLimitConfig {
            per_second: 2.5,
            burst: None,
        };
        assert!(ok.check().is_ok());
        assert_eq!(ok.burst(), 3.0);
    }
}
