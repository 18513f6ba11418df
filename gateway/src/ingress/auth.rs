//! Ingress authentication of a bus: API keys (`X-API-Key`) or bearer tokens, kept only as
//! SHA-256 digests. The configuration may name a key as `env:VAR` (resolved at load),
//! `sha256:<hex>` (already hashed) or in clear; the cluster store gets digests or `env:`
//! references, never a key in clear.

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
    /// The digests, with `env:` references resolved. Errors name the key's index.
    pub fn resolve(&self) -> Result<KeySet, String> {
        if self.keys.is_empty() {
            return Err("auth.keys is empty".to_string());
        }
        if let Some(limit) = &self.rate_limit {
            limit.check().map_err(|m| format!("auth.{m}"))?;
        }
        let mut out = Vec::new();
        for (i, key) in self.keys.iter().enumerate() {
            let field = format!("auth.keys[{i}]");
            if let Some(var) = key.strip_prefix("env:") {
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
                out.push(digest(key.as_bytes()));
            }
        }
        Ok(KeySet {
            digests: out,
            per_key: self.rate_limit,
        })
    }
}

/// Why a request was refused: no key (`401`), or a key not accepted (`403`, naming the
/// header it came in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    Missing,
    Wrong(&'static str),
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
        }
    }
}

impl KeySet {
    /// Whether the request carries one of the keys; which one.
    pub fn check(&self, headers: &HeaderMap) -> Result<Accepted, Refused> {
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
        let keys = back.resolve().unwrap();
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
        assert!(bad.resolve().unwrap_err().contains("auth.keys[0]"));
    }
}
