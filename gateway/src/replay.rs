//! Archive and replay: a bus keeps its events for `retention` after acceptance (even once
//! every subscription has passed them), and a replay re-delivers the events of a time
//! range (or of given positions) to one rule, or one target of it, without touching live
//! delivery.
//!
//! A replay is a connector of its own: it reads each shard of the bus from the first
//! event accepted at or after `from` to the last accepted before `to` (found by binary
//! search over acceptance times, which grow along a shard), applies the rule's condition
//! and each target's transform chain, and delivers through the target's own retry policy
//! and dead-letter destination. Every replayed event carries the `sluicereplay`
//! extension (the replay's id). Its positions and counts are its own and are recorded in
//! the cluster store, so any replica shows its status.
//!
//! A replay runs on the replica that accepted it. Its status names that worker and every
//! progress record is a compare-and-set on it: in distributed mode, when that worker
//! leaves the cluster (killed, or its heartbeat lapsed), another replica claims the replay
//! (one compare-and-set on the status, so exactly one wins) and resumes it from the
//! positions last recorded per shard; the batch in flight at the kill may come again
//! (at least once, like live delivery). A worker that comes back after its replay was
//! claimed finds its next record refused and stops. A cancel through any replica marks
//! the status, and the worker running it stops at its next record. Standalone, replay
//! statuses live in the process and end with it.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use cloudevents::event::ExtensionValue;
use serde::{Deserialize, Serialize};

use crate::runtime::{Plan, Subscription};
use crate::store::redis::Redis;
use crate::store::{BusLog, Seq, StoreError};
use crate::targets::Envelope;

/// The extension every replayed event carries: the replay's id.
pub const REPLAY_EXTENSION: &str = "sluicereplay";

/// The first seq in `[lo, hi)` whose record was accepted after `cutoff_ms` (`hi` if none):
/// every record below it was accepted at or before the cutoff. Acceptance times grow along
/// a shard; records stored without one count as old.
pub async fn first_after(
    log: &dyn BusLog,
    shard: u32,
    mut lo: Seq,
    mut hi: Seq,
    cutoff_ms: u64,
) -> Result<Seq, StoreError> {
    let end = hi;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let mut reader = log.reader(shard, mid).await?;
        let record = reader.read(1).await?.into_iter().next();
        match record {
            // Trimmed up to `seq`: the record found stands for everything before it.
            Some(r) if r.accepted_ms <= cutoff_ms => lo = r.seq.max(mid) + 1,
            Some(_) => hi = mid,
            None => hi = mid,
        }
    }
    Ok(lo.min(end))
}

/// The passed records of a shard that a size retention keeps: the newest `max_bytes` of
/// them. Each record is counted once, as it is passed, into chunks of about 1/64 of the
/// bound; the boundary is the first chunk of the newest chunks that fit, so what is kept
/// lies within one chunk below the bound. A window that has not yet counted everything up
/// to the committed position (a new owner, a large backlog) only errs on keeping more.
#[derive(Debug, Default)]
pub struct SizeWindow {
    /// Records below it are counted (`None`: not started; it starts at the log's start).
    scanned: Option<Seq>,
    /// First seq and bytes of each chunk, oldest first.
    chunks: std::collections::VecDeque<(Seq, u64)>,
    total: u64,
}

/// At most this much is read per shard per release round, so counting a large backlog
/// never holds the worker loop long.
const SIZE_SCAN_BUDGET: u64 = 256 * 1024 * 1024;

