//! A real RocketMQ for tests: `rocketmq-namesrv-rust` and `rocketmq-broker-rust` (from the
//! `rocketmq-namesrv` / `rocketmq-broker` crates, built by `make rocketmq` into the cache
//! and found through `SLUICE_ROCKETMQ_BIN`) on free loopback ports with a temporary store,
//! plus the harness's own consumer and producer to prove round trips.

use std::collections::HashMap;
use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rocketmq_client_rust::{
    ClientResult, ClientRuntime, ClientRuntimeConfig, ConsumeConcurrentlyContext,
    ConsumeConcurrentlyStatus, DefaultLitePullConsumer, DefaultMQProducer, DefaultMQPushConsumer,
    MQPushConsumer, MessageListenerConcurrently,
};
use rocketmq_model::common::consumer::consume_from_where::ConsumeFromWhere;
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use tempfile::TempDir;

use crate::free_port;

/// Where the name server and broker binaries are.
pub fn rocketmq_bin() -> PathBuf {
    let dir = std::env::var("SLUICE_ROCKETMQ_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/sluice/rocketmq-1.0.0/bin")
        });
    for bin in ["rocketmq-namesrv-rust", "rocketmq-broker-rust"] {
        assert!(
            dir.join(bin).exists(),
            "{} is missing: run `make rocketmq` (it builds the RocketMQ name server and broker into the cache) or set SLUICE_ROCKETMQ_BIN",
            dir.join(bin).display()
        );
    }
    dir
}

/// A name server and a broker, stopped and deleted on drop.
pub struct RocketMq {
    namesrv: Option<Child>,
    broker: Option<Child>,
    dir: TempDir,
    pub namesrv_port: u16,
    pub broker_port: u16,
}

/// A port `p` such that `p` and `p - 2` (the broker's fast port) are free.
fn broker_port() -> u16 {
    loop {
        let p = free_port();
        if p > 1026 && std::net::TcpListener::bind(("127.0.0.1", p - 2)).is_ok() {
            return p;
        }
    }
}

impl RocketMq {
    pub async fn start() -> RocketMq {
        let bin = rocketmq_bin();
        let dir = tempfile::tempdir().expect("temp dir");
        let home = dir.path().to_path_buf();
        let home = home.as_path();
        let namesrv_port = free_port();
        let broker_port = broker_port();
        let ha_port = free_port();
        let ns_conf = home.join("namesrv.toml");
        fs::write(
            &ns_conf,
            format!(
                "rocketmqHome = \"{h}\"\nkvConfigPath = \"{h}/namesrv/kvConfig.json\"\nconfigStorePath = \"{h}/namesrv/namesrv.properties\"\n",
                h = home.display()
            ),
        )
        .expect("namesrv.toml");
        let store = home.join("store");
        let broker_conf = home.join("broker.toml");
        fs::write(
            &broker_conf,
            format!(
                r#"[broker]
namesrvAddr = "127.0.0.1:{namesrv_port}"
brokerIp1 = "127.0.0.1"
listenPort = {broker_port}
storePathRootDir = "{store}"
autoCreateTopicEnable = true

[broker.brokerServerConfig]
bindAddress = "127.0.0.1"

[broker.brokerIdentity]
brokerName = "broker-a"
brokerClusterName = "DefaultCluster"
brokerId = 0

[store]
storeType = "LocalFile"
brokerRole = "ASYNC_MASTER"
storePathRootDir = "{store}"
haListenAddress = "127.0.0.1"
haListenPort = {ha_port}
mappedFileSizeCommitLog = 67108864
"#,
                store = store.display()
            ),
        )
        .expect("broker.toml");
        let log = |name: &str| fs::File::create(home.join(name)).expect("log file");
        let namesrv = Command::new(bin.join("rocketmq-namesrv-rust"))
            .args([
                "-c",
                &ns_conf.to_string_lossy(),
                "--bindAddress",
                "127.0.0.1",
            ])
            .args(["--listenPort", &namesrv_port.to_string()])
            .env("ROCKETMQ_HOME", home)
            .env("ROCKETMQ_SECURITY_PROFILE", "development-insecure-loopback")
            .current_dir(home)
            .stdin(Stdio::null())
            .stdout(log("namesrv.log"))
            .stderr(log("namesrv.err"))
            .spawn()
            .expect("start rocketmq-namesrv-rust");
        let mut mq = RocketMq {
            namesrv: Some(namesrv),
            broker: None,
            dir,
            namesrv_port,
            broker_port,
        };
        mq.wait_port(namesrv_port, "name server").await;
        let broker = Command::new(bin.join("rocketmq-broker-rust"))
            .args(["-c", &broker_conf.to_string_lossy()])
            .args(["-n", &format!("127.0.0.1:{namesrv_port}")])
            .env("ROCKETMQ_HOME", mq.dir.path())
            .env("ROCKETMQ_SECURITY_PROFILE", "development-insecure-loopback")
            .current_dir(mq.dir.path())
            .stdin(Stdio::null())
            .stdout(log("broker.log"))
            .stderr(log("broker.err"))
            .spawn()
            .expect("start rocketmq-broker-rust");
        mq.broker = Some(broker);
        mq.wait_port(broker_port, "broker").await;
        mq
    }

