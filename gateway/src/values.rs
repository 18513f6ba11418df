//! The values every part of the configuration is made of: durations (`250ms`, `30s`), names
//! that become file names and keys, URLs as they may be shown, and the prefix of the
//! environment variables catalog resources may read. The bottom of the house: it imports
//! nothing of Sluice, and every component's configuration imports it.

use std::time::Duration;

use serde::{Deserialize, Deserializer};

/// `FromStr` for a configuration enum spelled by its names (`"name" => value`, ...): any
/// other text is refused naming them, e.g. "unknown mode `x` (standalone or distributed)".
macro_rules! from_names {
    ($ty:ty, $what:literal, $($name:literal => $value:expr),+ $(,)?) => {
        impl std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($value),)+
                    other => Err(format!(
                        "unknown {} `{other}` ({})",
                        $what,
                        [$($name),+].join(" or ")
                    )),
                }
            }
        }
    };
}
pub(crate) use from_names;

/// The prefix of the environment variables catalog resources may read by default.
pub const DEFAULT_SECRET_ENV_PREFIX: &str = "SLUICE_SECRET_";

/// The longest duration any key accepts. Deadlines are `now + duration`: far beyond this
/// they overflow `Instant` and panic the runtime, and nothing in Sluice needs to wait longer.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 3600);

fn check_max_duration(text: &str, d: Duration) -> Result<Duration, String> {
    if d > MAX_DURATION {
        return Err(format!(
            "`{text}` is too long: durations are at most 8760h (one year)"
        ));
    }
    Ok(d)
}

/// Parses `250ms`, `30s`, `5m`, `1h`, or a bare number of seconds, up to [`MAX_DURATION`].
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (examples: 250ms, 30s, 5m)"))?;
    let seconds = match unit.trim() {
        "ms" => number / 1000.0,
        "" | "s" => number,
        "m" => number * 60.0,
        "h" => number * 3600.0,
        other => {
            return Err(format!(
                "unknown duration unit `{other}` (use ms, s, m or h)"
            ))
        }
    };
    if !seconds.is_finite() || seconds < 0.0 {
        return Err(format!("`{text}` is not a duration"));
    }
    // `from_secs_f64` panics on values past `u64::MAX` seconds; compare first.
    if seconds > MAX_DURATION.as_secs_f64() {
        return check_max_duration(text, Duration::MAX);
    }
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| format!("`{text}` is not a duration"))
        .and_then(|d| check_max_duration(text, d))
}

pub fn duration<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Duration, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Seconds(u64),
        Text(String),
    }
    match Raw::deserialize(deserializer)? {
        Raw::Seconds(s) => check_max_duration(&s.to_string(), Duration::from_secs(s))
            .map_err(serde::de::Error::custom),
        Raw::Text(t) => parse_duration(&t).map_err(serde::de::Error::custom),
    }
}

/// Writes a duration the way the configuration reads it (`1500ms`), so a configuration
/// survives a round trip through TOML (distributed mode stores it in Redis).
pub fn ser_duration<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format!("{}ms", d.as_millis()))
}

pub fn optional_duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    duration(d).map(Some)
}

pub fn ser_optional_duration<S: serde::Serializer>(
    d: &Option<Duration>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => ser_duration(d, s),
        None => s.serialize_none(),
    }
}

/// Bus, rule and target names become file names and keys: keep them to a safe alphabet.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 {
        return Err(format!("`{name}` must be 1 to 128 characters"));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        || name.starts_with('.')
    {
        return Err(format!(
            "`{name}` may only contain ASCII letters, digits, `-`, `_` and `.`, and must not start with `.`"
        ));
    }
    Ok(())
}

/// A URL as it may be shown (logs, status reasons, dead-letter extensions, errors): the
/// user info (`user:password@`) and the query string are replaced by `***`, since both
/// commonly carry credentials. The scheme, host, port and path stay, to say which endpoint.
/// Text that does not parse as a URL is cut the same way by hand rather than shown as it is.
pub fn redact_url(url: &str) -> String {
    if let Ok(mut parsed) = url::Url::parse(url) {
        if parsed.cannot_be_a_base() {
            return redact_by_hand(url);
        }
        let had_user = !parsed.username().is_empty() || parsed.password().is_some();
        let had_query = parsed.query().is_some();
        let had_fragment = parsed.fragment().is_some();
        // Both setters only fail for URLs that cannot have user info (checked above).
        let _ = parsed.set_password(None);
        let _ = parsed.set_username(if had_user { "***" } else { "" });
        parsed.set_query(had_query.then_some("***"));
        parsed.set_fragment(had_fragment.then_some("***"));
        return parsed.to_string();
    }
    redact_by_hand(url)
}

fn redact_by_hand(url: &str) -> String {
    let (rest, cut) = match url.find(['?', '#']) {
        Some(i) => (&url[..i], true),
        None => (url, false),
    };
    let (scheme, after) = match rest.find("://") {
        Some(i) => rest.split_at(i + 3),
        None => ("", rest),
    };
    let authority_end = after.find('/').unwrap_or(after.len());
    let (authority, path) = after.split_at(authority_end);
    let authority = match authority.rfind('@') {
        Some(at) => format!("***{}", &authority[at..]),
        None => authority.to_string(),
    };
    let mut out = format!("{scheme}{authority}{path}");
    if cut {
        out.push_str("?***");
    }
    out
}

/// The top-level keys that `SLUICE_<KEY>` environment variables may override.
pub const ENV_KEYS: &[&str] = &[
    "listen",
    "data_dir",
    "log",
    "log_format",
    "mode",
    "durability",
    "redis_url",
    "redis_cluster_nodes",
    "redis_prefix",
    "worker_id",
    "admin_listen",
];

/// FNV-1a 64 with a final mix: stable across processes and versions.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // splitmix64 finaliser: FNV alone clusters similar keys on a ring.
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("7").unwrap(), Duration::from_secs(7));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("1 parsec").is_err());
    }

    #[test]
    fn urls_are_redacted_for_display() {
        for (url, shown) in [
            ("https://hooks.example/in", "https://hooks.example/in"),
            (
                "https://user:pa55@hooks.example:8443/in?token=s3cret&x=1#frag",
                "https://***@hooks.example:8443/in?***#***",
            ),
            ("https://:pa55@h/x", "https://***@h/x"),
            (
                "redis://:pa55@127.0.0.1:6379/0",
                "redis://***@127.0.0.1:6379/0",
            ),
            (
                "rediss://default:pa55@cache.internal/",
                "rediss://***@cache.internal/",
            ),
            // Not URLs: cut by hand, never shown as they are.
            ("redis://:pa55@bad host:6379", "redis://***@bad host:6379"),
            ("http://u:p@[::1/x?k=v", "http://***@[::1/x?***"),
            ("no scheme?key=1", "no scheme?***"),
        ] {
            let redacted = redact_url(url);
            assert_eq!(redacted, shown, "{url}");
            assert!(!redacted.contains("pa55") && !redacted.contains("s3cret"));
        }
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("orders-v1.eu_west").is_ok());
        assert!(check_name("../etc").is_err());
        assert!(check_name("").is_err());
        assert!(check_name("a b").is_err());
    }

    #[test]
    fn the_stable_hash_does_not_change() {
        // The catalog's stored digest and the placement of tasks depend on these values.
        assert_eq!(format!("{:016x}", stable_hash(b"")), "f52a15e9a9b5e89b");
        assert_eq!(
            format!("{:016x}", stable_hash(b"[buses.orders]\nshards = 4\n")),
            "af2418541cc130b9"
        );
    }
}
