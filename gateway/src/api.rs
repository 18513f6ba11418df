//! The admin API, `/api/v1`: buses, rules and sources as resources of the catalog
//! (create, read, replace, delete, with optimistic concurrency), connectors and tasks
//! (status, lag, positions, pause, resume, restart), the cluster (workers, assignment,
//! strategy), rule tests, and the OpenAPI description of all of it.
//!
//! Resources use the configuration file's field names, as JSON. Each has a `version` (the
//! catalog version at which it last changed) and answers with it as its `ETag`; a write
//! with `If-Match` naming an older version is refused with 412, so of two concurrent
//! writers exactly one wins. Every change is checked by the configuration loader's own
//! checks; a refusal is problem+json naming the field by JSON pointer.
//!
//! Credentials: a bearer token whose SHA-256 is in `admin.tokens` (or the token in
//! `SLUICE_ADMIN_TOKEN`). With none configured the gateway generates one (kept in
//! `{data_dir}/admin-token`, printed at start-up), unless `admin.allow_local_without_token`
//! lets loopback clients in without one (never through a proxy). Before the credentials,
//! `guard` refuses what a browser could send cross-site: a foreign `Host` (DNS
//! rebinding), and for state-changing requests a foreign `Origin` or `Sec-Fetch-Site` and a
//! body that is not JSON. `/api/v1/openapi.json` and `/api/v1/scaling` (read by
//! autoscalers) are open, like `/metrics`.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::catalog::{self, Catalog, ChangeError, Snapshot};
use crate::config::{AdminConfig, BusConfig, Channels, Kind, RuleConfig};
use crate::ingress::IngressState;
use crate::problem::Problem;
use crate::sources::SourceConfig;
use crate::store::cluster::task_id;
use crate::webhooks::WebhookConfig;

/// The OpenAPI description of `/api/v1`, kept in `schemas/` and checked against the
/// routes by the tests.
pub const OPENAPI: &str = include_str!("../../schemas/openapi.json");

/// The largest admin request body.
const MAX_BODY: usize = 1024 * 1024;

/// Who may use the admin API, and from where (`Host`, `Origin`).
#[derive(Debug, Default)]
pub struct AdminAuth {
    /// SHA-256 of each accepted token.
    hashes: Vec<[u8; 32]>,
    /// `admin.allow_local_without_token` (only meaningful without tokens).
    allow_local: bool,
    /// `admin.allowed_hosts`, lowercased; `*` is kept as `any_host`.
    allowed_hosts: Vec<String>,
    any_host: bool,
    /// `admin.allowed_origins`, lowercased, without a trailing slash.
    allowed_origins: Vec<String>,
    /// The cluster's assignment strategy, reported by `/api/v1/cluster`.
    pub strategy: String,
    /// Events per delivery of a replay (`delivery.batch_size`).
    pub replay_batch: usize,
}

/// The file, in the data directory, holding the token generated when none is configured.
pub const TOKEN_FILE: &str = "admin-token";

impl AdminAuth {
    /// From `[admin]` and `SLUICE_ADMIN_TOKEN`. With no token and no local opt-in, a
    /// token is generated (or read back) in `{data_dir}/admin-token` and printed.
    pub fn from_config(
        config: &AdminConfig,
        strategy: &str,
        replay_batch: usize,
        data_dir: &std::path::Path,
    ) -> Result<AdminAuth, String> {
        let mut hashes = Vec::new();
        for (i, token) in config.tokens.iter().enumerate() {
            hashes.push(parse_hash(token).map_err(|m| format!("admin.tokens[{i}]: {m}"))?);
        }
        if let Ok(token) = std::env::var("SLUICE_ADMIN_TOKEN") {
            if !token.is_empty() {
                hashes.push(Sha256::digest(token.as_bytes()).into());
            }
        }
        let mut allowed_hosts = Vec::new();
        let mut any_host = false;
        for (i, host) in config.allowed_hosts.iter().enumerate() {
            let host = host.trim().to_ascii_lowercase();
            if host == "*" {
                any_host = true;
            } else if host.is_empty() || split_host(&host).is_none() {
                return Err(format!(
                    "admin.allowed_hosts[{i}]: `{host}` is not `host`, `host:port` or `*`"
                ));
            } else {
                allowed_hosts.push(host);
            }
        }
        let mut allowed_origins = Vec::new();
        for (i, origin) in config.allowed_origins.iter().enumerate() {
            let origin = normal_origin(origin);
            if origin_authority(&origin).is_none() {
                return Err(format!(
                    "admin.allowed_origins[{i}]: `{origin}` is not an origin such as `https://console.example.com`"
                ));
            }
            allowed_origins.push(origin);
        }
        if hashes.is_empty() && config.allow_local_without_token {
            tracing::warn!(
                "the admin API has no token and admin.allow_local_without_token is set: every process on this host (and any proxy on it) can change the catalog"
            );
        } else if hashes.is_empty() {
            let path = data_dir.join(TOKEN_FILE);
            let token = generated_token(&path).map_err(|e| {
                format!(
                    "cannot keep a generated admin token in {}: {e}",
                    path.display()
                )
            })?;
            hashes.push(Sha256::digest(token.as_bytes()).into());
            // Printed like Jupyter's: the operator who started the process reads it here.
            tracing::warn!(
                file = %path.display(),
                "the admin API has no configured token (admin.tokens or SLUICE_ADMIN_TOKEN), so it uses this generated one: `sluice ctl --token {token} ...`, or paste it into the console"
            );
        } else {
            if config.allow_local_without_token {
                tracing::info!("admin.allow_local_without_token is ignored: a token is configured");
            }
            tracing::info!(
                tokens = hashes.len(),
                "the admin API requires a bearer token"
            );
        }
        Ok(AdminAuth {
            hashes,
            allow_local: config.allow_local_without_token,
            allowed_hosts,
            any_host,
            allowed_origins,
            strategy: strategy.to_string(),
            replay_batch,
        })
    }

    fn accepts(&self, token: &str) -> bool {
        let hash: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        let mut ok = subtle::Choice::from(0);
        for known in &self.hashes {
            ok |= subtle::ConstantTimeEq::ct_eq(&hash[..], &known[..]);
        }
        ok.into()
    }
}

/// `sha256:<64 hex digits>` or the hex digits alone.
pub fn parse_hash(text: &str) -> Result<[u8; 32], String> {
    let hex = text.strip_prefix("sha256:").unwrap_or(text).trim();
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(
            "must be the SHA-256 of the token as 64 hex digits (`sluice ctl hash-token` prints it)"
                .to_string(),
        );
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[i * 2..i * 2 + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The SHA-256 of a token, as `admin.tokens` takes it.
pub fn hash_token(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// The token kept in `path`, or a new one (32 bytes from the operating system's CSPRNG, as
/// hex) written there readable by the owner only: stable across restarts, so `sluice ctl`
/// and an open console keep working.
fn generated_token(path: &std::path::Path) -> std::io::Result<String> {
    use std::io::Write as _;
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => {
            restrict(path)?;
            return Ok(text.trim().to_string());
        }
        Ok(_) => std::fs::remove_file(path)?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|e| std::io::Error::other(e.to_string()))?;
    let token: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    // Owner only, like every file of the data directory (which this process holds locked).
    let mut file = crate::store::embedded::create_private(path)?;
    file.write_all(format!("{token}\n").as_bytes())?;
    file.sync_all()?;
    Ok(token)
}

/// Makes a secret file readable by its owner only (it may predate this version).
fn restrict(path: &std::path::Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(path)?.permissions().mode();
        if mode & 0o077 != 0 {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode & 0o700))?;
        }
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// `(name, port)` of a `Host` value (`name`, `name:port`, `[v6]`, `[v6]:port`), the name
/// lowercased and without a trailing dot; `None` when it is not one.
fn split_host(host: &str) -> Option<(String, Option<u16>)> {
    let host = host.trim();
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        let port = match after {
            "" => None,
            _ => Some(after.strip_prefix(':')?),
        };
        (format!("[{inside}]"), port)
    } else {
        match host.rsplit_once(':') {
            // A bare IPv6 address is not a `Host` (it needs brackets).
            Some((name, _)) if name.contains(':') => return None,
            Some((name, port)) => (name.to_string(), Some(port)),
            None => (host.to_string(), None),
        }
    };
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok()?),
        None => None,
    };
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let valid = !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b'[' | b']' | b':')
        });
    valid.then_some((name, port))
}

/// The address a `Host` name stands for, if it is an IP literal.
fn host_ip(name: &str) -> Option<std::net::IpAddr> {
    name.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_canonical())
}

