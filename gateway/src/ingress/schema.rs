//! JSON Schema validation of event data at ingress, per (bus, event type), or by the
//! event's `dataschema` when it names a schema the configuration knows. A failure is a
//! `400` naming the JSON pointer of the data at fault and the rule it broke; valid events
//! are stored unchanged.
//!
//! ```toml
//! [[schemas]]
//! bus = "default"
//! type = "com.example.order.created"   # events of this type on this bus
//! file = "schemas/order.json"          # relative to the configuration file
//! uri = "https://example.com/order"    # optional: events whose dataschema is this
//! ```

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use crate::event::http::Parsed;
use crate::event::EventError;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchemaConfig {
    pub bus: String,
    /// The event type the schema applies to (every event of it must match).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The schema document (JSON), relative to the configuration file's directory.
    pub file: String,
    /// Events whose `dataschema` is this URI are checked against it, whatever their type.
    #[serde(default)]
    pub uri: Option<String>,
}

/// The compiled schemas of one bus.
#[derive(Default)]
pub struct BusSchemas {
    by_type: HashMap<String, Arc<jsonschema::Validator>>,
    by_uri: HashMap<String, Arc<jsonschema::Validator>>,
}

/// Compiles the schemas of the configuration, by bus. `base` is the configuration file's
/// directory. Errors name the entry and say what is wrong.
pub fn load(
    configs: &[SchemaConfig],
    base: &Path,
) -> Result<HashMap<String, Arc<BusSchemas>>, String> {
    let mut buses: HashMap<String, BusSchemas> = HashMap::new();
    for (i, config) in configs.iter().enumerate() {
        let at = format!("schemas[{i}] (`{}`)", config.file);
        if config.kind.is_none() && config.uri.is_none() {
            return Err(format!("{at}: needs `type`, `uri` or both"));
        }
        let path = base.join(&config.file);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("{at}: cannot read {}: {e}", path.display()))?;
        let document: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{at}: {} is not JSON: {e}", path.display()))?;
        let validator = Arc::new(
            jsonschema::validator_for(&document)
                .map_err(|e| format!("{at}: not a valid JSON Schema: {e}"))?,
        );
        let bus = buses.entry(config.bus.clone()).or_default();
        if let Some(kind) = &config.kind {
            if bus
                .by_type
                .insert(kind.clone(), validator.clone())
                .is_some()
            {
                return Err(format!(
                    "{at}: bus `{}` already has a schema for type `{kind}`",
                    config.bus
                ));
            }
        }
        if let Some(uri) = &config.uri {
            bus.by_uri.insert(uri.clone(), validator);
        }
    }
    Ok(buses.into_iter().map(|(k, v)| (k, Arc::new(v))).collect())
}

impl BusSchemas {
    /// Checks the event's data against its schema, if it has one.
    pub fn check(&self, parsed: &Parsed) -> Result<(), EventError> {
        let event = &parsed.event;
        let by_uri = cloudevents::AttributesReader::dataschema(event)
            .and_then(|uri| self.by_uri.get(uri.as_str()));
        let Some(validator) =
            by_uri.or_else(|| self.by_type.get(cloudevents::AttributesReader::ty(event)))
        else {
            return Ok(());
        };
        // The stored form has the data as JSON (`data`) or as base64 (`data_base64`).
        let stored: Value = serde_json::from_slice(&parsed.stored)
            .map_err(|e| EventError::invalid("data", format!("cannot be read: {e}")))?;
        if stored.get("data_base64").is_some() {
            return Err(EventError::invalid(
                "data",
                "the event's type has a JSON Schema, but its data is not JSON",
            ));
        }
        let data = stored.get("data").unwrap_or(&Value::Null);
        let first = validator.iter_errors(data).next().map(|error| {
            (
                format!("/data{}", error.instance_path().as_str()),
                format!(
                    "does not match the schema: {error} (rule `{}`)",
                    error.kind().keyword()
                ),
            )
        });
        match first {
            None => Ok(()),
            Some((pointer, message)) => Err(EventError::invalid(pointer, message)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(file: &str) -> SchemaConfig {
        SchemaConfig {
            bus: "b".into(),
            kind: Some("t".into()),
            file: file.into(),
            uri: None,
        }
    }

    #[test]
    fn bad_schemas_are_refused_when_loaded_with_the_entry_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("bad.json"), r#"{"type": 5}"#).unwrap();
        std::fs::write(dir.path().join("text.json"), "not json").unwrap();
        std::fs::write(dir.path().join("ok.json"), r#"{"type": "object"}"#).unwrap();
        let err = load(&[config("missing.json")], dir.path()).err().unwrap();
        assert!(
            err.contains("schemas[0]") && err.contains("cannot read"),
            "{err}"
        );
        let err = load(&[config("text.json")], dir.path()).err().unwrap();
        assert!(err.contains("is not JSON"), "{err}");
        let err = load(&[config("bad.json")], dir.path()).err().unwrap();
        assert!(err.contains("not a valid JSON Schema"), "{err}");
        let err = load(&[config("ok.json"), config("ok.json")], dir.path())
            .err()
            .unwrap();
        assert!(err.contains("already has a schema for type `t`"), "{err}");
        let mut neither = config("ok.json");
        neither.kind = None;
        assert!(load(&[neither], dir.path()).is_err());
        assert!(load(&[config("ok.json")], dir.path()).is_ok());
    }
}
