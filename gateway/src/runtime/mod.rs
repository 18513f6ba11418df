//! The delivery runtime, after RocketMQ Connect's worker. Each (rule, target) pair is a
//! subscription (a connector); each shard of its bus is a task. Source connectors are
//! connectors too, split into their own tasks. A worker runs a reconcile loop on every
//! change notice and on a tick: it computes the assignment of all tasks over the live
//! workers with the configured strategy, takes a lease for each of its own tasks before
//! starting it, renews its leases, stops what moved away, and commits positions in fenced
//! batches. A task reads its shard from its position, filters, delivers in order and
//! records the new position; a failing target stalls only its own subscription.

pub mod cluster;
pub mod delivery;
pub mod rebalance;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::DeliveryConfig;
use crate::ingress::cloudevent;
use crate::rules::Filter;
use crate::sources::{Source, SourceTask};
use crate::store::{BusLog, PositionStore, Record, Seq, StoreError};
use crate::targets::{Body, Envelope, Target};
use cluster::{now_ms, task_id, Cluster, Control, Lease, State};
use rebalance::Strategy;
use sluice_functions::{Output, TransformChain};

/// One (rule, target) pair.
pub struct Subscription {
    /// `{bus}/{rule}/{target}`: the key of its positions and status.
    pub id: String,
    pub bus: String,
    pub filter: Arc<Filter>,
    /// Applied to each matched event before the target.
    pub transform: Option<TransformChain>,
    pub target: Arc<dyn Target>,
    /// The target under its retry policy and dead-letter destination.
    pub delivery: Arc<delivery::Delivery>,
}

/// What the workers run, built from one version of the configuration.
pub struct Plan {
    pub version: u64,
    pub subscriptions: Vec<Arc<Subscription>>,
    pub sources: Vec<Arc<Source>>,
    pub logs: HashMap<String, Arc<dyn BusLog>>,
}

/// What a task does: deliver one shard of a subscription, or run one part of a source.
#[derive(Clone)]
enum TaskKind {
    Deliver { sub: Arc<Subscription>, shard: u32 },
    Source { source: Arc<Source>, index: u32 },
}

impl TaskKind {
    /// The connector the task belongs to (pause, restart and status go by it).
    fn connector(&self) -> &str {
        match self {
            TaskKind::Deliver { sub, .. } => &sub.id,
            TaskKind::Source { source, .. } => &source.id,
        }
    }
}

impl Plan {
    /// Every task of the plan by task id.
    fn tasks(&self) -> BTreeMap<String, TaskKind> {
        let mut tasks = BTreeMap::new();
        for sub in &self.subscriptions {
            if let Some(log) = self.logs.get(&sub.bus) {
                for shard in 0..log.shards() {
                    tasks.insert(
                        task_id(&sub.id, shard),
                        TaskKind::Deliver {
                            sub: sub.clone(),
                            shard,
                        },
                    );
                }
            }
        }
        for source in &self.sources {
            for index in 0..source.config.tasks() {
                tasks.insert(
                    task_id(&source.id, index),
                    TaskKind::Source {
                        source: source.clone(),
                        index,
                    },
                );
            }
        }
        tasks
    }

    /// Every connector id: subscriptions and sources.
    fn connectors(&self) -> impl Iterator<Item = &str> {
        self.subscriptions
            .iter()
            .map(|s| s.id.as_str())
            .chain(self.sources.iter().map(|s| s.id.as_str()))
    }

    /// Gives every subscription without a position the current end of its bus, so it
    /// delivers exactly the events accepted from its creation on.
    pub async fn init_positions(&self, positions: &dyn PositionStore) -> Result<(), StoreError> {
        for sub in &self.subscriptions {
            if let Some(log) = self.logs.get(&sub.bus) {
                for shard in 0..log.shards() {
                    let end = log.end(shard).await?;
                    positions.init(&sub.id, shard, end).await?;
                }
            }
        }
        Ok(())
    }
}

#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub delivery: DeliveryConfig,
    pub strategy: Strategy,
    /// The rebalance tick (change notices can be lost; the tick catches up).
    pub tick: Duration,
}

pub struct Worker {
    stop: watch::Sender<bool>,
    plan: Arc<watch::Sender<Arc<Plan>>>,
    handle: JoinHandle<()>,
}

