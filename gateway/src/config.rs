//! The configuration file (TOML) and its `SLUICE_*` environment overrides.
//!
//! Every struct denies unknown fields, so a typo is an error that names the key and the
//! line instead of a silently ignored setting.

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};
use toml::Spanned;

/// Errors found while loading or checking a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}:{line}: {message}")]
    Invalid {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the HTTP ingress listens on.
    #[serde(default = "defaults::listen")]
    pub listen: SocketAddr,
    /// Where the embedded store keeps bus logs, positions and configuration.
    #[serde(default = "defaults::data_dir")]
    pub data_dir: PathBuf,
    /// Log filter, in `tracing` env-filter syntax (`info`, `sluice=debug,warn`).
    #[serde(default = "defaults::log")]
    pub log: String,
    /// Log line format.
    #[serde(default)]
    pub log_format: LogFormat,
    #[serde(default)]
    pub mode: Mode,
    /// Redis of the cluster (distributed mode), e.g. `redis://127.0.0.1:6379/0`.
    #[serde(default)]
    pub redis_url: Option<String>,
    /// Prefix of every Redis key, so several clusters can share one Redis.
    #[serde(default = "defaults::redis_prefix")]
    pub redis_prefix: String,
    /// This worker's stable id; by default generated once and kept in the data directory.
    #[serde(default)]
    pub worker_id: Option<String>,
    #[serde(default)]
    pub cluster: ClusterConfig,
    #[serde(default)]
    pub durability: Durability,
    #[serde(default)]
    pub limits: Limits,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub delivery: DeliveryConfig,
    #[serde(default)]
    pub buses: Vec<BusConfig>,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// Source connectors that feed buses (besides HTTP ingress).
    #[serde(default)]
    pub sources: Vec<crate::sources::SourceConfig>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// One process, embedded on-disk store, no external services.
    #[default]
    Standalone,
    /// Any number of replicas sharing one Redis: bus logs, positions, leases, membership,
    /// status and configuration live there.
    Distributed,
}

/// Timing of the distributed runtime.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// How often a worker announces it is alive.
    #[serde(deserialize_with = "duration")]
    pub heartbeat_interval: Duration,
    /// A worker silent for this long is gone and its tasks move.
    #[serde(deserialize_with = "duration")]
    pub member_ttl: Duration,
    /// A task lease lapses this long after its last renewal.
    #[serde(deserialize_with = "duration")]
    pub lease_ttl: Duration,
    /// The rebalance tick (besides every change notice).
    #[serde(deserialize_with = "duration")]
    pub rebalance_interval: Duration,
    pub strategy: crate::runtime::rebalance::Strategy,
    /// Timeout of every Redis call.
    #[serde(deserialize_with = "duration")]
    pub redis_timeout: Duration,
    /// The longest a shard reader's blocking read (`XREAD BLOCK`) waits for new events
    /// before it asks again: one round trip per owned shard per interval while idle. New
    /// events are seen as soon as they are appended whatever this is.
    #[serde(deserialize_with = "duration")]
    pub poll_interval: Duration,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            heartbeat_interval: Duration::from_millis(500),
            member_ttl: Duration::from_millis(1500),
            lease_ttl: Duration::from_millis(1500),
            rebalance_interval: Duration::from_secs(1),
            strategy: crate::runtime::rebalance::Strategy::default(),
            redis_timeout: Duration::from_secs(2),
            poll_interval: Duration::from_secs(1),
        }
    }
}

