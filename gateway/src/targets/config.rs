//! How a target is configured: the `[[rules.targets]]` entry (`TargetConfig`, one variant per
//! kind of target), its retry policy and dead-letter destination, and `[targets]`, what
//! catalog targets may reach on this replica. Each target's own settings live beside it.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use base64::Engine;
use reqwest::header::{HeaderName, HeaderValue};

use crate::values::{optional_duration, redact_url, ser_optional_duration};

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

/// Where a rule sends the events it matched.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum TargetConfig {
    /// Writes each event as one JSON line to standard output.
    Log(LogTargetConfig),
    /// Appends each event as one JSON line (structured mode) to a file.
    File(FileTargetConfig),
    /// Sends each event as a message to a RocketMQ topic.
    Rocketmq(RocketMqConfig),
    /// POSTs each event to an HTTP endpoint (signed webhooks, auth, limits).
    Http(HttpConfig),
    /// Adds each event to a Redis stream (XADD with MAXLEN).
    RedisStream(RedisStreamConfig),
    /// Puts each event on another bus.
    Bus(BusTargetConfig),
    /// POSTs each event to a function; a CloudEvent reply goes back onto a bus.
    Function(FunctionConfig),
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

/// A target's retry policy. Unset backoffs come from the `[delivery]` section.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Attempts per event, the first one included (EventBridge: 185).
    pub max_attempts: u32,
    /// How long after its first attempt an event may still be retried (EventBridge: 24 h).
    #[serde(
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub max_event_age: Duration,
    #[serde(
        default,
        deserialize_with = "optional_duration",
        serialize_with = "ser_optional_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub initial_backoff: Option<Duration>,
    #[serde(
        default,
        deserialize_with = "optional_duration",
        serialize_with = "ser_optional_duration",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_backoff: Option<Duration>,
}

impl Default for RetryConfig {
    fn default() -> Self {
        RetryConfig {
            max_attempts: 185,
            max_event_age: Duration::from_secs(24 * 3600),
            initial_backoff: None,
            max_backoff: None,
        }
    }
}

/// Where events go that cannot be delivered: a bus, or another target.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bus: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<Box<TargetConfig>>,
}

