//! Source connectors: how events enter a bus other than HTTP. A source is a connector like
//! a subscription: its work is split into tasks (for RocketMQ, the topic's queues spread over
//! `tasks` tasks) that the workers assign, lease and take over like every other task. Read
//! positions live in the same position store and their commits are fenced by the task's
//! lease, so a source task that moved away can neither commit nor keep appending.

pub mod rocketmq;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::store::cluster::{mono_ms, Cluster, Lease, State};
use crate::store::{BusLog, PositionStore};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum SourceConfig {
    /// Consumes a RocketMQ topic into a bus.
    Rocketmq(rocketmq::RocketMqSourceConfig),
}

impl SourceConfig {
    pub fn name(&self) -> &str {
        match self {
            SourceConfig::Rocketmq(s) => &s.name,
        }
    }

    pub fn bus(&self) -> &str {
        match self {
            SourceConfig::Rocketmq(s) => &s.bus,
        }
    }

    /// How many tasks the source's work is split into.
    pub fn tasks(&self) -> u32 {
        match self {
            SourceConfig::Rocketmq(s) => s.tasks,
        }
    }

    pub fn check(&self) -> Result<(), String> {
        match self {
            SourceConfig::Rocketmq(s) => s.check(),
        }
    }
}

/// A source connector of the running plan.
pub struct Source {
    /// `source/{name}`: the connector id (status, pause, restart) and the position prefix.
    pub id: String,
    pub config: SourceConfig,
    pub log: Arc<dyn BusLog>,
}

impl Source {
    pub fn new(config: SourceConfig, log: Arc<dyn BusLog>) -> Source {
        Source {
            id: format!("source/{}", config.name()),
            config,
            log,
        }
    }
}

/// What one running source task is given by the worker that holds its lease.
pub struct SourceTask {
    pub source: Arc<Source>,
    /// Which of the source's tasks this is (0-based).
    pub index: u32,
    pub lease: Lease,
    pub positions: Arc<dyn PositionStore>,
    pub cluster: Arc<dyn Cluster>,
    /// Until when (ms since the epoch) the lease is surely still ours.
    pub valid_until: Arc<AtomicU64>,
    pub stop: watch::Receiver<bool>,
}

impl SourceTask {
    pub async fn run(self) {
        let source = self.source.clone();
        match &source.config {
            SourceConfig::Rocketmq(c) => rocketmq::run(c, self).await,
        }
    }

    /// Whether the task may still append and record positions.
    pub fn leased(&self) -> bool {
        mono_ms() < self.valid_until.load(Ordering::Relaxed)
    }

    pub fn stopping(&self) -> bool {
        *self.stop.borrow() || !self.leased()
    }

    pub async fn report(&self, state: State, reason: Option<String>) {
        // Once the lease may have moved, the status is the next owner's to write.
        if !self.leased() {
            return;
        }
        self.cluster.report(&self.lease.task, state, reason).await;
    }
}
