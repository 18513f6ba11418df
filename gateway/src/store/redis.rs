//! The distributed store: every shared fact of a cluster in Redis, under one key prefix, so
//! several clusters can share one Redis. The key layout (also in docs/operations.md):
//!
//! ```text
//! {p}:bus:{bus}:{shard}        stream; entry id 0-{seq+1}, field `e` = the stored event
//! {p}:bus:{bus}:{shard}:next   next sequence number of the shard
//! {p}:bus-shards:{bus}         the shard count the bus's log was first used with (kept
//!                              after the bus is deleted, like its streams and positions)
//! {p}:gpos:{bus}:{shard}       hash: positions of the bus shard's subscriptions: `~shared`,
//!                              `~known` (the subscriptions, one per line) and one field per
//!                              subscription that is not at `~shared`
//! {p}:pos:source/{name}@{broker} hash: queue id -> next offset to read (source connectors)
//! {p}:lease:{task}             "{worker}|{epoch}", expires after the lease TTL
//! {p}:epoch:{task}             fencing epoch counter of the task
//! {p}:members                  sorted set: worker id -> last heartbeat (Redis time, ms)
//! {p}:config                   hash: version, digest, toml (buses, rules and sources), versions (JSON: each resource's version)
//! {p}:paused                   set of paused connector and task ids
//! {p}:restarts                 hash: connector or task id -> restart generation
//! {p}:status                   hash: connector or task id -> status JSON
//! {p}:replays                  hash: replay id -> replay status JSON (see `replay`)
//! {p}:notices                  pub/sub channel: join, leave, config and control notices
//! {p}:dedup:{hash}             a dedup record (see `webhooks::dedup`), expiring with its window
//! {p}:dedup-index:{bus}:{shard} sorted set: the dedup keys recorded with the shard's events,
//!                              scored by expiry (ms), held to a share of `max_dedup_bytes`
//! {p}:dedup-index:webhooks     the same for keys of the reserve/confirm path (`RedisDedup`)
//! ```
//!
//! Every multi-step change is one Lua script, so it is atomic; every call has a timeout
//! (the connection manager's response timeout) and the connection is multiplexed.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt as _;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands as _, Script};
use tokio::sync::watch;

use crate::store::cluster::{Cluster, Control, Lease, Status};
use crate::store::{
    BusLog, GroupPositions, PositionStore, Record, Seq, ShardAppend, ShardReader, StoreError,
    Unique,
};

fn redis_error(context: &str, e: &redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis {context}: {e}"))
}

/// A connection to the cluster's Redis and its key prefix.
#[derive(Clone)]
pub struct Redis {
    conn: ConnectionManager,
    client: redis::Client,
    prefix: String,
    timeout: Duration,
    /// `limits.max_dedup_bytes`: every dedup index of this process takes its share of it.
    dedup_bytes: usize,
}

impl Redis {
    /// `url` is `redis://` or, for TLS, `rediss://` (certificates checked against the
    /// platform's roots). Errors show the URL without its password.
    pub async fn connect(url: &str, prefix: &str, timeout: Duration) -> Result<Redis, StoreError> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError::Unavailable(format!(
                "redis url `{}`: {e}",
                crate::config::redact_url(url)
            ))
        })?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        // Lazy: a gateway may start while Redis is down and serve 503s until it is back.
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map_err(|e| redis_error("connect", &e))?;
        Ok(Redis {
            conn,
            client,
            prefix: prefix.to_string(),
            timeout,
            dedup_bytes: crate::webhooks::dedup::DEFAULT_MAX_BYTES,
        })
    }

    /// Bounds the dedup records this handle's logs and dedup store keep in Redis
    /// (`limits.max_dedup_bytes`; the default is [`crate::webhooks::dedup::DEFAULT_MAX_BYTES`]).
    /// Carried by the handle because every bus log is opened from it.
    #[must_use]
    pub fn with_dedup_bytes(mut self, bytes: usize) -> Redis {
        self.dedup_bytes = bytes;
        self
    }

    pub fn dedup_bytes(&self) -> usize {
        self.dedup_bytes
    }

    /// A connection of its own for blocking reads (`XREAD BLOCK`), which would hold up
    /// every other call on the shared multiplexed connection.
    async fn blocking_connection(
        &self,
        block: Duration,
    ) -> Result<redis::aio::MultiplexedConnection, StoreError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(block + self.timeout))
            .set_connection_timeout(Some(self.timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| redis_error("connect", &e))
    }

    pub fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    /// The shared multiplexed connection (webhook deduplication runs its scripts on it).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        redis::cmd("PING")
            .query_async::<String>(&mut self.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("ping", &e))
    }
}

// ---------------------------------------------------------------------------------------
// Bus logs

