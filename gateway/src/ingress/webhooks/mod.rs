//! Webhook sources: `POST /webhooks/{name}` receives a provider's webhook, verifies its
//! signature (`verify`, `presets`), answers the provider's handshakes, drops replays of a
//! delivery id (`dedup`), and stores the request as one CloudEvent on the source's bus
//! through the same path as binary-mode ingress. Also the CloudEvents Web Hook
//! abuse-protection handshake (`OPTIONS`) for webhook sources and buses.

pub mod dedup;
pub mod presets;
mod probe;
pub mod verify;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use toml::Spanned;

use crate::ingress::IngressState;
use crate::problem::Problem;
use dedup::{Dedup, MemoryDedup, Reserve};
use presets::{Mapping, Src};
use probe::Step;
use verify::{Algorithm, Encoding, Scheme, Secret, Signed, TimeFormat, TimestampSpec};

/// The default replay window of a delivery id.
pub const DEFAULT_DEDUP_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The default tolerance of a signed timestamp.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------
// Configuration

/// `[[webhooks]]`: one webhook source.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub name: Spanned<String>,
    pub bus: String,
    pub verify: VerifyConfig,
    /// Where the event's `type` comes from (default: the preset's event name).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<TypeConfig>,
    /// Where the delivery id comes from (default: the preset's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<ValueConfig>,
    /// The event's `source` (default `/webhooks/{name}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Extension name → request header kept as that extension.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, String>,
    /// How long a delivery id is remembered (`0s`: no deduplication).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "crate::config::ser_optional_duration"
    )]
    pub dedup_window: Option<Duration>,
    /// The public URL providers call (signed by twilio, square, hubspot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Origins the `OPTIONS` handshake allows (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_origins: Vec<String>,
    /// Requests per minute announced in `WebHook-Allowed-Rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_rate: Option<u32>,
    /// Verified requests per second this source takes (token bucket, shared by the
    /// cluster); more are answered `429` with `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
}

/// `verify = { preset = "...", secret = "..." }`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyConfig {
    pub preset: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "crate::config::ser_optional_duration"
    )]
    pub tolerance: Option<Duration>,
    // `hmac` and `api-key`:
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_format: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TypeConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonpath: Option<String>,
    /// A fixed type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ValueConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonpath: Option<String>,
}

fn optional_duration<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    crate::config::duration(d).map(Some)
}

// ---------------------------------------------------------------------------------------
// Runtime form

/// A value taken from the request.
#[derive(Debug, Clone)]
enum Pick {
    Header(String),
    Json(Vec<Step>),
}

/// Parses `$.a.b[0].c` (or `a.b`): names and indexes only, which is what the one-pass
/// field reader (`probe`) can follow without building the document (a JSONPath engine such
/// as `jsonpath-rust` needs the whole tree first).
fn parse_path(text: &str) -> Result<Vec<Step>, String> {
    let rest = text.strip_prefix('$').unwrap_or(text);
    let rest = rest.strip_prefix('.').unwrap_or(rest);
    let mut steps = Vec::new();
    for piece in rest.split('.') {
        let (name, mut indexes) = match piece.find('[') {
            Some(i) => (&piece[..i], &piece[i..]),
            None => (piece, ""),
        };
        if name.is_empty() && indexes.is_empty() {
            return Err(format!("`{text}` has an empty step"));
        }
        if !name.is_empty() {
            steps.push(Step::Key(name.to_string()));
        }
        while let Some(after) = indexes.strip_prefix('[') {
            let Some(close) = after.find(']') else {
                return Err(format!("`{text}`: unclosed `[`"));
            };
            let index = after[..close]
                .parse()
                .map_err(|_| format!("`{text}`: an index must be a number"))?;
            steps.push(Step::Index(index));
            indexes = &after[close + 1..];
        }
        if !indexes.is_empty() {
            return Err(format!("`{text}`: unexpected `{indexes}`"));
        }
    }
    Ok(steps)
}

/// A scalar as text (objects, arrays and null are not values here).
fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

struct Inputs<'a> {
    headers: &'a HeaderMap,
    /// The body's fields this source reads (`Webhook::paths`).
    json: &'a probe::Fields<'a>,
}

impl Inputs<'_> {
    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    }

    fn src(&self, src: Src) -> Option<String> {
        match src {
            Src::Header(h) => self.header(h),
            Src::Json(path) => self.json.get_dotted(path).and_then(scalar),
        }
    }

    fn pick(&self, pick: &Pick) -> Option<String> {
        match pick {
            Pick::Header(h) => self.header(h),
            Pick::Json(steps) => self.json.get(steps).and_then(scalar),
        }
    }
}

/// One webhook source, ready to take requests.
pub struct Webhook {
    pub name: String,
    pub bus: String,
    preset: String,
    scheme: Scheme,
    secrets: Vec<Secret>,
    tolerance: i64,
    mapping: Mapping,
    id: Option<Pick>,
    kind: Option<Pick>,
    fixed_type: Option<String>,
    type_prefix: String,
    source: String,
    extensions: Vec<(String, String)>,
    dedup_window: Duration,
    url: Option<String>,
    allowed_origins: Vec<String>,
    allowed_rate: Option<u32>,
    rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
    /// Every field of the JSON body this source reads (ids, names, times, handshakes).
    paths: probe::Paths,
}

/// The body fields a preset's handshake reads (`provider_handshake`).
fn handshake_fields(preset: &str) -> &'static [&'static str] {
    match preset {
        "slack" => &["type", "challenge"],
        "zoom" => &["event", "payload.plainToken"],
        "twitch" => &["challenge"],
        _ => &[],
    }
}

