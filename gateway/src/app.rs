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

use crate::catalog::{Catalog, ChangeError, FileCatalog, RedisCatalog, Snapshot};
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

/// Where bus logs come from: opened in the data directory (standalone, kept open until
/// shutdown) or streams in the cluster's Redis.
enum Logs {
    Embedded {
        data: DataDir,
        options: LogOptions,
        open: std::sync::Mutex<HashMap<String, Arc<crate::store::embedded::EmbeddedLog>>>,
    },
    Redis(Redis),
}

impl Logs {
    /// The log of every bus of `channels`.
    fn for_channels(
        &self,
        channels: &Channels,
    ) -> Result<HashMap<String, Arc<dyn BusLog>>, StartError> {
        let mut logs: HashMap<String, Arc<dyn BusLog>> = HashMap::new();
        for bus in &channels.buses {
            let name = bus.name.get_ref();
            let log: Arc<dyn BusLog> = match self {
                Logs::Embedded {
                    data,
                    options,
                    open,
                } => {
                    let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
                    match open.get(name) {
                        Some(log) if log.shards() == bus.shards => log.clone(),
                        _ => {
                            let log = Arc::new(data.open_bus(name, bus.shards, options)?);
                            open.insert(name.clone(), log.clone());
                            log
                        }
                    }
                }
                Logs::Redis(redis) => Arc::new(RedisLog::new(redis.clone(), name, bus.shards)),
            };
            logs.insert(name.clone(), log);
        }
        Ok(logs)
    }

