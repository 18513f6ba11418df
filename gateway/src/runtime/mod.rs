//! The delivery runtime, after RocketMQ Connect's worker.
//!
//! The unit of work a worker leases is a *shard task*: one shard of one bus with every
//! subscription of that bus (each (rule, target) pair is a subscription, a connector in
//! Connect's words). Source connectors are split into their own tasks. So the number of
//! tasks, leases and Redis round trips depends on buses, shards and sources, never on the
//! number of rules.
//!
//! A worker runs a reconcile loop on every change notice and on a tick: it computes the
//! assignment of all tasks over the live workers with the configured strategy, takes a
//! lease (with a fencing epoch) for each of its own tasks before starting it, stops what
//! moved away, and commits positions in fenced batches. A separate lease keeper renews all
//! of the worker's leases in one round trip, so renewals never wait behind commits,
//! trimming or a rebalance.
//!
//! Inside a shard task (see `shard`), one reader reads and decodes each event once, asks the
//! bus's compiled rule index which subscriptions match, and hands the event to those
//! subscriptions' lanes. Each lane delivers in order with its own transform chain, retry
//! and dead-letter policy and its own position. The reader runs the lanes it just handed
//! events itself while their deliveries are done on the first poll (one task per delivery
//! cost more than a delivery to a file), combining their file writes into one per file;
//! a delivery that has to wait goes on in a task of its own. A lane whose target is slow
//! does not hold up the reader: once its queue is full it leaves the shared path, reads
//! the log on its own from its position until it has caught up with the reader, and then
//! rejoins. When the lanes of a shard are behind together (a busy machine, not one slow
//! target), the reader waits for them instead, so the log is not read once per lane.
//!
//! A rule change rebuilds the bus's index and is applied to the running shard tasks of
//! that bus in place: unchanged subscriptions keep their lanes and queues, changed ones
//! continue from their position, new ones start at the end of the shard. Shard tasks of
//! other buses are not touched.

pub(crate) mod chain;
pub mod delivery;
pub mod plan;
pub mod rebalance;
mod shard;

use plan::TaskKind;
pub use plan::{shard_task_id, BusPlan, FailedConnector, Plan, RuleSubscriptions, Subscription};

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::runtime::delivery::DeliveryConfig;
use crate::sources::SourceTask;
use crate::store::cluster::{mono_ms, task_id, Cluster, Control, Lease, State};
use crate::store::{PositionStore, Seq};
use rebalance::Strategy;

#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub delivery: DeliveryConfig,
    pub strategy: Strategy,
    /// The rebalance tick (change notices can be lost; the tick catches up).
    pub tick: Duration,
    /// The longest an idle shard reader's blocking read waits before reading again.
    pub read_wait: Duration,
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
        let (lost_tx, lost) = mpsc::unbounded_channel();
        let leases = Arc::new(LeaseKeeper {
            cluster: cluster.clone(),
            held: Mutex::new(BTreeMap::new()),
            lost: lost_tx,
        });
        tokio::spawn(leases.clone().run(stop_rx.clone()));
        let state = WorkerLoop {
            cluster,
            positions,
            options,
            plan: plan_rx,
            stop: stop_rx,
            running: HashMap::new(),
            control: watch::Sender::new(Arc::new(Control::default())),
            leases,
            lost,
            reported: HashMap::new(),
            retained_from: HashMap::new(),
            size_windows: HashMap::new(),
        };
        Worker {
            stop,
            plan: Arc::new(plan_tx),
            handle: tokio::spawn(state.run()),
        }
    }

    /// Where to send a new configuration version.
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

/// Renews every lease of the worker in one round trip, on its own schedule: commits,
/// trimming and rebalancing never delay a renewal. A lease is trusted for 4/5 of its time
/// to live, counted from a monotonic instant taken *before* the renewal was sent, so a slow
/// reply or a clock step cannot stretch it.
struct LeaseKeeper {
    cluster: Arc<dyn Cluster>,
    held: Mutex<BTreeMap<String, (Lease, Arc<AtomicU64>)>>,
    /// Tasks whose lease turned out to be someone else's.
    lost: mpsc::UnboundedSender<String>,
}

