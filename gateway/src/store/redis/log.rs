//! Bus logs in Redis: a stream per shard (`{p}:{S}:log`, `S` the shard's tag, see
//! `client::shard_tag`), its sequence counter, the shard count recorded per bus, and the
//! per-shard dedup index and records of `append_unique`, all of a shard in its hash slot.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use redis::{AsyncCommands as _, Script};
use tokio::sync::watch;

use crate::store::redis::client::{redis_error, Redis};
use crate::store::redis::dedup::{
    dedup_name_len, redis_index_cap, redis_record_bytes, REDIS_BOUND,
};
use crate::store::{BusLog, Record, Seq, ShardAppend, ShardReader, StoreError, Unique};

/// Reads a stream from an entry id (inclusive) for at most ARGV[2] entries, stopping once
/// they hold ARGV[3] bytes (so the last may go past it): a byte bound XRANGE lacks. Reads
/// in small steps so that Redis does not build a large reply it would then cut.
const READ: &str = include_str!("lua/read.lua");

/// ARGV: the acceptance time (ms), then the records. Each entry: `e` the event, `t` when it
/// was accepted.
const APPEND: &str = include_str!("lua/append.lua");

/// KEYS: the stream, its counter, the shard's dedup index, then one dedup key per record.
/// ARGV: the acceptance time (ms), the dedup window (ms), the index's cap (records), then
/// the records. Per record: its sequence number, -1 when its key is recorded (a
/// duplicate), -2 when a request holds it (`pending:` reservation of the reserve/confirm
/// path); then the index's size (-1 when nothing was recorded, so it was not looked at)
/// and how many keys it evicted. A record and its dedup key are written together or not
/// at all (a duplicate within one call is caught by the key the first one set), and the
/// key enters the index in the same step, so the bound holds whatever the replicas do
/// (see `store::redis::dedup::REDIS_BOUND`, prepended to this script). The index is looked at
/// only when a key was recorded, and bounded once per call, not per record.
const APPEND_UNIQUE: &str = include_str!("lua/append_unique.lua");

/// The keys of one shard of a bus's log, all in the shard's hash slot.
#[derive(Clone)]
struct ShardKeys {
    /// The stream.
    log: String,
    /// Its sequence counter.
    next: String,
    /// The dedup index: one per shard rather than per bus, so that it lives in the slot
    /// of the stream it is written with, like the dedup records.
    dedup_index: String,
    /// The dedup records' names, without the record's key.
    dedup: String,
}

impl ShardKeys {
    fn of(redis: &Redis, bus: &str, shard: u32) -> ShardKeys {
        ShardKeys {
            log: redis.shard_key(bus, shard, &["log"]),
            next: redis.shard_key(bus, shard, &["next"]),
            dedup_index: redis.shard_key(bus, shard, &["dedup-index"]),
            dedup: redis.shard_key(bus, shard, &["dedup", ""]),
        }
    }
}

/// One bus's log: a Redis stream per shard.
pub struct RedisLog {
    redis: Redis,
    bus: String,
    shards: u32,
    append: Script,
    append_unique: Script,
    read: Arc<Script>,
    /// What this worker knows of each shard's end (its own appends).
    tails: Vec<watch::Sender<Seq>>,
    /// How many dedup keys each shard's index may hold: the process's `max_dedup_bytes`
    /// split between the bus's shards, over the estimated bytes of one record.
    dedup_cap: u64,
    dedup_record_bytes: i64,
    keys: Vec<ShardKeys>,
    /// The dedup gauges of each shard, resolved on the first deduplicated append (buses
    /// without a `dedup_window` get no series).
    dedup_series: Vec<std::sync::OnceLock<crate::metrics::DedupSeries>>,
}

