//! Ingress authentication of a bus: API keys (`X-API-Key`) or bearer tokens, kept only as
//! SHA-256 digests. A bus is a catalog resource, so a key is named as `env:VAR` (a variable
//! under `admin.secret_env_prefix`, resolved by each replica) or `sha256:<hex>` (already
//! hashed), never in clear: the catalog is shared and served by the admin API.

use http::HeaderMap;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use subtle::ConstantTimeEq as _;

use crate::problem::Problem;

/// `auth = { keys = [...] }` on a bus.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    #[serde(serialize_with = "ser_keys")]
    pub keys: Vec<String>,
    /// Opt-in: requests per second each key may send (a token bucket per key, shared by the
    /// cluster), besides the bus's own `rate_limit`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
}

/// The digests of the accepted keys, and the limit of each key.
#[derive(Debug, Clone)]
pub struct KeySet {
    digests: Vec<[u8; 32]>,
    pub per_key: Option<crate::ingress::ratelimit::RateLimitConfig>,
    /// Why this replica cannot read the bus's keys (an `env:` variable missing here): the
    /// bus stays closed, every request is answered 503, never let in without a key.
    unavailable: Option<String>,
}

/// The key a request was accepted with: a name for its rate-limit bucket (part of the
/// key's digest, never the key).
#[derive(Debug, Clone)]
pub struct Accepted(pub String);

