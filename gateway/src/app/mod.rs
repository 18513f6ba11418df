//! Wires a configuration into a running gateway: stores, ingress, the worker, and the
//! shutdown order (stop accepting → finish requests → stop tasks → commit → flush → leave).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::catalog::{Catalog, ChangeError, Drift, FileCatalog, RedisCatalog, Snapshot};
use crate::config::{Channels, Config, Mode};
use crate::ingress::auth::KeySet;
use crate::ingress::{self, IngressState};
use crate::rules::{compile_transform, Filter};
use crate::runtime::delivery::Delivery;
use crate::runtime::rebalance::stable_hash;
use crate::runtime::{
    BusPlan, FailedConnector, Plan, RuleSubscriptions, Subscription, UnavailableLog, Worker,
    WorkerOptions,
};
use crate::sources::Source;
use crate::store::cluster::State;
use crate::store::cluster::{Cluster, LocalCluster};
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
    Redis {
        redis: Redis,
        /// The shard count recorded in Redis for each bus this process has run.
        recorded: Box<std::sync::Mutex<HashMap<String, u32>>>,
    },
}

/// The logs of a catalog version's buses, and the buses whose log does not open here.
struct OpenedLogs {
    logs: HashMap<String, Arc<dyn BusLog>>,
    failed: HashMap<String, String>,
}

