//! The handle on the cluster's Redis: the connection (one server, or a Redis Cluster), the
//! key prefix and layout, and the errors every other file of `store::redis` builds on (this
//! file imports none of them).

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClient, ClusterClientBuilder};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::store::StoreError;

pub(super) fn redis_error(context: &str, e: &redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis {context}: {e}"))
}

/// Where the cluster's shared state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One Redis server (`redis_url`).
    Single(String),
    /// A Redis Cluster, by its seed nodes (`redis_cluster_nodes`).
    Cluster(Vec<String>),
}

impl Target {
    /// The addresses as they may be shown (no passwords).
    pub fn describe(&self) -> String {
        match self {
            Target::Single(url) => crate::values::redact_url(url),
            Target::Cluster(nodes) => format!(
                "cluster {}",
                nodes
                    .iter()
                    .map(|n| crate::values::redact_url(n))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }
}

/// `cluster.redis_durability`: when an append counts as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replication {
    /// Replicas that must hold an append before it is acknowledged.
    pub min_replicas: u32,
    /// How long an append waits for them (`WAIT`) before it is refused.
    pub timeout: Duration,
}

/// A connection to one Redis or to a Redis Cluster, as one `ConnectionLike`: every call
/// site sends the same commands and scripts either way (each touches keys of one hash slot).
#[derive(Clone)]
pub struct Conn(Link);

#[derive(Clone)]
enum Link {
    Managed(ConnectionManager),
    Plain(redis::aio::MultiplexedConnection),
    Cluster(Arc<LazyCluster>),
}

/// A cluster connection made on first use (a gateway may start while the cluster is down
/// and serve 503s until it is back), and made again after a failed attempt.
struct LazyCluster {
    client: ClusterClient,
    conn: tokio::sync::OnceCell<ClusterConnection>,
}

impl LazyCluster {
    async fn get(&self) -> redis::RedisResult<ClusterConnection> {
        self.conn
            .get_or_try_init(|| self.client.get_async_connection())
            .await
            .cloned()
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Link::Managed(c) => c.req_packed_command(cmd),
            Link::Plain(c) => c.req_packed_command(cmd),
            Link::Cluster(lazy) => Box::pin(async move {
                let mut conn = lazy.get().await?;
                conn.req_packed_command(cmd).await
            }),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Link::Managed(c) => c.req_packed_commands(pipeline, offset, count),
            Link::Plain(c) => c.req_packed_commands(pipeline, offset, count),
            Link::Cluster(lazy) => Box::pin(async move {
                let mut conn = lazy.get().await?;
                conn.req_packed_commands(pipeline, offset, count).await
            }),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Link::Managed(c) => c.get_db(),
            Link::Plain(c) => c.get_db(),
            Link::Cluster(_) => 0,
        }
    }
}

/// A connection to the cluster's Redis and its key prefix.
#[derive(Clone)]
pub struct Redis {
    conn: Conn,
    target: Target,
    /// One client per address: pub/sub (`PUBLISH` reaches every node of a cluster, so a
    /// subscription on any one hears it) and, on one server, blocking reads.
    clients: Arc<Vec<redis::Client>>,
    prefix: String,
    timeout: Duration,
    /// `limits.max_dedup_bytes`: every dedup index of this process takes its share of it.
    dedup_bytes: usize,
    /// `cluster.redis_durability = "replicated"`: its settings and the connection its
    /// appends and their `WAIT` share (a `WAIT` holds up the calls behind it on its
    /// connection, so it has one of its own).
    replication: Option<(Replication, Conn)>,
}

fn cluster_builder(nodes: &[String], timeout: Duration) -> ClusterClientBuilder {
    ClusterClientBuilder::new(nodes.to_vec())
        .connection_timeout(timeout)
        .response_timeout(timeout)
        .retries(3)
}

impl Redis {
    /// `url` is `redis://` or, for TLS, `rediss://` (certificates checked against the
    /// platform's roots). Errors show the URL without its password.
    pub async fn connect(url: &str, prefix: &str, timeout: Duration) -> Result<Redis, StoreError> {
        Redis::open(&Target::Single(url.to_string()), prefix, timeout)
    }

