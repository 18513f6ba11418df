//! What the workers run, built from one version of the catalog: each bus's log and its
//! subscriptions (a rule's target with its filter, transform and delivery) behind the
//! bus's rule index, the sources, and what this replica could not build.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use crate::rules::Filter;
use crate::sources::Source;
use crate::store::cluster::task_id;
use crate::store::BusLog;
use crate::targets::Target;
use crate::values::stable_hash;
use sluice_functions::{RuleIndex, TransformChain};

/// One (rule, target) pair.
pub struct Subscription {
    /// `{bus}/{rule}/{target}`: the connector id (status, pause, restart).
    pub id: String,
    /// `{rule}/{target}`: its key among the bus's positions.
    pub name: String,
    pub bus: String,
    pub filter: Arc<Filter>,
    /// Applied to each matched event before the target.
    pub transform: Option<Arc<TransformChain>>,
    pub target: Arc<dyn Target>,
    /// The target under its retry policy and dead-letter destination.
    pub delivery: Arc<crate::runtime::delivery::Delivery>,
    /// A digest of the rule's condition and the target's configuration: a subscription
    /// whose digest did not change keeps running across a configuration change.
    pub spec: u64,
    /// Why this replica cannot run it (a target it cannot build here, say an environment
    /// variable missing on this replica): its lanes hold their positions like paused ones,
    /// deliver nothing and are reported `FAILED` with this reason. `target` is then
    /// [`crate::targets::Unavailable`].
    pub failed: Option<String>,
}

/// A rule of a bus for the index: its condition and its subscriptions (one per target).
pub struct RuleSubscriptions {
    pub filter: Arc<Filter>,
    pub subscriptions: Vec<Arc<Subscription>>,
}

/// One bus as its shard tasks run it: its log, its subscriptions and their rule index.
pub struct BusPlan {
    pub name: String,
    pub log: Arc<dyn BusLog>,
    pub subscriptions: Vec<Arc<Subscription>>,
    /// The names of `subscriptions` (what a shard's positions record as known).
    pub known: Arc<BTreeSet<String>>,
    /// Rule id (as given to the index) → positions in `subscriptions`.
    pub(crate) rules: Vec<Vec<usize>>,
    /// Rule ids whose condition matches every event (also used for events that do not
    /// decode, which no pattern can look into).
    pub(crate) match_all: Vec<usize>,
    pub(crate) index: RuleIndex,
    /// Whether any rule or transform needs to look inside events.
    pub(crate) needs_decode: bool,
    /// Changes whenever anything the shard tasks run changes.
    pub digest: u64,
    /// How long events are kept after acceptance even once every subscription passed
    /// them (for replays).
    pub retention: Option<Duration>,
    /// How many bytes of passed events each shard keeps (the bus's `retention_bytes`
    /// split among its shards).
    pub retention_bytes: Option<u64>,
    /// The oldest an event may get while a subscription has not delivered it: past it the
    /// subscription skips it (`max_backlog_age`).
    pub max_backlog_age: Duration,
}

impl BusPlan {
    pub fn new(name: &str, log: Arc<dyn BusLog>, rules: Vec<RuleSubscriptions>) -> BusPlan {
        let mut builder = RuleIndex::builder();
        let mut subscriptions = Vec::new();
        let mut by_rule = Vec::new();
        let mut match_all = Vec::new();
        let mut needs_decode = false;
        let mut digest = Vec::new();
        for (rule_id, rule) in rules.into_iter().enumerate() {
            // A rule none of whose subscriptions can run here is not matched at all (its
            // condition may be the very thing that could not be built).
            let runs = rule.subscriptions.iter().any(|s| s.failed.is_none());
            match rule.filter.as_ref() {
                _ if !runs => {}
                Filter::All => {
                    builder.add_match_all(rule_id);
                    match_all.push(rule_id);
                }
                Filter::Pattern(p) => {
                    builder.add_pattern(rule_id, p);
                    needs_decode = true;
                }
                Filter::Cesql(f) => {
                    builder.add_filter(rule_id, f.clone());
                    needs_decode = true;
                }
            }
            let mut members = Vec::new();
            for sub in rule.subscriptions {
                // A chain of user functions alone reads the stored text.
                needs_decode |= sub
                    .transform
                    .as_ref()
                    .is_some_and(|t| !t.calls_only_functions())
                    && sub.failed.is_none();
                digest.extend_from_slice(sub.name.as_bytes());
                digest.extend_from_slice(&sub.spec.to_le_bytes());
                members.push(subscriptions.len());
                subscriptions.push(sub);
            }
            by_rule.push(members);
        }
        digest.extend_from_slice(name.as_bytes());
        digest.extend_from_slice(&log.shards().to_le_bytes());
        BusPlan {
            name: name.to_string(),
            log,
            known: Arc::new(subscriptions.iter().map(|s| s.name.clone()).collect()),
            subscriptions,
            rules: by_rule,
            match_all,
            index: builder.build(),
            needs_decode,
            digest: stable_hash(&digest),
            retention: None,
            retention_bytes: None,
            max_backlog_age: crate::store::DEFAULT_MAX_BACKLOG_AGE,
        }
    }

    /// Keeps passed events `age` after acceptance and/or the newest `bytes` of them across
    /// the bus (see `retention`); an event goes once either bound passes it.
    pub fn with_retention(mut self, age: Option<Duration>, bytes: Option<u64>) -> BusPlan {
        self.retention = age.filter(|r| !r.is_zero());
        self.retention_bytes = bytes
            .filter(|b| *b > 0)
            .map(|b| (b / u64::from(self.log.shards().max(1))).max(1));
        self
    }

