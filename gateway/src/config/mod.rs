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
    pub webhooks: Vec<crate::webhooks::WebhookConfig>,
    /// JSON Schemas of event data, per (bus, type) or by `dataschema`; files relative to
    /// this configuration file. Each replica takes them from its own file.
    #[serde(default)]
    pub schemas: Vec<crate::ingress::schema::SchemaConfig>,
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
            let value = crate::targets::local_secret(value)
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

/// The prefix of the environment variables catalog resources may read by default.
pub const DEFAULT_SECRET_ENV_PREFIX: &str = "SLUICE_SECRET_";

/// `[targets]`: what targets of catalog resources may reach on this replica.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetsConfig {
    /// Directories file targets may write under, besides `data_dir` (always allowed).
    /// Absolute paths; a file target's path must resolve (symlinks followed) inside one.
    #[serde(default)]
    pub file_roots: Vec<PathBuf>,
    /// Let http and function targets reach link-local and cloud metadata addresses
    /// (169.254.0.0/16, fe80::/10, fd00:ec2::254, 100.100.100.200, 0.0.0.0/8), refused by
    /// default. Loopback and private (RFC 1918) addresses are always allowed.
    #[serde(default)]
    pub allow_private_egress: bool,
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
    /// Memory that requests being read, parsed and stored may take at once, counted as
    /// twice the body (the body and the stored events) plus, for JSON bodies, 16 times the
    /// largest event's text (a JSON tree is up to that much larger than its text). A request
    /// that does not fit is shed with `503` and `Retry-After` rather than queued.
    pub max_inflight_bytes: usize,
    /// After SIGTERM: how long `/readyz` answers 503 (so load balancers stop sending) while
    /// requests are still accepted, before the listener closes and in-flight requests
    /// finish. 0 closes at once (Kubernetes: the `preStop` hook does the waiting).
    #[serde(deserialize_with = "duration")]
    pub shutdown_delay: Duration,
    /// Memory the deduplication records may take (webhook delivery ids, events of buses
    /// with a `dedup_window`): standalone in the process, distributed in Redis per
    /// deduplicating bus (split between its shards); past it the oldest records are
    /// dropped before their window ends (a late duplicate of one is stored again).
    pub max_dedup_bytes: usize,
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
            max_inflight_bytes: 256 * 1024 * 1024,
            shutdown_delay: Duration::ZERO,
            max_dedup_bytes: crate::webhooks::dedup::DEFAULT_MAX_BYTES,
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
            cache_bytes: 4 * 1024 * 1024,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DeliveryConfig {
    /// Most events a task reads and hands to its target at once.
    pub batch_size: usize,
    /// Most bytes of stored events one read of the log takes and one delivery hands to its
    /// target (the last event may go past it; a larger event goes alone), so memory is
    /// bounded by bytes whatever the events' size.
    pub batch_bytes: usize,
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
            batch_bytes: 1024 * 1024,
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
}

/// How old an undelivered event may get when the bus does not say (`max_backlog_age`).
/// A week, like Kafka's default `retention.ms` and Pub/Sub's longest unacknowledged retention.
pub const DEFAULT_MAX_BACKLOG_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

impl BusConfig {
    /// The bus's `max_backlog_age`, or the default.
    pub fn max_backlog_age(&self) -> Duration {
        self.max_backlog_age.unwrap_or(DEFAULT_MAX_BACKLOG_AGE)
    }
}

fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

pub(crate) fn ser_optional_duration<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => crate::runtime::delivery::ser_duration(d, s),
        None => s.serialize_none(),
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

/// Where in a nested table an error is. Targets are internally tagged (`type = "http"`), and
/// serde reads a tagged table through a buffer that drops the positions: an error anywhere
/// inside a `[[rules.targets]]` entry (a dead-letter `target` without `name`, an unknown key
/// of its retry table) comes back spanning the whole entry. This finds, inside that entry,
/// the key or table the message is about and reports its line instead.
mod nested {
    use std::ops::Range;

    use toml::de::{DeTable, DeValue};
    use toml::Spanned;

