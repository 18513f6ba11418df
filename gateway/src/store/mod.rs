//! The storage traits every mode implements: bus logs (one ordered log per shard) and
//! positions (how far each subscription has delivered each shard). The embedded backend keeps
//! them on local disk; the distributed backend keeps them in Redis behind the same traits.
//! `cluster` holds the cluster service's trait (membership, leases, control, status), which
//! the same two backends implement: one process in memory, or Redis. `dedup` holds the
//! deduplication trait, `catalog` the catalog's storage trait, each implemented by both.

pub mod append;
pub mod catalog;
pub mod cluster;
pub mod dedup;
pub mod embedded;
pub mod redis;
pub mod search;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use serde::Deserialize;
use tokio::sync::watch;

use cluster::Lease;

/// A sequence number within one shard's log: the first record is 0, then 1, 2, …
pub type Seq = u64;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store cannot take more work now; retrying shortly may succeed.
    #[error("the store is busy: {0}")]
    Busy(String),
    /// The store failed (I/O error, unreachable); nothing of the failed write was kept.
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// Stored data did not read back as written.
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// A record over [`MAX_RECORD_BYTES`]; retrying cannot help.
    #[error("{0}")]
    TooLarge(String),
}

/// The largest record any store takes. Every path that writes to a bus (ingress, function
/// replies, the bus target, dead letters) is held to it, so whatever is acknowledged can be
/// read back; `limits.max_event_bytes` is bounded well below it (data may grow by a third
/// when stored as base64).
pub const MAX_RECORD_BYTES: usize = 16 * 1024 * 1024;

/// Refuses the appends that hold a record over [`MAX_RECORD_BYTES`].
pub fn check_record_sizes(append: &ShardAppend) -> Result<(), StoreError> {
    append.records.iter().try_for_each(|r| check_record_size(r))
}

/// Refuses a record over [`MAX_RECORD_BYTES`].
pub fn check_record_size(record: &[u8]) -> Result<(), StoreError> {
    if record.len() > MAX_RECORD_BYTES {
        return Err(StoreError::TooLarge(format!(
            "a record of {} bytes is over the store's limit of {MAX_RECORD_BYTES} bytes",
            record.len()
        )));
    }
    Ok(())
}

impl StoreError {
    pub fn io(context: &str, e: &std::io::Error) -> Self {
        StoreError::Unavailable(format!("{context}: {e}"))
    }
}

/// One record read back from a shard log.
#[derive(Debug, Clone)]
pub struct Record {
    pub seq: Seq,
    pub payload: Bytes,
    /// When the store accepted the record (milliseconds since the Unix epoch); 0 for
    /// records written before acceptance times were kept.
    pub accepted_ms: u64,
}

/// The first byte of a stored record that begins with its acceptance time (8 bytes, big
/// endian, milliseconds) before the event; older records are the event alone (JSON, `{`).
const STAMPED: u8 = 0x01;
/// The bytes the acceptance time adds to a stored record.
pub const STAMP_BYTES: usize = 9;

/// Writes a record's stored form: its acceptance time, then the event.
pub fn write_stamped(buf: &mut Vec<u8>, accepted_ms: u64, payload: &[u8]) {
    buf.push(STAMPED);
    buf.extend_from_slice(&accepted_ms.to_be_bytes());
    buf.extend_from_slice(payload);
}

impl Record {
    /// A record read back from its stored form (stamped or not).
    pub fn from_stored(seq: Seq, stored: Bytes) -> Record {
        if stored.len() >= STAMP_BYTES && stored[0] == STAMPED {
            let mut at = [0u8; 8];
            at.copy_from_slice(&stored[1..STAMP_BYTES]);
            return Record {
                seq,
                accepted_ms: u64::from_be_bytes(at),
                payload: stored.slice(STAMP_BYTES..),
            };
        }
        Record {
            seq,
            payload: stored,
            accepted_ms: 0,
        }
    }
}

/// Now, in milliseconds since the Unix epoch: a record's acceptance time.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The records of one request bound for one shard.
#[derive(Debug)]
pub struct ShardAppend {
    pub shard: u32,
    pub records: Vec<Bytes>,
}