fn digest(key: &[u8]) -> [u8; 32] {
    sha2::Sha256::digest(key).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn parse_hex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 || !text.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Keys in clear are written as their digest.
fn ser_keys<S: serde::Serializer>(keys: &[String], s: S) -> Result<S::Ok, S::Error> {
    let stored: Vec<String> = keys
        .iter()
        .map(|k| {
            if k.starts_with("env:") || k.starts_with("sha256:") {
                k.clone()
            } else {
                format!("sha256:{}", hex(&digest(k.as_bytes())))
            }
        })
        .collect();
    stored.serialize(s)
}

impl AuthConfig {
    /// Checks the keys as written, without reading the environment: every replica checks
    /// the whole catalog on every change, and a variable missing on one replica must not
    /// stop changes made there (that bus alone is closed on that replica; see `resolve`).
    pub fn check(&self) -> Result<(), String> {
        if self.keys.is_empty() {
            return Err("auth.keys is empty".to_string());
        }
        if let Some(limit) = &self.rate_limit {
            limit.check().map_err(|m| format!("auth.{m}"))?;
        }
        for (i, key) in self.keys.iter().enumerate() {
            let field = format!("auth.keys[{i}]");
            if let Some(var) = key.strip_prefix("env:") {
                if var.is_empty() {
                    return Err(format!(
                        "{field}: `env:` must be followed by a variable name"
                    ));
                }
            } else if let Some(h) = key.strip_prefix("sha256:") {
                if parse_hex(h).is_none() {
                    return Err(format!(
                        "{field}: `sha256:` must be followed by 64 hex digits"
                    ));
                }
            } else if key.is_empty() {
                return Err(format!("{field} is empty"));
            }
        }
        Ok(())
    }

    /// The digests, with `env:` references resolved; each must name an exposed variable
    /// (`secret_prefix`: `admin.secret_env_prefix`), as the bus is a catalog resource.
    /// Errors name the key's index.
    pub fn resolve(&self, secret_prefix: &str) -> Result<KeySet, String> {
        self.check()?;
        let mut out = Vec::new();
        for (i, key) in self.keys.iter().enumerate() {
            let field = format!("auth.keys[{i}]");
            if let Some(var) = key.strip_prefix("env:") {
                crate::secrets::check_exposed(var, secret_prefix)
                    .map_err(|m| format!("{field}: {m}"))?;
                let value = std::env::var(var)
                    .map_err(|_| format!("{field}: environment variable {var} is not set"))?;
                if value.is_empty() {
                    return Err(format!("{field}: environment variable {var} is empty"));
                }
                out.push(digest(value.as_bytes()));
            } else if let Some(h) = key.strip_prefix("sha256:") {
                out.push(parse_hex(h).ok_or_else(|| {
                    format!("{field}: `sha256:` must be followed by 64 hex digits")
                })?);
            } else if key.is_empty() {
                return Err(format!("{field} is empty"));
            } else {
                // The bus is a catalog resource: a key in clear would be stored and shown.
                check_key_ref(key, secret_prefix).map_err(|m| format!("{field}: {m}"))?;
            }
        }
        Ok(KeySet {
            digests: out,
            per_key: self.rate_limit,
            unavailable: None,
        })
    }

    /// The JSON pointer inside the bus of the field a `resolve` error is about.
    pub fn pointer_of(message: &str) -> String {
        let index = message
            .strip_prefix("auth.keys[")
            .and_then(|rest| rest.split_once(']'))
            .map(|(i, _)| i);
        match index {
            Some(i) => format!("/auth/keys/{i}"),
            None => "/auth".to_string(),
        }
    }
}

/// Checks a key of a bus as the catalog may hold it, without reading it: a `sha256:` digest
/// (not a secret), or an `env:` reference to an exposed variable (`admin.secret_env_prefix`);
/// never the key in clear.
pub fn check_key_ref(key: &str, secret_prefix: &str) -> Result<(), String> {
    if key.starts_with("sha256:") {
        return Ok(());
    }
    crate::secrets::check_secret_ref(key, secret_prefix).map_err(|m| {
        m.replacen(
            "the catalog never holds a secret",
            "the catalog never holds a key in clear (a `sha256:` digest is fine: `sluice ctl hash-token KEY` prints one)",
            1,
        )
    })
}

/// Why a request was refused: no key (`401`), or a key not accepted (`403`, naming the
/// header it came in).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    Missing,
    Wrong(&'static str),
    /// This replica cannot read the bus's keys (`503`): closed, not open.
    Unavailable(String),
}

impl Refused {
    pub fn problem(self) -> Problem {
        match self {
            Refused::Missing => Problem::unauthorized(
                "authorization",
                "this bus needs an API key: `Authorization: Bearer <key>` or `X-API-Key`",
            ),
            Refused::Wrong(field) => {
                Problem::forbidden(field, "the key is not accepted on this bus")
            }
            Refused::Unavailable(why) => Problem::unavailable(
                format!("the bus's keys are unavailable on this replica ({why}); it takes no events here until they are"),
                30,
            )
            .with_field("auth.keys"),
        }
    }
}

impl KeySet {
    /// A bus whose keys this replica cannot read: every request is refused with `503`.
    pub fn unavailable(why: String) -> KeySet {
        KeySet {
            digests: Vec::new(),
            per_key: None,
            unavailable: Some(why),
        }
    }

    /// Whether the request carries one of the keys; which one.
    pub fn check(&self, headers: &HeaderMap) -> Result<Accepted, Refused> {
        if let Some(why) = &self.unavailable {
            return Err(Refused::Unavailable(why.clone()));
        }
        let bearer = headers
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, rest) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            });
        let (field, given) = match (bearer, headers.get("x-api-key")) {
            (Some(token), _) => ("authorization", token.as_bytes()),
            (None, Some(key)) => ("x-api-key", key.as_bytes()),
            (None, None) => return Err(Refused::Missing),
        };
        let given = digest(given);
        let mut ok = false;
        for accepted in &self.digests {
            ok |= bool::from(accepted.ct_eq(&given));
        }
        if ok {
            Ok(Accepted(hex(&given[..8])))
        } else {
            Err(Refused::Wrong(field))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn keys_are_stored_hashed_and_checked() {
        let config = AuthConfig {
            keys: vec![
                "clear-key".to_string(),
                format!("sha256:{}", hex(&digest(b"hashed-key"))),
            ],
            rate_limit: None,
        };
        let stored = toml::to_string(&config).unwrap();
        assert!(!stored.contains("clear-key"), "{stored}");
        let back: AuthConfig = toml::from_str(&stored).unwrap();
        let keys = back.resolve("SLUICE_SECRET_").unwrap();
        let mut h = HeaderMap::new();
        assert_eq!(keys.check(&h).unwrap_err().problem().status, 401);
        h.insert("authorization", "Bearer clear-key".parse().unwrap());
        assert!(keys.check(&h).is_ok());
        h.insert("authorization", "Bearer wrong".parse().unwrap());
        assert_eq!(keys.check(&h).unwrap_err().problem().status, 403);
        h.remove("authorization");
        h.insert("x-api-key", "hashed-key".parse().unwrap());
        assert!(keys.check(&h).is_ok());
        let bad = AuthConfig {
            keys: vec!["env:SLUICE_UNSET_KEY_VAR".to_string()],
            rate_limit: None,
        };
        let err = bad.resolve("SLUICE_UNSET_").unwrap_err();
        assert!(err.contains("auth.keys[0]"), "{err}");
        assert_eq!(AuthConfig::pointer_of(&err), "/auth/keys/0");
        assert!(bad.check().is_ok(), "the static check reads no environment");
        // The catalog holds no key in clear, and only exposed variables are read.
        let clear = AuthConfig {
            keys: vec!["clear-key".to_string()],
            rate_limit: None,
        };
        let err = clear.resolve("SLUICE_SECRET_").unwrap_err();
        assert!(
            err.starts_with("auth.keys[0]: the catalog never holds a key in clear")
                && !err.contains("clear-key"),
            "{err}"
        );
        let hidden = AuthConfig {
            keys: vec!["env:PATH".to_string()],
            rate_limit: None,
        };
        let err = hidden.resolve("SLUICE_SECRET_").unwrap_err();
        assert!(err.contains("`PATH` is not an exposed secret"), "{err}");
    }

    #[test]
    fn a_bus_whose_keys_are_unavailable_stays_closed() {
        let keys = KeySet::unavailable("environment variable X is not set".to_string());
        let mut h = HeaderMap::new();
        assert_eq!(keys.check(&h).unwrap_err().problem().status, 503);
        h.insert("authorization", "Bearer anything".parse().unwrap());
        let problem = keys.check(&h).unwrap_err().problem();
        assert_eq!(problem.status, 503);
        assert!(problem.detail.contains("unavailable on this replica"));
    }
}