/// Reads a stream from an entry id (inclusive) for at most ARGV[2] entries, stopping once
/// they hold ARGV[3] bytes (so the last may go past it): a byte bound XRANGE lacks. Reads
/// in small steps so that Redis does not build a large reply it would then cut.
const READ: &str = r"
local start = ARGV[1]
local max = tonumber(ARGV[2])
local budget = tonumber(ARGV[3])
local out = {}
local used = 0
while #out < max and used < budget do
  local want = math.min(max - #out, 32)
  local entries = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', want)
  for i = 1, #entries do
    if used >= budget then
      return out
    end
    local fields = entries[i][2]
    for j = 2, #fields, 2 do
      used = used + #fields[j]
    end
    out[#out + 1] = entries[i]
    start = '(' .. entries[i][1]
  end
  if #entries < want then
    break
  end
end
return out
";

/// ARGV: the acceptance time (ms), then the records. Each entry: `e` the event, `t` when it
/// was accepted.
const APPEND: &str = r"
local n = #ARGV - 1
local last = redis.call('INCRBY', KEYS[2], n)
local first = last - n
for i = 1, n do
  redis.call('XADD', KEYS[1], '0-' .. (first + i), 'e', ARGV[i + 1], 't', ARGV[1])
end
return first
";

/// KEYS: the stream, its counter, the shard's dedup index, then one dedup key per record.
/// ARGV: the acceptance time (ms), the dedup window (ms), the index's cap (records), then
/// the records. Per record: its sequence number, -1 when its key is recorded (a
/// duplicate), -2 when a request holds it (`pending:` reservation of the reserve/confirm
/// path); then the index's size (-1 when nothing was recorded, so it was not looked at)
/// and how many keys it evicted. A record and its dedup key are written together or not
/// at all (a duplicate within one call is caught by the key the first one set), and the
/// key enters the index in the same step, so the bound holds whatever the replicas do
/// (see `webhooks::dedup::REDIS_BOUND`, prepended to this script). The index is looked at
/// only when a key was recorded, and bounded once per call, not per record.
const APPEND_UNIQUE: &str = r"
local now = dedup_now()
local window = tonumber(ARGV[2])
local out = {}
local added = 0
for i = 1, #ARGV - 3 do
  local key = KEYS[i + 3]
  local held = redis.call('GET', key)
  if held == 'done' then
    out[i] = -1
  elseif held then
    out[i] = -2
  else
    local next = redis.call('INCR', KEYS[2])
    redis.call('XADD', KEYS[1], '0-' .. next, 'e', ARGV[i + 3], 't', ARGV[1])
    redis.call('SET', key, 'done', 'PX', ARGV[2])
    redis.call('ZADD', KEYS[3], now + window, key)
    added = added + 1
    out[i] = next - 1
  end
end
local size, evicted = -1, 0
if added > 0 then
  size, evicted = dedup_bound(KEYS[3], now, ARGV[2], tonumber(ARGV[3]))
end
out[#out + 1] = size
out[#out + 1] = evicted
return out
";

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
    /// The dedup gauges of each shard, resolved on the first deduplicated append (buses
    /// without a `dedup_window` get no series).
    dedup_series: Vec<std::sync::OnceLock<crate::metrics::DedupSeries>>,
}

impl RedisLog {
    pub fn new(redis: Redis, bus: &str, shards: u32) -> RedisLog {
        RedisLog {
            bus: bus.to_string(),
            shards,
            append: Script::new(APPEND),
            append_unique: Script::new(&format!(
                "{}{APPEND_UNIQUE}",
                crate::webhooks::dedup::REDIS_BOUND
            )),
            read: Arc::new(Script::new(READ)),
            tails: (0..shards).map(|_| watch::Sender::new(0)).collect(),
            dedup_cap: crate::webhooks::dedup::redis_index_cap(&redis, shards),
            dedup_record_bytes: i64::try_from(crate::webhooks::dedup::redis_record_bytes(&redis))
                .unwrap_or(i64::MAX),
            dedup_series: (0..shards).map(|_| std::sync::OnceLock::new()).collect(),
            redis,
        }
    }

    /// `{p}:dedup-index:{bus}:{shard}`: one index per shard rather than per bus so that,
    /// on Redis Cluster, it can take the shard's hash tag and live in the slot of the
    /// stream it is written with (the dedup keys would take the same tag).
    fn dedup_index(&self, shard: u32) -> String {
        self.redis
            .key(&["dedup-index", &self.bus, &shard.to_string()])
    }

    fn stream(&self, shard: u32) -> String {
        self.redis.key(&["bus", &self.bus, &shard.to_string()])
    }

    fn counter(&self, shard: u32) -> String {
        self.redis
            .key(&["bus", &self.bus, &shard.to_string(), "next"])
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
const RECORD_SHARDS: &str = r"
local recorded = redis.call('GET', KEYS[1])
if recorded then return tonumber(recorded) end
redis.call('SET', KEYS[1], ARGV[1])
return tonumber(ARGV[1])
";

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
    /// count, else (a log from before counts were recorded) at least one past the highest
    /// shard at or beyond `shards` that has a sequence counter, a stream or positions.
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
        if beyond.is_empty() {
            return Ok(None);
        }
        let mut pipe = redis::pipe();
        for shard in &beyond {
            let shard = shard.to_string();
            pipe.exists(redis.key(&["bus", bus, &shard, "next"]))
                .exists(redis.key(&["bus", bus, &shard]))
                .exists(redis.key(&["gpos", bus, &shard]));
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
            let mut invocation = self.append.prepare_invoke();
            invocation
                .key(self.stream(append.shard))
                .key(self.counter(append.shard));
            invocation.arg(crate::store::now_ms());
            for record in &append.records {
                invocation.arg(record.as_ref());
            }
            let started = std::time::Instant::now();
            let result = invocation
                .invoke_async::<Seq>(&mut self.redis.conn())
                .await
                .map_err(|e| redis_error("append", &e));
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
        let mut invocation = self.append_unique.prepare_invoke();
        invocation
            .key(self.stream(shard))
            .key(self.counter(shard))
            .key(self.dedup_index(shard));
        for (_, key) in records {
            // The key the reserve/confirm path (`webhooks::dedup::RedisDedup`) uses.
            invocation.key(self.redis.key(&["dedup", key]));
        }
        invocation
            .arg(crate::store::now_ms())
            .arg(u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1))
            .arg(self.dedup_cap);
        for (record, _) in records {
            invocation.arg(record.as_ref());
        }
        let started = std::time::Instant::now();
        let result = invocation
            .invoke_async::<Vec<i64>>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("append", &e));
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
    blocking: Option<redis::aio::MultiplexedConnection>,
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

// ---------------------------------------------------------------------------------------
// Positions

const COMMIT: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local current = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '-1')
if tonumber(ARGV[3]) > current then redis.call('HSET', KEYS[2], ARGV[2], ARGV[3]) end
return 1
";

/// Commits a bus shard's positions: the changed fields and the removed ones, in one step.
/// ARGV: lease value, number of fields to set, then name/value pairs, then fields to delete.
const COMMIT_GROUP: &str = r"
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
if n > 0 then redis.call('HSET', KEYS[2], unpack(ARGV, 3, 2 + 2 * n)) end
if #ARGV > 2 + 2 * n then redis.call('HDEL', KEYS[2], unpack(ARGV, 3 + 2 * n, #ARGV)) end
return 1
";

const SHARED_FIELD: &str = "~shared";
const KNOWN_FIELD: &str = "~known";

/// Positions in Redis; every commit is checked against the task's lease (fencing).
pub struct RedisPositions {
    redis: Redis,
    worker: String,
    commit: Script,
    commit_group: Script,
    state: Mutex<PositionState>,
}

#[derive(Default)]
struct PositionState {
    pending: HashMap<(String, u32), Seq>,
    /// The lease (task, epoch) each owned position is committed under.
    owners: HashMap<(String, u32), (String, u64)>,
    /// Bus shards run by this worker, by (bus, shard).
    groups: HashMap<(String, u32), GroupState>,
}

#[derive(Default)]
struct GroupState {
    owner: Option<(String, u64)>,
    /// What Redis holds, as last read or committed: commits send only the difference.
    committed: Option<GroupPositions>,
    latest: Option<GroupPositions>,
    /// Bumped by every `set_group`; `committed_version` is the one Redis holds. A flush
    /// looks only at groups whose versions differ, so an idle shard costs nothing per
    /// subscription (comparing whole groups on every commit tick did).
    version: u64,
    committed_version: u64,
}

impl RedisPositions {
    pub fn new(redis: Redis, worker: &str) -> RedisPositions {
        RedisPositions {
            redis,
            worker: worker.to_string(),
            commit: Script::new(COMMIT),
            commit_group: Script::new(COMMIT_GROUP),
            state: Mutex::new(PositionState::default()),
        }
    }

    fn group_hash(&self, bus: &str, shard: u32) -> String {
        self.redis.key(&["gpos", bus, &shard.to_string()])
    }

    /// Commits every bus shard whose positions moved; returns the fenced tasks.
    async fn flush_groups(&self) -> Result<Vec<String>, StoreError> {
        type Work = (
            (String, u32),
            (String, u64),
            Option<GroupPositions>,
            GroupPositions,
            u64,
        );
        let work: Vec<Work> = {
            let state = self.lock();
            state
                .groups
                .iter()
                .filter_map(|(key, g)| {
                    if g.version == g.committed_version {
                        return None;
                    }
                    let latest = g.latest.as_ref()?;
                    let owner = g.owner.clone()?;
                    Some((
                        key.clone(),
                        owner,
                        g.committed.clone(),
                        latest.clone(),
                        g.version,
                    ))
                })
                .collect()
        };
        let mut fenced = Vec::new();
        for ((bus, shard), (task, epoch), committed, latest, version) in work {
            let (set, del) = group_diff(committed.as_ref(), &latest);
            if set.is_empty() && del.is_empty() {
                if let Some(g) = self.lock().groups.get_mut(&(bus, shard)) {
                    g.committed_version = version;
                }
                continue;
            }
            let mut invocation = self.commit_group.prepare_invoke();
            invocation
                .key(self.redis.key(&["lease", &task]))
                .key(self.group_hash(&bus, shard))
                .arg(format!("{}|{epoch}", self.worker))
                .arg(set.len());
            for (field, value) in &set {
                invocation.arg(field).arg(value);
            }
            for field in &del {
                invocation.arg(field);
            }
            match invocation
                .invoke_async::<i64>(&mut self.redis.conn())
                .await
                .map_err(|e| redis_error("commit positions", &e))?
            {
                1 => {
                    if let Some(g) = self.lock().groups.get_mut(&(bus, shard)) {
                        g.committed = Some(latest);
                        g.committed_version = version;
                    }
                }
                _ => fenced.push(task),
            }
        }
        Ok(fenced)
    }
}

/// The fields to set and to delete to turn `from` (what Redis holds) into `to`.
fn group_diff(
    from: Option<&GroupPositions>,
    to: &GroupPositions,
) -> (Vec<(String, String)>, Vec<String>) {
    let empty = GroupPositions::default();
    let from = from.unwrap_or(&empty);
    let mut set = Vec::new();
    let mut del = Vec::new();
    if to.shared != from.shared {
        match to.shared {
            Some(seq) => set.push((SHARED_FIELD.to_string(), seq.to_string())),
            None => del.push(SHARED_FIELD.to_string()),
        }
    }
    if to.known != from.known {
        let known: Vec<&str> = to.known.iter().map(String::as_str).collect();
        set.push((KNOWN_FIELD.to_string(), known.join("\n")));
    }
    for (name, seq) in &to.own {
        if from.own.get(name) != Some(seq) {
            set.push((name.clone(), seq.to_string()));
        }
    }
    for name in from.own.keys() {
        if !to.own.contains_key(name) {
            del.push(name.clone());
        }
    }
    (set, del)
}

fn parse_group(fields: HashMap<String, String>) -> Result<GroupPositions, StoreError> {
    let mut group = GroupPositions::default();
    let number = |field: &str, value: &str| {
        value.parse::<Seq>().map_err(|_| {
            StoreError::Corrupt(format!("position `{field}` is not a number: {value}"))
        })
    };
    for (field, value) in fields {
        match field.as_str() {
            SHARED_FIELD => group.shared = Some(number(&field, &value)?),
            KNOWN_FIELD => {
                group.known = Arc::new(
                    value
                        .split('\n')
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect(),
                );
            }
            _ => {
                let seq = number(&field, &value)?;
                group.own.insert(field, seq);
            }
        }
    }
    Ok(group)
}

impl RedisPositions {
    fn lock(&self) -> std::sync::MutexGuard<'_, PositionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hash(&self, subscription: &str) -> String {
        self.redis.key(&["pos", subscription])
    }
}

#[async_trait]
impl PositionStore for RedisPositions {
    async fn load(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        self.committed(subscription, shard).await
    }

    async fn init(&self, subscription: &str, shard: u32, next: Seq) -> Result<(), StoreError> {
        self.redis
            .conn()
            .hset_nx::<_, _, _, ()>(self.hash(subscription), shard, next)
            .await
            .map_err(|e| redis_error("init position", &e))
    }

    fn set(&self, subscription: &str, shard: u32, next: Seq) {
        self.lock()
            .pending
            .insert((subscription.to_string(), shard), next);
    }

    fn own(&self, subscription: &str, shard: u32, lease: &Lease) {
        self.lock().owners.insert(
            (subscription.to_string(), shard),
            (lease.task.clone(), lease.epoch),
        );
    }

    fn disown(&self, task: &str) {
        let mut state = self.lock();
        let gone: Vec<(String, u32)> = state
            .owners
            .iter()
            .filter(|(_, (t, _))| t == task)
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            state.owners.remove(&key);
            state.pending.remove(&key);
        }
        state
            .groups
            .retain(|_, g| g.owner.as_ref().is_none_or(|(t, _)| t != task));
    }

    async fn peek_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        let fields: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.group_hash(bus, shard))
            .await
            .map_err(|e| redis_error("read positions", &e))?;
        parse_group(fields)
    }

    async fn load_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        let fields: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.group_hash(bus, shard))
            .await
            .map_err(|e| redis_error("read positions", &e))?;
        let group = parse_group(fields)?;
        let mut state = self.lock();
        let g = state.groups.entry((bus.to_string(), shard)).or_default();
        g.committed = Some(group.clone());
        g.latest = None;
        g.committed_version = g.version;
        Ok(group)
    }

    fn own_group(&self, bus: &str, shard: u32, lease: &Lease) {
        self.lock()
            .groups
            .entry((bus.to_string(), shard))
            .or_default()
            .owner = Some((lease.task.clone(), lease.epoch));
    }

    fn set_group(&self, bus: &str, shard: u32, positions: GroupPositions) {
        let mut state = self.lock();
        let g = state.groups.entry((bus.to_string(), shard)).or_default();
        g.latest = Some(positions);
        g.version += 1;
    }

    fn committed_min(&self, bus: &str, shard: u32) -> Option<Seq> {
        self.lock()
            .groups
            .get(&(bus.to_string(), shard))?
            .committed
            .as_ref()?
            .min()
    }

    fn committed_group(&self, bus: &str, shard: u32) -> Option<GroupPositions> {
        self.lock()
            .groups
            .get(&(bus.to_string(), shard))?
            .committed
            .clone()
    }

    async fn flush(&self) -> Result<Vec<String>, StoreError> {
        let mut fenced = self.flush_groups().await?;
        let batch: Vec<((String, u32), Seq, Option<(String, u64)>)> = {
            let mut state = self.lock();
            let pending = std::mem::take(&mut state.pending);
            pending
                .into_iter()
                .map(|(key, seq)| {
                    let owner = state.owners.get(&key).cloned();
                    (key, seq, owner)
                })
                .collect()
        };
        let mut batch = batch.into_iter();
        while let Some(((sub, shard), seq, owner)) = batch.next() {
            // Progress of a task this worker no longer runs is never committed.
            let Some((task, epoch)) = owner else {
                fenced.push(crate::store::cluster::task_id(&sub, shard));
                continue;
            };
            let result = self
                .commit
                .key(self.redis.key(&["lease", &task]))
                .key(self.hash(&sub))
                .arg(format!("{}|{epoch}", self.worker))
                .arg(shard)
                .arg(seq)
                .invoke_async::<i64>(&mut self.redis.conn())
                .await;
            match result {
                Ok(1) => {}
                Ok(_) => fenced.push(task),
                Err(e) => {
                    // Keep this one and every one not tried yet for the next flush, unless
                    // a newer position arrived meanwhile: a dropped position would leave
                    // the committed one behind until the shard moves again, and a takeover
                    // would re-send everything since.
                    let mut state = self.lock();
                    state.pending.entry((sub, shard)).or_insert(seq);
                    for (key, seq, _) in batch {
                        state.pending.entry(key).or_insert(seq);
                    }
                    return Err(redis_error("commit position", &e));
                }
            }
        }
        fenced.sort();
        fenced.dedup();
        Ok(fenced)
    }

    async fn committed(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        self.redis
            .conn()
            .hget::<_, _, Option<Seq>>(self.hash(subscription), shard)
            .await
            .map_err(|e| redis_error("read position", &e))
    }
}

