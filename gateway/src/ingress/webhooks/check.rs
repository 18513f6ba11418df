//! The checks of webhook sources: of a configuration file (`check`), of a catalog resource
//! without its secrets (`check_catalog`, `check_catalog_policy`) and with them, on this
//! replica (`check_secrets_here`).

use crate::ingress::webhooks::config::*;
use crate::ingress::webhooks::source::{catalog_secret, Webhook};

/// A value the static check (`check_catalog`) takes for an `env:` secret: valid for every
/// preset (a Standard Webhooks key is base64 after `whsec_`).
pub(super) const PLACEHOLDER_SECRET: &str = "whsec_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// The top-level fields of a source: a build error that starts with one is about it.
pub(super) const FIELDS: &[&str] = &[
    "name",
    "bus",
    "verify",
    "type",
    "id",
    "source",
    "extensions",
    "dedup_window",
    "url",
    "allowed_origins",
    "allowed_rate",
    "rate_limit",
];

/// The JSON pointer a build error is about (`verify.secrets[1]: ...` → `/verify/secrets/1`),
/// or empty when it does not start with a field.
pub(super) fn pointer_of(message: &str) -> String {
    let head = message
        .split([':', ' '])
        .next()
        .unwrap_or_default()
        .trim_end_matches(',');
    let top = head.split(['.', '[']).next().unwrap_or_default();
    if !FIELDS.contains(&top) {
        return String::new();
    }
    let mut pointer = String::new();
    for part in head.split('.') {
        let (name, index) = match part.split_once('[') {
            Some((name, rest)) => (name, rest.strip_suffix(']')),
            None => (part, None),
        };
        pointer.push('/');
        pointer.push_str(name);
        if let Some(i) = index {
            pointer.push('/');
            pointer.push_str(i);
        }
    }
    pointer
}

/// Checks a webhook source kept in the catalog, without reading its secrets: every secret
/// must be an `env:NAME` reference (the catalog, shared through the cluster store, never
/// holds a secret; each replica reads the variable from its own environment), and every
/// other setting must be valid. `Err((JSON pointer inside the source, message))`.
pub fn check_catalog(config: &WebhookConfig) -> Result<(), (String, String)> {
    for (pointer, secret) in secret_fields(config) {
        match secret.strip_prefix("env:") {
            Some(var) if !var.is_empty() => {}
            _ => {
                return Err((
                    pointer,
                    "a webhook source in the catalog takes its secrets as `env:NAME` references, read by each replica from its environment (the catalog is shared and never holds a secret); literal secrets belong in a replica's own configuration file".to_string(),
                ))
            }
        }
    }
    if let Some(limit) = &config.rate_limit {
        limit.check().map_err(|m| ("/rate_limit".to_string(), m))?;
    }
    Webhook::build_with(config, &|_| Ok(PLACEHOLDER_SECRET.to_string()))
        .map(|_| ())
        .map_err(|m| (pointer_of(&m), m))
}

/// Every secret of a source's `verify`, with its JSON pointer inside the source.
pub(super) fn secret_fields(config: &WebhookConfig) -> impl Iterator<Item = (String, &String)> {
    let v = &config.verify;
    v.secret
        .iter()
        .map(|s| ("/verify/secret".to_string(), s))
        .chain(
            v.secrets
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("/verify/secrets/{i}"), s)),
        )
}

/// Checks that this replica can read every secret of a catalog source (the admin API asks
/// before storing one, so a mistyped variable is caught where it is made), each an exposed
/// variable (`secret_prefix`: `admin.secret_env_prefix`).
pub fn check_secrets_here(
    config: &WebhookConfig,
    secret_prefix: &str,
) -> Result<(), (String, String)> {
    Webhook::build_with(config, &|v| catalog_secret(v, secret_prefix))
        .map(|_| ())
        .map_err(|m| (pointer_of(&m), m))
}

