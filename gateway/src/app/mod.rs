//! Wires a configuration into a running gateway: stores, ingress, the worker, and the
//! shutdown order (stop accepting → finish requests → stop tasks → commit → flush → leave).

use std::collections::BTreeMap;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

mod backend;
mod limits;
mod plan;
pub mod router;
#[cfg(test)]
mod router_tests;

use tokio::sync::watch;

use crate::admin::AdminState;
use crate::catalog::{Catalog, ChangeError, Snapshot};
use crate::config::{Channels, Config, Mode};
use crate::ingress::state::IngressState;
use crate::ingress::webhooks::source::Webhooks;
use crate::runtime::{Worker, WorkerOptions};
use crate::store::cluster::Cluster;
use crate::store::embedded::DataDir;
use crate::store::StoreError;

use backend::Backend;
use plan::{build_plan, follow_catalog, log_failures, report_failed, settings_of, Following};

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
    let backend = Backend::open(&config, data, &id).await?;
    let Backend {
        cluster,
        positions,
        catalog,
        logs,
        limiter,
        dedup,
        replays,
        inventory,
        membership,
    } = backend;
    let leave = || async {
        if let Some(membership) = &membership {
            membership.leave().await;
        }
    };
    // The file's resources seed an empty catalog; a stored catalog is never replaced by
    // the file (that would roll back the admin API's changes). Wait for Redis if it is
    // not up yet.
    // Moved out of the configuration: from here on the catalog is what runs, and with
    // thousands of rules the file's copy would only take memory.
    let mut file = config.take_channels();
    crate::wasm::registry().configure(&data_path, config.limits.max_event_bytes);
    // The file's functions name their components by path: stored by hash, named by hash.
    for function in &mut file.functions {
        loop {
            match crate::wasm::resolve_path(function, &config.base_dir, catalog.store().as_ref())
                .await
            {
                Ok(()) => break,
                Err(crate::wasm::ResolveError::File(m)) => {
                    leave().await;
                    return Err(StartError::Config(m));
                }
                Err(e) => {
                    tracing::warn!(error = %e, "waiting for the cluster store to hold the file's functions");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = stop.wait_for(|s| *s) => {
                            leave().await;
                            return Ok(());
                        }
                    }
                }
            }
        }
    }
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
    crate::wasm::registry().sync(&snapshot.channels.functions, catalog.store());
    // One resource this replica cannot build fails alone: the rest starts.
    let opened = logs.open(&snapshot.channels).await;
    let plan = build_plan(&config, &snapshot.channels, snapshot.version, opened);
    log_failures(snapshot.version, &BTreeMap::new(), &plan.failures);
    let plan = Arc::new(plan);
    let worker = Worker::start(
        cluster.clone(),
        positions.clone(),
        plan.clone(),
        worker_options(&config),
    );
    let schemas = Arc::new(
        crate::ingress::schema::load(&config.schemas, &config.base_dir)
            .map_err(StartError::Config)?,
    );
    let webhooks = Webhooks::build(
        &config.webhooks,
        &plan.webhooks,
        dedup.clone(),
        config.admin.secret_env_prefix(),
    )
    .map_err(StartError::Config)?;
    let ingress = Arc::new(
        IngressState::new(
            settings_of(&plan, schemas.clone(), Arc::new(webhooks)),
            config.limits.clone(),
            cluster.clone(),
            limiter,
            dedup,
        )
        .with_knative_brokers(config.knative.brokers.clone()),
    );
    let auth = crate::admin::AdminAuth::from_config(
        &config.admin,
        config.cluster.strategy.name(),
        config.delivery.batch_size,
        &data_path,
    )
    .map_err(StartError::Config)?;
    let admission = crate::admission::Admission::new(config.clone(), inventory);
    let admin = Arc::new(AdminState::new(
        ingress.clone(),
        cluster.clone(),
        catalog.clone(),
        auth,
        admission,
        positions.clone(),
        replays.clone(),
        worker.plan_sender().subscribe(),
    ));
    report_failed(cluster.as_ref(), &plan).await;
    // A member of a cluster takes over the replays of replicas that left it.
    if membership.is_some() {
        tokio::spawn(crate::replay::adopt_orphans(
            crate::replay::Adopter {
                store: replays,
                cancels: admin.replay_cancels.clone(),
                cluster: cluster.clone(),
                plans: worker.plan_sender().subscribe(),
                batch: admin.auth.replay_batch,
            },
            std::time::Duration::from_secs(2),
            stop.clone(),
        ));
    }
    tokio::spawn(crate::scaling::sample(admin.clone(), stop.clone()));
    tokio::spawn(follow_catalog(
        config.clone(),
        catalog,
        logs.clone(),
        snapshot.head(),
        Following {
            ingress: ingress.clone(),
            schemas,
            cluster: cluster.clone(),
        },
        worker.plan_sender(),
        stop.clone(),
    ));
    announce(&config, &listener, &data_path, &id, &snapshot);
    // The plan holds what it needs of it.
    drop(snapshot);
    let drain = drain(stop.clone(), ingress.clone(), config.limits.shutdown_delay);
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
                    router::router(ingress.clone(), None),
                    &config.limits,
                    drain
                ),
                crate::server::serve(
                    admin_listener,
                    crate::admin::admin_router(admin),
                    &config.limits,
                    admin_drain
                ),
            );
        }
        None => {
            crate::server::serve(
                listener,
                router::router(ingress, Some(admin)),
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
        .filter(|h| crate::values::check_name(h).is_ok())
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