// ---------------------------------------------------------------------------------------
// Cluster: membership, leases, control, status, notices

const HEARTBEAT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local added = redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
if added == 1 then redis.call('PUBLISH', KEYS[2], 'join:' .. ARGV[1]) end
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[2]), '+inf')
";

const MEMBERS: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf')
";

const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  local owner = string.match(current, '^(.*)|%d+$')
  if owner ~= ARGV[1] then return -1 end
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. epoch, 'PX', ARGV[2])
return epoch
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// Renews many leases at once. ARGV: the TTL, then one lease value per key.
const RENEW_ALL: &str = r"
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[i + 1] then
    redis.call('PEXPIRE', key, ARGV[1])
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
";

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub heartbeat: Duration,
    /// A worker that has not heartbeated for this long is gone.
    pub member_ttl: Duration,
    pub lease_ttl: Duration,
}

pub struct RedisCluster {
    redis: Redis,
    id: String,
    options: ClusterOptions,
    notices: watch::Sender<u64>,
    healthy: Arc<AtomicBool>,
    scripts: Scripts,
    stop: watch::Sender<bool>,
}

struct Scripts {
    heartbeat: Script,
    members: Script,
    acquire: Script,
    renew: Script,
    renew_all: Script,
    release: Script,
}

impl RedisCluster {
    /// Joins the cluster: starts heartbeating and listening for notices.
    pub fn join(redis: Redis, id: &str, options: ClusterOptions) -> Arc<RedisCluster> {
        let cluster = Arc::new(RedisCluster {
            redis,
            id: id.to_string(),
            options,
            notices: watch::Sender::new(0),
            healthy: Arc::new(AtomicBool::new(false)),
            scripts: Scripts {
                heartbeat: Script::new(HEARTBEAT),
                members: Script::new(MEMBERS),
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                renew_all: Script::new(RENEW_ALL),
                release: Script::new(RELEASE),
            },
            stop: watch::Sender::new(false),
        });
        tokio::spawn(heartbeat_loop(cluster.clone()));
        tokio::spawn(notice_loop(cluster.clone()));
        cluster
    }