/// When an accepted event counts as stored.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Durability {
    /// `202` only after the log is fsynced (group commit: concurrent appends share one flush).
    #[default]
    Fsync,
    /// `202` once the OS has the write; survives a process crash, not a power loss.
    Os,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest single event, in bytes of its structured JSON form (EventBridge: 256 KiB).
    pub max_event_bytes: usize,
    /// Most entries in one batch-mode request.
    pub max_batch_events: usize,
    /// Largest batch-mode request body.
    pub max_batch_bytes: usize,
    /// Largest request head (request line and headers).
    pub max_header_bytes: usize,
    /// Time to receive the whole request and answer it.
    #[serde(deserialize_with = "duration")]
    pub request_timeout: Duration,
    /// Time a kept-alive connection may sit without a new request.
    #[serde(deserialize_with = "duration")]
    pub idle_timeout: Duration,
    /// Requests served at once; more are shed with `503` at once rather than queued.
    pub max_concurrent_requests: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_event_bytes: 256 * 1024,
            max_batch_events: 100,
            max_batch_bytes: 1024 * 1024,
            max_header_bytes: 16 * 1024,
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_concurrent_requests: 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// A shard's log rolls to a new segment file past this size.
    pub segment_bytes: u64,
    /// Bytes of recent events kept in memory per shard, so deliveries that keep up with
    /// ingest never read the files.
    pub cache_bytes: usize,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            segment_bytes: 64 * 1024 * 1024,
            cache_bytes: 8 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Most events a task reads and hands to its target at once.
    pub batch_size: usize,
    /// How long a task lets new events gather after being woken, so that under load it
    /// delivers batches instead of single events (costs this much delivery latency).
    #[serde(deserialize_with = "duration")]
    pub linger: Duration,
    /// How often delivered positions are committed to the store.
    #[serde(deserialize_with = "duration")]
    pub commit_interval: Duration,
    /// First wait after a failed delivery; doubles up to `max_backoff`.
    #[serde(deserialize_with = "duration")]
    pub initial_backoff: Duration,
    #[serde(deserialize_with = "duration")]
    pub max_backoff: Duration,
}

impl Default for DeliveryConfig {
    fn default() -> Self {
        DeliveryConfig {
            batch_size: 256,
            linger: Duration::from_millis(2),
            commit_interval: Duration::from_millis(200),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BusConfig {
    pub name: Spanned<String>,
    /// Number of shards; fixed once the bus has stored events.
    #[serde(default = "defaults::shards")]
    pub shards: u32,
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

/// Where a rule sends the events it matched.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum TargetConfig {
    /// Writes each event as one JSON line to standard output.
    Log(LogTargetConfig),
    /// Appends each event as one JSON line (structured mode) to a file.
    File(FileTargetConfig),
    /// Sends each event as a message to a RocketMQ topic.
    Rocketmq(crate::targets::rocketmq::RocketMqConfig),
    /// POSTs each event to an HTTP endpoint (signed webhooks, auth, limits).
    Http(crate::targets::http::HttpConfig),
    /// Adds each event to a Redis stream (XADD with MAXLEN).
    RedisStream(crate::targets::redis_stream::RedisStreamConfig),
    /// Puts each event on another bus.
    Bus(crate::targets::bus::BusTargetConfig),
    /// POSTs each event to a function; a CloudEvent reply goes back onto a bus.
    Function(crate::targets::function::FunctionConfig),
}

impl TargetConfig {
    pub fn name(&self) -> &str {
        match self {
            TargetConfig::Log(t) => &t.name,
            TargetConfig::File(t) => &t.name,
            TargetConfig::Rocketmq(t) => &t.name,
            TargetConfig::Http(t) => &t.name,
            TargetConfig::RedisStream(t) => &t.name,
            TargetConfig::Bus(t) => &t.name,
            TargetConfig::Function(t) => &t.name,
        }
    }

    /// The transform chain applied to events before this target (a step or a list).
    pub fn transform(&self) -> Option<&toml::Value> {
        match self {
            TargetConfig::Log(t) => t.transform.as_ref(),
            TargetConfig::File(t) => t.transform.as_ref(),
            TargetConfig::Rocketmq(t) => t.transform.as_ref(),
            TargetConfig::Http(t) => t.transform.as_ref(),
            TargetConfig::RedisStream(t) => t.transform.as_ref(),
            TargetConfig::Bus(t) => t.transform.as_ref(),
            TargetConfig::Function(t) => t.transform.as_ref(),
        }
    }

    /// The target's retry policy and dead-letter destination (defaults for targets without).
    pub fn delivery(&self) -> (RetryConfig, Option<&DeadLetterConfig>) {
        let (retry, dead_letter) = match self {
            TargetConfig::Log(_) | TargetConfig::File(_) => return (RetryConfig::default(), None),
            TargetConfig::Rocketmq(t) => (&t.retry, &t.dead_letter),
            TargetConfig::Http(t) => (&t.retry, &t.dead_letter),
            TargetConfig::RedisStream(t) => (&t.retry, &t.dead_letter),
            TargetConfig::Bus(t) => (&t.retry, &t.dead_letter),
            TargetConfig::Function(t) => (&t.retry, &t.dead_letter),
        };
        (retry.clone(), dead_letter.as_ref())
    }
}

pub use crate::runtime::delivery::{DeadLetterConfig, RetryConfig};

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogTargetConfig {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileTargetConfig {
    pub name: String,
    /// The file; `{data_dir}` is replaced by the data directory.
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

mod defaults {
    use std::net::SocketAddr;
    use std::path::PathBuf;

    pub(super) fn listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 8080))
    }
    pub(super) fn data_dir() -> PathBuf {
        PathBuf::from("./data")
    }
    pub(super) fn log() -> String {
        "info".to_string()
    }
    pub(super) fn shards() -> u32 {
        4
    }
    pub(super) fn redis_prefix() -> String {
        "sluice".to_string()
    }
}

/// Parses `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (examples: 250ms, 30s, 5m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit `{other}` (use ms, s, m or h)"
            ))
        }
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(format!("`{text}` is not a duration"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

pub(crate) fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Seconds(u64),
        Text(String),
    }
    match Raw::deserialize(deserializer)? {
        Raw::Seconds(s) => Ok(Duration::from_secs(s)),
        Raw::Text(t) => parse_duration(&t).map_err(serde::de::Error::custom),
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Durability::Fsync => "fsync",
            Durability::Os => "os",
        })
    }
}

