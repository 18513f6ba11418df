//! From a catalog version to what runs: the plan (`build_plan`: each bus's log, rules with
//! their compiled filters, transforms and targets, sources), with what cannot be built on
//! this replica failing alone; and `follow_catalog`, which follows the stored catalog and
//! hands every new plan to the worker and to ingress.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::catalog::{Catalog, Drift};
use crate::config::{Channels, Config};
use crate::ingress::auth::KeySet;
use crate::ingress::state::IngressState;
use crate::ingress::state::Settings;
use crate::ingress::webhooks::source::Webhooks;
use crate::rules::{compile_transform, Filter};
use crate::runtime::delivery::Delivery;
use crate::runtime::{BusPlan, FailedConnector, Plan, RuleSubscriptions, Subscription};
use crate::sources::Source;
use crate::store::cluster::Cluster;
use crate::store::cluster::State;
use crate::store::UnavailableLog;
use crate::targets;
use crate::values::stable_hash;

use super::backend::{BusLogs, OpenedLogs};

/// What this replica cannot run of a catalog version, by what (`bus/{bus}`, a connector
/// id `{bus}/{rule}/{target}` or `source/{name}`), with why.
pub(super) type Failures = BTreeMap<String, String>;

/// Turns buses and rules into what the worker runs: per bus, its log, its subscriptions
/// and their compiled rule index.
///
/// Never fails as a whole: what cannot be built on this replica fails alone. A target that
/// does not build (an environment variable missing here) or a rule whose condition does
/// not compile makes subscriptions that hold their events (`Subscription::failed`); a bus
/// whose keys cannot be read is closed (503); a bus whose log does not open takes no
/// events and its rules and sources are reported failed. The rest runs.
pub(super) fn build_plan(
    config: &Config,
    channels: &Channels,
    version: u64,
    opened: OpenedLogs,
) -> Plan {
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
                            &config.delivery,
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
                    .with_max_backlog_age(bus.map_or(crate::store::DEFAULT_MAX_BACKLOG_AGE, |b| {
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
    let aws = crate::ingress::compat::aws::resolve_all(
        channels
            .buses
            .iter()
            .filter_map(|b| Some((b.name.get_ref().as_str(), b.aws.as_ref()?))),
        secret_prefix,
        &mut failures,
    );
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
        aws,
        failed,
        failures,
        connectors: std::sync::OnceLock::new(),
    }
}

/// The running parts of a subscription: its target, its delivery (retry, dead letters) and
/// its transform chain.
type Parts = (
    Arc<dyn targets::Target>,
    Delivery,
    Option<Arc<sluice_functions::TransformChain>>,
);

/// A subscription's running parts; why not, when one cannot be built here.
fn subscription_parts(
    config: &Config,
    rule: &str,
    id: &str,
    target: &crate::targets::config::TargetConfig,
    resources: &targets::Resources,
) -> Result<Parts, String> {
    let built =
        targets::build(&config.target_policy(), target, resources).map_err(|e| e.message)?;
    let delivery = Delivery::new(
        &config.target_policy(),
        &config.delivery,
        rule,
        id,
        target,
        built.clone(),
        resources,
    )
    .map_err(|e| e.message)?;
    let transform = target
        .transform()
        .map(compile_transform)
        .transpose()?
        .map(Arc::new);
    Ok((built, delivery, transform))
}

/// Says what this replica cannot run of a catalog version: each failure at ERROR once per
/// version (`before`: what the version it replaces could not run, said already if it is
/// the same version), and what runs again.
pub(super) fn log_failures(version: u64, before: &Failures, failures: &Failures) {
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
    logs: &dyn BusLogs,
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
            if let Some(name) = name.strip_suffix("#auth") {
                bus(name)
                    .and_then(|b| b.auth.as_ref())
                    .is_some_and(|a| a.resolve(config.admin.secret_env_prefix()).is_ok())
            } else if let Some(name) = name.strip_suffix("#aws") {
                bus(name)
                    .and_then(|b| b.aws.as_ref())
                    .is_some_and(|a| a.resolve(config.admin.secret_env_prefix()).is_ok())
            } else {
                match bus(name) {
                    Some(b) => {
                        let one = Channels {
                            buses: vec![b.clone()],
                            ..Channels::default()
                        };
                        logs.open(&one).await.failed.is_empty()
                    }
                    None => false,
                }
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
                    && targets::validate(&config.target_policy(), target, &buses).is_ok()
            })
        };
        if builds {
            return true;
        }
    }
    false
}