fn resolve(value: &str) -> Result<String, String> {
    match value.strip_prefix("env:") {
        Some(var) => {
            std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
        }
        None => Ok(value.to_string()),
    }
}

fn header_name(field: &str, name: &str) -> Result<String, String> {
    HeaderName::from_bytes(name.as_bytes())
        .map(|h| h.as_str().to_string())
        .map_err(|_| format!("{field}: `{name}` is not a valid header name"))
}

fn pick(
    field: &str,
    header: Option<&String>,
    jsonpath: Option<&String>,
) -> Result<Option<Pick>, String> {
    match (header, jsonpath) {
        (Some(_), Some(_)) => Err(format!("{field}: set `header` or `jsonpath`, not both")),
        (Some(h), None) => Ok(Some(Pick::Header(header_name(
            &format!("{field}.header"),
            h,
        )?))),
        (None, Some(p)) => parse_path(p)
            .map(|steps| Some(Pick::Json(steps)))
            .map_err(|m| format!("{field}.jsonpath: {m}")),
        (None, None) => Ok(None),
    }
}

/// CloudEvents attribute names the extensions must not take.
const RESERVED: &[&str] = &[
    "id",
    "source",
    "type",
    "specversion",
    "time",
    "subject",
    "datacontenttype",
    "dataschema",
    "data",
    "data_base64",
];

impl Webhook {
    /// Checks a source's settings and resolves its `env:` secrets. Errors name the key.
    pub fn build(config: &WebhookConfig) -> Result<Webhook, String> {
        Webhook::build_with(config, &resolve)
    }

    /// `build` with the secrets read by `resolve`.
    fn build_with(
        config: &WebhookConfig,
        resolve: &dyn Fn(&str) -> Result<String, String>,
    ) -> Result<Webhook, String> {
        let v = &config.verify;
        let preset = v.preset.as_str();
        if !matches!(preset, "none" | "basic" | "api-key" | "hmac")
            && presets::scheme(preset).is_none()
        {
            return Err(format!(
                "verify.preset: unknown preset `{preset}` (one of {}, hmac, basic, api-key, none)",
                presets::NAMES.join(", ")
            ));
        }
        let generic = matches!(preset, "hmac" | "api-key");
        if !generic {
            for (key, set) in [
                ("header", v.header.is_some()),
                ("algorithm", v.algorithm.is_some()),
                ("encoding", v.encoding.is_some()),
                ("prefix", v.prefix.is_some()),
                ("signed", v.signed.is_some()),
                ("timestamp_header", v.timestamp_header.is_some()),
                ("timestamp_format", v.timestamp_format.is_some()),
            ] {
                if set {
                    return Err(format!(
                        "verify.{key} applies to the `hmac` and `api-key` presets only"
                    ));
                }
            }
        }
        let scheme = match preset {
            "none" => Scheme::None,
            "basic" => Scheme::Basic,
            "api-key" => Scheme::Token {
                header: header_name(
                    "verify.header",
                    v.header.as_deref().unwrap_or("authorization"),
                )?,
                prefix: v.prefix.clone().unwrap_or_else(|| {
                    if v.header.is_none() {
                        "Bearer ".to_string()
                    } else {
                        String::new()
                    }
                }),
            },
            "hmac" => generic_hmac(v)?,
            name => presets::scheme(name).ok_or_else(|| {
                format!(
                    "verify.preset: unknown preset `{name}` (one of {}, hmac, basic, api-key, none)",
                    presets::NAMES.join(", ")
                )
            })?,
        };
        let mut raw: Vec<String> = v.secrets.clone();
        if let Some(s) = &v.secret {
            raw.insert(0, s.clone());
        }
        if scheme == Scheme::None {
            if !raw.is_empty() {
                return Err("verify.secret: preset `none` takes no secret".to_string());
            }
        } else if raw.is_empty() {
            return Err("verify.secret: a secret is required (or `secrets = [...]`)".to_string());
        }
        let mut secrets = Vec::new();
        for (i, value) in raw.iter().enumerate() {
            let field = if v.secret.is_some() && i == 0 {
                "verify.secret".to_string()
            } else {
                format!("verify.secrets[{}]", i - usize::from(v.secret.is_some()))
            };
            let text = resolve(value).map_err(|m| format!("{field}: {m}"))?;
            if text.is_empty() {
                return Err(format!("{field}: the secret is empty"));
            }
            secrets.push(match scheme {
                Scheme::StandardWebhooks { .. } => {
                    verify::standard_webhooks_key(&text).map_err(|m| format!("{field}: {m}"))?
                }
                _ => Secret::new(text.into_bytes()),
            });
        }
        let tolerance = v.tolerance.unwrap_or(DEFAULT_TOLERANCE);
        if v.tolerance.is_some() && !scheme.has_timestamp() {
            return Err(format!(
                "verify.tolerance: preset `{preset}` signs no timestamp"
            ));
        }
        if tolerance.is_zero() {
            return Err("verify.tolerance must be greater than zero".to_string());
        }
        if let Some(url) = &config.url {
            url::Url::parse(url).map_err(|e| format!("url: `{url}`: {e}"))?;
        } else if scheme.needs_url() {
            return Err(format!(
                "url: preset `{preset}` signs the public URL the provider calls; set `url`"
            ));
        }
        let (kind, fixed_type, type_prefix) = match &config.kind {
            Some(t) => {
                let kind = pick("type", t.header.as_ref(), t.jsonpath.as_ref())?;
                if kind.is_some() && t.value.is_some() {
                    return Err("type: set one of `header`, `jsonpath` or `value`".to_string());
                }
                let prefix = t
                    .prefix
                    .clone()
                    .unwrap_or_else(|| presets::mapping(preset).prefix.to_string());
                (kind, t.value.clone(), prefix)
            }
            None => (None, None, presets::mapping(preset).prefix.to_string()),
        };
        let id = match &config.id {
            Some(i) => {
                let p = pick("id", i.header.as_ref(), i.jsonpath.as_ref())?;
                if p.is_none() {
                    return Err("id: set `header` or `jsonpath`".to_string());
                }
                p
            }
            None => None,
        };
        let mut extensions = Vec::new();
        for (name, header) in &config.extensions {
            let valid = !name.is_empty()
                && name.len() <= 20
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
            if !valid || RESERVED.contains(&name.as_str()) {
                return Err(format!(
                    "extensions.{name}: an extension name is 1 to 20 lower-case letters and digits, and not a CloudEvents attribute"
                ));
            }
            extensions.push((
                name.clone(),
                header_name(&format!("extensions.{name}"), header)?,
            ));
        }
        let source = config
            .source
            .clone()
            .unwrap_or_else(|| format!("/webhooks/{}", config.name.get_ref()));
        if source.is_empty() {
            return Err("source must not be empty".to_string());
        }
        for origin in &config.allowed_origins {
            if origin.is_empty() || HeaderValue::from_str(origin).is_err() {
                return Err(format!("allowed_origins: `{origin}` is not a valid origin"));
            }
        }
        let mapping = presets::mapping(preset);
        let mut paths = probe::Paths::default();
        let dotted = mapping
            .id
            .iter()
            .chain(
                mapping
                    .kind
                    .iter()
                    .flat_map(|(a, b)| std::iter::once(a).chain(b)),
            )
            .chain(mapping.time.iter().map(|(src, _)| src))
            .filter_map(|src| match src {
                Src::Json(path) => Some(*path),
                Src::Header(_) => None,
            });
        for path in dotted.chain(handshake_fields(preset).iter().copied()) {
            paths.add_dotted(path);
        }
        for p in [&id, &kind].into_iter().flatten() {
            if let Pick::Json(steps) = p {
                paths.add(steps);
            }
        }
        Ok(Webhook {
            name: config.name.get_ref().clone(),
            bus: config.bus.clone(),
            preset: preset.to_string(),
            mapping,
            paths,
            scheme,
            secrets,
            tolerance: i64::try_from(tolerance.as_secs()).unwrap_or(i64::MAX),
            id,
            kind,
            fixed_type,
            type_prefix,
            source,
            extensions,
            dedup_window: config.dedup_window.unwrap_or(DEFAULT_DEDUP_WINDOW),
            url: config.url.clone(),
            allowed_origins: config.allowed_origins.clone(),
            allowed_rate: config.allowed_rate,
            rate_limit: config.rate_limit,
        })
    }