/// The log of one bus: `shards` independent ordered logs.
#[async_trait]
pub trait BusLog: Send + Sync + 'static {
    fn shards(&self) -> u32;

    /// Appends to several shards at once and returns, per input entry, the sequence number
    /// of its first record. Returns only when every record is durable in the configured
    /// sense; an `Err` entry means none of that entry's records were kept.
    async fn append(&self, appends: Vec<ShardAppend>) -> Vec<Result<Seq, StoreError>>;

    /// A reader of one shard that starts at `from` (clamped to what the log still holds).
    async fn reader(&self, shard: u32, from: Seq) -> Result<Box<dyn ShardReader>, StoreError>;

    /// The next sequence number the shard will give out; everything below it is durable.
    /// Changes whenever a new record becomes durable.
    fn tail(&self, shard: u32) -> watch::Receiver<Seq>;

    /// The next sequence number the shard will give out, read from the store itself.
    async fn end(&self, shard: u32) -> Result<Seq, StoreError>;

    /// Records below `seq` are no longer needed by anyone and may be deleted.
    async fn release(&self, shard: u32, seq: Seq) -> Result<(), StoreError>;

    /// A position at or below the oldest record the shard still holds (a reader started
    /// there starts at that record without being clamped).
    async fn start(&self, shard: u32) -> Result<Seq, StoreError>;

    /// False once the log is fenced (a flush failed): it takes no writes until a restart
    /// re-verifies it. Liveness reports it, so an orchestrator restarts the process.
    fn healthy(&self) -> bool;

    /// Why writes are failing now (no space left, file too large), while they fail; the
    /// log is not fenced and the first write that succeeds clears it. Readiness reports it.
    fn write_problem(&self) -> Option<String> {
        None
    }

    /// Appends the records of one shard, each under its deduplication key, in one atomic
    /// step with the dedup records: a record whose key is already recorded is not stored,
    /// and a key is recorded (for `window`) only with its record, so a failed store never
    /// makes a retry look like a duplicate. `None` when this log cannot do both at once
    /// (the caller reserves, stores and confirms through its `Dedup` instead).
    async fn append_unique(
        &self,
        _shard: u32,
        _records: &[(Bytes, &str)],
        _window: Duration,
    ) -> Option<Result<Vec<Unique>, StoreError>> {
        None
    }
}

/// What became of one record of [`BusLog::append_unique`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unique {
    Stored(Seq),
    /// Its key was recorded within the window: not stored again.
    Duplicate,
    /// Its key is held by a request still deciding (reserved through a `Dedup`).
    Busy,
}

/// Most bytes of records one read returns unless the reader is told otherwise
/// ([`ShardReader::set_max_bytes`]); a read always returns at least one record.
pub const DEFAULT_READ_BYTES: usize = 4 * 1024 * 1024;

#[async_trait]
pub trait ShardReader: Send + Sync {
    /// Bounds the bytes of records one read returns: a read stops once its records'
    /// payloads reach `bytes`, so it holds at most `bytes` plus one record (and a record
    /// larger than the bound is still read, alone).
    fn set_max_bytes(&mut self, bytes: usize);

    /// Up to `max` durable records from the reader's position on; empty when it is at the tail.
    async fn read(&mut self, max: usize) -> Result<Vec<Record>, StoreError>;

    /// Like `read`, but at the tail waits up to `wait` for new records (a blocking read in
    /// Redis, the tail's change notice in the embedded log), so an idle reader costs nothing
    /// between appends.
    async fn read_wait(&mut self, max: usize, wait: Duration) -> Result<Vec<Record>, StoreError>;
}

/// The positions of every subscription of one bus shard, kept as one value so that its
/// size and the cost of committing it do not grow with the number of subscriptions that
/// are simply keeping up: those are all at `shared` (the shard reader's position), and only
/// subscriptions that are behind, ahead, paused or catching up are listed in `own`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupPositions {
    /// Where every subscription in `known` but not in `own` is; `None` before the first
    /// commit of the shard.
    pub shared: Option<Seq>,
    /// Subscriptions (`{rule}/{target}`) whose position differs from `shared`.
    pub own: BTreeMap<String, Seq>,
    /// Every subscription that has a position in this shard. A subscription of the bus that
    /// is not here is new: it starts at the end of the shard. Shared with the bus's plan,
    /// so a commit does not copy (or compare) a list as long as the bus's rules.
    pub known: Arc<BTreeSet<String>>,
}

impl GroupPositions {
    /// Where the subscription is, if it has a position.
    pub fn of(&self, subscription: &str) -> Option<Seq> {
        if let Some(seq) = self.own.get(subscription) {
            return Some(*seq);
        }
        if self.known.contains(subscription) {
            return self.shared;
        }
        None
    }

    /// The lowest position of any subscription: records below it are no longer needed.
    pub fn min(&self) -> Option<Seq> {
        let own = self.own.values().copied().min();
        match (self.shared, own) {
            (Some(s), Some(o)) => Some(s.min(o)),
            (s, o) => s.or(o),
        }
    }
}

