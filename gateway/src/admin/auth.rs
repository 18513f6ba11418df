//! Who may use the admin API and from where: the tokens (`admin.tokens`, `SLUICE_ADMIN_TOKEN`,
//! or one generated and kept in `{data_dir}/admin-token`), loopback under the explicit opt-in,
//! and the `Host` and `Origin` a request may carry (which `crate::admin::guard` checks).

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::net::SocketAddr;

use axum::extract::Request;
use axum::http::header;
use sha2::{Digest, Sha256};

use crate::config::AdminConfig;

/// Who may use the admin API, and from where (`Host`, `Origin`).
#[derive(Debug, Default)]
pub struct AdminAuth {
    /// SHA-256 of each accepted token.
    pub(super) hashes: Vec<[u8; 32]>,
    /// `admin.allow_local_without_token` (only meaningful without tokens).
    pub(super) allow_local: bool,
    /// `admin.allowed_hosts`, lowercased; `*` is kept as `any_host`.
    pub(super) allowed_hosts: Vec<String>,
    pub(super) any_host: bool,
    /// `admin.allowed_origins`, lowercased, without a trailing slash.
    pub(super) allowed_origins: Vec<String>,
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

    pub(super) fn accepts(&self, token: &str) -> bool {
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
pub(super) fn generated_token(path: &std::path::Path) -> std::io::Result<String> {
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
pub(super) fn restrict(path: &std::path::Path) -> std::io::Result<()> {
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
pub(super) fn split_host(host: &str) -> Option<(String, Option<u16>)> {
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
pub(super) fn host_ip(name: &str) -> Option<std::net::IpAddr> {
    name.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .ok()
        .map(|ip| ip.to_canonical())
}

/// An origin as compared: lowercased, without a trailing slash.
pub(super) fn normal_origin(origin: &str) -> String {
    origin.trim().trim_end_matches('/').to_ascii_lowercase()
}

/// `(scheme, host, port)` of a normalized origin (`http://host[:port]`, nothing after),
/// the port defaulted from the scheme.
pub(super) fn origin_authority(origin: &str) -> Option<(&str, String, u16)> {
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
pub(super) fn request_host(request: &Request) -> Option<String> {
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
    pub(super) fn host_allowed(&self, host: Option<&str>, local: Option<SocketAddr>) -> bool {
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
    pub(super) fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
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

    pub(super) fn origin_listed(&self, origin: &str) -> bool {
        let origin = normal_origin(origin);
        self.allowed_origins.contains(&origin)
    }
}

/// Headers a proxy adds: a request carrying one did not come from the peer's own process.
pub(super) const PROXY_HEADERS: [&str; 4] = ["forwarded", "x-forwarded-for", "x-real-ip", "via"];

/// Body types the admin API reads: JSON (`sluice ctl` converts TOML and YAML files to it).
pub(super) fn json_type(content_type: &str) -> bool {
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
