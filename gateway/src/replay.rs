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
//! A replay runs on the replica that accepted it; if that replica stops, the replay stops
//! where it was (its status says `FAILED` once another replica sees the owner gone, and
//! a new replay of the remaining range can be started).

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
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ShardProgress {
    pub from: Seq,
    pub to: Seq,
    pub next: Seq,
}

/// Where replay statuses are kept: this process (standalone) or Redis (any replica sees
/// every replay).
#[async_trait]
pub trait ReplayStore: Send + Sync {
    async fn put(&self, status: &ReplayStatus) -> Result<(), StoreError>;
    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError>;
}

#[derive(Default)]
pub struct LocalReplays {
    all: std::sync::Mutex<BTreeMap<String, ReplayStatus>>,
}

#[async_trait]
impl ReplayStore for LocalReplays {
    async fn put(&self, status: &ReplayStatus) -> Result<(), StoreError> {
        self.all
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(status.id.clone(), status.clone());
        Ok(())
    }

    async fn list(&self) -> Result<Vec<ReplayStatus>, StoreError> {
        Ok(self
            .all
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect())
    }
}

/// `{p}:replays`: a hash, replay id → status JSON.
pub struct RedisReplays {
    redis: Redis,
}

impl RedisReplays {
    pub fn new(redis: Redis) -> RedisReplays {
        RedisReplays { redis }
    }
}

#[async_trait]
impl ReplayStore for RedisReplays {
    async fn put(&self, status: &ReplayStatus) -> Result<(), StoreError> {
        let json = serde_json::to_string(status)
            .map_err(|e| StoreError::Unavailable(format!("replay status: {e}")))?;
        redis::cmd("HSET")
            .arg(self.redis.key(&["replays"]))
            .arg(&status.id)
            .arg(json)
            .query_async::<()>(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis write replay status: {e}")))
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
pub async fn start(
    request: ReplayRequest,
    store: Arc<dyn ReplayStore>,
    worker: &str,
    batch: usize,
    cancel: tokio::sync::watch::Receiver<bool>,
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
    };
    store.put(&status).await?;
    tracing::info!(replay = %status.id, bus = %status.bus, rule = %status.rule, "replay started");
    tokio::spawn(run(request, status.clone(), store, batch, cancel));
    Ok(status)
}

async fn run(
    request: ReplayRequest,
    mut status: ReplayStatus,
    store: Arc<dyn ReplayStore>,
    batch: usize,
    mut cancel: tokio::sync::watch::Receiver<bool>,
) {
    let result = tokio::select! {
        r = replay_all(&request, &mut status, store.as_ref(), batch) => r,
        _ = cancel.wait_for(|c| *c) => Err("cancelled".to_string()),
    };
    match result {
        Ok(()) => status.state = "COMPLETED".to_string(),
        Err(reason) if reason == "cancelled" => status.state = "CANCELLED".to_string(),
        Err(reason) => {
            status.state = "FAILED".to_string();
            status.reason = Some(reason);
        }
    }
    status.changed_ms = crate::store::now_ms();
    tracing::info!(replay = %status.id, state = %status.state, delivered = status.delivered, "replay ended");
    if let Err(e) = store.put(&status).await {
        tracing::warn!(replay = %status.id, error = %e, "cannot record the replay's end");
    }
}

async fn replay_all(
    request: &ReplayRequest,
    status: &mut ReplayStatus,
    store: &dyn ReplayStore,
    batch: usize,
) -> Result<(), String> {
    let shards: Vec<u32> = status.shards.keys().copied().collect();
    for shard in shards {
        let Some(progress) = status.shards.get(&shard).copied() else {
            continue;
        };
        let mut next = progress.next;
        let mut reader = request
            .log
            .reader(shard, next)
            .await
            .map_err(|e| e.to_string())?;
        while next < progress.to {
            let records = reader.read(batch.max(1)).await.map_err(|e| e.to_string())?;
            if records.is_empty() {
                break;
            }
            for sub in &request.subscriptions {
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
            if let Err(e) = store.put(status).await {
                tracing::debug!(replay = %status.id, error = %e, "cannot record the replay's progress");
            }
        }
        if let Some(p) = status.shards.get_mut(&shard) {
            p.next = progress.to;
        }
    }
    Ok(())
}

/// One record as the subscription would deliver it, marked as replayed; `None` when the
/// rule does not take it.
fn replayed(sub: &Subscription, record: &crate::store::Record, id: &str) -> Option<Envelope> {
    let event = crate::ingress::cloudevent::decode(&record.payload).ok()?;
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
        None => (
            crate::ingress::cloudevent::encode(&event).ok()?,
            event,
            None,
        ),
        Some(chain) => match chain.apply(&event).ok()? {
            sluice_functions::Output::Event(mut e) => {
                e.set_extension(REPLAY_EXTENSION, ExtensionValue::String(id.to_string()));
                (crate::ingress::cloudevent::encode(&e).ok()?, e, None)
            }
            sluice_functions::Output::Body {
                content_type,
                bytes,
            } => (
                crate::ingress::cloudevent::encode(&event).ok()?,
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