impl RedisLog {
    pub fn new(redis: Redis, bus: &str, shards: u32) -> RedisLog {
        // The longest name of the bus's dedup records (its last shard's).
        let name = dedup_name_len(&redis.shard_key(bus, shards.saturating_sub(1), &["dedup", ""]));
        RedisLog {
            bus: bus.to_string(),
            shards,
            append: Script::new(APPEND),
            append_unique: Script::new(&format!("{REDIS_BOUND}{APPEND_UNIQUE}")),
            read: Arc::new(Script::new(READ)),
            tails: (0..shards).map(|_| watch::Sender::new(0)).collect(),
            dedup_cap: redis_index_cap(&redis, shards, name),
            dedup_record_bytes: i64::try_from(redis_record_bytes(name)).unwrap_or(i64::MAX),
            dedup_series: (0..shards).map(|_| std::sync::OnceLock::new()).collect(),
            keys: (0..shards).map(|s| ShardKeys::of(&redis, bus, s)).collect(),
            redis,
        }
    }

    /// The names of a shard's keys, made once per log (a shard's tag takes a search the
    /// first time, and an append would otherwise format three or four names).
    fn keys(&self, shard: u32) -> std::borrow::Cow<'_, ShardKeys> {
        match self.keys.get(shard as usize) {
            Some(keys) => std::borrow::Cow::Borrowed(keys),
            None => std::borrow::Cow::Owned(ShardKeys::of(&self.redis, &self.bus, shard)),
        }
    }

    /// A dedup record of an event stored on `shard`. A duplicate is recognised on the
    /// shard its partition key picks: the same `partitionkey` (or, without one, the same
    /// id) as the first, which is what a retry sends.
    fn dedup_key(&self, shard: u32, key: &str) -> String {
        format!("{}{key}", self.keys(shard).dedup)
    }

    fn stream(&self, shard: u32) -> String {
        self.keys(shard).log.clone()
    }

    fn counter(&self, shard: u32) -> String {
        self.keys(shard).next.clone()
    }

    /// Runs an append script. With `cluster.redis_durability = "replicated"` it runs on the
    /// replication connection followed by `WAIT` in one pipeline (both go to the node of
    /// the shard's slot), and fails unless enough replicas confirmed it in time: the
    /// records are then in Redis but not acknowledged, and a retry of the producer may
    /// store them again (at least once).
    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T, StoreError> {
        let Some((replication, mut conn)) = self.redis.replication() else {
            return invocation
                .invoke_async::<T>(&mut self.redis.conn())
                .await
                .map_err(|e| redis_error("append", &e));
        };
        let mut pipe = redis::pipe();
        pipe.invoke_script(invocation)
            .cmd("WAIT")
            .arg(replication.min_replicas)
            .arg(
                u64::try_from(replication.timeout.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            );
        let mut answer = pipe.query_async::<(T, i64)>(&mut conn).await;
        if matches!(&answer, Err(e) if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript))
        {
            invocation
                .load_async(&mut conn)
                .await
                .map_err(|e| redis_error("load the append script", &e))?;
            answer = pipe.query_async::<(T, i64)>(&mut conn).await;
        }
        let (value, replicas) = answer.map_err(|e| redis_error("append", &e))?;
        let replicas = u32::try_from(replicas).unwrap_or(0);
        if replicas < replication.min_replicas {
            crate::metrics::get().replication_shortfall.inc();
            return Err(StoreError::Busy(format!(
                "the event reached {replicas} of the {} Redis replicas `cluster.redis_durability = \"replicated\"` asks for within {} ms; it was not acknowledged, retry",
                replication.min_replicas,
                replication.timeout.as_millis()
            )));
        }
        Ok(value)
    }

    /// Moves the known end of a shard forward to `end`.
    fn advance(&self, shard: u32, end: Seq) {
        if let Some(tail) = self.tails.get(shard as usize) {
            tail.send_if_modified(|t| {
                let moved = end > *t;
                if moved {
                    *t = end;
                }
                moved
            });
        }
    }
}

/// Records a bus's shard count unless one is recorded; returns the recorded count.
const RECORD_SHARDS: &str = include_str!("lua/record_shards.lua");

/// What the store knows of the shard count of a bus's log (kept after the bus leaves the
/// catalog, with its events and positions), so a bus name cannot come back with another
/// count while that data exists.
impl RedisLog {
    /// `{p}:bus-shards:{bus}`: the shard count the bus's log was first used with.
    fn shards_key(redis: &Redis, bus: &str) -> String {
        redis.key(&["bus-shards", bus])
    }

