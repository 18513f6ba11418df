//! Wires a configuration into a running gateway: stores, ingress, runtime, and the
//! shutdown order (stop accepting → finish requests → stop tasks → commit → flush).

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use crate::config::{Config, Mode};
use crate::ingress::{self, IngressState};
use crate::rules::Matcher;
use crate::runtime::delivery::Delivery;
use crate::runtime::{Runtime, Subscription};
use crate::sources::Sources;
use crate::store::embedded::{DataDir, EmbeddedLog, LogOptions};
use crate::store::{BusLog, PositionStore, StoreError};
use crate::targets;

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
    #[error("rule `{rule}`: pattern {message}")]
    Pattern { rule: String, message: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Runs the gateway until `shutdown` resolves, then shuts down in order.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let Mode::Standalone = config.mode;
    let data = DataDir::open(&config.data_dir)?;
    let options = LogOptions {
        durability: config.durability,
        segment_bytes: config.store.segment_bytes,
        cache_bytes: config.store.cache_bytes,
    };
    let mut embedded: Vec<Arc<EmbeddedLog>> = Vec::new();
    let mut logs: HashMap<String, Arc<dyn BusLog>> = HashMap::new();
    for bus in &config.buses {
        let log = Arc::new(data.open_bus(bus.name.get_ref(), bus.shards, &options)?);
        embedded.push(log.clone());
        logs.insert(bus.name.get_ref().clone(), log);
    }
    let positions: Arc<dyn PositionStore> = Arc::new(data.open_positions()?);

    let resources = targets::Resources {
        buses: logs.clone(),
    };
    let mut subscriptions = Vec::new();
    for rule in &config.rules {
        let rule_name = rule.name.get_ref();
        let matcher = match &rule.pattern {
            Some(p) => Matcher::compile(p.get_ref()).map_err(|message| StartError::Pattern {
                rule: rule_name.clone(),
                message,
            })?,
            None => Matcher::default(),
        };
        let matcher = Arc::new(matcher);
        for target in &rule.targets {
            let target_name = target.name();
            let failed = |e: targets::TargetError| StartError::Target {
                rule: rule_name.clone(),
                target: target_name.to_string(),
                message: e.message,
            };
            let id = format!("{}/{}/{}", rule.bus.get_ref(), rule_name, target_name);
            let built = targets::build(&config, target, &resources).map_err(failed)?;
            let delivery = Delivery::new(&config, rule_name, &id, target, built, &resources)
                .map_err(failed)?;
            subscriptions.push(Subscription {
                id,
                bus: rule.bus.get_ref().clone(),
                matcher: matcher.clone(),
                delivery: Arc::new(delivery),
            });
        }
    }

    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.listen,
            source,
        })?;
    let runtime = Runtime::start(
        subscriptions,
        &logs,
        positions.clone(),
        config.delivery.clone(),
    )
    .await?;
    let sources = Sources::start(&config.sources, &logs, positions.clone());
    let router = ingress::router(Arc::new(IngressState {
        buses: logs,
        limits: config.limits.clone(),
    }));
    tracing::info!(
        listen = %listener.local_addr().map_or(config.listen, |a| a),
        data_dir = %data.path().display(),
        durability = %config.durability,
        buses = config.buses.len(),
        rules = config.rules.len(),
        "sluice is ready"
    );

    crate::server::serve(listener, router, &config.limits, shutdown).await;
    tracing::info!("ingress stopped; finishing deliveries");
    sources.shutdown().await;
    runtime.shutdown(positions.as_ref()).await;
    for log in &embedded {
        log.close().await;
    }
    tracing::info!("shutdown complete");
    Ok(())
}