/// Where each subscription has got to in each shard (the next sequence number to deliver).
///
/// Progress is recorded in memory as tasks deliver (`set`) and made durable in batches
/// (`flush`). In distributed mode every commit is fenced: it is refused unless the task's
/// lease epoch given to `own` is still the current one.
#[async_trait]
pub trait PositionStore: Send + Sync + 'static {
    /// The committed position, if the subscription has one for this shard.
    async fn load(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError>;

    /// Sets the position if there is none yet, durably. A new subscription starts where its
    /// bus ends when it is created, so it neither replays old events nor misses new ones.
    async fn init(&self, subscription: &str, shard: u32, next: Seq) -> Result<(), StoreError>;

    /// Records progress; made durable by the next `flush`.
    fn set(&self, subscription: &str, shard: u32, next: Seq);

    /// This worker now commits the position under `lease` (a task's lease may cover many
    /// positions: a source task owns one per queue it reads).
    fn own(&self, subscription: &str, shard: u32, lease: &Lease);

    /// This worker no longer runs the task: forget the positions its lease covered,
    /// including progress not committed yet.
    fn disown(&self, task: &str);

    /// Commits every position set so far. Returns the tasks whose commits were refused
    /// because their lease moved on: those tasks must stop.
    async fn flush(&self) -> Result<Vec<String>, StoreError>;

    /// The position as of the last successful commit: what a restart resumes from.
    async fn committed(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError>;

    /// The committed positions of the subscriptions of one bus shard.
    async fn load_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError>;

    /// The committed positions of one bus shard, read without touching this worker's own
    /// commit state (for observers: lag, scaling).
    async fn peek_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        self.load_group(bus, shard).await
    }

    /// This worker now commits the bus shard's positions under `lease` (its shard task's).
    fn own_group(&self, bus: &str, shard: u32, lease: &Lease);

    /// Records the bus shard's positions; made durable by the next `flush`, fenced by the
    /// lease given to `own_group`. `disown(lease.task)` forgets them.
    fn set_group(&self, bus: &str, shard: u32, positions: GroupPositions);

    /// The bus shard's positions as of the last successful commit by this worker.
    fn committed_group(&self, bus: &str, shard: u32) -> Option<GroupPositions>;

    /// The lowest committed position of the bus shard's subscriptions (what `release` may
    /// drop below), without copying the group: it is asked on every commit.
    fn committed_min(&self, bus: &str, shard: u32) -> Option<Seq>;
}

/// When an accepted event counts as stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Durability {
    /// `202` only after the log is fsynced (group commit: concurrent appends share one flush).
    #[default]
    Fsync,
    /// `202` once the OS has the write; survives a process crash, not a power loss.
    Os,
}

impl std::fmt::Display for Durability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Durability::Fsync => "fsync",
            Durability::Os => "os",
        })
    }
}

crate::values::from_names!(
    Durability,
    "durability",
    "fsync" => Durability::Fsync,
    "os" => Durability::Os,
);

/// Stands in for the log of a bus that does not open on this replica (or for any bus
/// while a change is only being checked): appends and reads fail as the store failing
/// would, so ingress answers 503 and a target appending to it retries; nothing is lost or
/// taken. It shows as empty (end and start 0), so observers (lag, scaling) count nothing
/// for it rather than fail for every bus.
pub struct UnavailableLog {
    shards: u32,
    reason: String,
    tail: watch::Sender<Seq>,
}

impl UnavailableLog {
    pub fn new(shards: u32, reason: String) -> UnavailableLog {
        UnavailableLog {
            shards,
            reason,
            tail: watch::Sender::new(0),
        }
    }

    fn error(&self) -> crate::store::StoreError {
        crate::store::StoreError::Unavailable(self.reason.clone())
    }
}

#[async_trait::async_trait]
impl BusLog for UnavailableLog {
    fn shards(&self) -> u32 {
        self.shards
    }

    async fn append(
        &self,
        appends: Vec<crate::store::ShardAppend>,
    ) -> Vec<Result<Seq, crate::store::StoreError>> {
        appends.iter().map(|_| Err(self.error())).collect()
    }

    async fn reader(
        &self,
        _shard: u32,
        _from: Seq,
    ) -> Result<Box<dyn crate::store::ShardReader>, crate::store::StoreError> {
        Err(self.error())
    }

    fn tail(&self, _shard: u32) -> watch::Receiver<Seq> {
        self.tail.subscribe()
    }

    async fn end(&self, _shard: u32) -> Result<Seq, crate::store::StoreError> {
        Ok(0)
    }

    async fn release(&self, _shard: u32, _seq: Seq) -> Result<(), crate::store::StoreError> {
        Err(self.error())
    }

    async fn start(&self, _shard: u32) -> Result<Seq, crate::store::StoreError> {
        Ok(0)
    }

    // Not unhealthy: the process restarting would not open it either, and the other buses
    // run. Ingress says why for this bus.
    fn healthy(&self) -> bool {
        true
    }
}

/// How old an undelivered event may get when the bus does not say (`max_backlog_age`).
/// A week, like Kafka's default `retention.ms` and Pub/Sub's longest unacknowledged retention.
pub const DEFAULT_MAX_BACKLOG_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

#[cfg(test)]
mod stamp_tests {
    use super::*;

    #[test]
    fn stored_records_carry_their_acceptance_time_and_old_ones_read_as_before() {
        let mut buf = Vec::new();
        write_stamped(&mut buf, 1_700_000_000_123, br#"{"id":"1"}"#);
        let r = Record::from_stored(7, Bytes::from(buf));
        assert_eq!((r.seq, r.accepted_ms), (7, 1_700_000_000_123));
        assert_eq!(&r.payload[..], br#"{"id":"1"}"#);
        let old = Record::from_stored(8, Bytes::from_static(br#"{"id":"2"}"#));
        assert_eq!(old.accepted_ms, 0);
        assert_eq!(&old.payload[..], br#"{"id":"2"}"#);
    }
}