    fn channel(&self) -> String {
        self.redis.key(&["notices"])
    }

    fn notify_local(&self) {
        self.notices.send_modify(|n| *n += 1);
    }

    async fn publish(&self, message: &str) -> Result<(), StoreError> {
        self.redis
            .conn()
            .publish::<_, _, i64>(self.channel(), message)
            .await
            .map(|_| ())
            .map_err(|e| redis_error("publish", &e))
    }

    fn lease_value(&self, lease: &Lease) -> String {
        format!("{}|{}", self.id, lease.epoch)
    }

    /// The stored catalog: its version and id, the TOML of its buses, rules and sources,
    /// and the version of each resource (JSON). `None` when nothing is stored yet.
    pub async fn load_catalog(&self) -> Result<Option<crate::catalog::Stored>, StoreError> {
        let map: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.redis.key(&["config"]))
            .await
            .map_err(|e| redis_error("read config", &e))?;
        let (Some(version), Some(text)) = (
            map.get("version").and_then(|v| v.parse().ok()),
            map.get("toml"),
        ) else {
            return Ok(None);
        };
        let versions = map
            .get("versions")
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or_default();
        Ok(Some(crate::catalog::Stored {
            version,
            id: map.get("id").and_then(|v| v.parse().ok()).unwrap_or(0),
            text: text.clone(),
            versions,
        }))
    }

    /// The version and id of the stored catalog (two fields, whatever its size).
    pub async fn catalog_head(&self) -> Result<Option<crate::catalog::Head>, StoreError> {
        let (version, id): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(self.redis.key(&["config"]))
            .arg("version")
            .arg("id")
            .query_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("read config version", &e))?;
        Ok(version
            .and_then(|v| v.parse().ok())
            .map(|version| crate::catalog::Head {
                version,
                id: id.and_then(|v| v.parse().ok()).unwrap_or(0),
            }))
    }

    pub async fn config_version(&self) -> Result<u64, StoreError> {
        self.redis
            .conn()
            .hget::<_, _, Option<u64>>(self.redis.key(&["config"]), "version")
            .await
            .map(|v| v.unwrap_or(0))
            .map_err(|e| redis_error("read config version", &e))
    }

    /// Stores `next` if the stored catalog is still `expected`, version and id (a version
    /// alone would let a writer that read before a restore from a backup win after it):
    /// `Ok(())`, or `Err(the stored head)` when another writer came first. Every change is
    /// announced to all workers.
    pub async fn store_catalog(
        &self,
        expected: crate::catalog::Head,
        next: crate::catalog::Head,
        text: &str,
        versions: &str,
    ) -> Result<Result<(), crate::catalog::Head>, StoreError> {
        // Ids are compared as text (Lua numbers are doubles); a catalog written before ids
        // existed has none, which `expected` spells as an empty id.
        const STORE: &str = r"
local held = redis.call('HMGET', KEYS[1], 'version', 'id')
local version = held[1] or '0'
local id = held[2] or ''
if version ~= ARGV[1] or id ~= ARGV[2] then return {'0', version, id} end
redis.call('HSET', KEYS[1], 'version', ARGV[3], 'id', ARGV[4], 'digest', ARGV[5], 'toml', ARGV[6], 'versions', ARGV[7])
redis.call('PUBLISH', KEYS[2], 'config:' .. ARGV[3])
return {'1'}
";
        let id_text = |id: u64| {
            if id == 0 {
                String::new()
            } else {
                id.to_string()
            }
        };
        let digest = format!(
            "{:016x}",
            crate::runtime::rebalance::stable_hash(text.as_bytes())
        );
        let answer = Script::new(STORE)
            .key(self.redis.key(&["config"]))
            .key(self.channel())
            .arg(expected.version)
            .arg(id_text(expected.id))
            .arg(next.version)
            .arg(id_text(next.id))
            .arg(digest)
            .arg(text)
            .arg(versions)
            .invoke_async::<Vec<String>>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("store config", &e))?;
        Ok(match answer.as_slice() {
            [done] if done == "1" => Ok(()),
            [_, version, id] => Err(crate::catalog::Head {
                version: version.parse().unwrap_or(0),
                id: id.parse().unwrap_or(0),
            }),
            _ => {
                return Err(StoreError::Corrupt(format!(
                    "redis answered {answer:?} to a catalog write"
                )))
            }
        })
    }
}

