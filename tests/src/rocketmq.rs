//! A real RocketMQ for tests: `rocketmq-namesrv-rust` and `rocketmq-broker-rust` (from the
//! `rocketmq-namesrv` / `rocketmq-broker` crates, built by `make rocketmq` into the cache
//! and found through `SLUICE_ROCKETMQ_BIN`) on free loopback ports with a temporary store,
//! plus the harness's own producer, a reader that reads every queue of a topic from its
//! first offset (queue ids and offsets as the consumer reports them), and the broker
//! restarts and topic changes that tests inflict.

use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use rocketmq_client_rust::{ClientRuntime, ClientRuntimeConfig, DefaultMQProducer};
use rocketmq_model::common::message::message_ext::MessageExt;
use rocketmq_model::common::message::message_single::Message;
use tempfile::TempDir;

use crate::free_port;

/// Starts `rocketmq-{what}-rust` of `bin` in `home` with `args`, its output appended to
/// `{what}.log` / `{what}.err` there.
fn launch(home: &Path, bin: &Path, what: &str, args: &[&str]) -> Child {
    let log = |name: String| {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(home.join(name))
            .expect("log file")
    };
    Command::new(bin.join(format!("rocketmq-{what}-rust")))
        .args(args)
        .env("ROCKETMQ_HOME", home)
        .env("ROCKETMQ_SECURITY_PROFILE", "development-insecure-loopback")
        .current_dir(home)
        .stdin(Stdio::null())
        .stdout(log(format!("{what}.log")))
        .stderr(log(format!("{what}.err")))
        .spawn()
        .unwrap_or_else(|e| panic!("start rocketmq-{what}-rust: {e}"))
}

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
    bin: PathBuf,
    pub namesrv_port: u16,
    pub broker_port: u16,
}

/// How to start a broker.
pub struct RocketMqBuilder {
    auto_create_topics: bool,
    namesrv_port: Option<u16>,
}

impl RocketMqBuilder {
    /// Whether the broker creates a topic on its first send (`autoCreateTopicEnable`, on
    /// by default here as in RocketMQ).
    pub fn auto_create_topics(mut self, on: bool) -> Self {
        self.auto_create_topics = on;
        self
    }

    /// The name server's port (a free one by default): for a client configured before
    /// the name server exists.
    pub fn namesrv_port(mut self, port: u16) -> Self {
        self.namesrv_port = Some(port);
        self
    }

    pub async fn start(self) -> RocketMq {
        // On a loaded machine a port picked free may be taken before the broker binds it
        // (the broker then exits at start-up): start again on fresh ports and a fresh store,
        // at most three times, before failing.
        for attempt in 1..=3 {
            match RocketMq::start_with(&self).await {
                Ok(mq) => return mq,
                Err(e) if attempt < 3 => {
                    eprintln!("RocketMQ did not start (attempt {attempt}); trying again on fresh ports:\n{e}");
                }
                Err(e) => panic!("{e}"),
            }
        }
        unreachable!("the last attempt panics")
    }
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
    pub fn builder() -> RocketMqBuilder {
        RocketMqBuilder {
            auto_create_topics: true,
            namesrv_port: None,
        }
    }

    pub async fn start() -> RocketMq {
        RocketMq::builder().start().await
    }