impl FromStr for Durability {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fsync" => Ok(Durability::Fsync),
            "os" => Ok(Durability::Os),
            other => Err(format!("unknown durability `{other}` (fsync or os)")),
        }
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "standalone" => Ok(Mode::Standalone),
            "distributed" => Ok(Mode::Distributed),
            other => Err(format!(
                "unknown mode `{other}` (standalone or distributed)"
            )),
        }
    }
}

/// The buses and rules of a configuration: what the cluster shares and versions.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Channels {
    #[serde(default)]
    pub buses: Vec<BusConfig>,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sources: Vec<crate::sources::SourceConfig>,
}

impl Channels {
    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string(self).map_err(|e| e.to_string())
    }

    pub fn from_toml(text: &str) -> Result<Channels, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }
}

impl FromStr for LogFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!("unknown log format `{other}` (text or json)")),
        }
    }
}

/// The top-level keys that `SLUICE_<KEY>` environment variables may override.
pub const ENV_KEYS: &[&str] = &[
    "listen",
    "data_dir",
    "log",
    "log_format",
    "mode",
    "durability",
];

impl Config {
    /// Reads, parses, applies environment overrides and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Config::parse(path, &text)?;
        config.apply_env(std::env::vars())?;
        config.check(path, &text)?;
        Ok(config)
    }

    /// Parses TOML text. Unknown keys and bad values name the key and the line.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: e.to_string().trim_end().to_string(),
        })
    }

    /// Applies `SLUICE_<KEY>` overrides of top-level keys. Returns the unknown `SLUICE_*`
    /// variables so the caller can warn about them.
    pub fn apply_env(
        &mut self,
        vars: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Vec<String>, ConfigError> {
        let mut unknown = Vec::new();
        for (var, value) in vars {
            let Some(key) = var.strip_prefix("SLUICE_") else {
                continue;
            };
            let key = key.to_ascii_lowercase();
            let bad = |message: String| ConfigError::Env {
                var: var.clone(),
                message,
            };
            match key.as_str() {
                "listen" => {
                    self.listen = value
                        .parse()
                        .map_err(|e| bad(format!("`{value}` is not a socket address: {e}")))?
                }
                "data_dir" => self.data_dir = PathBuf::from(value),
                "log" => self.log = value,
                "log_format" => self.log_format = value.parse().map_err(bad)?,
                "mode" => self.mode = value.parse().map_err(bad)?,
                "durability" => self.durability = value.parse().map_err(bad)?,
                "redis_url" => self.redis_url = Some(value),
                "redis_prefix" => self.redis_prefix = value,
                "worker_id" => self.worker_id = Some(value),
                // Read by the CLI itself, not a configuration key.
                "config" => {}
                _ => unknown.push(var.clone()),
            }
        }
        Ok(unknown)
    }

    /// Cross-field checks: names are unique and valid, rules name existing buses, limits
    /// are sane. `text` is the file's contents, for line numbers.
    pub fn check(&self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let invalid = |span: std::ops::Range<usize>, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: line_of(text, span.start),
            message,
        };
        if self.mode == Mode::Distributed && self.redis_url.is_none() {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "mode"),
                message: "mode = \"distributed\" needs `redis_url` (or SLUICE_REDIS_URL)"
                    .to_string(),
            });
        }
        if let Some(id) = &self.worker_id {
            check_name(id).map_err(|m| ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "worker_id"),
                message: format!("worker_id: {m}"),
            })?;
        }
        let c = &self.cluster;
        if c.member_ttl <= c.heartbeat_interval || c.lease_ttl <= c.heartbeat_interval {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "[cluster]"),
                message: "cluster.member_ttl and cluster.lease_ttl must be longer than cluster.heartbeat_interval".to_string(),
            });
        }
        let mut buses = HashSet::new();
        for bus in &self.buses {
            check_name(bus.name.get_ref())
                .map_err(|m| invalid(bus.name.span(), format!("bus name: {m}")))?;
            if !buses.insert(bus.name.get_ref().as_str()) {
                return Err(invalid(
                    bus.name.span(),
                    format!("bus `{}` is defined twice", bus.name.get_ref()),
                ));
            }
            if bus.shards == 0 || bus.shards > 1024 {
                return Err(invalid(
                    bus.name.span(),
                    format!(
                        "bus `{}`: shards must be between 1 and 1024",
                        bus.name.get_ref()
                    ),
                ));
            }
        }
        let mut rules = HashSet::new();
        for rule in &self.rules {
            check_name(rule.name.get_ref())
                .map_err(|m| invalid(rule.name.span(), format!("rule name: {m}")))?;
            if !rules.insert((rule.bus.get_ref().as_str(), rule.name.get_ref().as_str())) {
                return Err(invalid(
                    rule.name.span(),
                    format!(
                        "rule `{}` is defined twice on bus `{}`",
                        rule.name.get_ref(),
                        rule.bus.get_ref()
                    ),
                ));
            }
            if !buses.contains(rule.bus.get_ref().as_str()) {
                return Err(invalid(
                    rule.bus.span(),
                    format!(
                        "rule `{}` names bus `{}`, which is not defined",
                        rule.name.get_ref(),
                        rule.bus.get_ref()
                    ),
                ));
            }
            let at = rule
                .pattern
                .as_ref()
                .map(Spanned::span)
                .or_else(|| rule.filter.as_ref().map(Spanned::span))
                .unwrap_or_else(|| rule.name.span());
            crate::rules::Filter::compile(
                rule.pattern.as_ref().map(Spanned::get_ref),
                rule.filter.as_ref().map(|f| f.get_ref().as_str()),
            )
            .map_err(|m| invalid(at, format!("rule `{}`: {m}", rule.name.get_ref())))?;
            if rule.targets.is_empty() {
                return Err(invalid(
                    rule.name.span(),
                    format!("rule `{}` has no targets", rule.name.get_ref()),
                ));
            }
            let mut targets = HashSet::new();
            for target in &rule.targets {
                // Targets sit in a tagged table whose spans serde does not keep: point at the rule.
                let at = rule.name.span();
                let name = target.name();
                check_name(name).map_err(|m| {
                    invalid(
                        at.clone(),
                        format!("rule `{}`: target name: {m}", rule.name.get_ref()),
                    )
                })?;
                if !targets.insert(name) {
                    return Err(invalid(
                        at,
                        format!(
                            "rule `{}`: target `{name}` is defined twice",
                            rule.name.get_ref()
                        ),
                    ));
                }
                if let Some(spec) = target.transform() {
                    crate::rules::compile_transform(spec).map_err(|m| {
                        invalid(
                            at.clone(),
                            format!("rule `{}`, target `{name}`: {m}", rule.name.get_ref()),
                        )
                    })?;
                }
                if let TargetConfig::File(file) = target {
                    if file.path.trim().is_empty() {
                        return Err(invalid(
                            at,
                            format!(
                                "rule `{}`: file target `{name}`: `path` is empty",
                                rule.name.get_ref()
                            ),
                        ));
                    }
                }
                crate::targets::check(target, &buses).map_err(|m| {
                    invalid(
                        at.clone(),
                        format!("rule `{}`: target `{name}`: {m}", rule.name.get_ref()),
                    )
                })?;
            }
        }
        let mut sources = HashSet::new();
        for source in &self.sources {
            let name = source.name();
            let at = find_line(text, "[[sources]]");
            let bad = |message: String| ConfigError::Invalid {
                path: path.to_path_buf(),
                line: at,
                message: format!("source `{name}`: {message}"),
            };
            check_name(name).map_err(&bad)?;
            if !sources.insert(name) {
                return Err(bad("is defined twice".to_string()));
            }
            if !buses.contains(source.bus()) {
                return Err(bad(format!("bus `{}` is not defined", source.bus())));
            }
            source.check().map_err(&bad)?;
        }
        let l = &self.limits;
        let limit = |what: &str| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: find_line(text, what),
            message: format!("limits.{what} must be greater than zero"),
        };
        for (value, name) in [
            (l.max_event_bytes, "max_event_bytes"),
            (l.max_batch_events, "max_batch_events"),
            (l.max_batch_bytes, "max_batch_bytes"),
            (l.max_concurrent_requests, "max_concurrent_requests"),
        ] {
            if value == 0 {
                return Err(limit(name));
            }
        }
        if l.max_header_bytes < 8192 {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "max_header_bytes"),
                message: "limits.max_header_bytes must be at least 8192".to_string(),
            });
        }
        if self.delivery.batch_size == 0 {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "batch_size"),
                message: "delivery.batch_size must be greater than zero".to_string(),
            });
        }
        Ok(())
    }

    pub fn channels(&self) -> Channels {
        Channels {
            buses: self.buses.clone(),
            rules: self.rules.clone(),
            sources: self.sources.clone(),
        }
    }

    /// Resolves `{data_dir}` in a path taken from the configuration.
    pub fn expand_path(&self, path: &str) -> PathBuf {
        PathBuf::from(path.replace("{data_dir}", &self.data_dir.to_string_lossy()))
    }
}