    /// Records the shard count of a bus the catalog runs, unless one is recorded already;
    /// returns the recorded count (another count means the log holds keys placed by it).
    pub async fn record_shards(redis: &Redis, bus: &str, shards: u32) -> Result<u32, StoreError> {
        Script::new(RECORD_SHARDS)
            .key(RedisLog::shards_key(redis, bus))
            .arg(shards)
            .invoke_async::<u32>(&mut redis.conn())
            .await
            .map_err(|e| redis_error("record bus shards", &e))
    }

    /// The shard count of an existing log of `bus`, if the store holds one: the recorded
    /// count, else (a log from before counts were recorded, on one server: a cluster never
    /// held one) at least one past the highest shard at or beyond `shards` that has a
    /// sequence counter, a stream or positions.
    pub async fn stored_shards(
        redis: &Redis,
        bus: &str,
        shards: u32,
    ) -> Result<Option<u32>, StoreError> {
        let recorded: Option<u32> = redis
            .conn()
            .get(RedisLog::shards_key(redis, bus))
            .await
            .map_err(|e| redis_error("read bus shards", &e))?;
        if recorded.is_some() {
            return Ok(recorded);
        }
        let beyond: Vec<u32> = (shards..MAX_SHARDS).collect();
        if beyond.is_empty() || redis.is_cluster() {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        for shard in &beyond {
            for part in ["next", "log", "pos"] {
                pipe.exists(redis.shard_key(bus, *shard, &[part]));
            }
        }
        let found: Vec<bool> = pipe
            .query_async(&mut redis.conn())
            .await
            .map_err(|e| redis_error("look for a bus's log", &e))?;
        Ok(found
            .chunks(3)
            .zip(&beyond)
            .filter(|(keys, _)| keys.iter().any(|k| *k))
            .map(|(_, shard)| shard + 1)
            .max())
    }
}

/// The most shards a bus may have (the configuration's bound).
const MAX_SHARDS: u32 = 1024;

fn entry_id(seq: Seq) -> String {
    format!("0-{}", seq + 1)
}

fn seq_of(id: &str) -> Option<Seq> {
    id.strip_prefix("0-")?.parse::<Seq>().ok()?.checked_sub(1)
}

#[async_trait]
impl BusLog for RedisLog {
    fn shards(&self) -> u32 {
        self.shards
    }

    async fn append(&self, appends: Vec<ShardAppend>) -> Vec<Result<Seq, StoreError>> {
        let mut results = Vec::with_capacity(appends.len());
        for append in appends {
            if append.shard >= self.shards {
                results.push(Err(StoreError::Unavailable(format!(
                    "bus `{}` has no shard {}",
                    self.bus, append.shard
                ))));
                continue;
            }
            if let Err(e) = crate::store::check_record_sizes(&append) {
                results.push(Err(e));
                continue;
            }
            let keys = self.keys(append.shard);
            let mut invocation = self.append.prepare_invoke();
            invocation.key(&keys.log).key(&keys.next);
            invocation.arg(crate::store::now_ms());
            for record in &append.records {
                invocation.arg(record.as_ref());
            }
            let started = std::time::Instant::now();
            let result = self.invoke::<Seq>(&invocation).await;
            let metrics = crate::metrics::get();
            metrics.observe_redis("append", started.elapsed(), result.is_ok());
            match &result {
                Ok(_) => {
                    metrics
                        .appended(&self.bus, append.shard)
                        .inc_by(append.records.len() as u64);
                }
                Err(_) => metrics.write_error(&self.bus, append.shard),
            }
            if let Ok(first) = &result {
                self.advance(append.shard, first + append.records.len() as Seq);
            }
            results.push(result);
        }
        results
    }