    /// The event's `(id, provider's id?, type, time)`.
    fn attributes(&self, inputs: &Inputs<'_>) -> (Option<String>, String, Option<String>) {
        let id = match &self.id {
            Some(p) => inputs.pick(p),
            None => self.mapping.id.iter().find_map(|s| inputs.src(*s)),
        };
        let name = match (&self.fixed_type, &self.kind) {
            (Some(fixed), _) => Some(fixed.clone()),
            (None, Some(p)) => inputs.pick(p),
            (None, None) => self.mapping.kind.iter().find_map(|(first, then)| {
                let first = inputs.src(*first)?;
                Some(match then.and_then(|t| inputs.src(t)) {
                    Some(second) => format!("{first}.{second}"),
                    None => first,
                })
            }),
        };
        let kind = format!(
            "{}{}",
            self.type_prefix,
            name.unwrap_or_else(|| "webhook".to_string())
        );
        let time = self.mapping.time.and_then(|(src, format)| {
            let text = inputs.src(src)?;
            let secs = format.parse(&text)?;
            match format {
                // Keep the provider's precision where it wrote RFC 3339 itself.
                TimeFormat::Rfc3339 => chrono::DateTime::parse_from_rfc3339(&text)
                    .ok()
                    .map(|t| t.to_rfc3339()),
                _ => chrono::DateTime::from_timestamp(secs, 0)
                    .map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
            }
        });
        (id, kind, time)
    }
}

fn generic_hmac(v: &VerifyConfig) -> Result<Scheme, String> {
    let header = header_name(
        "verify.header",
        v.header
            .as_deref()
            .ok_or("verify.header: the `hmac` preset needs the signature's header")?,
    )?;
    let algorithm = match v.algorithm.as_deref().unwrap_or("sha256") {
        "sha1" => Algorithm::Sha1,
        "sha256" => Algorithm::Sha256,
        "sha512" => Algorithm::Sha512,
        other => {
            return Err(format!(
                "verify.algorithm: `{other}` (sha1, sha256 or sha512)"
            ))
        }
    };
    let encoding = match v.encoding.as_deref().unwrap_or("hex") {
        "hex" => Encoding::Hex,
        "base64" => Encoding::Base64,
        other => return Err(format!("verify.encoding: `{other}` (hex or base64)")),
    };
    let signed = verify::parse_template(v.signed.as_deref().unwrap_or("{body}"))
        .map_err(|m| format!("verify.signed: {m}"))?;
    let uses_ts = signed.contains(&verify::Part::Timestamp);
    let timestamp = match (&v.timestamp_header, uses_ts) {
        (Some(h), _) => Some(TimestampSpec {
            header: header_name("verify.timestamp_header", h)?,
            format: match v.timestamp_format.as_deref().unwrap_or("unix") {
                "unix" => TimeFormat::UnixSeconds,
                "unix-ms" => TimeFormat::UnixMillis,
                "rfc3339" => TimeFormat::Rfc3339,
                other => {
                    return Err(format!(
                        "verify.timestamp_format: `{other}` (unix, unix-ms or rfc3339)"
                    ))
                }
            },
        }),
        (None, true) => {
            return Err("verify.signed uses {timestamp}: set verify.timestamp_header".to_string())
        }
        (None, false) => {
            if v.timestamp_format.is_some() {
                return Err("verify.timestamp_format needs verify.timestamp_header".to_string());
            }
            None
        }
    };
    Ok(Scheme::Hmac {
        header,
        algorithm,
        encoding,
        prefix: v.prefix.clone().unwrap_or_default(),
        signed,
        timestamp,
    })
}

