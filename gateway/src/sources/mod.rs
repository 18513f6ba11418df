//! Source connectors: how events enter a bus other than HTTP. Each source runs as a task
//! that keeps its read positions in the same position store as the subscriptions.

pub mod rocketmq;

use std::collections::HashMap;
use std::sync::Arc;

use serde::Deserialize;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::store::{BusLog, PositionStore};

#[derive(Debug, Clone, Deserialize)]
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

    pub fn check(&self) -> Result<(), String> {
        match self {
            SourceConfig::Rocketmq(s) => s.check(),
        }
    }
}

/// The running sources; stop them before the runtime commits positions at shutdown.
pub struct Sources {
    tasks: JoinSet<()>,
    stop: watch::Sender<bool>,
}

impl Sources {
    pub fn start(
        configs: &[SourceConfig],
        logs: &HashMap<String, Arc<dyn BusLog>>,
        positions: Arc<dyn PositionStore>,
    ) -> Sources {
        let (stop, _) = watch::channel(false);
        let mut tasks = JoinSet::new();
        for config in configs {
            let Some(log) = logs.get(config.bus()) else {
                continue;
            };
            match config {
                SourceConfig::Rocketmq(c) => {
                    let source =
                        rocketmq::RocketMqSource::new(c.clone(), log.clone(), positions.clone());
                    tasks.spawn(source.run(stop.subscribe()));
                }
            }
        }
        Sources { tasks, stop }
    }

    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.tasks.join_next().await.is_some() {}
    }
}