    async fn append_unique(
        &self,
        shard: u32,
        records: &[(Bytes, &str)],
        window: Duration,
    ) -> Option<Result<Vec<Unique>, StoreError>> {
        if shard >= self.shards {
            return Some(Err(StoreError::Unavailable(format!(
                "bus `{}` has no shard {shard}",
                self.bus
            ))));
        }
        if let Err(e) = records
            .iter()
            .try_for_each(|(r, _)| crate::store::check_record_size(r))
        {
            return Some(Err(e));
        }
        let keys = self.keys(shard);
        let mut invocation = self.append_unique.prepare_invoke();
        invocation
            .key(&keys.log)
            .key(&keys.next)
            .key(&keys.dedup_index);
        for (_, key) in records {
            invocation.key(self.dedup_key(shard, key));
        }
        invocation
            .arg(crate::store::now_ms())
            .arg(u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(self.dedup_cap);
        for (record, _) in records {
            invocation.arg(record.as_ref());
        }
        let started = std::time::Instant::now();
        let result = self.invoke::<Vec<i64>>(&invocation).await;
        let metrics = crate::metrics::get();
        metrics.observe_redis("append", started.elapsed(), result.is_ok());
        let mut answers = match result {
            Ok(answers) if answers.len() == records.len() + 2 => answers,
            Ok(answers) => {
                return Some(Err(StoreError::Corrupt(format!(
                    "redis answered {} results for {} records",
                    answers.len().saturating_sub(2),
                    records.len()
                ))))
            }
            Err(e) => {
                metrics.write_error(&self.bus, shard);
                return Some(Err(e));
            }
        };
        let evicted = answers.pop().unwrap_or(0);
        let size = answers.pop().unwrap_or(-1);
        if evicted > 0 {
            metrics.dedup_evicted.inc_by(evicted.unsigned_abs());
        }
        if size >= 0 {
            if let Some(series) = self.dedup_series.get(shard as usize) {
                let (entries, memory) = series.get_or_init(|| {
                    metrics.dedup_series(&[
                        ("store", "redis"),
                        ("bus", &self.bus),
                        ("shard", &shard.to_string()),
                    ])
                });
                entries.set(size);
                memory.set(size.saturating_mul(self.dedup_record_bytes));
            }
        }
        let out: Vec<Unique> = answers
            .into_iter()
            .map(|a| match a {
                -1 => Unique::Duplicate,
                a if a < 0 => Unique::Busy,
                seq => Unique::Stored(seq as Seq),
            })
            .collect();
        let stored = out.iter().filter_map(|u| match u {
            Unique::Stored(seq) => Some(*seq),
            _ => None,
        });
        let count = stored.clone().count();
        if let Some(last) = stored.max() {
            metrics.appended(&self.bus, shard).inc_by(count as u64);
            self.advance(shard, last + 1);
        }
        Some(Ok(out))
    }

    async fn reader(&self, shard: u32, from: Seq) -> Result<Box<dyn ShardReader>, StoreError> {
        Ok(Box::new(RedisReader {
            redis: self.redis.clone(),
            stream: self.stream(shard),
            next: from,
            blocking: None,
            script: self.read.clone(),
            max_bytes: crate::store::DEFAULT_READ_BYTES,
            idle: false,
        }))
    }

    fn tail(&self, shard: u32) -> watch::Receiver<Seq> {
        match self.tails.get(shard as usize) {
            Some(t) => t.subscribe(),
            None => watch::channel(0).1,
        }
    }

    async fn end(&self, shard: u32) -> Result<Seq, StoreError> {
        self.redis
            .conn()
            .get::<_, Option<Seq>>(self.counter(shard))
            .await
            .map(|n| n.unwrap_or(0))
            .map_err(|e| redis_error("read the shard end", &e))
    }

    async fn start(&self, shard: u32) -> Result<Seq, StoreError> {
        let first: StreamEntries = redis::cmd("XRANGE")
            .arg(self.stream(shard))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .query_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("read the shard start", &e))?;
        Ok(first.first().and_then(|(id, _)| seq_of(id)).unwrap_or(0))
    }

    async fn release(&self, shard: u32, seq: Seq) -> Result<(), StoreError> {
        redis::cmd("XTRIM")
            .arg(self.stream(shard))
            .arg("MINID")
            .arg(entry_id(seq))
            .query_async::<u64>(&mut self.redis.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("trim", &e))
    }

    /// Redis's reachability is the cluster's health (readiness checks it).
    fn healthy(&self) -> bool {
        true
    }
}

struct RedisReader {
    redis: Redis,
    stream: String,
    next: Seq,
    /// The reader's own connection for blocking reads, made on first use.
    blocking: Option<crate::store::redis::client::Conn>,
    script: Arc<Script>,
    /// Most bytes one read returns (the last record may go past it).
    max_bytes: usize,
    /// The last `read_wait` found nothing: the next one blocks at once.
    idle: bool,
}

type StreamEntries = Vec<(String, Vec<(String, Vec<u8>)>)>;

#[async_trait]
impl ShardReader for RedisReader {
    fn set_max_bytes(&mut self, bytes: usize) {
        self.max_bytes = bytes.max(1);
    }

