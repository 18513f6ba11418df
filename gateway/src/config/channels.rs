//! The channels: buses, rules, sources and webhook sources, as the configuration file and
//! the catalog hold them, with their checks (`Channels::check`, `check_policy`) and the key
//! of each in the catalog.

use std::collections::HashSet;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::store::DEFAULT_MAX_BACKLOG_AGE;
use crate::targets::config::TargetConfig;
use crate::values::{check_name, optional_duration, ser_optional_duration};

/// The kinds of resource the catalog holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bus,
    Rule,
    Source,
    Webhook,
    Function,
}

/// A resource that does not pass the checks: which one (its kind and index among the
/// channels), the field at fault as a JSON pointer inside it (`/targets/0/retry`), and why.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    pub kind: Kind,
    pub index: usize,
    pub pointer: String,
    pub message: String,
}

impl Invalid {
    fn new(kind: Kind, index: usize, pointer: &str, message: String) -> Invalid {
        Invalid {
            kind,
            index,
            pointer: pointer.to_string(),
            message,
        }
    }
}

/// The buses and rules of a configuration: what the cluster shares and versions.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Channels {
    #[serde(default)]
    pub buses: Vec<BusConfig>,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<crate::sources::SourceConfig>,
    /// Webhook sources kept in the catalog (admin API, `sluice ctl apply`), served by every
    /// replica; their secrets are `env:` references each replica reads. (A configuration
    /// file's own `[[webhooks]]` stay with the replica that reads it.)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub webhooks: Vec<crate::ingress::webhooks::config::WebhookConfig>,
    /// WebAssembly functions that transform chains call (`{ wasm = "name" }`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub functions: Vec<crate::wasm::FunctionConfig>,
}