    async fn close(&self) {
        if let Logs::Embedded { open, .. } = self {
            let logs: Vec<_> = open
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
}

async fn run_until(mut config: Config, mut stop: watch::Receiver<bool>) -> Result<(), StartError> {
    let data = DataDir::open(&config.data_dir)?;
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    let admin_listener = match config.admin.listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Listen { addr, source })?,
        ),
        None => None,
    };
    let id = worker_id(&config, data.path())?;
    let data_path = data.path().to_path_buf();
    let (cluster, positions, catalog, logs, limiter, dedup, redis_cluster) = match config.mode {
        Mode::Standalone => {
            let positions: Arc<dyn PositionStore> = Arc::new(data.open_positions()?);
            let cluster: Arc<dyn Cluster> = Arc::new(LocalCluster::new(&id));
            let catalog = Catalog::new(Arc::new(FileCatalog::new(data.path())));
            let dedup = standalone_dedup(data.path())?;
            let logs = Logs::Embedded {
                data,
                options: LogOptions {
                    durability: config.durability,
                    segment_bytes: config.store.segment_bytes,
                    cache_bytes: config.store.cache_bytes,
                },
                open: std::sync::Mutex::new(HashMap::new()),
            };
            let limiter: Arc<dyn crate::ingress::ratelimit::Limiter> =
                Arc::new(crate::ingress::ratelimit::LocalLimiter::default());
            (cluster, positions, catalog, logs, limiter, dedup, None)
        }
        Mode::Distributed => {
            let url = config.redis_url.clone().ok_or_else(|| {
                StartError::Config("distributed mode needs redis_url".to_string())
            })?;
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
            let catalog = Catalog::new(Arc::new(RedisCatalog::new(cluster.clone())));
            let limiter: Arc<dyn crate::ingress::ratelimit::Limiter> =
                Arc::new(crate::ingress::ratelimit::RedisLimiter::new(redis.clone()));
            let dedup: Arc<dyn Dedup> = Arc::new(RedisDedup::new(redis.clone()));
            let shared: Arc<dyn Cluster> = cluster.clone();
            (
                shared,
                positions,
                catalog,
                Logs::Redis(redis),
                limiter,
                dedup,
                Some(cluster),
            )
        }
    };
    let leave = || async {
        if let Some(cluster) = &redis_cluster {
            cluster.leave().await;
        }
    };
    // The file's resources seed an empty catalog; a stored catalog is never replaced by
    // the file (that would roll back the admin API's changes). Wait for Redis if it is
    // not up yet.
    // Moved out of the configuration: from here on the catalog is what runs, and with
    // thousands of rules the file's copy would only take memory.
    let file = config.take_channels();
    let snapshot = loop {
        match seed(&catalog, &file).await {
            Ok(snapshot) => break snapshot,
            Err(StartError::Store(e)) => {
                tracing::warn!(error = %e, "waiting for the cluster store to hold the configuration");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.wait_for(|s| *s) => {
                        leave().await;
                        return Ok(());
                    }
                }
            }
            Err(e) => {
                leave().await;
                return Err(e);
            }
        }
    };
    drop(file);
    let plan = match logs
        .for_channels(&snapshot.channels)
        .and_then(|l| build_plan(&config, &snapshot.channels, snapshot.version, l))
    {
        Ok(plan) => Arc::new(plan),
        Err(e) => {
            leave().await;
            return Err(e);
        }
    };
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
    state.set_positions(positions.clone());
    state.set_limiter(limiter);
    state.set_plan(&plan);
    state.set_schemas(
        crate::ingress::schema::load(&config.schemas, &config.base_dir)
            .map_err(StartError::Config)?,
    );
    state.set_webhooks(
        Webhooks::build(&config.webhooks, &plan.webhooks, dedup).map_err(StartError::Config)?,
    );
    let admin = crate::api::AdminAuth::from_config(
        &config.admin,
        config.cluster.strategy.name(),
        config.delivery.batch_size,
    )
    .map_err(StartError::Config)?;
    state.set_admin(catalog.clone(), admin);
    if let Logs::Redis(redis) = &logs {
        *state.replays.write().unwrap_or_else(|p| p.into_inner()) =
            Arc::new(crate::replay::RedisReplays::new(redis.clone()));
        tokio::spawn(crate::replay::adopt_orphans(
            state.clone(),
            std::time::Duration::from_secs(2),
            stop.clone(),
        ));
    }
    tokio::spawn(crate::scaling::sample(state.clone(), stop.clone()));
    let logs = Arc::new(logs);
    tokio::spawn(follow_catalog(
        config.clone(),
        catalog,
        logs.clone(),
        snapshot.version,
        state.clone(),
        worker.plan_sender(),
        stop.clone(),
    ));
    announce(&config, &listener, &data_path, &id, &snapshot);
    // The plan holds what it needs of it.
    drop(snapshot);
    let drain = drain(stop.clone(), state.clone(), config.limits.shutdown_delay);
    match admin_listener {
        Some(admin_listener) => {
            tracing::info!(admin_listen = %admin_listener.local_addr().map_or_else(|_| "?".to_string(), |a| a.to_string()), "the admin API listens on its own address");
            let admin_drain = {
                let mut stop = stop.clone();
                async move {
                    let _ = stop.wait_for(|s| *s).await;
                }
            };
            tokio::join!(
                crate::server::serve(
                    listener,
                    ingress::router(state.clone(), false),
                    &config.limits,
                    drain
                ),
                crate::server::serve(
                    admin_listener,
                    crate::api::admin_router(state.clone()),
                    &config.limits,
                    admin_drain
                ),
            );
        }
        None => {
            crate::server::serve(
                listener,
                ingress::router(state, true),
                &config.limits,
                drain,
            )
            .await;
        }
    }
    tracing::info!("ingress stopped; finishing deliveries");
    worker.shutdown().await;
    logs.close().await;
    tracing::info!("shutdown complete");
    Ok(())
}

/// Seeds an empty catalog with the file's resources and returns the catalog to run.
async fn seed(catalog: &Catalog, file: &Channels) -> Result<Snapshot, StartError> {
    match catalog.seed(file).await {
        Ok((version, differs)) => {
            if differs {
                tracing::warn!(
                    version,
                    "the configuration file's buses, rules or sources differ from the catalog's; \
                     running the catalog (the admin API's changes are kept). \
                     To apply the file: sluice ctl apply -f FILE"
                );
            } else {
                tracing::info!(version, "catalog loaded");
            }
            Ok(catalog.snapshot().await?)
        }
        Err(ChangeError::Store(e)) => Err(StartError::Store(e)),
        Err(e) => Err(StartError::Config(format!(
            "the configuration's resources: {e}"
        ))),
    }
}

