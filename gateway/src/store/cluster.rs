//! The cluster service: who the workers are, who holds which task (leases with fencing
//! epochs), control requests (pause, resume, restart) and task status. Standalone mode is a
//! cluster of one held in memory; distributed mode keeps it all in Redis.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::StoreError;

/// A task or a subscription's part of one: `{connector}#{index}`. The tasks a worker
/// leases are `bus/{bus}#{shard}` (every subscription of the bus for that shard) and
/// `source/{name}#{index}`; a subscription's part of a shard task is
/// `{bus}/{rule}/{target}#{shard}` (status, pause, restart).
pub fn task_id(subscription: &str, shard: u32) -> String {
    format!("{subscription}#{shard}")
}

/// The right to run a task. A newer lease of the same task has a higher epoch; position
/// commits carry the epoch and are refused once it is no longer the current one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub task: String,
    pub epoch: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum State {
    Unassigned,
    Running,
    Paused,
    Failed,
}

impl State {
    /// The state as shown in statuses and metrics.
    pub fn label(self) -> &'static str {
        match self {
            State::Unassigned => "UNASSIGNED",
            State::Running => "RUNNING",
            State::Paused => "PAUSED",
            State::Failed => "FAILED",
        }
    }
}

/// The status of a connector (subscription) or task, readable from any worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub id: String,
    pub state: State,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Milliseconds since the Unix epoch.
    pub changed_at: u64,
}

/// Operator requests that shape the assignment: paused ids (connectors or tasks) and a
/// restart generation per id (a bump restarts it wherever it runs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Control {
    pub paused: HashSet<String>,
    pub restarts: HashMap<String, u64>,
}

impl Control {
    pub fn is_paused(&self, subscription: &str, task: &str) -> bool {
        self.paused.contains(subscription) || self.paused.contains(task)
    }

    /// The generation that identifies a task's current incarnation.
    pub fn generation(&self, subscription: &str, task: &str) -> u64 {
        self.restarts.get(subscription).copied().unwrap_or(0)
            + self.restarts.get(task).copied().unwrap_or(0)
    }
}

#[async_trait]
pub trait Cluster: Send + Sync + 'static {
    fn worker_id(&self) -> &str;

    /// How long a lease lasts without renewal.
    fn lease_ttl(&self) -> Duration;

    /// Ticks whenever membership, configuration or control changed somewhere.
    fn notices(&self) -> watch::Receiver<u64>;

    /// Whether the cluster store answers now.
    fn healthy(&self) -> bool;

    /// Live workers, this one included.
    async fn members(&self) -> Result<Vec<String>, StoreError>;

    /// Each live worker and how long ago (ms) it last heartbeated.
    async fn heartbeats(&self) -> Result<Vec<(String, u64)>, StoreError> {
        Ok(self.members().await?.into_iter().map(|m| (m, 0)).collect())
    }

    /// Takes the task's lease if it is free (or already this worker's); `None` when another
    /// worker holds it.
    async fn acquire(&self, task: &str) -> Result<Option<Lease>, StoreError>;

    /// Extends a lease; `false` when it is no longer this worker's.
    async fn renew(&self, lease: &Lease) -> Result<bool, StoreError>;

    /// Extends every lease in one round trip; per lease, whether it is still this worker's.
    async fn renew_all(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        let mut held = Vec::with_capacity(leases.len());
        for lease in leases {
            held.push(self.renew(lease).await?);
        }
        Ok(held)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError>;

    async fn control(&self) -> Result<Control, StoreError>;

    async fn set_paused(&self, id: &str, paused: bool) -> Result<(), StoreError>;

    async fn request_restart(&self, id: &str) -> Result<(), StoreError>;

    async fn set_status(&self, status: Status) -> Result<(), StoreError>;

    /// Writes many statuses at once (a shard task reports all its subscriptions together).
    async fn set_statuses(&self, statuses: Vec<Status>) -> Result<(), StoreError> {
        for status in statuses {
            self.set_status(status).await?;
        }
        Ok(())
    }

    /// Like `report`, for many ids in one write.
    async fn report_many(&self, reports: Vec<(String, State, Option<String>)>) {
        let at = now_ms();
        let metrics = crate::metrics::get();
        let statuses = reports
            .into_iter()
            .inspect(|(id, state, _)| metrics.task_state(id, self.worker_id(), state.label()))
            .map(|(id, state, reason)| Status {
                id,
                state,
                worker: (state != State::Unassigned).then(|| self.worker_id().to_string()),
                reason,
                changed_at: at,
            })
            .collect();
        if let Err(e) = self.set_statuses(statuses).await {
            tracing::debug!(error = %e, "cannot write statuses");
        }
    }

    /// Records a connector's or task's state as this worker's (an unassigned one has no
    /// worker). A status that cannot be written is skipped: the next change writes it.
    async fn report(&self, id: &str, state: State, reason: Option<String>) {
        crate::metrics::get().task_state(id, self.worker_id(), state.label());
        let status = Status {
            id: id.to_string(),
            state,
            worker: (state != State::Unassigned).then(|| self.worker_id().to_string()),
            reason,
            changed_at: now_ms(),
        };
        if let Err(e) = self.set_status(status).await {
            tracing::debug!(id, error = %e, "cannot write status");
        }
    }

    async fn statuses(&self) -> Result<Vec<Status>, StoreError>;

    /// Forgets the statuses (and pause and restart entries) of connectors and tasks that
    /// no longer exist (their rule or source was deleted).
    async fn forget(&self, ids: &[String]) -> Result<(), StoreError>;

    /// Announces that this worker leaves (graceful shutdown).
    async fn leave(&self);
}

