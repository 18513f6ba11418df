//! The RocketMQ source connector: consumes a topic into a bus. A message that carries
//! CloudEvents properties (`CE_id`, `CE_source`, `CE_type`, `CE_specversion`: the RocketMQ
//! binding, as the RocketMQ target writes it) becomes that event; any other message is
//! wrapped in an event whose type and source come from the configuration and whose data is
//! the body.
//!
//! Positions: the next offset of each queue is kept in the position store under
//! `source/{name}` (shard = queue id), set only after the events are durable on the bus, and
//! committed with every other position: a crash re-reads at most what was not committed
//! (at least once). The broker's own consumer offsets are not used.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cloudevents::EventBuilder;
use rocketmq_client_rust::DefaultLitePullConsumer;
use rocketmq_model::common::message::message_ext::MessageExt;
use serde::Deserialize;
use tokio::sync::watch;

use crate::ingress::cloudevent;
use crate::store::{BusLog, PositionStore};
use crate::targets::{self, TargetError};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RocketMqSourceConfig {
    pub name: String,
    pub name_server: String,
    pub topic: String,
    /// The bus the events go to.
    pub bus: String,
    #[serde(default)]
    pub consumer_group: Option<String>,
    /// `type` of wrapped (non-CloudEvent) messages.
    #[serde(default = "defaults::wrap_type")]
    pub wrap_type: String,
    /// `source` of wrapped messages (default `rocketmq://{topic}`).
    #[serde(default)]
    pub wrap_source: Option<String>,
}

mod defaults {
    pub(super) fn wrap_type() -> String {
        "org.apache.rocketmq.message".to_string()
    }
}

impl RocketMqSourceConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.name_server.trim().is_empty() {
            return Err("`name_server` is empty".to_string());
        }
        if self.topic.is_empty() {
            return Err("`topic` is empty".to_string());
        }
        if self.wrap_type.is_empty() {
            return Err("`wrap_type` is empty".to_string());
        }
        Ok(())
    }

    fn position_key(&self) -> String {
        format!("source/{}", self.name)
    }
}

pub struct RocketMqSource {
    config: RocketMqSourceConfig,
    log: Arc<dyn BusLog>,
    positions: Arc<dyn PositionStore>,
}

impl RocketMqSource {
    pub fn new(
        config: RocketMqSourceConfig,
        log: Arc<dyn BusLog>,
        positions: Arc<dyn PositionStore>,
    ) -> RocketMqSource {
        RocketMqSource {
            config,
            log,
            positions,
        }
    }

