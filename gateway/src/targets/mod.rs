//! Targets: where matched events go. One module per target behind one small trait; each
//! target's config is turned into the running thing by `build`.

pub mod bus;
pub mod config;
mod file;
pub mod function;
pub mod http;
pub mod limits;
mod log;
pub mod policy;
pub mod redis_stream;
pub mod rocketmq;
pub mod target;

use std::sync::Arc;

use crate::store::BusLog;
use crate::targets::config::TargetConfig;

pub use file::{combine_writes, combining, CombineGuard, FileTarget};
pub use log::LogTarget;
pub use policy::{
    allowed_file_path, check_egress, check_policy, check_url, redis_url, refused_address, secret,
    EgressResolver, TargetPolicy,
};
pub use target::{
    append_to_bus, json_lines, stored, Body, Envelope, Resources, Target, TargetError, Unavailable,
};

/// Builds the running target for a configured one.
pub fn build(
    policy: &TargetPolicy,
    target: &TargetConfig,
    resources: &Resources,
) -> Result<Arc<dyn Target>, TargetError> {
    Ok(match target {
        TargetConfig::Log(_) => Arc::new(LogTarget::new()),
        TargetConfig::File(file) => {
            // The path as resolved when checked is the one opened.
            let path = allowed_file_path(policy, &file.path).map_err(TargetError::fatal)?;
            Arc::new(FileTarget::open(&path, policy.durability)?)
        }
        TargetConfig::Rocketmq(c) => Arc::new(rocketmq::RocketMqTarget::new(c)?),
        TargetConfig::Http(c) => {
            let ca_file = c.ca_file.as_deref().map(|p| policy.expand_path(p));
            Arc::new(http::HttpTarget::new(c, ca_file.as_deref(), policy)?)
        }
        TargetConfig::RedisStream(c) => Arc::new(redis_stream::RedisStreamTarget::new(c, policy)?),
        TargetConfig::Bus(c) => Arc::new(bus::BusTarget::new(c, resources)?),
        TargetConfig::Function(c) => Arc::new(function::FunctionTarget::new(c, resources, policy)?),
    })
}

/// Why a target cannot be built on this replica: the field at fault as a JSON pointer
/// inside the target (`/auth/token`; empty for the target as a whole) and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unbuildable {
    pub pointer: String,
    pub message: String,
}

/// Checks that `build` would succeed for this target on this replica, without its side
/// effects: no directory made, no file opened, no connection, no producer started. The
/// policy (`check_policy`), the secrets, URLs and clients go through the very code `build`
/// runs (against stand-in buses), so whatever `build` refuses is refused here, when the
/// resource is written. `buses` are the buses the target may name.
pub fn validate(
    policy: &TargetPolicy,
    target: &TargetConfig,
    buses: &std::collections::HashSet<&str>,
) -> Result<(), Unbuildable> {
    config::check(target, buses).map_err(|message| Unbuildable {
        pointer: String::new(),
        message,
    })?;
    check_policy(policy, target).map_err(|(pointer, message)| Unbuildable { pointer, message })?;
    let built = match target {
        // `build` makes the directories and opens the file: only where they would be.
        TargetConfig::File(file) => allowed_file_path(policy, &file.path)
            .map_err(TargetError::fatal)
            .and_then(|path| writable(&path)),
        // `build` registers a producer (started on the first delivery): only its settings.
        TargetConfig::Rocketmq(c) => c.check().map_err(TargetError::fatal),
        // Building these reads secrets and files, parses URLs and makes clients, and
        // connects nowhere.
        _ => {
            let stand_in = |bus: &&str| -> (String, Arc<dyn BusLog>) {
                let log = crate::store::UnavailableLog::new(1, "only checked".to_string());
                (bus.to_string(), Arc::new(log))
            };
            let resources = Resources {
                buses: buses.iter().map(stand_in).collect(),
            };
            build(policy, target, &resources).map(drop)
        }
    };
    built.map_err(|e| Unbuildable {
        pointer: pointer_of(target, &e.message),
        message: e.message,
    })?;
    let (_, dead_letter) = target.delivery();
    if let Some(t) = dead_letter.and_then(|d| d.target.as_deref()) {
        validate(policy, t, buses).map_err(|e| Unbuildable {
            pointer: format!("/dead_letter/target{}", e.pointer),
            message: format!("dead_letter.target: {}", e.message),
        })?;
    }
    Ok(())
}