/// Where a webhook source is declared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The replica's own configuration file (its secrets may be literal; other replicas
    /// do not know it).
    File,
    /// The catalog (admin API, `sluice ctl apply`): every replica serves it.
    Catalog,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::File => "file",
            Origin::Catalog => "catalog",
        }
    }
}

/// Every webhook source this replica serves, and the dedup store they share.
pub struct Webhooks {
    by_name: HashMap<String, (Arc<Webhook>, Origin)>,
    /// Catalog sources this replica cannot serve (a secret's environment variable is not
    /// set here), with why: their requests are answered 503.
    unavailable: HashMap<String, String>,
    dedup: Arc<dyn Dedup>,
    /// The file's sources as configured (kept to merge with each catalog version).
    file: Arc<[WebhookConfig]>,
    /// `admin.secret_env_prefix`: the variables the catalog's sources may read.
    secret_prefix: Arc<str>,
}

impl Webhooks {
    pub fn empty() -> Webhooks {
        Webhooks {
            by_name: HashMap::new(),
            unavailable: HashMap::new(),
            dedup: Arc::new(MemoryDedup::default()),
            file: Arc::from(Vec::new()),
            secret_prefix: Arc::from(crate::config::DEFAULT_SECRET_ENV_PREFIX),
        }
    }

    /// Each webhook source's (name, bus, preset, origin), sorted by name.
    pub fn list(&self) -> Vec<(String, String, String, Origin)> {
        let mut all: Vec<_> = self
            .by_name
            .values()
            .map(|(h, origin)| (h.name.clone(), h.bus.clone(), h.preset.clone(), *origin))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// The catalog sources this replica cannot serve, and why.
    pub fn unavailable(&self) -> &HashMap<String, String> {
        &self.unavailable
    }

    /// Whether the replica's own file declares a source of this name.
    pub fn in_file(&self, name: &str) -> bool {
        self.file.iter().any(|c| c.name.get_ref() == name)
    }

    /// The bus of each source of this replica's file, by name.
    pub fn file_buses(&self) -> impl Iterator<Item = (&str, &str)> {
        self.file
            .iter()
            .map(|c| (c.name.get_ref().as_str(), c.bus.as_str()))
    }

    /// `admin.secret_env_prefix`, as the catalog's sources are held to it.
    pub fn secret_prefix(&self) -> &str {
        &self.secret_prefix
    }

    /// The dedup store (shared with buses that deduplicate CloudEvents).
    pub fn dedup(&self) -> Arc<dyn Dedup> {
        self.dedup.clone()
    }

    /// The file's sources (each must build: an error stops the start) and the catalog's
    /// (one that cannot build here is left unavailable and logged; a name the file also
    /// declares is served as the file says). The file's sources may read any variable and
    /// hold literal secrets (they never leave this replica); the catalog's read only
    /// variables whose names start with `secret_prefix` (`admin.secret_env_prefix`).
    pub fn build(
        file: &[WebhookConfig],
        catalog: &[WebhookConfig],
        dedup: Arc<dyn Dedup>,
        secret_prefix: &str,
    ) -> Result<Webhooks, String> {
        let mut by_name = HashMap::new();
        for config in file {
            let hook = Webhook::build(config)
                .map_err(|m| format!("webhook `{}`: {m}", config.name.get_ref()))?;
            by_name.insert(hook.name.clone(), (Arc::new(hook), Origin::File));
        }
        let mut unavailable = HashMap::new();
        for config in catalog {
            let name = config.name.get_ref();
            if by_name.contains_key(name) {
                tracing::warn!(webhook = %name, "the catalog and this replica's file both declare this webhook source; this replica serves the file's");
                continue;
            }
            match Webhook::build_with(config, &|v| catalog_secret(v, secret_prefix)) {
                Ok(hook) => {
                    by_name.insert(name.clone(), (Arc::new(hook), Origin::Catalog));
                }
                Err(m) => {
                    tracing::error!(webhook = %name, "cannot serve this webhook source of the catalog on this replica: {m}");
                    unavailable.insert(name.clone(), m);
                }
            }
        }
        Ok(Webhooks {
            by_name,
            unavailable,
            dedup,
            file: Arc::from(file.to_vec()),
            secret_prefix: Arc::from(secret_prefix),
        })
    }

    /// The same file sources and dedup store with another catalog version's sources.
    pub fn with_catalog(&self, catalog: &[WebhookConfig]) -> Webhooks {
        match Webhooks::build(&self.file, catalog, self.dedup.clone(), &self.secret_prefix) {
            Ok(hooks) => hooks,
            // The file's sources built when the replica started; they still do unless an
            // environment variable went away, which cannot happen to a running process.
            Err(m) => {
                tracing::error!("cannot rebuild the webhook sources: {m}");
                Webhooks {
                    by_name: self.by_name.clone(),
                    unavailable: self.unavailable.clone(),
                    dedup: self.dedup.clone(),
                    file: self.file.clone(),
                    secret_prefix: self.secret_prefix.clone(),
                }
            }
        }
    }
}

/// A value the static check (`check_catalog`) takes for an `env:` secret: valid for every
/// preset (a Standard Webhooks key is base64 after `whsec_`).
const PLACEHOLDER_SECRET: &str = "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// The top-level fields of a source: a build error that starts with one is about it.
const FIELDS: &[&str] = &[
    "name",
    "bus",
    "verify",
    "type",
    "id",
    "source",
    "extensions",
    "dedup_window",
    "url",
    "allowed_origins",
    "allowed_rate",
    "rate_limit",
];

/// The JSON pointer a build error is about (`verify.secrets[1]: ...` → `/verify/secrets/1`),
/// or empty when it does not start with a field.
fn pointer_of(message: &str) -> String {
    let head = message
        .split([':', ' '])
        .next()
        .unwrap_or_default()
        .trim_end_matches(',');
    let top = head.split(['.', '[']).next().unwrap_or_default();
    if !FIELDS.contains(&top) {
        return String::new();
    }
    let mut pointer = String::new();
    for part in head.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, rest.strip_suffix(']')),
            None => (part, None),
        };
        pointer.push('/');
        pointer.push_str(name);
        if let Some(i) = index {
            pointer.push('/');
            pointer.push_str(i);
        }
    }
    pointer
}