    pub async fn run(self, mut stop: watch::Receiver<bool>) {
        let mut backoff = Duration::from_millis(200);
        loop {
            tokio::select! {
                result = self.consume() => {
                    if let Err(e) = result {
                        tracing::error!(source = %self.config.name, error = %e, "RocketMQ source failed; restarting");
                    }
                }
                _ = stop.changed() => return,
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = stop.changed() => return,
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
        }
    }

    async fn consume(&self) -> Result<(), TargetError> {
        let runtime = targets::rocketmq::client_runtime()?;
        let group = self
            .config
            .consumer_group
            .clone()
            .unwrap_or_else(|| format!("sluice-source-{}", self.config.name));
        let consumer = DefaultLitePullConsumer::builder(runtime)
            .consumer_group(group)
            .name_server_addr(self.config.name_server.clone())
            .auto_commit(false)
            .build()
            .map_err(|e| TargetError::fatal(format!("cannot build the consumer: {e}")))?;
        consumer
            .start()
            .await
            .map_err(|e| TargetError::retryable(format!("cannot start the consumer: {e}")))?;
        let result = self.pull(&consumer).await;
        consumer.shutdown().await;
        result
    }

    async fn pull(&self, consumer: &DefaultLitePullConsumer) -> Result<(), TargetError> {
        let topic = &self.config.topic;
        let queues = consumer.fetch_message_queues(topic).await.map_err(|e| {
            TargetError::retryable(format!("cannot fetch the queues of `{topic}`: {e}"))
        })?;
        if queues.is_empty() {
            return Err(TargetError::retryable(format!(
                "topic `{topic}` has no queues"
            )));
        }
        consumer
            .assign(queues.clone())
            .await
            .map_err(|e| TargetError::retryable(format!("cannot assign queues: {e}")))?;
        let key = self.config.position_key();
        for queue in &queues {
            let stored = self
                .positions
                .load(&key, queue.queue_id() as u32)
                .await
                .map_err(|e| TargetError::retryable(format!("cannot load positions: {e}")))?;
            let seek = match stored {
                Some(next) => consumer.seek(queue, next as i64).await,
                None => consumer.seek_to_begin(queue).await,
            };
            seek.map_err(|e| {
                TargetError::retryable(format!("cannot seek queue {}: {e}", queue.queue_id()))
            })?;
        }
        tracing::info!(source = %self.config.name, topic, queues = queues.len(), "RocketMQ source consuming");
        loop {
            let messages = consumer.poll_with_timeout(500).await;
            if messages.is_empty() {
                continue;
            }
            let shards = self.log.shards();
            let mut records: Vec<(u32, Bytes)> = Vec::with_capacity(messages.len());
            let mut next: std::collections::BTreeMap<u32, u64> = Default::default();
            for message in &messages {
                records.push(self.event(message, shards)?);
                let queue = message.queue_id() as u32;
                let after = (message.queue_offset() + 1).max(0) as u64;
                let entry = next.entry(queue).or_insert(after);
                *entry = (*entry).max(after);
            }
            // Durable on the bus first, then the positions move (at least once).
            let mut wait = Duration::from_millis(50);
            while let Err(e) =
                targets::append_to_bus(self.log.as_ref(), &self.config.bus, records.clone()).await
            {
                tracing::warn!(source = %self.config.name, error = %e, "appending to the bus failed; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            for (queue, after) in next {
                self.positions.set(&key, queue, after);
            }
            // Committed now rather than on the workers' tick, which only runs with tasks.
            if let Err(e) = self.positions.flush().await {
                tracing::warn!(source = %self.config.name, error = %e, "committing source positions failed; retried with the next batch");
            }
        }
    }

    /// The stored event for a message, and its shard.
    fn event(&self, message: &MessageExt, shards: u32) -> Result<(u32, Bytes), TargetError> {
        let properties = message.properties();
        let body = message.body().map(|b| b.to_vec()).unwrap_or_default();
        if properties.keys().any(|k| k.as_str() == "CE_specversion") {
            let mut headers = http::HeaderMap::new();
            for (name, value) in properties {
                let Some(attr) = name.as_str().strip_prefix("CE_") else {
                    continue;
                };
                let header = if attr == "datacontenttype" {
                    http::header::CONTENT_TYPE
                } else {
                    match http::HeaderName::from_bytes(
                        format!("ce-{}", attr.to_ascii_lowercase()).as_bytes(),
                    ) {
                        Ok(h) => h,
                        Err(_) => continue,
                    }
                };
                if let Ok(v) = http::HeaderValue::from_str(&percent(value.as_str())) {
                    headers.insert(header, v);
                }
            }
            match cloudevent::from_binary(&headers, &body) {
                Ok(parsed) => {
                    let shard =
                        crate::ingress::shard_of(&cloudevent::partition_key(&parsed.event), shards);
                    return Ok((shard, Bytes::from(parsed.stored)));
                }
                Err(e) => {
                    tracing::warn!(source = %self.config.name, msg_id = %message.msg_id(), error = %e, "message has CloudEvents properties but is not a valid event; wrapping it");
                }
            }
        }
        let source = self
            .config
            .wrap_source
            .clone()
            .unwrap_or_else(|| format!("rocketmq://{}", self.config.topic));
        let data = match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(json) => cloudevents::Data::Json(json),
            Err(_) => match String::from_utf8(body.clone()) {
                Ok(text) => cloudevents::Data::String(text),
                Err(_) => cloudevents::Data::Binary(body),
            },
        };
        let content_type = match &data {
            cloudevents::Data::Json(_) => "application/json",
            cloudevents::Data::String(_) => "text/plain",
            cloudevents::Data::Binary(_) => "application/octet-stream",
        };
        let mut builder = cloudevents::EventBuilderV10::new()
            .id(message.msg_id().to_string())
            .source(source)
            .ty(self.config.wrap_type.clone())
            .data(content_type, data)
            .extension("rocketmqtopic", self.config.topic.clone())
            .extension("rocketmqqueue", i64::from(message.queue_id()))
            .extension("rocketmqoffset", message.queue_offset());
        if let Some(tags) = properties.get("TAGS").filter(|t| !t.is_empty()) {
            builder = builder.subject(tags.to_string());
        }
        if let Some(keys) = properties.get("KEYS").filter(|k| !k.is_empty()) {
            builder = builder.extension("partitionkey", keys.to_string());
        }
        let event = builder
            .build()
            .map_err(|e| TargetError::fatal(format!("cannot wrap message: {e}")))?;
        targets::stored(&event, shards)
    }
}

/// Percent-encodes a value for a binary-mode header (the ingress parser decodes it).
fn percent(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'"' && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
