//! A lane's task: delivers what its lane queued (or reads on its own while catching up),
//! and how the reader hands records to lanes and runs the ready ones (`dispatch`).

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::event;
use crate::runtime::chain::{prepare, through_functions};
use crate::runtime::shard::lane::*;
use crate::runtime::shard::shared::Shared;
use crate::store::cluster::mono_ms;
use crate::store::{Record, Seq, ShardReader, StoreError};
use crate::targets::Envelope;

impl Shared {
    /// Hands a batch of records to the lanes that take them.
    pub(super) fn dispatch(self: &Arc<Self>, records: Vec<Record>) {
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
    pub(super) fn claim(&self, st: &mut LaneState) -> bool {
        if st.running || matches!(st.mode, Mode::Paused { .. }) {
            return false;
        }
        st.running = true;
        self.running_lanes.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// Starts the lane's task if it has none.
    pub(super) fn ensure_running(self: &Arc<Self>, lane: &Arc<Lane>, st: &mut LaneState) {
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
    pub(super) fn run_ready(self: &Arc<Self>, ready: Vec<Arc<Lane>>) {
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
    pub(super) fn wake_lanes(self: &Arc<Self>) {
        let d = lock(&self.dispatch);
        for lane in &d.lanes {
            let mut st = lock(&lane.state);
            if matches!(st.mode, Mode::CatchingUp { .. }) || !st.queue.is_empty() {
                self.ensure_running(lane, &mut st);
            }
        }
    }
}

/// Delivers one lane's events, in order, while it has any; then ends.
pub(super) struct LaneTask {
    pub(super) shared: Arc<Shared>,
    pub(super) lane: Arc<Lane>,
    /// The lane's own reader while catching up.
    pub(super) reader: Option<(Box<dyn ShardReader>, Seq)>,
}

pub(super) enum Work {
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
    pub(super) fn new(shared: Arc<Shared>, lane: Arc<Lane>) -> Self {
        LaneTask {
            shared,
            lane,
            reader: None,
        }
    }

    pub(super) async fn run(mut self) {
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
    pub(super) fn next_work(&self) -> Option<Work> {
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
    pub(super) fn finish(&self, first: Seq, end: Seq, epoch: u64, done: bool) {
        let mut st = lock(&self.lane.state);
        // A batch that did not go through because the process is stopping stays in flight:
        // the lane's position, committed on the way out, is then its first event, and the
        // next owner sends it. (Cleared, the position would be the event after it, and the
        // batch would be lost.)
        let unsent_at_stop = !done && st.epoch == epoch && self.shared.stopping();
        if st.in_flight.map(|(f, _)| f) == Some(first) && !unsent_at_stop {
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
    pub(super) async fn catch_up(&mut self, next: Seq, epoch: u64) -> Result<bool, StoreError> {
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
    pub(super) fn attach(&self, next: Seq) {
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
    pub(super) fn select(&self, records: Vec<Record>) -> (Vec<Envelope>, Seq) {
        let sub = &self.lane.sub;
        let mut out = Vec::with_capacity(records.len());
        let mut end = records.first().map_or(0, |r| r.seq);
        let mut bytes = 0;
        for r in records {
            if bytes >= self.shared.delivery.batch_bytes {
                break;
            }
            end = r.seq + 1;
            let reads_event = sub
                .transform
                .as_ref()
                .is_some_and(|t| !t.calls_only_functions());
            let event = if sub.filter.matches_everything() && !reads_event {
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
    pub(super) async fn deliver(&self, events: &[Envelope], epoch: u64) -> bool {
        if events.is_empty() {
            return true;
        }
        if let Some(chain) = self
            .lane
            .sub
            .transform
            .as_ref()
            .filter(|c| c.calls_functions())
        {
            return self.deliver_through_functions(chain, events, epoch).await;
        }
        self.deliver_envelopes(events, epoch).await
    }

    /// Runs the chain's user functions on a blocking thread (a function may take its whole
    /// time limit; the reader and the other lanes go on), dead-letters the events the
    /// chain refused, and delivers what it made. Waits first until every function it
    /// calls is loaded on this replica.
    async fn deliver_through_functions(
        &self,
        chain: &Arc<sluice_functions::TransformChain>,
        events: &[Envelope],
        epoch: u64,
    ) -> bool {
        let (ready, refused) = match through_functions(
            chain,
            events.to_vec(),
            self.shared.stop.clone(),
        )
        .await
        {
            Ok(Some(done)) => done,
            // Stopping: the batch stays pending (delivered by whoever runs the shard next).
            Ok(None) => return false,
            Err(why) => {
                tracing::error!(lane = %self.lane.id, error = %why, "the lane waits for its functions");
                let mut stop = self.shared.stop.clone();
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = stop.changed() => {}
                }
                return false;
            }
        };
        for (envelope, why) in &refused {
            self.lane.sub.delivery.reject(envelope, why).await;
        }
        self.deliver_envelopes(&ready, epoch).await
    }

    async fn deliver_envelopes(&self, events: &[Envelope], epoch: u64) -> bool {
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
pub(super) struct YieldOnce(bool);

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