    /// A better-placed message than the parser's, when the error is about a whole table.
    pub(super) fn locate(text: &str, error: &toml::de::Error) -> Option<String> {
        let span = error.span()?;
        let root = DeTable::parse(text).ok()?;
        // Table-level errors carry the table's span (for `[[rules.targets]]`, its header).
        let element = table_at(root.get_ref(), &span)?;
        let message = error.message();
        let mut found = None;
        visit_table(element, message, false, 0, &mut found);
        if found.is_none() {
            // Parsers quote part of a value (the unit of `3 fortnights`): look for it inside.
            visit_table(element, message, true, 0, &mut found);
        }
        let (at, _) = found?;
        Some(render(text, at, message))
    }

    /// The JSON pointer of where an error is in `text` (written by `from_json`: one inline
    /// value per key, so each field has its own span): the deepest key or value whose span
    /// holds the error's, refined inside a tagged table the way `locate` does.
    pub(super) fn pointer(text: &str, error: &toml::de::Error) -> Option<String> {
        let mut span = error.span()?;
        let root = DeTable::parse(text).ok()?;
        // Errors inside tagged tables come back spanning the table, or the whole array
        // of them: look inside for what the message is about.
        if let Some(element) = root.get_ref().iter().find_map(|(_, v)| value_at(v, &span)) {
            for partial in [false, true] {
                let mut found = None;
                visit_value(element, error.message(), partial, 0, &mut found);
                if let Some((at, _)) = found {
                    span = at;
                    break;
                }
            }
        }
        let mut path = Vec::new();
        walk_table(root.get_ref(), &span, &mut path);
        Some(
            path.iter()
                .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
                .collect(),
        )
    }

    /// The table or array (at any depth) whose span is `span`.
    fn value_at<'a, 'i>(
        value: &'a Spanned<DeValue<'i>>,
        span: &Range<usize>,
    ) -> Option<&'a Spanned<DeValue<'i>>> {
        match value.get_ref() {
            DeValue::Table(_) | DeValue::Array(_) if value.span() == *span => Some(value),
            DeValue::Table(t) => t.iter().find_map(|(_, v)| value_at(v, span)),
            DeValue::Array(items) => items.iter().find_map(|i| value_at(i, span)),
            _ => None,
        }
    }

    fn walk_table(table: &DeTable<'_>, span: &Range<usize>, path: &mut Vec<String>) {
        for (key, value) in table {
            let holds = |r: Range<usize>| r.start <= span.start && span.end <= r.end;
            if holds(key.span()) {
                path.push(key.get_ref().to_string());
                return;
            }
            if holds(value.span()) {
                path.push(key.get_ref().to_string());
                walk_value(value, span, path);
                return;
            }
        }
    }

