//! The `aws` table of a bus (`access_keys`, `account`, `region`): checked as written, its
//! secrets checked against the operator's policy, and resolved per replica into what
//! PutEvents needs ([`AwsBus`]).

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The `account` and `region` of events put on a bus that configures none.
pub const DEFAULT_ACCOUNT: &str = "000000000000";
pub const DEFAULT_REGION: &str = "us-east-1";

/// `aws = { access_keys = [...], account = "...", region = "..." }` on a bus.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AwsConfig {
    /// The SigV4 access keys this bus accepts; none: any request is accepted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub access_keys: Vec<AccessKey>,
    /// The `account` of its events (12 digits); default `000000000000`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub account: Option<String>,
    /// The `region` of its events; default `us-east-1`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
}

/// One access key: its id (what SDKs send in the clear) and its secret, an `env:`
/// reference (the catalog never holds the secret).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AccessKey {
    pub id: String,
    pub secret: String,
}

impl AwsConfig {
    /// Checks the table as written, reading no environment. Errors name the field.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for (i, key) in self.access_keys.iter().enumerate() {
            let field = format!("aws.access_keys[{i}]");
            if key.id.is_empty()
                || key.id.len() > 128
                || !key.id.bytes().all(|b| b.is_ascii_alphanumeric())
            {
                return Err(format!(
                    "{field}.id must be 1 to 128 ASCII letters and digits (an access key id such as AKIAIOSFODNN7EXAMPLE)"
                ));
            }
            if !seen.insert(key.id.as_str()) {
                return Err(format!("{field}.id `{}` is listed twice", key.id));
            }
            match key.secret.strip_prefix("env:") {
                Some(var) if !var.is_empty() => {}
                _ => {
                    return Err(format!(
                        "{field}.secret must be an `env:NAME` reference to an environment variable holding the secret access key (the catalog never holds a secret)"
                    ))
                }
            }
        }
        if let Some(account) = &self.account {
            if account.len() != 12 || !account.bytes().all(|b| b.is_ascii_digit()) {
                return Err("aws.account must be 12 digits".to_string());
            }
        }
        if let Some(region) = &self.region {
            if region.is_empty()
                || region.len() > 32
                || !region
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            {
                return Err(
                    "aws.region must be 1 to 32 lower-case letters, digits and `-` (e.g. us-east-1)"
                        .to_string(),
                );
            }
        }
        Ok(())
    }

    /// The operator's policy: each secret names an exposed variable.
    pub fn check_policy(&self, secret_prefix: &str) -> Result<(), (String, String)> {
        for (i, key) in self.access_keys.iter().enumerate() {
            crate::secrets::check_secret_ref(&key.secret, secret_prefix).map_err(|m| {
                (
                    format!("/aws/access_keys/{i}/secret"),
                    format!("aws.access_keys[{i}].secret: {m}"),
                )
            })?;
        }
        Ok(())
    }

    /// What ingress needs, secrets read from this replica's environment. A secret that
    /// cannot be read closes the bus to PutEvents here (503), never opens it.
    pub fn resolve(&self, secret_prefix: &str) -> Result<AwsBus, String> {
        self.check()?;
        let mut keys = Vec::new();
        for (i, key) in self.access_keys.iter().enumerate() {
            let secret = crate::secrets::secret(&key.secret, secret_prefix)
                .map_err(|m| format!("aws.access_keys[{i}].secret: {m}"))?;
            if secret.is_empty() {
                return Err(format!(
                    "aws.access_keys[{i}].secret: the variable is empty"
                ));
            }
            keys.push((key.id.clone(), secret));
        }
        Ok(AwsBus {
            keys,
            account: self.account.clone(),
            region: self.region.clone(),
            unavailable: None,
        })
    }
}

/// A bus's PutEvents settings on this replica.
#[derive(Clone, Default)]
pub struct AwsBus {
    /// (access key id, secret access key).
    pub(super) keys: Vec<(String, String)>,
    account: Option<String>,
    region: Option<String>,
    /// Why this replica cannot read the bus's secrets: closed to PutEvents.
    pub(super) unavailable: Option<String>,
}

impl std::fmt::Debug for AwsBus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secrets.
        f.debug_struct("AwsBus")
            .field(
                "keys",
                &self.keys.iter().map(|(id, _)| id).collect::<Vec<_>>(),
            )
            .field("account", &self.account)
            .field("region", &self.region)
            .field("unavailable", &self.unavailable)
            .finish()
    }
}

impl AwsBus {
    /// A bus whose secrets this replica cannot read.
    pub fn unavailable(why: String) -> AwsBus {
        AwsBus {
            unavailable: Some(why),
            ..AwsBus::default()
        }
    }

    pub(super) fn account(&self) -> &str {
        self.account.as_deref().unwrap_or(DEFAULT_ACCOUNT)
    }

    pub(super) fn region(&self) -> &str {
        self.region.as_deref().unwrap_or(DEFAULT_REGION)
    }
}

/// The PutEvents settings of every bus that has an `aws` table, given as `(bus, table)`.
/// A table whose secrets this replica cannot read closes PutEvents on that bus (503) and is
/// recorded in `failures` as `bus/{name}#aws`, retried as the bus's other keys are.
pub fn resolve_all<'a>(
    buses: impl IntoIterator<Item = (&'a str, &'a AwsConfig)>,
    secret_prefix: &str,
    failures: &mut std::collections::BTreeMap<String, String>,
) -> HashMap<String, Arc<AwsBus>> {
    let mut out = HashMap::new();
    for (name, config) in buses {
        let resolved = config.resolve(secret_prefix).unwrap_or_else(|m| {
            failures.insert(
                format!("bus/{name}#aws"),
                format!("the AWS access keys of bus `{name}` are unavailable on this replica: {m}"),
            );
            AwsBus::unavailable(m)
        });
        out.insert(name.to_string(), Arc::new(resolved));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    #[test]
    fn config_is_checked_and_secrets_never_literal() {
        let ok: AwsConfig = toml::from_str(
            "access_keys = [{ id = \"AKIAEXAMPLE\", secret = \"env:SLUICE_SECRET_AWS\" }]\naccount = \"123456789012\"\nregion = \"eu-west-1\"",
        )
        .unwrap();
        assert!(ok.check().is_ok());
        assert!(ok.check_policy("SLUICE_SECRET_").is_ok());
        assert!(ok.check_policy("OTHER_").is_err());
        let literal = AwsConfig {
            access_keys: vec![AccessKey {
                id: "AKIA".into(),
                secret: "wJalr".into(),
            }],
            ..AwsConfig::default()
        };
        let err = literal.check().unwrap_err();
        assert!(
            err.contains("aws.access_keys[0].secret") && !err.contains("wJalr"),
            "{err}"
        );
        let account = AwsConfig {
            account: Some("12".into()),
            ..AwsConfig::default()
        };
        assert!(account.check().unwrap_err().contains("aws.account"));
        assert!(toml::from_str::<AwsConfig>("regoin = \"x\"").is_err());
        let missing = AwsConfig {
            access_keys: vec![AccessKey {
                id: "AKIA".into(),
                secret: "env:SLUICE_SECRET_UNSET_AWS_VAR".into(),
            }],
            ..AwsConfig::default()
        };
        let err = missing.resolve("SLUICE_SECRET_").unwrap_err();
        assert!(err.contains("aws.access_keys[0].secret"), "{err}");
    }
}
