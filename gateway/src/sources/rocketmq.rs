//! The RocketMQ source connector: consumes a topic into a bus. A message that carries
//! CloudEvents properties (`CE_id`, `CE_source`, `CE_type`, `CE_specversion`: the RocketMQ
//! binding, as the RocketMQ target writes it) becomes that event; any other message is
//! wrapped in an event whose type and source come from the configuration and whose data is
//! the body.
//!
//! Tasks: the topic's queues are spread over `tasks` tasks (queue id modulo `tasks`), which
//! the workers assign, lease and take over like every other task; with `tasks` equal to the
//! topic's queue count each queue is a task.
//!
//! Positions: the next offset of each queue is kept in the position store under
//! `source/{name}@{broker}` (shard = queue id), set only after the events are durable on the
//! bus, and committed with every other position under the task's lease: a crash re-reads at
//! most what was not committed (at least once), and a task that moved cannot commit. The
//! broker's own consumer offsets are not used.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use cloudevents::EventBuilder;
use rocketmq_client_rust::DefaultLitePullConsumer;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_queue::MessageQueue;
use serde::{Deserialize, Serialize};

use super::SourceTask;
use crate::event;
use crate::event::http as cloudevent;
use crate::store::cluster::State;
use crate::targets::{self, TargetError};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RocketMqSourceConfig {
    pub name: String,
    pub name_server: String,
    pub topic: String,
    /// The bus the events go to.
    pub bus: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer_group: Option<String>,
    /// The topic's queues are spread over this many tasks (queue id modulo `tasks`).
    #[serde(default = "defaults::tasks")]
    pub tasks: u32,
    /// `type` of wrapped (non-CloudEvent) messages.
    #[serde(default = "defaults::wrap_type")]
    pub wrap_type: String,
    /// `source` of wrapped messages (default `rocketmq://{topic}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wrap_source: Option<String>,
}

mod defaults {
    pub(super) fn tasks() -> u32 {
        1
    }

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
        if !(1..=MAX_TASKS).contains(&self.tasks) {
            return Err(format!(
                "`tasks` must be between 1 and {MAX_TASKS}, not {}",
                self.tasks
            ));
        }
        Ok(())
    }
}

const MAX_TASKS: u32 = 1024;

/// How long a task with no queue of its own waits before asking for the queues again.
const NO_QUEUE_RECHECK: Duration = Duration::from_secs(10);