/// Standalone webhook dedup records, kept in the data directory across restarts.
fn standalone_dedup(data_dir: &Path) -> Result<Arc<dyn Dedup>, StoreError> {
    MemoryDedup::persistent(&data_dir.join("webhook-dedup.jsonl"))
        .map(|d| Arc::new(d) as Arc<dyn Dedup>)
        .map_err(|e| StoreError::io("cannot open webhook-dedup.jsonl", &e))
}

fn announce(
    config: &Config,
    listener: &tokio::net::TcpListener,
    data_dir: &Path,
    id: &str,
    catalog: &Snapshot,
) {
    tracing::info!(
        listen = %listener.local_addr().map_or(config.listen, |a| a),
        data_dir = %data_dir.display(),
        mode = ?config.mode,
        worker = id,
        durability = %config.durability,
        catalog = catalog.version,
        buses = catalog.channels.buses.len(),
        rules = catalog.channels.rules.len(),
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
            Arc::new({
                let bus = channels.buses.iter().find(|b| b.name.get_ref() == name);
                BusPlan::new(name, log.clone(), rules)
                    .with_retention(
                        bus.and_then(|b| b.retention),
                        bus.and_then(|b| b.retention_bytes),
                    )
                    .with_max_backlog_age(bus.map_or(crate::config::DEFAULT_MAX_BACKLOG_AGE, |b| {
                        b.max_backlog_age()
                    }))
            }),
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
        webhooks: channels.webhooks.clone(),
    })
}

/// Follows the catalog: whenever its version moves past ours (on every notice and on the
/// rebalance tick, since notices can be lost), rebuilds the plan and hands it to the
/// worker, which restarts only what changed.
async fn follow_catalog(
    config: Config,
    catalog: Catalog,
    logs: Arc<Logs>,
    mut version: u64,
    ingress: Arc<IngressState>,
    plans: Arc<watch::Sender<Arc<Plan>>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut notices = catalog.changes();
    let mut tick = tokio::time::interval(config.cluster.rebalance_interval);
    // The version that last failed to run, and when: retried every 30 s (the cause may pass).
    let mut failed: Option<(u64, std::time::Instant)> = None;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = notices.changed() => {}
            _ = stop.changed() => return,
        }
        let current = match catalog.version().await {
            Ok(v) => v,
            Err(_) => continue,
        };
        if current <= version
            || failed.is_some_and(|(v, at)| v == current && at.elapsed() < Duration::from_secs(30))
        {
            continue;
        }
        let snapshot = match catalog.snapshot().await {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the catalog; retrying");
                continue;
            }
        };
        // A version that cannot run (a log that does not open, a target that cannot be
        // built) is logged and tried again every 30 s until a newer version comes.
        let built = logs
            .for_channels(&snapshot.channels)
            .and_then(|l| build_plan(&config, &snapshot.channels, snapshot.version, l));
        match built {
            Ok(plan) => {
                tracing::info!(
                    from = version,
                    to = plan.version,
                    "catalog changed; applied"
                );
                version = plan.version;
                // What the change removed leaves no status, pause or restart entry behind.
                let before = ingress.connectors();
                let after = plan.connectors();
                let gone: Vec<String> = before
                    .iter()
                    .filter(|(id, _)| !after.contains_key(*id))
                    .flat_map(|(id, tasks)| {
                        std::iter::once(id.clone())
                            .chain((0..*tasks).map(|t| crate::runtime::cluster::task_id(id, t)))
                    })
                    .collect();
                let plan = Arc::new(plan);
                ingress.set_plan(&plan);
                plans.send_replace(plan);
                if !gone.is_empty() {
                    // After the worker has the new plan: its lanes report no more.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if let Err(e) = ingress.cluster.forget(&gone).await {
                        tracing::warn!(error = %e, "cannot remove the statuses of deleted connectors");
                    }
                }
            }
            Err(e) => {
                failed = Some((current, std::time::Instant::now()));
                tracing::error!(version = current, error = %e, "cannot run the catalog's new version; keeping the previous one");
            }
        }
    }
}