/// Whether a file target could open `path`, read without writing: it is not a directory,
/// and its nearest existing ancestor is one (the rest is made on the first open).
fn writable(path: &std::path::Path) -> Result<(), TargetError> {
    if path.is_dir() {
        return Err(TargetError::fatal(format!(
            "{} is a directory, not a file",
            path.display()
        )));
    }
    let mut ancestor = path.parent();
    while let Some(dir) = ancestor.filter(|d| !d.as_os_str().is_empty()) {
        match std::fs::metadata(dir) {
            Ok(meta) if meta.is_dir() => return Ok(()),
            Ok(_) => {
                return Err(TargetError::fatal(format!(
                    "cannot write {}: {} is not a directory",
                    path.display(),
                    dir.display()
                )))
            }
            Err(_) => ancestor = dir.parent(),
        }
    }
    Ok(())
}

/// The field a build error is about: the secret whose variable it names, the CA file it
/// names, else the target as a whole.
fn pointer_of(target: &TargetConfig, message: &str) -> String {
    let mut fields: Vec<(&str, &str)> = Vec::new();
    match target {
        TargetConfig::Http(c) => {
            match &c.auth {
                Some(crate::targets::config::AuthConfig::Bearer { token }) => {
                    fields.push(("/auth/token", token))
                }
                Some(crate::targets::config::AuthConfig::Basic { username, password }) => {
                    fields.push(("/auth/username", username));
                    fields.push(("/auth/password", password));
                }
                Some(crate::targets::config::AuthConfig::ApiKey { key, .. }) => {
                    fields.push(("/auth/key", key))
                }
                None => {}
            }
            if let Some(secret) = &c.signing_secret {
                fields.push(("/signing_secret", secret));
            }
            if c.ca_file.is_some() && message.contains("`ca_file`") {
                return "/ca_file".to_string();
            }
        }
        TargetConfig::RedisStream(c) => fields.push(("/url", &c.url)),
        TargetConfig::File(_) => return "/path".to_string(),
        _ => {}
    }
    let named = |value: &str| {
        let word = value.strip_prefix("env:").unwrap_or(value);
        !word.is_empty() && mentions(message, word)
    };
    fields
        .into_iter()
        .find(|(_, value)| named(value))
        .map_or_else(String::new, |(pointer, _)| pointer.to_string())
}

