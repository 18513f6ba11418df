//! The `rocketmq` target: each event becomes a message on a topic (the CloudEvents RocketMQ
//! binding, see `message`), sent to the queue its partition key maps to (see `queues`).
//!
//! Order: events with the same partition key go to the same queue for as long as the topic's
//! queues stay the same, and the batches of one queue are sent one after the other: a batch
//! goes only once the one before it for that queue succeeded, so a failed batch is retried
//! (the delivery policy retries the whole delivery) before anything after it. Different
//! queues are sent concurrently, with the number of batches in flight capped (unbounded
//! sends saturate the client's admission queue). One sync send costs ~1.7 ms here while
//! batches of 100 reach ~40k msg/s, so batch.
//!
//! Every send goes through the client's queue selector, synchronously, which the client never
//! retries: the client finds the route as RocketMQ producers do (the topic's route, else the
//! default route `TBW102`, so a broker with `autoCreateTopicEnable` creates the topic on the
//! first send), and the selector only ever answers the key's queue. A failed send stays
//! failed rather than moving to another queue; retries belong to the delivery policy.
//!
//! Client: `rocketmq-client-rust` (remoting protocol), which talks to the Rust broker
//! directly; the Apache 5.x client is gRPC-only and would need a proxy.

pub(crate) mod message;
mod queues;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use rocketmq_client_rust::{
    ClientError, ClientRuntime, ClientRuntimeConfig, DefaultMQProducer, MQClientException,
};
use rocketmq_model::common::message::message_queue::MessageQueue;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::result::SendStatus;
use tokio::sync::{OnceCell, Semaphore};

use crate::targets::config::RocketMqConfig;
use crate::targets::target::{Envelope, Target, TargetError};
use queues::{QueueMap, Route, Seen};

/// How long starting the producer may take before the attempt is given up.
const PRODUCER_START_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The one RocketMQ client runtime of the process (it owns its own Tokio runtime, as the
/// client requires). Created on first use and kept for the life of the process.
struct Client {
    runtime: Arc<ClientRuntime>,
    _owner: rocketmq_runtime::RuntimeOwner,
    _telemetry: rocketmq_observability::TelemetryRuntimeGuard,
}

static CLIENT: OnceLock<Result<Client, String>> = OnceLock::new();

pub fn client_runtime() -> Result<Arc<ClientRuntime>, TargetError> {
    let client = CLIENT.get_or_init(|| {
        let owner = rocketmq_runtime::RuntimeOwner::new()
            .map_err(|e| format!("cannot start the RocketMQ client runtime: {e}"))?;
        let telemetry = rocketmq_observability::TelemetryRuntimeGuard::noop();
        let runtime = ClientRuntime::try_new(
            owner.root_context().component("sluice-rocketmq"),
            ClientRuntimeConfig::default(),
            telemetry.handle(),
        )
        .map_err(|e| format!("cannot start the RocketMQ client runtime: {e}"))?;
        Ok(Client {
            runtime,
            _owner: owner,
            _telemetry: telemetry,
        })
    });
    match client {
        Ok(c) => Ok(c.runtime.clone()),
        Err(e) => Err(TargetError::fatal(e.clone())),
    }
}

/// Started producers by (name server, group). A configuration change rebuilds targets; the
/// new target reuses the producer instead of registering its group a second time.
type SharedProducer = Arc<OnceCell<Arc<DefaultMQProducer>>>;
static PRODUCERS: OnceLock<std::sync::Mutex<HashMap<(String, String), SharedProducer>>> =
    OnceLock::new();

fn shared_producer(name_server: &str, group: &str) -> SharedProducer {
    let mut producers = PRODUCERS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    producers
        .entry((name_server.to_string(), group.to_string()))
        .or_default()
        .clone()
}

pub struct RocketMqTarget {
    config: RocketMqConfig,
    producer: SharedProducer,
    route: Arc<Route>,
    in_flight: Arc<Semaphore>,
}

/// The topic that stands for every topic a broker may create on first use.
const DEFAULT_TOPIC: &str = "TBW102";

/// How long a delivery refused by a change of the topic's queues waits before it is grouped
/// again: long enough for the task status (checked every 250 ms) to show why.
const QUEUES_CHANGED_PAUSE: Duration = Duration::from_millis(500);

/// Why a send failed.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("the queues of topic `{topic}` changed from {from} to {to} ({queues}): partition keys now map over the new queues, so a key's events before and after the change may be on different queues; the batch is grouped again")]
    QueuesChanged {
        topic: String,
        from: usize,
        to: usize,
        queues: String,
    },
    #[error("topic `{topic}` does not exist and no broker creates it on first use (autoCreateTopicEnable = false, or no broker registered with name server {name_server}): create it, e.g. `mqadmin updateTopic -n {name_server} -c <cluster> -t {topic}`")]
    TopicMissing { topic: String, name_server: String },
    #[error("no route to topic `{topic}` from name server {name_server}: {error}")]
    NoRoute {
        topic: String,
        name_server: String,
        error: String,
    },
    #[error("the broker refused a message of topic `{topic}` as illegal: {error}")]
    Illegal { topic: String, error: String },
    #[error("send to queue {queue} of topic `{topic}` failed: {error}")]
    Failed {
        topic: String,
        queue: String,
        error: String,
    },
    #[error("the broker answered {status:?} for queue {queue} of topic `{topic}`")]
    Status {
        topic: String,
        queue: String,
        status: SendStatus,
    },
}

