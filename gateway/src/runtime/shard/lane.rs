//! A subscription's lane on a shard: its queue of prepared events, its mode (attached to
//! the reader, catching up on its own, paused) and position, and what a queued event
//! holds in memory (the transform chain itself is `runtime::chain`).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::runtime::plan::{BusPlan, Subscription};

use crate::store::cluster::{task_id, Control};
use crate::store::Seq;
use crate::targets::Envelope;

/// Most events a lane may have queued before it leaves the shared path (in batches of the
/// delivery batch size).
pub(super) const LANE_QUEUE_BATCHES: usize = 4;

/// Most bytes one lane may have queued (events wait in the log, not in memory, for a slow
/// target).
pub(super) const LANE_QUEUE_BYTES: usize = 1024 * 1024;

/// Most bytes queued across all lanes of one shard task. Past it the reader waits for the
/// lanes to deliver (they are behind together: the machine is busy, and reading on would
/// only make every lane read the log again on its own); if that takes long, the lanes that
/// hold the most leave the shared path and catch up from the log, so a few slow targets
/// cannot hold the others back. Keeps memory bounded whatever the number of rules.
pub(super) const SHARD_QUEUE_BYTES: usize = 16 * 1024 * 1024;

/// How long the reader waits for room before it sheds the lanes that hold the most.
pub(super) const SHED_AFTER: Duration = Duration::from_millis(250);

/// Samples of acceptance times kept per shard.
pub(super) const ACCEPTED_SAMPLES: usize = 4096;

/// Guarded by one lock: the reader holds it while it hands out one batch, and a lane takes
/// it to attach again, so no record is handed out between "not attached" and "attached".
pub(super) struct Dispatch {
    /// Every record below it has been handed to each attached lane that takes it.
    pub(super) cursor: Seq,
    pub(super) bus: Arc<BusPlan>,
    /// In the order of `bus.subscriptions`.
    pub(super) lanes: Vec<Arc<Lane>>,
}

pub(super) struct Lane {
    pub(super) sub: Arc<Subscription>,
    /// `{bus}/{rule}/{target}#{shard}`: status, pause and restart of this part.
    pub(super) id: String,
    pub(super) state: Mutex<LaneState>,
    /// Its lag gauges (events, seconds), looked up once.
    pub(super) gauges: std::sync::OnceLock<LagGauges>,
}

pub(super) struct LagGauges {
    pub(super) events: prometheus_client::metrics::gauge::Gauge,
    pub(super) seconds: prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl Lane {
    pub(super) fn gauges(&self, shard: u32) -> &LagGauges {
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
pub(super) enum Mode {
    Attached { from: Seq },
    CatchingUp { next: Seq },
    Paused { next: Seq },
}

pub(super) struct LaneState {
    pub(super) mode: Mode,
    pub(super) queue: VecDeque<Queued>,
    /// Bytes in `queue`.
    pub(super) queued: usize,
    /// The first sequence number of the delivery in progress (and one past its last).
    pub(super) in_flight: Option<(Seq, Seq)>,
    /// The acceptance time of the first event of that delivery (0: none, or not known).
    pub(super) in_flight_accepted: u64,
    /// Whether a lane task is running (only while there is work).
    pub(super) running: bool,
    /// Bumped by pause, restart and replacement: a delivery in flight under an older epoch
    /// is abandoned (its events are delivered again from the position: at least once).
    pub(super) epoch: u64,
    /// Whether the lane is reported FAILED.
    pub(super) failed: bool,
    /// Applied control: paused and restart generation.
    pub(super) paused: bool,
    pub(super) generation: u64,
}

pub(super) struct Queued {
    pub(super) seq: Seq,
    pub(super) envelope: Envelope,
    pub(super) bytes: usize,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing holding these locks can leave them half-updated in a way that matters more
    // than stopping delivery would.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Lane {
    /// A lane in `mode`, at the control's current restart generation (pause is applied by
    /// `apply_control`).
    pub(super) fn new(
        sub: Arc<Subscription>,
        shard: u32,
        mode: Mode,
        control: &Control,
    ) -> Arc<Lane> {
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
    pub(super) fn position(state: &LaneState, cursor: Seq) -> Seq {
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

/// Where a lane starts: new subscriptions at the end of the shard, known ones at their
/// position (on the shared path if that is the reader's, else catching up or ahead).
pub(super) fn start_mode(position: Option<Seq>, cursor: Seq, end: Seq) -> Mode {
    match position {
        None => Mode::Attached {
            from: end.max(cursor),
        },
        Some(p) if p >= cursor => Mode::Attached { from: p },
        Some(p) => Mode::CatchingUp { next: p },
    }
}

/// What an envelope holds in memory: the stored form, the decoded event when it holds one,
/// and a transformed body. A decoded event's JSON data is a tree of values that can take
/// many times its text (`[0,0,…]`: 2 bytes of text, 32 of tree per element), so it is
/// counted by its JSON structure, not by its length: queues stay bounded by bytes whatever
/// the events look like.
pub(super) fn envelope_bytes(envelope: &Envelope) -> usize {
    let decoded = if envelope.event.is_some() {
        decoded_bytes(&envelope.raw)
    } else {
        0
    };
    envelope_size(envelope, decoded)
}

/// `envelope_bytes` with the decoded event's size already known.
pub(super) fn envelope_size(envelope: &Envelope, decoded: usize) -> usize {
    envelope.raw.len() + decoded + envelope.body.as_ref().map_or(0, |b| b.bytes.len()) + 128
}

/// An upper estimate of the memory a stored event takes decoded: its text plus about 48
/// bytes per JSON value or member (each `,` `:` `[` `{` starts at most one).
pub(super) fn decoded_bytes(raw: &[u8]) -> usize {
    let nodes = raw
        .iter()
        .filter(|b| matches!(b, b',' | b':' | b'[' | b'{'))
        .count();
    raw.len() + nodes * 48
}

/// How long a stopping task waits for its deliveries in flight.
pub(super) const STOP_GRACE: Duration = Duration::from_millis(500);

/// How often an idle shard reader checks that the log did not roll back under it.
pub(super) const ROLLBACK_CHECK: Duration = Duration::from_secs(2);

/// After a rollback, events accepted up to this long before the last one the reader saw
/// are delivered again (replicas' clocks differ a little; a duplicate beats a loss).
pub(super) const ROLLBACK_MARGIN_MS: u64 = 2_000;

/// How often each lane's lag (`sluice_subscription_lag_events`) is computed.
pub(super) const LAG_INTERVAL: Duration = Duration::from_secs(2);

/// How often a shard looks for events its subscriptions hold past the bus's
/// `max_backlog_age` (one record read while nothing is that old).
pub(super) const EXPIRE_CHECK: Duration = Duration::from_secs(1);