async fn heartbeat_loop(cluster: Arc<RedisCluster>) {
    let mut stop = cluster.stop.subscribe();
    let mut tick = tokio::time::interval(cluster.options.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut known: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let result = cluster
            .scripts
            .heartbeat
            .key(cluster.redis.key(&["members"]))
            .key(cluster.channel())
            .arg(&cluster.id)
            .arg(cluster.options.member_ttl.as_millis() as u64)
            .invoke_async::<Vec<String>>(&mut cluster.redis.conn())
            .await;
        match result {
            Ok(mut members) => {
                if !cluster.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(worker = %cluster.id, "connected to the cluster");
                    cluster.notify_local();
                }
                members.sort();
                // Members that stop heartbeating leave no notice: notice it here.
                if members != known {
                    known = members;
                    cluster.notify_local();
                }
            }
            Err(e) => {
                if cluster.healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(worker = %cluster.id, error = %e, "lost the cluster store");
                }
            }
        }
    }
}

async fn notice_loop(cluster: Arc<RedisCluster>) {
    let mut stop = cluster.stop.subscribe();
    let mut backoff = Duration::from_millis(100);
    loop {
        let subscribed = async {
            let mut pubsub = cluster.redis.client.get_async_pubsub().await?;
            pubsub.subscribe(cluster.channel()).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(pubsub) => {
                backoff = Duration::from_millis(100);
                // Notices may have been missed while not subscribed.
                cluster.notify_local();
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        message = messages.next() => match message {
                            Some(_) => cluster.notify_local(),
                            None => break,
                        },
                        _ = stop.changed() => return,
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot subscribe to notices"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[async_trait]
impl Cluster for RedisCluster {
    fn worker_id(&self) -> &str {
        &self.id
    }

    fn lease_ttl(&self) -> Duration {
        self.options.lease_ttl
    }

    fn notices(&self) -> watch::Receiver<u64> {
        self.notices.subscribe()
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    async fn members(&self) -> Result<Vec<String>, StoreError> {
        self.scripts
            .members
            .key(self.redis.key(&["members"]))
            .arg(self.options.member_ttl.as_millis() as u64)
            .invoke_async::<Vec<String>>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("members", &e))
    }

    async fn acquire(&self, task: &str) -> Result<Option<Lease>, StoreError> {
        let epoch = self
            .scripts
            .acquire
            .key(self.redis.key(&["lease", task]))
            .key(self.redis.key(&["epoch", task]))
            .arg(&self.id)
            .arg(self.options.lease_ttl.as_millis() as u64)
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("acquire lease", &e))?;
        Ok(u64::try_from(epoch).ok().map(|epoch| Lease {
            task: task.to_string(),
            epoch,
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<bool, StoreError> {
        self.scripts
            .renew
            .key(self.redis.key(&["lease", &lease.task]))
            .arg(self.lease_value(lease))
            .arg(self.options.lease_ttl.as_millis() as u64)
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map(|r| r == 1)
            .map_err(|e| redis_error("renew lease", &e))
    }

    async fn renew_all(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let mut invocation = self.scripts.renew_all.prepare_invoke();
        invocation.arg(self.options.lease_ttl.as_millis() as u64);
        for lease in leases {
            invocation
                .key(self.redis.key(&["lease", &lease.task]))
                .arg(self.lease_value(lease));
        }
        let held: Vec<i64> = invocation
            .invoke_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("renew leases", &e))?;
        Ok(held.into_iter().map(|h| h == 1).collect())
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.scripts
            .release
            .key(self.redis.key(&["lease", &lease.task]))
            .arg(self.lease_value(lease))
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("release lease", &e))
    }

    async fn control(&self) -> Result<Control, StoreError> {
        let mut conn = self.redis.conn();
        let paused: HashSet<String> = conn
            .smembers(self.redis.key(&["paused"]))
            .await
            .map_err(|e| redis_error("read paused", &e))?;
        let restarts: HashMap<String, u64> = conn
            .hgetall(self.redis.key(&["restarts"]))
            .await
            .map_err(|e| redis_error("read restarts", &e))?;
        Ok(Control { paused, restarts })
    }

    async fn set_paused(&self, id: &str, paused: bool) -> Result<(), StoreError> {
        let key = self.redis.key(&["paused"]);
        let mut conn = self.redis.conn();
        let result = if paused {
            conn.sadd::<_, _, i64>(key, id).await
        } else {
            conn.srem::<_, _, i64>(key, id).await
        };
        result.map_err(|e| redis_error("pause", &e))?;
        self.publish("control").await
    }

    async fn request_restart(&self, id: &str) -> Result<(), StoreError> {
        self.redis
            .conn()
            .hincr::<_, _, _, i64>(self.redis.key(&["restarts"]), id, 1)
            .await
            .map_err(|e| redis_error("restart", &e))?;
        self.publish("control").await
    }

    async fn set_status(&self, status: Status) -> Result<(), StoreError> {
        let json = serde_json::to_string(&status)
            .map_err(|e| StoreError::Unavailable(format!("encode status: {e}")))?;
        self.redis
            .conn()
            .hset::<_, _, _, i64>(self.redis.key(&["status"]), &status.id, json)
            .await
            .map(|_| ())
            .map_err(|e| redis_error("write status", &e))
    }

    async fn set_statuses(&self, statuses: Vec<Status>) -> Result<(), StoreError> {
        if statuses.is_empty() {
            return Ok(());
        }
        let mut fields = Vec::with_capacity(statuses.len());
        for status in &statuses {
            let json = serde_json::to_string(status)
                .map_err(|e| StoreError::Unavailable(format!("encode status: {e}")))?;
            fields.push((status.id.as_str(), json));
        }
        // Large sets (thousands of subscriptions) go in slices to keep each call short.
        for chunk in fields.chunks(1000) {
            self.redis
                .conn()
                .hset_multiple::<_, _, _, ()>(self.redis.key(&["status"]), chunk)
                .await
                .map_err(|e| redis_error("write status", &e))?;
        }
        Ok(())
    }

    async fn statuses(&self) -> Result<Vec<Status>, StoreError> {
        let map: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.redis.key(&["status"]))
            .await
            .map_err(|e| redis_error("read status", &e))?;
        let mut statuses: Vec<Status> = map
            .values()
            .filter_map(|json| serde_json::from_str(json).ok())
            .collect();
        statuses.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(statuses)
    }

    async fn heartbeats(&self) -> Result<Vec<(String, u64)>, StoreError> {
        const AGES: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local r = redis.call('ZRANGEBYSCORE', KEYS[1], now - tonumber(ARGV[1]), '+inf', 'WITHSCORES')
local out = {}
for i = 1, #r, 2 do
  out[#out + 1] = r[i]
  out[#out + 1] = tostring(math.max(0, now - tonumber(r[i + 1])))
end
return out
";
        let flat: Vec<String> = Script::new(AGES)
            .key(self.redis.key(&["members"]))
            .arg(self.options.member_ttl.as_millis() as u64)
            .invoke_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("read heartbeats", &e))?;
        Ok(flat
            .chunks(2)
            .filter_map(|pair| match pair {
                [id, age] => Some((id.clone(), age.parse().unwrap_or(0))),
                _ => None,
            })
            .collect())
    }

    async fn forget(&self, ids: &[String]) -> Result<(), StoreError> {
        for chunk in ids.chunks(1000) {
            let mut pipe = redis::pipe();
            pipe.hdel(self.redis.key(&["status"]), chunk)
                .ignore()
                .srem(self.redis.key(&["paused"]), chunk)
                .ignore()
                .hdel(self.redis.key(&["restarts"]), chunk)
                .ignore();
            pipe.query_async::<()>(&mut self.redis.conn())
                .await
                .map_err(|e| redis_error("forget statuses", &e))?;
        }
        Ok(())
    }

    async fn leave(&self) {
        let _ = self.stop.send(true);
        let removed = self
            .redis
            .conn()
            .zrem::<_, _, i64>(self.redis.key(&["members"]), &self.id)
            .await;
        if removed.is_ok() {
            let _ = self.publish(&format!("leave:{}", self.id)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_positions_are_committed_as_differences() {
        let from = GroupPositions {
            shared: Some(10),
            own: [("a/t".to_string(), 3), ("b/t".to_string(), 5)]
                .into_iter()
                .collect(),
            known: Arc::new(
                ["a/t", "b/t", "c/t"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            ),
        };
        let to = GroupPositions {
            shared: Some(20),
            own: [("a/t".to_string(), 3), ("c/t".to_string(), 25)]
                .into_iter()
                .collect(),
            known: from.known.clone(),
        };
        let (set, del) = group_diff(Some(&from), &to);
        assert_eq!(
            set,
            vec![
                ("~shared".to_string(), "20".to_string()),
                ("c/t".to_string(), "25".to_string())
            ]
        );
        assert_eq!(del, vec!["b/t".to_string()]);
        // What Redis then holds reads back as `to`.
        let mut fields: HashMap<String, String> = HashMap::new();
        let (all, _) = group_diff(None, &to);
        fields.extend(all);
        assert_eq!(parse_group(fields).unwrap(), to);
        assert!(parse_group([("~shared".to_string(), "x".to_string())].into()).is_err());
    }

    #[test]
    fn entry_ids_map_to_sequence_numbers() {
        assert_eq!(entry_id(0), "0-1");
        assert_eq!(seq_of("0-1"), Some(0));
        assert_eq!(seq_of("0-42"), Some(41));
        assert_eq!(seq_of("0-0"), None);
        assert_eq!(seq_of("1700000000000-0"), None);
    }
}