impl From<SendError> for TargetError {
    fn from(e: SendError) -> TargetError {
        match &e {
            SendError::Illegal { .. } => TargetError::fatal(e.to_string()),
            SendError::QueuesChanged { .. } => TargetError {
                retry_after: Some(QUEUES_CHANGED_PAUSE),
                ..TargetError::retryable(e.to_string())
            },
            _ => TargetError::retryable(e.to_string()),
        }
    }
}

/// What a send asks of the queue selector, and what the selector saw.
struct Pick {
    /// The map the batch was grouped under and the batch's queue in it; `None` for the send
    /// that learns the route, which goes to `key`'s queue on whatever the route lists.
    grouped: Option<(QueueMap, usize)>,
    key: String,
    seen: std::sync::Mutex<Option<QueueMap>>,
}

/// The queue selector: the batch's queue while the route lists what the batch was grouped
/// for, else none (the send fails and the delivery groups its events again).
fn select<M>(route: &[MessageQueue], _message: &M, pick: &Arc<Pick>) -> Option<MessageQueue> {
    let seen = QueueMap::new(route)?;
    let chosen = match &pick.grouped {
        Some((map, index)) if *map == seen => seen.queue(*index).cloned(),
        Some(_) => None,
        None => seen.queue(seen.index_of(&pick.key)).cloned(),
    };
    *pick.seen.lock().unwrap_or_else(|p| p.into_inner()) = Some(seen);
    chosen
}

/// What the tasks sending one queue's batches share.
struct Sender {
    producer: Arc<DefaultMQProducer>,
    route: Arc<Route>,
    topic: String,
    name_server: String,
    timeout_ms: u64,
}

impl Sender {
    /// Sends messages (one, or several as one batch request) through the selector.
    async fn send(&self, mut messages: Vec<Message>, pick: Pick) -> Result<(), SendError> {
        let pick = Arc::new(pick);
        let result = match messages.len() {
            1 => match messages.pop() {
                Some(message) => self
                    .producer
                    .send_with_selector_timeout(message, select, pick.clone(), self.timeout_ms)
                    .await
                    .map(|r| r.map(|r| r.send_status)),
                None => Ok(None),
            },
            _ => match message::batch(messages) {
                Ok(batch) => self
                    .producer
                    .send_with_selector_timeout(batch, select, pick.clone(), self.timeout_ms)
                    .await
                    .map(|r| r.map(|r| r.send_status)),
                Err(e) => {
                    return Err(SendError::Failed {
                        topic: self.topic.clone(),
                        queue: "-".into(),
                        error: e.message,
                    })
                }
            },
        };
        let seen = pick.seen.lock().unwrap_or_else(|p| p.into_inner()).take();
        let expected = pick.grouped.as_ref().map(|(map, _)| map);
        let queue = match (&seen, &pick.grouped) {
            (Some(seen), Some((_, index))) => seen.queue(*index),
            (Some(seen), None) => seen.queue(seen.index_of(&pick.key)),
            (None, _) => None,
        }
        .map(|q| format!("{}:{}", q.broker_name(), q.queue_id()))
        .unwrap_or_else(|| "-".into());
        if let Some(seen) = &seen {
            match self.route.observe(expected, seen) {
                Seen::Same => {}
                Seen::First => {
                    tracing::debug!(topic = %self.topic, queues = %seen.describe(), "partition keys are spread over these queues");
                }
                Seen::Changed {
                    from,
                    to,
                    first_report,
                } => {
                    if first_report {
                        tracing::warn!(
                            topic = %self.topic,
                            from = from.len(),
                            to = to.len(),
                            queues = %to.describe(),
                            "the topic's queues changed: partition keys now map over the new queues (a key's events before and after the change may be on different queues)"
                        );
                    }
                    if expected.is_some() {
                        return Err(SendError::QueuesChanged {
                            topic: self.topic.clone(),
                            from: from.len(),
                            to: to.len(),
                            queues: to.describe(),
                        });
                    }
                }
            }
        }
        match result {
            Ok(Some(SendStatus::SendOk)) | Ok(None) => Ok(()),
            Ok(Some(status)) => Err(SendError::Status {
                topic: self.topic.clone(),
                queue,
                status,
            }),
            Err(error) => Err(self.classify(error, seen.is_some(), queue).await),
        }
    }

