//! The cluster service in Redis: membership (`{p}:members`, heartbeats), leases with
//! fencing epochs (`{p}:{task}:lease`, `{p}:{task}:epoch`: see `Redis::task_key`), control (`{p}:paused`,
//! `{p}:restarts`), statuses (`{p}:status`) and notices (`{p}:notices`, pub/sub).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::StreamExt as _;
use redis::{AsyncCommands as _, Script};
use tokio::sync::watch;

use crate::store::cluster::{Cluster, Control, Lease, Status};
use crate::store::redis::client::{redis_error, Redis};
use crate::store::StoreError;

const HEARTBEAT: &str = include_str!("lua/heartbeat.lua");

const MEMBERS: &str = include_str!("lua/members.lua");

const ACQUIRE: &str = include_str!("lua/acquire.lua");

const RENEW: &str = include_str!("lua/renew.lua");

/// Renews many leases at once. ARGV: the TTL, then one lease value per key.
const RENEW_ALL: &str = include_str!("lua/renew_all.lua");

const RELEASE: &str = include_str!("lua/release_lease.lua");

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub heartbeat: Duration,
    /// A worker that has not heartbeated for this long is gone.
    pub member_ttl: Duration,
    pub lease_ttl: Duration,
}

pub struct RedisCluster {
    redis: Redis,
    id: String,
    options: ClusterOptions,
    notices: watch::Sender<u64>,
    healthy: Arc<AtomicBool>,
    scripts: Scripts,
    stop: watch::Sender<bool>,
}

struct Scripts {
    heartbeat: Script,
    members: Script,
    acquire: Script,
    renew: Script,
    renew_all: Script,
    release: Script,
}

impl RedisCluster {
    /// Joins the cluster: starts heartbeating and listening for notices.
    pub fn join(redis: Redis, id: &str, options: ClusterOptions) -> Arc<RedisCluster> {
        let cluster = Arc::new(RedisCluster {
            redis,
            id: id.to_string(),
            options,
            notices: watch::Sender::new(0),
            healthy: Arc::new(AtomicBool::new(false)),
            scripts: Scripts {
                heartbeat: Script::new(HEARTBEAT),
                members: Script::new(MEMBERS),
                acquire: Script::new(ACQUIRE),
                renew: Script::new(RENEW),
                renew_all: Script::new(RENEW_ALL),
                release: Script::new(RELEASE),
            },
            stop: watch::Sender::new(false),
        });
        tokio::spawn(heartbeat_loop(cluster.clone()));
        tokio::spawn(notice_loop(cluster.clone()));
        cluster
    }

    /// The handle the cluster runs on (the catalog's calls share it).
    pub(super) fn redis(&self) -> &Redis {
        &self.redis
    }

    /// `{p}:notices`: the pub/sub channel every change is announced on.
    pub(super) fn channel(&self) -> String {
        self.redis.key(&["notices"])
    }

    fn notify_local(&self) {
        self.notices.send_modify(|n| *n += 1);
    }

    async fn publish(&self, message: &str) -> Result<(), StoreError> {
        self.redis
            .conn()
            .publish::<_, _, i64>(self.channel(), message)
            .await
            .map(|_| ())
            .map_err(|e| redis_error("publish", &e))
    }

    fn lease_value(&self, lease: &Lease) -> String {
        format!("{}|{}", self.id, lease.epoch)
    }
}

async fn heartbeat_loop(cluster: Arc<RedisCluster>) {
    let mut stop = cluster.stop.subscribe();
    let mut tick = tokio::time::interval(cluster.options.heartbeat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut known: Vec<String> = Vec::new();
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let result = cluster
            .scripts
            .heartbeat
            .key(cluster.redis.key(&["members"]))
            .arg(&cluster.id)
            .arg(cluster.options.member_ttl.as_millis() as u64)
            .arg(cluster.channel())
            .invoke_async::<Vec<String>>(&mut cluster.redis.conn())
            .await;
        match result {
            Ok(mut members) => {
                if !cluster.healthy.swap(true, Ordering::Relaxed) {
                    tracing::info!(worker = %cluster.id, "connected to the cluster");
                    cluster.notify_local();
                }
                members.sort();
                // Members that stop heartbeating leave no notice: notice it here.
                if members != known {
                    known = members;
                    cluster.notify_local();
                }
            }
            Err(e) => {
                if cluster.healthy.swap(false, Ordering::Relaxed) {
                    tracing::warn!(worker = %cluster.id, error = %e, "lost the cluster store");
                }
            }
        }
    }
}

