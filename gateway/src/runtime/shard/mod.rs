//! One shard of one bus with all of its subscriptions: the fan-out engine.
//!
//! The shard reader reads each record once, decodes it once, asks the bus's rule index
//! which subscriptions take it, applies each of those subscriptions' transform chain and
//! queues the result on the subscription's *lane*. Work per record grows with the number of
//! matching subscriptions, not with the number of rules; a lane with nothing to do has no
//! running task at all.
//!
//! A lane is in one of three modes:
//! - attached: it gets its events from the reader (and ignores those below `from`, which is
//!   how a new subscription starts at the end of the shard);
//! - catching up: its queue filled up (a slow or failing target), so the reader leaves it
//!   alone; the lane drains what it had queued, then reads the log on its own from its
//!   position with its own filter, and attaches again once it has reached the reader;
//! - paused: it delivers nothing and keeps its position.
//!
//! Positions: every lane that is attached with nothing queued or in flight is exactly at
//! the reader's position, so the shard's positions are stored as that one `shared` value
//! plus the few lanes that differ (`GroupPositions`). Committing them costs the same with
//! ten rules as with ten thousand.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use cloudevents::Event;
use tokio::sync::watch;

use super::{shard_task_id, BusPlan, Subscription, STOP_GRACE};
use crate::config::DeliveryConfig;
use crate::event;
use crate::store::cluster::{mono_ms, task_id, Cluster, Control, Lease, State};
use crate::store::{GroupPositions, PositionStore, Record, Seq, ShardReader, StoreError};
use crate::targets::{Body, Envelope};
use sluice_functions::Output;

/// Most events a lane may have queued before it leaves the shared path (in batches of the
/// delivery batch size).
const LANE_QUEUE_BATCHES: usize = 4;

/// Most bytes one lane may have queued (events wait in the log, not in memory, for a slow
/// target).
const LANE_QUEUE_BYTES: usize = 1024 * 1024;

/// Most bytes queued across all lanes of one shard task. Past it the reader waits for the
/// lanes to deliver (they are behind together: the machine is busy, and reading on would
/// only make every lane read the log again on its own); if that takes long, the lanes that
/// hold the most leave the shared path and catch up from the log, so a few slow targets
/// cannot hold the others back. Keeps memory bounded whatever the number of rules.
const SHARD_QUEUE_BYTES: usize = 16 * 1024 * 1024;

/// How often an idle shard reader checks that the log did not roll back under it.
const ROLLBACK_CHECK: Duration = Duration::from_secs(2);

/// After a rollback, events accepted up to this long before the last one the reader saw
/// are delivered again (replicas' clocks differ a little; a duplicate beats a loss).
const ROLLBACK_MARGIN_MS: u64 = 2_000;

/// How often each lane's lag (`sluice_subscription_lag_events`) is computed.
const LAG_INTERVAL: Duration = Duration::from_secs(2);

/// How often a shard looks for events its subscriptions hold past the bus's
/// `max_backlog_age` (one record read while nothing is that old).
const EXPIRE_CHECK: Duration = Duration::from_secs(1);

/// How long the reader waits for room before it sheds the lanes that hold the most.
const SHED_AFTER: Duration = Duration::from_millis(250);

pub(super) struct ShardTask {
    pub(super) id: String,
    pub(super) shard: u32,
    pub(super) lease: Lease,
    pub(super) positions: Arc<dyn PositionStore>,
    pub(super) cluster: Arc<dyn Cluster>,
    pub(super) delivery: DeliveryConfig,
    pub(super) read_wait: Duration,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) valid_until: Arc<AtomicU64>,
    /// The bus's definition; a new one arrives when its rules change.
    pub(super) plans: watch::Receiver<Arc<BusPlan>>,
    pub(super) control: watch::Receiver<Arc<Control>>,
}

/// What the reader and the lanes share.
struct Shared {
    shard: u32,
    dispatch: Mutex<Dispatch>,
    /// Bytes queued across lanes.
    queued: AtomicUsize,
    /// Signalled when `queued` falls below `SHARD_QUEUE_BYTES` (the reader may be waiting).
    drained: tokio::sync::Notify,
    /// Lane tasks running, and lanes reported FAILED: while both are zero there is nothing
    /// to check, so an idle shard costs nothing per subscription.
    running_lanes: AtomicUsize,
    failed_lanes: AtomicUsize,
    /// Bumped whenever a position may have moved, so unchanged positions are not
    /// recomputed or rewritten.
    changes: AtomicU64,
    delivery: DeliveryConfig,
    cluster: Arc<dyn Cluster>,
    valid_until: Arc<AtomicU64>,
    stop: watch::Receiver<bool>,
    /// (seq, acceptance time) of the first record of recent batches the reader handed
    /// out, oldest first: how old the event at a position is, for lanes that hold none of
    /// it in memory (paused, catching up).
    accepted: Mutex<VecDeque<(Seq, u64)>>,
    /// Set when the cursor was moved past what the reader read (expired events): the
    /// reader opens the log again at the cursor.
    reopen: std::sync::atomic::AtomicBool,
    /// The acceptance time of the last record the reader handed out (0: none yet).
    last_accepted: AtomicU64,
}

/// Samples of acceptance times kept per shard.
const ACCEPTED_SAMPLES: usize = 4096;

/// Guarded by one lock: the reader holds it while it hands out one batch, and a lane takes
/// it to attach again, so no record is handed out between "not attached" and "attached".
struct Dispatch {
    /// Every record below it has been handed to each attached lane that takes it.
    cursor: Seq,
    bus: Arc<BusPlan>,
    /// In the order of `bus.subscriptions`.
    lanes: Vec<Arc<Lane>>,
}

struct Lane {
    sub: Arc<Subscription>,
    /// `{bus}/{rule}/{target}#{shard}`: status, pause and restart of this part.
    id: String,
    state: Mutex<LaneState>,
    /// Its lag gauges (events, seconds), looked up once.
    gauges: std::sync::OnceLock<LagGauges>,
}

