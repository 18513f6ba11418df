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

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

mod lane;
mod lane_task;
mod reader;
mod shared;

use crate::runtime::delivery::DeliveryConfig;
use crate::runtime::plan::BusPlan;
use crate::store::cluster::{mono_ms, Cluster, Control, Lease, State};
use crate::store::{GroupPositions, PositionStore, Seq, StoreError};
use lane::*;
use reader::ReaderLoop;
use shared::Shared;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::plan::Subscription;

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
        let target_config: crate::targets::config::TargetConfig =
            toml::from_str("type = \"log\"\nname = \"l\"").unwrap();
        let target: Arc<dyn crate::targets::Target> = Arc::new(crate::targets::Unavailable {
            reason: "environment variable X is not set".to_string(),
        });
        let delivery = crate::runtime::delivery::Delivery::unbuilt(
            &crate::runtime::delivery::DeliveryConfig::default(),
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
