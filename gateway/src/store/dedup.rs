//! Delivery-id deduplication in two steps, so that a record exists only for stored events:
//! `reserve` takes the id for a short time (another request with the same id sees it is
//! in flight), then `confirm` keeps it for the dedup window once the event is stored, or
//! `release` drops it when the store failed, so the provider's retry is taken. Used by
//! CloudEvents ingress and webhook sources alike.
//!
//! Keys are fixed-size: [`key`] hashes the parts that scope a record (the bus or webhook
//! source, the producer's API key when the bus has keys, the event's `source` and `id`),
//! so an id of 200 KB costs what an id of 2 bytes costs, and one producer cannot make
//! another's event a duplicate.
//!
//! Distributed, the Redis log does better than these three steps: its `append_unique`
//! checks the key, appends the event and records the key in one script (one round trip,
//! atomic), so two replicas never both store a delivery and a key exists only with its
//! event (`ingress::store_unique` picks that path). `RedisDedup` (`store::redis::dedup`:
//! `SET NX PX`, compare-and-set scripts) remains for logs that cannot; its keys expire
//! with their window. In Redis too the records are bounded by `limits.max_dedup_bytes`:
//! every recorded key enters an index in the script that writes it, and past the index's
//! share of the bound the soonest-expiring keys are deleted (see `REDIS_BOUND`).
//! Standalone: `MemoryDedup` (`store::embedded::dedup`), a map in the process whose
//! confirmed records are appended to a file in the data directory
//! (`webhook-dedup.jsonl`, one line of fixed size per record), read back at start and
//! compacted (rewritten without expired records: aside, synced, renamed) at start and
//! whenever it grew past twice its live records. The file is not flushed per record, so a
//! power loss may forget the last ones (their retries are stored again: at least once).
//! Memory is bounded by `limits.max_dedup_bytes`: past it the oldest records are dropped
//! before their window ends (counted in `sluice_dedup_evicted_total`; a late duplicate of
//! one is stored again, a legitimate event is never refused).

use std::time::Duration;

use async_trait::async_trait;
use sha2::{Digest as _, Sha256};

use crate::store::StoreError;

/// How long a reservation holds without being confirmed (a request that dies half-way).
pub const RESERVATION: Duration = Duration::from_secs(30);

/// The default of `limits.max_dedup_bytes`.
pub const DEFAULT_MAX_BYTES: usize = 64 * 1024 * 1024;

/// The dedup key of a record: SHA-256 of the length-prefixed parts, its first 128 bits in
/// hex (32 characters, whatever the parts' sizes). Length prefixes keep any two tuples
/// apart (`("a:b", "c")` is not `("a", "b:c")`); 128 bits keep collisions out of reach
/// (2^-64 at four billion records).
pub fn key(parts: &[&str]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_be_bytes());
        hash.update(part.as_bytes());
    }
    let digest = hash.finalize();
    digest[..16].iter().map(|b| format!("{b:02x}")).collect()
}

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

/// A reservation's token: 128 random bits in hex.
pub(crate) fn token() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_fixed_size_and_keep_tuples_apart() {
        let long = "x".repeat(200_000);
        assert_eq!(key(&["bus", "b", "", "/s", &long]).len(), 32);
        assert_eq!(key(&["bus", "b", "", "/s", "1"]).len(), 32);
        assert_ne!(key(&["a:b", "c"]), key(&["a", "b:c"]));
        assert_ne!(
            key(&["bus", "b", "k1", "/s", "1"]),
            key(&["bus", "b", "k2", "/s", "1"])
        );
        assert_eq!(key(&["a", "b"]), key(&["a", "b"]));
    }
}
