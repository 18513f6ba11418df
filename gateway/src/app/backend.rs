//! Standalone or distributed, decided once: `Backend::open` makes every store the gateway
//! runs on (cluster membership, positions, catalog, bus logs, rate-limit buckets, dedup
//! records, replay statuses, what admission asks), embedded in the data directory or in
//! the cluster's Redis, and hands them on as trait objects. Above this file only
//! `membership` tells whether other replicas exist (replays they ran can be taken over).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::admission::Inventory;
use crate::catalog::{Catalog, FileCatalog, RedisCatalog};
use crate::config::RedisDurability;
use crate::config::{Channels, Config, Mode};
use crate::ingress::ratelimit::{Limiter, LocalLimiter, RedisLimiter};
use crate::replay::{LocalReplays, RedisReplays, ReplayStore};
use crate::store::cluster::{Cluster, LocalCluster};
use crate::store::dedup::Dedup;
use crate::store::embedded::MemoryDedup;
use crate::store::embedded::{DataDir, EmbeddedLog, LogOptions};
use crate::store::redis::RedisDedup;
use crate::store::redis::{ClusterOptions, Redis, RedisCluster, RedisLog, RedisPositions};
use crate::store::redis::{Layout, Replication, Target};
use crate::store::{BusLog, PositionStore, StoreError};

use super::StartError;

/// The stores of one gateway process.
pub(super) struct Backend {
    pub(super) cluster: Arc<dyn Cluster>,
    pub(super) positions: Arc<dyn PositionStore>,
    pub(super) catalog: Catalog,
    pub(super) logs: Arc<dyn BusLogs>,
    pub(super) limiter: Arc<dyn Limiter>,
    pub(super) dedup: Arc<dyn Dedup>,
    pub(super) replays: Arc<dyn ReplayStore>,
    /// Where admission finds the logs a bus left behind.
    pub(super) inventory: Inventory,
    /// Distributed: this replica's membership of the cluster, left at shutdown.
    pub(super) membership: Option<Arc<RedisCluster>>,
}

impl Backend {
    pub(super) async fn open(
        config: &Config,
        data: DataDir,
        id: &str,
    ) -> Result<Backend, StartError> {
        match config.mode {
            Mode::Standalone => Ok(Backend {
                cluster: Arc::new(LocalCluster::new(id)),
                positions: Arc::new(data.open_positions()?),
                catalog: Catalog::new(Arc::new(FileCatalog::new(data.path()))),
                limiter: Arc::new(LocalLimiter::default()),
                dedup: standalone_dedup(data.path(), config.limits.max_dedup_bytes)?,
                replays: Arc::new(LocalReplays::default()),
                inventory: Inventory::Embedded(data.path().to_path_buf()),
                membership: None,
                logs: Arc::new(EmbeddedLogs {
                    data,
                    options: LogOptions {
                        durability: config.durability,
                        segment_bytes: config.store.segment_bytes,
                        cache_bytes: config.store.cache_bytes,
                    },
                    open: Mutex::new(HashMap::new()),
                }),
            }),
            Mode::Distributed => {
                let target = match (&config.redis_url, &config.redis_cluster_nodes) {
                    (_, Some(nodes)) => Target::Cluster(nodes.clone()),
                    (Some(url), None) => Target::Single(url.clone()),
                    (None, None) => {
                        return Err(StartError::Config(
                            "distributed mode needs redis_url or redis_cluster_nodes".to_string(),
                        ))
                    }
                };
                let mut redis =
                    Redis::open(&target, &config.redis_prefix, config.cluster.redis_timeout)?
                        .with_dedup_bytes(config.limits.max_dedup_bytes);
                if config.cluster.redis_durability == RedisDurability::Replicated {
                    redis = redis.with_replication(Replication {
                        min_replicas: config.cluster.min_replicas,
                        timeout: config.cluster.replication_timeout,
                    })?;
                }
                prepare_layout(&redis, config.cluster.member_ttl).await?;
                let membership = RedisCluster::join(
                    redis.clone(),
                    id,
                    ClusterOptions {
                        heartbeat: config.cluster.heartbeat_interval,
                        member_ttl: config.cluster.member_ttl,
                        lease_ttl: config.cluster.lease_ttl,
                    },
                );
                Ok(Backend {
                    cluster: membership.clone(),
                    positions: Arc::new(RedisPositions::new(redis.clone(), id)),
                    catalog: Catalog::new(Arc::new(RedisCatalog::new(membership.clone()))),
                    limiter: Arc::new(RedisLimiter::new(redis.clone())),
                    dedup: Arc::new(RedisDedup::new(redis.clone())),
                    replays: Arc::new(RedisReplays::new(redis.clone())),
                    inventory: Inventory::Redis(Box::new(redis.clone())),
                    membership: Some(membership),
                    logs: Arc::new(RedisLogs {
                        redis,
                        recorded: Mutex::new(HashMap::new()),
                    }),
                })
            }
        }
    }
}