    /// Names a failure for the status: a topic the broker will not create, a route the name
    /// server does not have, a message the broker refuses, or a failed send.
    async fn classify(&self, error: ClientError, selected: bool, queue: String) -> SendError {
        const TOPIC_NOT_EXIST: i32 = 17;
        const MESSAGE_ILLEGAL: i32 = 13;
        match error.broker_response_code() {
            Some(TOPIC_NOT_EXIST) => {
                return SendError::TopicMissing {
                    topic: self.topic.clone(),
                    name_server: self.name_server.clone(),
                }
            }
            Some(MESSAGE_ILLEGAL) => {
                return SendError::Illegal {
                    topic: self.topic.clone(),
                    error: explain(&error),
                }
            }
            _ => {}
        }
        if selected {
            return SendError::Failed {
                topic: self.topic.clone(),
                queue,
                error: explain(&error),
            };
        }
        // No route reached the selector: ask the name server whether the topic, or the
        // default topic a broker creates topics from, exists at all.
        let mut probe = (*self.producer).clone();
        let topic_missing = matches!(probe.fetch_publish_message_queues(&self.topic).await, Err(e) if route_not_found(&e));
        if topic_missing
            && matches!(probe.fetch_publish_message_queues(DEFAULT_TOPIC).await, Err(e) if route_not_found(&e))
        {
            return SendError::TopicMissing {
                topic: self.topic.clone(),
                name_server: self.name_server.clone(),
            };
        }
        SendError::NoRoute {
            topic: self.topic.clone(),
            name_server: self.name_server.clone(),
            error: explain(&error),
        }
    }
}

/// The client's message below an error's canonical code (alone, the code reads like
/// "core.argument.invalid: Argument is invalid").
fn detail(error: &ClientError) -> Option<&str> {
    error
        .source_ref::<MQClientException>()
        .and_then(MQClientException::error_message)
}

/// An error for logs and the task status: its code, and the client's message when it has one.
fn explain(error: &ClientError) -> String {
    match detail(error) {
        Some(detail) => format!("{error} ({detail})"),
        None => error.to_string(),
    }
}

/// Whether the name server answered that it knows no such topic (the client says so only
/// in its message; an unreachable name server fails differently).
fn route_not_found(error: &ClientError) -> bool {
    detail(error).is_some_and(|d| d.contains("Can not find Message Queue"))
}

impl RocketMqTarget {
    pub fn new(config: &RocketMqConfig) -> Result<RocketMqTarget, TargetError> {
        config.check().map_err(TargetError::fatal)?;
        let group = config
            .producer_group
            .clone()
            .unwrap_or_else(|| format!("sluice-{}", config.name));
        Ok(RocketMqTarget {
            producer: shared_producer(&config.name_server, &group),
            config: config.clone(),
            route: Arc::new(Route::default()),
            in_flight: Arc::new(Semaphore::new(config.max_in_flight)),
        })
    }