impl LeaseKeeper {
    fn held(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Lease, Arc<AtomicU64>)>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, lease: &Lease, valid_until: Arc<AtomicU64>) {
        let mut held = self.held();
        held.insert(lease.task.clone(), (lease.clone(), valid_until));
        crate::metrics::get().leases_held.set(held.len() as i64);
    }

    fn remove(&self, task: &str) {
        let mut held = self.held();
        held.remove(task);
        crate::metrics::get().leases_held.set(held.len() as i64);
    }

    async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let ttl = self.cluster.lease_ttl();
        let mut tick = tokio::time::interval((ttl / 3).max(Duration::from_millis(50)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => return,
            }
            let leases: Vec<(Lease, Arc<AtomicU64>)> = self.held().values().cloned().collect();
            if leases.is_empty() {
                continue;
            }
            let sent = mono_ms();
            let only: Vec<Lease> = leases.iter().map(|(l, _)| l.clone()).collect();
            match self.cluster.renew_all(&only).await {
                Ok(held) => {
                    let margin = lease_margin(ttl);
                    for ((lease, valid_until), held) in leases.iter().zip(held) {
                        if held {
                            valid_until.fetch_max(sent + margin, Ordering::Relaxed);
                        } else {
                            tracing::warn!(task = %lease.task, epoch = lease.epoch, "lease lost to another worker; stopping the task");
                            crate::metrics::get().lease_losses.inc();
                            valid_until.store(0, Ordering::Relaxed);
                            let _ = self.lost.send(lease.task.clone());
                        }
                    }
                }
                // Tasks stop by themselves once their lease may have lapsed.
                Err(e) => tracing::warn!(error = %e, leases = leases.len(), "cannot renew leases"),
            }
        }
    }
}

struct Running {
    kind: TaskKind,
    lease: Lease,
    digest: u64,
    /// Source tasks restart when their generation changes (shard tasks apply restarts of
    /// their subscriptions themselves).
    generation: u64,
    valid_until: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    /// Shard tasks: where a changed definition of their bus goes.
    update: Option<watch::Sender<Arc<BusPlan>>>,
    handle: JoinHandle<()>,
}

struct WorkerLoop {
    cluster: Arc<dyn Cluster>,
    positions: Arc<dyn PositionStore>,
    options: WorkerOptions,
    plan: watch::Receiver<Arc<Plan>>,
    stop: watch::Receiver<bool>,
    running: HashMap<String, Running>,
    /// Pause and restart requests, for the shard tasks to apply to their subscriptions.
    control: watch::Sender<Arc<Control>>,
    leases: Arc<LeaseKeeper>,
    lost: mpsc::UnboundedReceiver<String>,
    /// The last state reported for each source connector, so status is written on change.
    reported: HashMap<String, State>,
    /// Per bus shard with a retention: where the retained records start (the last release).
    retained_from: HashMap<(String, u32), Seq>,
    /// Per owned (bus, shard) with `retention_bytes`: the bytes of passed records kept.
    size_windows: HashMap<(String, u32), crate::store::search::SizeWindow>,
}