impl DeadLetterConfig {
    pub fn check(&self, buses: &std::collections::HashSet<&str>) -> Result<(), String> {
        match (&self.bus, &self.target) {
            (Some(bus), None) if buses.contains(bus.as_str()) => Ok(()),
            (Some(bus), None) => Err(format!("dead_letter.bus `{bus}` is not defined")),
            (None, Some(target)) => {
                check(target, buses).map_err(|m| format!("dead_letter.target: {m}"))
            }
            _ => Err("dead_letter needs exactly one of `bus` or `target`".to_string()),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BodyMode {
    /// Attributes as `ce-*` headers, the data as the body.
    #[default]
    Binary,
    /// The whole event as `application/cloudevents+json`.
    Structured,
    /// The data alone, as a plain webhook.
    Raw,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, tag = "type", rename_all = "kebab-case")]
pub enum AuthConfig {
    /// `Authorization: Bearer <token>`. Secrets (`token`, `password`, `key`) are `env:NAME`
    /// references to variables under `admin.secret_env_prefix`: the catalog holds no secret.
    Bearer { token: String },
    /// `Authorization: Basic base64(user:password)`.
    Basic { username: String, password: String },
    /// A header carrying a key, e.g. `x-api-key`.
    ApiKey { header: String, key: String },
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitBreakerConfig {
    /// Failures in a row (network errors, timeouts, 5xx, 429) that open the circuit.
    #[serde(default = "http_defaults::breaker_failures")]
    pub failures: u32,
    /// How long it stays open before one probe is let through.
    #[serde(
        default = "http_defaults::breaker_open_for",
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub open_for: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    pub name: String,
    pub url: String,
    #[serde(default)]
    pub mode: BodyMode,
    /// Extra request headers.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Time for the whole request, answer included.
    #[serde(
        default = "http_defaults::timeout",
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub timeout: Duration,
    #[serde(
        default = "http_defaults::connect_timeout",
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub connect_timeout: Duration,
    /// Speak h2 without TLS negotiation (h2c).
    #[serde(default)]
    pub http2_prior_knowledge: bool,
    /// PEM file of root certificates to trust besides the platform's (a private CA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<String>,
    /// Standard Webhooks signing secret: `env:NAME`, a variable (under
    /// `admin.secret_env_prefix`) holding `whsec_...`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<AuthConfig>,
    /// Most events per second to this endpoint (all tasks together).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<f64>,
    /// Most requests in flight to this endpoint (all tasks together).
    #[serde(default = "http_defaults::max_in_flight")]
    pub max_in_flight: usize,
    /// Send a batch's events concurrently (up to `max_in_flight`) instead of in order.
    #[serde(default)]
    pub concurrent: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub circuit_breaker: Option<CircuitBreakerConfig>,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The transform chain applied to events before this target (a step or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

mod http_defaults {
    use std::time::Duration;
    pub(super) fn timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub(super) fn connect_timeout() -> Duration {
        Duration::from_secs(3)
    }
    pub(super) fn max_in_flight() -> usize {
        16
    }
    pub(super) fn breaker_failures() -> u32 {
        5
    }
    pub(super) fn breaker_open_for() -> Duration {
        Duration::from_secs(30)
    }
}

impl HttpConfig {
    pub fn check(&self) -> Result<(), String> {
        let shown = redact_url(&self.url);
        let url = url::Url::parse(&self.url).map_err(|e| format!("url `{shown}`: {e}"))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!("url `{shown}` must be http or https"));
        }
        for (name, value) in &self.headers {
            HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("header name `{name}` is not valid"))?;
            HeaderValue::from_str(value)
                .map_err(|_| format!("header `{name}`: value is not valid"))?;
        }
        if let Some(s) = &self.signing_secret {
            if !s.starts_with("env:") {
                signing_key(s)?;
            }
        }
        if let Some(rate) = self.rate_limit {
            if !(rate.is_finite() && rate > 0.0) {
                return Err("`rate_limit` must be a positive number of events per second".into());
            }
        }
        if self.max_in_flight == 0 {
            return Err("`max_in_flight` must be greater than zero".to_string());
        }
        if self.timeout.is_zero() {
            return Err("`timeout` must be greater than zero".to_string());
        }
        Ok(())
    }
}

/// The HMAC key of a `whsec_<base64>` secret.
pub(crate) fn signing_key(secret: &str) -> Result<Vec<u8>, String> {
    let encoded = secret
        .strip_prefix("whsec_")
        .ok_or("`signing_secret` must start with `whsec_`")?;
    base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| "`signing_secret`: the part after `whsec_` is not base64".to_string())
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    pub name: String,
    pub url: String,
    /// The bus replies are put on.
    pub reply_bus: String,
    /// Most functions an event may pass through (its reply chain), to stop loops.
    #[serde(default = "function_defaults::max_hops")]
    pub max_hops: i64,
    #[serde(
        default = "function_defaults::timeout",
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub timeout: Duration,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The transform chain applied to events before this target (a step or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

mod function_defaults {
    use std::time::Duration;
    pub(super) fn max_hops() -> i64 {
        8
    }
    pub(super) fn timeout() -> Duration {
        Duration::from_secs(30)
    }
}

impl FunctionConfig {
    pub fn check(&self) -> Result<(), String> {
        url::Url::parse(&self.url).map_err(|e| format!("url `{}`: {e}", redact_url(&self.url)))?;
        if self.max_hops < 1 {
            return Err("`max_hops` must be at least 1".to_string());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RocketMqConfig {
    pub name: String,
    /// `host:port` of the name server(s), `;`-separated.
    pub name_server: String,
    pub topic: String,
    /// Attribute whose value becomes the message tag (absent attribute: no tag).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag_attribute: Option<String>,
    /// A fixed tag, when `tag_attribute` is not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
    /// Attribute whose value becomes the message key (default `id`).
    #[serde(default = "rocketmq_defaults::keys_attribute")]
    pub keys_attribute: String,
    /// Attribute choosing the queue: same value, same queue, in order (default
    /// `partitionkey`; events without it are spread by id).
    #[serde(default = "rocketmq_defaults::partition_key_attribute")]
    pub partition_key_attribute: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub producer_group: Option<String>,
    /// Most messages in one batch send.
    #[serde(default = "rocketmq_defaults::max_batch")]
    pub max_batch: usize,
    /// Most bytes (bodies and properties) in one batch send.
    #[serde(default = "rocketmq_defaults::max_batch_bytes")]
    pub max_batch_bytes: usize,
    /// Batches in flight at once across this target's tasks.
    #[serde(default = "rocketmq_defaults::max_in_flight")]
    pub max_in_flight: usize,
    #[serde(
        default = "rocketmq_defaults::send_timeout",
        deserialize_with = "crate::values::duration",
        serialize_with = "crate::values::ser_duration"
    )]
    pub send_timeout: Duration,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The transform chain applied to events before this target (a step or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

mod rocketmq_defaults {
    use std::time::Duration;
    pub(super) fn keys_attribute() -> String {
        "id".to_string()
    }
    pub(super) fn partition_key_attribute() -> String {
        "partitionkey".to_string()
    }
    pub(super) fn max_batch() -> usize {
        100
    }
    pub(super) fn max_batch_bytes() -> usize {
        1024 * 1024
    }
    pub(super) fn max_in_flight() -> usize {
        8
    }
    pub(super) fn send_timeout() -> Duration {
        Duration::from_secs(3)
    }
}

impl RocketMqConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.name_server.trim().is_empty() {
            return Err("`name_server` is empty".to_string());
        }
        let topic_ok = !self.topic.is_empty()
            && self.topic.len() <= 127
            && self
                .topic
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '%' | '|'));
        if !topic_ok {
            return Err(format!(
                "topic `{}` must be 1 to 127 characters of letters, digits, `-`, `_`, `%`, `|`",
                self.topic
            ));
        }
        if self.tag.is_some() && self.tag_attribute.is_some() {
            return Err("set `tag` or `tag_attribute`, not both".to_string());
        }
        if self.max_batch == 0 || self.max_batch > 1000 {
            return Err("`max_batch` must be between 1 and 1000".to_string());
        }
        if self.max_in_flight == 0 {
            return Err("`max_in_flight` must be greater than zero".to_string());
        }
        if self.max_batch_bytes < 1024 || self.max_batch_bytes > 4 * 1024 * 1024 {
            return Err("`max_batch_bytes` must be between 1 KiB and 4 MiB".to_string());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RedisStreamConfig {
    pub name: String,
    /// `redis://host:port/db`, or `env:NAME` (a variable under `admin.secret_env_prefix`):
    /// a URL with a password must come whole from the environment.
    #[serde(default = "redis_stream_defaults::url")]
    pub url: String,
    pub stream: String,
    /// Approximate cap on the stream's length (`MAXLEN ~`).
    #[serde(default = "redis_stream_defaults::maxlen")]
    pub maxlen: usize,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The transform chain applied to events before this target (a step or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

mod redis_stream_defaults {
    pub(super) fn url() -> String {
        "redis://127.0.0.1:6379".to_string()
    }
    pub(super) fn maxlen() -> usize {
        100_000
    }
}

impl RedisStreamConfig {
    pub fn check(&self) -> Result<(), String> {
        if self.stream.is_empty() {
            return Err("`stream` is empty".to_string());
        }
        if !self.url.starts_with("env:") {
            redis::Client::open(self.url.as_str()).map_err(|e| format!("url: {e}"))?;
        }
        if self.maxlen == 0 {
            return Err("`maxlen` must be greater than zero".to_string());
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BusTargetConfig {
    pub name: String,
    pub bus: String,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dead_letter: Option<DeadLetterConfig>,
    /// The transform chain applied to events before this target (a step or a list).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<toml::Value>,
}

/// Checks a target's configuration when the rule is loaded; `buses` are the defined buses.
pub fn check(target: &TargetConfig, buses: &std::collections::HashSet<&str>) -> Result<(), String> {
    let bus_exists = |what: &str, bus: &str| {
        if buses.contains(bus) {
            Ok(())
        } else {
            Err(format!("{what} `{bus}` is not defined"))
        }
    };
    let dead_letter = match target {
        TargetConfig::Log(_) | TargetConfig::File(_) => None,
        TargetConfig::Rocketmq(c) => {
            c.check()?;
            c.dead_letter.as_ref()
        }
        TargetConfig::Http(c) => {
            c.check()?;
            c.dead_letter.as_ref()
        }
        TargetConfig::RedisStream(c) => {
            c.check()?;
            c.dead_letter.as_ref()
        }
        TargetConfig::Bus(c) => {
            bus_exists("bus", &c.bus)?;
            c.dead_letter.as_ref()
        }
        TargetConfig::Function(c) => {
            c.check()?;
            bus_exists("reply_bus", &c.reply_bus)?;
            c.dead_letter.as_ref()
        }
    };
    if let Some(dead_letter) = dead_letter {
        dead_letter.check(buses)?;
    }
    Ok(())
}
