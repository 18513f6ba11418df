//! The configuration file (TOML) and its `SLUICE_*` environment overrides.
//!
//! Every struct denies unknown fields, so a typo is an error that names the key and the
//! line instead of a silently ignored setting.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

mod channels;
mod locate;

pub use channels::{
    bus_key, function_key, rule_key, source_key, webhook_key, BusConfig, Channels, Invalid, Kind,
    RuleConfig,
};
pub use locate::from_json;
use locate::{find_line, key_line, line_of, nested};

use crate::ingress::limits::Limits;
use crate::runtime::delivery::DeliveryConfig;
use crate::store::Durability;
use crate::targets::config::TargetsConfig;
use crate::values::{check_name, duration, redact_url, DEFAULT_SECRET_ENV_PREFIX};

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
    /// A Redis Cluster instead of one server (distributed mode): its seed nodes,
    /// `redis://host:port` (or `rediss://` for TLS). Names some nodes; the rest are found.
    #[serde(default)]
    pub redis_cluster_nodes: Option<Vec<String>>,
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
    /// The admin API (`/api/v1`): its credentials and, optionally, its own address.
    #[serde(default)]
    pub admin: AdminConfig,
    /// The admin API's own address: the same as `admin.listen` (one or the other).
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    /// `[targets]`: where catalog targets may write files and send requests.
    #[serde(default)]
    pub targets: TargetsConfig,
    /// `[tracing]`: span export over OTLP.
    #[serde(default)]
    pub tracing: TracingConfig,
    #[serde(default)]
    pub buses: Vec<BusConfig>,
    #[serde(default)]
    pub rules: Vec<RuleConfig>,
    /// Source connectors that feed buses (besides HTTP ingress).
    #[serde(default)]
    pub sources: Vec<crate::sources::SourceConfig>,
    /// Webhook sources (`POST /webhooks/{name}`). Each replica takes them from its own
    /// file: their secrets are not shared through the cluster store.
    #[serde(default)]
    pub webhooks: Vec<crate::ingress::webhooks::config::WebhookConfig>,
    /// WebAssembly functions (`path` relative to this file): stored by hash at start, they
    /// seed the catalog like buses and rules.
    #[serde(default)]
    pub functions: Vec<crate::wasm::FunctionConfig>,
    /// JSON Schemas of event data, per (bus, type) or by `dataschema`; files relative to
    /// this configuration file. Each replica takes them from its own file.
    #[serde(default)]
    pub schemas: Vec<crate::ingress::schema::SchemaConfig>,
    /// `[knative]`: which bus each Knative broker (`POST /{namespace}/{broker}`) feeds.
    #[serde(default)]
    pub knative: crate::ingress::compat::knative::KnativeConfig,
    /// The configuration file's directory (relative schema paths start there).
    #[serde(skip)]
    pub base_dir: PathBuf,
}

/// `[tracing]`: where the gateway's spans (`request`, `deliver`) go.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// An OTLP/HTTP collector's base address (`http://otel-collector:4318`): spans are
    /// posted to `{otlp_endpoint}/v1/traces`. Absent: no export. Needs the cargo feature
    /// `otlp` (on by default).
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Headers sent with each export (an API key of a hosted collector); `env:NAME` values
    /// are read from the environment.
    #[serde(default)]
    pub otlp_headers: std::collections::BTreeMap<String, String>,
    /// The `service.name` of the exported resource.
    #[serde(default = "defaults::service_name")]
    pub service_name: String,
    /// Share of new traces exported (0 to 1; default 1: all). A caller's `traceparent`
    /// decides for its own trace (its `sampled` flag).
    #[serde(default = "defaults::sample_ratio")]
    pub sample_ratio: f64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        TracingConfig {
            otlp_endpoint: None,
            otlp_headers: Default::default(),
            service_name: defaults::service_name(),
            sample_ratio: defaults::sample_ratio(),
        }
    }
}

/// Where spans go, checked and with the headers' `env:` values read.
#[derive(Debug, Clone)]
pub struct OtlpExport {
    pub endpoint: String,
    pub headers: Vec<(String, String)>,
}