impl WorkerLoop {
    async fn run(mut self) {
        let mut notices = self.cluster.notices();
        let mut tick = tokio::time::interval(self.options.tick);
        let mut commit = tokio::time::interval(self.options.delivery.commit_interval);
        let mut housekeeping = tokio::time::interval(Duration::from_secs(5));
        for t in [&mut tick, &mut commit, &mut housekeeping] {
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
                Some(task) = self.lost.recv() => {
                    if self.running.contains_key(&task) {
                        self.stop_tasks(&[task], State::Unassigned).await;
                    }
                }
                _ = commit.tick() => self.commit().await,
                _ = housekeeping.tick() => self.release_passed_records().await,
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
        self.control.send_if_modified(|current| {
            let changed = **current != control;
            if changed {
                *current = Arc::new(control.clone());
            }
            changed
        });
        let plan = self.plan.borrow().clone();
        let tasks = plan.tasks();
        let ids: Vec<String> = tasks.keys().cloned().collect();
        let owners = rebalance::assign(self.options.strategy, &members, &ids);
        let me = self.cluster.worker_id().to_string();
        let mine = |task: &str| owners.get(task).is_some_and(|o| *o == me);

        // Stop what is no longer ours or no longer defined, sources that are paused,
        // restarted or redefined, and tasks that ended by themselves.
        let stale: Vec<String> = self
            .running
            .iter()
            .filter(|(id, r)| {
                let Some(kind) = tasks.get(*id) else {
                    return true;
                };
                let source_changed = match &r.kind {
                    TaskKind::Source { source, .. } => {
                        control.is_paused(&source.id, id)
                            || r.generation != control.generation(&source.id, id)
                            || r.digest != kind.digest()
                    }
                    TaskKind::Shard { .. } => false,
                };
                !mine(id) || source_changed || r.handle.is_finished()
            })
            .map(|(id, _)| id.clone())
            .collect();
        if !stale.is_empty() {
            crate::metrics::get().rebalances.inc();
            tracing::info!(worker = %me, tasks = stale.len(), "stopping tasks that moved, paused, restarted or ended");
            self.stop_tasks(&stale, State::Unassigned).await;
        }

        // Shard tasks whose bus changed take the new definition in place.
        for (id, r) in &mut self.running {
            if let (Some(TaskKind::Shard { bus, .. }), Some(update)) = (tasks.get(id), &r.update) {
                if r.digest != bus.digest {
                    tracing::info!(task = %id, "the bus's rules changed; updating the running task");
                    r.digest = bus.digest;
                    let _ = update.send(bus.clone());
                }
            }
        }

        for (id, kind) in &tasks {
            if !mine(id) || self.running.contains_key(id) {
                continue;
            }
            if let TaskKind::Source { source, .. } = kind {
                if control.is_paused(&source.id, id) {
                    self.report_once(id, State::Paused).await;
                    continue;
                }
            }
            let asked = mono_ms();
            match self.cluster.acquire(id).await {
                Ok(Some(lease)) => {
                    let Some(valid_until) =
                        trusted_until(asked, self.cluster.lease_ttl(), mono_ms())
                    else {
                        tracing::warn!(task = %id, "the lease came back too late to be trusted; trying again on the next tick");
                        let _ = self.cluster.release(&lease).await;
                        continue;
                    };
                    self.start_task(&control, kind.clone(), lease, valid_until)
                        .await
                }
                // Its previous owner still holds it; its lease lapses or is released soon.
                Ok(None) => {}
                Err(e) => tracing::warn!(task = %id, error = %e, "cannot take the task's lease"),
            }
        }
        for source in &plan.sources {
            if mine(&task_id(&source.id, 0)) {
                let state = if control.paused.contains(&source.id) {
                    State::Paused
                } else {
                    State::Running
                };
                self.report_once(&source.id, state).await;
            }
        }
    }

    /// Reports a state unless it is the one this worker reported last.
    async fn report_once(&mut self, id: &str, state: State) {
        if self.reported.get(id) != Some(&state) {
            self.reported.insert(id.to_string(), state);
            self.cluster.report(id, state, None).await;
        }
    }

    async fn start_task(&mut self, control: &Control, kind: TaskKind, lease: Lease, until: u64) {
        let id = lease.task.clone();
        let valid_until = Arc::new(AtomicU64::new(until));
        let (stop, stop_rx) = watch::channel(false);
        let mut update = None;
        let handle = match &kind {
            TaskKind::Shard { bus, shard } => {
                let (update_tx, update_rx) = watch::channel(bus.clone());
                update = Some(update_tx);
                let task = shard::ShardTask {
                    id: id.clone(),
                    shard: *shard,
                    lease: lease.clone(),
                    positions: self.positions.clone(),
                    cluster: self.cluster.clone(),
                    delivery: self.options.delivery.clone(),
                    read_wait: self.options.read_wait,
                    stop: stop_rx,
                    valid_until: valid_until.clone(),
                    plans: update_rx,
                    control: self.control.subscribe(),
                };
                tracing::info!(task = %id, epoch = lease.epoch, worker = %self.cluster.worker_id(), subscriptions = bus.subscriptions.len(), "shard task started");
                tokio::spawn(task.run())
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
                self.cluster.report(&id, State::Running, None).await;
                tokio::spawn(task.run())
            }
        };
        let connector = match &kind {
            TaskKind::Shard { .. } => "",
            TaskKind::Source { source, .. } => source.id.as_str(),
        };
        self.leases.add(&lease, valid_until.clone());
        self.running.insert(
            id.clone(),
            Running {
                generation: control.generation(connector, &id),
                digest: kind.digest(),
                kind,
                lease,
                valid_until,
                stop,
                update,
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
            self.leases.remove(&id);
            self.positions.disown(&id);
            // A slow stop may have let the lease lapse, and another worker may run the task
            // (and have reported it RUNNING) already: report and release only while the
            // lease is still ours. Status first: once the lease is free the next owner
            // reports RUNNING.
            match self.cluster.renew(&r.lease).await {
                Ok(true) => {
                    let mut reports = vec![(id.clone(), state, None)];
                    if let TaskKind::Shard { bus, shard } = &r.kind {
                        reports.extend(
                            bus.subscriptions
                                .iter()
                                .map(|s| (task_id(&s.id, *shard), state, None)),
                        );
                    }
                    self.cluster.report_many(reports).await;
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

    /// Lets each log drop the records every subscription of its shard has committed past.
    /// The shard task's committed positions cover all of its subscriptions, so this costs
    /// one call per owned shard, whatever the number of rules.
    async fn release_passed_records(&mut self) {
        let owned: std::collections::HashSet<(&str, u32)> = self
            .running
            .values()
            .filter_map(|r| match &r.kind {
                TaskKind::Shard { bus, shard } => Some((bus.name.as_str(), *shard)),
                _ => None,
            })
            .collect();
        self.retained_from
            .retain(|(bus, shard), _| owned.contains(&(bus.as_str(), *shard)));
        self.size_windows
            .retain(|(bus, shard), _| owned.contains(&(bus.as_str(), *shard)));
        for r in self.running.values() {
            let TaskKind::Shard { bus, shard } = &r.kind else {
                continue;
            };
            let Some(mut min) = self.positions.committed_min(&bus.name, *shard) else {
                continue;
            };
            // A bus with a retention keeps what was accepted within it and/or the newest
            // bytes of what was passed (read from the current plan, so a change of
            // retention applies without a restart). With both, the tighter bound wins.
            let (age, bytes) = self
                .plan
                .borrow()
                .buses
                .get(&bus.name)
                .map_or((None, None), |b| (b.retention, b.retention_bytes));
            let key = (bus.name.clone(), *shard);
            let mut kept_from: Option<Seq> = None;
            if let Some(age) = age {
                let cutoff = crate::store::now_ms().saturating_sub(age.as_millis() as u64);
                let lo = match self.retained_from.get(&key) {
                    Some(lo) => *lo,
                    None => bus.log.start(*shard).await.unwrap_or(0),
                }
                .min(min);
                let found =
                    crate::store::search::first_after(bus.log.as_ref(), *shard, lo, min, cutoff)
                        .await
                        .inspect_err(|e| {
                            tracing::debug!(bus = %bus.name, shard, error = %e, "cannot find the retention boundary")
                        });
                let Ok(boundary) = found else { continue };
                kept_from = Some(boundary);
                self.retained_from.insert(key.clone(), boundary);
            } else {
                self.retained_from.remove(&key);
            }
            if let Some(bytes) = bytes {
                let window = self.size_windows.entry(key).or_default();
                let counted = window.advance(bus.log.as_ref(), *shard, min, bytes).await;
                let Ok(boundary) = counted.inspect_err(|e| {
                    tracing::debug!(bus = %bus.name, shard, error = %e, "cannot count the retained bytes")
                }) else {
                    continue;
                };
                kept_from = Some(kept_from.map_or(boundary, |b| b.max(boundary)));
            } else {
                self.size_windows.remove(&key);
            }
            if let Some(kept_from) = kept_from {
                min = min.min(kept_from);
            }
            if let Err(e) = bus.log.release(*shard, min).await {
                tracing::warn!(bus = %bus.name, shard, error = %e, "releasing passed records failed");
            }
        }
    }
}

/// A lease is trusted locally for 4/5 of its time to live after a successful renewal, so a
/// paused or partitioned worker stops delivering before another worker can take over.
fn lease_margin(ttl: Duration) -> u64 {
    (ttl.as_millis() as u64) * 4 / 5
}

/// Until when (monotonic ms) a lease granted in answer to a request sent at `asked` may be
/// trusted: validity counts from before the request, so a slow answer shortens it. `None`
/// when it came back too late to be trusted at all (another worker may hold it by now).
fn trusted_until(asked: u64, ttl: Duration, now: u64) -> Option<u64> {
    let until = asked + lease_margin(ttl);
    (now < until).then_some(until)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::cluster::{LocalCluster, Status};
    use crate::store::StoreError;

    /// A standalone cluster whose lease requests take `delay` to be answered.
    struct SlowCluster {
        inner: LocalCluster,
        delay: Duration,
        ttl: Duration,
    }

    #[async_trait::async_trait]
    impl Cluster for SlowCluster {
        fn worker_id(&self) -> &str {
            self.inner.worker_id()
        }
        fn lease_ttl(&self) -> Duration {
            self.ttl
        }
        fn notices(&self) -> watch::Receiver<u64> {
            self.inner.notices()
        }
        fn healthy(&self) -> bool {
            true
        }
        async fn members(&self) -> Result<Vec<String>, StoreError> {
            self.inner.members().await
        }
        async fn acquire(&self, task: &str) -> Result<Option<Lease>, StoreError> {
            tokio::time::sleep(self.delay).await;
            self.inner.acquire(task).await
        }
        async fn renew(&self, lease: &Lease) -> Result<bool, StoreError> {
            tokio::time::sleep(self.delay).await;
            self.inner.renew(lease).await
        }
        async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
            self.inner.release(lease).await
        }
        async fn control(&self) -> Result<Control, StoreError> {
            self.inner.control().await
        }
        async fn set_paused(&self, id: &str, paused: bool) -> Result<(), StoreError> {
            self.inner.set_paused(id, paused).await
        }
        async fn request_restart(&self, id: &str) -> Result<(), StoreError> {
            self.inner.request_restart(id).await
        }
        async fn set_status(&self, status: Status) -> Result<(), StoreError> {
            self.inner.set_status(status).await
        }
        async fn statuses(&self) -> Result<Vec<Status>, StoreError> {
            self.inner.statuses().await
        }
        async fn forget(&self, ids: &[String]) -> Result<(), StoreError> {
            self.inner.forget(ids).await
        }
        async fn leave(&self) {}
    }

    #[test]
    fn a_lease_answered_after_its_margin_is_not_trusted() {
        let ttl = Duration::from_secs(10);
        // Counted from the request (1,000), not from the answer.
        assert_eq!(trusted_until(1_000, ttl, 1_000), Some(9_000));
        assert_eq!(trusted_until(1_000, ttl, 8_999), Some(9_000));
        assert_eq!(trusted_until(1_000, ttl, 9_000), None);
        assert_eq!(trusted_until(1_000, ttl, 60_000), None);
    }

    /// Renewals count from a monotonic instant taken before the request: a slow answer
    /// shortens the lease instead of stretching it, and an answer slower than the margin
    /// leaves the task without a valid lease (it stops) rather than with a stale one.
    #[tokio::test]
    async fn renewals_count_from_before_the_request() {
        for (delay_ms, ttl_ms) in [(300u64, 1_000u64), (1_000, 1_000)] {
            let cluster = Arc::new(SlowCluster {
                inner: LocalCluster::new("w"),
                delay: Duration::from_millis(delay_ms),
                ttl: Duration::from_millis(ttl_ms),
            });
            let lease = cluster.inner.acquire("t").await.unwrap().unwrap();
            let (lost, _lost) = mpsc::unbounded_channel();
            let keeper = Arc::new(LeaseKeeper {
                cluster: cluster.clone(),
                held: Mutex::default(),
                lost,
            });
            let valid_until = Arc::new(AtomicU64::new(1));
            keeper.add(&lease, valid_until.clone());
            let (stop, stopped) = watch::channel(false);
            let before = mono_ms();
            let running = tokio::spawn(keeper.clone().run(stopped));
            let deadline = before + 5_000;
            while valid_until.load(Ordering::Relaxed) == 1 {
                assert!(mono_ms() < deadline, "no renewal");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let answered = mono_ms();
            let until = valid_until.load(Ordering::Relaxed);
            let margin = lease_margin(Duration::from_millis(ttl_ms));
            assert!(until >= before + margin, "{until} < {before} + {margin}");
            assert!(
                until + delay_ms <= answered + margin,
                "counted from the answer: until {until}, answered {answered}, delay {delay_ms}"
            );
            if delay_ms >= margin {
                assert!(
                    until <= answered,
                    "a renewal slower than the margin is not valid"
                );
            }
            let _ = stop.send(true);
            running.await.unwrap();
        }
    }
}