    async fn start_with(options: &RocketMqBuilder) -> Result<RocketMq, String> {
        let bin = rocketmq_bin();
        let dir = tempfile::tempdir().expect("temp dir");
        let home = dir.path().to_path_buf();
        let home = home.as_path();
        let namesrv_port = options.namesrv_port.unwrap_or_else(free_port);
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
autoCreateTopicEnable = {auto_create}

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
                store = store.display(),
                auto_create = options.auto_create_topics,
            ),
        )
        .expect("broker.toml");
        let namesrv = launch(
            home,
            &bin,
            "namesrv",
            &[
                "-c",
                &ns_conf.to_string_lossy(),
                "--bindAddress",
                "127.0.0.1",
                "--listenPort",
                &namesrv_port.to_string(),
            ],
        );
        let mut mq = RocketMq {
            namesrv: Some(namesrv),
            broker: None,
            dir,
            bin,
            namesrv_port,
            broker_port,
        };
        mq.try_wait_port(namesrv_port, "name server").await?;
        mq.try_spawn_broker().await?;
        Ok(mq)
    }

    /// Starts the broker (again) on its configuration and store; its output is appended to
    /// `broker.log` / `broker.err`.
    async fn spawn_broker(&mut self) {
        if let Err(e) = self.try_spawn_broker().await {
            panic!("{e}");
        }
    }

    async fn try_spawn_broker(&mut self) -> Result<(), String> {
        let home = self.dir.path();
        let broker = launch(
            home,
            &self.bin,
            "broker",
            &[
                "-c",
                &home.join("broker.toml").to_string_lossy(),
                "-n",
                &self.name_server(),
            ],
        );
        self.broker = Some(broker);
        self.try_wait_port(self.broker_port, "broker").await
    }

    /// Stops the broker with SIGTERM (as an orderly restart does), waits for it to exit
    /// (30 s at most) and starts it again on the same store.
    pub async fn restart_broker(&mut self) {
        let mut broker = self.broker.take().expect("the broker is running");
        crate::send_signal(broker.id(), "TERM");
        let deadline = Instant::now() + Duration::from_secs(30);
        while broker.try_wait().expect("wait for the broker").is_none() {
            if Instant::now() > deadline {
                let _ = broker.kill();
                let _ = broker.wait();
                panic!(
                    "the broker did not stop within 30 s of SIGTERM:\n{}",
                    self.logs()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.spawn_broker().await;
    }

    async fn try_wait_port(&mut self, port: u16, what: &str) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let exited = [self.namesrv.as_mut(), self.broker.as_mut()]
                .into_iter()
                .flatten()
                .find_map(|child| child.try_wait().ok().flatten());
            if let Some(status) = exited {
                return Err(format!(
                    "RocketMQ {what} exited ({status}):\n{}",
                    self.logs()
                ));
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("RocketMQ {what} not listening:\n{}", self.logs()));
            }
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

    /// Creates `topic` with `queues` read and write queues on the broker, or changes the
    /// queue count of an existing topic, and waits (30 s at most) until the name server's
    /// route shows it.
    pub async fn create_topic(&self, topic: &str, queues: i32) {
        let mut producer = self.producer(&format!("admin-{topic}")).await;
        let deadline = Instant::now() + Duration::from_secs(30);
        // The key topic only tells the client which brokers to ask; the broker registers
        // a topic named after its cluster, once it has registered with the name server.
        while let Err(e) = producer
            .create_topic("DefaultCluster", topic, queues, HashMap::new())
            .await
        {
            assert!(
                Instant::now() < deadline,
                "create topic {topic}: {e}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        loop {
            match producer.fetch_publish_message_queues(topic).await {
                Ok(q) if q.len() == queues as usize => break,
                other => assert!(
                    Instant::now() < deadline,
                    "topic {topic} never showed {queues} queues: {:?}",
                    other.map(|q| q.len())
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        producer.shutdown().await;
    }

    /// Reads every queue of `topic` from its first offset to its end with a pull consumer,
    /// until at least `count` messages are stored and no more arrive for a second (60 s at
    /// most). Each message carries the queue id it was pulled from and the queue offset the
    /// consumer reports for it; the result is sorted by queue and offset. Panics if a
    /// queue does not start at offset 0 or a reported offset is not where it was pulled.
    /// (A push consumer is no witness of where messages are: one it redelivers through its
    /// group's retry topic reports that topic's queue id and offset.)
    #[allow(
        deprecated,
        reason = "classic pull reads one queue from a given offset, which is what checking the stored order needs"
    )]
    pub async fn read_queues(&self, topic: &str, count: usize) -> Vec<Received> {
        use rocketmq_client_rust::DefaultMQPullConsumer;
        static READERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = READERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let consumer = DefaultMQPullConsumer::builder(client_runtime())
            .consumer_group(format!("read-{topic}-{n}"))
            .name_server_addr(self.name_server())
            .build()
            .expect("pull consumer");
        consumer.start().await.expect("start pull consumer");
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut last_total = None;
        let mut quiet_since = Instant::now();
        let out = loop {
            let read = read_every_queue(&consumer, topic).await;
            let total = read.as_ref().map(Vec::len).ok();
            if total != last_total {
                last_total = total;
                quiet_since = Instant::now();
            }
            match read {
                Ok(messages)
                    if messages.len() >= count
                        && quiet_since.elapsed() >= Duration::from_secs(1) =>
                {
                    break messages
                }
                other => assert!(
                    Instant::now() < deadline,
                    "{topic}: wanted {count} stored messages, read {:?} in 60 s\n{}",
                    other.map(|m| m.len()),
                    self.logs()
                ),
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // No shutdown: it takes ~20 s (it waits out the rebalance service), and the
        // consumer's background work ends with the test process.
        drop(consumer);
        out
    }
}

/// One pass over every queue of `topic`, from offset 0 to the queue's end.
#[allow(deprecated, reason = "see `RocketMq::read_queues`")]
async fn read_every_queue(
    consumer: &rocketmq_client_rust::DefaultMQPullConsumer,
    topic: &str,
) -> Result<Vec<Received>, String> {
    let queues = consumer
        .fetch_subscribe_message_queues(topic)
        .await
        .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    for queue in &queues {
        let first = consumer
            .min_offset(queue)
            .await
            .map_err(|e| e.to_string())?;
        assert_eq!(first, 0, "queue {queue:?} no longer starts at offset 0");
        let end = consumer
            .max_offset(queue)
            .await
            .map_err(|e| e.to_string())?;
        let mut offset = 0i64;
        // Each pull moves at least one message forward, so `end` pulls are enough.
        for _ in 0..=end {
            if offset >= end {
                break;
            }
            let pulled = consumer
                .pull(queue, "*", offset, 32)
                .await
                .map_err(|e| e.to_string())?;
            let messages = pulled.msg_found_list().unwrap_or_default();
            for (i, m) in messages.iter().enumerate() {
                assert_eq!(
                    (m.queue_id(), m.queue_offset()),
                    (queue.queue_id(), offset + i as i64),
                    "the consumer reports message {i} pulled from {queue:?} at offset {offset} as queue {} offset {}",
                    m.queue_id(),
                    m.queue_offset()
                );
                out.extend(Received::from_message(m));
            }
            let next = pulled.next_begin_offset() as i64;
            if next <= offset {
                break;
            }
            offset = next;
        }
    }
    out.sort_by_key(|m| (m.queue_id, m.queue_offset));
    Ok(out)
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