impl SizeWindow {
    /// Counts the records passed up to `upto` and returns the position below which
    /// records may go (everything from it to `upto` fits in `max_bytes`).
    pub async fn advance(
        &mut self,
        log: &dyn BusLog,
        shard: u32,
        upto: Seq,
        max_bytes: u64,
    ) -> Result<Seq, StoreError> {
        if self.scanned.is_some_and(|scanned| upto < scanned) {
            // Positions went back (a reset): count again.
            *self = SizeWindow::default();
        }
        let mut scanned = match self.scanned {
            Some(scanned) => scanned,
            None => log.start(shard).await?.min(upto),
        };
        let chunk_limit = (max_bytes / 64).max(1);
        let mut read = 0u64;
        if scanned < upto {
            let mut reader = log.reader(shard, scanned).await?;
            'scan: while scanned < upto && read < SIZE_SCAN_BUDGET {
                let records = reader.read(512).await?;
                if records.is_empty() {
                    break;
                }
                for record in records {
                    if record.seq >= upto {
                        break 'scan;
                    }
                    let size = record.payload.len() as u64;
                    read += size;
                    match self.chunks.back_mut() {
                        Some(last) if last.1 + size <= chunk_limit => last.1 += size,
                        _ => self.chunks.push_back((record.seq, size)),
                    }
                    self.total += size;
                    scanned = record.seq + 1;
                }
            }
        }
        self.scanned = Some(scanned);
        while self.total > max_bytes {
            let Some((_, bytes)) = self.chunks.pop_front() else {
                break;
            };
            self.total -= bytes;
        }
        Ok(self.chunks.front().map_or(scanned, |c| c.0))
    }
}

/// What a replay re-delivers and how far it got.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplayStatus {
    pub id: String,
    pub bus: String,
    pub rule: String,
    /// The targets replayed to (all of the rule's, or the one asked for).
    pub targets: Vec<String>,
    /// The acceptance-time range, ms since the Unix epoch (`to` exclusive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to_ms: Option<u64>,
    /// `RUNNING`, `COMPLETED`, `FAILED` or `CANCELLED`.
    pub state: String,
    pub worker: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Per shard: the range read and the next position.
    pub shards: BTreeMap<u32, ShardProgress>,
    /// Events read in the range, matched by the rule, delivered (or dead-lettered).
    pub read: u64,
    pub matched: u64,
    pub delivered: u64,
    pub created_ms: u64,
    pub changed_ms: u64,
    /// How many times another worker took the replay over.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub takeovers: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ShardProgress {
    pub from: Seq,
    pub to: Seq,
    pub next: Seq,
}

/// What recording a replay's status found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    /// Recorded: the replay is still this worker's and running.
    Kept,
    /// Not recorded: another worker claimed the replay.
    Moved,
    /// Not recorded: the replay was cancelled or ended meanwhile.
    Ended,
}

/// Where replay statuses are kept: this process (standalone) or Redis (any replica sees
/// every replay). Writes are conditional, so a replay has one runner at a time.
#[async_trait]
pub trait ReplayStore: Send + Sync {
    /// Records the status of a replay this worker (`status.worker`) runs: a new one, or
    /// one whose stored status still names this worker and is `RUNNING`.
    async fn put(&self, status: &ReplayStatus) -> Result<Recorded, StoreError>;
    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError>;
    /// Replaces `old` by `new` if the stored status is still exactly `old`.
    async fn swap(&self, old: &ReplayStatus, new: &ReplayStatus) -> Result<bool, StoreError>;
}

/// Whether `status` may be written over `stored` by its worker.
fn writable(stored: Option<&ReplayStatus>, status: &ReplayStatus) -> Recorded {
    match stored {
        None => Recorded::Kept,
        Some(s) if s.worker != status.worker => Recorded::Moved,
        Some(s) if s.state != "RUNNING" => Recorded::Ended,
        Some(_) => Recorded::Kept,
    }
}

#[derive(Default)]
pub struct LocalReplays {
    all: std::sync::Mutex<BTreeMap<String, ReplayStatus>>,
}