impl Channels {
    /// Every check of buses, rules and sources the configuration loader makes: names are
    /// unique and valid, rules and sources name existing buses, patterns, filters,
    /// transforms and targets compile. The error names the resource and, as a JSON
    /// pointer inside it, the field at fault.
    pub fn check(&self) -> Result<(), Invalid> {
        let mut functions = HashSet::new();
        for (index, function) in self.functions.iter().enumerate() {
            let name = function.name.as_str();
            let bad = |pointer: &str, message: String| {
                Invalid::new(
                    Kind::Function,
                    index,
                    pointer,
                    format!("function `{name}`: {message}"),
                )
            };
            function.check().map_err(|(pointer, m)| bad(pointer, m))?;
            if !functions.insert(name) {
                return Err(bad("/name", "is defined twice".to_string()));
            }
        }
        let mut buses = HashSet::new();
        for (index, bus) in self.buses.iter().enumerate() {
            let name = bus.name.get_ref();
            let bad =
                |pointer: &str, message: String| Invalid::new(Kind::Bus, index, pointer, message);
            check_name(name).map_err(|m| bad("/name", format!("bus name: {m}")))?;
            if !buses.insert(name.as_str()) {
                return Err(bad("/name", format!("bus `{name}` is defined twice")));
            }
            if let Some(limit) = &bus.rate_limit {
                limit
                    .check()
                    .map_err(|m| bad("/rate_limit", format!("bus `{name}`: {m}")))?;
            }
            if let Some(auth) = &bus.auth {
                // Not resolved here: a variable missing on this replica closes that bus
                // here, it does not refuse every change to the catalog (see `admission`).
                auth.check()
                    .map_err(|m| bad("/auth", format!("bus `{name}`: {m}")))?;
            }
            if let Some(aws) = &bus.aws {
                aws.check()
                    .map_err(|m| bad("/aws", format!("bus `{name}`: {m}")))?;
            }
            if bus.shards == 0 || bus.shards > 1024 {
                return Err(bad(
                    "/shards",
                    format!("bus `{name}`: shards must be between 1 and 1024"),
                ));
            }
            if bus
                .max_backlog_age
                .is_some_and(|a| a < Duration::from_secs(1))
            {
                return Err(bad(
                    "/max_backlog_age",
                    format!(
                        "bus `{name}`: max_backlog_age must be at least 1s (leave it out for the default of 168h)"
                    ),
                ));
            }
            if bus.retention_bytes == Some(0) {
                return Err(bad(
                    "/retention_bytes",
                    format!(
                        "bus `{name}`: retention_bytes must be at least 1 (leave it out for none)"
                    ),
                ));
            }
        }
        let mut rules = HashSet::new();
        for (index, rule) in self.rules.iter().enumerate() {
            let name = rule.name.get_ref();
            let bad =
                |pointer: &str, message: String| Invalid::new(Kind::Rule, index, pointer, message);
            check_name(name).map_err(|m| bad("/name", format!("rule name: {m}")))?;
            if !rules.insert((rule.bus.get_ref().as_str(), name.as_str())) {
                return Err(bad(
                    "/name",
                    format!(
                        "rule `{name}` is defined twice on bus `{}`",
                        rule.bus.get_ref()
                    ),
                ));
            }
            if !buses.contains(rule.bus.get_ref().as_str()) {
                return Err(bad(
                    "/bus",
                    format!(
                        "rule `{name}` names bus `{}`, which is not defined",
                        rule.bus.get_ref()
                    ),
                ));
            }
            crate::rules::Filter::compile_located(
                rule.pattern.as_ref().map(Spanned::get_ref),
                rule.filter.as_ref().map(|f| f.get_ref().as_str()),
            )
            .map_err(|(pointer, m)| bad(&pointer, format!("rule `{name}`: {m}")))?;
            if rule.targets.is_empty() {
                return Err(bad("/targets", format!("rule `{name}` has no targets")));
            }
            let mut targets = HashSet::new();
            for (i, target) in rule.targets.iter().enumerate() {
                let target_name = target.name();
                let at = |field: &str| format!("/targets/{i}{field}");
                check_name(target_name)
                    .map_err(|m| bad(&at("/name"), format!("rule `{name}`: target name: {m}")))?;
                if !targets.insert(target_name) {
                    return Err(bad(
                        &at("/name"),
                        format!("rule `{name}`: target `{target_name}` is defined twice"),
                    ));
                }
                if let Some(spec) = target.transform() {
                    let chain = crate::rules::compile_transform(spec).map_err(|m| {
                        bad(
                            &at("/transform"),
                            format!("rule `{name}`, target `{target_name}`: {m}"),
                        )
                    })?;
                    let missing = chain
                        .functions()
                        .find(|f| !self.functions.iter().any(|d| d.name == *f))
                        .map(str::to_string);
                    if let Some(f) = missing {
                        return Err(bad(
                            &at("/transform"),
                            format!(
                                "rule `{name}`, target `{target_name}`: function `{f}` is not defined (add it to `functions`)"
                            ),
                        ));
                    }
                }
                if let TargetConfig::File(file) = target {
                    if file.path.trim().is_empty() {
                        return Err(bad(
                            &at("/path"),
                            format!("rule `{name}`: file target `{target_name}`: `path` is empty"),
                        ));
                    }
                }
                crate::targets::config::check(target, &buses).map_err(|m| {
                    bad(
                        &at(""),
                        format!("rule `{name}`: target `{target_name}`: {m}"),
                    )
                })?;
            }
        }
        let mut sources = HashSet::new();
        for (index, source) in self.sources.iter().enumerate() {
            let name = source.name();
            let bad = |pointer: &str, message: String| {
                Invalid::new(
                    Kind::Source,
                    index,
                    pointer,
                    format!("source `{name}`: {message}"),
                )
            };
            check_name(name).map_err(|m| bad("/name", m))?;
            if !sources.insert(name) {
                return Err(bad("/name", "is defined twice".to_string()));
            }
            if !buses.contains(source.bus()) {
                return Err(bad(
                    "/bus",
                    format!("bus `{}` is not defined", source.bus()),
                ));
            }
            source.check().map_err(|m| bad("", m))?;
        }
        let mut webhooks = HashSet::new();
        for (index, hook) in self.webhooks.iter().enumerate() {
            let name = hook.name.get_ref();
            let bad = |pointer: &str, message: String| {
                Invalid::new(
                    Kind::Webhook,
                    index,
                    pointer,
                    format!("webhook `{name}`: {message}"),
                )
            };
            check_name(name).map_err(|m| bad("/name", m))?;
            if !webhooks.insert(name.as_str()) {
                return Err(bad("/name", "is defined twice".to_string()));
            }
            if !buses.contains(hook.bus.as_str()) {
                return Err(bad("/bus", format!("bus `{}` is not defined", hook.bus)));
            }
            crate::ingress::webhooks::check::check_catalog(hook)
                .map_err(|(pointer, m)| bad(&pointer, m))?;
        }
        Ok(())
    }

