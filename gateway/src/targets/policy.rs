//! What a target of the catalog may read and reach on a replica: which secrets (environment
//! variables whose names start with `admin.secret_env_prefix`, never a literal), which files
//! (under `data_dir` or `targets.file_roots`, resolved without `..` or a symlink leading
//! out) and which addresses (no link-local or cloud metadata address unless
//! `targets.allow_private_egress`).
//!
//! The catalog is written through the admin API and run by every replica, so whoever may
//! write a rule must not be able, through it, to read a replica's secrets, write its files
//! or ask its cloud's metadata service for credentials. Each rule of the policy is a small
//! pure function, called where resources are checked (the configuration file that seeds the
//! catalog, the admin API's validation) and again where a target is built, so a catalog
//! stored before the policy existed cannot get around it either.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Component, Path, PathBuf};

use crate::targets::config::TargetConfig;
use crate::targets::target::TargetError;

/// The operator's policy for catalog targets, as this replica's configuration sets it.
#[derive(Debug, Clone)]
pub struct TargetPolicy {
    /// `admin.secret_env_prefix`: the environment variables `env:` references may name.
    pub secret_env_prefix: String,
    /// `targets.allow_private_egress`.
    pub allow_private_egress: bool,
    /// `data_dir`, as configured (file targets may always write under it).
    pub data_dir: PathBuf,
    /// `targets.file_roots`.
    pub file_roots: Vec<PathBuf>,
    /// How file targets write (`durability`).
    pub durability: crate::store::Durability,
}

impl TargetPolicy {
    /// Resolves `{data_dir}` in a path taken from the configuration.
    pub fn expand_path(&self, path: &str) -> PathBuf {
        PathBuf::from(path.replace("{data_dir}", &self.data_dir.to_string_lossy()))
    }
}

// ---------------------------------------------------------------------------------------
// Secrets

use crate::secrets::{check_exposed, check_redis_url, check_secret_ref};

/// Resolves a secret of a catalog resource (see [`crate::secrets::secret`]).
pub fn secret(value: &str, prefix: &str) -> Result<String, TargetError> {
    crate::secrets::secret(value, prefix).map_err(TargetError::fatal)
}

/// A Redis URL of a catalog resource, resolved (see [`check_redis_url`]).
pub fn redis_url(value: &str, prefix: &str) -> Result<String, TargetError> {
    crate::secrets::redis_url(value, prefix).map_err(TargetError::fatal)
}

/// How a field of a target holds a secret.
enum Secret {
    /// A secret: an `env:` reference only.
    Required,
    /// A value that may be a secret (a user name): literal, or an `env:` reference.
    Optional,
    /// A Redis URL: literal without credentials, or an `env:` reference.
    RedisUrl,
}

/// The secret-bearing fields of a target, each with its JSON pointer inside the target.
fn secret_fields(target: &TargetConfig) -> Vec<(String, &str, Secret)> {
    use crate::targets::config::AuthConfig;
    let mut fields = Vec::new();
    match target {
        TargetConfig::Http(c) => {
            if let Some(s) = &c.signing_secret {
                fields.push(("/signing_secret".to_string(), s.as_str(), Secret::Required));
            }
            match &c.auth {
                None => {}
                Some(AuthConfig::Bearer { token }) => {
                    fields.push(("/auth/token".to_string(), token.as_str(), Secret::Required))
                }
                Some(AuthConfig::Basic { username, password }) => {
                    fields.push((
                        "/auth/username".to_string(),
                        username.as_str(),
                        Secret::Optional,
                    ));
                    fields.push((
                        "/auth/password".to_string(),
                        password.as_str(),
                        Secret::Required,
                    ));
                }
                Some(AuthConfig::ApiKey { key, .. }) => {
                    fields.push(("/auth/key".to_string(), key.as_str(), Secret::Required))
                }
            }
        }
        TargetConfig::RedisStream(c) => {
            fields.push(("/url".to_string(), c.url.as_str(), Secret::RedisUrl))
        }
        TargetConfig::Log(_)
        | TargetConfig::File(_)
        | TargetConfig::Rocketmq(_)
        | TargetConfig::Bus(_)
        | TargetConfig::Function(_) => {}
    }
    fields
}