    fn walk_value(value: &Spanned<DeValue<'_>>, span: &Range<usize>, path: &mut Vec<String>) {
        match value.get_ref() {
            DeValue::Table(t) => walk_table(t, span, path),
            DeValue::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    let r = item.span();
                    if r.start <= span.start && span.end <= r.end {
                        path.push(i.to_string());
                        walk_value(item, span, path);
                        return;
                    }
                }
            }
            _ => {}
        }
    }

    /// The table (at any depth) whose span is `span`.
    fn table_at<'a, 'i>(table: &'a DeTable<'i>, span: &Range<usize>) -> Option<&'a DeTable<'i>> {
        table
            .iter()
            .find_map(|(_, value)| value_table_at(value, span))
    }

    fn value_table_at<'a, 'i>(
        value: &'a Spanned<DeValue<'i>>,
        span: &Range<usize>,
    ) -> Option<&'a DeTable<'i>> {
        match value.get_ref() {
            DeValue::Table(t) if value.span() == *span => Some(t),
            DeValue::Table(t) => table_at(t, span),
            DeValue::Array(items) => items.iter().find_map(|i| value_table_at(i, span)),
            _ => None,
        }
    }

    /// The word a message is about: the first back-quoted one (`unknown field `x``, a bad
    /// value), else the first double-quoted one (`invalid type: string "x"`).
    fn subject(message: &str) -> Option<&str> {
        message
            .split('`')
            .nth(1)
            .or_else(|| message.split('"').nth(1))
    }

    /// A scalar's text as a message would quote it.
    fn scalar_text<'a>(value: &'a DeValue<'_>) -> Option<&'a str> {
        match value {
            DeValue::String(s) => Some(s),
            DeValue::Integer(i) => Some(i.as_str()),
            DeValue::Float(f) => Some(f.as_str()),
            _ => None,
        }
    }

    /// Keeps in `found` the deepest key or value inside `table` that the message is about:
    /// for `missing field `x``, a nested tagged table (one with `type`) that lacks `x`.
    /// `partial`: a string value containing the word counts too.
    fn visit_table(
        table: &DeTable<'_>,
        message: &str,
        partial: bool,
        depth: usize,
        found: &mut Option<(Range<usize>, usize)>,
    ) {
        let keep = |at: Range<usize>, found: &mut Option<(Range<usize>, usize)>| {
            if found.as_ref().is_none_or(|(_, d)| depth + 1 > *d) {
                *found = Some((at, depth + 1));
            }
        };
        let missing = message
            .strip_prefix("missing field ")
            .and_then(|_| subject(message));
        let word = subject(message);
        for (key, value) in table {
            match (missing, value.get_ref()) {
                (Some(field), DeValue::Table(t)) => {
                    if t.contains_key("type") && !t.contains_key(field) {
                        keep(key.span(), found);
                    }
                }
                (Some(_), _) => {}
                (None, v) => {
                    if word == Some(key.get_ref().as_ref()) {
                        keep(key.span(), found);
                    } else if let (Some(word), Some(text)) = (word, scalar_text(v)) {
                        if text == word || (partial && !word.is_empty() && text.contains(word)) {
                            keep(value.span(), found);
                        }
                    }
                }
            }
            visit_value(value, message, partial, depth + 1, found);
        }
    }

    fn visit_value(
        value: &Spanned<DeValue<'_>>,
        message: &str,
        partial: bool,
        depth: usize,
        found: &mut Option<(Range<usize>, usize)>,
    ) {
        match value.get_ref() {
            DeValue::Table(t) => visit_table(t, message, partial, depth, found),
            DeValue::Array(items) => {
                for item in items.iter() {
                    visit_value(item, message, partial, depth, found);
                }
            }
            _ => {}
        }
    }

    /// The parser's own layout: position, the line with a marker, the message.
    fn render(text: &str, at: Range<usize>, message: &str) -> String {
        let start = at.start.min(text.len());
        let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
        let line_end = text[start..].find('\n').map_or(text.len(), |i| start + i);
        let line_no = text[..start].matches('\n').count() + 1;
        let column = text[line_start..start].chars().count() + 1;
        let width = text[start..at.end.min(line_end).max(start)]
            .chars()
            .count()
            .max(1);
        let gutter = " ".repeat(line_no.to_string().len());
        format!(
            "TOML parse error at line {line_no}, column {column}\n{gutter} |\n{line_no} | {}\n{gutter} | {}{}\n{message}",
            &text[line_start..line_end],
            " ".repeat(column - 1),
            "^".repeat(width),
        )
    }
}

/// Reads a resource (a bus, a rule, a source, or a set of them) from JSON with the
/// configuration file's own deserializer: the JSON is written as TOML with inline tables
/// (every value keeps its own position) and parsed as a configuration file is. An error
/// names the field at fault as a JSON pointer.
pub fn from_json<T: serde::de::DeserializeOwned>(
    value: &serde_json::Value,
) -> Result<T, (String, String)> {
    let serde_json::Value::Object(map) = value else {
        return Err((String::new(), "expected a JSON object".to_string()));
    };
    let mut text = String::new();
    for (key, value) in map {
        if value.is_null() {
            continue;
        }
        text.push_str(&toml_key(key));
        text.push_str(" = ");
        toml_value(value, &mut text);
        text.push('\n');
    }
    toml::from_str(&text).map_err(|e| {
        let pointer = nested::pointer(&text, &e).unwrap_or_default();
        (pointer, e.message().trim_end().to_string())
    })
}

fn toml_key(key: &str) -> String {
    serde_json::to_string(key).unwrap_or_else(|_| "\"\"".to_string())
}