impl Worker {
    pub fn start(
        cluster: Arc<dyn Cluster>,
        positions: Arc<dyn PositionStore>,
        plan: Arc<Plan>,
        options: WorkerOptions,
    ) -> Worker {
        let (stop, stop_rx) = watch::channel(false);
        let (plan_tx, plan_rx) = watch::channel(plan);
        let state = WorkerLoop {
            cluster,
            positions,
            options,
            plan: plan_rx,
            stop: stop_rx,
            running: HashMap::new(),
        };
        Worker {
            stop,
            plan: Arc::new(plan_tx),
            handle: tokio::spawn(state.run()),
        }
    }

    /// Where to send a new configuration version; tasks restart with their new definitions.
    pub fn plan_sender(&self) -> Arc<watch::Sender<Arc<Plan>>> {
        self.plan.clone()
    }

    /// Stops every task after its current batch, commits positions and releases leases.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.handle.await {
            tracing::error!(error = %e, "the worker loop failed");
        }
    }
}

struct Running {
    kind: TaskKind,
    lease: Lease,
    plan_version: u64,
    generation: u64,
    /// Until when (ms since the epoch) the lease is surely still ours.
    valid_until: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    handle: JoinHandle<()>,
}

struct WorkerLoop {
    cluster: Arc<dyn Cluster>,
    positions: Arc<dyn PositionStore>,
    options: WorkerOptions,
    plan: watch::Receiver<Arc<Plan>>,
    stop: watch::Receiver<bool>,
    running: HashMap<String, Running>,
}

impl WorkerLoop {
    async fn run(mut self) {
        let ttl = self.cluster.lease_ttl();
        let mut notices = self.cluster.notices();
        let mut tick = tokio::time::interval(self.options.tick);
        let mut renew = tokio::time::interval((ttl / 3).max(Duration::from_millis(100)));
        let mut commit = tokio::time::interval(self.options.delivery.commit_interval);
        let mut housekeeping = tokio::time::interval(Duration::from_secs(5));
        for t in [&mut tick, &mut renew, &mut commit, &mut housekeeping] {
            t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        }
        loop {
            tokio::select! {
                _ = self.stop.changed() => break,
                _ = tick.tick() => self.reconcile().await,
                changed = notices.changed() => {
                    if changed.is_ok() {
                        self.reconcile().await;
                    }
                }
                changed = self.plan.changed() => {
                    if changed.is_ok() {
                        self.reconcile().await;
                    }
                }
                _ = renew.tick() => self.renew().await,
                _ = commit.tick() => self.commit().await,
                _ = housekeeping.tick() => self.release_passed_segments().await,
            }
        }
        let ids: Vec<String> = self.running.keys().cloned().collect();
        self.stop_tasks(&ids, State::Unassigned).await;
        self.cluster.leave().await;
    }