/// Checks a target of the catalog against the policy, reading nothing but the file system
/// (to resolve a file target's path): its secrets are exposed `env:` references, its file
/// is under an allowed root, its URL is not a refused address; the same for its dead-letter
/// target. `Err((JSON pointer inside the target, message))`.
pub fn check_policy(policy: &TargetPolicy, target: &TargetConfig) -> Result<(), (String, String)> {
    let prefix = policy.secret_env_prefix.as_str();
    for (pointer, value, kind) in secret_fields(target) {
        let checked = match kind {
            Secret::Required => check_secret_ref(value, prefix),
            Secret::Optional => match value.strip_prefix("env:") {
                Some(name) => check_exposed(name, prefix),
                None => Ok(()),
            },
            Secret::RedisUrl => check_redis_url(value, prefix),
        };
        checked.map_err(|m| (pointer, m))?;
    }
    match target {
        TargetConfig::File(c) => {
            allowed_file_path(policy, &c.path).map_err(|m| ("/path".to_string(), m))?;
        }
        TargetConfig::Http(c) => {
            check_url(&c.url, policy).map_err(|m| ("/url".to_string(), m))?;
            check_headers(c.headers.keys(), policy)?;
        }
        TargetConfig::Function(c) => {
            check_url(&c.url, policy).map_err(|m| ("/url".to_string(), m))?;
        }
        _ => {}
    }
    let (_, dead_letter) = target.delivery();
    if let Some(t) = dead_letter.and_then(|d| d.target.as_deref()) {
        check_policy(policy, t).map_err(|(p, m)| (format!("/dead_letter/target{p}"), m))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Files

/// `path` made absolute (relative to the current directory, as `data_dir` is) with every
/// symlink resolved: the nearest ancestor that exists is canonicalised and the names that do
/// not exist yet are put back on it. A path whose last part is a symlink resolves to where
/// the link points (a dangling link does not resolve).
fn resolve_real(path: &Path) -> Result<PathBuf, String> {
    let absolute = std::path::absolute(path)
        .map_err(|e| format!("cannot resolve `{}`: {e}", path.display()))?;
    let mut existing = absolute.as_path();
    let mut missing = Vec::new();
    loop {
        match std::fs::symlink_metadata(existing) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                // `..` cannot be put back on a resolved path without knowing what it undoes.
                let (Some(name), Some(parent)) = (existing.file_name(), existing.parent()) else {
                    return Err(format!("cannot resolve `{}`", path.display()));
                };
                missing.push(name.to_os_string());
                existing = parent;
            }
            Err(e) => return Err(format!("cannot resolve `{}`: {e}", path.display())),
        }
    }
    let mut real = std::fs::canonicalize(existing)
        .map_err(|e| format!("cannot resolve `{}`: {e}", existing.display()))?;
    real.extend(missing.iter().rev());
    Ok(real)
}