struct LagGauges {
    events: prometheus_client::metrics::gauge::Gauge,
    seconds: prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Lane {
    fn gauges(&self, shard: u32) -> &LagGauges {
        self.gauges.get_or_init(|| {
            let metrics = crate::metrics::get();
            LagGauges {
                events: metrics.lag(&self.sub.id, shard),
                seconds: metrics.lag_seconds(&self.sub.id, shard),
            }
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Attached { from: Seq },
    CatchingUp { next: Seq },
    Paused { next: Seq },
}

struct LaneState {
    mode: Mode,
    queue: VecDeque<Queued>,
    /// Bytes in `queue`.
    queued: usize,
    /// The first sequence number of the delivery in progress (and one past its last).
    in_flight: Option<(Seq, Seq)>,
    /// The acceptance time of the first event of that delivery (0: none, or not known).
    in_flight_accepted: u64,
    /// Whether a lane task is running (only while there is work).
    running: bool,
    /// Bumped by pause, restart and replacement: a delivery in flight under an older epoch
    /// is abandoned (its events are delivered again from the position: at least once).
    epoch: u64,
    /// Whether the lane is reported FAILED.
    failed: bool,
    /// Applied control: paused and restart generation.
    paused: bool,
    generation: u64,
}

struct Queued {
    seq: Seq,
    envelope: Envelope,
    bytes: usize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing holding these locks can leave them half-updated in a way that matters more
    // than stopping delivery would.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    /// A lane in `mode`, at the control's current restart generation (pause is applied by
    /// `apply_control`).
    fn new(sub: Arc<Subscription>, shard: u32, mode: Mode, control: &Control) -> Arc<Lane> {
        let id = task_id(&sub.id, shard);
        let generation = control.generation(&sub.id, &id);
        // One that cannot run here is held from the start: the reader never hands it an
        // event it would have to give up (`apply_control` reports it).
        let mode = match (&sub.failed, mode) {
            (Some(_), Mode::Attached { from }) => Mode::Paused { next: from },
            (Some(_), Mode::CatchingUp { next }) => Mode::Paused { next },
            (_, mode) => mode,
        };
        Arc::new(Lane {
            id,
            sub,
            gauges: std::sync::OnceLock::new(),
            state: Mutex::new(LaneState {
                mode,
                queue: VecDeque::new(),
                queued: 0,
                in_flight: None,
                in_flight_accepted: 0,
                running: false,
                epoch: 0,
                failed: false,
                paused: false,
                generation,
            }),
        })
    }

    /// The next sequence number the lane has to deliver, given the reader's position.
    fn position(state: &LaneState, cursor: Seq) -> Seq {
        if let Some((first, _)) = state.in_flight {
            return first;
        }
        if let Some(q) = state.queue.front() {
            return q.seq;
        }
        match state.mode {
            Mode::Attached { from } => from.max(cursor),
            Mode::CatchingUp { next } | Mode::Paused { next } => next,
        }
    }
}

impl ShardTask {
    fn leased(&self) -> bool {
        mono_ms() < self.valid_until.load(Ordering::Relaxed)
    }

    pub(super) async fn run(mut self) {
        let bus = self.plans.borrow_and_update().clone();
        let control = self.control.borrow_and_update().clone();
        let shard = self.shard;
        self.positions.own_group(&bus.name, shard, &self.lease);
        let mut backoff = self.delivery.initial_backoff;
        // Load positions (retrying while the store is down, as long as the lease lasts).
        let (mut group, end) = loop {
            match self.load(&bus).await {
                Ok(found) => break found,
                Err(e) => {
                    tracing::warn!(task = %self.id, error = %e, "cannot load the shard's positions; retrying");
                    if self.wait(&mut backoff).await {
                        return;
                    }
                }
            }
        };
        let past_end =
            group.shared.is_some_and(|p| p > end) || group.own.values().any(|p| *p > end);
        if past_end {
            let start = bus.log.start(shard).await.unwrap_or(0);
            rolled_back(&self.id, &mut group, end, start);
        }
        if group.shared.is_none() && end > 0 {
            // Events, but no position was ever committed for the shard: its first run was
            // stopped (a crash) before its first commit, or events came before any replica
            // ran it. They were accepted for these subscriptions, so they are delivered
            // (from the log's start), not skipped as a new subscription's would be.
            let start = bus.log.start(shard).await.unwrap_or(0);
            tracing::warn!(task = %self.id, from = start, end, "the shard has events but no committed positions; delivering them from the log's start");
            group.shared = Some(start);
            Arc::make_mut(&mut group.known)
                .extend(bus.subscriptions.iter().map(|s| s.name.clone()));
        }
        let cursor = group.shared.unwrap_or(end);
        let lanes: Vec<Arc<Lane>> = bus
            .subscriptions
            .iter()
            .map(|sub| {
                let mode = start_mode(group.of(&sub.name), cursor, end);
                Lane::new(sub.clone(), shard, mode, &control)
            })
            .collect();
        let shared = Arc::new(Shared {
            shard,
            dispatch: Mutex::new(Dispatch {
                cursor,
                bus: bus.clone(),
                lanes,
            }),
            queued: AtomicUsize::new(0),
            drained: tokio::sync::Notify::new(),
            running_lanes: AtomicUsize::new(0),
            failed_lanes: AtomicUsize::new(0),
            changes: AtomicU64::new(1),
            delivery: self.delivery.clone(),
            cluster: self.cluster.clone(),
            valid_until: self.valid_until.clone(),
            stop: self.stop.clone(),
            accepted: Mutex::new(VecDeque::new()),
            reopen: std::sync::atomic::AtomicBool::new(false),
            last_accepted: AtomicU64::new(0),
        });
        let reports = shared.apply_control(&control, true);
        let mut statuses = vec![(self.id.clone(), State::Running, None)];
        statuses.extend(reports);
        self.cluster.report_many(statuses).await;
        shared.wake_lanes();
        tracing::info!(task = %self.id, from = cursor, end, subscriptions = bus.subscriptions.len(), "shard reader started");
        let mut recorded = 0;
        self.record(&shared, &mut recorded);
        // A new subscription of a shard with committed positions starts at the end of the
        // shard. That start is committed before anything is read for it: after a crash
        // before that commit it would be new again and start at the then end, skipping every
        // event accepted in between. (A shard with no committed positions at all starts at
        // the log's start after such a crash: see above.)
        let starts_new = group.shared.is_some()
            && bus
                .subscriptions
                .iter()
                .any(|s| group.of(&s.name).is_none());
        if starts_new {
            self.wait_committed(&bus).await;
        }

        let mut reader = ReaderLoop {
            shared: shared.clone(),
            log: bus.log.clone(),
            reader: None,
            read_wait: self.read_wait,
            batch: self.delivery.batch_size,
            backoff: self.delivery.initial_backoff,
        };
        let mut commit = tokio::time::interval(self.delivery.commit_interval);
        commit.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut check = tokio::time::interval(Duration::from_millis(250));
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut lag = tokio::time::interval(LAG_INTERVAL);
        lag.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut expire = tokio::time::interval(EXPIRE_CHECK);
        expire.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The reader runs until the loop ends; dropping it then ends its blocking read.
        let mut reading = Box::pin(reader.run());
        loop {
            tokio::select! {
                _ = self.stop.changed() => break,
                () = &mut reading => break,
                _ = commit.tick() => self.record(&shared, &mut recorded),
                _ = lag.tick() => shared.report_lag(),
                _ = expire.tick() => {
                    if let Err(e) = shared.expire_backlog().await {
                        tracing::debug!(task = %self.id, error = %e, "cannot look for expired events");
                    }
                }
                _ = check.tick() => {
                    if !self.leased() {
                        break;
                    }
                    shared.check_failures().await;
                }
                changed = self.plans.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let bus = self.plans.borrow_and_update().clone();
                    match bus.log.end(shard).await {
                        Ok(end) => {
                            let control = self.control.borrow().clone();
                            let reports = shared.replace_plan(bus, end, &control);
                            self.cluster.report_many(reports).await;
                            shared.wake_lanes();
                        }
                        Err(e) => {
                            // Applied on the next change; the worker restarts the task if
                            // the store stays away longer than the lease.
                            tracing::warn!(task = %self.id, error = %e, "cannot apply the new rules yet");
                            self.plans.mark_changed();
                        }
                    }
                }
                changed = self.control.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let control = self.control.borrow_and_update().clone();
                    let reports = shared.apply_control(&control, false);
                    self.cluster.report_many(reports).await;
                    shared.wake_lanes();
                }
            }
        }
        drop(reading);
        drop(reader);
        // Lanes see the stop (or the lease lapse) themselves; give their deliveries in
        // flight a moment to finish so their positions are recorded.
        shared.wait_lanes_idle().await;
        self.record(&shared, &mut recorded);
        // The shard's lag is reported by whichever replica runs it next.
        shared.clear_lag();
    }

    async fn load(&self, bus: &BusPlan) -> Result<(GroupPositions, Seq), StoreError> {
        let mut group = self.positions.load_group(&bus.name, self.shard).await?;
        let end = bus.log.end(self.shard).await?;
        if group.shared.is_none() && end > 0 {
            // A shard with events but no shard positions was run by a version that kept one
            // position per subscription: carry those over rather than start at the end and
            // skip what they had not delivered yet. (A new bus has no events: nothing to read.)
            for sub in &bus.subscriptions {
                if let Some(p) = self.positions.load(&sub.id, self.shard).await? {
                    group.own.insert(sub.name.clone(), p);
                    Arc::make_mut(&mut group.known).insert(sub.name.clone());
                }
            }
            if !group.own.is_empty() {
                tracing::info!(task = %self.id, subscriptions = group.own.len(), "carried over per-subscription positions");
                group.shared = group.own.values().copied().min();
            }
        }
        Ok((group, end))
    }

    /// Waits until the shard's positions, with every subscription of `bus` known, are
    /// committed (the commit loop's next tick), or the task stops.
    async fn wait_committed(&self, bus: &BusPlan) {
        loop {
            let committed = self
                .positions
                .committed_group(&bus.name, self.shard)
                .is_some_and(|g| {
                    g.shared.is_some()
                        && bus.subscriptions.iter().all(|s| g.known.contains(&s.name))
                });
            if committed || *self.stop.borrow() || !self.leased() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits out a backoff; true if the task should stop.
    async fn wait(&mut self, backoff: &mut Duration) -> bool {
        let wait = *backoff;
        *backoff = (*backoff * 2).min(self.delivery.max_backoff);
        tokio::select! {
            _ = tokio::time::sleep(wait) => *self.stop.borrow() || !self.leased(),
            _ = self.stop.changed() => true,
        }
    }

    /// Hands the lanes' positions to the position store if any moved.
    fn record(&self, shared: &Shared, recorded: &mut u64) {
        let changes = shared.changes.load(Ordering::Acquire);
        if changes == *recorded {
            return;
        }
        let (bus, positions) = shared.positions();
        self.positions.set_group(&bus, self.shard, positions);
        *recorded = changes;
    }
}

/// Positions past the end of the log mean the store lost events it had (an embedded log
/// after a power loss with durability `os`, Redis restarted from an older snapshot or failed
/// over to a lagging replica): events appended since get the sequence numbers those
/// positions are already past, and would never be delivered. Which of the log's events
/// came after the rollback cannot be told here, so such positions go back to the log's
/// `start`: what it still holds is delivered again (duplicates, never a loss; a bus with a
/// long retention sends more again); what was lost is said in the log. (A running reader
/// that sees the rollback goes back less far: to the events accepted since the last one it
/// read.)
fn rolled_back(task: &str, group: &mut GroupPositions, end: Seq, start: Seq) {
    let start = start.min(end);
    let mut behind_end = Vec::new();
    if let Some(shared) = group.shared.filter(|s| *s > end) {
        behind_end.push(("(shared)".to_string(), shared));
        group.shared = Some(start);
    }
    for (name, p) in group.own.iter_mut() {
        if *p > end {
            behind_end.push((name.clone(), *p));
            *p = start;
        }
    }
    if let Some(highest) = behind_end.iter().map(|(_, p)| *p).max() {
        tracing::error!(
            task,
            log_end = end,
            position = highest,
            subscriptions = behind_end.len(),
            from = start,
            "the log ends before positions already committed: the store rolled back and lost the events from `log_end` up to `position`; delivering again from the log's start (`from`) so the events appended since are not skipped"
        );
    }
}

/// Where a lane starts: new subscriptions at the end of the shard, known ones at their
/// position (on the shared path if that is the reader's, else catching up or ahead).
fn start_mode(position: Option<Seq>, cursor: Seq, end: Seq) -> Mode {
    match position {
        None => Mode::Attached {
            from: end.max(cursor),
        },
        Some(p) if p >= cursor => Mode::Attached { from: p },
        Some(p) => Mode::CatchingUp { next: p },
    }
}

impl Shared {
    fn leased(&self) -> bool {
        mono_ms() < self.valid_until.load(Ordering::Relaxed)
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow() || !self.leased()
    }

    fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Sets each lane's lag gauges: the shard's end minus the lane's position, and the age
    /// of the oldest event it has not delivered (exact for what it holds in memory, else
    /// from the acceptance times sampled as the reader went: at most one batch older).
    fn report_lag(&self) {
        let d = lock(&self.dispatch);
        let end = *d.bus.log.tail(self.shard).borrow();
        let now = crate::store::now_ms();
        let samples = lock(&self.accepted);
        for lane in &d.lanes {
            let st = lock(&lane.state);
            let p = Lane::position(&st, d.cursor);
            let behind = end.saturating_sub(p);
            let gauges = lane.gauges(self.shard);
            gauges.events.set(i64::try_from(behind).unwrap_or(i64::MAX));
            let oldest = if behind == 0 {
                None
            } else if st.in_flight_accepted > 0 {
                Some(st.in_flight_accepted)
            } else if let Some(q) = st.queue.front().filter(|q| q.envelope.accepted_ms > 0) {
                Some(q.envelope.accepted_ms)
            } else {
                // The sample at or before the position, else the oldest one there is.
                samples
                    .iter()
                    .rev()
                    .find(|(seq, _)| *seq <= p)
                    .or_else(|| samples.front())
                    .map(|(_, t)| *t)
            };
            let age = oldest.map_or(0.0, |t| now.saturating_sub(t) as f64 / 1000.0);
            gauges.seconds.set(age);
        }
    }

    fn clear_lag(&self) {
        let d = lock(&self.dispatch);
        for lane in &d.lanes {
            let gauges = lane.gauges(self.shard);
            gauges.events.set(0);
            gauges.seconds.set(0.0);
        }
    }

    /// The positions of every lane: the reader's as `shared`, and the lanes that differ.
    fn positions(&self) -> (String, GroupPositions) {
        let d = lock(&self.dispatch);
        let mut own = BTreeMap::new();
        for lane in &d.lanes {
            let p = Lane::position(&lock(&lane.state), d.cursor);
            if p != d.cursor {
                own.insert(lane.sub.name.clone(), p);
            }
        }
        (
            d.bus.name.clone(),
            GroupPositions {
                shared: Some(d.cursor),
                own,
                // The lanes are the plan's subscriptions.
                known: d.bus.known.clone(),
            },
        )
    }

    /// Hands a batch of records to the lanes that take them.
    fn dispatch(self: &Arc<Self>, records: Vec<Record>) {
        let Some(last) = records.last().map(|r| r.seq) else {
            return;
        };
        if let Some(t) = records.last().map(|r| r.accepted_ms).filter(|t| *t > 0) {
            self.last_accepted.store(t, Ordering::Relaxed);
        }
        if let Some(first) = records.first().filter(|r| r.accepted_ms > 0) {
            let mut samples = lock(&self.accepted);
            samples.push_back((first.seq, first.accepted_ms));
            if samples.len() > ACCEPTED_SAMPLES {
                samples.pop_front();
            }
        }
        let mut d = lock(&self.dispatch);
        let bus = d.bus.clone();
        let limit = self.delivery.batch_size * LANE_QUEUE_BATCHES;
        let mut rules = Vec::new();
        // Lanes that got events and had no task: run once the batch is handed out.
        let mut ready = Vec::new();
        for record in records {
            if record.seq < d.cursor {
                continue;
            }
            let mut record_decoded: Option<usize> = None;
            let event = if bus.needs_decode {
                match event::decode(&record.payload) {
                    Ok(event) => Some(event),
                    Err(e) => {
                        tracing::error!(bus = %bus.name, shard = self.shard, seq = record.seq, error = %e, "a stored event does not decode; only rules without a condition take it");
                        None
                    }
                }
            } else {
                None
            };
            if bus.needs_decode {
                bus.matching(event.as_ref(), &mut rules);
            } else {
                rules.clear();
                rules.extend(0..bus.rules.len());
            }
            for &rule in &rules {
                let Some(members) = bus.rules.get(rule) else {
                    continue;
                };
                for &i in members {
                    let Some(lane) = d.lanes.get(i) else {
                        continue;
                    };
                    let mut st = lock(&lane.state);
                    let Mode::Attached { from } = st.mode else {
                        continue;
                    };
                    if record.seq < from {
                        continue;
                    }
                    if st.queue.len() >= limit || st.queued >= LANE_QUEUE_BYTES {
                        tracing::debug!(lane = %lane.id, seq = record.seq, "the lane is behind; it catches up from the log on its own");
                        st.mode = Mode::CatchingUp { next: record.seq };
                        self.ensure_running(lane, &mut st);
                        continue;
                    }
                    if let Some(envelope) = prepare(
                        &lane.sub,
                        self.shard,
                        record.seq,
                        &record.payload,
                        record.accepted_ms,
                        event.as_ref(),
                    ) {
                        lane.sub.delivery.metrics().matched.inc();
                        // The record's decoded size is estimated once, whatever the number
                        // of lanes taking it as stored.
                        let bytes = if envelope.event.is_some()
                            && envelope.raw.as_ptr() == record.payload.as_ptr()
                        {
                            let decoded = *record_decoded
                                .get_or_insert_with(|| decoded_bytes(&record.payload));
                            envelope_size(&envelope, decoded)
                        } else {
                            envelope_bytes(&envelope)
                        };
                        self.queued.fetch_add(bytes, Ordering::Relaxed);
                        st.queued += bytes;
                        st.queue.push_back(Queued {
                            seq: record.seq,
                            envelope,
                            bytes,
                        });
                        if self.claim(&mut st) {
                            ready.push(lane.clone());
                        }
                    }
                }
            }
        }
        d.cursor = last + 1;
        drop(d);
        self.changed();
        self.run_ready(ready);
    }

    /// Marks the lane's task as running unless it runs already or the lane is paused: true
    /// when the caller is to run it.
    fn claim(&self, st: &mut LaneState) -> bool {
        if st.running || matches!(st.mode, Mode::Paused { .. }) {
            return false;
        }
        st.running = true;
        self.running_lanes.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Starts the lane's task if it has none.
    fn ensure_running(self: &Arc<Self>, lane: &Arc<Lane>, st: &mut LaneState) {
        if self.claim(st) {
            tokio::spawn(LaneTask::new(self.clone(), lane.clone()).run());
        }
    }

    /// Runs the tasks of lanes that were just handed events (claimed) on the reader, as
    /// long as each delivery is done on its first poll (a quick target such as a file with
    /// durability `os`): with thousands of subscriptions an event is often a delivery of
    /// its own, and a task spawned per delivery cost more than the delivery. A lane whose
    /// delivery has to wait (a network target, a retry's backoff) goes on as a task of its
    /// own from where it stopped, so a slow target still does not hold up the reader. Only
    /// queued events are delivered here: a lane of the shared path that falls behind is
    /// switched to catching up by the reader, which starts a task for it.
    ///
    /// Writes to files are combined over the pass (`combine_writes`): the lanes' first
    /// deliveries wait for one write per file at the end of it, and are then polled again.
    fn run_ready(self: &Arc<Self>, ready: Vec<Arc<Lane>>) {
        if ready.is_empty() {
            return;
        }
        let mut waiting = Vec::new();
        {
            let _combine = crate::targets::combine_writes();
            for lane in ready {
                let mut task = Box::pin(LaneTask::new(self.clone(), lane).run());
                if futures_util::FutureExt::now_or_never(&mut task).is_none() {
                    waiting.push(task);
                }
            }
        }
        for mut task in waiting {
            if futures_util::FutureExt::now_or_never(&mut task).is_none() {
                tokio::spawn(task);
            }
        }
    }

    /// Starts the tasks of lanes that have work without the reader (catching up).
    fn wake_lanes(self: &Arc<Self>) {
        let d = lock(&self.dispatch);
        for lane in &d.lanes {
            let mut st = lock(&lane.state);
            if matches!(st.mode, Mode::CatchingUp { .. }) || !st.queue.is_empty() {
                self.ensure_running(lane, &mut st);
            }
        }
    }

    /// Applies pause, resume and restart to the lanes; returns the statuses to write (all
    /// of them when `all`, else those that changed). The shard-0 task also reports each
    /// subscription's connector status.
    ///
    /// A subscription this replica cannot run (`Subscription::failed`) is held like a
    /// paused one whatever the control says: nothing delivered, nothing skipped, its
    /// position kept for a replica that can run it; it is reported `FAILED` with why.
    fn apply_control(&self, control: &Control, all: bool) -> Vec<(String, State, Option<String>)> {
        let d = lock(&self.dispatch);
        let mut reports = Vec::new();
        let state_of = |failed: Option<&String>, paused: bool| match failed {
            Some(reason) => (State::Failed, Some(reason.clone())),
            None if paused => (State::Paused, None),
            None => (State::Running, None),
        };
        for lane in &d.lanes {
            let failed = lane.sub.failed.as_ref();
            let paused = failed.is_some() || control.is_paused(&lane.sub.id, &lane.id);
            let generation = control.generation(&lane.sub.id, &lane.id);
            let mut st = lock(&lane.state);
            let position = Lane::position(&st, d.cursor);
            let mut changed = all;
            if let (Some(reason), false) = (failed, st.paused) {
                // Logged at ERROR once per catalog version where the plan is built.
                tracing::debug!(lane = %lane.id, position, reason = %reason, "the subscription cannot run on this replica; holding its events at its position");
                self.clear_queue(&mut st);
                st.mode = Mode::Paused { next: position };
                st.epoch += 1;
                changed = true;
            } else if paused && !st.paused {
                tracing::info!(lane = %lane.id, position, "paused");
                self.clear_queue(&mut st);
                st.mode = Mode::Paused { next: position };
                st.epoch += 1;
                changed = true;
            } else if !paused && st.paused {
                tracing::info!(lane = %lane.id, position, "resumed");
                st.mode = Mode::CatchingUp { next: position };
                changed = true;
            } else if generation != st.generation && !paused && !all {
                tracing::info!(lane = %lane.id, position, "restarted: reading again from its position");
                self.clear_queue(&mut st);
                st.mode = Mode::CatchingUp { next: position };
                st.epoch += 1;
                changed = true;
            }
            st.paused = paused;
            st.generation = generation;
            if changed {
                let (state, reason) = state_of(failed, paused);
                reports.push((lane.id.clone(), state, reason));
            }
        }
        if self.shard == 0 {
            for lane in &d.lanes {
                let paused = control.paused.contains(&lane.sub.id);
                if all || reports.iter().any(|(id, _, _)| *id == lane.id) {
                    let (state, reason) = state_of(lane.sub.failed.as_ref(), paused);
                    reports.push((lane.sub.id.clone(), state, reason));
                }
            }
        }
        drop(d);
        self.changed();
        reports
    }

    /// Skips, for every subscription, the events older than the bus's `max_backlog_age`
    /// that it has not delivered yet (paused, failing with no dead-letter destination, far
    /// behind), so that one stuck subscription cannot hold the log forever. Costs one read
    /// of one record while nothing is that old; a binary search over the log otherwise.
    async fn expire_backlog(self: &Arc<Self>) -> Result<(), StoreError> {
        let (log, age, lowest, cursor) = {
            let d = lock(&self.dispatch);
            let lowest = d
                .lanes
                .iter()
                .map(|lane| Lane::position(&lock(&lane.state), d.cursor))
                .min()
                .unwrap_or(d.cursor)
                .min(d.cursor);
            (d.bus.log.clone(), d.bus.max_backlog_age, lowest, d.cursor)
        };
        // What the reader has read (or this replica appended): no store round trip while
        // every subscription keeps up with the reader.
        let end = (*log.tail(self.shard).borrow()).max(cursor);
        if lowest >= end {
            return Ok(());
        }
        let cutoff = crate::store::now_ms().saturating_sub(age.as_millis() as u64);
        let mut reader = log.reader(self.shard, lowest).await?;
        let Some(oldest) = reader.read(1).await?.into_iter().next() else {
            return Ok(());
        };
        // Records from before acceptance times were stored (0) have no age to judge.
        if oldest.accepted_ms == 0 || oldest.accepted_ms > cutoff {
            return Ok(());
        }
        let boundary =
            crate::replay::first_after(log.as_ref(), self.shard, lowest, end, cutoff).await?;
        if boundary > lowest {
            self.expire(boundary, age);
        }
        Ok(())
    }

    /// Moves every lane (and the reader) that is before `boundary` to it.
    fn expire(self: &Arc<Self>, boundary: Seq, age: Duration) {
        let mut d = lock(&self.dispatch);
        let cursor = d.cursor;
        let bus = d.bus.name.clone();
        if cursor < boundary {
            d.cursor = boundary;
            self.reopen.store(true, Ordering::Release);
            tracing::warn!(bus = %bus, shard = self.shard, from = cursor, to = boundary, max_backlog_age = ?age, "the shard's reader is behind by more than the bus's max_backlog_age; skipping to the first younger event");
        }
        for lane in &d.lanes {
            let mut st = lock(&lane.state);
            let position = Lane::position(&st, cursor);
            if position >= boundary {
                continue;
            }
            let skipped = boundary - position;
            lane.sub.delivery.metrics().expired.inc_by(skipped);
            tracing::warn!(
                lane = %lane.id,
                from = position,
                to = boundary,
                skipped,
                max_backlog_age = ?age,
                "events older than the bus's max_backlog_age were never delivered to this subscription; skipping them"
            );
            let idle = st.queue.is_empty() && st.in_flight.is_none();
            st.mode = match st.mode {
                Mode::Paused { .. } => Mode::Paused { next: boundary },
                Mode::Attached { from } if idle => Mode::Attached {
                    from: from.max(boundary),
                },
                _ => Mode::CatchingUp { next: boundary },
            };
            if !idle {
                // Abandon what is queued or in flight (a delivery retrying a failing
                // target): it is older than the boundary.
                self.clear_queue(&mut st);
                st.in_flight = None;
                st.in_flight_accepted = 0;
                st.epoch += 1;
            }
            if matches!(st.mode, Mode::CatchingUp { .. }) {
                self.ensure_running(lane, &mut st);
            }
        }
        drop(d);
        self.changed();
    }

    /// Moves the reader and every lane past `boundary` back to it (the log rolled back).
    fn rewind(self: &Arc<Self>, boundary: Seq) {
        let mut d = lock(&self.dispatch);
        let cursor = d.cursor;
        d.cursor = cursor.min(boundary);
        self.reopen.store(true, Ordering::Release);
        lock(&self.accepted).retain(|(seq, _)| *seq < boundary);
        for lane in &d.lanes {
            let mut st = lock(&lane.state);
            if Lane::position(&st, cursor) <= boundary {
                continue;
            }
            // What it holds was read from the log before the rollback: drop it.
            self.clear_queue(&mut st);
            st.in_flight = None;
            st.in_flight_accepted = 0;
            st.epoch += 1;
            st.mode = match st.mode {
                Mode::Paused { .. } => Mode::Paused { next: boundary },
                _ => Mode::Attached { from: boundary },
            };
        }
        drop(d);
        self.changed();
    }

    /// Drops a lane's queue (it will read those events again from the log).
    fn clear_queue(&self, st: &mut LaneState) {
        // Taken, not drained: the queue's memory goes with it.
        let bytes: usize = std::mem::take(&mut st.queue)
            .into_iter()
            .map(|q| q.bytes)
            .sum();
        st.queued = 0;
        self.release(bytes);
    }

    /// Takes delivered or dropped bytes off the shard's queue total.
    fn release(&self, bytes: usize) {
        let before = self.queued.fetch_sub(bytes, Ordering::Relaxed);
        if before >= SHARD_QUEUE_BYTES && before - bytes < SHARD_QUEUE_BYTES {
            self.drained.notify_one();
        }
    }

    /// Waits until the lanes have room for another batch of the reader. A wait longer than
    /// `SHED_AFTER` sheds the lanes holding a large share (slow targets): they catch up
    /// from the log on their own.
    async fn make_room(self: &Arc<Self>) {
        let mut since = tokio::time::Instant::now();
        while self.queued.load(Ordering::Relaxed) >= SHARD_QUEUE_BYTES && !self.stopping() {
            tokio::select! {
                () = self.drained.notified() => {}
                () = tokio::time::sleep(Duration::from_millis(50)) => {}
            }
            if since.elapsed() >= SHED_AFTER {
                self.shed_largest();
                since = tokio::time::Instant::now();
            }
        }
    }

    fn shed_largest(self: &Arc<Self>) {
        let d = lock(&self.dispatch);
        for lane in &d.lanes {
            let mut st = lock(&lane.state);
            if st.queued < LANE_QUEUE_BYTES / 4 {
                continue;
            }
            let Some(next) = st.queue.front().map(|q| q.seq) else {
                continue;
            };
            if let Mode::Attached { .. } | Mode::CatchingUp { .. } = st.mode {
                tracing::debug!(lane = %lane.id, queued = st.queued, "the lane holds much of the shard's queue; it catches up from the log on its own");
                self.clear_queue(&mut st);
                st.mode = Mode::CatchingUp { next };
                self.ensure_running(lane, &mut st);
            }
        }
    }

    /// Takes a new definition of the bus: unchanged subscriptions keep their lanes, changed
    /// ones continue from their position, new ones start at `end`, removed ones stop.
    fn replace_plan(
        &self,
        bus: Arc<BusPlan>,
        end: Seq,
        control: &Control,
    ) -> Vec<(String, State, Option<String>)> {
        let mut d = lock(&self.dispatch);
        let cursor = d.cursor;
        let mut old: HashMap<String, Arc<Lane>> = d
            .lanes
            .drain(..)
            .map(|lane| (lane.sub.name.clone(), lane))
            .collect();
        let mut lanes = Vec::with_capacity(bus.subscriptions.len());
        let mut reports = Vec::new();
        for sub in &bus.subscriptions {
            match old.remove(&sub.name) {
                Some(lane) if lane.sub.spec == sub.spec => lanes.push(lane),
                Some(lane) => {
                    let position = self.retire(&lane, cursor);
                    tracing::info!(lane = %lane.id, position, "the subscription changed; it continues from its position");
                    let mode = if position == cursor {
                        Mode::Attached { from: cursor }
                    } else {
                        Mode::CatchingUp { next: position }
                    };
                    // One that runs here now after failing: its FAILED status goes (one
                    // that fails now is reported by `apply_control`).
                    if lane.sub.failed.is_some() && sub.failed.is_none() {
                        reports.push((lane.id.clone(), State::Running, None));
                        if self.shard == 0 {
                            reports.push((sub.id.clone(), State::Running, None));
                        }
                    }
                    lanes.push(Lane::new(sub.clone(), self.shard, mode, control));
                }
                None => {
                    tracing::info!(subscription = %sub.id, shard = self.shard, from = end.max(cursor), "new subscription starts at the end of the shard");
                    let lane = Lane::new(
                        sub.clone(),
                        self.shard,
                        Mode::Attached {
                            from: end.max(cursor),
                        },
                        control,
                    );
                    reports.push((lane.id.clone(), State::Running, None));
                    lanes.push(lane);
                }
            }
        }
        for lane in old.values() {
            tracing::info!(lane = %lane.id, "the subscription was removed");
            self.retire(lane, cursor);
            crate::metrics::get().forget_lag(&lane.sub.id, self.shard);
        }
        d.bus = bus;
        d.lanes = lanes;
        drop(d);
        // Lanes made anew start unpaused: apply pause state and report them.
        reports.extend(self.apply_control(control, false));
        self.changed();
        reports
    }

    /// Stops a lane for good; returns its position.
    fn retire(&self, lane: &Lane, cursor: Seq) -> Seq {
        let mut st = lock(&lane.state);
        let position = Lane::position(&st, cursor);
        self.clear_queue(&mut st);
        st.mode = Mode::Paused { next: position };
        st.paused = true;
        st.epoch += 1;
        position
    }

    /// Reports lanes whose deliveries are failing (and those that recovered).
    async fn check_failures(&self) {
        if self.running_lanes.load(Ordering::Relaxed) == 0
            && self.failed_lanes.load(Ordering::Relaxed) == 0
        {
            return;
        }
        let mut reports = Vec::new();
        {
            let d = lock(&self.dispatch);
            for lane in &d.lanes {
                let mut st = lock(&lane.state);
                if st.paused {
                    continue;
                }
                let busy = st.in_flight.is_some();
                match lane.sub.delivery.last_error() {
                    Some(reason) if busy && !st.failed => {
                        st.failed = true;
                        self.failed_lanes.fetch_add(1, Ordering::Relaxed);
                        reports.push((lane.id.clone(), State::Failed, Some(reason)));
                    }
                    None if st.failed => {
                        st.failed = false;
                        self.failed_lanes.fetch_sub(1, Ordering::Relaxed);
                        reports.push((lane.id.clone(), State::Running, None));
                    }
                    _ => {}
                }
            }
        }
        if !reports.is_empty() && self.leased() {
            self.cluster.report_many(reports).await;
        }
    }

    /// Waits until no lane task runs (they stop on their own once the task stops).
    async fn wait_lanes_idle(&self) {
        let deadline = tokio::time::Instant::now() + STOP_GRACE + Duration::from_millis(200);
        loop {
            let busy = self.running_lanes.load(Ordering::Relaxed) > 0;
            if !busy || tokio::time::Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

/// The envelope a subscription delivers for one record: the record as stored, or the
/// transform chain's result. `None` when the transform fails on this event (reported; it
/// cannot succeed on a retry).
fn prepare(
    sub: &Subscription,
    shard: u32,
    seq: Seq,
    payload: &Bytes,
    accepted_ms: u64,
    event: Option<&Event>,
) -> Option<Envelope> {
    let Some(chain) = &sub.transform else {
        return Some(Envelope {
            raw: payload.clone(),
            accepted_ms,
            event: event.cloned(),
            body: None,
        });
    };
    let Some(event) = event else {
        tracing::error!(subscription = %sub.id, shard, seq, "the event does not decode, so it cannot be transformed; skipping it");
        return None;
    };
    match chain.apply(event) {
        Ok(Output::Event(transformed)) => match event::encode(&transformed) {
            Ok(raw) => Some(Envelope {
                raw: raw.into(),
                accepted_ms,
                event: Some(transformed),
                body: None,
            }),
            Err(e) => {
                tracing::error!(subscription = %sub.id, shard, seq, error = %e, "cannot encode a transformed event; skipping it");
                None
            }
        },
        Ok(Output::Body {
            content_type,
            bytes,
        }) => Some(Envelope {
            raw: payload.clone(),
            accepted_ms,
            event: Some(event.clone()),
            body: Some(Body {
                content_type,
                bytes: bytes.into(),
            }),
        }),
        Err(e) => {
            tracing::error!(subscription = %sub.id, shard, seq, error = %e, "the transform failed on this event; skipping it");
            None
        }
    }
}

/// What an envelope holds in memory: the stored form, the decoded event when it holds one,
/// and a transformed body. A decoded event's JSON data is a tree of values that can take
/// many times its text (`[0,0,…]`: 2 bytes of text, 32 of tree per element), so it is
/// counted by its JSON structure, not by its length: queues stay bounded by bytes whatever
/// the events look like.
fn envelope_bytes(envelope: &Envelope) -> usize {
    let decoded = if envelope.event.is_some() {
        decoded_bytes(&envelope.raw)
    } else {
        0
    };
    envelope_size(envelope, decoded)
}

/// `envelope_bytes` with the decoded event's size already known.
fn envelope_size(envelope: &Envelope, decoded: usize) -> usize {
    envelope.raw.len() + decoded + envelope.body.as_ref().map_or(0, |b| b.bytes.len()) + 128
}

/// An upper estimate of the memory a stored event takes decoded: its text plus about 48
/// bytes per JSON value or member (each `,` `:` `[` `{` starts at most one).
fn decoded_bytes(raw: &[u8]) -> usize {
    let nodes = raw
        .iter()
        .filter(|b| matches!(b, b',' | b':' | b'[' | b'{'))
        .count();
    raw.len() + nodes * 48
}

/// The shard reader: reads the log from the shared position and hands records out.
struct ReaderLoop {
    shared: Arc<Shared>,
    log: Arc<dyn crate::store::BusLog>,
    reader: Option<Box<dyn ShardReader>>,
    read_wait: Duration,
    batch: usize,
    backoff: Duration,
}

impl ReaderLoop {
    async fn run(&mut self) {
        let mut idle_check = tokio::time::Instant::now();
        loop {
            if self.shared.stopping() {
                return;
            }
            if self.shared.queued.load(Ordering::Relaxed) >= SHARD_QUEUE_BYTES {
                self.shared.make_room().await;
                continue;
            }
            let cursor = lock(&self.shared.dispatch).cursor;
            if self.shared.reopen.swap(false, Ordering::AcqRel) {
                self.reader = None;
            }
            if self.reader.is_none() {
                match self.log.reader(self.shared.shard, cursor).await {
                    Ok(mut r) => {
                        r.set_max_bytes(self.shared.delivery.batch_bytes);
                        self.reader = Some(r);
                    }
                    Err(e) => {
                        self.failed(e).await;
                        continue;
                    }
                }
            }
            let Some(reader) = self.reader.as_mut() else {
                continue;
            };
            match reader.read_wait(self.batch, self.read_wait).await {
                Ok(records) if records.is_empty() => {
                    // Idle: now and then check the log still reaches the reader's position
                    // (a store that rolled back underneath never will, and the events
                    // appended since would get sequence numbers it is already past).
                    if idle_check.elapsed() >= ROLLBACK_CHECK {
                        idle_check = tokio::time::Instant::now();
                        if let Ok(end) = self.log.end(self.shared.shard).await {
                            if end < cursor {
                                self.rolled_back(end, cursor).await;
                            }
                        }
                    }
                }
                Ok(records) => {
                    idle_check = tokio::time::Instant::now();
                    self.backoff = self.shared.delivery.initial_backoff;
                    if let Some(first) = records.first() {
                        if first.seq > cursor {
                            // Trimmed past the reader's position (released by a slower
                            // setting or by hand): continue at what is there.
                            tracing::warn!(
                                shard = self.shared.shard,
                                expected = cursor,
                                found = first.seq,
                                "records are missing from the shard"
                            );
                        }
                    }
                    self.shared.dispatch(records);
                }
                Err(e) => {
                    self.reader = None;
                    self.failed(e).await;
                }
            }
        }
    }

    /// The log ends at `end`, below the reader's position: the store rolled back (Redis
    /// restored from an older snapshot or failed over to a lagging replica). Goes back to
    /// the first event accepted since shortly before the last one the reader saw, so the
    /// events appended since the rollback are delivered, not skipped (some that were
    /// delivered before may be delivered again).
    async fn rolled_back(&mut self, end: Seq, cursor: Seq) {
        let shard = self.shared.shard;
        let seen = self.shared.last_accepted.load(Ordering::Relaxed);
        let start = self.log.start(shard).await.unwrap_or(0);
        let boundary = if seen == 0 {
            start
        } else {
            let since = seen.saturating_sub(ROLLBACK_MARGIN_MS);
            match crate::replay::first_after(self.log.as_ref(), shard, start, end, since).await {
                Ok(boundary) => boundary,
                Err(e) => {
                    tracing::warn!(shard, error = %e, "cannot search the rolled-back log; checking again shortly");
                    return;
                }
            }
        };
        let bus = lock(&self.shared.dispatch).bus.name.clone();
        tracing::error!(
            bus = %bus,
            shard,
            log_end = end,
            position = cursor,
            from = boundary,
            "the log now ends before the reader's position: the store rolled back and lost the events from `log_end` up to `position`; delivering again from `from`, the first event accepted since shortly before the last one read, so the events appended since are not skipped"
        );
        self.shared.rewind(boundary);
        self.reader = None;
    }

    async fn failed(&mut self, e: StoreError) {
        let bus = lock(&self.shared.dispatch).bus.name.clone();
        tracing::error!(bus = %bus, shard = self.shared.shard, error = %e, "reading the shard failed; retrying");
        if self.shared.leased() {
            self.shared
                .cluster
                .report(
                    &shard_task_id(&bus, self.shared.shard),
                    State::Failed,
                    Some(e.to_string()),
                )
                .await;
        }
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(self.shared.delivery.max_backoff);
        tokio::time::sleep(wait).await;
    }
}

/// Delivers one lane's events, in order, while it has any; then ends.
struct LaneTask {
    shared: Arc<Shared>,
    lane: Arc<Lane>,
    /// The lane's own reader while catching up.
    reader: Option<(Box<dyn ShardReader>, Seq)>,
}

enum Work {
    /// Events [first, end) taken off the queue, holding `bytes` of the shard's queue.
    Queued {
        events: Vec<Envelope>,
        first: Seq,
        end: Seq,
        bytes: usize,
        epoch: u64,
    },
    CatchUp {
        next: Seq,
        epoch: u64,
    },
}

impl LaneTask {
    fn new(shared: Arc<Shared>, lane: Arc<Lane>) -> Self {
        LaneTask {
            shared,
            lane,
            reader: None,
        }
    }

    async fn run(mut self) {
        let mut backoff = self.shared.delivery.initial_backoff;
        loop {
            if self.shared.stopping() {
                break;
            }
            let Some(work) = self.next_work() else {
                return;
            };
            match work {
                Work::Queued {
                    events,
                    first,
                    end,
                    bytes,
                    epoch,
                } => {
                    let done = self.deliver(&events, epoch).await;
                    drop(events);
                    self.shared.release(bytes);
                    self.finish(first, end, epoch, done);
                    // Not done and not stopping: paused, restarted or replaced meanwhile;
                    // the next round sees the lane's new mode.
                    if !done && self.shared.stopping() {
                        break;
                    }
                }
                Work::CatchUp { next, epoch } => match self.catch_up(next, epoch).await {
                    Ok(true) => backoff = self.shared.delivery.initial_backoff,
                    Ok(false) => break,
                    Err(e) => {
                        tracing::error!(lane = %self.lane.id, error = %e, "reading the shard failed; retrying");
                        self.reader = None;
                        let wait = backoff;
                        backoff = (backoff * 2).min(self.shared.delivery.max_backoff);
                        tokio::time::sleep(wait).await;
                    }
                },
            }
        }
        lock(&self.lane.state).running = false;
        self.shared.running_lanes.fetch_sub(1, Ordering::Relaxed);
    }

    /// What to do next: queued events first (they come before the catch-up position), then
    /// catching up; `None` (and the task ends) when there is nothing.
    fn next_work(&self) -> Option<Work> {
        let mut st = lock(&self.lane.state);
        if matches!(st.mode, Mode::Paused { .. }) {
            st.running = false;
            self.shared.running_lanes.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        if !st.queue.is_empty() {
            // Up to `batch_size` events and `batch_bytes` (the last may go past it).
            let max = self.shared.delivery.batch_size.max(1);
            let mut n = 0;
            let mut bytes = 0;
            for q in st.queue.iter().take(max) {
                if bytes >= self.shared.delivery.batch_bytes {
                    break;
                }
                bytes += q.bytes;
                n += 1;
            }
            let mut events = Vec::with_capacity(n);
            let (mut first, mut end, mut bytes) = (0, 0, 0);
            for (i, q) in st.queue.drain(..n).enumerate() {
                if i == 0 {
                    first = q.seq;
                }
                end = q.seq + 1;
                bytes += q.bytes;
                events.push(q.envelope);
            }
            st.queued -= bytes;
            st.in_flight = Some((first, end));
            st.in_flight_accepted = events.first().map_or(0, |e| e.accepted_ms);
            return Some(Work::Queued {
                events,
                first,
                end,
                bytes,
                epoch: st.epoch,
            });
        }
        if let Mode::CatchingUp { next } = st.mode {
            return Some(Work::CatchUp {
                next,
                epoch: st.epoch,
            });
        }
        // Idle: give the queue's memory back (with thousands of subscriptions, queues each
        // grown once by a burst would otherwise hold it for good).
        st.queue = VecDeque::new();
        st.running = false;
        self.shared.running_lanes.fetch_sub(1, Ordering::Relaxed);
        None
    }

    /// Records the end of a delivery of [first, end).
    fn finish(&self, first: Seq, end: Seq, epoch: u64, done: bool) {
        let mut st = lock(&self.lane.state);
        if st.in_flight.map(|(f, _)| f) == Some(first) {
            st.in_flight = None;
            st.in_flight_accepted = 0;
        }
        if done {
            // Paused (or replaced) while this was in flight: it went through after all, so
            // the lane resumes after it rather than sending it again.
            if let Mode::Paused { next } = st.mode {
                if next == first && st.epoch != epoch {
                    st.mode = Mode::Paused { next: end };
                }
            }
        }
        drop(st);
        self.shared.changed();
    }

    /// Reads one batch of the log from `next` with the lane's own filter and delivers it;
    /// attaches to the shared path once caught up. `Ok(false)` when stopped.
    async fn catch_up(&mut self, next: Seq, epoch: u64) -> Result<bool, StoreError> {
        let log = lock(&self.shared.dispatch).bus.log.clone();
        let reader = match self.reader.take() {
            Some((r, at)) if at == next => r,
            _ => {
                let mut r = log.reader(self.shared.shard, next).await?;
                r.set_max_bytes(self.shared.delivery.batch_bytes);
                r
            }
        };
        let mut reader = reader;
        let records = reader.read(self.shared.delivery.batch_size).await?;
        let Some(read_end) = records.last().map(|r| r.seq + 1) else {
            self.reader = Some((reader, next));
            self.attach(next);
            return Ok(true);
        };
        let first_accepted = records.first().map_or(0, |r| r.accepted_ms);
        let (events, end) = self.select(records);
        // Cut short (decoded, the batch grew past `batch_bytes`): read the rest again.
        self.reader = (end == read_end).then_some((reader, end));
        let last = end - 1;
        {
            let mut st = lock(&self.lane.state);
            if st.epoch != epoch {
                return Ok(true);
            }
            st.in_flight = Some((next, last + 1));
            st.in_flight_accepted = first_accepted;
        }
        let done = self.deliver(&events, epoch).await;
        {
            let mut st = lock(&self.lane.state);
            st.in_flight = None;
            st.in_flight_accepted = 0;
            if done && st.epoch == epoch {
                if let Mode::CatchingUp { next: n } = &mut st.mode {
                    *n = last + 1;
                }
            }
        }
        self.shared.changed();
        if !done {
            return Ok(!self.shared.stopping());
        }
        self.attach(last + 1);
        Ok(true)
    }

    /// Joins the shared path if the lane has reached the reader.
    fn attach(&self, next: Seq) {
        let d = lock(&self.shared.dispatch);
        let mut st = lock(&self.lane.state);
        if st.mode == (Mode::CatchingUp { next }) && next >= d.cursor {
            tracing::debug!(lane = %self.lane.id, at = next, "caught up; back on the shared path");
            st.mode = Mode::Attached { from: next };
        }
        drop(st);
        drop(d);
        self.shared.changed();
    }

    /// The records this lane's subscription takes, transformed (per-subscription work only
    /// while catching up), and one past the last record looked at: decoded events can take
    /// many times their stored size, so the batch stops once it holds `batch_bytes` (at
    /// least one record is looked at).
    fn select(&self, records: Vec<Record>) -> (Vec<Envelope>, Seq) {
        let sub = &self.lane.sub;
        let mut out = Vec::with_capacity(records.len());
        let mut end = records.first().map_or(0, |r| r.seq);
        let mut bytes = 0;
        for r in records {
            if bytes >= self.shared.delivery.batch_bytes {
                break;
            }
            end = r.seq + 1;
            let event = if sub.filter.matches_everything() && sub.transform.is_none() {
                None
            } else {
                match event::decode(&r.payload) {
                    Ok(event) => Some(event),
                    Err(e) => {
                        if !sub.filter.matches_everything() {
                            tracing::error!(subscription = %sub.id, shard = self.shared.shard, seq = r.seq, error = %e, "a stored event does not decode; skipping it");
                            continue;
                        }
                        None
                    }
                }
            };
            if let Some(e) = &event {
                if !sub.filter.matches(e) {
                    continue;
                }
            }
            if let Some(envelope) = prepare(
                sub,
                self.shared.shard,
                r.seq,
                &r.payload,
                r.accepted_ms,
                event.as_ref(),
            ) {
                bytes += envelope_bytes(&envelope);
                out.push(envelope);
            }
        }
        (out, end)
    }

    /// Delivers (retries, backoff and dead letters: see `delivery`); false if stopped, the
    /// lease lapsed or the lane was paused, restarted or replaced first. Stopping gives a
    /// delivery in flight `STOP_GRACE` to finish, so a graceful stop sends nothing twice.
    async fn deliver(&self, events: &[Envelope], epoch: u64) -> bool {
        if events.is_empty() {
            return true;
        }
        if !self.shared.leased() {
            return false;
        }
        let deliver = self.lane.sub.delivery.deliver(events);
        tokio::pin!(deliver);
        // Most deliveries to a quick target are done on their first poll: no timer for them.
        if futures_util::FutureExt::now_or_never(&mut deliver).is_some() {
            return true;
        }
        if crate::targets::combining() {
            // A write deferred to the end of the reader's pass (`run_ready`): done when the
            // reader polls again after it, still without a timer.
            YieldOnce(false).await;
            if futures_util::FutureExt::now_or_never(&mut deliver).is_some() {
                return true;
            }
        }
        let mut stop = self.shared.stop.clone();
        let mut check = tokio::time::interval_at(
            tokio::time::Instant::now() + Duration::from_millis(100),
            Duration::from_millis(100),
        );
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            if !self.shared.leased() {
                return false;
            }
            tokio::select! {
                () = &mut deliver => return true,
                _ = stop.changed() => {
                    let left = self.shared.valid_until.load(Ordering::Relaxed).saturating_sub(mono_ms());
                    let grace = STOP_GRACE.min(Duration::from_millis(left));
                    return tokio::time::timeout(grace, &mut deliver).await.is_ok();
                }
                _ = check.tick() => {
                    if lock(&self.lane.state).epoch != epoch {
                        return false;
                    }
                }
            }
        }
    }
}

/// `Pending` once (waking its task, which is then polled again), then `Ready`.
struct YieldOnce(bool);

impl std::future::Future for YieldOnce {
    type Output = ();

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_start_where_their_positions_say() {
        // New subscription: the end of the shard, even when the reader is behind it.
        assert_eq!(start_mode(None, 10, 50), Mode::Attached { from: 50 });
        // At the reader: on the shared path.
        assert_eq!(start_mode(Some(10), 10, 50), Mode::Attached { from: 10 });
        // Behind it: catches up first.
        assert_eq!(start_mode(Some(4), 10, 50), Mode::CatchingUp { next: 4 });
        // Ahead of it (created while the reader had a backlog): skips what came before.
        assert_eq!(start_mode(Some(30), 10, 50), Mode::Attached { from: 30 });
    }

    /// A subscription this replica cannot build is held where it would have started: the
    /// reader never hands it an event, and its position stays for a replica that can.
    #[test]
    fn a_subscription_that_cannot_run_here_holds_its_position() {
        let config = crate::config::Config::parse(std::path::Path::new("t.toml"), "").unwrap();
        let target_config: crate::config::TargetConfig =
            toml::from_str("type = \"log\"\nname = \"l\"").unwrap();
        let target: Arc<dyn crate::targets::Target> = Arc::new(crate::targets::Unavailable {
            reason: "environment variable X is not set".to_string(),
        });
        let delivery = crate::runtime::delivery::Delivery::unbuilt(
            &config,
            "r",
            "b/r/l",
            &target_config,
            target.clone(),
        );
        let sub = Arc::new(Subscription {
            id: "b/r/l".to_string(),
            name: "r/l".to_string(),
            bus: "b".to_string(),
            filter: Arc::new(crate::rules::Filter::All),
            transform: None,
            target,
            delivery: Arc::new(delivery),
            spec: 1,
            failed: Some("environment variable X is not set".to_string()),
        });
        let control = Control::default();
        for (mode, held) in [
            (Mode::Attached { from: 7 }, 7),
            (Mode::CatchingUp { next: 3 }, 3),
        ] {
            let lane = Lane::new(sub.clone(), 0, mode, &control);
            let st = lock(&lane.state);
            assert_eq!(st.mode, Mode::Paused { next: held });
            assert_eq!(Lane::position(&st, 10), held);
        }
    }
}
