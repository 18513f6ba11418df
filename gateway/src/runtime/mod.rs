//! The delivery runtime. Each (rule, target) pair is a subscription; each subscription runs
//! one task per shard of its bus. A task reads its shard from its own position, filters,
//! delivers in order, and records the new position; positions are committed in batches.
//! A failing target stalls only its own subscription.

pub mod delivery;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::DeliveryConfig;
use crate::ingress::cloudevent;
use crate::rules::Matcher;
use crate::store::{BusLog, PositionStore, Seq};
use crate::targets::Envelope;

/// One (rule, target) pair.
pub struct Subscription {
    /// `{bus}/{rule}/{target}`: the key of its positions.
    pub id: String,
    pub bus: String,
    pub matcher: Arc<Matcher>,
    /// The target under its retry policy and dead-letter destination.
    pub delivery: Arc<delivery::Delivery>,
}

pub struct Runtime {
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl Runtime {
    /// Starts every subscription's tasks. A subscription seen for the first time starts at
    /// the current end of its bus (it receives events accepted from now on); its starting
    /// position is committed before this returns, so a crash cannot make it skip events.
    pub async fn start(
        subscriptions: Vec<Subscription>,
        logs: &HashMap<String, Arc<dyn BusLog>>,
        positions: Arc<dyn PositionStore>,
        delivery: DeliveryConfig,
    ) -> Result<Runtime, crate::store::StoreError> {
        let (stop, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        let mut started = Vec::new();
        let mut subscribers = Subscribers::new();
        for sub in subscriptions {
            let Some(log) = logs.get(&sub.bus) else {
                continue;
            };
            for shard in 0..log.shards() {
                if positions.get(&sub.id, shard).is_none() {
                    let tail = *log.tail(shard).borrow();
                    positions.set(&sub.id, shard, tail);
                }
            }
            subscribers
                .entry(sub.bus.clone())
                .or_default()
                .push(sub.id.clone());
            started.push((Arc::new(sub), log.clone()));
        }
        positions.flush().await?;
        for (sub, log) in started {
            for shard in 0..log.shards() {
                let task = Task {
                    sub: sub.clone(),
                    shard,
                    log: log.clone(),
                    positions: positions.clone(),
                    delivery: delivery.clone(),
                    stop: stop.subscribe(),
                };
                tasks.spawn(task.run());
            }
        }
        let housekeeping = Housekeeping {
            logs: logs.clone(),
            positions: positions.clone(),
            interval: delivery.commit_interval,
            stop: stop.subscribe(),
            subscribers,
        };
        tasks.spawn(housekeeping.run());
        Ok(Runtime { tasks, stop })
    }

    /// Stops after each task's current batch, then commits positions.
    pub async fn shutdown(mut self, positions: &dyn PositionStore) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
        if let Err(e) = positions.flush().await {
            tracing::error!(error = %e, "committing positions at shutdown failed");
        }
    }
}

struct Task {
    sub: Arc<Subscription>,
    shard: u32,
    log: Arc<dyn BusLog>,
    positions: Arc<dyn PositionStore>,
    delivery: DeliveryConfig,
    stop: watch::Receiver<bool>,
}

impl Task {
    async fn run(mut self) {
        let sub = self.sub.id.clone();
        let shard = self.shard;
        let mut backoff = self.delivery.initial_backoff;
        'reopen: loop {
            let next = self.positions.get(&sub, shard).unwrap_or(0);
            let mut reader = match self.log.reader(shard, next).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(subscription = %sub, shard, error = %e, "cannot open the shard");
                    if self.pause(&mut backoff).await {
                        return;
                    }
                    continue 'reopen;
                }
            };
            let mut tail = self.log.tail(shard);
            loop {
                if *self.stop.borrow() {
                    return;
                }
                let records = match reader.read(self.delivery.batch_size).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(subscription = %sub, shard, error = %e, "reading the shard failed");
                        if self.pause(&mut backoff).await {
                            return;
                        }
                        continue 'reopen;
                    }
                };
                let Some(last) = records.last().map(|r| r.seq) else {
                    tokio::select! {
                        changed = tail.changed() => if changed.is_err() { return },
                        _ = self.stop.changed() => return,
                    }
                    continue;
                };
                let events = self.select(records);
                if !self.deliver(&events, &mut backoff).await {
                    // Stopped before delivery succeeded: the position stays, the batch is
                    // delivered again after restart.
                    return;
                }
                self.positions.set(&sub, shard, next_after(last));
            }
        }
    }

    /// The records this subscription's rule matches. Events are decoded only when the rule
    /// needs to look inside them.
    fn select(&self, records: Vec<crate::store::Record>) -> Vec<Envelope> {
        if self.sub.matcher.matches_everything() {
            return records
                .into_iter()
                .map(|r| Envelope {
                    raw: r.payload,
                    event: None,
                })
                .collect();
        }
        records
            .into_iter()
            .filter_map(|r| match cloudevent::decode(&r.payload) {
                Ok(event) => self.sub.matcher.matches(&event).then_some(Envelope {
                    raw: r.payload,
                    event: Some(event),
                }),
                Err(e) => {
                    tracing::error!(subscription = %self.sub.id, shard = self.shard, seq = r.seq, error = %e, "a stored event does not decode; skipping it");
                    None
                }
            })
            .collect()
    }

    /// Delivers (retrying, dead-lettering: see `delivery`); false if asked to stop first.
    async fn deliver(&mut self, events: &[Envelope], backoff: &mut Duration) -> bool {
        if events.is_empty() {
            return true;
        }
        tokio::select! {
            () = self.sub.delivery.deliver(events) => {
                *backoff = self.delivery.initial_backoff;
                true
            }
            _ = self.stop.changed() => false,
        }
    }

    /// Waits out the backoff (doubling it for next time); true if asked to stop meanwhile.
    async fn pause(&mut self, backoff: &mut Duration) -> bool {
        let wait = *backoff;
        *backoff = (*backoff * 2).min(self.delivery.max_backoff);
        tokio::select! {
            _ = tokio::time::sleep(wait) => *self.stop.borrow(),
            _ = self.stop.changed() => true,
        }
    }
}

fn next_after(seq: Seq) -> Seq {
    seq + 1
}

/// For each bus, the subscriptions reading it (by id).
type Subscribers = HashMap<String, Vec<String>>;

/// Commits positions on an interval and releases log segments every subscription has passed.
struct Housekeeping {
    logs: HashMap<String, Arc<dyn BusLog>>,
    positions: Arc<dyn PositionStore>,
    interval: Duration,
    stop: watch::Receiver<bool>,
    subscribers: Subscribers,
}

impl Housekeeping {
    async fn run(mut self) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = self.stop.changed() => return,
            }
            if let Err(e) = self.positions.flush().await {
                tracing::error!(error = %e, "committing positions failed; retrying");
                continue;
            }
            // Only committed positions count: after a crash tasks resume from those.
            for (bus, log) in &self.logs {
                let subs = self.subscribers.get(bus).map(Vec::as_slice).unwrap_or(&[]);
                for shard in 0..log.shards() {
                    let min = subs
                        .iter()
                        .map(|s| self.positions.committed(s, shard).unwrap_or(0))
                        .min()
                        .unwrap_or_else(|| *log.tail(shard).borrow());
                    if let Err(e) = log.release(shard, min).await {
                        tracing::warn!(bus, shard, error = %e, "releasing old segments failed");
                    }
                }
            }
        }
    }
}