/// Runs one source task until it is stopped or its lease lapses; a failure (broker
/// unreachable, topic missing) is reported as FAILED and retried with backoff.
pub(super) async fn run(config: &RocketMqSourceConfig, mut task: SourceTask) {
    let mut backoff = Duration::from_millis(200);
    while !task.stopping() {
        match consume(config, &mut task).await {
            Ok(()) => return,
            Err(e) => {
                tracing::error!(task = %task.lease.task, error = %e, "RocketMQ source task failed; restarting");
                task.report(State::Failed, Some(e.to_string())).await;
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = task.stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

async fn consume(config: &RocketMqSourceConfig, task: &mut SourceTask) -> Result<(), TargetError> {
    let runtime = targets::rocketmq::client_runtime()?;
    let group = config
        .consumer_group
        .clone()
        .unwrap_or_else(|| format!("sluice-source-{}", config.name));
    // One client instance per task: several tasks of one group may run in one process.
    let consumer = DefaultLitePullConsumer::builder(runtime)
        .consumer_group(group)
        .instance_name(format!("sluice-{}-{}", config.name, task.index))
        .name_server_addr(config.name_server.clone())
        .auto_commit(false)
        .build()
        .map_err(|e| TargetError::fatal(format!("cannot build the consumer: {e}")))?;
    consumer
        .start()
        .await
        .map_err(|e| TargetError::retryable(format!("cannot start the consumer: {e}")))?;
    let result = pull(config, task, &consumer).await;
    consumer.shutdown().await;
    result
}

/// The position key of a broker's queues (the shard is the queue id): queue ids repeat
/// across brokers.
fn position_key(source_id: &str, broker: &str) -> String {
    format!("{source_id}@{broker}")
}

/// This task's queues of the topic; empty when there are more tasks than queues.
async fn my_queues(
    config: &RocketMqSourceConfig,
    task: &SourceTask,
    consumer: &DefaultLitePullConsumer,
) -> Result<Vec<MessageQueue>, TargetError> {
    let topic = &config.topic;
    let queues = consumer.fetch_message_queues(topic).await.map_err(|e| {
        TargetError::retryable(format!("cannot fetch the queues of `{topic}`: {e}"))
    })?;
    if queues.is_empty() {
        return Err(TargetError::retryable(format!(
            "topic `{topic}` has no queues"
        )));
    }
    Ok(queues
        .into_iter()
        .filter(|q| q.queue_id().unsigned_abs() % config.tasks == task.index)
        .collect())
}

async fn pull(
    config: &RocketMqSourceConfig,
    task: &mut SourceTask,
    consumer: &DefaultLitePullConsumer,
) -> Result<(), TargetError> {
    let queues = loop {
        let queues = my_queues(config, task, consumer).await?;
        if !queues.is_empty() {
            break queues;
        }
        tracing::info!(task = %task.lease.task, topic = %config.topic, "no queue of the topic falls to this task; waiting");
        task.report(State::Running, None).await;
        tokio::select! {
            _ = tokio::time::sleep(NO_QUEUE_RECHECK) => {}
            _ = task.stop.changed() => return Ok(()),
        }
        if task.stopping() {
            return Ok(());
        }
    };
    consumer
        .assign(queues.clone())
        .await
        .map_err(|e| TargetError::retryable(format!("cannot assign queues: {e}")))?;
    let source = task.source.clone();
    for queue in &queues {
        let key = position_key(&source.id, queue.broker_name());
        let shard = queue.queue_id().unsigned_abs();
        task.positions.own(&key, shard, &task.lease);
        let stored = task
            .positions
            .load(&key, shard)
            .await
            .map_err(|e| TargetError::retryable(format!("cannot load positions: {e}")))?;
        let seek = match stored {
            Some(next) => consumer.seek(queue, next as i64).await,
            None => consumer.seek_to_begin(queue).await,
        };
        seek.map_err(|e| {
            TargetError::retryable(format!("cannot seek queue {}: {e}", queue.queue_id()))
        })?;
        match stored {
            Some(next) => {
                tracing::info!(task = %task.lease.task, queue = queue.queue_id(), from = next, "RocketMQ source queue resumes from its stored position")
            }
            None => {
                tracing::info!(task = %task.lease.task, queue = queue.queue_id(), "RocketMQ source queue has no stored position; reading from its first message")
            }
        }
    }
    tracing::info!(task = %task.lease.task, topic = %config.topic, queues = ?queues.iter().map(|q| q.queue_id()).collect::<Vec<_>>(), "RocketMQ source task consuming");
    task.report(State::Running, None).await;
    loop {
        let messages = tokio::select! {
            messages = consumer.poll_with_timeout(500) => messages,
            _ = task.stop.changed() => return Ok(()),
        };
        if task.stopping() {
            // Not appended: whoever runs the task next reads these again.
            return Ok(());
        }
        if messages.is_empty() {
            continue;
        }
        let shards = source.log.shards();
        let mut records: Vec<(u32, bytes::Bytes)> = Vec::with_capacity(messages.len());
        let mut next: BTreeMap<(String, u32), u64> = BTreeMap::new();
        for message in &messages {
            records.push(event(config, message, shards)?);
            let key = position_key(&source.id, message.broker_name());
            let after = (message.queue_offset() + 1).max(0) as u64;
            let entry = next
                .entry((key, message.queue_id().unsigned_abs()))
                .or_insert(after);
            *entry = (*entry).max(after);
        }
        // Durable on the bus first, then the positions move (at least once). They are
        // committed, fenced by the lease, on the worker's commit tick and when it stops.
        let mut wait = Duration::from_millis(50);
        while let Err(e) =
            targets::append_to_bus(source.log.as_ref(), &config.bus, records.clone()).await
        {
            tracing::warn!(task = %task.lease.task, error = %e, "appending to the bus failed; retrying");
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = task.stop.changed() => return Ok(()),
            }
            if !task.leased() {
                return Ok(());
            }
            wait = (wait * 2).min(Duration::from_secs(5));
        }
        for ((key, queue), after) in next {
            task.positions.set(&key, queue, after);
        }
    }
}

/// The stored event for a message, and its shard.
pub(crate) fn event(
    config: &RocketMqSourceConfig,
    message: &MessageExt,
    shards: u32,
) -> Result<(u32, Bytes), TargetError> {
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
            // Attribute values are percent-encoded in binary mode; the content type is not
            // (ingress reads Content-Type as it is).
            let value = if header == http::header::CONTENT_TYPE {
                value.to_string()
            } else {
                crate::event::header_text(value.as_str())
            };
            if let Ok(v) = http::HeaderValue::from_str(&value) {
                headers.insert(header, v);
            }
        }
        // The binding's body of an event without data is one NUL (the RocketMQ target sends
        // it, as RocketMQ refuses empty bodies): no data, not a body to read as the content type.
        let data: &[u8] = if body == b"\0" { b"" } else { &body };
        match cloudevent::from_binary(&headers, data) {
            Ok(parsed) => {
                let shard = event::shard_of(&event::partition_key(&parsed.event), shards);
                return Ok((shard, Bytes::from(parsed.stored)));
            }
            Err(e) => {
                tracing::warn!(source = %config.name, msg_id = %message.msg_id(), error = %e, "message has CloudEvents properties but is not a valid event; wrapping it");
            }
        }
    }
    let source = config
        .wrap_source
        .clone()
        .unwrap_or_else(|| format!("rocketmq://{}", config.topic));
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
        .ty(config.wrap_type.clone())
        .data(content_type, data)
        .extension("rocketmqtopic", config.topic.clone())
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

#[cfg(test)]
mod tests {
    use rocketmq_model::common::message::message_single::Message;

    use super::*;

    /// The event the source stores for a binary-mode message of topic `T` with this body and
    /// the required CloudEvents properties (id `1`) plus `extra`.
    fn read_binary_message(body: &'static [u8], extra: &[(&str, &str)]) -> cloudevents::Event {
        let config: RocketMqSourceConfig = toml::from_str(
            "name = \"s\"\nname_server = \"127.0.0.1:9876\"\ntopic = \"T\"\nbus = \"b\"\n",
        )
        .unwrap();
        let mut message = Message::builder()
            .topic("T")
            .body(Bytes::from_static(body))
            .build()
            .unwrap();
        let required = [
            ("CE_specversion", "1.0"),
            ("CE_id", "1"),
            ("CE_source", "/s"),
            ("CE_type", "t"),
        ];
        message.set_properties(
            required
                .iter()
                .chain(extra)
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
        );
        let mut ext = MessageExt::default();
        ext.set_message_inner(message);
        let (_, stored) = event(&config, &ext, 1).unwrap();
        crate::event::decode(&stored).unwrap()
    }

    /// Found by fuzzing (`ce_structured`, RocketMQ target → source): the content type was
    /// percent-encoded like an attribute, so `text/plain; charset=utf-8` came back as
    /// `text/plain;%20charset=utf-8`.
    #[test]
    fn a_binary_mode_message_keeps_its_content_type() {
        let e = read_binary_message(
            "hällo".as_bytes(),
            &[
                ("CE_subject", "a b%"),
                ("CE_datacontenttype", "text/plain; charset=utf-8"),
            ],
        );
        assert_eq!(
            cloudevents::AttributesReader::datacontenttype(&e),
            Some("text/plain; charset=utf-8")
        );
        assert_eq!(cloudevents::AttributesReader::subject(&e), Some("a b%"));
        assert_eq!(
            e.data(),
            Some(&cloudevents::Data::String("hällo".to_string()))
        );
    }

    /// Found by fuzzing (`ce_binary`, RocketMQ target → source): an event without data
    /// travels with the binding's one-NUL body, which the source read as the data, so a JSON
    /// content type made the event invalid and it was wrapped as a foreign message.
    #[test]
    fn the_one_nul_body_is_an_event_without_data() {
        let e = read_binary_message(b"\0", &[("CE_datacontenttype", "application/json")]);
        assert_eq!(cloudevents::AttributesReader::id(&e), "1");
        assert_eq!(e.data(), None);
    }
}
