//! Wires a configuration into a running gateway: stores, ingress, the worker, and the
//! shutdown order (stop accepting → finish requests → stop tasks → commit → flush → leave).

use std::collections::HashMap;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::{Channels, Config, Mode};
use crate::ingress::{self, IngressState};
use crate::rules::{compile_transform, Filter};
use crate::runtime::cluster::{Cluster, LocalCluster};
use crate::runtime::delivery::Delivery;
use crate::runtime::rebalance::stable_hash;
use crate::runtime::{BusPlan, Plan, RuleSubscriptions, Subscription, Worker, WorkerOptions};
use crate::sources::Source;
use crate::store::embedded::{DataDir, LogOptions};
use crate::store::redis::{ClusterOptions, Redis, RedisCluster, RedisLog, RedisPositions};
use crate::store::{BusLog, PositionStore, StoreError};
use crate::targets;
use crate::webhooks::dedup::{Dedup, MemoryDedup, RedisDedup};
use crate::webhooks::Webhooks;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("rule `{rule}`, target `{target}`: {message}")]
    Target {
        rule: String,
        target: String,
        message: String,
    },
    #[error("rule `{rule}`: {message}")]
    Pattern { rule: String, message: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cluster configuration: {0}")]
    Config(String),
}

/// Resolves when the listener should close: once shutdown starts, readiness fails at once,
/// and requests are still served for `delay` (load balancers stop sending meanwhile).
async fn drain(mut stop: watch::Receiver<bool>, state: Arc<IngressState>, delay: Duration) {
    let _ = stop.wait_for(|s| *s).await;
    state.start_draining();
    if !delay.is_zero() {
        tracing::info!(delay = ?delay, "draining: /readyz answers 503; still serving until the delay ends");
        tokio::time::sleep(delay).await;
    }
}

/// Runs the gateway until `shutdown` resolves, then shuts down in order.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let (stop_tx, stop) = watch::channel(false);
    let main = run_until(config, stop);
    tokio::pin!(main);
    tokio::select! {
        result = &mut main => return result,
        () = shutdown => {
            let _ = stop_tx.send(true);
        }
    }
    main.await
}

