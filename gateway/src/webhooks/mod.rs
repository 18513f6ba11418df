//! Webhook sources: `POST /webhooks/{name}` receives a provider's webhook, verifies its
//! signature (`verify`, `presets`), answers the provider's handshakes, drops replays of a
//! delivery id (`dedup`), and stores the request as one CloudEvent on the source's bus
//! through the same path as binary-mode ingress. Also the CloudEvents Web Hook
//! abuse-protection handshake (`OPTIONS`) for webhook sources and buses.

pub mod dedup;
pub mod presets;
pub mod verify;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};
use toml::Spanned;

use crate::ingress::IngressState;
use crate::problem::Problem;
use dedup::{Dedup, MemoryDedup, Reserve};
use presets::{Mapping, Src};
use verify::{Algorithm, Encoding, Scheme, Secret, Signed, TimeFormat, TimestampSpec};

/// The default replay window of a delivery id.
pub const DEFAULT_DEDUP_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The default tolerance of a signed timestamp.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------
// Configuration

/// `[[webhooks]]`: one webhook source.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub name: Spanned<String>,
    pub bus: String,
    pub verify: VerifyConfig,
    /// Where the event's `type` comes from (default: the preset's event name).
    #[serde(default, rename = "type")]
    pub kind: Option<TypeConfig>,
    /// Where the delivery id comes from (default: the preset's).
    #[serde(default)]
    pub id: Option<ValueConfig>,
    /// The event's `source` (default `/webhooks/{name}`).
    #[serde(default)]
    pub source: Option<String>,
    /// Extension name → request header kept as that extension.
    #[serde(default)]
    pub extensions: BTreeMap<String, String>,
    /// How long a delivery id is remembered (`0s`: no deduplication).
    #[serde(default, deserialize_with = "optional_duration")]
    pub dedup_window: Option<Duration>,
    /// The public URL providers call (signed by twilio, square, hubspot).
    #[serde(default)]
    pub url: Option<String>,
    /// Origins the `OPTIONS` handshake allows (empty: any).
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Requests per minute announced in `WebHook-Allowed-Rate`.
    #[serde(default)]
    pub allowed_rate: Option<u32>,
    /// Verified requests per second this source takes (token bucket, shared by the
    /// cluster); more are answered `429` with `Retry-After`.
    #[serde(default)]
    pub rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
}