/// An origin as compared: lowercased, without a trailing slash.
fn normal_origin(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// `(scheme, host, port)` of a normalized origin (`http://host[:port]`, nothing after),
/// the port defaulted from the scheme.
fn origin_authority(origin: &str) -> Option<(&str, String, u16)> {
    let (scheme, authority) = origin.split_once("://")?;
    let default = match scheme {
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    if authority.contains(['/', '?', '#', '@']) {
        return None;
    }
    let (name, port) = split_host(authority)?;
    Some((scheme, name, port.unwrap_or(default)))
}

/// The request's `Host` (or the HTTP/2 `:authority`).
fn request_host(request: &Request) -> Option<String> {
    request
        .headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or_else(|| request.uri().authority().map(|a| a.as_str().to_string()))
}

/// The address the request came in on (set by `server::serve`).
#[derive(Debug, Clone, Copy)]
pub struct LocalAddr(pub SocketAddr);

impl AdminAuth {
    /// Whether the admin API answers a request naming `host`, which came in on `local`.
    /// The listen address, loopback names and `admin.allowed_hosts` are answered; with a
    /// token and no `allowed_hosts`, any name (the token defeats DNS rebinding).
    fn host_allowed(&self, host: Option<&str>, local: Option<SocketAddr>) -> bool {
        if self.any_host || (!self.hashes.is_empty() && self.allowed_hosts.is_empty()) {
            return true;
        }
        // Browsers always send one; a client that does not is not a page being rebound.
        let Some(host) = host else { return true };
        let Some((name, port)) = split_host(host) else {
            return false;
        };
        let listed = self.allowed_hosts.iter().any(|allowed| {
            allowed == &name || port.is_some_and(|p| *allowed == format!("{name}:{p}"))
        });
        if listed {
            return true;
        }
        let port_ok = match local {
            Some(local) => port.unwrap_or(80) == local.port(),
            None => true,
        };
        let local_name = name == "localhost"
            || host_ip(&name).is_some_and(|ip| {
                ip.is_loopback() || local.is_some_and(|l| l.ip().to_canonical() == ip)
            });
        port_ok && local_name
    }

    /// Whether `origin` may send state-changing requests: the admin API's own origin (the
    /// console served with it) or one of `admin.allowed_origins`.
    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let origin = normal_origin(origin);
        if self.origin_listed(&origin) {
            return true;
        }
        let (Some((scheme, name, port)), Some((host_name, host_port))) =
            (origin_authority(&origin), host.and_then(split_host))
        else {
            return false;
        };
        // The scheme is not compared: behind a proxy that ends TLS the gateway sees http
        // while the page is https; an attacker's page at the same host is the same site.
        let default = if scheme == "https" { 443 } else { 80 };
        name == host_name && port == host_port.unwrap_or(default)
    }

    fn origin_listed(&self, origin: &str) -> bool {
        let origin = normal_origin(origin);
        self.allowed_origins.contains(&origin)
    }
}

/// Headers a proxy adds: a request carrying one did not come from the peer's own process.
const PROXY_HEADERS: [&str; 4] = ["forwarded", "x-forwarded-for", "x-real-ip", "via"];

/// Body types the admin API reads: JSON (`sluice ctl` converts TOML and YAML files to it).
fn json_type(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json"))
}

/// What a browser could send from another site, refused before anything else: a `Host`
/// this gateway does not answer to (DNS rebinding), and for state-changing methods a
/// foreign `Origin` or `Sec-Fetch-Site`, and a body that is not JSON (a "simple" request
/// needs no preflight only with `text/plain`, forms or no type). No answer of the admin API
/// carries CORS permissions.
async fn guard(State(state): State<Arc<IngressState>>, request: Request, next: Next) -> Response {
    let Some((_, auth)) = state.admin() else {
        return Problem::unavailable("the gateway is starting", 1).into_response();
    };
    let host = request_host(&request);
    let local = request.extensions().get::<LocalAddr>().map(|l| l.0);
    if !auth.host_allowed(host.as_deref(), local) {
        return Problem::forbidden(
            "host",
            format!(
                "the admin API does not answer to the host `{}`: add it to admin.allowed_hosts",
                host.as_deref().unwrap_or("")
            ),
        )
        .into_response();
    }
    let method = request.method();
    let safe = method == axum::http::Method::GET
        || method == axum::http::Method::HEAD
        || method == axum::http::Method::OPTIONS;
    if !safe {
        let headers = request.headers();
        let origin = headers
            .get(header::ORIGIN)
            .map(|v| v.to_str().unwrap_or("null"));
        if let Some(origin) = origin {
            if !auth.origin_allowed(origin, host.as_deref()) {
                return Problem::forbidden(
                    "origin",
                    format!("the admin API does not take changes from the origin `{origin}` (its own origin and admin.allowed_origins only)"),
                )
                .into_response();
            }
        }
        let fetch_site = headers
            .get("sec-fetch-site")
            .map(|v| v.to_str().unwrap_or("").to_ascii_lowercase());
        if let Some(site) = fetch_site {
            let listed = origin.is_some_and(|o| auth.origin_listed(o));
            if site != "same-origin" && site != "none" && !listed {
                return Problem::forbidden(
                    "sec-fetch-site",
                    format!("the admin API does not take changes sent {site} by a browser"),
                )
                .into_response();
            }
        }
        match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
            Some(Ok(t)) if json_type(t) => {}
            Some(t) => {
                return Problem::unsupported_media_type(format!(
                    "the admin API reads JSON bodies (`Content-Type: application/json`), not `{}`",
                    t.unwrap_or("?")
                ))
                .into_response()
            }
            None if has_body(&request) => {
                return Problem::unsupported_media_type(
                    "a request body needs `Content-Type: application/json`",
                )
                .into_response()
            }
            None => {}
        }
    }
    let mut response = next.run(request).await;
    let cors: Vec<_> = response
        .headers()
        .keys()
        .filter(|k| k.as_str().starts_with("access-control-allow-"))
        .cloned()
        .collect();
    for name in cors {
        response.headers_mut().remove(name);
    }
    response
}

/// Whether a request carries a body (a length above zero, chunked, or an HTTP/2 stream
/// that has not ended).
fn has_body(request: &Request) -> bool {
    use axum::body::HttpBody as _;
    let length = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(n) => n > 0,
        None => {
            request.headers().contains_key(header::TRANSFER_ENCODING)
                || !request.body().is_end_stream()
        }
    }
}

/// The routes of `/api/v1` (and the older `/admin/*` aliases), with their credentials.
pub fn routes(state: Arc<IngressState>) -> Router {
    let open = Router::new()
        .route("/api/v1/openapi.json", get(openapi))
        .merge(crate::scaling::within_limits(
            Router::new()
                .route("/api/v1/scaling", get(crate::scaling::handler))
                .with_state(state.clone()),
            &state.limits,
        ))
        // The console's files need no token (it asks for one when the API does), but they
        // are answered only under a `Host` of this gateway, like the API.
        .merge(
            crate::console::routes().layer(middleware::from_fn_with_state(state.clone(), guard)),
        );
    let guarded = Router::new()
        .route("/api/v1/catalog", get(get_catalog))
        .route("/api/v1/catalog/apply", post(apply))
        .route("/api/v1/buses", get(list_buses))
        .route(
            "/api/v1/buses/{bus}",
            get(get_bus).put(put_bus).delete(delete_bus),
        )
        .route("/api/v1/buses/{bus}/rules", get(list_rules))
        .route(
            "/api/v1/buses/{bus}/rules/{rule}",
            get(get_rule).put(put_rule).delete(delete_rule),
        )
        .route("/api/v1/sources", get(list_sources))
        .route(
            "/api/v1/sources/{source}",
            get(get_source).put(put_source).delete(delete_source),
        )
        .route(
            "/api/v1/sources/{source}/{action}",
            post(crate::admin::source_action),
        )
        .route(
            "/api/v1/sources/{source}/tasks/{index}/{action}",
            post(crate::admin::source_task_action),
        )
        .route("/api/v1/connectors", get(list_connectors))
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}",
            get(get_connector),
        )
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            post(crate::admin::connector_action),
        )
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}/tasks/{shard}/{action}",
            post(crate::admin::task_action),
        )
        .route("/api/v1/cluster", get(cluster))
        .route("/api/v1/webhooks", get(list_webhooks))
        .route(
            "/api/v1/webhooks/{name}",
            get(get_webhook).put(put_webhook).delete(delete_webhook),
        )
        .route(
            "/api/v1/buses/{bus}/replays",
            get(list_replays).post(start_replay),
        )
        .route(
            "/api/v1/buses/{bus}/replays/{replay}",
            get(get_replay).delete(cancel_replay),
        )
        .route("/api/v1/buses/{bus}/events", get(recent_events))
        .route(
            "/api/v1/buses/{bus}/rules/{rule}/redeliver",
            post(redeliver),
        )
        .route("/api/v1/rules/test", post(test_rule))
        .merge(crate::admin::routes())
        .with_state(state.clone())
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        // Before the credentials: what a browser sends cross-site is refused whoever it is.
        .layer(middleware::from_fn_with_state(state, guard))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(problem_rejections));
    open.merge(guarded)
}

/// The admin API alone, for `admin.listen`.
pub fn admin_router(state: Arc<IngressState>) -> Router {
    routes(state).fallback(|uri: axum::http::Uri| async move { Problem::not_found(uri.path()) })
}

async fn authorize(
    State(state): State<Arc<IngressState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some((_, auth)) = state.admin() else {
        return Problem::unavailable("the gateway is starting", 1).into_response();
    };
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    if auth.hashes.is_empty() && auth.allow_local {
        if let Some(name) = PROXY_HEADERS
            .iter()
            .find(|h| request.headers().contains_key(**h))
        {
            return Problem::forbidden(
                *name,
                "the request came through a proxy, so its peer address does not tell whether its client is local; the admin API answers it only with a token (admin.tokens or SLUICE_ADMIN_TOKEN)",
            )
            .into_response();
        }
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        // `::ffff:127.0.0.1` on a `[::]` listener is loopback too.
        if peer.is_some_and(|p| p.ip().to_canonical().is_loopback()) {
            return next.run(request).await;
        }
        return Problem::forbidden(
            "admin.allow_local_without_token",
            "the admin API has no token configured (admin.tokens or SLUICE_ADMIN_TOKEN) and answers only clients on loopback",
        )
        .into_response();
    }
    match token {
        Some(token) if auth.accepts(token) => next.run(request).await,
        Some(_) => with_challenge(Problem::unauthorized(
            "authorization",
            "the bearer token is not one the admin API accepts",
        )),
        None => with_challenge(Problem::unauthorized(
            "authorization",
            "the admin API needs `Authorization: Bearer <token>`",
        )),
    }
}

fn with_challenge(problem: Problem) -> Response {
    let mut response = problem.into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sluice-admin\""),
    );
    response
}

/// Axum's own refusals (a body over the limit, a path parameter that is not a number) are
/// plain text: made problem+json like every other error of the API.
async fn problem_rejections(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    if !status.is_client_error() || is_problem {
        return response;
    }
    let bytes = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    Problem::client_error(status, String::from_utf8_lossy(&bytes).trim().to_string())
        .into_response()
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

fn catalog_of(state: &IngressState) -> Result<Catalog, Problem> {
    state
        .admin()
        .map(|(c, _)| c)
        .ok_or_else(|| Problem::unavailable("the gateway is starting", 1))
}

fn store_problem(e: &crate::store::StoreError) -> Problem {
    Problem::unavailable(format!("the catalog cannot be read or written: {e}"), 2)
}

// ---------------------------------------------------------------------------------------
// Resources

/// A resource as the API shows it: its fields and its version.
fn view(resource: &impl serde::Serialize, version: u64) -> Value {
    let mut value = serde_json::to_value(resource).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.insert("version".to_string(), json!(version));
    }
    value
}

fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

fn found(value: Value, version: u64) -> Response {
    ([(header::ETAG, etag(version))], Json(value)).into_response()
}

fn bus_view(snapshot: &Snapshot, bus: &BusConfig) -> Value {
    view(
        bus,
        snapshot.version_of(&catalog::bus_key(bus.name.get_ref())),
    )
}

fn rule_view(snapshot: &Snapshot, rule: &RuleConfig) -> Value {
    view(
        rule,
        snapshot.version_of(&catalog::rule_key(rule.bus.get_ref(), rule.name.get_ref())),
    )
}

/// A catalog webhook source: its settings (secrets are `env:` references), version, the
/// URL providers call, and whether this replica can serve it.
fn webhook_view(snapshot: &Snapshot, hook: &WebhookConfig) -> Value {
    let name = hook.name.get_ref();
    let mut value = view(hook, snapshot.version_of(&catalog::webhook_key(name)));
    if let Value::Object(map) = &mut value {
        map.insert("path".to_string(), json!(format!("/webhooks/{name}")));
        map.insert("origin".to_string(), json!("catalog"));
    }
    value
}