    /// The operator's policy for what catalog resources may hold and reach (see
    /// `targets::check_policy`): secrets only as `env:` references to exposed variables
    /// (bus keys may also be `sha256:` digests), file targets under the allowed roots,
    /// http and function targets not at refused addresses. Only the resources whose
    /// catalog key (`catalog::rule_key`, ...) `changed` accepts are checked: a catalog
    /// stored before the policy keeps loading, and one old resource does not stop every
    /// later change (it fails where it is built instead).
    pub fn check_policy(
        &self,
        policy: &crate::targets::TargetPolicy,
        changed: &dyn Fn(&str) -> bool,
    ) -> Result<(), Invalid> {
        let prefix = policy.secret_env_prefix.as_str();
        for (index, bus) in self.buses.iter().enumerate() {
            let name = bus.name.get_ref();
            if let Some(aws) = bus.aws.as_ref().filter(|_| changed(&bus_key(name))) {
                aws.check_policy(prefix).map_err(|(pointer, m)| {
                    Invalid::new(Kind::Bus, index, &pointer, format!("bus `{name}`: {m}"))
                })?;
            }
            let Some(auth) = bus.auth.as_ref().filter(|_| changed(&bus_key(name))) else {
                continue;
            };
            for (i, key) in auth.keys.iter().enumerate() {
                crate::ingress::auth::check_key_ref(key, prefix).map_err(|m| {
                    Invalid::new(
                        Kind::Bus,
                        index,
                        &format!("/auth/keys/{i}"),
                        format!("bus `{name}`: auth.keys[{i}]: {m}"),
                    )
                })?;
            }
        }
        for (index, rule) in self.rules.iter().enumerate() {
            let name = rule.name.get_ref();
            if !changed(&rule_key(rule.bus.get_ref(), name)) {
                continue;
            }
            for (i, target) in rule.targets.iter().enumerate() {
                crate::targets::check_policy(policy, target).map_err(|(pointer, m)| {
                    Invalid::new(
                        Kind::Rule,
                        index,
                        &format!("/targets/{i}{pointer}"),
                        format!("rule `{name}`: target `{}`: {m}", target.name()),
                    )
                })?;
            }
        }
        for (index, hook) in self.webhooks.iter().enumerate() {
            let name = hook.name.get_ref();
            if !changed(&webhook_key(name)) {
                continue;
            }
            crate::ingress::webhooks::check::check_catalog_policy(hook, prefix).map_err(
                |(pointer, m)| {
                    Invalid::new(
                        Kind::Webhook,
                        index,
                        &pointer,
                        format!("webhook `{name}`: {m}"),
                    )
                },
            )?;
        }
        Ok(())
    }

    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    pub fn from_toml(text: &str) -> Result<Channels, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

/// The key of a resource in the version map (and in `ctl` output).
pub fn bus_key(name: &str) -> String {
    format!("bus/{name}")
}

pub fn rule_key(bus: &str, name: &str) -> String {
    format!("rule/{bus}/{name}")
}

pub fn source_key(name: &str) -> String {
    format!("source/{name}")
}

pub fn webhook_key(name: &str) -> String {
    format!("webhook/{name}")
}

pub fn function_key(name: &str) -> String {
    format!("function/{name}")
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BusConfig {
    pub name: Spanned<String>,
    /// Number of shards; fixed once the bus has stored events.
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// Opt-in: a CloudEvent whose `source` + `id` this bus already stored within this
    /// window is answered as a duplicate and not stored again.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "ser_optional_duration"
    )]
    pub dedup_window: Option<Duration>,
    /// Opt-in: producers must present one of these keys (`Authorization: Bearer` or
    /// `X-API-Key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<crate::ingress::auth::AuthConfig>,
    /// Opt-in: requests per second this bus takes (token bucket, shared by the cluster);
    /// more are answered `429` with `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
    /// Opt-in: keep events this long after acceptance even once every subscription has
    /// passed them, so they can be replayed (`POST /api/v1/buses/{bus}/replays`).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "ser_optional_duration"
    )]
    pub retention: Option<Duration>,
    /// Opt-in: keep up to this many bytes of passed events per bus (split evenly among its
    /// shards; the newest are kept). With `retention` too, an event goes once either
    /// bound passes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_bytes: Option<u64>,
    /// The oldest an event may get while a subscription has not delivered it yet (paused,
    /// failing with no dead-letter destination, far behind): past it the subscription
    /// skips the event, counted in `sluice_events_expired_total` and logged, so one stuck
    /// subscription cannot hold the log until Redis's memory or the disk runs out. Left
    /// out: [`DEFAULT_MAX_BACKLOG_AGE`]. Keep it above the targets' `retry.max_event_age`
    /// (24 h by default), so failing deliveries are dead-lettered before they expire.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "ser_optional_duration"
    )]
    pub max_backlog_age: Option<Duration>,
    /// Opt-in: AWS EventBridge PutEvents settings (SigV4 access keys, `account`, `region`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub aws: Option<crate::ingress::compat::aws::config::AwsConfig>,
}

impl BusConfig {
    /// The bus's `max_backlog_age`, or the default.
    pub fn max_backlog_age(&self) -> Duration {
        self.max_backlog_age.unwrap_or(DEFAULT_MAX_BACKLOG_AGE)
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    pub name: Spanned<String>,
    pub bus: Spanned<String>,
    /// Event pattern (EventBridge pattern language; see functions/README.md). Absent or
    /// empty matches every event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pattern: Option<Spanned<toml::Table>>,
    /// CESQL filter expression, instead of a pattern.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<Spanned<String>>,
    pub targets: Vec<TargetConfig>,
}

fn default_shards() -> u32 {
    4
}