async fn run_until(config: Config, mut stop: watch::Receiver<bool>) -> Result<(), StartError> {
    let data = DataDir::open(&config.data_dir)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    match config.mode {
        Mode::Standalone => {
            let options = LogOptions {
                durability: config.durability,
                segment_bytes: config.store.segment_bytes,
                cache_bytes: config.store.cache_bytes,
            };
            let mut embedded = Vec::new();
            let mut logs: HashMap<String, Arc<dyn BusLog>> = HashMap::new();
            for bus in &config.buses {
                let log = Arc::new(data.open_bus(bus.name.get_ref(), bus.shards, &options)?);
                embedded.push(log.clone());
                logs.insert(bus.name.get_ref().clone(), log);
            }
            let positions: Arc<dyn PositionStore> = Arc::new(data.open_positions()?);
            let id = worker_id(&config, data.path())?;
            let cluster: Arc<dyn Cluster> = Arc::new(LocalCluster::new(&id));
            let plan = Arc::new(build_plan(&config, &config.channels(), 1, logs)?);
            let worker = Worker::start(
                cluster.clone(),
                positions.clone(),
                plan.clone(),
                worker_options(&config),
            );
            let state = Arc::new(IngressState::new(
                plan.logs.clone(),
                config.limits.clone(),
                cluster,
            ));
            state.set_connectors(plan.connectors());
            state.set_positions(positions.clone());
            tokio::spawn(crate::scaling::sample(state.clone(), stop.clone()));
            state.set_bus_dedup(plan.dedup.clone());
            state.set_bus_auth(plan.auth.clone());
            state.set_bus_rate_limits(plan.rate_limits.clone());
            state.set_schemas(
                crate::ingress::schema::load(&config.schemas, &config.base_dir)
                    .map_err(StartError::Config)?,
            );
            state.set_webhooks(
                Webhooks::build(&config.webhooks, standalone_dedup(data.path())?)
                    .map_err(StartError::Config)?,
            );
            announce(&config, &listener, data.path(), &id);
            let drain = drain(stop.clone(), state.clone(), config.limits.shutdown_delay);
            crate::server::serve(listener, ingress::router(state), &config.limits, drain).await;
            tracing::info!("ingress stopped; finishing deliveries");
            worker.shutdown().await;
            for log in &embedded {
                log.close().await;
            }
        }
        Mode::Distributed => {
            let url = config.redis_url.clone().ok_or_else(|| {
                StartError::Config("distributed mode needs redis_url".to_string())
            })?;
            let id = worker_id(&config, data.path())?;
            let redis =
                Redis::connect(&url, &config.redis_prefix, config.cluster.redis_timeout).await?;
            let cluster = RedisCluster::join(
                redis.clone(),
                &id,
                ClusterOptions {
                    heartbeat: config.cluster.heartbeat_interval,
                    member_ttl: config.cluster.member_ttl,
                    lease_ttl: config.cluster.lease_ttl,
                },
            );
            let positions: Arc<dyn PositionStore> =
                Arc::new(RedisPositions::new(redis.clone(), &id));
            // The configuration is shared: publish ours (a no-op when it is already there)
            // and run what the cluster holds. Wait for Redis if it is not up yet.
            let (version, plan) = loop {
                match sync_config(&config, &cluster, &redis, true).await {
                    Ok(Some(found)) => break found,
                    Ok(None) | Err(StartError::Store(_)) => {
                        tracing::warn!("waiting for the cluster store to hold the configuration");
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                            _ = stop.wait_for(|s| *s) => {
                                cluster.leave().await;
                                return Ok(());
                            }
                        }
                    }
                    Err(e) => {
                        cluster.leave().await;
                        return Err(e);
                    }
                }
            };
            let shared: Arc<dyn Cluster> = cluster.clone();
            let worker = Worker::start(
                shared.clone(),
                positions.clone(),
                plan.clone(),
                worker_options(&config),
            );
            let state = Arc::new(IngressState::new(
                plan.logs.clone(),
                config.limits.clone(),
                shared,
            ));
            state.set_connectors(plan.connectors());
            state.set_positions(positions.clone());
            tokio::spawn(crate::scaling::sample(state.clone(), stop.clone()));
            state.set_limiter(Arc::new(crate::ingress::ratelimit::RedisLimiter::new(
                redis.clone(),
            )));
            state.set_bus_dedup(plan.dedup.clone());
            state.set_bus_auth(plan.auth.clone());
            state.set_bus_rate_limits(plan.rate_limits.clone());
            state.set_schemas(
                crate::ingress::schema::load(&config.schemas, &config.base_dir)
                    .map_err(StartError::Config)?,
            );
            state.set_webhooks(
                Webhooks::build(&config.webhooks, Arc::new(RedisDedup::new(redis.clone())))
                    .map_err(StartError::Config)?,
            );
            tokio::spawn(follow_config(
                config.clone(),
                cluster.clone(),
                redis.clone(),
                version,
                state.clone(),
                worker.plan_sender(),
                stop.clone(),
            ));
            announce(&config, &listener, data.path(), &id);
            let drain = drain(stop.clone(), state.clone(), config.limits.shutdown_delay);
            crate::server::serve(listener, ingress::router(state), &config.limits, drain).await;
            tracing::info!("ingress stopped; finishing deliveries");
            worker.shutdown().await;
        }
    }
    tracing::info!("shutdown complete");
    Ok(())
}

/// Standalone webhook dedup records, kept in the data directory across restarts.
fn standalone_dedup(data_dir: &Path) -> Result<Arc<dyn Dedup>, StoreError> {
    MemoryDedup::persistent(&data_dir.join("webhook-dedup.jsonl"))
        .map(|d| Arc::new(d) as Arc<dyn Dedup>)
        .map_err(|e| StoreError::io("cannot open webhook-dedup.jsonl", &e))
}

fn announce(config: &Config, listener: &tokio::net::TcpListener, data_dir: &Path, id: &str) {
    tracing::info!(
        listen = %listener.local_addr().map_or(config.listen, |a| a),
        data_dir = %data_dir.display(),
        mode = ?config.mode,
        worker = id,
        durability = %config.durability,
        buses = config.buses.len(),
        rules = config.rules.len(),
        "sluice is ready"
    );
}

