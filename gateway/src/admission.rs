//! Admission of catalog changes: what the admin API checks, besides the configuration's own
//! checks, before it stores a change. The replica that takes the request must be able to
//! build every resource the change makes or alters, exactly as its runtime would (targets
//! built without their side effects, env references resolved, conditions and transforms
//! compiled, bus keys and webhook secrets read); and a bus name that comes back must keep
//! the shard count its log still in the store was placed by. Resources the change leaves
//! as they are are not checked again: a replica missing a variable that another resource
//! needs can still change everything else.
//!
//! A replica that later cannot build a resource (a variable missing on it only) does not
//! refuse the catalog: that resource fails alone there (see `app::build_plan`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;

use crate::catalog::{self, Snapshot};
use crate::config::{Channels, Config, Invalid, Kind};
use crate::store::redis::{Redis, RedisLog};
use crate::store::StoreError;

/// Where the logs of buses (and their shard counts) are kept.
pub enum Inventory {
    /// The data directory of a standalone gateway.
    Embedded(PathBuf),
    /// The cluster's Redis.
    Redis(Box<Redis>),
}

/// The checks of catalog changes on this replica.
pub struct Admission {
    config: Config,
    inventory: Inventory,
}

/// A change this replica refuses: the resource at fault (its kind and index in the catalog
/// after the change), the field and why. `conflict` when the change is refused for what
/// the store holds (`409`) rather than for what the resource says (`400`).
#[derive(Debug, Clone)]
pub struct Refusal {
    pub invalid: Invalid,
    pub conflict: bool,
}

/// How a message says where it was checked: a variable may be set on other replicas.
fn here(message: &str) -> String {
    if message.ends_with(" is not set") || message.ends_with(" is empty") {
        format!("{message} on the replica that took this request")
    } else {
        format!("{message} (checked on the replica that took this request)")
    }
}

impl Admission {
    pub fn new(config: Config, inventory: Inventory) -> Admission {
        Admission { config, inventory }
    }

    /// The shard counts of the logs the store still holds for these buses (name, shards
    /// the change gives it); buses without a log are left out. Read before the change is
    /// made, as the store is asked over the network.
    pub async fn stored_shards<'a>(
        &self,
        buses: impl IntoIterator<Item = (&'a str, u32)>,
    ) -> Result<HashMap<String, u32>, StoreError> {
        let mut stored = HashMap::new();
        for (bus, shards) in buses {
            let found = match &self.inventory {
                Inventory::Embedded(dir) => crate::store::embedded::bus_shards(dir, bus)?,
                Inventory::Redis(redis) => RedisLog::stored_shards(redis, bus, shards).await?,
            };
            if let Some(found) = found {
                stored.insert(bus.to_string(), found);
            }
        }
        Ok(stored)
    }

    /// Checks that this replica can build every resource of `after` whose key is among
    /// `keys` and that differs from `before` (new or changed), and that no bus comes back
    /// with another shard count than its stored log (`stored`, from `stored_shards`).
    pub fn check(
        &self,
        before: &Channels,
        after: &Channels,
        keys: &HashSet<String>,
        stored: &HashMap<String, u32>,
    ) -> Result<(), Refusal> {
        catalog::check_stored_shards(before, after, stored).map_err(|invalid| Refusal {
            invalid,
            conflict: true,
        })?;
        let old = Snapshot::resources_where(before, |key| keys.contains(key));
        let changed = |key: &String, json: &serde_json::Value| {
            keys.contains(key) && old.get(key) != Some(json)
        };
        let refuse = |kind: Kind, index: usize, pointer: String, message: String| Refusal {
            invalid: Invalid {
                kind,
                index,
                pointer,
                message,
            },
            conflict: false,
        };
        let prefix = self.config.admin.secret_env_prefix();
        for (index, bus) in after.buses.iter().enumerate() {
            let key = catalog::bus_key(bus.name.get_ref());
            if !keys.contains(&key) || !changed(&key, &json(bus)) {
                continue;
            }
            if let Some(auth) = &bus.auth {
                auth.resolve(prefix).map_err(|m| {
                    refuse(
                        Kind::Bus,
                        index,
                        crate::ingress::auth::AuthConfig::pointer_of(&m),
                        here(&format!("bus `{}`: {m}", bus.name.get_ref())),
                    )
                })?;
            }
        }
        let buses: HashSet<&str> = after
            .buses
            .iter()
            .map(|b| b.name.get_ref().as_str())
            .collect();
        for (index, rule) in after.rules.iter().enumerate() {
            let key = catalog::rule_key(rule.bus.get_ref(), rule.name.get_ref());
            if !keys.contains(&key) || !changed(&key, &json(rule)) {
                continue;
            }
            let name = rule.name.get_ref();
            crate::rules::Filter::compile_located(
                rule.pattern.as_ref().map(|p| p.get_ref()),
                rule.filter.as_ref().map(|f| f.get_ref().as_str()),
            )
            .map_err(|(pointer, m)| {
                refuse(Kind::Rule, index, pointer, format!("rule `{name}`: {m}"))
            })?;
            for (i, target) in rule.targets.iter().enumerate() {
                let target_name = target.name();
                if let Some(spec) = target.transform() {
                    crate::rules::compile_transform(spec).map_err(|m| {
                        refuse(
                            Kind::Rule,
                            index,
                            format!("/targets/{i}/transform"),
                            format!("rule `{name}`, target `{target_name}`: {m}"),
                        )
                    })?;
                }
                crate::targets::validate(&self.config.target_policy(), target, &buses).map_err(
                    |e| {
                        refuse(
                            Kind::Rule,
                            index,
                            format!("/targets/{i}{}", e.pointer),
                            here(&format!(
                                "rule `{name}`, target `{target_name}`: {}",
                                e.message
                            )),
                        )
                    },
                )?;
            }
        }
        for (index, source) in after.sources.iter().enumerate() {
            let key = catalog::source_key(source.name());
            if !keys.contains(&key) || !changed(&key, &json(source)) {
                continue;
            }
            // A source is built from its settings alone (the broker is reached once it runs).
            source.check().map_err(|m| {
                refuse(
                    Kind::Source,
                    index,
                    String::new(),
                    format!("source `{}`: {m}", source.name()),
                )
            })?;
        }
        for (index, hook) in after.webhooks.iter().enumerate() {
            let key = catalog::webhook_key(hook.name.get_ref());
            if !keys.contains(&key) || !changed(&key, &json(hook)) {
                continue;
            }
            crate::ingress::webhooks::check::check_secrets_here(hook, prefix).map_err(
                |(pointer, m)| {
                    refuse(
                        Kind::Webhook,
                        index,
                        pointer,
                        here(&format!("webhook `{}`: {m}", hook.name.get_ref())),
                    )
                },
            )?;
        }
        Ok(())
    }
}

fn json(resource: &impl serde::Serialize) -> serde_json::Value {
    serde_json::to_value(resource).unwrap_or(serde_json::Value::Null)
}

/// The keys of every resource of `channels` (the resources a request names).
pub fn keys_of(channels: &Channels) -> HashSet<String> {
    Snapshot::resources(channels).into_keys().collect()
}