impl LocalReplays {
    fn all(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, ReplayStatus>> {
        self.all.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[async_trait]
impl ReplayStore for LocalReplays {
    async fn put(&self, status: &ReplayStatus) -> Result<Recorded, StoreError> {
        let mut all = self.all();
        let verdict = writable(all.get(&status.id), status);
        if verdict == Recorded::Kept {
            all.insert(status.id.clone(), status.clone());
        }
        Ok(verdict)
    }

    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError> {
        Ok(self.all().values().cloned().collect())
    }

    async fn swap(&self, old: &ReplayStatus, new: &ReplayStatus) -> Result<bool, StoreError> {
        let mut all = self.all();
        let same = match all.get(&old.id) {
            Some(stored) => serde_json::to_string(stored).ok() == serde_json::to_string(old).ok(),
            None => false,
        };
        if same {
            all.insert(new.id.clone(), new.clone());
        }
        Ok(same)
    }
}

/// `{p}:replays`: a hash, replay id → status JSON.
pub struct RedisReplays {
    redis: Redis,
    put: redis::Script,
    swap: redis::Script,
}

/// KEYS[1] the hash, ARGV: id, status JSON, worker. 1 recorded, 0 another worker's, 2 no
/// longer running.
const PUT: &str = r#"
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, s = pcall(cjson.decode, cur)
  if ok and type(s) == 'table' then
    if s.worker ~= ARGV[3] then return 0 end
    if s.state ~= 'RUNNING' then return 2 end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"#;

/// KEYS[1] the hash, ARGV: id, the status JSON expected, the new one.
const SWAP: &str = r#"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
"#;

impl RedisReplays {
    pub fn new(redis: Redis) -> RedisReplays {
        RedisReplays {
            redis,
            put: redis::Script::new(PUT),
            swap: redis::Script::new(SWAP),
        }
    }
}

fn to_json(status: &ReplayStatus) -> Result<String, StoreError> {
    serde_json::to_string(status)
        .map_err(|e| StoreError::Unavailable(format!("replay status: {e}")))
}

#[async_trait]
impl ReplayStore for RedisReplays {
    async fn put(&self, status: &ReplayStatus) -> Result<Recorded, StoreError> {
        let answer: i64 = self
            .put
            .key(self.redis.key(&["replays"]))
            .arg(&status.id)
            .arg(to_json(status)?)
            .arg(&status.worker)
            .invoke_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis write replay status: {e}")))?;
        Ok(match answer {
            1 => Recorded::Kept,
            0 => Recorded::Moved,
            _ => Recorded::Ended,
        })
    }

    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError> {
        let all: Vec<String> = redis::cmd("HVALS")
            .arg(self.redis.key(&["replays"]))
            .query_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis read replay statuses: {e}")))?;
        Ok(all
            .iter()
            .filter_map(|json| serde_json::from_str(json).ok())
            .collect())
    }

    async fn swap(&self, old: &ReplayStatus, new: &ReplayStatus) -> Result<bool, StoreError> {
        // The stored JSON is what `put` wrote: serde writes the same fields in the same
        // order, so the status read back and written again compares equal.
        let answer: i64 = self
            .swap
            .key(self.redis.key(&["replays"]))
            .arg(&old.id)
            .arg(to_json(old)?)
            .arg(to_json(new)?)
            .invoke_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis swap replay status: {e}")))?;
        Ok(answer == 1)
    }
}

/// Marks a running replay `CANCELLED` in the store (for one that runs on another worker:
/// that worker stops at its next progress record). `None` when there is no such replay.
pub async fn cancel_anywhere(
    store: &dyn ReplayStore,
    id: &str,
    by: &str,
) -> Result<Option<ReplayStatus>, StoreError> {
    for _ in 0..10 {
        let Some(old) = store.list().await?.into_iter().find(|r| r.id == id) else {
            return Ok(None);
        };
        if old.state != "RUNNING" {
            return Ok(Some(old));
        }
        let mut new = old.clone();
        new.state = "CANCELLED".to_string();
        new.reason = Some(format!("cancelled through worker `{by}`"));
        new.changed_ms = crate::store::now_ms();
        if store.swap(&old, &new).await? {
            return Ok(Some(new));
        }
    }
    Err(StoreError::Unavailable(
        "the replay's status kept changing; try again".to_string(),
    ))
}

/// A replay to start: what the API checked.
pub struct ReplayRequest {
    pub bus: String,
    pub rule: String,
    pub subscriptions: Vec<Arc<Subscription>>,
    pub log: Arc<dyn BusLog>,
    pub from_ms: Option<u64>,
    pub to_ms: Option<u64>,
    /// Explicit positions per shard (`[from, to)`), instead of times.
    pub positions: Option<BTreeMap<u32, (Seq, Seq)>>,
}

/// The subscriptions of `bus/rule` (or of one of its targets) in the running plan.
pub fn subscriptions(
    plan: &Plan,
    bus: &str,
    rule: &str,
    target: Option<&str>,
) -> Vec<Arc<Subscription>> {
    let Some(bus) = plan.buses.get(bus) else {
        return Vec::new();
    };
    bus.subscriptions
        .iter()
        .filter(|s| {
            let (r, t) = s.name.split_once('/').unwrap_or((&s.name, ""));
            r == rule && target.is_none_or(|want| want == t)
        })
        .cloned()
        .collect()
}

/// Plans the shard ranges of a replay and starts it in the background. Returns its first
/// status (already stored).
/// The replays this process runs (or ran): id → what cancels it. A `RUNNING` replay that
/// names this worker but is not here was started by an earlier process with the same
/// worker id, and is taken over like any orphan.
pub type Cancels =
    std::sync::Mutex<std::collections::HashMap<String, tokio::sync::watch::Sender<bool>>>;

fn register(cancels: &Cancels, id: &str) -> tokio::sync::watch::Receiver<bool> {
    let (cancel, cancelled) = tokio::sync::watch::channel(false);
    cancels
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id.to_string(), cancel);
    cancelled
}

pub async fn start(
    request: ReplayRequest,
    store: Arc<dyn ReplayStore>,
    worker: &str,
    batch: usize,
    cancels: &Cancels,
) -> Result<ReplayStatus, StoreError> {
    let now = crate::store::now_ms();
    let id = format!("{}-{:04x}", now, fastrand::u16(..));
    let mut shards = BTreeMap::new();
    for shard in 0..request.log.shards() {
        let end = request.log.end(shard).await?;
        let (from, to) = match &request.positions {
            Some(p) => match p.get(&shard) {
                Some((from, to)) => (*from, (*to).min(end)),
                None => continue,
            },
            None => {
                let from = match request.from_ms {
                    Some(ms) => {
                        first_after(request.log.as_ref(), shard, 0, end, ms.saturating_sub(1))
                            .await?
                    }
                    None => 0,
                };
                let to = match request.to_ms {
                    Some(ms) => {
                        first_after(request.log.as_ref(), shard, from, end, ms.saturating_sub(1))
                            .await?
                    }
                    None => end,
                };
                (from, to)
            }
        };
        shards.insert(
            shard,
            ShardProgress {
                from,
                to,
                next: from,
            },
        );
    }
    let status = ReplayStatus {
        id,
        bus: request.bus.clone(),
        rule: request.rule.clone(),
        targets: request
            .subscriptions
            .iter()
            .map(|s| {
                s.name
                    .split_once('/')
                    .map_or(s.name.clone(), |(_, t)| t.to_string())
            })
            .collect(),
        from_ms: request.from_ms,
        to_ms: request.to_ms,
        state: "RUNNING".to_string(),
        worker: worker.to_string(),
        reason: None,
        shards,
        read: 0,
        matched: 0,
        delivered: 0,
        created_ms: now,
        changed_ms: now,
        takeovers: 0,
    };
    // Registered before it is recorded, so it is never mistaken for an orphan here.
    let cancel = register(cancels, &status.id);
    if let Err(e) = store.put(&status).await {
        cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&status.id);
        return Err(e);
    }
    tracing::info!(replay = %status.id, bus = %status.bus, rule = %status.rule, "replay started");
    tokio::spawn(run(
        request.subscriptions,
        request.log,
        status.clone(),
        store,
        batch,
        cancel,
    ));
    Ok(status)
}

/// How a replay's run stopped before its end.
enum Stop {
    Cancelled,
    /// Another worker claimed it, or it was cancelled through another worker: the stored
    /// status is no longer this worker's to write.
    Released(Recorded),
    Failed(String),
}

async fn run(
    subscriptions: Vec<Arc<Subscription>>,
    log: Arc<dyn BusLog>,
    mut status: ReplayStatus,
    store: Arc<dyn ReplayStore>,
    batch: usize,
    mut cancel: tokio::sync::watch::Receiver<bool>,
) {
    let result = tokio::select! {
        r = replay_all(&subscriptions, log.as_ref(), &mut status, store.as_ref(), batch) => r,
        _ = cancel.wait_for(|c| *c) => Err(Stop::Cancelled),
    };
    match result {
        Ok(()) => status.state = "COMPLETED".to_string(),
        Err(Stop::Cancelled) => status.state = "CANCELLED".to_string(),
        Err(Stop::Failed(reason)) => {
            status.state = "FAILED".to_string();
            status.reason = Some(reason);
        }
        Err(Stop::Released(why)) => {
            let why = if why == Recorded::Moved {
                "another worker took it over"
            } else {
                "it was cancelled or ended elsewhere"
            };
            tracing::warn!(replay = %status.id, "replay stopped here: {why}");
            return;
        }
    }
    status.changed_ms = crate::store::now_ms();
    tracing::info!(replay = %status.id, state = %status.state, delivered = status.delivered, "replay ended");
    match store.put(&status).await {
        Ok(Recorded::Kept) => {}
        Ok(_) => {
            tracing::warn!(replay = %status.id, "the replay's end was not recorded: another worker holds it")
        }
        Err(e) => tracing::warn!(replay = %status.id, error = %e, "cannot record the replay's end"),
    }
}

async fn replay_all(
    subscriptions: &[Arc<Subscription>],
    log: &dyn BusLog,
    status: &mut ReplayStatus,
    store: &dyn ReplayStore,
    batch: usize,
) -> Result<(), Stop> {
    let shards: Vec<u32> = status.shards.keys().copied().collect();
    let failed = |e: StoreError| Stop::Failed(e.to_string());
    for shard in shards {
        let Some(progress) = status.shards.get(&shard).copied() else {
            continue;
        };
        let mut next = progress.next;
        if next >= progress.to {
            continue;
        }
        let mut reader = log.reader(shard, next).await.map_err(failed)?;
        while next < progress.to {
            let records = reader.read(batch.max(1)).await.map_err(failed)?;
            if records.is_empty() {
                break;
            }
            for sub in subscriptions {
                let mut envelopes = Vec::new();
                for record in records.iter().filter(|r| r.seq < progress.to) {
                    if let Some(envelope) = replayed(sub, record, &status.id) {
                        envelopes.push(envelope);
                    }
                }
                status.matched += envelopes.len() as u64;
                if !envelopes.is_empty() {
                    sub.delivery.deliver(&envelopes).await;
                    status.delivered += envelopes.len() as u64;
                }
            }
            let in_range = records.iter().filter(|r| r.seq < progress.to).count();
            status.read += in_range as u64;
            next = records.last().map_or(next, |r| r.seq + 1).min(progress.to);
            if let Some(p) = status.shards.get_mut(&shard) {
                p.next = next;
            }
            status.changed_ms = crate::store::now_ms();
            match store.put(status).await {
                Ok(Recorded::Kept) => {}
                Ok(other) => return Err(Stop::Released(other)),
                Err(e) => {
                    tracing::debug!(replay = %status.id, error = %e, "cannot record the replay's progress")
                }
            }
        }
        if let Some(p) = status.shards.get_mut(&shard) {
            p.next = progress.to;
        }
    }
    Ok(())
}

/// Takes over, every `every`, the running replays whose worker left the cluster (distributed
/// mode): one compare-and-set on each status, so one replica wins; the winner resumes it
/// from the positions recorded per shard.
pub async fn adopt_orphans(
    state: Arc<crate::ingress::IngressState>,
    every: std::time::Duration,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        // Jitter, so replicas do not all try at the same instant.
        let wait = every + std::time::Duration::from_millis(fastrand::u64(0..500));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        if let Err(e) = adopt_once(&state).await {
            tracing::debug!(error = %e, "cannot look for replays to take over");
        }
    }
}