impl TracingConfig {
    /// The export settings when export is on: the endpoint checked and the headers read.
    pub fn resolve(&self) -> Result<Option<OtlpExport>, String> {
        let Some(endpoint) = &self.otlp_endpoint else {
            return Ok(None);
        };
        if !cfg!(feature = "otlp") {
            return Err("tracing.otlp_endpoint: this build has no OTLP export (build with the cargo feature `otlp`, on by default)".to_string());
        }
        match url::Url::parse(endpoint) {
            Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => {}
            _ => {
                return Err(format!(
                    "tracing.otlp_endpoint must be an http(s) URL such as http://otel-collector:4318, not `{}`",
                    redact_url(endpoint)
                ))
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err("tracing.sample_ratio must be between 0 and 1".to_string());
        }
        let mut headers = Vec::new();
        for (name, value) in &self.otlp_headers {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(format!(
                    "tracing.otlp_headers: `{name}` is not a header name"
                ));
            }
            // The replica's own file: any variable, or the value as written.
            let value = crate::secrets::local_secret(value)
                .map_err(|e| format!("tracing.otlp_headers.{name}: {e}"))?;
            if http::HeaderValue::from_str(&value).is_err() {
                return Err(format!("tracing.otlp_headers.{name}: not a header value"));
            }
            headers.push((name.clone(), value));
        }
        Ok(Some(OtlpExport {
            endpoint: endpoint.clone(),
            headers,
        }))
    }
}

/// `[admin]`: who may use the admin API and where it listens.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    /// The admin API's own address; by default it is served on `listen` with the ingress.
    #[serde(default)]
    pub listen: Option<SocketAddr>,
    /// The accepted bearer tokens, as SHA-256 hashes (`sha256:<hex>`; `sluice ctl
    /// hash-token` prints one). `SLUICE_ADMIN_TOKEN` adds one token in clear. With none
    /// (and no `allow_local_without_token`), the gateway generates one at start-up, keeps
    /// it in `{data_dir}/admin-token` and prints it.
    #[serde(default)]
    pub tokens: Vec<String>,
    /// With no token configured, answer clients on loopback without one (development
    /// only: any local process, and any proxy on this host, can then change the catalog).
    /// Requests carrying proxy headers (`Forwarded`, `X-Forwarded-For`, `X-Real-IP`,
    /// `Via`) are still refused. Ignored when a token is configured.
    #[serde(default)]
    pub allow_local_without_token: bool,
    /// `Host` names the admin API answers besides the listen address and loopback names
    /// (`host` for any port, or `host:port`; `*` for any). Empty with a token configured:
    /// any `Host` (the token defeats DNS rebinding).
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Origins (`https://console.example.com`) allowed to send state-changing requests
    /// besides the admin API's own (the console served by this gateway).
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// The environment variables catalog resources may read as `env:NAME` secrets: those
    /// whose names start with this prefix (left out: `SLUICE_SECRET_`). The catalog is
    /// written through the admin API and shared by every replica, so a reference outside
    /// the prefix would let whoever writes a rule read any secret of any replica. `""`
    /// exposes every variable (unsafe: only where every catalog writer may read them all).
    #[serde(default)]
    pub secret_env_prefix: Option<String>,
}

impl AdminConfig {
    /// `secret_env_prefix`, or its default.
    pub fn secret_env_prefix(&self) -> &str {
        self.secret_env_prefix
            .as_deref()
            .unwrap_or(DEFAULT_SECRET_ENV_PREFIX)
    }
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
    /// When an append to a bus log in Redis is acknowledged (`202`): `primary` once the
    /// Redis primary holds it, `replicated` once `min_replicas` replicas do too (`WAIT`).
    pub redis_durability: RedisDurability,
    /// `redis_durability = "replicated"`: the replicas that must confirm an append.
    pub min_replicas: u32,
    /// `redis_durability = "replicated"`: how long an append waits for them before it is
    /// refused with `503` (nothing acknowledged).
    #[serde(deserialize_with = "duration")]
    pub replication_timeout: Duration,
}