    /// Opens one server or a cluster; nothing is dialled until the first call.
    pub fn open(target: &Target, prefix: &str, timeout: Duration) -> Result<Redis, StoreError> {
        let open = |url: &str| {
            redis::Client::open(url).map_err(|e| {
                StoreError::Unavailable(format!(
                    "redis url `{}`: {e}",
                    crate::values::redact_url(url)
                ))
            })
        };
        let (conn, clients) = match target {
            Target::Single(url) => {
                let client = open(url)?;
                (Redis::managed(&client, timeout)?, vec![client])
            }
            Target::Cluster(nodes) => {
                if nodes.is_empty() {
                    return Err(StoreError::Unavailable(
                        "redis_cluster_nodes names no node".to_string(),
                    ));
                }
                let clients = nodes.iter().map(|n| open(n)).collect::<Result<_, _>>()?;
                (Redis::lazy_cluster(nodes, timeout)?, clients)
            }
        };
        Ok(Redis {
            conn,
            target: target.clone(),
            clients: Arc::new(clients),
            prefix: prefix.to_string(),
            timeout,
            dedup_bytes: crate::store::dedup::DEFAULT_MAX_BYTES,
            replication: None,
        })
    }

    fn managed(client: &redis::Client, timeout: Duration) -> Result<Conn, StoreError> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        // Lazy: a gateway may start while Redis is down and serve 503s until it is back.
        ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map(|c| Conn(Link::Managed(c)))
            .map_err(|e| redis_error("connect", &e))
    }

    fn lazy_cluster(nodes: &[String], timeout: Duration) -> Result<Conn, StoreError> {
        let client = cluster_builder(nodes, timeout)
            .build()
            .map_err(|e| redis_error("cluster nodes", &e))?;
        Ok(Conn(Link::Cluster(Arc::new(LazyCluster {
            client,
            conn: tokio::sync::OnceCell::new(),
        }))))
    }

    /// Appends are acknowledged only once `replication.min_replicas` replicas hold them.
    pub fn with_replication(mut self, replication: Replication) -> Result<Redis, StoreError> {
        let timeout = self.timeout + replication.timeout;
        let conn = match &self.target {
            Target::Single(_) => Redis::managed(&self.clients[0], timeout)?,
            Target::Cluster(nodes) => Redis::lazy_cluster(nodes, timeout)?,
        };
        self.replication = Some((replication, conn));
        Ok(self)
    }

    /// The replication appends wait for, and the connection they are sent on.
    pub(super) fn replication(&self) -> Option<(Replication, Conn)> {
        self.replication.clone()
    }

    /// Bounds the dedup records this handle's logs and dedup store keep in Redis
    /// (`limits.max_dedup_bytes`; the default is [`crate::store::dedup::DEFAULT_MAX_BYTES`]).
    /// Carried by the handle because every bus log is opened from it.
    #[must_use]
    pub fn with_dedup_bytes(mut self, bytes: usize) -> Redis {
        self.dedup_bytes = bytes;
        self
    }

    pub fn dedup_bytes(&self) -> usize {
        self.dedup_bytes
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.target, Target::Cluster(_))
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// A connection of its own for blocking reads (`XREAD BLOCK`), which would hold up
    /// every other call on the shared multiplexed connection. On a cluster it is a cluster
    /// connection of its own: the read goes to whichever node holds the stream's slot,
    /// and follows it when the slot moves.
    pub(super) async fn blocking_connection(&self, block: Duration) -> Result<Conn, StoreError> {
        let timeout = block + self.timeout;
        match &self.target {
            Target::Single(_) => {
                let config = redis::AsyncConnectionConfig::new()
                    .set_response_timeout(Some(timeout))
                    .set_connection_timeout(Some(self.timeout));
                self.clients[0]
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
                    .map(|c| Conn(Link::Plain(c)))
                    .map_err(|e| redis_error("connect", &e))
            }
            Target::Cluster(nodes) => Redis::lazy_cluster(nodes, timeout),
        }
    }

    /// An untagged key, `{prefix}:{part}:…`: a key no script shares with another.
    pub fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    /// A key in the hash slot of `tag`, `{prefix}:{{tag}}:{part}:…`: every key one script
    /// touches has the same tag, so on a cluster they live on one node.
    pub fn tagged(&self, tag: &str, parts: &[&str]) -> String {
        let mut key = format!("{}:{{{tag}}}", self.prefix);
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    /// A key of a bus shard: its stream (`log`), counter (`next`), positions (`pos`),
    /// dedup index and records, all under the shard's tag ([`shard_tag`]), which the
    /// shard task's lease and epoch share (see [`Redis::task_key`]), so a commit is fenced
    /// in one step.
    pub fn shard_key(&self, bus: &str, shard: u32, parts: &[&str]) -> String {
        self.tagged(&shard_tag(bus, shard), parts)
    }

    /// A key of a task (`lease`, `epoch`): a bus shard's task (`bus/{bus}#{shard}`) takes
    /// the shard's tag; a source's tasks share their source's tag with its positions
    /// ([`Redis::source_key`]).
    pub fn task_key(&self, task: &str, kind: &str) -> String {
        if let Some((bus, shard)) = task
            .strip_prefix("bus/")
            .and_then(|t| t.rsplit_once('#'))
            .and_then(|(bus, shard)| Some((bus, shard.parse::<u32>().ok()?)))
        {
            return self.shard_key(bus, shard, &[kind]);
        }
        match task.rsplit_once('#') {
            Some((source, index)) => self.tagged(source, &[kind, index]),
            None => self.tagged(task, &[kind]),
        }
    }

    /// The positions hash of a source connector's subscription (`source/{name}@{broker}`):
    /// in the tag of the source (`source/{name}`), with its tasks' leases.
    pub fn source_key(&self, subscription: &str) -> String {
        match subscription.split_once('@') {
            Some((source, broker)) => self.tagged(source, &["pos", broker]),
            None => self.tagged(subscription, &["pos"]),
        }
    }

    /// The shared multiplexed connection (one server), or the cluster connection.
    pub fn connection(&self) -> Conn {
        self.conn.clone()
    }

    pub(super) fn conn(&self) -> Conn {
        self.conn.clone()
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        redis::cmd("PING")
            .query_async::<Value>(&mut self.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("ping", &e))
    }

    /// A client for a pub/sub connection: the `attempt`th address, round robin, so a
    /// subscriber whose node went away tries the next one.
    pub(super) fn client(&self, attempt: usize) -> &redis::Client {
        &self.clients[attempt % self.clients.len()]
    }
}