    async fn read(&mut self, max: usize) -> Result<Vec<Record>, StoreError> {
        self.read_bounded(max, self.max_bytes).await
    }

    /// Busy: bounded reads. Idle: one blocking `XREAD` for a single entry (so its reply is
    /// bounded too), then a bounded read for the rest of the batch.
    async fn read_wait(&mut self, max: usize, wait: Duration) -> Result<Vec<Record>, StoreError> {
        if !self.idle {
            let records = self.read(max).await?;
            if !records.is_empty() {
                return Ok(records);
            }
            self.idle = true;
        }
        let mut records = self.read_blocking(wait).await?;
        if let Some(first) = records.first() {
            self.idle = false;
            let used = first.payload.len().max(1);
            if max > 1 && used < self.max_bytes {
                let more = self.read_bounded(max - 1, self.max_bytes - used).await?;
                // Nothing behind it: the next call blocks at once rather than ask again.
                self.idle = more.is_empty();
                records.extend(more);
            }
        }
        Ok(records)
    }
}

impl RedisReader {
    async fn read_bounded(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<Record>, StoreError> {
        let entries: StreamEntries = self
            .script
            .key(&self.stream)
            .arg(entry_id(self.next))
            .arg(max)
            .arg(max_bytes)
            .invoke_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("read", &e))?;
        self.records(entries)
    }

    /// Waits up to `wait` for the next entry.
    async fn read_blocking(&mut self, wait: Duration) -> Result<Vec<Record>, StoreError> {
        let mut conn = match self.blocking.take() {
            Some(conn) => conn,
            None => self.redis.blocking_connection(wait).await?,
        };
        // XREAD answers entries after the id given: `0-{next}` is the entry of seq next-1.
        let reply: Result<Option<Vec<(String, StreamEntries)>>, _> = redis::cmd("XREAD")
            .arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(wait.as_millis().max(1) as u64)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(format!("0-{}", self.next))
            .query_async(&mut conn)
            .await;
        match reply {
            Ok(reply) => {
                self.blocking = Some(conn);
                let entries = reply
                    .into_iter()
                    .flatten()
                    .flat_map(|(_, entries)| entries)
                    .collect();
                self.records(entries)
            }
            // A broken connection is made anew on the next call.
            Err(e) => Err(redis_error("read", &e)),
        }
    }

    fn records(&mut self, entries: StreamEntries) -> Result<Vec<Record>, StoreError> {
        let mut records = Vec::with_capacity(entries.len());
        for (id, fields) in entries {
            let seq = seq_of(&id).ok_or_else(|| {
                StoreError::Corrupt(format!("unexpected entry id {id} in {}", self.stream))
            })?;
            if seq != self.next {
                // Trimmed past our position (it was released): continue at what is there.
                tracing::warn!(stream = %self.stream, expected = self.next, found = seq, "records are missing from the stream");
            }
            let mut payload = None;
            let mut accepted_ms = 0;
            for (name, value) in fields {
                match name.as_str() {
                    "e" => payload = Some(Bytes::from(value)),
                    "t" => {
                        accepted_ms = std::str::from_utf8(&value)
                            .ok()
                            .and_then(|t| t.parse().ok())
                            .unwrap_or(0)
                    }
                    _ => {}
                }
            }
            let payload =
                payload.ok_or_else(|| StoreError::Corrupt(format!("entry {id} has no event")))?;
            records.push(Record {
                seq,
                payload,
                accepted_ms,
            });
            self.next = seq + 1;
        }
        Ok(records)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_ids_map_to_sequence_numbers() {
        assert_eq!(entry_id(0), "0-1");
        assert_eq!(seq_of("0-1"), Some(0));
        assert_eq!(seq_of("0-42"), Some(41));
        assert_eq!(seq_of("0-0"), None);
        assert_eq!(seq_of("1700000000000-0"), None);
    }
}