/// Reports the connectors this replica cannot run at all (see `Plan::failed`) as FAILED.
pub(super) async fn report_failed(cluster: &dyn Cluster, plan: &Plan) {
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
/// What follows the catalog besides the worker: ingress's settings.
pub(super) struct Following {
    pub ingress: Arc<IngressState>,
    /// The configuration's JSON Schemas (loaded once; not part of the catalog).
    pub schemas: Arc<HashMap<String, Arc<crate::ingress::schema::BusSchemas>>>,
    pub cluster: Arc<dyn Cluster>,
}

impl Following {
    /// Ingress takes the buses and settings of `plan`, which replaces `before`; the
    /// catalog's webhook sources are rebuilt only when they changed.
    fn follow(&self, before: &Plan, plan: &Plan) {
        let same = |a: &[crate::ingress::webhooks::config::WebhookConfig],
                    b: &[crate::ingress::webhooks::config::WebhookConfig]| {
            serde_json::to_value(a).ok() == serde_json::to_value(b).ok()
        };
        let current = self.ingress.settings();
        let webhooks = if same(&before.webhooks, &plan.webhooks) {
            current.webhooks.clone()
        } else {
            Arc::new(current.webhooks.with_catalog(&plan.webhooks))
        };
        self.ingress
            .set_settings(settings_of(plan, self.schemas.clone(), webhooks));
    }
}

/// Ingress's settings for a plan.
pub(super) fn settings_of(
    plan: &Plan,
    schemas: Arc<HashMap<String, Arc<crate::ingress::schema::BusSchemas>>>,
    webhooks: Arc<Webhooks>,
) -> Settings {
    Settings {
        buses: Arc::new(plan.logs.clone()),
        dedup: Arc::new(plan.dedup.clone()),
        auth: Arc::new(plan.auth.clone()),
        schemas,
        rate: Arc::new(plan.rate_limits.clone()),
        webhooks,
        aws: Arc::new(plan.aws.clone()),
        series: Settings::series_of(plan.logs.keys()),
    }
}

pub(super) async fn follow_catalog(
    config: Config,
    catalog: Catalog,
    logs: Arc<dyn BusLogs>,
    running: crate::catalog::Head,
    following: Following,
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
        crate::wasm::registry().sync(&snapshot.channels.functions, catalog.store());
        // Every version runs: what cannot be built here fails alone. Tried again, the
        // plan is made anew only once something that failed builds (making it builds
        // every target again).
        let again = snapshot.version == version && snapshot.id == running_id;
        if again && !may_build_now(&config, logs.as_ref(), &snapshot.channels, &failures).await {
            tried = std::time::Instant::now();
            continue;
        }
        let opened = logs.open(&snapshot.channels).await;
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
        let before = plans.borrow().connectors();
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
        following.follow(&plans.borrow(), &plan);
        plans.send_replace(plan.clone());
        report_failed(following.cluster.as_ref(), &plan).await;
        if !gone.is_empty() {
            // After the worker has the new plan: its lanes report no more.
            tokio::time::sleep(Duration::from_millis(200)).await;
            crate::metrics::get().forget_subscriptions(&gone);
            if let Err(e) = following.cluster.forget(&gone).await {
                tracing::warn!(error = %e, "cannot remove the statuses of deleted connectors");
            }
        }
    }
}

/// How often what a replica cannot run of its catalog is tried again.
const RETRY_FAILED: Duration = Duration::from_secs(30);
