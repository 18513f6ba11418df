//! Delivery-id deduplication in two steps, so that a record exists only for stored events:
//! `reserve` takes the id for a short time (another request with the same id sees it is
//! in flight), then `confirm` keeps it for the dedup window once the event is stored, or
//! `release` drops it when the store failed, so the provider's retry is taken.
//!
//! Distributed, the Redis log does better than these three steps: its `append_unique`
//! checks the key, appends the event and records the key in one script (one round trip,
//! atomic), so two replicas never both store a delivery and a key exists only with its
//! event (`ingress::store_unique` picks that path). `RedisDedup` (`SET NX PX`,
//! compare-and-set scripts) remains for logs that cannot. Standalone: a map in the process whose confirmed records are appended
//! to a file in the data directory (`webhook-dedup.jsonl`, read back and compacted at
//! start), so they survive a restart; the file is not flushed per record, so a power loss
//! may forget the last ones (their retries are stored again: at least once).

use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

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

/// Standalone: in the process, with confirmed records kept in a file when `persistent`.
#[derive(Default)]
pub struct MemoryDedup {
    entries: Mutex<HashMap<String, (Held, Instant)>>,
    file: Option<Mutex<std::fs::File>>,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl MemoryDedup {
    /// Loads the records of `path` that have not expired, rewrites the file with only them,
    /// and appends every new confirmed record to it.
    pub fn persistent(path: &Path) -> std::io::Result<MemoryDedup> {
        let now_ms = unix_ms();
        let now = Instant::now();
        let mut entries = HashMap::new();
        let mut live = Vec::new();
        match std::fs::read_to_string(path) {
            Ok(text) => {
                for line in text.lines() {
                    // A torn last line (a crash mid-write) is skipped.
                    let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
                        continue;
                    };
                    let (Some(key), Some(until)) = (
                        record.get("k").and_then(|k| k.as_str()),
                        record.get("u").and_then(serde_json::Value::as_u64),
                    ) else {
                        continue;
                    };
                    if until > now_ms {
                        let left = Duration::from_millis(until - now_ms);
                        entries.insert(key.to_string(), (Held::Done, now + left));
                        live.push(line.to_string());
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let tmp = path.with_extension("jsonl.tmp");
        let mut text = live.join("\n");
        if !text.is_empty() {
            text.push('\n');
        }
        std::fs::write(&tmp, text)?;
        std::fs::rename(&tmp, path)?;
        let file = std::fs::OpenOptions::new().append(true).open(path)?;
        Ok(MemoryDedup {
            entries: Mutex::new(entries),
            file: Some(Mutex::new(file)),
        })
    }

    fn record(&self, key: &str, window: Duration) -> Result<(), StoreError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let until = unix_ms().saturating_add(u64::try_from(window.as_millis()).unwrap_or(u64::MAX));
        // `{"k":<key as a JSON string>,"u":<until>}`: what `persistent` reads back.
        let mut line = String::with_capacity(key.len() + 40);
        line.push_str("{\"k\":");
        line.push_str(&serde_json::to_string(key).unwrap_or_default());
        line.push_str(",\"u\":");
        line.push_str(&until.to_string());
        line.push_str("}\n");
        let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
        file.write_all(line.as_bytes())
            .map_err(|e| StoreError::Unavailable(format!("webhook dedup file: {e}")))
    }

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
        let ours = self.with(|map| {
            let ours = matches!(map.get(key), Some((Held::Pending(t), _)) if t == token);
            if ours {
                map.insert(key.to_string(), (Held::Done, Instant::now() + window));
            }
            ours
        });
        if ours && !window.is_zero() {
            self.record(key, window)?;
        }
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

    #[tokio::test]
    async fn confirmed_records_survive_a_reopen_until_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup.jsonl");
        let d = MemoryDedup::persistent(&path).unwrap();
        for (key, window) in [("kept\nline", 3_600_000), ("short", 1)] {
            let Reserve::Taken(t) = d.reserve(key).await.unwrap() else {
                panic!()
            };
            d.confirm(key, &t, Duration::from_millis(window))
                .await
                .unwrap();
        }
        let Reserve::Taken(_) = d.reserve("pending").await.unwrap() else {
            panic!()
        };
        drop(d);
        std::thread::sleep(Duration::from_millis(5));
        let d = MemoryDedup::persistent(&path).unwrap();
        assert_eq!(d.reserve("kept\nline").await.unwrap(), Reserve::Duplicate);
        assert!(matches!(
            d.reserve("short").await.unwrap(),
            Reserve::Taken(_)
        ));
        assert!(matches!(
            d.reserve("pending").await.unwrap(),
            Reserve::Taken(_)
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
    }
}
