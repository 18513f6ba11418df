//! A webhook source ready to serve (`Webhook`: verification scheme, secrets, mapping), and
//! every source a replica serves (`Webhooks`: the file's and the catalog's).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use serde_json::Value;

use crate::ingress::webhooks::config::*;
use crate::ingress::webhooks::presets::{self, Mapping, Src};
use crate::ingress::webhooks::probe::{self, Step};
use crate::ingress::webhooks::verify::{
    self, Algorithm, Encoding, Scheme, Secret, TimeFormat, TimestampSpec,
};
use crate::store::dedup::Dedup;
use crate::store::embedded::MemoryDedup;

// ---------------------------------------------------------------------------------------
// Runtime form

/// A value taken from the request.
#[derive(Debug, Clone)]
pub(super) enum Pick {
    Header(String),
    Json(Vec<Step>),
}

/// Parses `$.a.b[0].c` (or `a.b`): names and indexes only, which is what the one-pass
/// field reader (`probe`) can follow without building the document (a JSONPath engine such
/// as `jsonpath-rust` needs the whole tree first).
pub(super) fn parse_path(text: &str) -> Result<Vec<Step>, String> {
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
pub(super) fn scalar(value: &Value) -> Option<String> {
    match value {
        Value::String(s) if !s.is_empty() => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

pub(super) struct Inputs<'a> {
    pub(super) headers: &'a HeaderMap,
    /// The body's fields this source reads (`Webhook::paths`).
    pub(super) json: &'a probe::Fields<'a>,
}

impl Inputs<'_> {
    pub(super) fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
            .map(str::to_string)
    }

    pub(super) fn src(&self, src: Src) -> Option<String> {
        match src {
            Src::Header(h) => self.header(h),
            Src::Json(path) => self.json.get_dotted(path).and_then(scalar),
        }
    }

    pub(super) fn pick(&self, pick: &Pick) -> Option<String> {
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
    pub(super) preset: String,
    pub(super) scheme: Scheme,
    pub(super) secrets: Vec<Secret>,
    pub(super) tolerance: i64,
    pub(super) mapping: Mapping,
    pub(super) id: Option<Pick>,
    pub(super) kind: Option<Pick>,
    pub(super) fixed_type: Option<String>,
    pub(super) type_prefix: String,
    pub(super) source: String,
    pub(super) extensions: Vec<(String, String)>,
    pub(super) dedup_window: Duration,
    pub(super) url: Option<String>,
    pub(super) allowed_origins: Vec<String>,
    pub(super) allowed_rate: Option<u32>,
    pub(super) rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
    /// Every field of the JSON body this source reads (ids, names, times, handshakes).
    pub(super) paths: probe::Paths,
}

/// The body fields a preset's handshake reads (`provider_handshake`).
pub(super) fn handshake_fields(preset: &str) -> &'static [&'static str] {
    match preset {
        "slack" => &["type", "challenge"],
        "zoom" => &["event", "payload.plainToken"],
        "twitch" => &["challenge"],
        _ => &[],
    }
}

pub(super) fn resolve(value: &str) -> Result<String, String> {
    match value.strip_prefix("env:") {
        Some(var) => {
            std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
        }
        None => Ok(value.to_string()),
    }
}

pub(super) fn header_name(field: &str, name: &str) -> Result<String, String> {
    HeaderName::from_bytes(name.as_bytes())
        .map(|h| h.as_str().to_string())
        .map_err(|_| format!("{field}: `{name}` is not a valid header name"))
}

pub(super) fn pick(
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
pub(super) const RESERVED: &[&str] = &[
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
    pub(super) fn build_with(
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
    pub(super) fn attributes(
        &self,
        inputs: &Inputs<'_>,
    ) -> (Option<String>, String, Option<String>) {
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

pub(super) fn generic_hmac(v: &VerifyConfig) -> Result<Scheme, String> {
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
    pub(super) by_name: HashMap<String, (Arc<Webhook>, Origin)>,
    /// Catalog sources this replica cannot serve (a secret's environment variable is not
    /// set here), with why: their requests are answered 503.
    pub(super) unavailable: HashMap<String, String>,
    pub(super) dedup: Arc<dyn Dedup>,
    /// The file's sources as configured (kept to merge with each catalog version).
    pub(super) file: Arc<[WebhookConfig]>,
    /// `admin.secret_env_prefix`: the variables the catalog's sources may read.
    pub(super) secret_prefix: Arc<str>,
}

impl Webhooks {
    pub fn empty() -> Webhooks {
        Webhooks {
            by_name: HashMap::new(),
            unavailable: HashMap::new(),
            dedup: Arc::new(MemoryDedup::default()),
            file: Arc::from(Vec::new()),
            secret_prefix: Arc::from(crate::values::DEFAULT_SECRET_ENV_PREFIX),
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

/// Reads a secret of a catalog source: an `env:` reference to an exposed variable only.
pub(super) fn catalog_secret(value: &str, secret_prefix: &str) -> Result<String, String> {
    crate::secrets::secret(value, secret_prefix)
}