async fn adopt_once(state: &Arc<crate::ingress::IngressState>) -> Result<(), StoreError> {
    let (Some(plan), Some((_, admin))) = (state.plan(), state.admin()) else {
        return Ok(());
    };
    let store = state
        .replays
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let me = state.cluster.worker_id();
    let mine = |id: &str| {
        state
            .replay_cancels
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(id)
    };
    let orphans: Vec<ReplayStatus> = {
        let all = store.list().await?;
        if !all
            .iter()
            .any(|r| r.state == "RUNNING" && (r.worker != me || !mine(&r.id)))
        {
            return Ok(());
        }
        let members = state.cluster.members().await?;
        all.into_iter()
            .filter(|r| {
                r.state == "RUNNING"
                    && if r.worker == me {
                        // An earlier process with this worker id (a fixed `worker_id`).
                        !mine(&r.id)
                    } else {
                        !members.contains(&r.worker)
                    }
            })
            .collect()
    };
    for old in orphans {
        let mut new = old.clone();
        new.worker = me.to_string();
        new.takeovers += 1;
        new.changed_ms = crate::store::now_ms();
        let log = plan.buses.get(&old.bus).map(|b| b.log.clone());
        let subscriptions: Vec<Arc<Subscription>> = subscriptions(&plan, &old.bus, &old.rule, None)
            .into_iter()
            .filter(|s| {
                let target = s.name.split_once('/').map_or("", |(_, t)| t);
                old.targets.iter().any(|t| t == target)
            })
            .collect();
        let Some(log) = log.filter(|_| !subscriptions.is_empty()) else {
            new.state = "FAILED".to_string();
            new.reason = Some(format!(
                "worker `{}`, which ran it, left the cluster, and its rule or targets no longer exist",
                old.worker
            ));
            store.swap(&old, &new).await?;
            continue;
        };
        if !store.swap(&old, &new).await? {
            continue;
        }
        tracing::info!(replay = %new.id, from = %old.worker, "took over a replay whose worker left the cluster (or an earlier process with this worker id)");
        let cancelled = register(&state.replay_cancels, &new.id);
        tokio::spawn(run(
            subscriptions,
            log,
            new,
            store.clone(),
            admin.replay_batch,
            cancelled,
        ));
    }
    Ok(())
}

