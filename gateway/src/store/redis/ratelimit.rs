//! Rate-limit buckets in Redis: `{p}:rate:{scope}`, a token bucket refilled on Redis's own
//! clock, one atomic script per request (the limits themselves are `ingress::ratelimit`'s).

use std::time::Duration;

use redis::Script;

use crate::store::redis::client::Redis;
use crate::store::StoreError;

/// Token bucket in a hash {tokens, at_us}, refilled on Redis's own clock. Returns the
/// microseconds to wait (0: allowed).
const TAKE: &str = include_str!("lua/rate_take.lua");

/// The token buckets of a cluster, in Redis.
pub struct RedisBuckets {
    redis: Redis,
    script: Script,
}

impl RedisBuckets {
    pub fn new(redis: Redis) -> RedisBuckets {
        RedisBuckets {
            redis,
            script: Script::new(TAKE),
        }
    }

    /// Takes one token from the bucket `scope` (refilled at `per_second`, holding at most
    /// `burst`): `None` when allowed, `Some(wait)` until the next token when it is empty.
    pub async fn take(
        &self,
        scope: &str,
        per_second: f64,
        burst: f64,
    ) -> Result<Option<Duration>, StoreError> {
        let wait: u64 = self
            .script
            .key(self.redis.key(&["rate", scope]))
            .arg(per_second)
            .arg(burst)
            .invoke_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis rate limit: {e}")))?;
        Ok((wait > 0).then(|| Duration::from_micros(wait)))
    }
}
