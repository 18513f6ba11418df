//! The `bus` target: puts each event, unchanged, on another bus (shard by its partition key).

use std::sync::Arc;

use async_trait::async_trait;

use crate::store::BusLog;
use crate::targets::config::BusTargetConfig;
use crate::targets::target::{append_to_bus, Envelope, Resources, Target, TargetError};

pub struct BusTarget {
    bus: String,
    log: Arc<dyn BusLog>,
}

impl BusTarget {
    pub fn new(config: &BusTargetConfig, resources: &Resources) -> Result<BusTarget, TargetError> {
        let log = resources
            .buses
            .get(&config.bus)
            .ok_or_else(|| TargetError::fatal(format!("bus `{}` is not defined", config.bus)))?;
        Ok(BusTarget {
            bus: config.bus.clone(),
            log: log.clone(),
        })
    }
}

#[async_trait]
impl Target for BusTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let shards = self.log.shards();
        let mut records = Vec::with_capacity(events.len());
        for envelope in events {
            let event = envelope.decoded()?;
            let key = crate::event::partition_key(&event);
            records.push((crate::event::shard_of(&key, shards), envelope.raw.clone()));
        }
        append_to_bus(self.log.as_ref(), &self.bus, records).await
    }

    fn describe(&self) -> String {
        format!("bus {}", self.bus)
    }
}