/// Where a file target may write: the path with `{data_dir}` expanded and every symlink
/// resolved, if that is under `data_dir` or one of `targets.file_roots` (each resolved the
/// same way). The path may not contain `..`. The target opens the returned path, so what was
/// checked is what is written.
pub fn allowed_file_path(policy: &TargetPolicy, path: &str) -> Result<PathBuf, String> {
    if path.trim().is_empty() {
        return Err("`path` is empty".to_string());
    }
    if Path::new(path)
        .components()
        .any(|c| c == Component::ParentDir)
    {
        return Err(format!(
            "path `{path}` contains `..`: write the path it means, under data_dir or a directory of targets.file_roots"
        ));
    }
    let data_dir = policy.data_dir.to_string_lossy();
    let expanded = PathBuf::from(path.replace("{data_dir}", &data_dir));
    let real = resolve_real(&expanded)?;
    let inside = std::iter::once(&policy.data_dir)
        .chain(&policy.file_roots)
        .filter_map(|root| resolve_real(root).ok())
        .any(|root| real.starts_with(root));
    if inside {
        return Ok(real);
    }
    let shown = expanded.display().to_string();
    let resolves = if Path::new(&shown) == real {
        String::new()
    } else {
        format!(" (it resolves to `{}`)", real.display())
    };
    let roots = if policy.file_roots.is_empty() {
        "none".to_string()
    } else {
        policy
            .file_roots
            .iter()
            .map(|r| format!("`{}`", r.display()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    Err(format!(
        "path `{shown}`{resolves} is outside the allowed file roots (data_dir `{data_dir}` and targets.file_roots: {roots}); file targets write only there: list the directory in targets.file_roots of each replica's configuration"
    ))
}

// ---------------------------------------------------------------------------------------
// Egress

fn refused_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    // 0.0.0.0/8 ("this network": connecting to it reaches the host itself), link-local
    // 169.254.0.0/16 (AWS, GCP, Azure and OpenStack metadata at 169.254.169.254), and
    // Alibaba Cloud's metadata address.
    a == 0 || (a == 169 && b == 254) || ip == Ipv4Addr::new(100, 100, 100, 200)
}

/// Whether targets may not send to this address unless `targets.allow_private_egress`:
/// link-local and cloud metadata addresses (and their IPv4-mapped and NAT64 forms).
/// Loopback and private ranges stay allowed (sidecars, services of the same network).
pub fn refused_address(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => refused_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return refused_v4(v4);
            }
            let s = v6.segments();
            // 64:ff9b::/96 (NAT64) carries an IPv4 address in its last 32 bits.
            if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
                let [.., a, b, c, d] = v6.octets();
                return refused_v4(Ipv4Addr::new(a, b, c, d));
            }
            v6.is_unspecified()
                || (s[0] & 0xffc0) == 0xfe80
                || v6 == Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)
        }
    }
}

/// Why an address is refused, for messages.
const REFUSED: &str = "link-local and cloud metadata addresses (169.254.0.0/16, fe80::/10, fd00:ec2::254, 100.100.100.200, 0.0.0.0/8) are refused for targets; set targets.allow_private_egress = true to allow them";

/// Checks a target's URL against the egress policy where it can be checked without DNS:
/// an address written in the URL. Host names are checked when they are resolved, at each
/// connection ([`EgressResolver`]).
pub fn check_egress(url: &str, allow_private: bool) -> Result<(), String> {
    if allow_private {
        return Ok(());
    }
    let Ok(parsed) = url::Url::parse(url) else {
        // The target's own check says what is wrong with it.
        return Ok(());
    };
    let ip = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => IpAddr::V4(ip),
        Some(url::Host::Ipv6(ip)) => IpAddr::V6(ip),
        _ => return Ok(()),
    };
    if refused_address(ip) {
        return Err(format!(
            "url `{}`: {ip}: {REFUSED}",
            crate::values::redact_url(url)
        ));
    }
    Ok(())
}

/// Headers that carry credentials: an http target takes them from `auth` (whose secrets are
/// `env:` references), not as literal `headers`.
const CREDENTIAL_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie"];

/// Checks an http target's extra `headers`: none of them a credential header (the catalog
/// holds no secret). `Err((JSON pointer inside the target, message))`.
pub(super) fn check_headers<'a>(
    names: impl IntoIterator<Item = &'a String>,
    policy: &TargetPolicy,
) -> Result<(), (String, String)> {
    for name in names {
        if CREDENTIAL_HEADERS.contains(&name.to_ascii_lowercase().as_str()) {
            return Err((
                format!("/headers/{}", name.replace('~', "~0").replace('/', "~1")),
                format!(
                    "header `{name}` carries credentials, and the catalog never holds a secret: use `auth` (its token, password or key as `env:{}...`)",
                    policy.secret_env_prefix
                ),
            ));
        }
    }
    Ok(())
}

/// Checks the URL of an http or function target: no password in it (the catalog holds no
/// secret: `auth = { type = "basic", ... }` takes one from the environment) and no refused
/// address written in it ([`check_egress`]).
pub fn check_url(url: &str, policy: &TargetPolicy) -> Result<(), String> {
    if url::Url::parse(url).is_ok_and(|u| u.password().is_some()) {
        return Err(format!(
            "url `{}` carries a password; the catalog never holds a secret: use `auth = {{ type = \"basic\", username = \"...\", password = \"env:{}...\" }}`",
            crate::values::redact_url(url),
            policy.secret_env_prefix
        ));
    }
    check_egress(url, policy.allow_private_egress)
}

