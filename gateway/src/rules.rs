//! A rule's filter. This first version matches attributes exactly: each key of the pattern
//! names an attribute (or extension) and gives the value, or a list of values, it must have.
//! An absent or empty pattern matches every event. The shape is the EventBridge pattern
//! shape, so the full pattern language of the functions crate accepts the same documents.

use cloudevents::event::ExtensionValue;
use cloudevents::{AttributesReader, Event};
use serde_json::Value;

#[derive(Debug, Clone, Default)]
pub struct Matcher {
    /// (attribute, accepted values); every attribute must match.
    fields: Vec<(String, Vec<String>)>,
}

impl Matcher {
    pub fn compile(pattern: &toml::Table) -> Result<Matcher, String> {
        let json = serde_json::to_value(pattern).map_err(|e| e.to_string())?;
        Matcher::from_json(&json)
    }

    pub fn from_json(pattern: &Value) -> Result<Matcher, String> {
        let Value::Object(map) = pattern else {
            return Err("must be a table of attribute names to values".to_string());
        };
        let mut fields = Vec::with_capacity(map.len());
        for (name, value) in map {
            if name == "data" {
                return Err(format!(
                    "at `{name}`: matching on data needs the full pattern language; this filter matches attributes"
                ));
            }
            let scalar = |v: &Value| match v {
                Value::String(s) => Ok(s.clone()),
                Value::Number(n) => Ok(n.to_string()),
                Value::Bool(b) => Ok(b.to_string()),
                _ => Err(format!(
                    "at `{name}`: expected a string, number or boolean, or a list of them"
                )),
            };
            let values = match value {
                Value::Array(items) if items.is_empty() => {
                    return Err(format!("at `{name}`: an empty list matches nothing"))
                }
                Value::Array(items) => items.iter().map(scalar).collect::<Result<_, _>>()?,
                other => vec![scalar(other)?],
            };
            fields.push((name.clone(), values));
        }
        Ok(Matcher { fields })
    }

    /// True when the pattern is empty: events need not even be decoded.
    pub fn matches_everything(&self) -> bool {
        self.fields.is_empty()
    }

    pub fn matches(&self, event: &Event) -> bool {
        self.fields.iter().all(|(name, accepted)| {
            attribute(event, name).is_some_and(|v| accepted.iter().any(|a| *a == v))
        })
    }
}

/// An attribute or extension of an event as text, the way binary mode would carry it.
pub fn attribute(event: &Event, name: &str) -> Option<String> {
    Some(match name {
        "id" => event.id().to_string(),
        "source" => event.source().to_string(),
        "type" => event.ty().to_string(),
        "specversion" => event.specversion().to_string(),
        "subject" => event.subject()?.to_string(),
        "datacontenttype" => event.datacontenttype()?.to_string(),
        "dataschema" => event.dataschema()?.to_string(),
        "time" => event.time()?.to_rfc3339(),
        _ => match event.extension(name)? {
            ExtensionValue::String(s) => s.clone(),
            other => other.to_string(),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::EventBuilder;

    fn event() -> Event {
        cloudevents::EventBuilderV10::new()
            .id("1")
            .source("/shop")
            .ty("order.created")
            .extension("region", "eu")
            .extension("priority", 3i64)
            .build()
            .unwrap()
    }

    fn compile(text: &str) -> Result<Matcher, String> {
        Matcher::compile(&text.parse::<toml::Table>().unwrap())
    }

    #[test]
    fn exact_values_and_lists() {
        let e = event();
        assert!(compile("").unwrap().matches(&e));
        assert!(compile("type = \"order.created\"").unwrap().matches(&e));
        assert!(
            compile("type = [\"a\", \"order.created\"]\nregion = \"eu\"")
                .unwrap()
                .matches(&e)
        );
        assert!(compile("priority = 3").unwrap().matches(&e));
        assert!(!compile("type = \"order.created\"\nregion = \"us\"")
            .unwrap()
            .matches(&e));
        assert!(!compile("subject = \"x\"").unwrap().matches(&e));
    }

    #[test]
    fn bad_patterns_say_where() {
        assert!(compile("type = []").unwrap_err().contains("`type`"));
        assert!(compile("type = { prefix = \"a\" }")
            .unwrap_err()
            .contains("`type`"));
        assert!(compile("data = 1").unwrap_err().contains("`data`"));
    }
}