/// `webhook_view` with why this replica cannot serve it, if it cannot (`unavailable`).
fn served_webhook_view(
    snapshot: &Snapshot,
    hook: &WebhookConfig,
    webhooks: &crate::webhooks::Webhooks,
) -> Value {
    let mut item = webhook_view(snapshot, hook);
    if let (Value::Object(map), Some(why)) =
        (&mut item, webhooks.unavailable().get(hook.name.get_ref()))
    {
        map.insert("unavailable".to_string(), json!(why));
    }
    item
}

fn source_view(snapshot: &Snapshot, source: &SourceConfig) -> Value {
    view(
        source,
        snapshot.version_of(&catalog::source_key(source.name())),
    )
}

async fn get_catalog(State(state): State<Arc<IngressState>>) -> Response {
    let catalog = match catalog_of(&state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    match catalog.snapshot().await {
        Ok(s) => Json(json!({
            "version": s.version,
            "buses": s.channels.buses.iter().map(|b| bus_view(&s, b)).collect::<Vec<_>>(),
            "rules": s.channels.rules.iter().map(|r| rule_view(&s, r)).collect::<Vec<_>>(),
            "sources": s.channels.sources.iter().map(|r| source_view(&s, r)).collect::<Vec<_>>(),
            "webhooks": s.channels.webhooks.iter().map(|h| webhook_view(&s, h)).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

async fn list_buses(State(state): State<Arc<IngressState>>) -> Response {
    list(&state, |s| {
        s.channels.buses.iter().map(|b| bus_view(s, b)).collect()
    })
    .await
}

async fn list_rules(State(state): State<Arc<IngressState>>, Path(bus): Path<String>) -> Response {
    let catalog = match catalog_of(&state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    match catalog.snapshot().await {
        Ok(s) if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) => {
            let items: Vec<Value> = s
                .channels
                .rules
                .iter()
                .filter(|r| *r.bus.get_ref() == bus)
                .map(|r| rule_view(&s, r))
                .collect();
            Json(json!({"version": s.version, "items": items})).into_response()
        }
        Ok(_) => no_bus(&bus).into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

async fn list_sources(State(state): State<Arc<IngressState>>) -> Response {
    list(&state, |s| {
        s.channels
            .sources
            .iter()
            .map(|r| source_view(s, r))
            .collect()
    })
    .await
}

async fn list(state: &IngressState, items: impl Fn(&Snapshot) -> Vec<Value>) -> Response {
    let catalog = match catalog_of(state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    match catalog.snapshot().await {
        Ok(s) => Json(json!({"version": s.version, "items": items(&s)})).into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

fn no_bus(bus: &str) -> Problem {
    Problem::unknown(format!("no bus `{bus}`")).with_field("bus")
}

async fn get_bus(State(state): State<Arc<IngressState>>, Path(bus): Path<String>) -> Response {
    get_one(&state, |s| {
        s.channels
            .buses
            .iter()
            .find(|b| *b.name.get_ref() == bus)
            .map(|b| (bus_view(s, b), s.version_of(&catalog::bus_key(&bus))))
            .ok_or_else(|| no_bus(&bus))
    })
    .await
}

async fn get_rule(
    State(state): State<Arc<IngressState>>,
    Path((bus, rule)): Path<(String, String)>,
) -> Response {
    get_one(&state, |s| {
        if !s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
            return Err(no_bus(&bus));
        }
        s.channels
            .rules
            .iter()
            .find(|r| *r.bus.get_ref() == bus && *r.name.get_ref() == rule)
            .map(|r| {
                (
                    rule_view(s, r),
                    s.version_of(&catalog::rule_key(&bus, &rule)),
                )
            })
            .ok_or_else(|| {
                Problem::unknown(format!("no rule `{rule}` on bus `{bus}`")).with_field("rule")
            })
    })
    .await
}

async fn get_source(State(state): State<Arc<IngressState>>, Path(name): Path<String>) -> Response {
    get_one(&state, |s| {
        s.channels
            .sources
            .iter()
            .find(|r| r.name() == name)
            .map(|r| (source_view(s, r), s.version_of(&catalog::source_key(&name))))
            .ok_or_else(|| Problem::unknown(format!("no source `{name}`")).with_field("source"))
    })
    .await
}

async fn get_one(
    state: &IngressState,
    find: impl Fn(&Snapshot) -> Result<(Value, u64), Problem>,
) -> Response {
    let catalog = match catalog_of(state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    match catalog.snapshot().await {
        Ok(s) => match find(&s) {
            Ok((value, version)) => found(value, version),
            Err(p) => p.into_response(),
        },
        Err(e) => store_problem(&e).into_response(),
    }
}

/// The preconditions of a write: `If-Match` (a version, or `*`) and `If-None-Match: *`.
struct Preconditions {
    if_match: Option<Vec<String>>,
    if_none_match: bool,
}

impl Preconditions {
    fn from(headers: &HeaderMap) -> Preconditions {
        let list = |name: header::HeaderName| {
            headers.get(name).and_then(|v| v.to_str().ok()).map(|v| {
                v.split(',')
                    .map(|t| {
                        t.trim()
                            .trim_start_matches("W/")
                            .trim_matches('"')
                            .to_string()
                    })
                    .collect::<Vec<_>>()
            })
        };
        Preconditions {
            if_match: list(header::IF_MATCH),
            if_none_match: list(header::IF_NONE_MATCH).is_some_and(|l| l.iter().any(|t| t == "*")),
        }
    }

    /// Checks them against the resource's current version (`None`: it does not exist).
    fn check(&self, current: Option<u64>, what: &str) -> Result<(), Problem> {
        if let Some(tags) = &self.if_match {
            let ok = match current {
                None => false,
                Some(v) => tags.iter().any(|t| t == "*" || *t == v.to_string()),
            };
            if !ok {
                return Err(Problem::precondition_failed(match current {
                    Some(v) => format!("{what} is at version {v}, not the one If-Match names; read it again and retry"),
                    None => format!("{what} does not exist, and If-Match names a version of it"),
                }));
            }
        }
        if self.if_none_match && current.is_some() {
            return Err(Problem::precondition_failed(format!(
                "{what} exists already (If-None-Match: *)"
            )));
        }
        Ok(())
    }
}

/// A resource from a request body: JSON with the configuration file's field names, read by
/// the configuration loader itself (the same TOML deserializer, defaults and checks).
fn parse_resource<T: serde::de::DeserializeOwned>(
    body: &[u8],
    path_fields: &[(&str, &str)],
) -> Result<T, Problem> {
    let mut value: Value = serde_json::from_slice(body)
        .map_err(|e| Problem::invalid_resource("", format!("the body is not JSON: {e}")))?;
    let Value::Object(map) = &mut value else {
        return Err(Problem::invalid_resource(
            "",
            "the body must be a JSON object",
        ));
    };
    map.remove("version");
    for (field, from_path) in path_fields {
        match map.get(*field) {
            None | Some(Value::Null) => {
                map.insert((*field).to_string(), Value::String((*from_path).to_string()));
            }
            Some(Value::String(s)) if s == from_path => {}
            Some(other) => {
                return Err(Problem::invalid_resource(
                    &format!("/{field}"),
                    format!("`{field}` is {other} in the body and `{from_path}` in the URL; they must agree"),
                ))
            }
        }
    }
    crate::config::from_json(&value)
        .map_err(|(pointer, message)| Problem::invalid_resource(&pointer, message))
}

/// A refused change as problem+json: the field at fault, by JSON pointer, inside the
/// resource the request is about; a problem elsewhere in the catalog (the change breaks
/// another resource) is a conflict naming that one.
fn change_problem(
    e: ChangeError<Problem>,
    kind: Kind,
    key: &str,
    after: Option<&Channels>,
) -> Problem {
    match e {
        ChangeError::Rejected(p) => p,
        ChangeError::Store(e) => store_problem(&e),
        ChangeError::Contention => {
            Problem::conflict("the catalog kept changing under this request; try again")
        }
        ChangeError::Invalid(invalid) => {
            let at = after.and_then(|c| key_of(c, invalid.kind, invalid.index));
            if invalid.kind == kind && at.as_deref() == Some(key) {
                Problem::invalid_resource(&invalid.pointer, invalid.message)
            } else {
                Problem::conflict(format!(
                    "the change would break {}: {}",
                    at.unwrap_or_else(|| "another resource".to_string()),
                    invalid.message
                ))
            }
        }
    }
}

/// A change this replica refuses to accept because it could not run it (see
/// `admission`), as problem+json: `400` naming the field when the resource the request is
/// about cannot be built here, `409` naming `/shards` when its bus's log in the store has
/// another shard count.
fn admission_problem(
    refusal: crate::admission::Refusal,
    kind: Kind,
    key: &str,
    after: &Channels,
) -> Problem {
    let invalid = refusal.invalid;
    let at = key_of(after, invalid.kind, invalid.index);
    if invalid.kind != kind || at.as_deref() != Some(key) {
        return Problem::conflict(format!(
            "the change would break {}: {}",
            at.unwrap_or_else(|| "another resource".to_string()),
            invalid.message
        ));
    }
    refused(
        Problem::invalid_resource(&invalid.pointer, invalid.message),
        refusal.conflict,
    )
}

/// A refusal's problem, made `409 Conflict` when the store's state refused it (a bus log
/// with another shard count) rather than the resource itself; field and pointer kept.
fn refused(mut problem: Problem, conflict: bool) -> Problem {
    if conflict {
        problem.status = StatusCode::CONFLICT.as_u16();
        problem.title = "Conflict";
        problem.kind = Problem::conflict("").kind;
    }
    problem
}

/// Runs this replica's admission checks on a change (`keys`: the resources the request
/// names); `Some(problem)` when it refuses. What the configuration's own checks refuse
/// is left to them (`Catalog::change` says it, with the same pointer as ever).
fn admit(
    state: &IngressState,
    before: &Channels,
    after: &Channels,
    keys: &std::collections::HashSet<String>,
    stored: &HashMap<String, u32>,
) -> Option<crate::admission::Refusal> {
    let admission = state.admission()?;
    let refusal = admission.check(before, after, keys, stored).err()?;
    catalog::check_change(before, after)
        .is_ok()
        .then_some(refusal)
}

fn key_of(channels: &Channels, kind: Kind, index: usize) -> Option<String> {
    match kind {
        Kind::Bus => channels
            .buses
            .get(index)
            .map(|b| catalog::bus_key(b.name.get_ref())),
        Kind::Rule => channels
            .rules
            .get(index)
            .map(|r| catalog::rule_key(r.bus.get_ref(), r.name.get_ref())),
        Kind::Source => channels
            .sources
            .get(index)
            .map(|s| catalog::source_key(s.name())),
        Kind::Webhook => channels
            .webhooks
            .get(index)
            .map(|h| catalog::webhook_key(h.name.get_ref())),
    }
}

/// 201 with `Location` when created, 200 when replaced.
fn written(created: bool, location: String, value: Value, version: u64) -> Response {
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = (status, [(header::ETAG, etag(version))], Json(value)).into_response();
    if created {
        if let Ok(v) = HeaderValue::from_str(&location) {
            response.headers_mut().insert(header::LOCATION, v);
        }
    }
    response
}

/// One resource of the catalog as the write handlers address it.
struct Addressed<T> {
    kind: Kind,
    /// Its key in the version map.
    key: String,
    /// How messages name it (`rule \`r\` on bus \`b\``).
    what: String,
    /// Its URL (`Location` of a created one).
    location: String,
    /// The 404 when it is not there.
    missing: Problem,
    list: fn(&Channels) -> &Vec<T>,
    list_mut: fn(&mut Channels) -> &mut Vec<T>,
    view: fn(&Snapshot, &T) -> Value,
}

fn buses_of(c: &Channels) -> &Vec<BusConfig> {
    &c.buses
}
fn buses_mut(c: &mut Channels) -> &mut Vec<BusConfig> {
    &mut c.buses
}
fn rules_of(c: &Channels) -> &Vec<RuleConfig> {
    &c.rules
}
fn rules_mut(c: &mut Channels) -> &mut Vec<RuleConfig> {
    &mut c.rules
}
fn sources_of(c: &Channels) -> &Vec<SourceConfig> {
    &c.sources
}
fn sources_mut(c: &mut Channels) -> &mut Vec<SourceConfig> {
    &mut c.sources
}

fn bus_addressed(bus: &str) -> Addressed<BusConfig> {
    Addressed {
        kind: Kind::Bus,
        key: catalog::bus_key(bus),
        what: format!("bus `{bus}`"),
        location: format!("/api/v1/buses/{bus}"),
        missing: no_bus(bus),
        list: buses_of,
        list_mut: buses_mut,
        view: bus_view,
    }
}

fn rule_addressed(bus: &str, rule: &str) -> Addressed<RuleConfig> {
    Addressed {
        kind: Kind::Rule,
        key: catalog::rule_key(bus, rule),
        what: format!("rule `{rule}` on bus `{bus}`"),
        location: format!("/api/v1/buses/{bus}/rules/{rule}"),
        missing: Problem::unknown(format!("no rule `{rule}` on bus `{bus}`")).with_field("rule"),
        list: rules_of,
        list_mut: rules_mut,
        view: rule_view,
    }
}

fn source_addressed(name: &str) -> Addressed<SourceConfig> {
    Addressed {
        kind: Kind::Source,
        key: catalog::source_key(name),
        what: format!("source `{name}`"),
        location: format!("/api/v1/sources/{name}"),
        missing: Problem::unknown(format!("no source `{name}`")).with_field("source"),
        list: sources_of,
        list_mut: sources_mut,
        view: source_view,
    }
}

fn webhooks_of(c: &Channels) -> &Vec<WebhookConfig> {
    &c.webhooks
}
fn webhooks_mut(c: &mut Channels) -> &mut Vec<WebhookConfig> {
    &mut c.webhooks
}

fn no_webhook(name: &str) -> Problem {
    Problem::unknown(format!("no webhook source `{name}` in the catalog")).with_field("name")
}

fn webhook_addressed(name: &str) -> Addressed<WebhookConfig> {
    Addressed {
        kind: Kind::Webhook,
        key: catalog::webhook_key(name),
        what: format!("webhook source `{name}`"),
        location: format!("/api/v1/webhooks/{name}"),
        missing: no_webhook(name),
        list: webhooks_of,
        list_mut: webhooks_mut,
        view: webhook_view,
    }
}

/// `PUT` of a resource: creates (201) or replaces (200) it under the request's
/// preconditions, after `precheck` (which may refuse, e.g. a rule of a missing bus).
///
/// The change is accepted only if this replica can build the resource (see `admission`);
/// `stored` holds the shard count of its bus's log in the store, for a bus.
async fn put_resource<T: Clone>(
    state: &IngressState,
    headers: &HeaderMap,
    at: Addressed<T>,
    resource: T,
    is: impl Fn(&T) -> bool,
    precheck: impl Fn(&Snapshot) -> Result<(), Problem>,
    stored: HashMap<String, u32>,
) -> Response {
    let catalog = match catalog_of(state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let pre = Preconditions::from(headers);
    let mut attempted = None;
    let keys = std::collections::HashSet::from([at.key.clone()]);
    let result = catalog
        .change(|s| {
            precheck(s)?;
            let found = (at.list)(&s.channels).iter().position(&is);
            pre.check(found.map(|_| s.version_of(&at.key)), &at.what)?;
            let mut next = s.channels.clone();
            match found {
                Some(i) => (at.list_mut)(&mut next)[i] = resource.clone(),
                None => (at.list_mut)(&mut next).push(resource.clone()),
            }
            if let Some(refusal) = admit(state, &s.channels, &next, &keys, &stored) {
                return Err(admission_problem(refusal, at.kind, &at.key, &next));
            }
            attempted = Some(next.clone());
            Ok((Some(next), found.is_none()))
        })
        .await;
    match result {
        Ok(done) => {
            let s = &done.snapshot;
            let Some(stored) = (at.list)(&s.channels).iter().find(|r| is(r)) else {
                return Problem::internal(format!(
                    "{} is not in the catalog after writing it",
                    at.what
                ))
                .into_response();
            };
            written(
                done.value,
                at.location.clone(),
                (at.view)(s, stored),
                s.version_of(&at.key),
            )
        }
        Err(e) => change_problem(e, at.kind, &at.key, attempted.as_ref()).into_response(),
    }
}

/// `DELETE` of a resource (204) under the request's preconditions, unless `in_use` refuses.
async fn delete_resource<T>(
    state: &IngressState,
    headers: &HeaderMap,
    at: Addressed<T>,
    is: impl Fn(&T) -> bool,
    in_use: impl Fn(&Snapshot) -> Result<(), Problem>,
) -> Response {
    let catalog = match catalog_of(state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let pre = Preconditions::from(headers);
    let result = catalog
        .change(|s| {
            let Some(found) = (at.list)(&s.channels).iter().position(&is) else {
                return Err(at.missing.clone());
            };
            pre.check(Some(s.version_of(&at.key)), &at.what)?;
            in_use(s)?;
            let mut next = s.channels.clone();
            (at.list_mut)(&mut next).remove(found);
            Ok((Some(next), ()))
        })
        .await;
    match result {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => change_problem(e, at.kind, &at.key, None).into_response(),
    }
}

async fn put_bus(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: BusConfig = match parse_resource(&body, &[("name", &bus)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |b: &BusConfig| *b.name.get_ref() == bus;
    // Whether the store still holds a log of this bus (deleted and made again), and with
    // how many shards: asked before the change, which is made without waiting.
    let stored = match state.admission() {
        Some(admission) => match admission
            .stored_shards([(bus.as_str(), resource.shards)])
            .await
        {
            Ok(stored) => stored,
            Err(e) => return store_problem(&e).into_response(),
        },
        None => HashMap::new(),
    };
    put_resource(
        &state,
        &headers,
        bus_addressed(&bus),
        resource,
        is,
        |_| Ok(()),
        stored,
    )
    .await
}

async fn put_rule(
    State(state): State<Arc<IngressState>>,
    Path((bus, rule)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: RuleConfig = match parse_resource(&body, &[("name", &rule), ("bus", &bus)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |r: &RuleConfig| *r.bus.get_ref() == bus && *r.name.get_ref() == rule;
    let bus_exists = |s: &Snapshot| {
        if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
            Ok(())
        } else {
            Err(no_bus(&bus))
        }
    };
    put_resource(
        &state,
        &headers,
        rule_addressed(&bus, &rule),
        resource,
        is,
        bus_exists,
        HashMap::new(),
    )
    .await
}

async fn put_source(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: SourceConfig = match parse_resource(&body, &[("name", &name)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |r: &SourceConfig| r.name() == name;
    put_resource(
        &state,
        &headers,
        source_addressed(&name),
        resource,
        is,
        |_| Ok(()),
        HashMap::new(),
    )
    .await
}

async fn delete_bus(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
) -> Response {
    // What this replica's own file ties to the bus (webhook sources, schemas).
    let webhooks = state.webhooks();
    let local: Vec<String> = webhooks
        .file_buses()
        .filter(|(_, b)| *b == bus)
        .map(|(name, _)| format!("webhook `{name}` (this replica's file)"))
        .chain(
            state
                .bus_schemas(&bus)
                .map(|_| "its JSON Schemas".to_string()),
        )
        .collect();
    let unused = |s: &Snapshot| {
        let mut users: Vec<String> = s
            .channels
            .rules
            .iter()
            .filter(|r| *r.bus.get_ref() == bus)
            .map(|r| format!("rule `{}`", r.name.get_ref()))
            .chain(
                s.channels
                    .sources
                    .iter()
                    .filter(|r| r.bus() == bus)
                    .map(|r| format!("source `{}`", r.name())),
            )
            .chain(
                s.channels
                    .webhooks
                    .iter()
                    .filter(|h| h.bus == bus)
                    .map(|h| format!("webhook `{}`", h.name.get_ref())),
            )
            .collect();
        users.extend(local.iter().cloned());
        if users.is_empty() {
            Ok(())
        } else {
            Err(Problem::conflict(format!(
                "bus `{bus}` is used by {}; delete those first",
                users.join(", ")
            )))
        }
    };
    let is = |b: &BusConfig| *b.name.get_ref() == bus;
    delete_resource(&state, &headers, bus_addressed(&bus), is, unused).await
}

async fn delete_rule(
    State(state): State<Arc<IngressState>>,
    Path((bus, rule)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let is = |r: &RuleConfig| *r.bus.get_ref() == bus && *r.name.get_ref() == rule;
    delete_resource(
        &state,
        &headers,
        rule_addressed(&bus, &rule),
        is,
        |_| Ok(()),
    )
    .await
}

async fn delete_source(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let is = |r: &SourceConfig| r.name() == name;
    delete_resource(&state, &headers, source_addressed(&name), is, |_| Ok(())).await
}

/// `POST /api/v1/catalog/apply`: makes the catalog hold a file's resources, as one change.
/// `?prune=true` also deletes what the file does not have; `?dry_run=true` only reports.
async fn apply(
    State(state): State<Arc<IngressState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    body: axum::body::Bytes,
) -> Response {
    let catalog = match catalog_of(&state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let mut prune = false;
    let mut dry_run = false;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
        let flag = match value {
            "true" | "1" | "" => true,
            "false" | "0" => false,
            other => {
                return Problem::bad_request(
                    key,
                    format!("`{key}` must be true or false, not `{other}`"),
                )
                .into_response()
            }
        };
        match key {
            "prune" => prune = flag,
            "dry_run" => dry_run = flag,
            other => {
                return Problem::bad_request(
                    other,
                    format!("unknown parameter `{other}` (prune, dry_run)"),
                )
                .into_response()
            }
        }
    }
    let file: Channels = match parse_resource(&body, &[]) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    // The body's resources are the ones this replica must be able to build; its buses,
    // the ones whose logs the store may still hold with another shard count.
    let keys = crate::admission::keys_of(&file);
    let stored = match state.admission() {
        Some(admission) => {
            let buses: Vec<(&str, u32)> = file
                .buses
                .iter()
                .map(|b| (b.name.get_ref().as_str(), b.shards))
                .collect();
            match admission.stored_shards(buses).await {
                Ok(stored) => stored,
                Err(e) => return store_problem(&e).into_response(),
            }
        }
        None => HashMap::new(),
    };
    let mut attempted = None;
    let result = catalog
        .change(|s| {
            let (next, report) = merge(&s.channels, &file, prune);
            if let Some(refusal) = admit(&state, &s.channels, &next, &keys, &stored) {
                return Err(refused(
                    applied_invalid(&next, &file, &refusal.invalid),
                    refusal.conflict,
                ));
            }
            attempted = Some(next.clone());
            Ok::<_, Problem>((if dry_run { None } else { Some(next) }, report))
        })
        .await;
    match result {
        Ok(done) => {
            if dry_run {
                // Checked like a real apply, without writing.
                if let Some(next) = &attempted {
                    if let Err(invalid) = catalog::check_change(&done.snapshot.channels, next) {
                        return applied_invalid(next, &file, &invalid).into_response();
                    }
                }
            }
            Json(json!({
                "version": done.snapshot.version,
                "dry_run": dry_run,
                "changed": done.written,
                "resources": done.value,
            }))
            .into_response()
        }
        Err(ChangeError::Invalid(invalid)) => match &attempted {
            Some(next) => applied_invalid(next, &file, &invalid).into_response(),
            None => Problem::invalid_resource("", invalid.message).into_response(),
        },
        Err(e) => change_problem(e, Kind::Bus, "", None).into_response(),
    }
}

/// A refused apply: the pointer is into the request body (`/rules/2/targets/0/...`) when
/// the resource at fault is one of the body's, else empty; `resource` names it either way.
fn applied_invalid(next: &Channels, body: &Channels, invalid: &crate::config::Invalid) -> Problem {
    let at = key_of(next, invalid.kind, invalid.index).unwrap_or_default();
    let (list, keys): (&str, Vec<String>) = match invalid.kind {
        Kind::Bus => (
            "buses",
            body.buses
                .iter()
                .map(|b| catalog::bus_key(b.name.get_ref()))
                .collect(),
        ),
        Kind::Rule => (
            "rules",
            body.rules
                .iter()
                .map(|r| catalog::rule_key(r.bus.get_ref(), r.name.get_ref()))
                .collect(),
        ),
        Kind::Source => (
            "sources",
            body.sources
                .iter()
                .map(|s| catalog::source_key(s.name()))
                .collect(),
        ),
        Kind::Webhook => (
            "webhooks",
            body.webhooks
                .iter()
                .map(|h| catalog::webhook_key(h.name.get_ref()))
                .collect(),
        ),
    };
    let pointer = match keys.iter().position(|k| *k == at) {
        Some(i) => format!("/{list}/{i}{}", invalid.pointer),
        None => String::new(),
    };
    Problem::invalid_resource(&pointer, format!("{at}: {}", invalid.message))
        .with_extra("resource", json!(at))
}

/// The catalog after applying `file` to `current`, and what happened to each resource.
fn merge(current: &Channels, file: &Channels, prune: bool) -> (Channels, Vec<Value>) {
    let before = Snapshot::resources(current);
    let wanted = Snapshot::resources(file);
    let mut report = Vec::new();
    let mut next = if prune {
        Channels::default()
    } else {
        current.clone()
    };
    if prune {
        for key in before.keys().filter(|k| !wanted.contains_key(*k)) {
            report.push(json!({"resource": key, "result": "deleted"}));
        }
    }
    for bus in &file.buses {
        match next
            .buses
            .iter()
            .position(|b| b.name.get_ref() == bus.name.get_ref())
        {
            Some(i) => next.buses[i] = bus.clone(),
            None => next.buses.push(bus.clone()),
        }
    }
    for rule in &file.rules {
        match next.rules.iter().position(|r| {
            r.bus.get_ref() == rule.bus.get_ref() && r.name.get_ref() == rule.name.get_ref()
        }) {
            Some(i) => next.rules[i] = rule.clone(),
            None => next.rules.push(rule.clone()),
        }
    }
    for source in &file.sources {
        match next.sources.iter().position(|s| s.name() == source.name()) {
            Some(i) => next.sources[i] = source.clone(),
            None => next.sources.push(source.clone()),
        }
    }
    for hook in &file.webhooks {
        match next
            .webhooks
            .iter()
            .position(|h| h.name.get_ref() == hook.name.get_ref())
        {
            Some(i) => next.webhooks[i] = hook.clone(),
            None => next.webhooks.push(hook.clone()),
        }
    }
    for (key, json) in &wanted {
        let result = match before.get(key) {
            None => "created",
            Some(old) if old == json => "unchanged",
            Some(_) => "updated",
        };
        report.push(json!({"resource": key, "result": result}));
    }
    (next, report)
}

// ---------------------------------------------------------------------------------------
// Connectors, tasks, cluster

async fn connector_view(
    state: &IngressState,
    id: &str,
    statuses: &HashMap<String, Value>,
    rates: &HashMap<String, crate::scaling::Rate>,
) -> Value {
    let plan = state.plan();
    let tasks = state.connectors().get(id).copied().unwrap_or(0);
    let mut task_views = Vec::new();
    let parts: Vec<&str> = id.splitn(3, '/').collect();
    let log = match (&plan, parts.as_slice()) {
        (Some(plan), [bus, _, _]) => plan.logs.get(*bus).cloned(),
        _ => None,
    };
    let positions = state.positions();
    for index in 0..tasks {
        let task = task_id(id, index);
        let mut view = statuses
            .get(&task)
            .cloned()
            .unwrap_or_else(|| json!({"id": task, "state": "UNASSIGNED"}));
        if let (Some(log), Some(positions), [bus, rule, target]) =
            (&log, &positions, parts.as_slice())
        {
            let end = log.end(index).await.ok();
            let at = positions
                .peek_group(bus, index)
                .await
                .ok()
                .and_then(|g| g.of(&format!("{rule}/{target}")));
            let rate = rates
                .get(id)
                .and_then(|r| r.shards.get(index as usize))
                .map(|r| (r * 100.0).round() / 100.0);
            if let Value::Object(map) = &mut view {
                map.insert("shard".to_string(), json!(index));
                map.insert("rate".to_string(), json!(rate));
                map.insert("position".to_string(), json!(at));
                map.insert("end".to_string(), json!(end));
                // No position yet: the subscription starts where the shard ends.
                map.insert(
                    "lag".to_string(),
                    json!(end.map(|e| e.saturating_sub(at.unwrap_or(e).min(e)))),
                );
            }
        } else if let Value::Object(map) = &mut view {
            map.insert("index".to_string(), json!(index));
        }
        task_views.push(view);
    }
    let lag: u64 = task_views.iter().filter_map(|t| t["lag"].as_u64()).sum();
    let rate = rates.get(id).map(|r| r.total);
    let mut view = statuses
        .get(id)
        .cloned()
        .unwrap_or_else(|| json!({"id": id, "state": "RUNNING"}));
    if let Value::Object(map) = &mut view {
        map.insert(
            "kind".to_string(),
            json!(if id.starts_with("source/") {
                "source"
            } else {
                "subscription"
            }),
        );
        map.insert("lag".to_string(), json!(lag));
        // Delivered events per second over the last minute, cluster-wide (sampled every
        // 5 s once asked for; null until there are two samples).
        map.insert(
            "rate".to_string(),
            json!(rate.map(|r| (r * 100.0).round() / 100.0)),
        );
        map.insert("tasks".to_string(), Value::Array(task_views));
    }
    view
}

async fn statuses_by_id(state: &IngressState) -> Result<HashMap<String, Value>, Problem> {
    let statuses = state
        .cluster
        .statuses()
        .await
        .map_err(|e| Problem::unavailable(e.to_string(), 2))?;
    Ok(statuses
        .into_iter()
        .map(|s| {
            (
                s.id.clone(),
                serde_json::to_value(&s).unwrap_or(Value::Null),
            )
        })
        .collect())
}

async fn list_connectors(State(state): State<Arc<IngressState>>) -> Response {
    let statuses = match statuses_by_id(&state).await {
        Ok(s) => s,
        Err(p) => return p.into_response(),
    };
    let rates = state.scaling.rates();
    let mut ids: Vec<String> = state.connectors().keys().cloned().collect();
    ids.sort();
    let mut items = Vec::new();
    for id in ids {
        items.push(connector_view(&state, &id, &statuses, &rates).await);
    }
    Json(json!({"items": items})).into_response()
}

async fn get_connector(
    State(state): State<Arc<IngressState>>,
    Path((bus, rule, target)): Path<(String, String, String)>,
) -> Response {
    let id = format!("{bus}/{rule}/{target}");
    if !state.connectors().contains_key(&id) {
        return Problem::unknown(format!("no connector `{id}` in the running catalog"))
            .into_response();
    }
    let rates = state.scaling.rates();
    match statuses_by_id(&state).await {
        Ok(statuses) => Json(connector_view(&state, &id, &statuses, &rates).await).into_response(),
        Err(p) => p.into_response(),
    }
}

async fn cluster(State(state): State<Arc<IngressState>>) -> Response {
    let Some((_, auth)) = state.admin() else {
        return Problem::unavailable("the gateway is starting", 1).into_response();
    };
    let members = match state.cluster.members().await {
        Ok(mut m) => {
            m.sort();
            m
        }
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    let statuses = match state.cluster.statuses().await {
        Ok(s) => s,
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    let mut assignment: BTreeMap<String, Vec<String>> =
        members.iter().map(|m| (m.clone(), Vec::new())).collect();
    for status in &statuses {
        if status.state == crate::store::cluster::State::Running && status.id.contains('#') {
            if let Some(worker) = &status.worker {
                assignment
                    .entry(worker.clone())
                    .or_default()
                    .push(status.id.clone());
            }
        }
    }
    for tasks in assignment.values_mut() {
        tasks.sort();
    }
    let workers: Vec<Value> = match state.cluster.heartbeats().await {
        Ok(mut beats) => {
            beats.sort();
            beats
                .into_iter()
                .map(|(id, age)| json!({"id": id, "heartbeat_age_ms": age}))
                .collect()
        }
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    Json(json!({
        "worker": state.cluster.worker_id(),
        "strategy": auth.strategy,
        "members": members,
        "workers": workers,
        "assignment": assignment,
        "statuses": statuses,
    }))
    .into_response()
}

/// `GET /api/v1/webhooks`: the catalog's webhook sources (every replica serves them) and
/// this replica's own (from its file; shown without their settings, as their secrets may
/// be literal), with whether this replica can serve each.
async fn list_webhooks(State(state): State<Arc<IngressState>>) -> Response {
    let catalog = match catalog_of(&state) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    let snapshot = match catalog.snapshot().await {
        Ok(s) => s,
        Err(e) => return store_problem(&e).into_response(),
    };
    let webhooks = state.webhooks();
    let mut items: Vec<Value> = Vec::new();
    for (name, bus, preset, origin) in webhooks.list() {
        if origin == crate::webhooks::Origin::File {
            items.push(json!({
                "path": format!("/webhooks/{name}"),
                "name": name,
                "bus": bus,
                "preset": preset,
                "origin": "file",
            }));
        }
    }
    for hook in &snapshot.channels.webhooks {
        let name = hook.name.get_ref();
        if webhooks.in_file(name) {
            continue;
        }
        items.push(served_webhook_view(&snapshot, hook, &webhooks));
    }
    items.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Json(json!({"version": snapshot.version, "items": items})).into_response()
}

async fn get_webhook(State(state): State<Arc<IngressState>>, Path(name): Path<String>) -> Response {
    let webhooks = state.webhooks();
    get_one(&state, |s| {
        s.channels
            .webhooks
            .iter()
            .find(|h| *h.name.get_ref() == name)
            .map(|h| {
                (
                    served_webhook_view(s, h, &webhooks),
                    s.version_of(&catalog::webhook_key(&name)),
                )
            })
            .ok_or_else(|| no_webhook(&name))
    })
    .await
}

/// `PUT /api/v1/webhooks/{name}`: creates or replaces a webhook source of the catalog.
/// Refused when this replica's own file declares the name (it would serve the file's), or
/// when a secret's environment variable is not set on this replica (most likely a typo;
/// replicas without it answer that source's requests 503).
async fn put_webhook(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: WebhookConfig = match parse_resource(&body, &[("name", &name)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    if state.webhooks().in_file(&name) {
        return Problem::conflict(format!(
            "this replica's configuration file declares webhook source `{name}`; rename one of them"
        ))
        .with_field("name")
        .into_response();
    }
    // The settings first (they name the field), then whether this replica reads the secrets.
    if let Err((pointer, message)) = crate::webhooks::check_catalog(&resource).and_then(|()| {
        crate::webhooks::check_secrets_here(&resource, state.webhooks().secret_prefix())
    }) {
        return Problem::invalid_resource(&pointer, format!("webhook `{name}`: {message}"))
            .into_response();
    }
    let is = |h: &WebhookConfig| *h.name.get_ref() == name;
    let bus = resource.bus.clone();
    let bus_exists = |s: &Snapshot| {
        if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
            Ok(())
        } else {
            Err(no_bus(&bus))
        }
    };
    put_resource(
        &state,
        &headers,
        webhook_addressed(&name),
        resource,
        is,
        bus_exists,
        HashMap::new(),
    )
    .await
}

async fn delete_webhook(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let is = |h: &WebhookConfig| *h.name.get_ref() == name;
    delete_resource(&state, &headers, webhook_addressed(&name), is, |_| Ok(())).await
}

// ---------------------------------------------------------------------------------------
// Replays

/// A time as RFC 3339 text or milliseconds since the Unix epoch.
fn parse_time(value: &Value, pointer: &str) -> Result<u64, Problem> {
    match value {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            Problem::invalid_resource(
                pointer,
                "a time is milliseconds since the Unix epoch or RFC 3339 text",
            )
        }),
        Value::String(s) => chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_millis().max(0) as u64)
            .map_err(|e| {
                Problem::invalid_resource(pointer, format!("`{s}` is not an RFC 3339 time: {e}"))
            }),
        _ => Err(Problem::invalid_resource(
            pointer,
            "a time is milliseconds since the Unix epoch or RFC 3339 text",
        )),
    }
}

/// `POST /api/v1/buses/{bus}/replays`: `{"rule", "target"?, "from"?, "to"?}` (acceptance
/// times) or `{"rule", "target"?, "positions": {"0": [from, to], ...}}`.
async fn start_replay(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    match start_replay_inner(&state, &bus, &body).await {
        Ok(status) => {
            let location = format!("/api/v1/buses/{bus}/replays/{}", status.id);
            let mut response = (StatusCode::ACCEPTED, Json(json!(status))).into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, v);
            }
            response
        }
        Err(p) => p.into_response(),
    }
}

async fn start_replay_inner(
    state: &IngressState,
    bus: &str,
    body: &[u8],
) -> Result<crate::replay::ReplayStatus, Problem> {
    let request: Map<String, Value> = match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => map,
        Ok(_) => {
            return Err(Problem::invalid_resource(
                "",
                "the body must be a JSON object",
            ))
        }
        Err(e) => {
            return Err(Problem::invalid_resource(
                "",
                format!("the body is not JSON: {e}"),
            ))
        }
    };
    for key in request.keys() {
        if !matches!(
            key.as_str(),
            "rule" | "target" | "from" | "to" | "positions"
        ) {
            return Err(Problem::invalid_resource(
                &format!("/{key}"),
                format!("unknown field `{key}` (rule, target, from, to, positions)"),
            ));
        }
    }
    let plan = state
        .plan()
        .ok_or_else(|| Problem::unavailable("the gateway is starting", 1))?;
    let Some(bus_plan) = plan.buses.get(bus) else {
        return Err(no_bus(bus));
    };
    let Some(rule) = request.get("rule").and_then(Value::as_str) else {
        return Err(Problem::invalid_resource(
            "/rule",
            "`rule` (the name of a rule of the bus) is required",
        ));
    };
    let target = match request.get("target") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t.as_str()),
        Some(_) => {
            return Err(Problem::invalid_resource(
                "/target",
                "`target` is a target's name",
            ))
        }
    };
    let subscriptions = crate::replay::subscriptions(&plan, bus, rule, target);
    if subscriptions.is_empty() {
        return Err(Problem::invalid_resource(
            if target.is_some() { "/target" } else { "/rule" },
            match target {
                Some(t) => format!("rule `{rule}` of bus `{bus}` has no target `{t}` running"),
                None => format!("bus `{bus}` has no rule `{rule}` running"),
            },
        ));
    }
    let from_ms = request
        .get("from")
        .map(|v| parse_time(v, "/from"))
        .transpose()?;
    let to_ms = request
        .get("to")
        .map(|v| parse_time(v, "/to"))
        .transpose()?;
    if let (Some(f), Some(t)) = (from_ms, to_ms) {
        if t <= f {
            return Err(Problem::invalid_resource(
                "/to",
                "`to` must be after `from`",
            ));
        }
    }
    let positions = match request.get("positions") {
        None => None,
        Some(Value::Object(map)) => {
            if from_ms.is_some() || to_ms.is_some() {
                return Err(Problem::invalid_resource(
                    "/positions",
                    "give a time range (`from`, `to`) or `positions`, not both",
                ));
            }
            let mut out = BTreeMap::new();
            for (shard, range) in map {
                let at = format!("/positions/{shard}");
                let shard: u32 = shard
                    .parse()
                    .ok()
                    .filter(|s| *s < bus_plan.log.shards())
                    .ok_or_else(|| {
                        Problem::invalid_resource(
                            &at,
                            format!("bus `{bus}` has shards 0 to {}", bus_plan.log.shards() - 1),
                        )
                    })?;
                let pair = range.as_array().and_then(|a| match a.as_slice() {
                    [from, to] => Some((from.as_u64()?, to.as_u64()?)),
                    _ => None,
                });
                match pair {
                    Some((from, to)) if from <= to => {
                        out.insert(shard, (from, to));
                    }
                    _ => {
                        return Err(Problem::invalid_resource(
                            &at,
                            "a shard's range is `[from, to]`, positions with from <= to",
                        ))
                    }
                }
            }
            Some(out)
        }
        Some(_) => {
            return Err(Problem::invalid_resource(
                "/positions",
                "`positions` maps a shard to `[from, to]`",
            ))
        }
    };
    let (_, admin) = state
        .admin()
        .ok_or_else(|| Problem::unavailable("the gateway is starting", 1))?;
    let store = state
        .replays
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    crate::replay::start(
        crate::replay::ReplayRequest {
            bus: bus.to_string(),
            rule: rule.to_string(),
            subscriptions,
            log: bus_plan.log.clone(),
            from_ms,
            to_ms,
            positions,
        },
        store,
        state.cluster.worker_id(),
        admin.replay_batch,
        &state.replay_cancels,
    )
    .await
    .map_err(|e| store_problem(&e))
}

/// Replays of `bus`, newest first. A replay still `RUNNING` on a worker that left the
/// cluster says so in `reason` until another replica takes it over.
async fn replays_of(state: &IngressState, bus: &str) -> Result<Vec<Value>, Problem> {
    let store = state
        .replays
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut all = store.list().await.map_err(|e| store_problem(&e))?;
    let members = state.cluster.members().await.unwrap_or_default();
    all.retain(|r| r.bus == bus);
    all.sort_by_key(|r| std::cmp::Reverse(r.created_ms));
    Ok(all
        .into_iter()
        .map(|mut r| {
            if r.state == "RUNNING" && !members.contains(&r.worker) {
                r.reason = Some(format!(
                    "worker `{}`, which ran it, left the cluster; another replica takes it over",
                    r.worker
                ));
            }
            json!(r)
        })
        .collect())
}

async fn list_replays(State(state): State<Arc<IngressState>>, Path(bus): Path<String>) -> Response {
    match replays_of(&state, &bus).await {
        Ok(items) => Json(json!({"items": items})).into_response(),
        Err(p) => p.into_response(),
    }
}

async fn get_replay(
    State(state): State<Arc<IngressState>>,
    Path((bus, id)): Path<(String, String)>,
) -> Response {
    match replays_of(&state, &bus).await {
        Ok(items) => match items.into_iter().find(|r| r["id"] == id.as_str()) {
            Some(r) => Json(r).into_response(),
            None => Problem::unknown(format!("no replay `{id}` of bus `{bus}`"))
                .with_field("replay")
                .into_response(),
        },
        Err(p) => p.into_response(),
    }
}

async fn cancel_replay(
    State(state): State<Arc<IngressState>>,
    Path((bus, id)): Path<(String, String)>,
) -> Response {
    let items = match replays_of(&state, &bus).await {
        Ok(items) => items,
        Err(p) => return p.into_response(),
    };
    let Some(replay) = items.into_iter().find(|r| r["id"] == id.as_str()) else {
        return Problem::unknown(format!("no replay `{id}` of bus `{bus}`"))
            .with_field("replay")
            .into_response();
    };
    if replay["state"] != "RUNNING" {
        return StatusCode::NO_CONTENT.into_response();
    }
    // Kept in the map (it marks the replay as this process's, not an orphan).
    let cancelled_here = state
        .replay_cancels
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .is_some_and(|cancel| cancel.send(true).is_ok());
    if cancelled_here {
        return StatusCode::NO_CONTENT.into_response();
    }
    // Running on another worker (or its run here already ended): mark it in the store;
    // the worker running it stops at its next progress record.
    let store = state
        .replays
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    match crate::replay::cancel_anywhere(store.as_ref(), &id, state.cluster.worker_id()).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

// ---------------------------------------------------------------------------------------
// Recent events, redelivery

/// `GET /api/v1/buses/{bus}/events?limit=N`: the newest stored events of the bus (still in
/// its log), each with its delivery state per subscription that takes it. On buses with
/// many shards, approximately the newest (each shard gives a bounded share).
async fn recent_events(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let mut limit = 20usize;
    for pair in query
        .as_deref()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        match (key, value.parse::<usize>()) {
            ("limit", Ok(n)) if (1..=200).contains(&n) => limit = n,
            ("limit", _) => {
                return Problem::bad_request("limit", "`limit` is a number from 1 to 200")
                    .into_response()
            }
            (other, _) => {
                return Problem::bad_request(other, format!("unknown parameter `{other}` (limit)"))
                    .into_response()
            }
        }
    }
    let Some(plan) = state.plan() else {
        return Problem::unavailable("the gateway is starting", 1).into_response();
    };
    let Some(bus_plan) = plan.buses.get(&bus) else {
        return no_bus(&bus).into_response();
    };
    let positions = state.positions();
    let log = bus_plan.log.clone();
    let mut items = Vec::new();
    // The newest `limit` of each shard would be exact; on a bus with many shards that is
    // too much to read for one request, so each shard gives a fair share (four times its
    // even part, at least eight).
    let shards = log.shards().max(1) as usize;
    let per_shard = limit.min((4 * limit / shards + 1).max(8));
    for shard in 0..log.shards() {
        let end = match log.end(shard).await {
            Ok(end) => end,
            Err(e) => return store_problem(&e).into_response(),
        };
        let from = end.saturating_sub(per_shard as u64);
        let records = match log.reader(shard, from).await {
            Ok(mut reader) => reader.read(per_shard).await.unwrap_or_default(),
            Err(e) => return store_problem(&e).into_response(),
        };
        let group = match &positions {
            Some(p) => p.peek_group(&bus, shard).await.ok(),
            None => None,
        };
        for record in records {
            let Ok(event) = crate::event::decode(&record.payload) else {
                continue;
            };
            let mut subscriptions = Map::new();
            for sub in &bus_plan.subscriptions {
                if !sub.filter.matches(&event) {
                    continue;
                }
                let at = group.as_ref().and_then(|g| g.of(&sub.name));
                let delivered = at.is_some_and(|p| p > record.seq);
                subscriptions.insert(
                    sub.name.clone(),
                    json!(if delivered { "delivered" } else { "pending" }),
                );
            }
            items.push((
                record.accepted_ms,
                record.seq,
                json!({
                    "shard": shard,
                    "seq": record.seq,
                    "accepted_ms": record.accepted_ms,
                    "event": serde_json::to_value(&event).unwrap_or(Value::Null),
                    "subscriptions": subscriptions,
                }),
            ));
        }
    }
    items.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let items: Vec<Value> = items.into_iter().take(limit).map(|(_, _, v)| v).collect();
    Json(json!({"items": items})).into_response()
}

/// `POST /api/v1/buses/{bus}/rules/{rule}/redeliver`: `{"event", "target"?}` delivers one
/// event (a dead letter, say) to that rule's targets only, through their transform chains,
/// retry policies and dead-letter destinations, marked with `sluicereplay`. The
/// `deadletter*` extensions of a dead letter are removed first.
async fn redeliver(
    State(state): State<Arc<IngressState>>,
    Path((bus, rule)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let request: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(Value::Object(map)) => map,
        Ok(_) => {
            return Problem::invalid_resource("", "the body must be a JSON object").into_response()
        }
        Err(e) => {
            return Problem::invalid_resource("", format!("the body is not JSON: {e}"))
                .into_response()
        }
    };
    if let Some(key) = request
        .keys()
        .find(|k| !matches!(k.as_str(), "event" | "target"))
    {
        return Problem::invalid_resource(
            &format!("/{key}"),
            format!("unknown field `{key}` (event, target)"),
        )
        .into_response();
    }
    let Some(plan) = state.plan() else {
        return Problem::unavailable("the gateway is starting", 1).into_response();
    };
    if !plan.buses.contains_key(&bus) {
        return no_bus(&bus).into_response();
    }
    let target = request.get("target").and_then(Value::as_str);
    let subscriptions = crate::replay::subscriptions(&plan, &bus, &rule, target);
    if subscriptions.is_empty() {
        return Problem::unknown(match target {
            Some(t) => format!("rule `{rule}` of bus `{bus}` has no target `{t}` running"),
            None => format!("bus `{bus}` has no rule `{rule}` running"),
        })
        .with_field(if target.is_some() { "/target" } else { "/rule" })
        .into_response();
    }
    let Some(event) = request.get("event") else {
        return Problem::invalid_resource(
            "/event",
            "`event` (a structured-mode CloudEvent) is required",
        )
        .into_response();
    };
    let mut event: cloudevents::Event = match serde_json::from_value(event.clone()) {
        Ok(e) => e,
        Err(e) => {
            return Problem::invalid_resource("/event", format!("not a CloudEvent: {e}"))
                .into_response()
        }
    };
    let dead: Vec<String> = event
        .iter_extensions()
        .map(|(k, _)| k.to_string())
        .filter(|k| k.starts_with("deadletter"))
        .collect();
    for key in dead {
        event.remove_extension(&key);
    }
    let id = format!(
        "redeliver-{}-{:04x}",
        crate::store::now_ms(),
        fastrand::u16(..)
    );
    let mut targets = Vec::new();
    for sub in subscriptions {
        let Some(envelope) = crate::replay::marked(&sub, event.clone(), &id) else {
            return Problem::invalid_resource(
                "/event",
                format!("the transform chain of `{}` fails on this event", sub.name),
            )
            .into_response();
        };
        targets.push(
            sub.name
                .split_once('/')
                .map_or(sub.name.clone(), |(_, t)| t.to_string()),
        );
        let replay = id.clone();
        tokio::spawn(async move {
            sub.delivery.deliver(std::slice::from_ref(&envelope)).await;
            tracing::info!(replay = %replay, subscription = %sub.id, "redelivered");
        });
    }
    (
        StatusCode::ACCEPTED,
        Json(json!({"id": id, "targets": targets})),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------
// Rule test

/// `POST /api/v1/rules/test`: `{"event": {...}, "pattern": {...} | "filter": "...",
/// "transform": step-or-chain}` or `{"event": {...}, "rule": "bus/rule", "target": "name"}`.
async fn test_rule(State(state): State<Arc<IngressState>>, body: axum::body::Bytes) -> Response {
    let request: Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(Value::Object(map)) => map,
        Ok(_) => {
            return Problem::invalid_resource("", "the body must be a JSON object").into_response()
        }
        Err(e) => {
            return Problem::invalid_resource("", format!("the body is not JSON: {e}"))
                .into_response()
        }
    };
    for key in request.keys() {
        if !matches!(
            key.as_str(),
            "event" | "pattern" | "filter" | "transform" | "rule" | "target"
        ) {
            return Problem::invalid_resource(
                &format!("/{key}"),
                format!("unknown field `{key}` (event, pattern, filter, transform, rule, target)"),
            )
            .into_response();
        }
    }
    let Some(event) = request.get("event") else {
        return Problem::invalid_resource(
            "/event",
            "`event` (a structured-mode CloudEvent) is required",
        )
        .into_response();
    };
    let mut pattern = request.get("pattern").cloned();
    let mut filter = request
        .get("filter")
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut transform = request.get("transform").cloned();
    if let Some(rule) = request.get("rule") {
        let Some((bus, name)) = rule.as_str().and_then(|r| r.split_once('/')) else {
            return Problem::invalid_resource("/rule", "`rule` is `bus/rule`").into_response();
        };
        let catalog = match catalog_of(&state) {
            Ok(c) => c,
            Err(p) => return p.into_response(),
        };
        let snapshot = match catalog.snapshot().await {
            Ok(s) => s,
            Err(e) => return store_problem(&e).into_response(),
        };
        let Some(found) = snapshot
            .channels
            .rules
            .iter()
            .find(|r| *r.bus.get_ref() == bus && *r.name.get_ref() == name)
        else {
            return Problem::unknown(format!("no rule `{name}` on bus `{bus}`"))
                .with_field("/rule")
                .into_response();
        };
        pattern = found
            .pattern
            .as_ref()
            .map(|p| serde_json::to_value(p.get_ref()).unwrap_or(Value::Null));
        filter = found.filter.as_ref().map(|f| f.get_ref().clone());
        if let Some(target) = request.get("target").and_then(Value::as_str) {
            let Some(t) = found.targets.iter().find(|t| t.name() == target) else {
                return Problem::unknown(format!("rule `{bus}/{name}` has no target `{target}`"))
                    .with_field("/target")
                    .into_response();
            };
            transform = t
                .transform()
                .map(|v| serde_json::to_value(v).unwrap_or(Value::Null));
        }
    }
    let event_bytes = serde_json::to_vec(event).unwrap_or_default();
    let everything = json!({});
    let condition = match (&pattern, &filter) {
        (Some(_), Some(_)) => {
            return Problem::invalid_resource("/filter", "give a `pattern` or a `filter`, not both")
                .into_response()
        }
        (Some(p), None) => sluice_functions::Condition::Pattern(p),
        (None, Some(f)) => sluice_functions::Condition::Filter(f),
        (None, None) => sluice_functions::Condition::Pattern(&everything),
    };
    let matched = match sluice_functions::test_rule(&event_bytes, condition, None) {
        Ok(answer) => answer["matched"].as_bool().unwrap_or(false),
        Err(e) => return rule_test_problem(&e).into_response(),
    };
    let mut answer = json!({ "matched": matched });
    if let (true, Some(transform)) = (matched, &transform) {
        // Each step on its own, fed the previous step's event: what each one produced.
        let steps: Vec<Value> = match transform {
            Value::Array(steps) => steps.clone(),
            one => vec![one.clone()],
        };
        if let Err(e) = sluice_functions::TransformChain::compile(transform) {
            return Problem::invalid_resource("/transform", e.to_string()).into_response();
        }
        let mut current = event_bytes.clone();
        let mut outputs = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let everything = json!({});
            match sluice_functions::test_rule(
                &current,
                sluice_functions::Condition::Pattern(&everything),
                Some(step),
            ) {
                Ok(out) => {
                    let output = out.get("output").cloned().unwrap_or(Value::Null);
                    current = serde_json::to_vec(&output).unwrap_or_default();
                    outputs.push(json!({"step": i, "output": output}));
                }
                Err(e) => {
                    outputs.push(json!({"step": i, "error": e.to_string()}));
                    break;
                }
            }
        }
        if let Some(last) = outputs.last().and_then(|o| o.get("output")).cloned() {
            answer["output"] = last;
        }
        answer["steps"] = Value::Array(outputs);
    }
    Json(answer).into_response()
}

fn rule_test_problem(e: &sluice_functions::RuleTestError) -> Problem {
    let text = e.to_string();
    let at = match e {
        sluice_functions::RuleTestError::Event(_) => "/event",
        sluice_functions::RuleTestError::Pattern(p) => {
            return Problem::invalid_resource(
                &format!("/pattern{}", crate::rules::path_to_pointer(&p.path)),
                text,
            )
        }
        sluice_functions::RuleTestError::Filter(_) => "/filter",
        _ => "/transform",
    };
    Problem::invalid_resource(at, text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::ServiceExt as _;

    async fn router(hashes: Vec<[u8; 32]>) -> (Router, tempfile::TempDir) {
        let allow_local = hashes.is_empty();
        router_with(AdminAuth {
            hashes,
            allow_local,
            strategy: "sorted-hash".to_string(),
            replay_batch: 100,
            ..AdminAuth::default()
        })
        .await
    }

    async fn router_with(auth: AdminAuth) -> (Router, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let state = Arc::new(IngressState::new(
            HashMap::new(),
            crate::config::Limits::default(),
            Arc::new(crate::store::cluster::LocalCluster::new("w")),
        ));
        let catalog = Catalog::new(Arc::new(catalog::FileCatalog::new(dir.path())));
        state.set_admin(catalog, auth);
        (routes(state), dir)
    }

    fn request(peer: [u8; 4], token: Option<&str>, path: &str) -> Request {
        let mut builder = axum::http::Request::get(path);
        if let Some(token) = token {
            builder = builder.header("authorization", format!("Bearer {token}"));
        }
        let mut request = builder.body(axum::body::Body::empty()).unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from((peer, 40000))));
        request
    }

    #[tokio::test]
    async fn without_a_token_only_loopback_is_answered() {
        let (router, _dir) = router(Vec::new()).await;
        let local = router
            .clone()
            .oneshot(request([127, 0, 0, 1], None, "/api/v1/buses"))
            .await
            .unwrap();
        assert_eq!(local.status(), 200);
        let remote = router
            .clone()
            .oneshot(request([10, 1, 2, 3], None, "/api/v1/buses"))
            .await
            .unwrap();
        assert_eq!(remote.status(), 403);
        assert_eq!(remote.headers()["content-type"], "application/problem+json");
        // Open routes stay open.
        let doc = router
            .oneshot(request([10, 1, 2, 3], None, "/api/v1/openapi.json"))
            .await
            .unwrap();
        assert_eq!(doc.status(), 200);
    }

    #[tokio::test]
    async fn with_tokens_any_peer_needs_one_of_them() {
        let hash = parse_hash(&hash_token("t0ken")).unwrap();
        let (router, _dir) = router(vec![hash]).await;
        for (peer, token, status) in [
            ([127, 0, 0, 1], None, 401),
            ([10, 1, 2, 3], None, 401),
            ([10, 1, 2, 3], Some("wrong"), 401),
            ([10, 1, 2, 3], Some("t0ken"), 200),
        ] {
            let answer = router
                .clone()
                .oneshot(request(peer, token, "/api/v1/buses"))
                .await
                .unwrap();
            assert_eq!(answer.status(), status, "{peer:?} {token:?}");
        }
    }

    #[test]
    fn token_hashes_are_checked() {
        assert!(parse_hash("sha256:00").is_err());
        assert!(parse_hash(&"g".repeat(64)).is_err());
        let h = hash_token("abc");
        assert_eq!(
            h,
            "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert!(parse_hash(&h).is_ok());
    }

    fn local_auth(hosts: &[&str], origins: &[&str]) -> AdminAuth {
        let config = AdminConfig {
            allow_local_without_token: true,
            allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
            allowed_origins: origins.iter().map(|o| o.to_string()).collect(),
            ..AdminConfig::default()
        };
        let dir = tempfile::tempdir().unwrap();
        AdminAuth::from_config(&config, "sorted-hash", 100, dir.path()).unwrap()
    }

    #[test]
    fn host_names_are_checked_against_the_listener_loopback_and_the_list() {
        let auth = local_auth(&["sluice.internal", "gw.example:9000"], &[]);
        let local = Some(SocketAddr::from(([127, 0, 0, 1], 8080)));
        for (host, ok) in [
            ("127.0.0.1:8080", true),
            ("localhost:8080", true),
            ("LOCALHOST.:8080", true),
            ("[::1]:8080", true),
            ("127.0.0.1:9999", false),
            ("localhost", false),
            ("rebind.evil.example:8080", false),
            ("sluice.internal:1234", true),
            ("gw.example:9000", true),
            ("gw.example:9001", false),
            ("::1", false),
            ("a b", false),
        ] {
            assert_eq!(auth.host_allowed(Some(host), local), ok, "{host}");
        }
        // A `[::]` listener: the address the connection came in on counts as its name.
        let on_v6 = Some("[::ffff:10.0.0.5]:8080".parse::<SocketAddr>().unwrap());
        assert!(auth.host_allowed(Some("10.0.0.5:8080"), on_v6));
        assert!(!auth.host_allowed(Some("10.0.0.6:8080"), on_v6));
        // With a token and no list, any name; with a list, only the list and local names.
        let token = AdminAuth {
            hashes: vec![[0; 32]],
            ..AdminAuth::default()
        };
        assert!(token.host_allowed(Some("rebind.evil.example:8080"), local));
        let listed = AdminAuth {
            hashes: vec![[0; 32]],
            allowed_hosts: vec!["sluice.internal".to_string()],
            ..AdminAuth::default()
        };
        assert!(!listed.host_allowed(Some("rebind.evil.example:8080"), local));
        assert!(local_auth(&["*"], &[]).host_allowed(Some("anything:1"), local));
    }

    #[test]
    fn origins_must_be_the_host_or_listed() {
        let auth = local_auth(&[], &["https://console.example.com/"]);
        let host = Some("127.0.0.1:8080");
        assert!(auth.origin_allowed("http://127.0.0.1:8080", host));
        assert!(!auth.origin_allowed("http://127.0.0.1:8081", host));
        assert!(!auth.origin_allowed("https://evil.example", host));
        assert!(!auth.origin_allowed("null", host));
        assert!(auth.origin_allowed("HTTPS://console.example.com", host));
        // Behind a proxy that ends TLS: `https://admin.example` against `Host: admin.example`.
        assert!(auth.origin_allowed("https://admin.example", Some("admin.example")));
        assert!(!auth.origin_allowed("https://admin.example", Some("admin.example:8080")));
        let bad = AdminConfig {
            allowed_origins: vec!["console.example.com".to_string()],
            allow_local_without_token: true,
            ..AdminConfig::default()
        };
        let dir = tempfile::tempdir().unwrap();
        assert!(AdminAuth::from_config(&bad, "sorted-hash", 1, dir.path()).is_err());
    }

    #[test]
    fn json_types_are_json_and_nothing_else() {
        for t in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/merge-patch+json",
        ] {
            assert!(json_type(t), "{t}");
        }
        for t in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "text/json",
            "",
        ] {
            assert!(!json_type(t), "{t}");
        }
    }

    #[test]
    fn a_generated_token_is_kept_owner_only_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TOKEN_FILE);
        let first = generated_token(&path).unwrap();
        assert_eq!(first.len(), 64);
        assert!(first.bytes().all(|b| b.is_ascii_hexdigit()));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        assert_eq!(
            generated_token(&path).unwrap(),
            first,
            "stable across restarts"
        );
        let other = tempfile::tempdir().unwrap();
        assert_ne!(
            generated_token(&other.path().join(TOKEN_FILE)).unwrap(),
            first
        );
    }

    fn write(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request {
        let mut builder = axum::http::Request::builder().method(method).uri(path);
        for (k, v) in headers {
            builder = builder.header(*k, *v);
        }
        let mut request = builder
            .body(axum::body::Body::from(body.to_string()))
            .unwrap();
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
        request
            .extensions_mut()
            .insert(LocalAddr(SocketAddr::from(([127, 0, 0, 1], 8080))));
        request
    }

    #[tokio::test]
    async fn cross_site_writes_are_refused_before_anything_runs() {
        let (router, _dir) = router(Vec::new()).await;
        let body = r#"{"rules":[]}"#;
        let host = ("host", "127.0.0.1:8080");
        for (headers, status, field) in [
            (
                vec![
                    ("host", "rebind.evil.example:8080"),
                    ("origin", "https://evil.example"),
                    ("content-type", "text/plain"),
                ],
                403,
                "host",
            ),
            (
                vec![
                    host,
                    ("origin", "https://evil.example"),
                    ("content-type", "application/json"),
                ],
                403,
                "origin",
            ),
            (
                vec![
                    host,
                    ("sec-fetch-site", "cross-site"),
                    ("content-type", "application/json"),
                ],
                403,
                "sec-fetch-site",
            ),
            (
                vec![host, ("content-type", "text/plain")],
                415,
                "content-type",
            ),
            (vec![host], 415, "content-type"),
            (
                vec![
                    host,
                    ("x-forwarded-for", "10.0.0.1"),
                    ("content-type", "application/json"),
                ],
                403,
                "x-forwarded-for",
            ),
        ] {
            let answer = router
                .clone()
                .oneshot(write(
                    "POST",
                    "/api/v1/catalog/apply?dry_run=true",
                    &headers,
                    body,
                ))
                .await
                .unwrap();
            assert_eq!(answer.status(), status, "{headers:?}");
            let bytes = axum::body::to_bytes(answer.into_body(), 1 << 16)
                .await
                .unwrap();
            let problem: Value = serde_json::from_slice(&bytes).unwrap();
            assert_eq!(problem["field"], field, "{headers:?}");
        }
        let same_origin = router
            .clone()
            .oneshot(write(
                "POST",
                "/api/v1/catalog/apply?dry_run=true",
                &[
                    host,
                    ("origin", "http://127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                    ("content-type", "application/json; charset=utf-8"),
                ],
                body,
            ))
            .await
            .unwrap();
        assert_eq!(same_origin.status(), 200);
        // A body-less action needs no type, and a preflight gets no CORS permission.
        let preflight = router
            .oneshot(write(
                "OPTIONS",
                "/api/v1/catalog/apply",
                &[
                    host,
                    ("origin", "https://evil.example"),
                    ("access-control-request-method", "POST"),
                ],
                "",
            ))
            .await
            .unwrap();
        assert!(preflight
            .headers()
            .keys()
            .all(|k| !k.as_str().starts_with("access-control-")));
    }
}