fn worker_options(config: &Config) -> WorkerOptions {
    WorkerOptions {
        delivery: config.delivery.clone(),
        strategy: config.cluster.strategy,
        tick: config.cluster.rebalance_interval,
        read_wait: config.cluster.poll_interval,
    }
}

/// The configured worker id, or the one kept in the data directory (made on first start).
fn worker_id(config: &Config, data_dir: &Path) -> Result<String, StoreError> {
    if let Some(id) = &config.worker_id {
        return Ok(id.clone());
    }
    let path = data_dir.join("worker-id");
    match std::fs::read_to_string(&path) {
        Ok(id) if !id.trim().is_empty() => return Ok(id.trim().to_string()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(StoreError::io("cannot read worker-id", &e)),
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| crate::config::check_name(h).is_ok())
        .unwrap_or_else(|| "worker".to_string());
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let id = format!("{host}-{:08x}", random as u32);
    std::fs::write(&path, &id).map_err(|e| StoreError::io("cannot write worker-id", &e))?;
    Ok(id)
}

/// Turns buses and rules into what the worker runs: per bus, its log, its subscriptions
/// and their compiled rule index.
fn build_plan(
    config: &Config,
    channels: &Channels,
    version: u64,
    logs: HashMap<String, Arc<dyn BusLog>>,
) -> Result<Plan, StartError> {
    let resources = targets::Resources {
        buses: logs.clone(),
    };
    let mut rules_by_bus: HashMap<&str, Vec<RuleSubscriptions>> = HashMap::new();
    for rule in &channels.rules {
        let rule_name = rule.name.get_ref();
        let filter = Filter::compile(
            rule.pattern.as_ref().map(|p| p.get_ref()),
            rule.filter.as_ref().map(|f| f.get_ref().as_str()),
        )
        .map_err(|message| StartError::Pattern {
            rule: rule_name.clone(),
            message,
        })?;
        let filter = Arc::new(filter);
        // What a subscription's definition is, to tell a changed one from an unchanged one.
        let condition = format!(
            "{:?}|{:?}",
            rule.pattern.as_ref().map(|p| p.get_ref()),
            rule.filter.as_ref().map(|f| f.get_ref())
        );
        let mut subscriptions = Vec::new();
        for target in &rule.targets {
            let target_name = target.name();
            let failed = |message: String| StartError::Target {
                rule: rule_name.clone(),
                target: target_name.to_string(),
                message,
            };
            let name = format!("{rule_name}/{target_name}");
            let id = format!("{}/{name}", rule.bus.get_ref());
            let built =
                targets::build(config, target, &resources).map_err(|e| failed(e.message))?;
            let delivery = Delivery::new(config, rule_name, &id, target, built.clone(), &resources)
                .map_err(|e| failed(e.message))?;
            let transform = target
                .transform()
                .map(compile_transform)
                .transpose()
                .map_err(failed)?;
            let spec = serde_json::to_string(target).map_err(|e| failed(e.to_string()))?;
            subscriptions.push(Arc::new(Subscription {
                id,
                name,
                bus: rule.bus.get_ref().clone(),
                filter: filter.clone(),
                transform,
                target: built,
                delivery: Arc::new(delivery),
                spec: stable_hash(format!("{condition}|{spec}").as_bytes()),
            }));
        }
        rules_by_bus
            .entry(rule.bus.get_ref().as_str())
            .or_default()
            .push(RuleSubscriptions {
                filter,
                subscriptions,
            });
    }
    let mut buses = std::collections::BTreeMap::new();
    for (name, log) in &logs {
        let rules = rules_by_bus.remove(name.as_str()).unwrap_or_default();
        buses.insert(
            name.clone(),
            Arc::new(BusPlan::new(name, log.clone(), rules)),
        );
    }
    let mut sources = Vec::new();
    for source in &channels.sources {
        // Checked with the configuration: the bus exists.
        if let Some(log) = logs.get(source.bus()) {
            sources.push(Arc::new(Source::new(source.clone(), log.clone())));
        }
    }
    let dedup = channels
        .buses
        .iter()
        .filter_map(|b| {
            b.dedup_window
                .filter(|w| !w.is_zero())
                .map(|w| (b.name.get_ref().clone(), w))
        })
        .collect();
    let mut auth = HashMap::new();
    for bus in &channels.buses {
        if let Some(config) = &bus.auth {
            let keys = config
                .resolve()
                .map_err(|m| StartError::Config(format!("bus `{}`: {m}", bus.name.get_ref())))?;
            auth.insert(bus.name.get_ref().clone(), Arc::new(keys));
        }
    }
    let rate_limits = channels
        .buses
        .iter()
        .filter_map(|b| b.rate_limit.map(|l| (b.name.get_ref().clone(), l)))
        .collect();
    Ok(Plan {
        version,
        buses,
        sources,
        logs,
        dedup,
        auth,
        rate_limits,
    })
}

/// Reads the cluster's configuration (after publishing ours when `publish`) and builds its
/// plan. `Ok(None)` when there is none stored yet.
async fn sync_config(
    config: &Config,
    cluster: &RedisCluster,
    redis: &Redis,
    publish: bool,
) -> Result<Option<(u64, Arc<Plan>)>, StartError> {
    if publish {
        let ours = config.channels();
        if let Some((_, stored)) = cluster.load_config().await? {
            let stored = Channels::from_toml(&stored).map_err(StartError::Config)?;
            for bus in &ours.buses {
                if let Some(old) = stored
                    .buses
                    .iter()
                    .find(|b| b.name.get_ref() == bus.name.get_ref())
                {
                    if old.shards != bus.shards {
                        return Err(StartError::Config(format!(
                            "bus `{}` has {} shards in the cluster and {} in this configuration; \
                             changing the shard count of a bus is not supported",
                            bus.name.get_ref(),
                            old.shards,
                            bus.shards
                        )));
                    }
                }
            }
        }
        let text = ours.to_toml().map_err(StartError::Config)?;
        let version = cluster.apply_config(&text).await?;
        tracing::info!(version, "configuration published to the cluster");
    }
    let Some((version, text)) = cluster.load_config().await? else {
        return Ok(None);
    };
    let channels = Channels::from_toml(&text).map_err(StartError::Config)?;
    let mut logs: HashMap<String, Arc<dyn BusLog>> = HashMap::new();
    for bus in &channels.buses {
        logs.insert(
            bus.name.get_ref().clone(),
            Arc::new(RedisLog::new(redis.clone(), bus.name.get_ref(), bus.shards)),
        );
    }
    let plan = build_plan(config, &channels, version, logs)?;
    Ok(Some((version, Arc::new(plan))))
}

/// Full resync whenever the cluster's configuration version moves past ours (on every
/// notice and on the rebalance tick, since notices can be lost).
#[allow(clippy::too_many_arguments)]
async fn follow_config(
    config: Config,
    cluster: Arc<RedisCluster>,
    redis: Redis,
    mut version: u64,
    ingress: Arc<IngressState>,
    plans: Arc<watch::Sender<Arc<Plan>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut notices = cluster.notices();
    let mut tick = tokio::time::interval(config.cluster.rebalance_interval);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = notices.changed() => {}
            _ = stop.changed() => return,
        }
        let current = match cluster.config_version().await {
            Ok(v) => v,
            Err(_) => continue,
        };
        if current <= version {
            continue;
        }
        match sync_config(&config, &cluster, &redis, false).await {
            Ok(Some((v, plan))) => {
                tracing::info!(from = version, to = v, "configuration changed; resynced");
                version = v;
                ingress.set_buses(plan.logs.clone());
                ingress.set_connectors(plan.connectors());
                ingress.set_bus_dedup(plan.dedup.clone());
                ingress.set_bus_auth(plan.auth.clone());
                ingress.set_bus_rate_limits(plan.rate_limits.clone());
                plans.send_replace(plan);
            }
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "cannot apply the cluster's new configuration"),
        }
    }
}