    /// Skips, for each subscription, the events older than `age` it has not delivered.
    pub fn with_max_backlog_age(mut self, age: Duration) -> BusPlan {
        self.max_backlog_age = age;
        // The shard tasks get the new plan when this changes.
        let mut digest = self.digest.to_le_bytes().to_vec();
        digest.extend_from_slice(&age.as_millis().to_le_bytes());
        self.digest = stable_hash(&digest);
        self
    }

    /// The subscriptions (positions in `subscriptions`) that take the event; `None` for an
    /// event that does not decode: only rules without a condition take it.
    pub(crate) fn matching(&self, event: Option<&cloudevents::Event>, rules: &mut Vec<usize>) {
        rules.clear();
        match event {
            Some(event) => self.index.matches(event, rules),
            None => rules.extend_from_slice(&self.match_all),
        }
    }
}

/// What the workers run, built from one version of the configuration.
#[derive(Default)]
pub struct Plan {
    pub version: u64,
    pub buses: BTreeMap<String, Arc<BusPlan>>,
    pub sources: Vec<Arc<Source>>,
    pub logs: HashMap<String, Arc<dyn BusLog>>,
    /// The dedup window of each bus that opted in (`dedup_window`).
    pub dedup: HashMap<String, std::time::Duration>,
    /// The accepted keys of each bus that requires one (`auth`).
    pub auth: HashMap<String, Arc<crate::ingress::auth::KeySet>>,
    /// The rate limit of each bus that has one (`rate_limit`).
    pub rate_limits: HashMap<String, crate::ingress::ratelimit::RateLimitConfig>,
    /// The catalog's webhook sources (ingress serves them with the file's own).
    pub webhooks: Vec<crate::ingress::webhooks::config::WebhookConfig>,
    /// The AWS PutEvents settings of each bus that has an `aws` table.
    pub aws: HashMap<String, Arc<crate::ingress::compat::aws::config::AwsBus>>,
    /// Connectors this replica cannot run at all (the rules and sources of a bus whose log
    /// does not open here): reported `FAILED` with the reason, listed with their tasks.
    /// (Subscriptions of a running bus that cannot run carry `Subscription::failed`.)
    pub failed: BTreeMap<String, FailedConnector>,
    /// Everything of the version this replica could not build, by what (`bus/{bus}`, a
    /// connector id), with why: what is logged and tried again.
    pub failures: BTreeMap<String, String>,
    /// The connectors and their number of tasks, made once when first asked for.
    pub(crate) connectors: std::sync::OnceLock<Arc<HashMap<String, u32>>>,
}

/// A connector of the catalog this replica cannot run, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedConnector {
    pub tasks: u32,
    pub reason: String,
}

/// The id of a bus shard's task.
pub fn shard_task_id(bus: &str, shard: u32) -> String {
    task_id(&format!("bus/{bus}"), shard)
}

impl Plan {
    /// Every connector of the plan (subscriptions `{bus}/{rule}/{target}` and sources
    /// `source/{name}`) with its number of tasks: what the admin API may act on.
    pub fn connectors(&self) -> Arc<HashMap<String, u32>> {
        self.connectors
            .get_or_init(|| {
                let mut out = HashMap::new();
                for bus in self.buses.values() {
                    for sub in &bus.subscriptions {
                        out.insert(sub.id.clone(), bus.log.shards());
                    }
                }
                for source in &self.sources {
                    out.insert(source.id.clone(), source.config.tasks());
                }
                for (id, failed) in &self.failed {
                    out.insert(id.clone(), failed.tasks);
                }
                Arc::new(out)
            })
            .clone()
    }

    /// Every task of the plan by task id.
    pub(crate) fn tasks(&self) -> BTreeMap<String, TaskKind> {
        let shards = self.buses.values().flat_map(|bus| {
            (0..bus.log.shards()).map(|shard| TaskKind::Shard {
                bus: bus.clone(),
                shard,
            })
        });
        let parts = self.sources.iter().flat_map(|source| {
            (0..source.config.tasks()).map(|index| TaskKind::Source {
                source: source.clone(),
                index,
            })
        });
        shards.chain(parts).map(|kind| (kind.id(), kind)).collect()
    }
}

/// What a task does: run one shard of a bus, or one part of a source.
#[derive(Clone)]
pub(crate) enum TaskKind {
    Shard { bus: Arc<BusPlan>, shard: u32 },
    Source { source: Arc<Source>, index: u32 },
}

impl TaskKind {
    /// The task's id: `bus/{bus}` or the source's id, and the shard or part.
    pub(crate) fn id(&self) -> String {
        match self {
            TaskKind::Shard { bus, shard } => shard_task_id(&bus.name, *shard),
            TaskKind::Source { source, index } => task_id(&source.id, *index),
        }
    }

    /// A digest of the task's definition: the task is updated (shard) or restarted
    /// (source) when it changes.
    pub(crate) fn digest(&self) -> u64 {
        match self {
            TaskKind::Shard { bus, .. } => bus.digest,
            TaskKind::Source { source, .. } => stable_hash(
                serde_json::to_string(&source.config)
                    .unwrap_or_default()
                    .as_bytes(),
            ),
        }
    }
}