/// Standalone dedup records (webhooks and buses), kept in the data directory across
/// restarts, in at most `max_bytes` of memory.
fn standalone_dedup(
    data_dir: &std::path::Path,
    max_bytes: usize,
) -> Result<Arc<dyn Dedup>, StoreError> {
    MemoryDedup::persistent(&data_dir.join("webhook-dedup.jsonl"), max_bytes)
        .map(|d| Arc::new(d) as Arc<dyn Dedup>)
        .map_err(|e| StoreError::io("cannot open webhook-dedup.jsonl", &e))
}

/// The logs of a catalog version's buses, and the buses whose log does not open here.
pub(super) struct OpenedLogs {
    pub(super) logs: HashMap<String, Arc<dyn BusLog>>,
    pub(super) failed: HashMap<String, String>,
}

/// Where bus logs come from.
#[async_trait]
pub(super) trait BusLogs: Send + Sync {
    /// The log of every bus of `channels`. A log that does not open (its shard count is
    /// not the one its data was placed by, the disk fails) fails that bus alone.
    async fn open(&self, channels: &Channels) -> OpenedLogs {
        let mut opened = OpenedLogs {
            logs: HashMap::new(),
            failed: HashMap::new(),
        };
        for bus in &channels.buses {
            let name = bus.name.get_ref();
            match self.open_one(name, bus.shards).await {
                Ok(log) => {
                    opened.logs.insert(name.clone(), log);
                }
                Err(why) => {
                    opened.failed.insert(name.clone(), why);
                }
            }
        }
        opened
    }

    /// The log of one bus of `shards` shards, or why it does not open.
    async fn open_one(&self, name: &str, shards: u32) -> Result<Arc<dyn BusLog>, String>;

    /// Flushes and closes what is open (at shutdown).
    async fn close(&self) {}
}

/// Standalone: logs in the data directory, kept open until shutdown.
struct EmbeddedLogs {
    data: DataDir,
    options: LogOptions,
    open: Mutex<HashMap<String, Arc<EmbeddedLog>>>,
}

#[async_trait]
impl BusLogs for EmbeddedLogs {
    async fn open_one(&self, name: &str, shards: u32) -> Result<Arc<dyn BusLog>, String> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        match open.get(name) {
            Some(log) if log.shards() == shards => Ok(log.clone()),
            _ => match self.data.open_bus(name, shards, &self.options) {
                Ok(log) => {
                    let log = Arc::new(log);
                    open.insert(name.to_string(), log.clone());
                    Ok(log)
                }
                Err(e) => Err(e.to_string()),
            },
        }
    }

    async fn close(&self) {
        let logs: Vec<_> = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        for log in logs {
            log.close().await;
        }
    }
}

/// Distributed: streams in the cluster's Redis.
struct RedisLogs {
    redis: Redis,
    /// The shard count recorded in Redis for each bus this process has run.
    recorded: Mutex<HashMap<String, u32>>,
}

#[async_trait]
impl BusLogs for RedisLogs {
    async fn open_one(&self, name: &str, shards: u32) -> Result<Arc<dyn BusLog>, String> {
        let known = self
            .recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .copied();
        let recorded = match known {
            Some(recorded) => Some(recorded),
            // Not recorded while Redis is away: the next version records it.
            None => RedisLog::record_shards(&self.redis, name, shards)
                .await
                .inspect(|recorded| {
                    self.recorded
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(name.to_string(), *recorded);
                })
                .ok(),
        };
        match recorded {
            Some(stored) if stored != shards => Err(format!(
                "bus `{name}` was first run with {stored} shards and the catalog now says {shards}; \
                 its events are placed by the first count"
            )),
            _ => Ok(Arc::new(RedisLog::new(self.redis.clone(), name, shards))),
        }
    }
}

/// Puts the store on the current key layout before this process uses it (see
/// `store::redis::layout`). Waits while Redis cannot be reached, saying so; refuses to start
/// while workers of an older version run against the store.
async fn prepare_layout(redis: &Redis, member_ttl: std::time::Duration) -> Result<(), StartError> {
    let mut wait = std::time::Duration::from_millis(200);
    loop {
        match crate::store::redis::prepare_layout(redis, member_ttl).await {
            Ok(Layout::Current) => return Ok(()),
            Ok(Layout::Migrated(0)) => {
                tracing::debug!(target = %redis.target().describe(), "a new store: marked as on the hash-tagged key layout");
                return Ok(());
            }
            Ok(Layout::Migrated(keys)) => {
                tracing::info!(keys, target = %redis.target().describe(), "moved the store to the hash-tagged key layout");
                return Ok(());
            }
            Ok(Layout::OlderWorkersRunning(workers)) => {
                return Err(StartError::Config(format!(
                    "the Redis store (prefix `{}`) is on the key layout of an older Sluice and {workers} worker(s) of it are still running; stop them before starting this version, which moves the keys once on start (nothing is lost: see docs/scaling.md, \"Upgrading a running deployment\")",
                    redis.prefix()
                )))
            }
            Err(e) => {
                tracing::warn!(error = %e, target = %redis.target().describe(), "waiting for Redis to check the key layout");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(std::time::Duration::from_secs(5));
            }
        }
    }
}