/// Slots a tag may land from its aim ([`shard_tag`]).
const TAG_SPREAD: u16 = 32;

/// `0.618… × 16384`: consecutive shards aim this far apart on the slot ring, so any number
/// of them spreads evenly (the golden-ratio sequence), whatever the cluster's slot ranges.
const GOLDEN_STEP: u32 = 10_126;

/// The hash tag of a bus shard, `bus/{bus}#{shard}.{k}`. Tags that differ in one digit
/// would fall on correlated slots (CRC16 is linear): 12 shards of one bus put 8 on one of
/// three primaries. So each shard aims at a slot (the bus's own offset plus `shard` golden
/// steps) and takes the first `k` whose tag falls within [`TAG_SPREAD`] of it: a bus's
/// shards spread evenly over the slot ring, and so over the primaries. Part of the stored
/// layout: every version computes the same tags. About 250 CRCs the first time, then cached.
pub fn shard_tag(bus: &str, shard: u32) -> String {
    use std::collections::HashMap;
    use std::sync::{Mutex, OnceLock};
    static TAGS: OnceLock<Mutex<HashMap<(String, u32), String>>> = OnceLock::new();
    let tags = TAGS.get_or_init(|| Mutex::new(HashMap::new()));
    let key = (bus.to_string(), shard);
    if let Some(tag) = tags.lock().unwrap_or_else(|p| p.into_inner()).get(&key) {
        return tag.clone();
    }
    let offset = (crate::values::stable_hash(bus.as_bytes()) % 16384) as u32;
    let aim = ((offset + shard.wrapping_mul(GOLDEN_STEP) % 16384) % 16384) as u16;
    let tag = (0u32..)
        .map(|k| format!("bus/{bus}#{shard}.{k}"))
        .find(|tag| {
            let slot = crc16(tag.as_bytes()) % 16384;
            let distance = slot.abs_diff(aim).min(16384 - slot.abs_diff(aim));
            distance <= TAG_SPREAD
        })
        .unwrap_or_else(|| format!("bus/{bus}#{shard}"));
    tags.lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key, tag.clone());
    tag
}

fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for byte in bytes {
        crc ^= u16::from(*byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash tag (the part between
/// the first `{` and the next `}`, when not empty) or of the whole key, modulo 16384.
pub fn slot_of(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let hashed = match bytes.iter().position(|b| *b == b'{') {
        Some(open) => match bytes[open + 1..].iter().position(|b| *b == b'}') {
            Some(len) if len > 0 => &bytes[open + 1..open + 1 + len],
            _ => bytes,
        },
        None => bytes,
    };
    crc16(hashed) % 16384
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The examples of the Redis Cluster specification.
    #[test]
    fn slots_follow_the_cluster_spec() {
        // CRC16 (XMODEM) of "123456789" is 0x31C3.
        assert_eq!(slot_of("123456789"), 0x31C3);
        assert_eq!(
            slot_of("{user1000}.following"),
            slot_of("{user1000}.followers")
        );
        assert_eq!(slot_of("foo{}{bar}"), slot_of("foo{}{bar}"));
        assert_ne!(slot_of("foo{}{bar}"), slot_of("bar"));
        assert_eq!(slot_of("foo{{bar}}zap"), slot_of("{bar"));
        assert_eq!(slot_of("foo{bar}{zap}"), slot_of("bar"));
    }

    /// Every key a script touches shares its tag: a shard's log, positions, dedup keys and
    /// its task's lease; a source's positions and its tasks' leases.
    #[tokio::test]
    async fn keys_of_one_step_share_a_slot() {
        let redis = Redis::connect("redis://127.0.0.1:1/", "sluice", Duration::from_secs(1))
            .await
            .unwrap();
        let shard = crate::store::cluster::task_id("bus/orders", 3);
        let slot = slot_of(&redis.task_key(&shard, "lease"));
        let log = redis.shard_key("orders", 3, &["log"]);
        assert!(
            log.starts_with("sluice:{bus/orders#3.") && log.ends_with("}:log"),
            "{log}"
        );
        for key in [
            redis.shard_key("orders", 3, &["log"]),
            redis.shard_key("orders", 3, &["next"]),
            redis.shard_key("orders", 3, &["pos"]),
            redis.shard_key("orders", 3, &["dedup", "00ff"]),
            redis.task_key(&shard, "epoch"),
        ] {
            assert_eq!(slot_of(&key), slot, "{key}");
        }
        assert_ne!(slot_of(&redis.shard_key("orders", 4, &["log"])), slot);
        let source = redis.source_key("source/mq-in@broker-a");
        assert_eq!(source, "sluice:{source/mq-in}:pos:broker-a");
        for task in ["source/mq-in#0", "source/mq-in#7"] {
            assert_eq!(slot_of(&redis.task_key(task, "lease")), slot_of(&source));
        }
    }

    /// A bus's shards spread evenly over three primaries holding equal slot ranges, for
    /// every shard count: at most one apart, where one-digit tags put 8 of 12 on one.
    #[test]
    fn shards_spread_evenly_over_the_slot_ring() {
        let ranges = [(0u16, 5460u16), (5461, 10922), (10923, 16383)];
        for bus in ["default", "orders", "a-much-longer-bus-name.v2"] {
            for shards in [3u32, 4, 6, 12, 16, 64] {
                let mut per_node = [0u32; 3];
                for shard in 0..shards {
                    let slot = slot_of(&format!("{{{}}}", shard_tag(bus, shard)));
                    let node = ranges
                        .iter()
                        .position(|(a, b)| (*a..=*b).contains(&slot))
                        .unwrap();
                    per_node[node] += 1;
                }
                let (lo, hi) = (
                    per_node.iter().min().unwrap(),
                    per_node.iter().max().unwrap(),
                );
                assert!(hi - lo <= 2, "{bus} over {shards}: {per_node:?}");
            }
        }
        // Stable: part of the stored layout.
        assert_eq!(shard_tag("default", 0), shard_tag("default", 0));
    }
}
