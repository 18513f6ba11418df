//! What the shard's reader and its lanes share: the lanes, the positions, the memory the
//! queues hold, and what happens when the plan, the controls or the retention change.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::runtime::plan::BusPlan;

use crate::runtime::delivery::DeliveryConfig;
use crate::runtime::shard::lane::*;
use crate::store::cluster::{mono_ms, Cluster, Control, State};
use crate::store::{GroupPositions, Seq, StoreError};

/// What the reader and the lanes share.
pub(super) struct Shared {
    pub(super) shard: u32,
    pub(super) dispatch: Mutex<Dispatch>,
    /// Bytes queued across lanes.
    pub(super) queued: AtomicUsize,
    /// Signalled when `queued` falls below `SHARD_QUEUE_BYTES` (the reader may be waiting).
    pub(super) drained: tokio::sync::Notify,
    /// Lane tasks running, and lanes reported FAILED: while both are zero there is nothing
    /// to check, so an idle shard costs nothing per subscription.
    pub(super) running_lanes: AtomicUsize,
    pub(super) failed_lanes: AtomicUsize,
    /// Bumped whenever a position may have moved, so unchanged positions are not
    /// recomputed or rewritten.
    pub(super) changes: AtomicU64,
    pub(super) delivery: DeliveryConfig,
    pub(super) cluster: Arc<dyn Cluster>,
    pub(super) valid_until: Arc<AtomicU64>,
    pub(super) stop: watch::Receiver<bool>,
    /// (seq, acceptance time) of the first record of recent batches the reader handed
    /// out, oldest first: how old the event at a position is, for lanes that hold none of
    /// it in memory (paused, catching up).
    pub(super) accepted: Mutex<VecDeque<(Seq, u64)>>,
    /// Set when the cursor was moved past what the reader read (expired events): the
    /// reader opens the log again at the cursor.
    pub(super) reopen: std::sync::atomic::AtomicBool,
    /// The acceptance time of the last record the reader handed out (0: none yet).
    pub(super) last_accepted: AtomicU64,
}

impl Shared {
    pub(super) fn leased(&self) -> bool {
        mono_ms() < self.valid_until.load(Ordering::Relaxed)
    }

    pub(super) fn stopping(&self) -> bool {
        *self.stop.borrow() || !self.leased()
    }

    pub(super) fn changed(&self) {
        self.changes.fetch_add(1, Ordering::Release);
    }

    /// Sets each lane's lag gauges: the shard's end minus the lane's position, and the age
    /// of the oldest event it has not delivered (exact for what it holds in memory, else
    /// from the acceptance times sampled as the reader went: at most one batch older).
    pub(super) fn report_lag(&self) {
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

    pub(super) fn clear_lag(&self) {
        let d = lock(&self.dispatch);
        for lane in &d.lanes {
            let gauges = lane.gauges(self.shard);
            gauges.events.set(0);
            gauges.seconds.set(0.0);
        }
    }

    /// The positions of every lane: the reader's as `shared`, and the lanes that differ.
    pub(super) fn positions(&self) -> (String, GroupPositions) {
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

    /// Applies pause, resume and restart to the lanes; returns the statuses to write (all
    /// of them when `all`, else those that changed). The shard-0 task also reports each
    /// subscription's connector status.
    ///
    /// A subscription this replica cannot run (`Subscription::failed`) is held like a
    /// paused one whatever the control says: nothing delivered, nothing skipped, its
    /// position kept for a replica that can run it; it is reported `FAILED` with why.
    pub(super) fn apply_control(
        &self,
        control: &Control,
        all: bool,
    ) -> Vec<(String, State, Option<String>)> {
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
    pub(super) async fn expire_backlog(self: &Arc<Self>) -> Result<(), StoreError> {
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
            crate::store::search::first_after(log.as_ref(), self.shard, lowest, end, cutoff)
                .await?;
        if boundary > lowest {
            self.expire(boundary, age);
        }
        Ok(())
    }

    /// Moves every lane (and the reader) that is before `boundary` to it.
    pub(super) fn expire(self: &Arc<Self>, boundary: Seq, age: Duration) {
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
    pub(super) fn rewind(self: &Arc<Self>, boundary: Seq) {
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
    pub(super) fn clear_queue(&self, st: &mut LaneState) {
        // Taken, not drained: the queue's memory goes with it.
        let bytes: usize = std::mem::take(&mut st.queue)
            .into_iter()
            .map(|q| q.bytes)
            .sum();
        st.queued = 0;
        self.release(bytes);
    }

    /// Takes delivered or dropped bytes off the shard's queue total.
    pub(super) fn release(&self, bytes: usize) {
        let before = self.queued.fetch_sub(bytes, Ordering::Relaxed);
        if before >= SHARD_QUEUE_BYTES && before - bytes < SHARD_QUEUE_BYTES {
            self.drained.notify_one();
        }
    }

    /// Waits until the lanes have room for another batch of the reader. A wait longer than
    /// `SHED_AFTER` sheds the lanes holding a large share (slow targets): they catch up
    /// from the log on their own.
    pub(super) async fn make_room(self: &Arc<Self>) {
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

    pub(super) fn shed_largest(self: &Arc<Self>) {
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
    pub(super) fn replace_plan(
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
    pub(super) fn retire(&self, lane: &Lane, cursor: Seq) -> Seq {
        let mut st = lock(&lane.state);
        let position = Lane::position(&st, cursor);
        self.clear_queue(&mut st);
        st.mode = Mode::Paused { next: position };
        st.paused = true;
        st.epoch += 1;
        position
    }

    /// Reports lanes whose deliveries are failing (and those that recovered).
    pub(super) async fn check_failures(&self) {
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
    pub(super) async fn wait_lanes_idle(&self) {
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