async fn notice_loop(cluster: Arc<RedisCluster>) {
    let mut stop = cluster.stop.subscribe();
    let mut backoff = Duration::from_millis(100);
    // Which address to subscribe at: the next one after a failure (on a cluster, a
    // notice published at any node reaches every node's subscribers).
    let mut attempt = 0usize;
    loop {
        let client = cluster.redis.client(attempt);
        attempt += 1;
        let subscribed = async {
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(cluster.channel()).await?;
            Ok::<_, redis::RedisError>(pubsub)
        };
        match subscribed.await {
            Ok(pubsub) => {
                backoff = Duration::from_millis(100);
                // Notices may have been missed while not subscribed.
                cluster.notify_local();
                let mut messages = pubsub.into_on_message();
                loop {
                    tokio::select! {
                        message = messages.next() => match message {
                            Some(_) => cluster.notify_local(),
                            None => break,
                        },
                        _ = stop.changed() => return,
                    }
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot subscribe to notices"),
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff) => {}
            _ = stop.changed() => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

#[async_trait]
impl Cluster for RedisCluster {
    fn worker_id(&self) -> &str {
        &self.id
    }

    fn lease_ttl(&self) -> Duration {
        self.options.lease_ttl
    }

    fn notices(&self) -> watch::Receiver<u64> {
        self.notices.subscribe()
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    async fn members(&self) -> Result<Vec<String>, StoreError> {
        self.scripts
            .members
            .key(self.redis.key(&["members"]))
            .arg(self.options.member_ttl.as_millis() as u64)
            .invoke_async::<Vec<String>>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("members", &e))
    }

    async fn acquire(&self, task: &str) -> Result<Option<Lease>, StoreError> {
        let epoch = self
            .scripts
            .acquire
            .key(self.redis.task_key(task, "lease"))
            .key(self.redis.task_key(task, "epoch"))
            .arg(&self.id)
            .arg(self.options.lease_ttl.as_millis() as u64)
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("acquire lease", &e))?;
        Ok(u64::try_from(epoch).ok().map(|epoch| Lease {
            task: task.to_string(),
            epoch,
        }))
    }

    async fn renew(&self, lease: &Lease) -> Result<bool, StoreError> {
        self.scripts
            .renew
            .key(self.redis.task_key(&lease.task, "lease"))
            .arg(self.lease_value(lease))
            .arg(self.options.lease_ttl.as_millis() as u64)
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map(|r| r == 1)
            .map_err(|e| redis_error("renew lease", &e))
    }

    /// One script for all leases on one server; on a cluster one per hash slot, sent side
    /// by side (a script's keys must share a slot).
    async fn renew_all(&self, leases: &[Lease]) -> Result<Vec<bool>, StoreError> {
        if leases.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = leases
            .iter()
            .map(|l| self.redis.task_key(&l.task, "lease"))
            .collect();
        let mut groups: HashMap<u16, Vec<usize>> = HashMap::new();
        for (i, key) in keys.iter().enumerate() {
            let slot = if self.redis.is_cluster() {
                crate::store::redis::client::slot_of(key)
            } else {
                0
            };
            groups.entry(slot).or_default().push(i);
        }
        let calls = groups.into_values().map(|members| {
            let mut invocation = self.scripts.renew_all.prepare_invoke();
            invocation.arg(self.options.lease_ttl.as_millis() as u64);
            for &i in &members {
                invocation.key(&keys[i]).arg(self.lease_value(&leases[i]));
            }
            let mut conn = self.redis.conn();
            async move {
                let held: Vec<i64> = invocation
                    .invoke_async(&mut conn)
                    .await
                    .map_err(|e| redis_error("renew leases", &e))?;
                Ok::<_, StoreError>(members.into_iter().zip(held).collect::<Vec<_>>())
            }
        });
        let mut out = vec![false; leases.len()];
        for group in futures_util::future::join_all(calls).await {
            for (i, held) in group? {
                out[i] = held == 1;
            }
        }
        Ok(out)
    }

    async fn release(&self, lease: &Lease) -> Result<(), StoreError> {
        self.scripts
            .release
            .key(self.redis.task_key(&lease.task, "lease"))
            .arg(self.lease_value(lease))
            .invoke_async::<i64>(&mut self.redis.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("release lease", &e))
    }

    async fn control(&self) -> Result<Control, StoreError> {
        let mut conn = self.redis.conn();
        let paused: HashSet<String> = conn
            .smembers(self.redis.key(&["paused"]))
            .await
            .map_err(|e| redis_error("read paused", &e))?;
        let restarts: HashMap<String, u64> = conn
            .hgetall(self.redis.key(&["restarts"]))
            .await
            .map_err(|e| redis_error("read restarts", &e))?;
        Ok(Control { paused, restarts })
    }

    async fn set_paused(&self, id: &str, paused: bool) -> Result<(), StoreError> {
        let key = self.redis.key(&["paused"]);
        let mut conn = self.redis.conn();
        let result = if paused {
            conn.sadd::<_, _, i64>(key, id).await
        } else {
            conn.srem::<_, _, i64>(key, id).await
        };
        result.map_err(|e| redis_error("pause", &e))?;
        self.publish("control").await
    }

    async fn request_restart(&self, id: &str) -> Result<(), StoreError> {
        self.redis
            .conn()
            .hincr::<_, _, _, i64>(self.redis.key(&["restarts"]), id, 1)
            .await
            .map_err(|e| redis_error("restart", &e))?;
        self.publish("control").await
    }

    async fn set_status(&self, status: Status) -> Result<(), StoreError> {
        let json = serde_json::to_string(&status)
            .map_err(|e| StoreError::Unavailable(format!("encode status: {e}")))?;
        self.redis
            .conn()
            .hset::<_, _, _, i64>(self.redis.key(&["status"]), &status.id, json)
            .await
            .map(|_| ())
            .map_err(|e| redis_error("write status", &e))
    }

    async fn set_statuses(&self, statuses: Vec<Status>) -> Result<(), StoreError> {
        if statuses.is_empty() {
            return Ok(());
        }
        let mut fields = Vec::with_capacity(statuses.len());
        for status in &statuses {
            let json = serde_json::to_string(status)
                .map_err(|e| StoreError::Unavailable(format!("encode status: {e}")))?;
            fields.push((status.id.as_str(), json));
        }
        // Large sets (thousands of subscriptions) go in slices to keep each call short.
        for chunk in fields.chunks(1000) {
            self.redis
                .conn()
                .hset_multiple::<_, _, _, ()>(self.redis.key(&["status"]), chunk)
                .await
                .map_err(|e| redis_error("write status", &e))?;
        }
        Ok(())
    }

    async fn statuses(&self) -> Result<Vec<Status>, StoreError> {
        let map: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.redis.key(&["status"]))
            .await
            .map_err(|e| redis_error("read status", &e))?;
        let mut statuses: Vec<Status> = map
            .values()
            .filter_map(|json| serde_json::from_str(json).ok())
            .collect();
        statuses.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(statuses)
    }

    async fn heartbeats(&self) -> Result<Vec<(String, u64)>, StoreError> {
        const AGES: &str = include_str!("lua/heartbeat_ages.lua");
        let flat: Vec<String> = Script::new(AGES)
            .key(self.redis.key(&["members"]))
            .arg(self.options.member_ttl.as_millis() as u64)
            .invoke_async(&mut self.redis.conn())
            .await
            .map_err(|e| redis_error("read heartbeats", &e))?;
        Ok(flat
            .chunks(2)
            .filter_map(|pair| match pair {
                [id, age] => Some((id.clone(), age.parse().unwrap_or(0))),
                _ => None,
            })
            .collect())
    }

    /// Three calls per chunk, not one pipeline: the three keys have slots of their own on a
    /// cluster.
    async fn forget(&self, ids: &[String]) -> Result<(), StoreError> {
        let mut conn = self.redis.conn();
        for chunk in ids.chunks(1000) {
            conn.hdel::<_, _, i64>(self.redis.key(&["status"]), chunk)
                .await
                .map_err(|e| redis_error("forget statuses", &e))?;
            conn.srem::<_, _, i64>(self.redis.key(&["paused"]), chunk)
                .await
                .map_err(|e| redis_error("forget statuses", &e))?;
            conn.hdel::<_, _, i64>(self.redis.key(&["restarts"]), chunk)
                .await
                .map_err(|e| redis_error("forget statuses", &e))?;
        }
        Ok(())
    }

    async fn leave(&self) {
        let _ = self.stop.send(true);
        let removed = self
            .redis
            .conn()
            .zrem::<_, _, i64>(self.redis.key(&["members"]), &self.id)
            .await;
        if removed.is_ok() {
            let _ = self.publish(&format!("leave:{}", self.id)).await;
        }
    }
}
