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
use cloudevents::Event;
use serde::{Deserialize, Serialize};

use crate::runtime::{Plan, Subscription};
use crate::store::redis::{Redis, RedisReplayStatuses, ReplayPut};
use crate::store::search::first_after;
use crate::store::{BusLog, Seq, StoreError};
use crate::targets::Envelope;

/// The extension every replayed event carries: the replay's id.
pub const REPLAY_EXTENSION: &str = "sluicereplay";

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

/// Replay statuses in the cluster's Redis (`store::redis::RedisReplayStatuses`: the hash
/// `{p}:replays`, replay id → status JSON, and its conditional writes).
pub struct RedisReplays {
    statuses: RedisReplayStatuses,
}

impl RedisReplays {
    pub fn new(redis: Redis) -> RedisReplays {
        RedisReplays {
            statuses: RedisReplayStatuses::new(redis),
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
        let answer = self
            .statuses
            .put(&status.id, &to_json(status)?, &status.worker)
            .await?;
        Ok(match answer {
            ReplayPut::Kept => Recorded::Kept,
            ReplayPut::Moved => Recorded::Moved,
            ReplayPut::Ended => Recorded::Ended,
        })
    }

    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError> {
        let all = self.statuses.list().await?;
        Ok(all
            .iter()
            .filter_map(|json| serde_json::from_str(json).ok())
            .collect())
    }

    async fn swap(&self, old: &ReplayStatus, new: &ReplayStatus) -> Result<bool, StoreError> {
        // The stored JSON is what `put` wrote: serde writes the same fields in the same
        // order, so the status read back and written again compares equal.
        self.statuses
            .swap(&old.id, &to_json(old)?, &to_json(new)?)
            .await
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
                let events = taken(sub, &records, progress.to);
                status.matched += events.len() as u64;
                if events.is_empty() {
                    continue;
                }
                let (envelopes, refused) = marked(sub, events, &status.id)
                    .await
                    .map_err(Stop::Failed)?;
                for (envelope, why) in &refused {
                    sub.delivery.reject(envelope, why).await;
                }
                if !envelopes.is_empty() {
                    sub.delivery.deliver(&envelopes).await;
                    status.delivered += envelopes.len() as u64;
                }
                status.delivered += refused.len() as u64;
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
    adopter: Adopter,
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
        if let Err(e) = adopt_once(&adopter).await {
            tracing::debug!(error = %e, "cannot look for replays to take over");
        }
    }
}

/// What taking over orphaned replays needs: where statuses are kept, the cancel switches
/// of the replays running here, the cluster, the running plan and the batch size.
pub struct Adopter {
    pub store: Arc<dyn ReplayStore>,
    pub cancels: Arc<Cancels>,
    pub cluster: Arc<dyn crate::store::cluster::Cluster>,
    pub plans: tokio::sync::watch::Receiver<Arc<Plan>>,
    pub batch: usize,
}

async fn adopt_once(state: &Adopter) -> Result<(), StoreError> {
    let plan = state.plans.borrow().clone();
    let store = state.store.clone();
    let me = state.cluster.worker_id();
    let mine = |id: &str| {
        state
            .cancels
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
        let cancelled = register(&state.cancels, &new.id);
        tokio::spawn(run(
            subscriptions,
            log,
            new,
            store.clone(),
            state.batch,
            cancelled,
        ));
    }
    Ok(())
}

/// The events a replay reads that the subscription's rule takes.
fn taken(sub: &Subscription, records: &[crate::store::Record], to: Seq) -> Vec<Event> {
    records
        .iter()
        .filter(|r| r.seq < to)
        .filter_map(|r| crate::event::decode(&r.payload).ok())
        .filter(|event| sub.filter.matches(event))
        .collect()
}

/// The events as the subscription delivers them, marked with the replay's id `id`: its
/// transform chain applied, user functions included (on a blocking thread, once they are
/// loaded), and the events the chain refused, with why (as live delivery, they go to the
/// dead-letter destination). An error when a function the chain calls cannot be loaded.
pub async fn marked(
    sub: &Subscription,
    events: Vec<Event>,
    id: &str,
) -> Result<crate::runtime::chain::Ran, String> {
    let mark = |event: &mut Event| {
        event.set_extension(REPLAY_EXTENSION, ExtensionValue::String(id.to_string()));
    };
    // Replayed events are not live: their age (for `max_event_age`) counts from the replay,
    // and they stay out of the live latency histogram.
    let envelope = |event: Event| -> Result<Envelope, String> {
        let raw = crate::event::encode(&event).map_err(|e| format!("cannot encode: {e}"))?;
        Ok(Envelope {
            raw: raw.into(),
            accepted_ms: 0,
            event: Some(event),
            body: None,
        })
    };
    let mut inputs = Vec::with_capacity(events.len());
    for mut event in events {
        mark(&mut event);
        inputs.push(envelope(event)?);
    }
    let Some(chain) = &sub.transform else {
        return Ok((inputs, Vec::new()));
    };
    if chain.calls_functions() {
        // The sender stays here while the functions run: a replay stops by being dropped.
        let (_running, stop) = tokio::sync::watch::channel(false);
        let (ready, refused) = crate::runtime::chain::through_functions(chain, inputs, stop)
            .await?
            .ok_or("the functions' registry is closing")?;
        // Events a function made carry the mark too (it may not have kept it).
        let ready = ready
            .into_iter()
            .map(|mut e| {
                match e.event.as_mut() {
                    Some(event)
                        if e.body.is_none() && event.extension(REPLAY_EXTENSION).is_none() =>
                    {
                        mark(event);
                        if let Ok(raw) = crate::event::encode(event) {
                            e.raw = raw.into();
                        }
                    }
                    _ => {}
                }
                e
            })
            .collect();
        return Ok((ready, refused));
    }
    let mut ready = Vec::with_capacity(inputs.len());
    let mut refused = Vec::new();
    for input in inputs {
        let Some(event) = input.event.as_ref() else {
            continue;
        };
        match chain.apply(event) {
            Ok(sluice_functions::Output::Event(mut e)) => {
                mark(&mut e);
                ready.push(envelope(e)?);
            }
            Ok(sluice_functions::Output::Body {
                content_type,
                bytes,
            }) => ready.push(Envelope {
                body: Some(crate::targets::Body {
                    content_type,
                    bytes: bytes.into(),
                }),
                ..input
            }),
            Err(e) => refused.push((input, e.to_string())),
        }
    }
    Ok((ready, refused))
}

#[cfg(test)]
mod tests {
    use super::*;

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