/// Whether `message` names `word` as a whole (`VAR_1` does not name `VAR`).
fn mentions(message: &str, word: &str) -> bool {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    message.match_indices(word).any(|(at, _)| {
        let before = message[..at].chars().next_back();
        let after = message[at + word.len()..].chars().next();
        !before.is_some_and(is_name) && !after.is_some_and(is_name)
    })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::config::{Channels, Config};

    const TEXT: &str = r#"
[[buses]]
name = "b"
[[buses]]
name = "dlq"
[[rules]]
name = "r"
bus = "b"
[[rules.targets]]
type = "http"
name = "h"
url = "http://127.0.0.1:9/hook"
timeout = "1500ms"
signing_secret = "env:SLUICE_SECRET_SIGNING"
auth = { type = "bearer", token = "env:SLUICE_SECRET_TOKEN" }
circuit_breaker = { failures = 3, open_for = "2s" }
[rules.targets.retry]
max_attempts = 5
max_event_age = "1h"
initial_backoff = "50ms"
[rules.targets.dead_letter]
bus = "dlq"
[[rules.targets]]
type = "rocketmq"
name = "mq"
name_server = "127.0.0.1:9876"
topic = "Orders"
tag_attribute = "type"
[[rules.targets]]
type = "redis-stream"
name = "rs"
stream = "s"
[[rules.targets]]
type = "function"
name = "fn"
url = "http://127.0.0.1:9/fn"
reply_bus = "b"
[[rules.targets]]
type = "bus"
name = "copy"
bus = "dlq"
"#;

    fn parse(text: &str) -> Result<Config, String> {
        let c = Config::parse(Path::new("t.toml"), text).map_err(|e| e.to_string())?;
        c.check(Path::new("t.toml"), text)
            .map_err(|e| e.to_string())?;
        Ok(c)
    }

    #[test]
    fn target_configs_round_trip_through_toml() {
        let c = parse(TEXT).unwrap();
        let stored = c.channels().to_toml().unwrap();
        let back = Channels::from_toml(&stored).unwrap();
        assert_eq!(back.to_toml().unwrap(), stored);
        assert!(stored.contains("1500ms"), "{stored}");
    }

    #[test]
    fn bad_target_configs_are_refused_with_clear_messages() {
        for (from, to, expect) in [
            (
                "url = \"http://127.0.0.1:9/hook\"",
                "url = \"ftp://x\"",
                "must be http or https",
            ),
            (
                "env:SLUICE_SECRET_SIGNING",
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                "the catalog never holds a secret",
            ),
            (
                "env:SLUICE_SECRET_TOKEN",
                "env:SLUICE_REDIS_URL",
                "`SLUICE_REDIS_URL` is not an exposed secret",
            ),
            (
                "stream = \"s\"",
                "stream = \"s\"\nurl = \"redis://:hunter2@127.0.0.1/\"",
                "carries credentials",
            ),
            (
                "url = \"http://127.0.0.1:9/fn\"",
                "url = \"http://169.254.169.254/latest/meta-data\"",
                "cloud metadata addresses",
            ),
            (
                "bus = \"dlq\"\n[[rules.targets]]\ntype = \"rocketmq\"",
                "bus = \"nope\"\n[[rules.targets]]\ntype = \"rocketmq\"",
                "dead_letter.bus `nope` is not defined",
            ),
            ("topic = \"Orders\"", "topic = \"a b\"", "topic `a b`"),
            (
                "reply_bus = \"b\"",
                "reply_bus = \"x\"",
                "reply_bus `x` is not defined",
            ),
            (
                "max_attempts = 5",
                "max_attempts = 5\nmax_attempt = 1",
                "unknown field `max_attempt`",
            ),
        ] {
            let text = TEXT.replacen(from, to, 1);
            let err = parse(&text).unwrap_err();
            assert!(err.contains(expect), "{expect}: {err}");
        }
    }

    /// `validate` refuses what `build` would, naming the field, and makes nothing: no
    /// directory, no file.
    #[test]
    fn validate_refuses_what_build_would_without_its_side_effects() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = parse("").unwrap();
        config.data_dir = dir.path().to_path_buf();
        std::fs::write(dir.path().join("plain"), b"").unwrap();
        let buses = std::collections::HashSet::from(["b"]);
        let target =
            |text: &str| -> crate::targets::config::TargetConfig { toml::from_str(text).unwrap() };
        let http = "type = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\n";
        for (text, pointer, says) in [
            (
                format!("{http}auth = {{ type = \"bearer\", token = \"env:SLUICE_SECRET_VALIDATE_UNSET\" }}"),
                "/auth/token",
                "SLUICE_SECRET_VALIDATE_UNSET is not set",
            ),
            (
                format!("{http}auth = {{ type = \"basic\", username = \"u\", password = \"env:SLUICE_SECRET_VALIDATE_PW\" }}"),
                "/auth/password",
                "SLUICE_SECRET_VALIDATE_PW is not set",
            ),
            (
                format!("{http}ca_file = \"{{data_dir}}/no-such-ca.pem\""),
                "/ca_file",
                "no-such-ca.pem",
            ),
            (
                "type = \"file\"\nname = \"f\"\npath = \"{data_dir}/plain/x.jsonl\"".to_string(),
                "/path",
                "plain/x.jsonl",
            ),
            (
                "type = \"file\"\nname = \"f\"\npath = \"/tmp/anywhere/pwned.jsonl\"".to_string(),
                "/path",
                "outside the allowed file roots",
            ),
            (
                format!("{http}dead_letter = {{ target = {{ type = \"http\", name = \"d\", url = \"http://127.0.0.1:9/\", signing_secret = \"env:SLUICE_SECRET_VALIDATE_SIGN\" }} }}"),
                "/dead_letter/target/signing_secret",
                "SLUICE_SECRET_VALIDATE_SIGN is not set",
            ),
            (
                "type = \"function\"\nname = \"fn\"\nurl = \"http://127.0.0.1:9/\"\nreply_bus = \"nope\"".to_string(),
                "",
                "reply_bus `nope` is not defined",
            ),
        ] {
            let err = super::validate(&config.target_policy(), &target(&text), &buses).unwrap_err();
            assert_eq!(err.pointer, pointer, "{text}: {}", err.message);
            assert!(err.message.contains(says), "{says}: {}", err.message);
        }
        for text in [
            "type = \"file\"\nname = \"f\"\npath = \"{data_dir}/new/dir/x.jsonl\"",
            "type = \"function\"\nname = \"fn\"\nurl = \"http://127.0.0.1:9/\"\nreply_bus = \"b\"",
            "type = \"bus\"\nname = \"copy\"\nbus = \"b\"",
            "type = \"redis-stream\"\nname = \"rs\"\nstream = \"s\"",
            "type = \"rocketmq\"\nname = \"mq\"\nname_server = \"127.0.0.1:9876\"\ntopic = \"T\"",
        ] {
            super::validate(&config.target_policy(), &target(text), &buses)
                .unwrap_or_else(|e| panic!("{text}: {e:?}"));
        }
        assert!(
            !dir.path().join("new").exists(),
            "validate made a directory"
        );
    }
}
