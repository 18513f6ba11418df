//! Secrets: how configuration names them (`env:NAME`), which environment variables a catalog
//! resource may read (`admin.secret_env_prefix`, never the gateway's own settings), and
//! their resolution. The catalog never holds a secret's value.

/// The gateway's own variables (`SLUICE_ADMIN_TOKEN`, `SLUICE_REDIS_URL`, ...): never
/// readable by a catalog resource, whatever the prefix (even `""`).
fn own_variable(name: &str) -> bool {
    name.strip_prefix("SLUICE_").is_some_and(|key| {
        let key = key.to_ascii_lowercase();
        crate::values::ENV_KEYS.contains(&key.as_str())
            || matches!(key.as_str(), "admin_token" | "config" | "server")
    })
}

/// Checks that a catalog resource may read the environment variable `name`: its name starts
/// with `admin.secret_env_prefix`, and it is not one of the gateway's own settings.
pub fn check_exposed(name: &str, prefix: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("`env:` must be followed by the name of an environment variable".to_string());
    }
    if !name.starts_with(prefix) || own_variable(name) {
        let allowed = if prefix.is_empty() {
            "whose names are not the gateway's own settings".to_string()
        } else {
            format!("whose names start with `{prefix}`")
        };
        return Err(format!(
            "`{name}` is not an exposed secret: catalog resources may read only environment variables {allowed} (admin.secret_env_prefix)"
        ));
    }
    Ok(())
}

/// Why a literal secret is refused in the catalog.
fn literal_refused(prefix: &str) -> String {
    format!(
        "the catalog never holds a secret (it is shared by every replica and served by the admin API): give it as an `env:NAME` reference to an environment variable whose name starts with `{prefix}` (admin.secret_env_prefix), which each replica reads from its own environment"
    )
}

/// Checks a secret field of a catalog resource without reading it: an `env:NAME` reference
/// to an exposed variable, never a literal value.
pub fn check_secret_ref(value: &str, prefix: &str) -> Result<(), String> {
    match value.strip_prefix("env:") {
        Some(name) => check_exposed(name, prefix),
        None => Err(literal_refused(prefix)),
    }
}

/// Resolves a secret of a catalog resource: `env:NAME` reads the variable, if it is exposed
/// (see [`check_exposed`]); a literal value is refused, as the catalog never holds one.
pub fn secret(value: &str, prefix: &str) -> Result<String, String> {
    check_secret_ref(value, prefix)?;
    let name = value.strip_prefix("env:").unwrap_or(value);
    std::env::var(name).map_err(|_| format!("environment variable {name} is not set"))
}

/// Resolves a secret of this replica's own configuration (never shared through the
/// catalog): `env:NAME` reads any variable, anything else is taken literally.
pub fn local_secret(value: &str) -> Result<String, String> {
    match value.strip_prefix("env:") {
        Some(var) => {
            std::env::var(var).map_err(|_| format!("environment variable {var} is not set"))
        }
        None => Ok(value.to_string()),
    }
}

/// Checks a Redis URL of a catalog resource: `env:NAME` (exposed), or a literal URL that
/// carries no credentials (a URL with a password must come whole from the environment).
pub fn check_redis_url(value: &str, prefix: &str) -> Result<(), String> {
    if let Some(name) = value.strip_prefix("env:") {
        return check_exposed(name, prefix);
    }
    let with_credentials = match url::Url::parse(value) {
        Ok(url) => !url.username().is_empty() || url.password().is_some(),
        // Not a URL the parser reads (the Redis client may still): look for user info.
        Err(_) => value
            .split_once("://")
            .map_or(value, |(_, rest)| rest)
            .split('/')
            .next()
            .is_some_and(|authority| authority.contains('@')),
    };
    if with_credentials {
        return Err(format!(
            "`{}` carries credentials; {}",
            crate::values::redact_url(value),
            literal_refused(prefix).replacen("give it", "give the whole URL", 1)
        ));
    }
    Ok(())
}

/// A Redis URL of a catalog resource, resolved (see [`check_redis_url`]).
pub fn redis_url(value: &str, prefix: &str) -> Result<String, String> {
    check_redis_url(value, prefix)?;
    match value.strip_prefix("env:") {
        Some(_) => secret(value, prefix),
        None => Ok(value.to_string()),
    }
}
