//! Delivery-id deduplication in two steps, so that a record exists only for stored events:
//! `reserve` takes the id for a short time (another request with the same id sees it is
//! in flight), then `confirm` keeps it for the dedup window once the event is stored, or
//! `release` drops it when the store failed, so the provider's retry is taken.
//!
//! Distributed: Redis (`SET NX PX`, compare-and-set scripts), so two replicas never both
//! store a delivery. Standalone: a map in the process; it does not survive a restart.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::store::redis::Redis;
use crate::store::StoreError;

/// How long a reservation holds without being confirmed (a request that dies half-way).
pub const RESERVATION: Duration = Duration::from_secs(30);

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// Ours: store the event, then confirm or release with this token.
    Taken(String),
    /// Already stored within the window.
    Duplicate,
    /// Another request holds it now.
    InFlight,
}

#[async_trait]
pub trait Dedup: Send + Sync {
    async fn reserve(&self, key: &str) -> Result<Reserve, StoreError>;
    async fn confirm(&self, key: &str, token: &str, window: Duration) -> Result<(), StoreError>;
    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError>;
}

fn token() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

enum Held {
    Pending(String),
    Done,
}

/// Standalone: in the process, lost on restart.
#[derive(Default)]
pub struct MemoryDedup {
    entries: Mutex<HashMap<String, (Held, Instant)>>,
}

impl MemoryDedup {
    fn with<R>(&self, f: impl FnOnce(&mut HashMap<String, (Held, Instant)>) -> R) -> R {
        let mut map = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        // Amortised expiry: sweep when the map has grown, not on every call.
        if map.len() > 1024 && map.len().is_power_of_two() {
            map.retain(|_, (_, until)| *until > now);
        }
        f(&mut map)
    }
}

#[async_trait]
impl Dedup for MemoryDedup {
    async fn reserve(&self, key: &str) -> Result<Reserve, StoreError> {
        Ok(self.with(|map| {
            let now = Instant::now();
            match map.get(key) {
                Some((Held::Done, until)) if *until > now => Reserve::Duplicate,
                Some((Held::Pending(_), until)) if *until > now => Reserve::InFlight,
                _ => {
                    let t = token();
                    map.insert(
                        key.to_string(),
                        (Held::Pending(t.clone()), now + RESERVATION),
                    );
                    Reserve::Taken(t)
                }
            }
        }))
    }

    async fn confirm(&self, key: &str, token: &str, window: Duration) -> Result<(), StoreError> {
        self.with(|map| {
            if matches!(map.get(key), Some((Held::Pending(t), _)) if t == token) {
                map.insert(key.to_string(), (Held::Done, Instant::now() + window));
            }
        });
        Ok(())
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        self.with(|map| {
            if matches!(map.get(key), Some((Held::Pending(t), _)) if t == token) {
                map.remove(key);
            }
        });
        Ok(())
    }
}

/// Distributed: keys `{prefix}:dedup:{source}:{id}` in the cluster's Redis.
pub struct RedisDedup {
    redis: Redis,
}

impl RedisDedup {
    pub fn new(redis: Redis) -> RedisDedup {
        RedisDedup { redis }
    }
}

const RESERVE: &str = r"
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == 'done' then return 0 end
return 2
";

const CONFIRM: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'done', 'PX', ARGV[2])
end
return 1
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
";

fn unavailable(what: &str, e: &redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis dedup {what}: {e}"))
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[async_trait]
impl Dedup for RedisDedup {
    async fn reserve(&self, key: &str) -> Result<Reserve, StoreError> {
        let t = format!("pending:{}", token());
        let found: i64 = redis::Script::new(RESERVE)
            .key(self.redis.key(&["dedup", key]))
            .arg(&t)
            .arg(millis(RESERVATION))
            .invoke_async(&mut self.redis.connection())
            .await
            .map_err(|e| unavailable("reserve", &e))?;
        Ok(match found {
            1 => Reserve::Taken(t),
            0 => Reserve::Duplicate,
            _ => Reserve::InFlight,
        })
    }

    async fn confirm(&self, key: &str, token: &str, window: Duration) -> Result<(), StoreError> {
        redis::Script::new(CONFIRM)
            .key(self.redis.key(&["dedup", key]))
            .arg(token)
            .arg(millis(window))
            .invoke_async::<i64>(&mut self.redis.connection())
            .await
            .map(|_| ())
            .map_err(|e| unavailable("confirm", &e))
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        redis::Script::new(RELEASE)
            .key(self.redis.key(&["dedup", key]))
            .arg(token)
            .invoke_async::<i64>(&mut self.redis.connection())
            .await
            .map(|_| ())
            .map_err(|e| unavailable("release", &e))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_record_exists_only_once_confirmed() {
        let d = MemoryDedup::default();
        let Reserve::Taken(t) = d.reserve("a").await.unwrap() else {
            panic!("not taken")
        };
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::InFlight);
        d.release("a", &t).await.unwrap();
        let Reserve::Taken(t) = d.reserve("a").await.unwrap() else {
            panic!("not taken after release")
        };
        d.confirm("a", &t, Duration::from_secs(60)).await.unwrap();
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::Duplicate);
        d.release("a", &t).await.unwrap();
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::Duplicate);
        let Reserve::Taken(t) = d.reserve("b").await.unwrap() else {
            panic!()
        };
        d.confirm("b", &t, Duration::ZERO).await.unwrap();
        assert!(matches!(d.reserve("b").await.unwrap(), Reserve::Taken(_)));
    }
}