/// `cluster.redis_durability`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisDurability {
    /// Acknowledged once the primary holds the append (Redis replicates asynchronously).
    #[default]
    Primary,
    /// Acknowledged once `min_replicas` replicas confirmed it too.
    Replicated,
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
            redis_durability: RedisDurability::Primary,
            min_replicas: 1,
            replication_timeout: Duration::from_secs(1),
        }
    }
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
            cache_bytes: 4 * 1024 * 1024,
        }
    }
}

mod defaults {
    use std::net::SocketAddr;
    use std::path::PathBuf;

    pub(super) fn service_name() -> String {
        "sluice".to_string()
    }

    pub(super) fn sample_ratio() -> f64 {
        1.0
    }

    pub(super) fn listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 8080))
    }
    pub(super) fn data_dir() -> PathBuf {
        PathBuf::from("./data")
    }
    pub(super) fn log() -> String {
        "info".to_string()
    }
    pub(super) fn redis_prefix() -> String {
        "sluice".to_string()
    }
}

crate::values::from_names!(
    Mode,
    "mode",
    "standalone" => Mode::Standalone,
    "distributed" => Mode::Distributed,
);
crate::values::from_names!(
    LogFormat,
    "log format",
    "text" => LogFormat::Text,
    "json" => LogFormat::Json,
);