/// The policy checks of a catalog source (see `Channels::check_policy`): each secret is an
/// `env:` reference to an exposed variable. `Err((JSON pointer inside the source, message))`.
pub fn check_catalog_policy(
    config: &WebhookConfig,
    secret_prefix: &str,
) -> Result<(), (String, String)> {
    for (pointer, secret) in secret_fields(config) {
        crate::secrets::check_secret_ref(secret, secret_prefix).map_err(|m| (pointer, m))?;
    }
    Ok(())
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
        crate::values::check_name(name).map_err(|m| bad(format!("name: {m}")))?;
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Duration;

    use axum::http::{HeaderMap, HeaderValue};
    use serde_json::json;

    use super::*;
    use crate::ingress::webhooks::handler::ce_value;
    use crate::ingress::webhooks::probe::{self, Step};
    use crate::ingress::webhooks::source::{parse_path, Inputs};

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
        let mut paths = probe::Paths::default();
        let path = parse_path("a.b[2].c").unwrap();
        paths.add(&path);
        let body = json!({"a": {"b": [0, 1, {"c": "x"}]}}).to_string();
        assert_eq!(paths.read(body.as_bytes()).get(&path), Some(&json!("x")));
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
    fn catalog_sources_take_env_secrets_and_errors_point_at_the_field() {
        let parse = |text: &str| -> WebhookConfig { toml::from_str(text).unwrap() };
        let base = "name = \"h\"\nbus = \"b\"\n";
        let check = |verify: &str| {
            check_catalog(&parse(&format!("{base}verify = {{ {verify} }}\n")))
                .map_err(|(pointer, _)| pointer)
        };
        // No variable needs to be set for the static check, whatever the preset.
        for preset in ["standard-webhooks", "github", "stripe", "basic", "api-key"] {
            assert_eq!(
                check(&format!(
                    "preset = \"{preset}\", secret = \"env:SLUICE_TEST_UNSET_VARIABLE\""
                )),
                Ok(())
            );
        }
        assert_eq!(check("preset = \"none\""), Ok(()));
        assert_eq!(
            check("preset = \"github\", secret = \"literal\""),
            Err("/verify/secret".to_string())
        );
        assert_eq!(
            check("preset = \"github\", secrets = [\"env:A\", \"literal\"]"),
            Err("/verify/secrets/1".to_string())
        );
        assert_eq!(
            check("preset = \"nope\", secret = \"env:A\", header = \"x\""),
            Err("/verify/preset".to_string())
        );
        assert_eq!(
            check("preset = \"github\", secret = \"env:A\", tolerance = \"1m\""),
            Err("/verify/tolerance".to_string())
        );
        assert_eq!(
            check_catalog(&parse(&format!(
                "{base}verify = {{ preset = \"twilio\", secret = \"env:A\" }}\n"
            )))
            .map_err(|(p, _)| p),
            Err("/url".to_string())
        );
        // Reading the secrets here names the variable that is missing.
        let missing = check_secrets_here(
            &parse(&format!(
                "{base}verify = {{ preset = \"github\", secret = \"env:SLUICE_TEST_UNSET_VARIABLE\" }}\n"
            )),
            "SLUICE_TEST_",
        )
        .unwrap_err();
        assert_eq!(missing.0, "/verify/secret");
        // Only exposed variables, whatever this replica's environment holds.
        let hidden = check_secrets_here(
            &parse(&format!(
                "{base}verify = {{ preset = \"github\", secret = \"env:PATH\" }}\n"
            )),
            "SLUICE_SECRET_",
        )
        .unwrap_err();
        assert_eq!(hidden.0, "/verify/secret");
        assert!(
            hidden.1.contains("`PATH` is not an exposed secret"),
            "{}",
            hidden.1
        );
        assert!(
            missing.1.contains("SLUICE_TEST_UNSET_VARIABLE"),
            "{}",
            missing.1
        );
        assert_eq!(pointer_of("type: set one of"), "/type");
        assert_eq!(pointer_of("something else: x"), "");
    }

    #[test]
    fn a_source_round_trips_through_the_stored_toml() {
        let text = "[[webhooks]]\nname = \"h\"\nbus = \"b\"\nverify = { preset = \"hmac\", secrets = [\"env:A\", \"env:B\"], header = \"x-sig\", tolerance = \"90s\", signed = \"{timestamp}.{body}\", timestamp_header = \"x-ts\" }\ntype = { jsonpath = \"$.kind\", prefix = \"com.x.\" }\nid = { header = \"x-id\" }\nextensions = { tenant = \"x-tenant\" }\ndedup_window = \"1h\"\nallowed_origins = [\"https://a.example\"]\nallowed_rate = 5\nrate_limit = { per_second = 2.5, burst = 3 }\n";
        let channels: crate::config::Channels = toml::from_str(text).unwrap();
        let stored = channels.to_toml().unwrap();
        let back = crate::config::Channels::from_toml(&stored).unwrap();
        assert_eq!(
            serde_json::to_value(&back.webhooks).unwrap(),
            serde_json::to_value(&channels.webhooks).unwrap(),
            "{stored}"
        );
        assert_eq!(
            back.webhooks[0].dedup_window,
            Some(Duration::from_secs(3600))
        );
        assert_eq!(
            back.webhooks[0].verify.tolerance,
            Some(Duration::from_secs(90))
        );
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
        let body = json!({"action": "opened", "issue": {"title": "x"}}).to_string();
        let fields = hook.paths.read(body.as_bytes());
        let (id, kind, time) = hook.attributes(&Inputs {
            headers: &h,
            json: &fields,
        });
        assert_eq!(id.as_deref(), Some("d-1"));
        assert_eq!(kind, "com.github.issues.opened");
        assert_eq!(time, None);
        assert_eq!(ce_value("a b%\"").unwrap(), "a%20b%25%22");
    }
}