    async fn reconcile(&mut self) {
        let members = match self.cluster.members().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the member list; keeping the current tasks until their leases lapse");
                return;
            }
        };
        let control = match self.cluster.control().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read control state");
                return;
            }
        };
        let plan = self.plan.borrow().clone();
        let tasks = plan.tasks();
        let ids: Vec<String> = tasks.keys().cloned().collect();
        let owners = rebalance::assign(self.options.strategy, &members, &ids);
        let me = self.cluster.worker_id().to_string();
        let mine = |task: &str| owners.get(task).is_some_and(|o| *o == me);

        // Stop what is no longer ours, paused, restarted, redefined, or ended by itself.
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(id, r)| {
                !mine(id)
                    || control.is_paused(r.kind.connector(), id)
                    || r.plan_version != plan.version
                    || r.generation != control.generation(r.kind.connector(), id)
                    || r.handle.is_finished()
            })
            .map(|(id, _)| id.clone())
            .collect();
        if !stale.is_empty() {
            tracing::info!(worker = %me, tasks = stale.len(), "stopping tasks that moved, paused, restarted or ended");
            self.stop_tasks(&stale, State::Unassigned).await;
        }

        for (id, kind) in &tasks {
            if !mine(id) || self.running.contains_key(id) {
                continue;
            }
            if control.is_paused(kind.connector(), id) {
                self.cluster.report(id, State::Paused, None).await;
                continue;
            }
            match self.cluster.acquire(id).await {
                Ok(Some(lease)) => self.start_task(&plan, &control, kind.clone(), lease).await,
                // Its previous owner still holds it; its lease lapses or is released soon.
                Ok(None) => {}
                Err(e) => tracing::warn!(task = %id, error = %e, "cannot take the task's lease"),
            }
        }
        for connector in plan.connectors() {
            if mine(&task_id(connector, 0)) {
                let state = if control.paused.contains(connector) {
                    State::Paused
                } else {
                    State::Running
                };
                self.cluster.report(connector, state, None).await;
            }
        }
    }

    async fn start_task(&mut self, plan: &Plan, control: &Control, kind: TaskKind, lease: Lease) {
        let id = lease.task.clone();
        let valid_until = Arc::new(AtomicU64::new(
            now_ms() + lease_margin(self.cluster.lease_ttl()),
        ));
        let (stop, stop_rx) = watch::channel(false);
        let handle = match &kind {
            TaskKind::Deliver { sub, shard } => {
                let shard = *shard;
                let Some(log) = plan.logs.get(&sub.bus).cloned() else {
                    let _ = self.cluster.release(&lease).await;
                    return;
                };
                self.positions.own(&sub.id, shard, &lease);
                let from = match self.positions.load(&sub.id, shard).await {
                    Ok(p) => p.unwrap_or(0),
                    Err(e) => {
                        tracing::warn!(task = %id, error = %e, "cannot load the task's position; retrying on the next tick");
                        self.positions.disown(&id);
                        let _ = self.cluster.release(&lease).await;
                        return;
                    }
                };
                let task = Task {
                    sub: sub.clone(),
                    shard,
                    log,
                    positions: self.positions.clone(),
                    delivery: self.options.delivery.clone(),
                    stop: stop_rx,
                    valid_until: valid_until.clone(),
                    cluster: self.cluster.clone(),
                    id: id.clone(),
                };
                tracing::info!(task = %id, epoch = lease.epoch, from, worker = %self.cluster.worker_id(), "task started");
                tokio::spawn(task.run(from))
            }
            TaskKind::Source { source, index } => {
                let task = SourceTask {
                    source: source.clone(),
                    index: *index,
                    lease: lease.clone(),
                    positions: self.positions.clone(),
                    cluster: self.cluster.clone(),
                    valid_until: valid_until.clone(),
                    stop: stop_rx,
                };
                tracing::info!(task = %id, epoch = lease.epoch, worker = %self.cluster.worker_id(), "source task started");
                tokio::spawn(task.run())
            }
        };
        self.cluster.report(&id, State::Running, None).await;
        self.running.insert(
            id.clone(),
            Running {
                generation: control.generation(kind.connector(), &id),
                kind,
                lease,
                plan_version: plan.version,
                valid_until,
                stop,
                handle,
            },
        );
    }

    /// Stops tasks after their current batch, commits their positions, then lets go of
    /// their leases (in that order, so the next owner starts where they stopped).
    async fn stop_tasks(&mut self, ids: &[String], state: State) {
        let mut stopped = Vec::new();
        for id in ids {
            if let Some(r) = self.running.remove(id) {
                let _ = r.stop.send(true);
                stopped.push((id.clone(), r));
            }
        }
        for (_, r) in &mut stopped {
            if let Err(e) = (&mut r.handle).await {
                tracing::error!(error = %e, "a task failed");
            }
        }
        self.commit().await;
        for (id, r) in stopped {
            self.positions.disown(&id);
            // A slow stop may have let the lease lapse, and another worker may run the task
            // (and have reported it RUNNING) already: report and release only while the
            // lease is still ours. Status first: once the lease is free the next owner
            // reports RUNNING.
            match self.cluster.renew(&r.lease).await {
                Ok(true) => {
                    self.cluster.report(&id, state, None).await;
                    if let Err(e) = self.cluster.release(&r.lease).await {
                        tracing::warn!(task = %id, error = %e, "cannot release the lease; it lapses by itself");
                    }
                }
                Ok(false) => {
                    tracing::debug!(task = %id, "the lease moved on while the task stopped")
                }
                Err(e) => {
                    tracing::warn!(task = %id, error = %e, "cannot check the lease; it lapses by itself")
                }
            }
        }
    }

    async fn renew(&mut self) {
        let margin = lease_margin(self.cluster.lease_ttl());
        let mut lost = Vec::new();
        for (id, r) in &self.running {
            let started = now_ms();
            match self.cluster.renew(&r.lease).await {
                Ok(true) => r.valid_until.store(started + margin, Ordering::Relaxed),
                Ok(false) => {
                    tracing::warn!(task = %id, "lease lost to another worker; stopping the task");
                    r.valid_until.store(0, Ordering::Relaxed);
                    lost.push(id.clone());
                }
                // The task stops by itself when its lease may have lapsed.
                Err(e) => tracing::warn!(task = %id, error = %e, "cannot renew the lease"),
            }
        }
        if !lost.is_empty() {
            self.stop_tasks(&lost, State::Unassigned).await;
        }
    }

    async fn commit(&mut self) {
        match self.positions.flush().await {
            Ok(fenced) => {
                for id in fenced {
                    if let Some(r) = self.running.get(&id) {
                        tracing::warn!(task = %id, "position commit refused: the task moved; stopping it");
                        r.valid_until.store(0, Ordering::Relaxed);
                        let _ = r.stop.send(true);
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "committing positions failed; retrying"),
        }
    }

    /// Lets the log drop records every subscription of the bus has committed past.
    async fn release_passed_segments(&mut self) {
        let plan = self.plan.borrow().clone();
        let mut shards: Vec<(String, u32)> = self
            .running
            .values()
            .filter_map(|r| match &r.kind {
                TaskKind::Deliver { sub, shard } => Some((sub.bus.clone(), *shard)),
                TaskKind::Source { .. } => None,
            })
            .collect();
        shards.sort();
        shards.dedup();
        for (bus, shard) in shards {
            let Some(log) = plan.logs.get(&bus) else {
                continue;
            };
            let mut min: Option<Seq> = None;
            let mut known = true;
            for sub in plan.subscriptions.iter().filter(|s| s.bus == bus) {
                match self.positions.committed(&sub.id, shard).await {
                    Ok(Some(p)) => min = Some(min.map_or(p, |m| m.min(p))),
                    _ => known = false,
                }
            }
            if let (true, Some(min)) = (known, min) {
                if let Err(e) = log.release(shard, min).await {
                    tracing::warn!(bus, shard, error = %e, "releasing passed records failed");
                }
            }
        }
    }
}

/// How long a stopping task waits for its delivery in flight.
const STOP_GRACE: Duration = Duration::from_millis(500);

/// A lease is trusted locally for 4/5 of its time to live after a successful renewal, so a
/// paused or partitioned worker stops delivering before another worker can take over.
fn lease_margin(ttl: Duration) -> u64 {
    (ttl.as_millis() as u64) * 4 / 5
}

struct Task {
    id: String,
    sub: Arc<Subscription>,
    shard: u32,
    log: Arc<dyn BusLog>,
    positions: Arc<dyn PositionStore>,
    delivery: DeliveryConfig,
    stop: watch::Receiver<bool>,
    valid_until: Arc<AtomicU64>,
    cluster: Arc<dyn Cluster>,
}

impl Task {
    fn leased(&self) -> bool {
        now_ms() < self.valid_until.load(Ordering::Relaxed)
    }

    async fn run(mut self, from: Seq) {
        let sub = self.sub.id.clone();
        let shard = self.shard;
        let mut backoff = self.delivery.initial_backoff;
        let mut next = from;
        'reopen: loop {
            let mut reader = match self.log.reader(shard, next).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(subscription = %sub, shard, error = %e, "cannot open the shard");
                    if self.pause(&mut backoff, Some(e.to_string())).await {
                        return;
                    }
                    continue 'reopen;
                }
            };
            let mut tail = self.log.tail(shard);
            let mut idle = Duration::from_millis(5);
            loop {
                if *self.stop.borrow() || !self.leased() {
                    return;
                }
                let records = match reader.read(self.delivery.batch_size).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::error!(subscription = %sub, shard, error = %e, "reading the shard failed");
                        if self.pause(&mut backoff, Some(e.to_string())).await {
                            return;
                        }
                        continue 'reopen;
                    }
                };
                let Some(last) = records.last().map(|r| r.seq) else {
                    // Local appends wake the task at once; appends by other workers are
                    // found by polling, less often the longer the shard stays quiet.
                    let poll = self.log.poll_interval().map(|max| {
                        idle = (idle * 2).min(max);
                        idle
                    });
                    tokio::select! {
                        changed = tail.changed() => if changed.is_err() { return },
                        _ = self.stop.changed() => return,
                        _ = sleep_or_forever(poll) => {}
                    }
                    if !self.delivery.linger.is_zero() {
                        tokio::time::sleep(self.delivery.linger).await;
                    }
                    continue;
                };
                idle = Duration::from_millis(5);
                let events = self.select(records);
                if !self.deliver(&events, &mut backoff).await {
                    // Stopped or lease lost before delivery succeeded: the position stays and
                    // the batch is delivered again by whoever runs the task next.
                    return;
                }
                next = last + 1;
                self.positions.set(&sub, shard, next);
            }
        }
    }

    /// The records this subscription's rule matches, transformed. Events are decoded only
    /// when the rule or the transform needs to look inside them. An event the transform
    /// fails on is reported and left out (it cannot succeed on a retry).
    fn select(&self, records: Vec<Record>) -> Vec<Envelope> {
        if self.sub.filter.matches_everything() && self.sub.transform.is_none() {
            return records
                .into_iter()
                .map(|r| Envelope {
                    raw: r.payload,
                    event: None,
                    body: None,
                })
                .collect();
        }
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            let event = match cloudevent::decode(&r.payload) {
                Ok(event) => event,
                Err(e) => {
                    tracing::error!(subscription = %self.sub.id, shard = self.shard, seq = r.seq, error = %e, "a stored event does not decode; skipping it");
                    continue;
                }
            };
            if !self.sub.filter.matches(&event) {
                continue;
            }
            let Some(chain) = &self.sub.transform else {
                out.push(Envelope {
                    raw: r.payload,
                    event: Some(event),
                    body: None,
                });
                continue;
            };
            match chain.apply(&event) {
                Ok(Output::Event(transformed)) => match cloudevent::encode(&transformed) {
                    Ok(raw) => out.push(Envelope {
                        raw: raw.into(),
                        event: Some(transformed),
                        body: None,
                    }),
                    Err(e) => {
                        tracing::error!(subscription = %self.sub.id, seq = r.seq, error = %e, "cannot encode a transformed event; skipping it")
                    }
                },
                Ok(Output::Body {
                    content_type,
                    bytes,
                }) => out.push(Envelope {
                    raw: r.payload,
                    event: Some(event),
                    body: Some(Body {
                        content_type,
                        bytes: bytes.into(),
                    }),
                }),
                Err(e) => {
                    tracing::error!(subscription = %self.sub.id, shard = self.shard, seq = r.seq, error = %e, "the transform failed on this event; skipping it")
                }
            }
        }
        out
    }

    /// Delivers (retries, backoff and dead letters: see `delivery`); false if stopped (or
    /// the lease lapsed) first. Stopping cancels a delivery that does not finish within
    /// `STOP_GRACE`: the position has not moved, so the batch is delivered again by whoever
    /// runs the task next.
    async fn deliver(&mut self, events: &[Envelope], backoff: &mut Duration) -> bool {
        if events.is_empty() {
            return true;
        }
        let sub = self.sub.clone();
        let deliver = sub.delivery.deliver(events);
        tokio::pin!(deliver);
        let mut check = tokio::time::interval(Duration::from_millis(250));
        let mut failed = false;
        loop {
            if !self.leased() {
                return false;
            }
            tokio::select! {
                () = &mut deliver => {
                    *backoff = self.delivery.initial_backoff;
                    if failed {
                        self.report(State::Running, None).await;
                    }
                    return true;
                }
                _ = self.stop.changed() => {
                    // Stopping (shutdown, rebalance): a delivery in flight gets a moment
                    // to finish so its position is recorded and a graceful stop sends
                    // nothing twice; past the grace, or the lease, it is dropped.
                    let left = self.valid_until.load(Ordering::Relaxed).saturating_sub(now_ms());
                    let grace = STOP_GRACE.min(Duration::from_millis(left));
                    return tokio::time::timeout(grace, &mut deliver).await.is_ok();
                }
                _ = check.tick() => {
                    if let Some(reason) = sub.delivery.last_error() {
                        if !failed {
                            failed = true;
                            self.report(State::Failed, Some(reason)).await;
                        }
                    }
                }
            }
        }
    }

    async fn report(&self, state: State, reason: Option<String>) {
        // Once the lease may have moved, the status is the next owner's to write.
        if !self.leased() {
            return;
        }
        self.cluster.report(&self.id, state, reason).await;
    }

    /// Reports the failure, waits out the backoff (doubling it for next time); true if
    /// asked to stop meanwhile.
    async fn pause(&mut self, backoff: &mut Duration, reason: Option<String>) -> bool {
        self.report(State::Failed, reason).await;
        let wait = *backoff;
        *backoff = (*backoff * 2).min(self.delivery.max_backoff);
        tokio::select! {
            _ = tokio::time::sleep(wait) => *self.stop.borrow(),
            _ = self.stop.changed() => true,
        }
    }
}

async fn sleep_or_forever(duration: Option<Duration>) {
    match duration {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}