/// Checks a webhook source kept in the catalog, without reading its secrets: every secret
/// must be an `env:NAME` reference (the catalog, shared through the cluster store, never
/// holds a secret; each replica reads the variable from its own environment), and every
/// other setting must be valid. `Err((JSON pointer inside the source, message))`.
pub fn check_catalog(config: &WebhookConfig) -> Result<(), (String, String)> {
    for (pointer, secret) in secret_fields(config) {
        match secret.strip_prefix("env:") {
            Some(var) if !var.is_empty() => {}
            _ => {
                return Err((
                    pointer,
                    "a webhook source in the catalog takes its secrets as `env:NAME` references, read by each replica from its environment (the catalog is shared and never holds a secret); literal secrets belong in a replica's own configuration file".to_string(),
                ))
            }
        }
    }
    if let Some(limit) = &config.rate_limit {
        limit.check().map_err(|m| ("/rate_limit".to_string(), m))?;
    }
    Webhook::build_with(config, &|_| Ok(PLACEHOLDER_SECRET.to_string()))
        .map(|_| ())
        .map_err(|m| (pointer_of(&m), m))
}

/// Every secret of a source's `verify`, with its JSON pointer inside the source.
fn secret_fields(config: &WebhookConfig) -> impl Iterator<Item = (String, &String)> {
    let v = &config.verify;
    v.secret
        .iter()
        .map(|s| ("/verify/secret".to_string(), s))
        .chain(
            v.secrets
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("/verify/secrets/{i}"), s)),
        )
}

/// Checks that this replica can read every secret of a catalog source (the admin API asks
/// before storing one, so a mistyped variable is caught where it is made), each an exposed
/// variable (`secret_prefix`: `admin.secret_env_prefix`).
pub fn check_secrets_here(
    config: &WebhookConfig,
    secret_prefix: &str,
) -> Result<(), (String, String)> {
    Webhook::build_with(config, &|v| catalog_secret(v, secret_prefix))
        .map(|_| ())
        .map_err(|m| (pointer_of(&m), m))
}

/// Reads a secret of a catalog source: an `env:` reference to an exposed variable only.
fn catalog_secret(value: &str, secret_prefix: &str) -> Result<String, String> {
    crate::targets::secret(value, secret_prefix).map_err(|e| e.message)
}

/// The policy checks of a catalog source (see `Channels::check_policy`): each secret is an
/// `env:` reference to an exposed variable. `Err((JSON pointer inside the source, message))`.
pub fn check_catalog_policy(
    config: &WebhookConfig,
    secret_prefix: &str,
) -> Result<(), (String, String)> {
    for (pointer, secret) in secret_fields(config) {
        crate::targets::check_secret_ref(secret, secret_prefix).map_err(|m| (pointer, m))?;
    }
    Ok(())
}