/// Wall-clock milliseconds since the Unix epoch: for status times shown to people.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Monotonic milliseconds since the process started: for lease validity, which a clock
/// step must not stretch.
pub fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        // Never 0, so "valid until 0" always means "not valid".
        + 1
}

/// Standalone: one worker, everything in memory, every lease granted.
pub struct LocalCluster {
    id: String,
    notices: watch::Sender<u64>,
    state: Mutex<LocalState>,
}

#[derive(Default)]
struct LocalState {
    control: Control,
    statuses: BTreeMap<String, Status>,
    epochs: HashMap<String, u64>,
}

impl LocalCluster {
    pub fn new(id: &str) -> LocalCluster {
        LocalCluster {
            id: id.to_string(),
            notices: watch::Sender::new(0),
            state: Mutex::new(LocalState::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, LocalState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        self.notices.send_modify(|n| *n += 1);
    }
}

#[async_trait]
impl Cluster for LocalCluster {
    fn worker_id(&self) -> &str {
        &self.id
    }

    fn lease_ttl(&self) -> Duration {
        Duration::from_secs(3600)
    }

    fn notices(&self) -> watch::Receiver<u64> {
        self.notices.subscribe()
    }

    fn healthy(&self) -> bool {
        true
    }

    async fn members(&self) -> Result<Vec<String>, StoreError> {
        Ok(vec![self.id.clone()])
    }

    async fn acquire(&self, task: &str) -> Result<Option<Lease>, StoreError> {
        let mut state = self.state();
        let epoch = state.epochs.entry(task.to_string()).or_insert(0);
        *epoch += 1;
        Ok(Some(Lease {
            task: task.to_string(),
            epoch: *epoch,
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<bool, StoreError> {
        Ok(self.state().epochs.get(&lease.task) == Some(&lease.epoch))
    }

    async fn release(&self, _lease: &Lease) -> Result<(), StoreError> {
        Ok(())
    }

    async fn control(&self) -> Result<Control, StoreError> {
        Ok(self.state().control.clone())
    }

    async fn set_paused(&self, id: &str, paused: bool) -> Result<(), StoreError> {
        {
            let mut state = self.state();
            if paused {
                state.control.paused.insert(id.to_string());
            } else {
                state.control.paused.remove(id);
            }
        }
        self.notify();
        Ok(())
    }

    async fn request_restart(&self, id: &str) -> Result<(), StoreError> {
        *self
            .state()
            .control
            .restarts
            .entry(id.to_string())
            .or_insert(0) += 1;
        self.notify();
        Ok(())
    }

    async fn set_status(&self, status: Status) -> Result<(), StoreError> {
        self.state().statuses.insert(status.id.clone(), status);
        Ok(())
    }

    async fn statuses(&self) -> Result<Vec<Status>, StoreError> {
        Ok(self.state().statuses.values().cloned().collect())
    }

    async fn forget(&self, ids: &[String]) -> Result<(), StoreError> {
        let mut state = self.state();
        for id in ids {
            state.statuses.remove(id);
            state.control.paused.remove(id);
            state.control.restarts.remove(id);
        }
        Ok(())
    }

    async fn leave(&self) {}
}
