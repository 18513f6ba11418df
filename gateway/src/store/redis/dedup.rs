//! Deduplication in Redis: [`RedisDedup`] (the reserve/confirm path, for logs that cannot
//! deduplicate in their append) and the bound every Redis dedup index is held to
//! ([`REDIS_BOUND`], [`redis_index_cap`]), shared with `RedisLog::append_unique`.

use std::time::Duration;

use async_trait::async_trait;

use crate::store::dedup::{token, Dedup, Reserve, RESERVATION};
use crate::store::redis::client::Redis;
use crate::store::StoreError;

/// Redis memory one dedup record takes, its index entry included, for a key name of
/// `name` bytes (such as `{prefix}:{webhooks}:dedup:` and 32 hex characters). Measured on redis-server 7.0.15
/// (jemalloc), 20,000 records, `used_memory` before and after: for names of 45 and 99
/// bytes, the key with its `done` value and its expiry took 186 and 234 bytes, its
/// sorted-set member 169 and 217 (`MEMORY USAGE` says 120 for one key of 57 bytes, which
/// leaves out its expiry entry and its share of the tables, and 161 per member of the
/// index): about 265 bytes and 1.8 times the name. Counted as 275 and twice the name, so
/// that the bound holds.
pub(crate) fn redis_record_bytes(name: usize) -> usize {
    275 + 2 * name
}

/// The length of a dedup key named with `prefix` (the key is 32 hex characters).
pub(crate) fn dedup_name_len(prefix: &str) -> usize {
    prefix.len() + 32
}

/// The records one index may hold: the handle's `max_dedup_bytes` split between the
/// `indexes` that share it (a bus's shards), at least one, for names of `name` bytes.
pub(crate) fn redis_index_cap(redis: &Redis, indexes: u32, name: usize) -> u64 {
    let per_index = redis.dedup_bytes() / indexes.max(1) as usize;
    (per_index / redis_record_bytes(name)).max(1) as u64
}

/// Lua prepended to the scripts that record dedup keys in Redis, so that the bound is
/// kept in the step that writes the key. Each recorded key is also a member of an index (a
/// sorted set per bus shard, or the reserve/confirm path's one) scored by its expiry in
/// Redis time, the clock its `PX` runs on. `dedup_bound` drops the members that expired
/// by themselves, then pops the soonest-expiring ones past `cap` and deletes their keys
/// (those still `done`: a member left behind by a key that expired and was taken again
/// meanwhile is not someone's record), and keeps the index alive for the window (only
/// lengthened: webhook sources and the bus may have different windows). Returns the
/// index's size and how many keys it evicted. An evicted key makes a late duplicate of
/// it stored again (at least once), never a new event refused. Keys written before the
/// indexes existed are in none: they expire with their window as before.
pub(crate) const REDIS_BOUND: &str = include_str!("lua/dedup_bound.lua");

/// Distributed: keys `{prefix}:{webhooks}:dedup:{key}` in the cluster's Redis, each
/// expiring with its window (the key is [`crate::store::dedup::key`]'s fixed-size hash),
/// and confirmed keys held to `limits.max_dedup_bytes` by the index
/// `{prefix}:{webhooks}:dedup-index` (this path serves webhook delivery ids; the Redis log
/// deduplicates events in its append, with records and an index per shard). Keys and
/// index share one hash slot, so that confirming a key and bounding the index is one
/// step: on a cluster this path runs on one node, a small load next to the logs'.
pub(crate) const WEBHOOKS_TAG: &str = "webhooks";
pub struct RedisDedup {
    redis: Redis,
    index: String,
    cap: u64,
    record_bytes: i64,
    confirm: redis::Script,
}

impl RedisDedup {
    pub fn new(redis: Redis) -> RedisDedup {
        let name = dedup_name_len(&redis.tagged(WEBHOOKS_TAG, &["dedup", ""]));
        RedisDedup {
            index: redis.tagged(WEBHOOKS_TAG, &["dedup-index"]),
            cap: redis_index_cap(&redis, 1, name),
            record_bytes: i64::try_from(redis_record_bytes(name)).unwrap_or(i64::MAX),
            confirm: redis::Script::new(&format!("{REDIS_BOUND}{CONFIRM}")),
            redis,
        }
    }
}

impl RedisDedup {
    fn key(&self, key: &str) -> String {
        self.redis.tagged(WEBHOOKS_TAG, &["dedup", key])
    }
}

const RESERVE: &str = include_str!("lua/dedup_reserve.lua");

/// KEYS: the key, the index. ARGV: the reservation's token, the window (ms), the index's
/// cap. Returns the index's size (-1 when the reservation was not ours: nothing written)
/// and how many keys it evicted.
const CONFIRM: &str = include_str!("lua/dedup_confirm.lua");

const RELEASE: &str = include_str!("lua/dedup_release.lua");

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
            .key(self.key(key))
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
        let (size, evicted) = self
            .confirm
            .key(self.key(key))
            .key(&self.index)
            .arg(token)
            .arg(millis(window))
            .arg(self.cap)
            .invoke_async::<(i64, i64)>(&mut self.redis.connection())
            .await
            .map_err(|e| unavailable("confirm", &e))?;
        let metrics = crate::metrics::get();
        if evicted > 0 {
            metrics.dedup_evicted.inc_by(evicted.unsigned_abs());
        }
        if size >= 0 {
            let (entries, memory) =
                metrics.dedup_series(&[("store", "redis"), ("index", "webhooks")]);
            entries.set(size);
            memory.set(size.saturating_mul(self.record_bytes));
        }
        Ok(())
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        redis::Script::new(RELEASE)
            .key(self.key(key))
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
    use crate::store::dedup::DEFAULT_MAX_BYTES;

    /// Redis: the bound is split between a bus's shards, per record as estimated for the
    /// key names of the prefix, and never below one record an index.
    #[tokio::test]
    async fn redis_indexes_share_the_bound() {
        // Lazy: no server needed.
        let redis = Redis::connect("redis://127.0.0.1:1/", "sluice", Duration::from_secs(1))
            .await
            .unwrap();
        // `sluice:{webhooks}:dedup:` and 32 hex characters: 56 bytes.
        let name = dedup_name_len(&redis.tagged(WEBHOOKS_TAG, &["dedup", ""]));
        assert_eq!(name, 56);
        assert_eq!(redis_record_bytes(name), 275 + 2 * 56);
        assert_eq!(
            redis_index_cap(&redis, 1, 45),
            (DEFAULT_MAX_BYTES / 365) as u64
        );
        assert_eq!(
            redis_index_cap(&redis, 8, 45),
            (DEFAULT_MAX_BYTES / 8 / 365) as u64
        );
        let tiny = redis.with_dedup_bytes(100);
        assert_eq!(redis_index_cap(&tiny, 4, 45), 1);
        assert_eq!(redis_index_cap(&tiny, 0, 45), 1);
    }
}