impl Config {
    /// Reads, parses, applies environment overrides and checks a configuration file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(path, |_| {})
    }

    /// `load`, with the command line's overrides applied before the checks (file targets
    /// are checked against the data directory that will run).
    pub fn load_with(
        path: &Path,
        overrides: impl FnOnce(&mut Config),
    ) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut config = Config::parse(path, &text)?;
        config.apply_env(std::env::vars())?;
        overrides(&mut config);
        config.check(path, &text)?;
        Ok(config)
    }

    /// Parses TOML text. Unknown keys and bad values name the key and the line.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        let mut config: Config = toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_path_buf(),
            message: nested::locate(text, &e)
                .unwrap_or_else(|| e.to_string())
                .trim_end()
                .to_string(),
        })?;
        config.base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        match (config.admin_listen, config.admin.listen) {
            (Some(_), Some(_)) => {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    line: find_line(text, "admin_listen"),
                    message: "give `admin_listen` or `admin.listen`, not both".to_string(),
                })
            }
            (Some(addr), None) => config.admin.listen = Some(addr),
            _ => {}
        }
        Ok(config)
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
                "redis_cluster_nodes" => {
                    self.redis_cluster_nodes = Some(
                        value
                            .split(',')
                            .map(str::trim)
                            .filter(|n| !n.is_empty())
                            .map(str::to_string)
                            .collect(),
                    )
                }
                "redis_prefix" => self.redis_prefix = value,
                "worker_id" => self.worker_id = Some(value),
                "admin_listen" => {
                    self.admin.listen = Some(
                        value
                            .parse()
                            .map_err(|e| bad(format!("`{value}` is not a socket address: {e}")))?,
                    )
                }
                // Read by the CLI itself and by the admin API, not configuration keys.
                "config" | "admin_token" | "server" => {}
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
        self.tracing
            .resolve()
            .map_err(|message| ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "otlp_"),
                message,
            })?;
        self.check_redis(path, text)?;
        if let Some(id) = &self.worker_id {
            check_name(id).map_err(|m| ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "worker_id"),
                message: format!("worker_id: {m}"),
            })?;
        }
        self.check_durations(path, text)?;
        let c = &self.cluster;
        if c.member_ttl <= c.heartbeat_interval || c.lease_ttl <= c.heartbeat_interval {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "[cluster]"),
                message: "cluster.member_ttl and cluster.lease_ttl must be longer than cluster.heartbeat_interval".to_string(),
            });
        }
        for root in &self.targets.file_roots {
            if !root.is_absolute() {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    line: key_line(text, "targets", "file_roots"),
                    message: format!(
                        "targets.file_roots: `{}` is not an absolute path",
                        root.display()
                    ),
                });
            }
        }
        let channels = self.channels();
        let located = |e: Invalid| {
            let line = match e.kind {
                Kind::Bus => self
                    .buses
                    .get(e.index)
                    .map(|b| line_of(text, b.name.span().start)),
                Kind::Rule => self.rules.get(e.index).map(|rule| {
                    let span = if e.pointer.starts_with("/pattern") {
                        rule.pattern.as_ref().map(Spanned::span)
                    } else if e.pointer.starts_with("/filter") {
                        rule.filter.as_ref().map(Spanned::span)
                    } else if e.pointer == "/bus" {
                        Some(rule.bus.span())
                    } else {
                        None
                    };
                    line_of(text, span.unwrap_or_else(|| rule.name.span()).start)
                }),
                Kind::Source => Some(find_line(text, "[[sources]]")),
                // The file's webhook sources are checked below, not as channels.
                Kind::Webhook => None,
                Kind::Function => Some(find_line(text, "[[functions]]")),
            };
            ConfigError::Invalid {
                path: path.to_path_buf(),
                line: line.unwrap_or(1),
                message: e.message,
            }
        };
        channels.check().map_err(&located)?;
        for f in &self.functions {
            let Some(file) = &f.path else { continue };
            let full = self.base_dir.join(file);
            if !full.is_file() {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    line: find_line(text, "[[functions]]"),
                    message: format!(
                        "function `{}`: no component at {} (path is relative to this file)",
                        f.name,
                        full.display()
                    ),
                });
            }
        }
        // The file's resources seed the catalog: they follow its policy, so the operator
        // learns of a literal secret or a path outside the roots here, not from the API.
        channels
            .check_policy(&self.target_policy(), &|_| true)
            .map_err(located)?;
        let buses: HashSet<&str> = self
            .buses
            .iter()
            .map(|b| b.name.get_ref().as_str())
            .collect();
        crate::ingress::webhooks::check::check(&self.webhooks, &buses)
            .map_err(|(at, m)| invalid(at, m))?;
        for schema in &self.schemas {
            if !buses.contains(schema.bus.as_str()) {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    line: find_line(text, "[[schemas]]"),
                    message: format!("schemas: bus `{}` is not defined", schema.bus),
                });
            }
        }
        crate::ingress::schema::load(&self.schemas, &self.base_dir).map_err(|message| {
            ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "[[schemas]]"),
                message,
            }
        })?;
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
            (l.max_dedup_bytes, "max_dedup_bytes"),
        ] {
            if value == 0 {
                return Err(limit(name));
            }
        }
        // Stored, an event's data may grow by a third (base64) plus its attributes: 8 MiB
        // keeps every accepted event under the store's record limit.
        const MAX_EVENT_BYTES: usize = crate::store::MAX_RECORD_BYTES / 2;
        if l.max_event_bytes > MAX_EVENT_BYTES {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "max_event_bytes"),
                message: format!(
                    "limits.max_event_bytes must be at most {MAX_EVENT_BYTES} (8 MiB): stored events are bounded by the store's record limit"
                ),
            });
        }
        if l.max_inflight_bytes < 1024 * 1024 {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "max_inflight_bytes"),
                message: "limits.max_inflight_bytes must be at least 1048576 (1 MiB)".to_string(),
            });
        }
        if !(8192..=1024 * 1024).contains(&l.max_header_bytes) {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "max_header_bytes"),
                message: "limits.max_header_bytes must be between 8192 and 1048576 (1 MiB)"
                    .to_string(),
            });
        }
        if self.delivery.batch_size == 0 {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "batch_size"),
                message: "delivery.batch_size must be greater than zero".to_string(),
            });
        }
        if !(1024..=64 * 1024 * 1024).contains(&self.delivery.batch_bytes) {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: key_line(text, "delivery", "batch_bytes"),
                message: "delivery.batch_bytes must be between 1024 and 67108864 (64 MiB)"
                    .to_string(),
            });
        }
        Ok(())
    }

    /// Durations the runtime turns into timers and intervals: zero would panic
    /// (`tokio::time::interval`) or spin, so each must be positive.
    /// Where distributed mode keeps its state: one of `redis_url` and `redis_cluster_nodes`,
    /// each address valid, and a key prefix that cannot break hash tags or key patterns.
    fn check_redis(&self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let invalid = |key: &str, message: String| ConfigError::Invalid {
            path: path.to_path_buf(),
            line: find_line(text, key),
            message,
        };
        let nodes = self.redis_cluster_nodes.as_deref();
        if self.redis_url.is_some() && nodes.is_some() {
            return Err(invalid(
                "redis_cluster_nodes",
                "set `redis_url` (one Redis) or `redis_cluster_nodes` (a Redis Cluster), not both"
                    .to_string(),
            ));
        }
        if self.mode == Mode::Distributed && self.redis_url.is_none() && nodes.is_none() {
            return Err(invalid(
                "mode",
                "mode = \"distributed\" needs `redis_url` (or SLUICE_REDIS_URL), or `redis_cluster_nodes` (or SLUICE_REDIS_CLUSTER_NODES) for a Redis Cluster".to_string(),
            ));
        }
        if let Some(url) = &self.redis_url {
            redis::Client::open(url.as_str()).map_err(|e| {
                invalid("redis_url", format!("redis_url `{}`: {e}", redact_url(url)))
            })?;
        }
        if let Some(nodes) = nodes {
            if nodes.is_empty() {
                return Err(invalid(
                    "redis_cluster_nodes",
                    "redis_cluster_nodes must name at least one node".to_string(),
                ));
            }
            for node in nodes {
                redis::Client::open(node.as_str()).map_err(|e| {
                    invalid(
                        "redis_cluster_nodes",
                        format!("redis_cluster_nodes: `{}`: {e}", redact_url(node)),
                    )
                })?;
            }
        }
        let prefix = &self.redis_prefix;
        if prefix.is_empty()
            || !prefix
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':' | '/'))
        {
            return Err(invalid(
                "redis_prefix",
                format!("redis_prefix `{prefix}` may only contain ASCII letters, digits, `-`, `_`, `.`, `:` and `/` (it starts every key; braces would change hash slots)"),
            ));
        }
        let c = &self.cluster;
        if c.redis_durability == RedisDurability::Replicated
            && (c.min_replicas == 0 || c.replication_timeout.is_zero())
        {
            return Err(ConfigError::Invalid {
                path: path.to_path_buf(),
                line: key_line(text, "cluster", "min_replicas"),
                message: "cluster.redis_durability = \"replicated\" needs min_replicas >= 1 and a replication_timeout above zero".to_string(),
            });
        }
        Ok(())
    }

    fn check_durations(&self, path: &Path, text: &str) -> Result<(), ConfigError> {
        let (c, d, l) = (&self.cluster, &self.delivery, &self.limits);
        for (table, key, value) in [
            ("cluster", "heartbeat_interval", c.heartbeat_interval),
            ("cluster", "rebalance_interval", c.rebalance_interval),
            ("cluster", "poll_interval", c.poll_interval),
            ("cluster", "redis_timeout", c.redis_timeout),
            ("delivery", "commit_interval", d.commit_interval),
            ("delivery", "max_backoff", d.max_backoff),
            ("limits", "request_timeout", l.request_timeout),
            ("limits", "idle_timeout", l.idle_timeout),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Invalid {
                    path: path.to_path_buf(),
                    line: key_line(text, table, key),
                    message: format!("{table}.{key} must be greater than zero"),
                });
            }
        }
        Ok(())
    }

    /// Moves the buses, rules and sources out of the configuration (they only seed the
    /// catalog).
    pub fn take_channels(&mut self) -> Channels {
        Channels {
            buses: std::mem::take(&mut self.buses),
            rules: std::mem::take(&mut self.rules),
            sources: std::mem::take(&mut self.sources),
            webhooks: Vec::new(),
            functions: std::mem::take(&mut self.functions),
        }
    }

    pub fn channels(&self) -> Channels {
        Channels {
            buses: self.buses.clone(),
            rules: self.rules.clone(),
            sources: self.sources.clone(),
            webhooks: Vec::new(),
            functions: self.functions.clone(),
        }
    }

    /// The operator's policy for catalog targets, as this replica's configuration sets it.
    pub fn target_policy(&self) -> crate::targets::TargetPolicy {
        crate::targets::TargetPolicy {
            secret_env_prefix: self.admin.secret_env_prefix().to_string(),
            allow_private_egress: self.targets.allow_private_egress,
            data_dir: self.data_dir.clone(),
            file_roots: self.targets.file_roots.clone(),
            durability: self.durability,
        }
    }

    /// Resolves `{data_dir}` in a path taken from the configuration.
    pub fn expand_path(&self, path: &str) -> PathBuf {
        PathBuf::from(path.replace("{data_dir}", &self.data_dir.to_string_lossy()))
    }
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
    fn event_and_header_limits_are_bounded_by_the_store_record_limit() {
        let err = parse("[limits]\nmax_event_bytes = 9000000\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("t.toml:2:") && err.contains("limits.max_event_bytes must be at most"),
            "{err}"
        );
        assert!(parse("[limits]\nmax_event_bytes = 8388608\n").is_ok());
        let err = parse("[limits]\nmax_header_bytes = 2000000\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("limits.max_header_bytes"), "{err}");
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
        assert_eq!(back.buses[0].shards, 2);
        assert_eq!(back.rules[0].targets[0].name(), "f");
    }

    /// Replicas run the TOML stored in Redis, not their file: every setting of every kind of
    /// resource must come back from it with the value the file gave (compared as the values
    /// the file parsed to, not as one serialisation against another).
    #[test]
    fn every_setting_survives_the_stored_toml() {
        let text = r#"
[[buses]]
name = "orders"
shards = 3
dedup_window = "90s"
auth = { keys = ["env:SLUICE_SECRET_ORDERS_KEY", "sha256:a4ae87b73fa5645e6aee415a6f72be4dcbd99d057a7b40cb1b867c181d179260"] }

[[rules]]
name = "big"
bus = "orders"
filter = "type = 'order.created' AND EXISTS amount"

[[rules.targets]]
type = "http"
name = "hook"
url = "https://example.com/hooks?a=1"
transform = [{ form = "SET_ATTRIBUTES", attributes = { team = "billing" } }, { form = "JSONPATH", value = "$.data" }]
mode = "structured"
timeout = "7s"
headers = { x-team = "billing" }
rate_limit = 12.5
max_in_flight = 3
concurrent = true
circuit_breaker = { failures = 4, open_for = "45s" }
auth = { type = "bearer", token = "env:SLUICE_SECRET_HOOK_TOKEN" }
[rules.targets.retry]
max_attempts = 9
max_event_age = "90s"
initial_backoff = "15ms"
max_backoff = "2m"
[rules.targets.dead_letter]
bus = "dead"

[[rules.targets]]
type = "rocketmq"
name = "mq"
name_server = "127.0.0.1:9876"
topic = "orders"
tag = "big"
max_batch = 17
[rules.targets.dead_letter.target]
type = "file"
name = "dead-file"
path = "{data_dir}/dead.jsonl"

[[rules.targets]]
type = "redis-stream"
name = "stream"
url = "redis://127.0.0.1:6379/2"
stream = "s"
maxlen = 321

[[rules]]
name = "all"
bus = "orders"
pattern = { source = [{ prefix = "/shop" }], data = { total = [{ numeric = [">", 5] }] } }

[[rules.targets]]
type = "bus"
name = "copy"
bus = "dead"

[[buses]]
name = "dead"
shards = 1

[[sources]]
type = "rocketmq"
name = "mq-in"
name_server = "127.0.0.1:9876"
topic = "legacy"
bus = "orders"
wrap_type = "com.example.legacy"
tasks = 2
"#;
        let c = parse(text).unwrap();
        let original = serde_json::to_value(c.channels()).unwrap();
        let stored = c.channels().to_toml().unwrap();
        let back = Channels::from_toml(&stored).unwrap();
        assert_eq!(serde_json::to_value(&back).unwrap(), original, "{stored}");
        // And the values are the file's, not defaults that happen to agree.
        let hook = &original["rules"][0]["targets"][0];
        for (pointer, want) in [
            ("/timeout", serde_json::json!("7000ms")),
            ("/rate_limit", serde_json::json!(12.5)),
            ("/max_in_flight", serde_json::json!(3)),
            ("/concurrent", serde_json::json!(true)),
            ("/retry/max_attempts", serde_json::json!(9)),
            ("/retry/max_event_age", serde_json::json!("90000ms")),
            ("/retry/initial_backoff", serde_json::json!("15ms")),
            ("/dead_letter/bus", serde_json::json!("dead")),
            ("/headers/x-team", serde_json::json!("billing")),
        ] {
            assert_eq!(hook.pointer(pointer), Some(&want), "{pointer} in {hook}");
        }
        assert_eq!(
            original.pointer("/rules/0/targets/2/maxlen"),
            Some(&serde_json::json!(321))
        );
        assert_eq!(
            original.pointer("/sources/0/tasks"),
            Some(&serde_json::json!(2))
        );
    }

    #[test]
    fn distributed_mode_needs_redis() {
        let err = parse("mode = \"distributed\"\n").unwrap_err().to_string();
        assert!(err.contains("redis_url"), "{err}");
        assert!(parse("mode = \"distributed\"\nredis_url = \"redis://127.0.0.1/\"\n[cluster]\nstrategy = \"consistent-hash\"\n").is_ok());
    }

    /// A Redis Cluster by its seed nodes, from the file or the environment; exclusive with
    /// `redis_url`; every node a valid URL; replicated durability needs a replica.
    #[test]
    fn a_redis_cluster_is_named_by_its_nodes() {
        let text = "mode = \"distributed\"\nredis_cluster_nodes = [\"redis://127.0.0.1:7000\", \"rediss://127.0.0.1:7001\"]\n[cluster]\nredis_durability = \"replicated\"\nmin_replicas = 2\nreplication_timeout = \"250ms\"\n";
        let c = parse(text).unwrap();
        assert_eq!(c.redis_cluster_nodes.as_ref().map(Vec::len), Some(2));
        assert_eq!(c.cluster.redis_durability, RedisDurability::Replicated);
        assert_eq!(c.cluster.min_replicas, 2);
        assert_eq!(c.cluster.replication_timeout, Duration::from_millis(250));
        let both = "redis_url = \"redis://127.0.0.1/\"\nredis_cluster_nodes = [\"redis://127.0.0.1:7000\"]\n";
        let err = parse(both).unwrap_err().to_string();
        assert!(
            err.contains("t.toml:2") && err.contains("not both"),
            "{err}"
        );
        let err = parse("redis_cluster_nodes = []\n").unwrap_err().to_string();
        assert!(err.contains("at least one node"), "{err}");
        let err = parse("redis_cluster_nodes = [\"redis://:secret@host:70000000\"]\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("redis_cluster_nodes") && !err.contains("secret"),
            "{err}"
        );
        let err = parse("[cluster]\nredis_durability = \"replicated\"\nmin_replicas = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("min_replicas"), "{err}");
        let err = parse("[cluster]\nredis_durability = \"eventually\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("redis_durability"), "{err}");
        let err = parse("redis_prefix = \"a{b}\"\n").unwrap_err().to_string();
        assert!(err.contains("redis_prefix"), "{err}");

        let mut c = parse("").unwrap();
        c.apply_env([(
            "SLUICE_REDIS_CLUSTER_NODES".to_string(),
            "redis://127.0.0.1:7000, redis://127.0.0.1:7001".to_string(),
        )])
        .unwrap();
        assert_eq!(
            c.redis_cluster_nodes,
            Some(vec![
                "redis://127.0.0.1:7000".to_string(),
                "redis://127.0.0.1:7001".to_string()
            ])
        );
    }

    #[test]
    fn durations_that_would_panic_the_runtime_are_refused_with_key_and_line() {
        for (text, key, line) in [
            (
                "[delivery]\ncommit_interval = \"0ms\"\n",
                "delivery.commit_interval",
                2,
            ),
            (
                "[cluster]\nstrategy = \"sorted-hash\"\nrebalance_interval = 0\n",
                "cluster.rebalance_interval",
                3,
            ),
            (
                "log = \"info\"\n[cluster]\nheartbeat_interval = \"0s\"\n",
                "cluster.heartbeat_interval",
                3,
            ),
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(err.contains(key), "{key}: {err}");
            assert!(err.contains(&format!("t.toml:{line}:")), "{key}: {err}");
        }
        for text in [
            "[delivery]\ncommit_interval = \"9999999999999999999999999h\"\n",
            "[delivery]\ncommit_interval = 9223372036854775807\n",
            "[delivery]\ncommit_interval = \"8761h\"\n",
        ] {
            let err = parse(text).unwrap_err().to_string();
            assert!(
                err.contains("line 2")
                    && err.contains("commit_interval")
                    && err.contains("too long"),
                "{err}"
            );
        }
        assert!(parse("[delivery]\ncommit_interval = \"8760h\"\n").is_ok());
    }

    /// There is no TLS Redis here: this checks that `rediss://` is understood (the TLS
    /// feature is built in) and that a failing TLS connection is an error, not a panic
    /// (rustls needs a crypto provider), against the plain Redis of the test machine.
    #[tokio::test]
    async fn rediss_urls_connect_over_tls() {
        assert!(parse("redis_url = \"rediss://:pw@127.0.0.1:6379/0\"\n").is_ok());
        let redis = crate::store::redis::Redis::connect(
            "rediss://:hunter2@127.0.0.1:6379/0",
            "t",
            Duration::from_secs(2),
        )
        .await
        .unwrap();
        let err = redis.ping().await.unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
        assert!(!err.contains("feature"), "{err}");
        let err = crate::store::redis::Redis::connect(
            "redis://:hunter2@127.0.0.1:6379/nodb",
            "t",
            Duration::from_secs(2),
        )
        .await
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("***@127.0.0.1") && !err.contains("hunter2"),
            "{err}"
        );
    }

    #[test]
    fn a_bad_redis_url_is_refused_without_its_password() {
        let err = parse("redis_url = \"redis://:hunter2@127.0.0.1:6379/notadb\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("t.toml:1:") && err.contains("redis_url"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn errors_inside_a_target_point_at_the_nested_key() {
        let base = "[[buses]]\nname = \"b\"\n[[rules]]\nname = \"r\"\nbus = \"b\"\n[[rules.targets]]\ntype = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\n";
        for (tail, line, word) in [
            // The dead-letter target lacks `name`: the line of its table, not line 6.
            (
                "[rules.targets.dead_letter.target]\ntype = \"log\"\n",
                10,
                "name",
            ),
            (
                "dead_letter = { target = { type = \"log\" } }\n",
                10,
                "name",
            ),
            (
                "[rules.targets.retry]\nmax_attempts = 3\nbogus = 1\n",
                12,
                "bogus",
            ),
            (
                "[rules.targets.retry]\nmax_event_age = \"2 fortnights\"\n",
                11,
                "fortnights",
            ),
            ("mode = \"sideways\"\n", 10, "sideways"),
        ] {
            let err = parse(&format!("{base}{tail}")).unwrap_err().to_string();
            assert!(
                err.contains(&format!("line {line},")) && err.contains(word),
                "{tail}: {err}"
            );
        }
        // A target missing `name` itself is an error of its own table.
        let err = parse(&base.replace("name = \"h\"\n", ""))
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 6,") && err.contains("name"), "{err}");
    }
}