    async fn wait_port(&mut self, port: u16, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let exited = [self.namesrv.as_mut(), self.broker.as_mut()]
                .into_iter()
                .flatten()
                .find_map(|child| child.try_wait().ok().flatten());
            if let Some(status) = exited {
                panic!("RocketMQ {what} exited ({status}):\n{}", self.logs());
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "RocketMQ {what} not listening:\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub fn name_server(&self) -> String {
        format!("127.0.0.1:{}", self.namesrv_port)
    }

    /// The tail of the name server's and broker's output, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        for name in ["namesrv.log", "namesrv.err", "broker.log", "broker.err"] {
            let text = fs::read_to_string(self.dir.path().join(name)).unwrap_or_default();
            let tail: String = text
                .chars()
                .rev()
                .take(3000)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            out.push_str(&format!("--- {name}\n{tail}\n"));
        }
        out
    }

    /// A started producer on this broker.
    pub async fn producer(&self, group: &str) -> DefaultMQProducer {
        let mut producer = DefaultMQProducer::builder(client_runtime())
            .producer_group(group)
            .name_server_addr(self.name_server())
            .send_msg_timeout(5000)
            .build();
        producer.start().await.expect("start producer");
        producer
    }

    /// Sends until the broker has registered and auto-created the topic (bounded wait).
    pub async fn ensure_topic(&self, topic: &str) {
        let producer = self.producer(&format!("ensure-{topic}")).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let message = Message::builder()
                .topic(topic)
                .tags("sluice-warmup")
                .body_slice(b"warmup")
                .build()
                .expect("message");
            match producer.send(message).await {
                Ok(_) => return,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "topic {topic} not writable: {e}\n{}",
                        self.logs()
                    );
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }

    /// Reads `count` messages of `topic` from the start with a pull consumer assigned to
    /// every queue: each queue's messages come in the order the broker stored them.
    pub async fn read_in_queue_order(
        &self,
        topic: &str,
        count: usize,
        limit: Duration,
    ) -> Vec<Received> {
        let consumer = DefaultLitePullConsumer::builder(client_runtime())
            .consumer_group(format!("order-check-{topic}"))
            .name_server_addr(self.name_server())
            .auto_commit(false)
            .build()
            .expect("pull consumer");
        consumer.start().await.expect("start pull consumer");
        let queues = consumer.fetch_message_queues(topic).await.expect("queues");
        consumer.assign(queues.clone()).await.expect("assign");
        for q in &queues {
            consumer.seek_to_begin(q).await.expect("seek");
        }
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        while out.len() < count {
            assert!(
                Instant::now() < deadline,
                "read {} of {count} messages of {topic} in {limit:?}",
                out.len()
            );
            let messages = consumer.poll_with_timeout(500).await;
            out.extend(messages.iter().filter_map(Received::from_message));
        }
        consumer.shutdown().await;
        out
    }

    /// A push consumer of `topic` from its first offset, recording every message.
    pub async fn consume(&self, topic: &str, group: &str) -> Consumer {
        let received = Arc::new(Mutex::new(Vec::new()));
        let mut consumer = DefaultMQPushConsumer::builder(client_runtime())
            .consumer_group(group)
            .name_server_addr(self.name_server())
            .consume_from_where(ConsumeFromWhere::ConsumeFromFirstOffset)
            .build();
        consumer.subscribe(topic, "*").await.expect("subscribe");
        consumer.register_message_listener_concurrently(Recorder(received.clone()));
        consumer.start().await.expect("start consumer");
        Consumer {
            inner: consumer,
            received,
        }
    }
}