/// Checks the `[[webhooks]]` of a configuration: unique valid names, existing buses, and
/// every setting (secrets resolved). `Err((span of the name, message))`.
pub fn check(
    configs: &[WebhookConfig],
    buses: &std::collections::HashSet<&str>,
) -> Result<(), (std::ops::Range<usize>, String)> {
    let mut names = std::collections::HashSet::new();
    for config in configs {
        let name = config.name.get_ref();
        let at = config.name.span();
        let bad = |m: String| (at.clone(), format!("webhook `{name}`: {m}"));
        crate::config::check_name(name).map_err(|m| bad(format!("name: {m}")))?;
        if !names.insert(name.as_str()) {
            return Err(bad("is defined twice".to_string()));
        }
        if !buses.contains(config.bus.as_str()) {
            return Err(bad(format!("bus `{}` is not defined", config.bus)));
        }
        if let Some(limit) = &config.rate_limit {
            limit.check().map_err(bad)?;
        }
        Webhook::build(config).map_err(bad)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// HTTP

pub fn routes() -> Router<Arc<IngressState>> {
    Router::new().route(
        "/webhooks/{name}",
        post(receive)
            .options(webhook_options)
            .fallback(|m: Method| async move {
                Problem::method_not_allowed(m.as_str(), "POST, OPTIONS")
            }),
    )
}

const REQUEST_ORIGIN: &str = "webhook-request-origin";

/// The CloudEvents Web Hook abuse-protection handshake (CloudEvents HTTP Web Hook §4):
/// `OPTIONS` with `WebHook-Request-Origin` is answered with `WebHook-Allowed-Origin` (and
/// `WebHook-Allowed-Rate` when configured) if the origin is allowed.
fn handshake(headers: &HeaderMap, allowed: &[String], rate: Option<u32>) -> Response {
    let mut response = StatusCode::OK.into_response();
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("POST, OPTIONS"));
    let Some(origin) = headers.get(REQUEST_ORIGIN) else {
        return response;
    };
    let permitted = allowed.is_empty()
        || origin
            .to_str()
            .is_ok_and(|o| allowed.iter().any(|a| a == o || a == "*"));
    if !permitted {
        return Problem::forbidden(
            REQUEST_ORIGIN,
            "this origin may not deliver to this endpoint",
        )
        .into_response();
    }
    let h = response.headers_mut();
    h.insert("webhook-allowed-origin", origin.clone());
    if let Some(rate) = rate {
        h.insert("webhook-allowed-rate", HeaderValue::from(rate));
    }
    response
}

/// `OPTIONS /buses/{bus}/events`: any origin, no announced rate.
pub async fn bus_options(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !state.buses().contains_key(&bus) {
        return Problem::unknown_bus(&bus).into_response();
    }
    handshake(&headers, &[], None)
}

async fn webhook_options(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let webhooks = state.webhooks();
    let Some((hook, _)) = webhooks.by_name.get(&name) else {
        return unknown_webhook(&name).into_response();
    };
    handshake(&headers, &hook.allowed_origins, hook.allowed_rate)
}

fn unknown_webhook(name: &str) -> Problem {
    Problem::unknown(format!("no webhook source named `{name}` is configured")).with_field("name")
}

/// Text that may go in a `ce-*` header: everything outside printable ASCII (and `%`,
/// `"`) percent-encoded, as binary mode expects.
fn ce_value(text: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(&crate::event::header_text(text)).ok()
}

fn generated_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

async fn receive(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    let webhooks = state.webhooks();
    let Some(hook) = webhooks.by_name.get(&name).map(|(h, _)| h.clone()) else {
        if let Some(why) = webhooks.unavailable.get(&name) {
            return Problem::unavailable(
                format!("webhook source `{name}` cannot verify requests on this replica: {why}"),
                30,
            )
            .with_field("verify")
            .into_response();
        }
        return unknown_webhook(&name).into_response();
    };
    let Some(log) = state.buses().get(&hook.bus).cloned() else {
        return Problem::unknown_bus(&hook.bus).into_response();
    };
    let (parts, body) = request.into_parts();
    // Webhook bodies are read for a few fields without a JSON tree.
    let Some(_memory) = state.reserve_memory(&parts.headers, state.limits.max_event_bytes, false)
    else {
        crate::ingress::discard_body(body, state.limits.max_event_bytes).await;
        return Problem::memory_full().into_response();
    };
    let body = match crate::ingress::read_body(
        &parts.headers,
        body,
        state.limits.max_event_bytes,
        "limits.max_event_bytes",
    )
    .await
    {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let called = match &hook.url {
        Some(url) => url.clone(),
        None => format!(
            "http://{}{}",
            parts
                .headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("localhost"),
            parts.uri.path_and_query().map_or("/", |p| p.as_str())
        ),
    };
    // A configured URL is the base: the provider's query string (Twilio's bodySHA256) is
    // what it signed.
    let called = match (&hook.url, parts.uri.query()) {
        (Some(_), Some(q)) if !called.contains('?') => format!("{called}?{q}"),
        _ => called,
    };
    let now = chrono::Utc::now().timestamp();
    let signed = Signed {
        method: parts.method.as_str(),
        url: &called,
        headers: &parts.headers,
        body: &body,
        now,
    };
    if let Err(e) = hook.scheme.verify(&signed, &hook.secrets, hook.tolerance) {
        tracing::debug!(webhook = %hook.name, field = %e.field, "webhook refused: {}", e.message);
        return Problem::unauthorized(e.field, e.message).into_response();
    }
    // Counted after verification: unsigned floods do not eat the provider's budget.
    if let Some(limit) = &hook.rate_limit {
        if let Err(problem) = state
            .rate_limit(&format!("webhook/{}", hook.name), "rate_limit", limit)
            .await
        {
            return problem.into_response();
        }
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let json = content_type
        .as_deref()
        .map(crate::ingress::cloudevent::essence)
        .is_none_or(|e| crate::event::is_json(&e));
    // Only the fields this source reads, without building the document.
    let fields = if json {
        hook.paths.read(&body)
    } else {
        hook.paths.nothing()
    };
    if let Some(answer) = provider_handshake(&hook, &signed, &fields) {
        return answer;
    }
    let inputs = Inputs {
        headers: &parts.headers,
        json: &fields,
    };
    let (provider_id, kind, time) = hook.attributes(&inputs);
    let id = provider_id.clone().unwrap_or_else(generated_id);
    let mut ce = HeaderMap::new();
    let mut attributes = vec![
        ("ce-specversion", "specversion", "1.0".to_string()),
        ("ce-id", "id", id.clone()),
        ("ce-source", "source", hook.source.clone()),
        ("ce-type", "type", kind),
    ];
    if let Some(t) = time {
        attributes.push(("ce-time", "time", t));
    }
    for (name, field, value) in attributes {
        match ce_value(&value) {
            Some(v) => {
                ce.insert(HeaderName::from_static(name), v);
            }
            None => {
                return Problem::bad_request(field, "the value cannot be carried").into_response()
            }
        }
    }
    for (ext, from) in &hook.extensions {
        if let Some(value) = inputs.header(from) {
            let Ok(name) = HeaderName::from_bytes(format!("ce-{ext}").as_bytes()) else {
                continue;
            };
            match ce_value(&value) {
                Some(v) => {
                    ce.insert(name, v);
                }
                None => return Problem::bad_request(from.clone(), "not carried").into_response(),
            }
        }
    }
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        ce.insert(header::CONTENT_TYPE, ct.clone());
    }
    let parsed = crate::ingress::cloudevent::from_binary(&ce, &body);
    let parsed = match state.bus_schemas(&hook.bus) {
        Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
        None => parsed,
    };
    let entry = crate::ingress::entry(parsed, log.shards(), &state.limits);
    if let Err(e) = &entry {
        return crate::ingress::event_problem(e.clone()).into_response();
    }
    // Deduplicate only on the provider's own id: a generated one never repeats.
    let key = provider_id
        .filter(|_| !hook.dedup_window.is_zero())
        .map(|id| dedup::key(&["webhook", &hook.name, &id]));
    let entries = [entry];
    let (stored, duplicate) = match key {
        None => (crate::ingress::store(log.as_ref(), &entries).await, false),
        Some(key) => match crate::ingress::store_unique(
            log.as_ref(),
            webhooks.dedup.as_ref(),
            &entries,
            &[Some(key)],
            hook.dedup_window,
        )
        .await
        {
            Ok((stored, duplicates)) => (stored, duplicates.first() == Some(&true)),
            Err(e) => return crate::ingress::store_problem(&e).into_response(),
        },
    };
    if duplicate {
        return (
            StatusCode::OK,
            Json(json!({"id": id, "status": "duplicate"})),
        )
            .into_response();
    }
    match stored.into_iter().next().flatten() {
        Some(Ok(())) => (
            StatusCode::ACCEPTED,
            Json(json!({"id": id, "status": "accepted"})),
        )
            .into_response(),
        // The same delivery is being stored by another request: its retry gets the answer.
        Some(Err(e @ crate::store::StoreError::Busy(_))) => crate::ingress::store_problem(&e)
            .with_field("id")
            .into_response(),
        Some(Err(e)) => crate::ingress::store_problem(&e).into_response(),
        None => Problem::internal("the event was not stored").into_response(),
    }
}

/// Reserves a delivery id; while another request holds it, waits (bounded) for that one
/// to finish, so a concurrent retry gets the real answer (duplicate, or taken over after a
/// failed store) instead of a 503.
pub(crate) async fn reserve(
    dedup: &dyn Dedup,
    key: &str,
) -> Result<Reserve, crate::store::StoreError> {
    for _ in 0..40 {
        match dedup.reserve(key).await? {
            Reserve::InFlight => tokio::time::sleep(Duration::from_millis(50)).await,
            other => return Ok(other),
        }
    }
    Ok(Reserve::InFlight)
}

/// The providers' own endpoint checks, answered once the request's signature is verified
/// (Zoom's answer is an HMAC of a token the caller picks: unverified, it would sign
/// anything).
fn provider_handshake(
    hook: &Webhook,
    request: &Signed<'_>,
    json: &probe::Fields<'_>,
) -> Option<Response> {
    let headers = request.headers;
    let text = |path: &str| json.get_dotted(path).and_then(Value::as_str);
    match hook.preset.as_str() {
        "slack" if text("type") == Some("url_verification") => {
            let challenge = text("challenge")?;
            Some((StatusCode::OK, Json(json!({"challenge": challenge}))).into_response())
        }
        "zoom" if text("event") == Some("endpoint.url_validation") => {
            let plain = text("payload.plainToken")?;
            // The secret that signed this request (with several configured, in rotation).
            let secret = hook.secrets.iter().find(|s| {
                hook.scheme
                    .verify(request, std::slice::from_ref(s), hook.tolerance)
                    .is_ok()
            })?;
            let encrypted = verify::hex(&verify::hmac(
                Algorithm::Sha256,
                secret.bytes(),
                &[plain.as_bytes()],
            ));
            Some(
                (
                    StatusCode::OK,
                    Json(json!({"plainToken": plain, "encryptedToken": encrypted})),
                )
                    .into_response(),
            )
        }
        "twitch"
            if headers
                .get("twitch-eventsub-message-type")
                .is_some_and(|v| v == "webhook_callback_verification") =>
        {
            let challenge = text("challenge")?;
            let mut r = (StatusCode::OK, challenge.to_string()).into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            Some(r)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn paths_parse() {
        assert_eq!(
            parse_path("$.a.b[2].c").unwrap(),
            vec![
                Step::Key("a".into()),
                Step::Key("b".into()),
                Step::Index(2),
                Step::Key("c".into())
            ]
        );
        assert!(parse_path("$.a..b").is_err());
        assert!(parse_path("$.a[x]").is_err());
        let mut paths = probe::Paths::default();
        let path = parse_path("a.b[2].c").unwrap();
        paths.add(&path);
        let body = json!({"a": {"b": [0, 1, {"c": "x"}]}}).to_string();
        assert_eq!(paths.read(body.as_bytes()).get(&path), Some(&json!("x")));
    }

    fn config(text: &str) -> Result<Webhook, String> {
        let c: WebhookConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        Webhook::build(&c)
    }

    #[test]
    fn settings_are_checked_with_the_key_named() {
        let base = "name = \"w\"\nbus = \"b\"\n";
        let err = |t: &str| config(&format!("{base}{t}")).err().unwrap_or_default();
        assert!(err("verify = { preset = \"github\" }").contains("verify.secret"));
        assert!(err("verify = { preset = \"nope\", secret = \"s\" }").contains("verify.preset"));
        assert!(
            err("verify = { preset = \"github\", secret = \"env:SLUICE_UNSET_VAR_X\" }")
                .contains("SLUICE_UNSET_VAR_X is not set")
        );
        assert!(err("verify = { preset = \"twilio\", secret = \"s\" }").contains("url"));
        assert!(
            err("verify = { preset = \"github\", secret = \"s\", tolerance = \"1m\" }")
                .contains("verify.tolerance")
        );
        assert!(err("verify = { preset = \"hmac\", secret = \"s\" }").contains("verify.header"));
        assert!(err(
            "verify = { preset = \"hmac\", secret = \"s\", header = \"x-sig\", signed = \"{timestamp}.{body}\" }"
        )
        .contains("timestamp_header"));
        assert!(err(
            "verify = { preset = \"github\", secret = \"s\" }\nextensions = { Bad = \"x\" }"
        )
        .contains("extensions.Bad"));
        assert!(
            err("verify = { preset = \"github\", secret = \"s\", bogus = 1 }").contains("bogus")
        );
        assert!(config(&format!(
            "{base}verify = {{ preset = \"hmac\", secrets = [\"a\", \"b\"], header = \"x-sig\", algorithm = \"sha512\", encoding = \"base64\", signed = \"{{timestamp}}.{{body}}\", timestamp_header = \"x-ts\" }}"
        ))
        .is_ok());
    }

    #[test]
    fn catalog_sources_take_env_secrets_and_errors_point_at_the_field() {
        let parse = |text: &str| -> WebhookConfig { toml::from_str(text).unwrap() };
        let base = "name = \"h\"\nbus = \"b\"\n";
        let check = |verify: &str| {
            check_catalog(&parse(&format!("{base}verify = {{ {verify} }}\n")))
                .map_err(|(pointer, _)| pointer)
        };
        // No variable needs to be set for the static check, whatever the preset.
        for preset in ["standard-webhooks", "github", "stripe", "basic", "api-key"] {
            assert_eq!(
                check(&format!(
                    "preset = \"{preset}\", secret = \"env:SLUICE_TEST_UNSET_VARIABLE\""
                )),
                Ok(())
            );
        }
        assert_eq!(check("preset = \"none\""), Ok(()));
        assert_eq!(
            check("preset = \"github\", secret = \"literal\""),
            Err("/verify/secret".to_string())
        );
        assert_eq!(
            check("preset = \"github\", secrets = [\"env:A\", \"literal\"]"),
            Err("/verify/secrets/1".to_string())
        );
        assert_eq!(
            check("preset = \"nope\", secret = \"env:A\", header = \"x\""),
            Err("/verify/preset".to_string())
        );
        assert_eq!(
            check("preset = \"github\", secret = \"env:A\", tolerance = \"1m\""),
            Err("/verify/tolerance".to_string())
        );
        assert_eq!(
            check_catalog(&parse(&format!(
                "{base}verify = {{ preset = \"twilio\", secret = \"env:A\" }}\n"
            )))
            .map_err(|(p, _)| p),
            Err("/url".to_string())
        );
        // Reading the secrets here names the variable that is missing.
        let missing = check_secrets_here(
            &parse(&format!(
                "{base}verify = {{ preset = \"github\", secret = \"env:SLUICE_TEST_UNSET_VARIABLE\" }}\n"
            )),
            "SLUICE_TEST_",
        )
        .unwrap_err();
        assert_eq!(missing.0, "/verify/secret");
        // Only exposed variables, whatever this replica's environment holds.
        let hidden = check_secrets_here(
            &parse(&format!(
                "{base}verify = {{ preset = \"github\", secret = \"env:PATH\" }}\n"
            )),
            "SLUICE_SECRET_",
        )
        .unwrap_err();
        assert_eq!(hidden.0, "/verify/secret");
        assert!(
            hidden.1.contains("`PATH` is not an exposed secret"),
            "{}",
            hidden.1
        );
        assert!(
            missing.1.contains("SLUICE_TEST_UNSET_VARIABLE"),
            "{}",
            missing.1
        );
        assert_eq!(pointer_of("type: set one of"), "/type");
        assert_eq!(pointer_of("something else: x"), "");
    }

    #[test]
    fn a_source_round_trips_through_the_stored_toml() {
        let text = "[[webhooks]]\nname = \"h\"\nbus = \"b\"\nverify = { preset = \"hmac\", secrets = [\"env:A\", \"env:B\"], header = \"x-sig\", tolerance = \"90s\", signed = \"{timestamp}.{body}\", timestamp_header = \"x-ts\" }\ntype = { jsonpath = \"$.kind\", prefix = \"com.x.\" }\nid = { header = \"x-id\" }\nextensions = { tenant = \"x-tenant\" }\ndedup_window = \"1h\"\nallowed_origins = [\"https://a.example\"]\nallowed_rate = 5\nrate_limit = { per_second = 2.5, burst = 3 }\n";
        let channels: crate::config::Channels = toml::from_str(text).unwrap();
        let stored = channels.to_toml().unwrap();
        let back = crate::config::Channels::from_toml(&stored).unwrap();
        assert_eq!(
            serde_json::to_value(&back.webhooks).unwrap(),
            serde_json::to_value(&channels.webhooks).unwrap(),
            "{stored}"
        );
        assert_eq!(
            back.webhooks[0].dedup_window,
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            back.webhooks[0].verify.tolerance,
            Some(Duration::from_secs(90))
        );
    }

    #[test]
    fn a_github_request_maps_to_its_event() {
        let hook = config(
            "name = \"gh\"\nbus = \"b\"\nverify = { preset = \"github\", secret = \"s\" }\n",
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-github-delivery", HeaderValue::from_static("d-1"));
        h.insert("x-github-event", HeaderValue::from_static("issues"));
        let body = json!({"action": "opened", "issue": {"title": "x"}}).to_string();
        let fields = hook.paths.read(body.as_bytes());
        let (id, kind, time) = hook.attributes(&Inputs {
            headers: &h,
            json: &fields,
        });
        assert_eq!(id.as_deref(), Some("d-1"));
        assert_eq!(kind, "com.github.issues.opened");
        assert_eq!(time, None);
        assert_eq!(ce_value("a b%\"").unwrap(), "a%20b%25%22");
    }
}