/// Bus, rule and target names become file names and keys: keep them to a safe alphabet.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 {
        return Err(format!("`{name}` must be 1 to 128 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || name.starts_with('.')
    {
        return Err(format!(
            "`{name}` may only contain ASCII letters, digits, `-`, `_` and `.`, and must not start with `.`"
        ));
    }
    Ok(())
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |t| t.matches('\n').count() + 1)
}

fn find_line(text: &str, key: &str) -> usize {
    text.lines()
        .position(|l| l.trim_start().starts_with(key))
        .map_or(1, |i| i + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Config, ConfigError> {
        let c = Config::parse(Path::new("t.toml"), text)?;
        c.check(Path::new("t.toml"), text)?;
        Ok(c)
    }

    #[test]
    fn defaults_apply() {
        let c = parse("").unwrap();
        assert_eq!(c.listen.port(), 8080);
        assert_eq!(c.durability, Durability::Fsync);
        assert_eq!(c.limits.max_event_bytes, 262144);
    }

    #[test]
    fn unknown_key_names_key_and_line() {
        let err = parse("listen = \"127.0.0.1:1\"\n\n[limits]\nmax_evnt_bytes = 3\n").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("line 4"), "{msg}");
        assert!(msg.contains("max_evnt_bytes"), "{msg}");
    }

    #[test]
    fn bad_value_names_line() {
        let err = parse("durability = \"sometimes\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 1") && err.contains("sometimes"), "{err}");
        let err = parse("[limits]\nrequest_timeout = \"3 fortnights\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("line 2") && err.contains("fortnights"),
            "{err}"
        );
    }

    #[test]
    fn unknown_target_field_is_rejected() {
        let text = "[[buses]]\nname = \"b\"\n[[rules]]\nname = \"r\"\nbus = \"b\"\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"x\"\nmode = 1\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains("mode"), "{err}");
    }

    #[test]
    fn rule_on_unknown_bus_names_line() {
        let text = "[[buses]]\nname = \"b\"\n[[rules]]\nname = \"r\"\nbus = \"nope\"\n[[rules.targets]]\ntype = \"log\"\nname = \"l\"\n";
        let err = parse(text).unwrap_err().to_string();
        assert!(err.contains("t.toml:5") && err.contains("nope"), "{err}");
    }

    #[test]
    fn env_overrides_top_level_keys() {
        let mut c = parse("").unwrap();
        let unknown = c
            .apply_env([
                ("SLUICE_LISTEN".to_string(), "127.0.0.1:9999".to_string()),
                ("SLUICE_DURABILITY".to_string(), "os".to_string()),
                ("SLUICE_BOGUS".to_string(), "1".to_string()),
                ("PATH".to_string(), "/bin".to_string()),
            ])
            .unwrap();
        assert_eq!(c.listen.port(), 9999);
        assert_eq!(c.durability, Durability::Os);
        assert_eq!(unknown, vec!["SLUICE_BOGUS".to_string()]);
        let err = c
            .apply_env([("SLUICE_LISTEN".to_string(), "nowhere".to_string())])
            .unwrap_err()
            .to_string();
        assert!(err.contains("SLUICE_LISTEN"), "{err}");
    }

    #[test]
    fn channels_round_trip_through_toml() {
        let text = "[[buses]]\nname = \"b\"\nshards = 2\n[[rules]]\nname = \"r\"\nbus = \"b\"\npattern = { type = [\"x\", \"y\"] }\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{data_dir}/out.jsonl\"\n";
        let c = parse(text).unwrap();
        let stored = c.channels().to_toml().unwrap();
        let back = Channels::from_toml(&stored).unwrap();
        assert_eq!(back.to_toml().unwrap(), stored);
        assert_eq!(back.buses[0].shards, 2);
        assert_eq!(back.rules[0].targets[0].name(), "f");
    }

    #[test]
    fn distributed_mode_needs_redis() {
        let err = parse("mode = \"distributed\"\n").unwrap_err().to_string();
        assert!(err.contains("redis_url"), "{err}");
        assert!(parse("mode = \"distributed\"\nredis_url = \"redis://127.0.0.1/\"\n[cluster]\nstrategy = \"consistent-hash\"\n").is_ok());
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1 parsec").is_err());
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("orders-v1.eu_west").is_ok());
        assert!(check_name("../etc").is_err());
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
    }
}