impl Drop for RocketMq {
    fn drop(&mut self) {
        for child in [self.broker.take(), self.namesrv.take()]
            .into_iter()
            .flatten()
        {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A message as the harness consumer saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub queue_id: i32,
    pub queue_offset: i64,
    pub tags: Option<String>,
    pub keys: Option<String>,
    pub body: Vec<u8>,
    pub properties: HashMap<String, String>,
}

impl Received {
    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties.get(name).map(String::as_str)
    }

    /// The message as received; `None` for the harness's own warm-up messages.
    fn from_message(m: &MessageExt) -> Option<Received> {
        let properties: HashMap<String, String> = m
            .properties()
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if properties.get("TAGS").map(String::as_str) == Some("sluice-warmup") {
            return None;
        }
        Some(Received {
            queue_id: m.queue_id(),
            queue_offset: m.queue_offset(),
            tags: properties.get("TAGS").cloned(),
            keys: properties.get("KEYS").cloned(),
            body: m.body().map(|b| b.to_vec()).unwrap_or_default(),
            properties,
        })
    }
}

struct Recorder(Arc<Mutex<Vec<Received>>>);

impl MessageListenerConcurrently for Recorder {
    fn consume_message(
        &self,
        messages: &[&MessageExt],
        _context: &ConsumeConcurrentlyContext,
    ) -> ClientResult<ConsumeConcurrentlyStatus> {
        let mut out = self.0.lock().unwrap();
        out.extend(messages.iter().filter_map(|m| Received::from_message(m)));
        Ok(ConsumeConcurrentlyStatus::ConsumeSuccess)
    }
}

pub struct Consumer {
    inner: DefaultMQPushConsumer,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Consumer {
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Waits (a new push consumer needs 2–12 s before its first messages) until `pred`
    /// holds, or panics after `limit`.
    pub async fn wait_for(
        &self,
        limit: Duration,
        pred: impl Fn(&[Received]) -> bool,
    ) -> Vec<Received> {
        let deadline = Instant::now() + limit;
        loop {
            let received = self.received();
            if pred(&received) {
                return received;
            }
            assert!(
                Instant::now() < deadline,
                "consumer condition not met after {limit:?}; {} messages received",
                received.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn shutdown(mut self) {
        self.inner.shutdown().await;
    }
}

/// The test process's one RocketMQ client runtime (it owns its own Tokio runtime).
pub fn client_runtime() -> Arc<ClientRuntime> {
    struct Holder {
        runtime: Arc<ClientRuntime>,
        _owner: rocketmq_runtime::RuntimeOwner,
        _telemetry: rocketmq_observability::TelemetryRuntimeGuard,
    }
    static HOLDER: OnceLock<Holder> = OnceLock::new();
    HOLDER
        .get_or_init(|| {
            let owner = rocketmq_runtime::RuntimeOwner::new().expect("client runtime owner");
            let telemetry = rocketmq_observability::TelemetryRuntimeGuard::noop();
            let runtime = ClientRuntime::try_new(
                owner.root_context().component("sluice-tests"),
                ClientRuntimeConfig::default(),
                telemetry.handle(),
            )
            .expect("client runtime");
            Holder {
                runtime,
                _owner: owner,
                _telemetry: telemetry,
            }
        })
        .runtime
        .clone()
}