impl Logs {
    /// The log of every bus of `channels`. A log that does not open (its shard count is
    /// not the one its data was placed by, the disk fails) fails that bus alone.
    async fn for_channels(&self, channels: &Channels) -> OpenedLogs {
        let mut opened = OpenedLogs {
            logs: HashMap::new(),
            failed: HashMap::new(),
        };
        for bus in &channels.buses {
            let name = bus.name.get_ref();
            let log: Result<Arc<dyn BusLog>, String> = match self {
                Logs::Embedded {
                    data,
                    options,
                    open,
                } => {
                    let mut open = open.lock().unwrap_or_else(|p| p.into_inner());
                    match open.get(name) {
                        Some(log) if log.shards() == bus.shards => Ok(log.clone()),
                        _ => match data.open_bus(name, bus.shards, options) {
                            Ok(log) => {
                                let log = Arc::new(log);
                                open.insert(name.clone(), log.clone());
                                Ok(log)
                            }
                            Err(e) => Err(e.to_string()),
                        },
                    }
                }
                Logs::Redis { redis, recorded } => {
                    let known = recorded
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .get(name)
                        .copied();
                    let shards = match known {
                        Some(shards) => Some(shards),
                        // Not recorded while Redis is away: the next version records it.
                        None => RedisLog::record_shards(redis, name, bus.shards)
                            .await
                            .inspect(|shards| {
                                recorded
                                    .lock()
                                    .unwrap_or_else(|p| p.into_inner())
                                    .insert(name.clone(), *shards);
                            })
                            .ok(),
                    };
                    match shards {
                        Some(stored) if stored != bus.shards => Err(format!(
                            "bus `{name}` was first run with {stored} shards and the catalog now says {}; \
                             its events are placed by the first count",
                            bus.shards
                        )),
                        _ => Ok(Arc::new(RedisLog::new(redis.clone(), name, bus.shards))),
                    }
                }
            };
            match log {
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
    check_admin_credentials(&config)?;
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
            let dedup = standalone_dedup(data.path(), config.limits.max_dedup_bytes)?;
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
            let redis = Redis::connect(&url, &config.redis_prefix, config.cluster.redis_timeout)
                .await?
                .with_dedup_bytes(config.limits.max_dedup_bytes);
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
                Logs::Redis {
                    redis,
                    recorded: Box::default(),
                },
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
    // One resource this replica cannot build fails alone: the rest starts.
    let opened = logs.for_channels(&snapshot.channels).await;
    let plan = build_plan(&config, &snapshot.channels, snapshot.version, opened);
    log_failures(snapshot.version, &BTreeMap::new(), &plan.failures);
    let plan = Arc::new(plan);
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
        Webhooks::build(
            &config.webhooks,
            &plan.webhooks,
            dedup,
            config.admin.secret_env_prefix(),
        )
        .map_err(StartError::Config)?,
    );
    let admin = crate::api::AdminAuth::from_config(
        &config.admin,
        config.cluster.strategy.name(),
        config.delivery.batch_size,
        &data_path,
    )
    .map_err(StartError::Config)?;
    state.set_admin(catalog.clone(), admin);
    state.set_admission(crate::admission::Admission::new(
        config.clone(),
        match &logs {
            Logs::Embedded { .. } => crate::admission::Inventory::Embedded(data_path.clone()),
            Logs::Redis { redis, .. } => {
                crate::admission::Inventory::Redis(Box::new(redis.clone()))
            }
        },
    ));
    report_failed(state.cluster.as_ref(), &plan).await;
    if let Logs::Redis { redis, .. } = &logs {
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
        snapshot.head(),
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

/// A standalone gateway without an admin token generates one; replicas of a cluster cannot
/// (each would make its own, and a request through a load balancer would meet the wrong
/// one), so distributed mode needs a configured token or the explicit local opt-in.
fn check_admin_credentials(config: &Config) -> Result<(), StartError> {
    let env_token = std::env::var("SLUICE_ADMIN_TOKEN").is_ok_and(|t| !t.is_empty());
    if config.mode == Mode::Distributed
        && config.admin.tokens.is_empty()
        && !env_token
        && !config.admin.allow_local_without_token
    {
        return Err(StartError::Config(
            "distributed mode needs an admin token shared by every replica: set SLUICE_ADMIN_TOKEN \
             (or admin.tokens, `sluice ctl hash-token`); for a local trial only, \
             admin.allow_local_without_token = true"
                .to_string(),
        ));
    }
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

/// Standalone dedup records (webhooks and buses), kept in the data directory across
/// restarts, in at most `max_bytes` of memory.
fn standalone_dedup(data_dir: &Path, max_bytes: usize) -> Result<Arc<dyn Dedup>, StoreError> {
    MemoryDedup::persistent(&data_dir.join("webhook-dedup.jsonl"), max_bytes)
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
    crate::store::embedded::create_private(&path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, id.as_bytes()))
        .map_err(|e| StoreError::io("cannot write worker-id", &e))?;
    Ok(id)
}

/// What this replica cannot run of a catalog version, by what (`bus/{bus}`, a connector
/// id `{bus}/{rule}/{target}` or `source/{name}`), with why.
type Failures = BTreeMap<String, String>;

/// Turns buses and rules into what the worker runs: per bus, its log, its subscriptions
/// and their compiled rule index.
///
/// Never fails as a whole: what cannot be built on this replica fails alone. A target that
/// does not build (an environment variable missing here) or a rule whose condition does
/// not compile makes subscriptions that hold their events (`Subscription::failed`); a bus
/// whose keys cannot be read is closed (503); a bus whose log does not open takes no
/// events and its rules and sources are reported failed. The rest runs.
fn build_plan(config: &Config, channels: &Channels, version: u64, opened: OpenedLogs) -> Plan {
    let mut failures = Failures::new();
    let shards_of = |bus: &str| {
        channels
            .buses
            .iter()
            .find(|b| b.name.get_ref() == bus)
            .map_or(1, |b| b.shards)
    };
    let mut logs = opened.logs.clone();
    let mut failed = BTreeMap::new();
    for (bus, why) in &opened.failed {
        let reason = format!("the log of bus `{bus}` does not open on this replica: {why}");
        failures.insert(format!("bus/{bus}"), reason.clone());
        // Ingress answers 503 for it; targets appending to it retry.
        logs.insert(
            bus.clone(),
            Arc::new(UnavailableLog::new(shards_of(bus), reason)),
        );
    }
    let resources = targets::Resources {
        buses: logs.clone(),
    };
    let mut rules_by_bus: HashMap<&str, Vec<RuleSubscriptions>> = HashMap::new();
    for rule in &channels.rules {
        let rule_name = rule.name.get_ref();
        let bus = rule.bus.get_ref();
        if let Some(why) = opened.failed.get(bus) {
            for target in &rule.targets {
                failed.insert(
                    format!("{bus}/{rule_name}/{}", target.name()),
                    FailedConnector {
                        tasks: shards_of(bus),
                        reason: format!(
                            "the log of bus `{bus}` does not open on this replica: {why}"
                        ),
                    },
                );
            }
            continue;
        }
        let (filter, unmatched) = match Filter::compile(
            rule.pattern.as_ref().map(|p| p.get_ref()),
            rule.filter.as_ref().map(|f| f.get_ref().as_str()),
        ) {
            Ok(filter) => (filter, None),
            // The rule is left out of the index (see `BusPlan::new`).
            Err(m) => (
                Filter::All,
                Some(format!(
                    "the rule's condition does not compile on this replica: {m}"
                )),
            ),
        };
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
            let name = format!("{rule_name}/{target_name}");
            let id = format!("{bus}/{name}");
            let spec = serde_json::to_string(target).unwrap_or_default();
            let built = match &unmatched {
                Some(why) => Err(why.clone()),
                None => subscription_parts(config, rule_name, &id, target, &resources),
            };
            let subscription = match built {
                Ok((built, delivery, transform)) => Subscription {
                    id,
                    name,
                    bus: bus.clone(),
                    filter: filter.clone(),
                    transform,
                    target: built,
                    delivery: Arc::new(delivery),
                    spec: stable_hash(format!("{condition}|{spec}").as_bytes()),
                    failed: None,
                },
                Err(why) => {
                    failures.insert(id.clone(), why.clone());
                    let unbuilt: Arc<dyn targets::Target> = Arc::new(targets::Unavailable {
                        reason: why.clone(),
                    });
                    Subscription {
                        delivery: Arc::new(Delivery::unbuilt(
                            config,
                            rule_name,
                            &id,
                            target,
                            unbuilt.clone(),
                        )),
                        id,
                        name,
                        bus: bus.clone(),
                        filter: filter.clone(),
                        transform: None,
                        target: unbuilt,
                        // Another digest than the running one's: once it builds, its lanes
                        // are made anew from their positions.
                        spec: stable_hash(format!("{condition}|{spec}|failed: {why}").as_bytes()),
                        failed: Some(why),
                    }
                }
            };
            subscriptions.push(Arc::new(subscription));
        }
        rules_by_bus
            .entry(bus.as_str())
            .or_default()
            .push(RuleSubscriptions {
                filter,
                subscriptions,
            });
    }
    let mut buses = std::collections::BTreeMap::new();
    for (name, log) in &opened.logs {
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
        match (
            opened.logs.get(source.bus()),
            opened.failed.get(source.bus()),
        ) {
            (Some(log), _) => sources.push(Arc::new(Source::new(source.clone(), log.clone()))),
            (None, Some(why)) => {
                let id = format!("source/{}", source.name());
                let reason = format!(
                    "the log of bus `{}` does not open on this replica: {why}",
                    source.bus()
                );
                failures.insert(id.clone(), reason.clone());
                failed.insert(
                    id,
                    FailedConnector {
                        tasks: source.tasks(),
                        reason,
                    },
                );
            }
            (None, None) => {}
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
    let secret_prefix = config.admin.secret_env_prefix();
    for bus in &channels.buses {
        if let Some(config) = &bus.auth {
            let keys = config.resolve(secret_prefix).unwrap_or_else(|m| {
                // Closed, never open: its producers get 503 until a replica that can read
                // the keys takes their requests.
                let name = bus.name.get_ref();
                failures.insert(
                    format!("bus/{name}#auth"),
                    format!("the keys of bus `{name}` are unavailable on this replica: {m}"),
                );
                KeySet::unavailable(m)
            });
            auth.insert(bus.name.get_ref().clone(), Arc::new(keys));
        }
    }
    let rate_limits = channels
        .buses
        .iter()
        .filter_map(|b| b.rate_limit.map(|l| (b.name.get_ref().clone(), l)))
        .collect();
    Plan {
        version,
        buses,
        sources,
        logs,
        dedup,
        auth,
        rate_limits,
        webhooks: channels.webhooks.clone(),
        failed,
        failures,
    }
}

/// The running parts of a subscription: its target, its delivery (retry, dead letters) and
/// its transform chain.
type Parts = (
    Arc<dyn targets::Target>,
    Delivery,
    Option<sluice_functions::TransformChain>,
);

/// A subscription's running parts; why not, when one cannot be built here.
fn subscription_parts(
    config: &Config,
    rule: &str,
    id: &str,
    target: &crate::config::TargetConfig,
    resources: &targets::Resources,
) -> Result<Parts, String> {
    let built = targets::build(config, target, resources).map_err(|e| e.message)?;
    let delivery =
        Delivery::new(config, rule, id, target, built.clone(), resources).map_err(|e| e.message)?;
    let transform = target.transform().map(compile_transform).transpose()?;
    Ok((built, delivery, transform))
}

/// Says what this replica cannot run of a catalog version: each failure at ERROR once per
/// version (`before`: what the version it replaces could not run, said already if it is
/// the same version), and what runs again.
fn log_failures(version: u64, before: &Failures, failures: &Failures) {
    for (what, why) in failures {
        if before.get(what) != Some(why) {
            tracing::error!(version, resource = %what, reason = %why, "cannot run this resource of the catalog on this replica; it fails alone (reported FAILED) and is retried every 30 s and on every new version; the rest runs");
        }
    }
    for what in before.keys().filter(|w| !failures.contains_key(*w)) {
        tracing::info!(version, resource = %what, "this resource of the catalog runs again on this replica");
    }
}

/// Whether anything of `failures` builds now, checked for those resources alone and
/// without side effects (a bus's log is opened, as its runtime would).
async fn may_build_now(
    config: &Config,
    logs: &Logs,
    channels: &Channels,
    failures: &Failures,
) -> bool {
    let buses: std::collections::HashSet<&str> = channels
        .buses
        .iter()
        .map(|b| b.name.get_ref().as_str())
        .collect();
    let bus = |name: &str| channels.buses.iter().find(|b| b.name.get_ref() == name);
    for what in failures.keys() {
        let builds = if let Some(name) = what.strip_prefix("bus/") {
            match name.strip_suffix("#auth") {
                Some(name) => bus(name)
                    .and_then(|b| b.auth.as_ref())
                    .is_some_and(|a| a.resolve(config.admin.secret_env_prefix()).is_ok()),
                None => match bus(name) {
                    Some(b) => {
                        let one = Channels {
                            buses: vec![b.clone()],
                            ..Channels::default()
                        };
                        logs.for_channels(&one).await.failed.is_empty()
                    }
                    None => false,
                },
            }
        } else if what.starts_with("source/") {
            // Fails with its bus's log, tried above.
            false
        } else {
            // A subscription: `{bus}/{rule}/{target}`.
            channels.rules.iter().any(|rule| {
                let prefix = format!("{}/{}/", rule.bus.get_ref(), rule.name.get_ref());
                let Some(target) = what
                    .strip_prefix(&prefix)
                    .and_then(|t| rule.targets.iter().find(|x| x.name() == t))
                else {
                    return false;
                };
                Filter::compile(
                    rule.pattern.as_ref().map(|p| p.get_ref()),
                    rule.filter.as_ref().map(|f| f.get_ref().as_str()),
                )
                .is_ok()
                    && target
                        .transform()
                        .is_none_or(|t| compile_transform(t).is_ok())
                    && targets::validate(config, target, &buses).is_ok()
            })
        };
        if builds {
            return true;
        }
    }
    false
}

/// Reports the connectors this replica cannot run at all (see `Plan::failed`) as FAILED.
async fn report_failed(cluster: &dyn Cluster, plan: &Plan) {
    if plan.failed.is_empty() {
        return;
    }
    let reports = plan
        .failed
        .iter()
        .map(|(id, f)| (id.clone(), State::Failed, Some(f.reason.clone())))
        .collect();
    cluster.report_many(reports).await;
}

/// Follows the catalog: whenever its version moves past ours (on every notice and on the
/// rebalance tick, since notices can be lost), rebuilds the plan and hands it to the
/// worker, which restarts only what changed.
async fn follow_catalog(
    config: Config,
    catalog: Catalog,
    logs: Arc<Logs>,
    running: crate::catalog::Head,
    ingress: Arc<IngressState>,
    plans: Arc<watch::Sender<Arc<Plan>>>,
    mut stop: watch::Receiver<bool>,
) {
    // The write of the catalog this replica runs.
    let (mut version, mut running_id) = (running.version, running.id);
    let mut notices = catalog.changes();
    let mut tick = tokio::time::interval(config.cluster.rebalance_interval);
    // What the running version cannot run here fails alone (see `build_plan`); it is tried
    // again with every new version and every 30 s (a file may appear, a store come back).
    let mut tried = std::time::Instant::now();
    let mut failures = plans.borrow().failures.clone();
    // Whether the store was found without a catalog (said once, not every tick).
    let mut missing = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = notices.changed() => {}
            _ = stop.changed() => return,
        }
        // Only the head (version and id): the whole catalog is read when it moved.
        let current = match catalog.head().await {
            Ok(Some(head)) => {
                missing = false;
                head
            }
            Ok(None) => {
                // Not an empty catalog: running nothing would stop every delivery.
                if !std::mem::replace(&mut missing, true) {
                    tracing::error!(
                        version,
                        "the catalog is missing from the cluster store (flushed, or restored without it); \
                         running the last catalog until one is stored again (a replica started anew seeds it from its file)"
                    );
                }
                continue;
            }
            Err(_) => continue,
        };
        // Any other write than the one running is followed, older ones too: a store
        // restored from a backup numbers its writes again from an older version.
        let running = crate::catalog::Head {
            version,
            id: running_id,
        };
        let drift = current.drift_from(running);
        let retry = !failures.is_empty() && tried.elapsed() >= RETRY_FAILED;
        if drift == Drift::Same && !retry {
            continue;
        }
        match drift {
            Drift::Behind => tracing::warn!(
                from = version,
                to = current.version,
                "the catalog went back from version {version} to {} (restored from a backup?); running the stored catalog",
                current.version
            ),
            Drift::Replaced => tracing::warn!(
                version,
                "the stored catalog at version {version} is not the one this replica runs (restored from a backup?); running the stored catalog"
            ),
            // Same: tried again, not a new catalog.
            Drift::Same | Drift::Ahead => {}
        }
        let snapshot = match catalog.snapshot().await {
            Ok(snapshot) => snapshot,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the catalog; retrying");
                continue;
            }
        };
        // Every version runs: what cannot be built here fails alone. Tried again, the
        // plan is made anew only once something that failed builds (making it builds
        // every target again).
        let again = snapshot.version == version && snapshot.id == running_id;
        if again && !may_build_now(&config, &logs, &snapshot.channels, &failures).await {
            tried = std::time::Instant::now();
            continue;
        }
        let opened = logs.for_channels(&snapshot.channels).await;
        let plan = build_plan(&config, &snapshot.channels, snapshot.version, opened);
        tried = std::time::Instant::now();
        if again && plan.failures == failures {
            continue;
        }
        let said = if again { failures } else { Failures::new() };
        log_failures(plan.version, &said, &plan.failures);
        failures = plan.failures.clone();
        if again {
            tracing::info!(version, "tried again what could not run here; applied");
        } else {
            tracing::info!(
                from = version,
                to = plan.version,
                "catalog changed; applied"
            );
        }
        version = plan.version;
        running_id = snapshot.id;
        // What the change removed leaves no status, pause or restart entry behind.
        let before = ingress.connectors();
        let after = plan.connectors();
        let gone: Vec<String> = before
            .iter()
            .filter(|(id, _)| !after.contains_key(*id))
            .flat_map(|(id, tasks)| {
                std::iter::once(id.clone())
                    .chain((0..*tasks).map(|t| crate::store::cluster::task_id(id, t)))
            })
            .collect();
        let plan = Arc::new(plan);
        ingress.set_plan(&plan);
        plans.send_replace(plan.clone());
        report_failed(ingress.cluster.as_ref(), &plan).await;
        if !gone.is_empty() {
            // After the worker has the new plan: its lanes report no more.
            tokio::time::sleep(Duration::from_millis(200)).await;
            crate::metrics::get().forget_subscriptions(&gone);
            if let Err(e) = ingress.cluster.forget(&gone).await {
                tracing::warn!(error = %e, "cannot remove the statuses of deleted connectors");
            }
        }
    }
}

/// How often what a replica cannot run of its catalog is tried again.
const RETRY_FAILED: Duration = Duration::from_secs(30);