/// `verify = { preset = "...", secret = "..." }`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyConfig {
    pub preset: String,
    #[serde(default)]
    pub secret: Option<String>,
    #[serde(default)]
    pub secrets: Vec<String>,
    #[serde(default, deserialize_with = "optional_duration")]
    pub tolerance: Option<Duration>,
    // `hmac` and `api-key`:
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub algorithm: Option<String>,
    #[serde(default)]
    pub encoding: Option<String>,
    #[serde(default)]
    pub prefix: Option<String>,
    #[serde(default)]
    pub signed: Option<String>,
    #[serde(default)]
    pub timestamp_header: Option<String>,
    #[serde(default)]
    pub timestamp_format: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypeConfig {
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub jsonpath: Option<String>,
    /// A fixed type.
    #[serde(default)]
    pub value: Option<String>,
    #[serde(default)]
    pub prefix: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ValueConfig {
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
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

#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Key(String),
    Index(usize),
}

/// Parses `$.a.b[0].c` (or `a.b`): names and indexes only.
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

fn walk<'a>(value: &'a Value, steps: &[Step]) -> Option<&'a Value> {
    steps.iter().try_fold(value, |v, step| match step {
        Step::Key(k) => v.get(k),
        Step::Index(i) => v.get(i),
    })
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
    json: Option<&'a Value>,
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
            Src::Json(path) => {
                let steps: Vec<Step> = path.split('.').map(|k| Step::Key(k.to_string())).collect();
                self.json.and_then(|j| walk(j, &steps)).and_then(scalar)
            }
        }
    }

    fn pick(&self, pick: &Pick) -> Option<String> {
        match pick {
            Pick::Header(h) => self.header(h),
            Pick::Json(steps) => self.json.and_then(|j| walk(j, steps)).and_then(scalar),
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
        let v = &config.verify;
        let preset = v.preset.as_str();
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
        Ok(Webhook {
            name: config.name.get_ref().clone(),
            bus: config.bus.clone(),
            preset: preset.to_string(),
            mapping: presets::mapping(preset),
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

/// Every webhook source of the running configuration, and the dedup store they share.
pub struct Webhooks {
    by_name: HashMap<String, Arc<Webhook>>,
    dedup: Arc<dyn Dedup>,
}

impl Webhooks {
    pub fn empty() -> Webhooks {
        Webhooks {
            by_name: HashMap::new(),
            dedup: Arc::new(MemoryDedup::default()),
        }
    }

    /// Each webhook source's (name, bus, preset), sorted by name.
    pub fn list(&self) -> Vec<(String, String, String)> {
        let mut all: Vec<_> = self
            .by_name
            .values()
            .map(|h| (h.name.clone(), h.bus.clone(), h.preset.clone()))
            .collect();
        all.sort();
        all
    }

    /// Each webhook source's (name, bus).
    pub fn buses(&self) -> impl Iterator<Item = (&str, &str)> {
        self.by_name
            .values()
            .map(|h| (h.name.as_str(), h.bus.as_str()))
    }

    /// The dedup store (shared with buses that deduplicate CloudEvents).
    pub fn dedup(&self) -> Arc<dyn Dedup> {
        self.dedup.clone()
    }

    pub fn build(configs: &[WebhookConfig], dedup: Arc<dyn Dedup>) -> Result<Webhooks, String> {
        let mut by_name = HashMap::new();
        for config in configs {
            let hook = Webhook::build(config)
                .map_err(|m| format!("webhook `{}`: {m}", config.name.get_ref()))?;
            by_name.insert(hook.name.clone(), Arc::new(hook));
        }
        Ok(Webhooks { by_name, dedup })
    }
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
    let Some(hook) = webhooks.by_name.get(&name) else {
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
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x21..0x7f).contains(&b) && b != b'%' && b != b'"' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    HeaderValue::from_str(&out).ok()
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
    let Some(hook) = webhooks.by_name.get(&name).cloned() else {
        return unknown_webhook(&name).into_response();
    };
    let Some(log) = state.buses().get(&hook.bus).cloned() else {
        return Problem::unknown_bus(&hook.bus).into_response();
    };
    let (parts, body) = request.into_parts();
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
    let json: Option<Value> = if content_type
        .as_deref()
        .map(crate::ingress::cloudevent::essence)
        .is_none_or(|e| crate::ingress::cloudevent::is_json(&e))
    {
        serde_json::from_slice(&body).ok()
    } else {
        None
    };
    if let Some(answer) = provider_handshake(&hook, &signed, json.as_ref()) {
        return answer;
    }
    let inputs = Inputs {
        headers: &parts.headers,
        json: json.as_ref(),
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
        .map(|id| format!("{}:{id}", hook.name));
    let token = match &key {
        None => None,
        Some(key) => match reserve(webhooks.dedup.as_ref(), key).await {
            Ok(Reserve::Taken(token)) => Some(token),
            Ok(Reserve::Duplicate) => {
                return (
                    StatusCode::OK,
                    Json(json!({"id": id, "status": "duplicate"})),
                )
                    .into_response()
            }
            Ok(Reserve::InFlight) => {
                return Problem::unavailable(
                    "the same delivery is being stored by another request; retry shortly",
                    1,
                )
                .with_field("id")
                .into_response()
            }
            Err(e) => return crate::ingress::store_problem(&e).into_response(),
        },
    };
    let stored = crate::ingress::store(log.as_ref(), std::slice::from_ref(&entry)).await;
    let result = stored.into_iter().next().flatten();
    match (result, key, token) {
        (Some(Ok(())), key, token) => {
            if let (Some(key), Some(token)) = (key, token) {
                if let Err(e) = webhooks
                    .dedup
                    .confirm(&key, &token, hook.dedup_window)
                    .await
                {
                    // Stored: the provider must hear so. A retry of it may be stored again.
                    tracing::warn!(webhook = %hook.name, error = %e, "cannot record the delivery id");
                }
            }
            (
                StatusCode::ACCEPTED,
                Json(json!({"id": id, "status": "accepted"})),
            )
                .into_response()
        }
        (failed, key, token) => {
            if let (Some(key), Some(token)) = (key, token) {
                if let Err(e) = webhooks.dedup.release(&key, &token).await {
                    tracing::warn!(webhook = %hook.name, error = %e, "cannot release the delivery id");
                }
            }
            match failed {
                Some(Err(e)) => crate::ingress::store_problem(&e).into_response(),
                _ => Problem::internal("the event was not stored").into_response(),
            }
        }
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
    json: Option<&Value>,
) -> Option<Response> {
    let json = json?;
    let headers = request.headers;
    match hook.preset.as_str() {
        "slack" if json.get("type").and_then(Value::as_str) == Some("url_verification") => {
            let challenge = json.get("challenge").and_then(Value::as_str)?;
            Some((StatusCode::OK, Json(json!({"challenge": challenge}))).into_response())
        }
        "zoom" if json.get("event").and_then(Value::as_str) == Some("endpoint.url_validation") => {
            let plain = json
                .pointer("/payload/plainToken")
                .and_then(Value::as_str)?;
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
            let challenge = json.get("challenge").and_then(Value::as_str)?;
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
        let v = json!({"a": {"b": [0, 1, {"c": "x"}]}});
        assert_eq!(
            walk(&v, &parse_path("a.b[2].c").unwrap()),
            Some(&json!("x"))
        );
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
    fn a_github_request_maps_to_its_event() {
        let hook = config(
            "name = \"gh\"\nbus = \"b\"\nverify = { preset = \"github\", secret = \"s\" }\n",
        )
        .unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-github-delivery", HeaderValue::from_static("d-1"));
        h.insert("x-github-event", HeaderValue::from_static("issues"));
        let body = json!({"action": "opened"});
        let (id, kind, time) = hook.attributes(&Inputs {
            headers: &h,
            json: Some(&body),
        });
        assert_eq!(id.as_deref(), Some("d-1"));
        assert_eq!(kind, "com.github.issues.opened");
        assert_eq!(time, None);
        assert_eq!(ce_value("a b%\"").unwrap(), "a%20b%25%22");
    }
}