/// JSON as an inline TOML value (JSON string escapes are TOML basic-string escapes). Nulls
/// inside objects mean "absent".
fn toml_value(value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match value {
        Value::Null => out.push_str("{}"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => {
            let text = n.to_string();
            if n.is_f64() && !text.contains(['.', 'e', 'E']) {
                out.push_str(&format!("{text}.0"));
            } else {
                out.push_str(&text);
            }
        }
        Value::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                toml_value(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            let mut first = true;
            for (key, value) in map.iter().filter(|(_, v)| !v.is_null()) {
                if !first {
                    out.push_str(", ");
                }
                first = false;
                out.push_str(&toml_key(key));
                out.push_str(" = ");
                toml_value(value, out);
            }
            out.push('}');
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
    pub(super) fn shards() -> u32 {
        4
    }
    pub(super) fn redis_prefix() -> String {
        "sluice".to_string()
    }
}

/// The longest duration any key accepts. Deadlines are `now + duration`: far beyond this
/// they overflow `Instant` and panic the runtime, and nothing in Sluice needs to wait longer.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn check_max_duration(text: &str, d: Duration) -> Result<Duration, String> {
    if d > MAX_DURATION {
        return Err(format!(
            "`{text}` is too long: durations are at most 8760h (one year)"
        ));
    }
    Ok(d)
}

/// Parses `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds, up to [`MAX_DURATION`].
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
    // `from_secs_f64` panics on values past `u64::MAX` seconds; compare first.
    if seconds > MAX_DURATION.as_secs_f64() {
        return check_max_duration(text, Duration::MAX);
    }
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| format!("`{text}` is not a duration"))
        .and_then(|d| check_max_duration(text, d))
}

pub(crate) fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Seconds(u64),
        Text(String),
    }
    match Raw::deserialize(deserializer)? {
        Raw::Seconds(s) => check_max_duration(&s.to_string(), Duration::from_secs(s))
            .map_err(serde::de::Error::custom),
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

/// The kinds of resource the catalog holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Bus,
    Rule,
    Source,
    Webhook,
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
    pub webhooks: Vec<crate::webhooks::WebhookConfig>,
}