/// One record as the subscription would deliver it, marked as replayed; `None` when the
/// rule does not take it.
fn replayed(sub: &Subscription, record: &crate::store::Record, id: &str) -> Option<Envelope> {
    let event = crate::event::decode(&record.payload).ok()?;
    if !sub.filter.matches(&event) {
        return None;
    }
    marked(sub, event, id)
}

/// The event as the subscription delivers it (its transform chain applied), marked with
/// the replay's id.
pub fn marked(sub: &Subscription, mut event: cloudevents::Event, id: &str) -> Option<Envelope> {
    event.set_extension(REPLAY_EXTENSION, ExtensionValue::String(id.to_string()));
    let (raw, event, body) = match &sub.transform {
        None => (crate::event::encode(&event).ok()?, event, None),
        Some(chain) => match chain.apply(&event).ok()? {
            sluice_functions::Output::Event(mut e) => {
                e.set_extension(REPLAY_EXTENSION, ExtensionValue::String(id.to_string()));
                (crate::event::encode(&e).ok()?, e, None)
            }
            sluice_functions::Output::Body {
                content_type,
                bytes,
            } => (
                crate::event::encode(&event).ok()?,
                event,
                Some(crate::targets::Body {
                    content_type,
                    bytes: bytes.into(),
                }),
            ),
        },
    };
    // Replayed events are not live: their age (for `max_event_age`) counts from the replay,
    // and they stay out of the live latency histogram.
    Some(Envelope {
        raw: raw.into(),
        accepted_ms: 0,
        event: Some(event),
        body,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Durability;
    use crate::store::embedded::{DataDir, LogOptions};
    use crate::store::ShardAppend;
    use bytes::Bytes;

    async fn log_with(
        dir: &std::path::Path,
        records: usize,
        size: usize,
    ) -> (DataDir, Arc<dyn BusLog>) {
        let data = DataDir::open(dir).unwrap();
        let options = LogOptions {
            durability: Durability::Os,
            // Small segments, so a release deletes some of them.
            segment_bytes: 4096,
            cache_bytes: 1024,
        };
        let log: Arc<dyn BusLog> = Arc::new(data.open_bus("b", 1, &options).unwrap());
        // Ten records per append, so the log rolls segments as it goes.
        for first in (0..records).step_by(10) {
            let appends = vec![ShardAppend {
                shard: 0,
                records: (first..(first + 10).min(records))
                    .map(|i| Bytes::from(format!("{i:0size$}")))
                    .collect(),
            }];
            for r in log.append(appends).await {
                r.unwrap();
            }
        }
        (data, log)
    }

    #[tokio::test]
    async fn a_size_window_keeps_the_newest_bytes_of_what_was_passed() {
        let dir = tempfile::tempdir().unwrap();
        let (_data, log) = log_with(dir.path(), 1000, 100).await;
        let mut window = SizeWindow::default();
        // Nothing passed yet: nothing may go.
        assert_eq!(window.advance(log.as_ref(), 0, 0, 10_000).await.unwrap(), 0);
        // 500 records of 100 bytes passed, 10,000 bytes kept: the newest 100 records (to
        // within one chunk of 10,000 / 64 bytes, i.e. one record).
        let boundary = window.advance(log.as_ref(), 0, 500, 10_000).await.unwrap();
        assert!((400..=401).contains(&boundary), "{boundary}");
        // Counting goes on from where it was; the bound holds as more is passed.
        let boundary = window.advance(log.as_ref(), 0, 1000, 10_000).await.unwrap();
        assert!((900..=901).contains(&boundary), "{boundary}");
        log.release(0, boundary).await.unwrap();
        assert!(log.start(0).await.unwrap() > 0, "old segments were deleted");
        // A new owner counts from the log's start without going below what it holds.
        let mut fresh = SizeWindow::default();
        let again = fresh.advance(log.as_ref(), 0, 1000, 10_000).await.unwrap();
        assert!((900..=901).contains(&again), "{again}");
        // A bound smaller than one record keeps nothing.
        let mut tiny = SizeWindow::default();
        assert_eq!(tiny.advance(log.as_ref(), 0, 1000, 50).await.unwrap(), 1000);
    }

    #[tokio::test]
    async fn replay_statuses_have_one_writer_at_a_time() {
        let store = LocalReplays::default();
        let mut status = ReplayStatus {
            id: "r1".into(),
            bus: "b".into(),
            rule: "r".into(),
            targets: vec!["t".into()],
            from_ms: None,
            to_ms: None,
            state: "RUNNING".into(),
            worker: "w1".into(),
            reason: None,
            shards: BTreeMap::new(),
            read: 0,
            matched: 0,
            delivered: 0,
            created_ms: 1,
            changed_ms: 1,
            takeovers: 0,
        };
        assert_eq!(store.put(&status).await.unwrap(), Recorded::Kept);
        // Another worker claims it with a compare-and-set on what it read.
        let mut claimed = status.clone();
        claimed.worker = "w2".into();
        claimed.takeovers = 1;
        assert!(store.swap(&status, &claimed).await.unwrap());
        // A second claim of the same old status loses.
        assert!(!store.swap(&status, &claimed).await.unwrap());
        // The first worker's next record is refused: it stops.
        status.read = 5;
        assert_eq!(store.put(&status).await.unwrap(), Recorded::Moved);
        // A cancel through any worker ends the new owner's run at its next record.
        let cancelled = cancel_anywhere(&store, "r1", "w3").await.unwrap().unwrap();
        assert_eq!(cancelled.state, "CANCELLED");
        assert_eq!(store.put(&claimed).await.unwrap(), Recorded::Ended);
        assert!(cancel_anywhere(&store, "nope", "w3")
            .await
            .unwrap()
            .is_none());
    }
}