    /// The producer, started on first use (so the gateway starts while the broker is down).
    async fn producer(&self) -> Result<Arc<DefaultMQProducer>, TargetError> {
        self.producer
            .get_or_try_init(|| async {
                let runtime = client_runtime()?;
                let group = self
                    .config
                    .producer_group
                    .clone()
                    .unwrap_or_else(|| format!("sluice-{}", self.config.name));
                // No client-side retries: a retried send could land after the sends behind
                // it, and the delivery policy retries whole deliveries anyway.
                let mut producer = DefaultMQProducer::builder(runtime)
                    .producer_group(group)
                    .name_server_addr(self.config.name_server.clone())
                    .send_msg_timeout(self.config.send_timeout.as_millis() as u32)
                    .retry_times_when_send_failed(0)
                    .retry_times_when_send_async_failed(0)
                    .build();
                // A start that never returns (seen once under load in the client's set-up)
                // must not park the target for good: give up and start afresh next time.
                match tokio::time::timeout(PRODUCER_START_TIMEOUT, producer.start()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => {
                        return Err(TargetError::retryable(format!(
                            "cannot start the RocketMQ producer: {e}"
                        )))
                    }
                    Err(_) => {
                        return Err(TargetError::retryable(format!(
                            "the RocketMQ producer did not start within {PRODUCER_START_TIMEOUT:?}"
                        )))
                    }
                }
                Ok(Arc::new(producer))
            })
            .await
            .cloned()
    }

    /// One queue's events, in order, cut into batches by count and bytes.
    fn batches(&self, encoded: Vec<message::Encoded>, map: &QueueMap) -> Vec<Vec<Vec<Message>>> {
        let mut per_queue: Vec<Vec<Vec<Message>>> = vec![Vec::new(); map.len()];
        let mut sizes: Vec<usize> = vec![0; map.len()];
        for e in encoded {
            let q = map.index_of(&e.key);
            let batches = &mut per_queue[q];
            let full = batches.last().is_none_or(|b| {
                b.len() >= self.config.max_batch || sizes[q] + e.size > self.config.max_batch_bytes
            });
            if full {
                batches.push(Vec::new());
                sizes[q] = 0;
            }
            sizes[q] += e.size;
            if let Some(batch) = batches.last_mut() {
                batch.push(e.message);
            }
        }
        per_queue
    }
}

#[async_trait]
impl Target for RocketMqTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let producer = self.producer().await?;
        let mut encoded = events
            .iter()
            .map(|e| message::encode(&self.config, e))
            .collect::<Result<Vec<_>, _>>()?;
        if encoded.is_empty() {
            return Ok(());
        }
        let sender = Arc::new(Sender {
            producer,
            route: self.route.clone(),
            topic: self.config.topic.clone(),
            name_server: self.config.name_server.clone(),
            timeout_ms: self.config.send_timeout.as_millis() as u64,
        });
        let map = match self.route.current() {
            Some(map) => map,
            None => {
                // Nothing is known of the topic's queues yet: the first event's send learns
                // them (for a new topic, from the default route the broker creates it with).
                let first = encoded.remove(0);
                let pick = Pick {
                    grouped: None,
                    key: first.key,
                    seen: Default::default(),
                };
                sender.send(vec![first.message], pick).await?;
                self.route.current().ok_or_else(|| {
                    TargetError::retryable(format!(
                        "no queues of topic `{}` learnt from the route",
                        self.config.topic
                    ))
                })?
            }
        };
        let mut sends = tokio::task::JoinSet::new();
        for (index, batches) in self.batches(encoded, &map).into_iter().enumerate() {
            if batches.is_empty() {
                continue;
            }
            let sender = sender.clone();
            let in_flight = self.in_flight.clone();
            let map = map.clone();
            sends.spawn(async move {
                for batch in batches {
                    let _permit = in_flight
                        .acquire()
                        .await
                        .map_err(|_| TargetError::retryable("target is shutting down"))?;
                    let pick = Pick {
                        grouped: Some((map.clone(), index)),
                        key: String::new(),
                        seen: Default::default(),
                    };
                    // The next batch of this queue goes only after this one succeeded.
                    sender.send(batch, pick).await?;
                }
                Ok::<(), TargetError>(())
            });
        }
        // A refused event is reported over a refused route, which is reported over the
        // rest: a non-retryable error makes the delivery go event by event.
        let mut worst: Option<TargetError> = None;
        while let Some(joined) = sends.join_next().await {
            let result = joined.unwrap_or_else(|e| Err(TargetError::retryable(e.to_string())));
            if let Err(e) = result {
                let rank = |e: &TargetError| (!e.retryable, e.retry_after.is_some());
                if worst.as_ref().is_none_or(|w| rank(&e) > rank(w)) {
                    worst = Some(e);
                }
            }
        }
        match worst {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    fn describe(&self) -> String {
        format!(
            "rocketmq {} topic {}",
            self.config.name_server, self.config.topic
        )
    }
}