impl Channels {
    /// Every check of buses, rules and sources the configuration loader makes: names are
    /// unique and valid, rules and sources name existing buses, patterns, filters,
    /// transforms and targets compile. The error names the resource and, as a JSON
    /// pointer inside it, the field at fault.
    pub fn check(&self) -> Result<(), Invalid> {
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
                    crate::rules::compile_transform(spec).map_err(|m| {
                        bad(
                            &at("/transform"),
                            format!("rule `{name}`, target `{target_name}`: {m}"),
                        )
                    })?;
                }
                if let TargetConfig::File(file) = target {
                    if file.path.trim().is_empty() {
                        return Err(bad(
                            &at("/path"),
                            format!("rule `{name}`: file target `{target_name}`: `path` is empty"),
                        ));
                    }
                }
                crate::targets::check(target, &buses).map_err(|m| {
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
            crate::webhooks::check_catalog(hook).map_err(|(pointer, m)| bad(&pointer, m))?;
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
            let Some(auth) = bus
                .auth
                .as_ref()
                .filter(|_| changed(&crate::catalog::bus_key(name)))
            else {
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
            if !changed(&crate::catalog::rule_key(rule.bus.get_ref(), name)) {
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
            if !changed(&crate::catalog::webhook_key(name)) {
                continue;
            }
            crate::webhooks::check_catalog_policy(hook, prefix).map_err(|(pointer, m)| {
                Invalid::new(
                    Kind::Webhook,
                    index,
                    &pointer,
                    format!("webhook `{name}`: {m}"),
                )
            })?;
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
    "redis_url",
    "redis_prefix",
    "worker_id",
    "admin_listen",
];

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
        self.check_durations(path, text)?;
        if let Some(url) = &self.redis_url {
            redis::Client::open(url.as_str()).map_err(|e| ConfigError::Invalid {
                path: path.to_path_buf(),
                line: find_line(text, "redis_url"),
                message: format!("redis_url `{}`: {e}", redact_url(url)),
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
            };
            ConfigError::Invalid {
                path: path.to_path_buf(),
                line: line.unwrap_or(1),
                message: e.message,
            }
        };
        channels.check().map_err(&located)?;
        // The file's resources seed the catalog: they follow its policy, so the operator
        // learns of a literal secret or a path outside the roots here, not from the API.
        channels
            .check_policy(&crate::targets::TargetPolicy::of(self), &|_| true)
            .map_err(located)?;
        let buses: HashSet<&str> = self
            .buses
            .iter()
            .map(|b| b.name.get_ref().as_str())
            .collect();
        crate::webhooks::check(&self.webhooks, &buses).map_err(|(at, m)| invalid(at, m))?;
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
        }
    }

    pub fn channels(&self) -> Channels {
        Channels {
            buses: self.buses.clone(),
            rules: self.rules.clone(),
            sources: self.sources.clone(),
            webhooks: Vec::new(),
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

/// A URL as it may be shown (logs, status reasons, dead-letter extensions, errors): the
/// user info (`user:password@`) and the query string are replaced by `***`, since both
/// commonly carry credentials. The scheme, host, port and path stay, to say which endpoint.
/// Text that does not parse as a URL is cut the same way by hand rather than shown as it is.
pub fn redact_url(url: &str) -> String {
    if let Ok(mut parsed) = url::Url::parse(url) {
        if parsed.cannot_be_a_base() {
            return redact_by_hand(url);
        }
        let had_user = !parsed.username().is_empty() || parsed.password().is_some();
        let had_query = parsed.query().is_some();
        let had_fragment = parsed.fragment().is_some();
        // Both setters only fail for URLs that cannot have user info (checked above).
        let _ = parsed.set_password(None);
        let _ = parsed.set_username(if had_user { "***" } else { "" });
        parsed.set_query(had_query.then_some("***"));
        parsed.set_fragment(had_fragment.then_some("***"));
        return parsed.to_string();
    }
    redact_by_hand(url)
}

fn redact_by_hand(url: &str) -> String {
    let (rest, cut) = match url.find(['?', '#']) {
        Some(i) => (&url[..i], true),
        None => (url, false),
    };
    let (scheme, after) = match rest.find("://") {
        Some(i) => rest.split_at(i + 3),
        None => ("", rest),
    };
    let authority_end = after.find('/').unwrap_or(after.len());
    let (authority, path) = after.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => format!("***{}", &authority[at..]),
        None => authority.to_string(),
    };
    let mut out = format!("{scheme}{authority}{path}");
    if cut {
        out.push_str("?***");
    }
    out
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset)
        .map_or(1, |t| t.matches('\n').count() + 1)
}

/// The line of `key` inside the `[table]` section (or a dotted `table.key`), else of the
/// section header, else 1.
fn key_line(text: &str, table: &str, key: &str) -> usize {
    let header = format!("[{table}]");
    let dotted = format!("{table}.{key}");
    let mut in_table = false;
    let mut header_line = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim_start();
        if line.starts_with('[') {
            in_table = line.starts_with(&header);
            if in_table {
                header_line = Some(i + 1);
            }
            continue;
        }
        let is_key = |k: &str| {
            line.strip_prefix(k)
                .is_some_and(|rest| rest.trim_start().starts_with('='))
        };
        if (in_table && is_key(key)) || (header_line.is_none() && is_key(&dotted)) {
            return i + 1;
        }
    }
    header_line.unwrap_or(1)
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

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1 parsec").is_err());
    }

    #[test]
    fn urls_are_redacted_for_display() {
        for (url, shown) in [
            ("https://hooks.example/in", "https://hooks.example/in"),
            (
                "https://user:pa55@hooks.example:8443/in?token=s3cret&x=1#frag",
                "https://***@hooks.example:8443/in?***#***",
            ),
            ("https://:pa55@h/x", "https://***@h/x"),
            (
                "redis://:pa55@127.0.0.1:6379/0",
                "redis://***@127.0.0.1:6379/0",
            ),
            (
                "rediss://default:pa55@cache.internal/",
                "rediss://***@cache.internal/",
            ),
            // Not URLs: cut by hand, never shown as they are.
            ("redis://:pa55@bad host:6379", "redis://***@bad host:6379"),
            ("http://u:p@[::1/x?k=v", "http://***@[::1/x?***"),
            ("no scheme?key=1", "no scheme?***"),
        ] {
            let redacted = redact_url(url);
            assert_eq!(redacted, shown, "{url}");
            assert!(!redacted.contains("pa55") && !redacted.contains("s3cret"));
        }
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

    #[test]
    fn names_are_checked() {
        assert!(check_name("orders-v1.eu_west").is_ok());
        assert!(check_name("../etc").is_err());
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
    }
}