/// The addresses a host name resolved to that targets may connect to; an error when every
/// one of them is refused (or there were none).
fn allowed_addresses(
    host: &str,
    resolved: impl IntoIterator<Item = SocketAddr>,
) -> Result<Vec<SocketAddr>, String> {
    let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) = resolved
        .into_iter()
        .partition(|addr| !refused_address(addr.ip()));
    if !allowed.is_empty() {
        return Ok(allowed);
    }
    if refused.is_empty() {
        return Err(format!("`{host}` resolves to no address"));
    }
    let shown: Vec<String> = refused.iter().map(|a| a.ip().to_string()).collect();
    Err(format!(
        "`{host}` resolves only to refused addresses ({}): {REFUSED}",
        shown.join(", ")
    ))
}

/// The HTTP clients' resolver when private egress is not allowed: the system's resolver,
/// with refused addresses taken out of every answer, so a host name cannot lead a target to
/// a metadata service (also when its DNS answer changes after the target was checked). A
/// name that resolves only to refused addresses fails the connection; the delivery is
/// retried like any connection failure, since the name's answer may change.
#[derive(Debug, Clone, Copy, Default)]
pub struct EgressResolver;

impl reqwest::dns::Resolve for EgressResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let resolved = tokio::net::lookup_host((host.as_str(), 0)).await?;
            let allowed = allowed_addresses(&host, resolved)?;
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_exposed_variables_may_be_read() {
        let p = "SLUICE_SECRET_";
        assert!(check_exposed("SLUICE_SECRET_X", p).is_ok());
        for name in [
            "OTHER_SECRET",
            "SLUICE_REDIS_URL",
            "SLUICE_ADMIN_TOKEN",
            "HOME",
        ] {
            let err = check_exposed(name, p).unwrap_err();
            assert!(
                err.contains(&format!("`{name}` is not an exposed secret"))
                    && err.contains("start with `SLUICE_SECRET_` (admin.secret_env_prefix)"),
                "{err}"
            );
        }
        // `""` exposes every variable but the gateway's own.
        assert!(check_exposed("OTHER_SECRET", "").is_ok());
        assert!(check_exposed("SLUICE_ADMIN_TOKEN", "").is_err());
        assert!(check_exposed("SLUICE_REDIS_URL", "").is_err());
        assert!(check_exposed("", "").is_err());
    }

    #[test]
    fn literal_secrets_are_refused_and_references_resolved() {
        let err = check_secret_ref("t0ken", "SLUICE_SECRET_").unwrap_err();
        assert!(
            err.contains("never holds a secret") && !err.contains("t0ken"),
            "{err}"
        );
        assert!(secret("t0ken", "SLUICE_SECRET_").is_err());
        let err = secret("env:PATH", "SLUICE_SECRET_").unwrap_err().message;
        assert!(err.contains("`PATH` is not an exposed secret"), "{err}");
        assert!(secret("env:PATH", "").is_ok());
        let err = secret("env:SLUICE_SECRET_UNSET_IN_TESTS", "SLUICE_SECRET_")
            .unwrap_err()
            .message;
        assert!(
            err.contains("SLUICE_SECRET_UNSET_IN_TESTS is not set"),
            "{err}"
        );
    }

    #[test]
    fn redis_urls_with_credentials_come_from_the_environment() {
        let p = "SLUICE_SECRET_";
        assert!(check_redis_url("redis://127.0.0.1:6379/2", p).is_ok());
        assert!(check_redis_url("env:SLUICE_SECRET_REDIS", p).is_ok());
        for url in [
            "redis://:hunter2@127.0.0.1:6379",
            "rediss://user:hunter2@cache.internal/",
            "redis://:hunter2@bad host:6379",
        ] {
            let err = check_redis_url(url, p).unwrap_err();
            assert!(
                err.contains("carries credentials") && !err.contains("hunter2"),
                "{err}"
            );
        }
        assert!(check_redis_url("env:SLUICE_REDIS_URL", p).is_err());
    }

    #[test]
    fn link_local_and_metadata_addresses_are_refused() {
        for ip in [
            "169.254.169.254",
            "169.254.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "100.100.100.200",
            "fe80::1",
            "febf::1",
            "fd00:ec2::254",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "::",
        ] {
            assert!(refused_address(ip.parse().unwrap()), "{ip}");
        }
        for ip in [
            "127.0.0.1",
            "10.0.0.1",
            "192.168.1.1",
            "172.16.0.1",
            "100.100.100.201",
            "8.8.8.8",
            "::1",
            "fd00:ec2::253",
            "fec0::1",
            "::ffff:127.0.0.1",
        ] {
            assert!(!refused_address(ip.parse().unwrap()), "{ip}");
        }
    }

    #[test]
    fn urls_with_refused_addresses_are_refused_unless_allowed() {
        for url in [
            "http://169.254.169.254/latest/meta-data",
            "http://[fd00:ec2::254]/latest",
            "http://[::ffff:169.254.169.254]/",
            "http://2852039166/",
            "http://0xa9.0xfe.0xa9.0xfe/",
            "http://0/",
        ] {
            assert!(check_egress(url, false).is_err(), "{url}");
            assert!(check_egress(url, true).is_ok(), "{url}");
        }
        for url in [
            "http://127.0.0.1:9/hook",
            "https://hooks.example.com/x",
            "http://10.1.2.3/",
        ] {
            assert!(check_egress(url, false).is_ok(), "{url}");
        }
    }

    #[test]
    fn the_resolver_drops_refused_addresses_and_fails_when_none_is_left() {
        let a = |s: &str| -> SocketAddr { s.parse().unwrap() };
        let both = [a("169.254.169.254:0"), a("10.0.0.7:0")];
        assert_eq!(
            allowed_addresses("mixed.example", both).unwrap(),
            vec![a("10.0.0.7:0")]
        );
        let err = allowed_addresses(
            "metadata.example",
            [a("169.254.169.254:0"), a("[fd00:ec2::254]:0")],
        )
        .unwrap_err();
        assert!(
            err.contains("`metadata.example` resolves only to refused addresses (169.254.169.254, fd00:ec2::254)"),
            "{err}"
        );
        assert!(allowed_addresses("none.example", []).is_err());
    }

    #[tokio::test]
    async fn the_resolver_answers_for_allowed_names() {
        use reqwest::dns::Resolve as _;
        let addrs: Vec<SocketAddr> = EgressResolver
            .resolve("localhost".parse().unwrap())
            .await
            .unwrap()
            .collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()) && !addrs.is_empty());
    }

    fn policy(data_dir: &Path, roots: &[&Path]) -> TargetPolicy {
        TargetPolicy {
            secret_env_prefix: "SLUICE_SECRET_".to_string(),
            allow_private_egress: false,
            data_dir: data_dir.to_path_buf(),
            file_roots: roots.iter().map(|r| r.to_path_buf()).collect(),
            durability: crate::store::Durability::Os,
        }
    }

    #[test]
    fn file_targets_write_only_under_allowed_roots() {
        let data = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let root = tempfile::tempdir().unwrap();
        let p = policy(data.path(), &[root.path()]);
        let real_data = std::fs::canonicalize(data.path()).unwrap();
        assert_eq!(
            allowed_file_path(&p, "{data_dir}/delivered.jsonl").unwrap(),
            real_data.join("delivered.jsonl")
        );
        assert!(allowed_file_path(&p, "{data_dir}/new/dir/x.jsonl").is_ok());
        let listed = root.path().join("sub/x.jsonl");
        assert!(allowed_file_path(&p, &listed.to_string_lossy()).is_ok());

        let elsewhere = outside.path().join("anywhere/pwned.jsonl");
        let err = allowed_file_path(&p, &elsewhere.to_string_lossy()).unwrap_err();
        assert!(
            err.contains("is outside the allowed file roots") && err.contains("targets.file_roots"),
            "{err}"
        );
        assert!(!outside.path().join("anywhere").exists());
        let err = allowed_file_path(&p, "{data_dir}/../x.jsonl").unwrap_err();
        assert!(err.contains("contains `..`"), "{err}");
        assert!(allowed_file_path(&p, "/etc/passwd").is_err());
        assert!(allowed_file_path(&p, " ").is_err());

        // A symlink inside the data directory leading out: as a directory and as the file.
        std::os::unix::fs::symlink(outside.path(), data.path().join("out")).unwrap();
        let err = allowed_file_path(&p, "{data_dir}/out/x.jsonl").unwrap_err();
        assert!(err.contains("it resolves to"), "{err}");
        let target = outside.path().join("target.jsonl");
        std::fs::write(&target, b"").unwrap();
        std::os::unix::fs::symlink(&target, data.path().join("link.jsonl")).unwrap();
        assert!(allowed_file_path(&p, "{data_dir}/link.jsonl").is_err());
        // A dangling link cannot be checked, so it is refused.
        std::os::unix::fs::symlink(outside.path().join("nothing"), data.path().join("dangling"))
            .unwrap();
        assert!(allowed_file_path(&p, "{data_dir}/dangling").is_err());
        // A symlink that stays inside is fine, and resolves to its target.
        std::fs::write(data.path().join("real.jsonl"), b"").unwrap();
        std::os::unix::fs::symlink(data.path().join("real.jsonl"), data.path().join("in.jsonl"))
            .unwrap();
        assert_eq!(
            allowed_file_path(&p, "{data_dir}/in.jsonl").unwrap(),
            real_data.join("real.jsonl")
        );
    }

    #[test]
    fn every_secret_field_of_a_target_is_checked_with_its_pointer() {
        let data = tempfile::tempdir().unwrap();
        let p = policy(data.path(), &[]);
        let target = |toml_text: &str| -> TargetConfig { toml::from_str(toml_text).unwrap() };
        for (text, pointer) in [
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nauth = { type = \"bearer\", token = \"env:OTHER_SECRET\" }",
                "/auth/token",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nsigning_secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"",
                "/signing_secret",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nauth = { type = \"basic\", username = \"u\", password = \"pw\" }",
                "/auth/password",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nauth = { type = \"api-key\", header = \"x-key\", key = \"env:SLUICE_ADMIN_TOKEN\" }",
                "/auth/key",
            ),
            (
                "type = \"redis-stream\"\nname = \"r\"\nstream = \"s\"\nurl = \"redis://:pw@127.0.0.1/\"",
                "/url",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://169.254.169.254/latest/meta-data\"",
                "/url",
            ),
            (
                "type = \"function\"\nname = \"f\"\nreply_bus = \"b\"\nurl = \"http://[fd00:ec2::254]/\"",
                "/url",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"https://u:hunter2@hooks.example/\"",
                "/url",
            ),
            (
                "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nheaders = { x-team = \"a\", Authorization = \"Bearer t\" }",
                "/headers/Authorization",
            ),
            (
                "type = \"file\"\nname = \"f\"\npath = \"/tmp/anywhere/pwned.jsonl\"",
                "/path",
            ),
            (
                "type = \"bus\"\nname = \"b\"\nbus = \"x\"\ndead_letter = { target = { type = \"file\", name = \"d\", path = \"/tmp/x.jsonl\" } }",
                "/dead_letter/target/path",
            ),
        ] {
            let (at, _) = check_policy(&p, &target(text)).unwrap_err();
            assert_eq!(at, pointer, "{text}");
        }
        for text in [
            "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\nsigning_secret = \"env:SLUICE_SECRET_SIGN\"\nauth = { type = \"basic\", username = \"u\", password = \"env:SLUICE_SECRET_PW\" }",
            "type = \"redis-stream\"\nname = \"r\"\nstream = \"s\"",
            "type = \"file\"\nname = \"f\"\npath = \"{data_dir}/out.jsonl\"",
        ] {
            assert!(check_policy(&p, &target(text)).is_ok(), "{text}");
        }
    }
}
