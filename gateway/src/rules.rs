//! A rule's condition and a target's transform chain, compiled from the configuration with
//! the functions crate: EventBridge patterns (`pattern`), CESQL filters (`filter`), and
//! transform chains (`transform` on a target).

use cloudevents::Event;
use serde_json::Value;
use sluice_functions::{CesqlFilter, Pattern, TransformChain};

/// Which events a rule takes.
#[derive(Debug, Clone, Default)]
pub enum Filter {
    /// No condition, or the empty pattern: every event.
    #[default]
    All,
    Pattern(Pattern),
    Cesql(CesqlFilter),
}

impl Filter {
    /// From the rule's `pattern` (a TOML table) or `filter` (CESQL); at most one of them.
    pub fn compile(pattern: Option<&toml::Table>, filter: Option<&str>) -> Result<Filter, String> {
        match (pattern, filter) {
            (Some(_), Some(_)) => Err("give a `pattern` or a `filter`, not both".to_string()),
            (Some(table), None) => {
                let json = serde_json::to_value(table).map_err(|e| e.to_string())?;
                let pattern = Pattern::compile(&json).map_err(|e| format!("pattern: {e}"))?;
                Ok(if pattern.is_match_all() {
                    Filter::All
                } else {
                    Filter::Pattern(pattern)
                })
            }
            (None, Some(sql)) => CesqlFilter::parse(sql)
                .map(Filter::Cesql)
                .map_err(|e| format!("filter: {e}")),
            (None, None) => Ok(Filter::All),
        }
    }

    /// Like [`Filter::compile`], with the field at fault as a JSON pointer inside the rule:
    /// `/pattern/data/price/0` for the part of a pattern the compiler names, `/filter` for
    /// a CESQL expression.
    pub fn compile_located(
        pattern: Option<&toml::Table>,
        filter: Option<&str>,
    ) -> Result<Filter, (String, String)> {
        if let (Some(table), None) = (pattern, filter) {
            let json =
                serde_json::to_value(table).map_err(|e| ("/pattern".to_string(), e.to_string()))?;
            if let Err(e) = Pattern::compile(&json) {
                return Err((format!("/pattern{}", e.pointer), format!("pattern: {e}")));
            }
        }
        let at = if filter.is_some() {
            "/filter"
        } else {
            "/pattern"
        };
        Filter::compile(pattern, filter).map_err(|m| (at.to_string(), m))
    }

    /// True when every event matches: events need not even be decoded.
    pub fn matches_everything(&self) -> bool {
        matches!(self, Filter::All)
    }

    pub fn matches(&self, event: &Event) -> bool {
        match self {
            Filter::All => true,
            Filter::Pattern(p) => p.matches(event),
            Filter::Cesql(f) => f.matches(event),
        }
    }
}

/// A target's `transform` (a TOML table or array of tables) as a chain.
pub fn compile_transform(spec: &toml::Value) -> Result<TransformChain, String> {
    let json: Value = serde_json::to_value(spec).map_err(|e| e.to_string())?;
    TransformChain::compile(&json).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cloudevents::{EventBuilder, EventBuilderV10};

    fn event() -> Event {
        EventBuilderV10::new()
            .id("1")
            .source("/shop")
            .ty("order.created")
            .extension("region", "eu")
            .data(
                "application/json",
                serde_json::json!({"total": 120, "items": ["a", "b"]}),
            )
            .build()
            .unwrap()
    }

    fn pattern(text: &str) -> Result<Filter, String> {
        Filter::compile(Some(&text.parse::<toml::Table>().unwrap()), None)
    }

    #[test]
    fn patterns_from_toml_use_the_full_language() {
        let e = event();
        assert!(pattern("").unwrap().matches_everything());
        assert!(pattern("type = \"order.created\"").unwrap().matches(&e));
        assert!(
            pattern("source = [{ prefix = \"/sh\" }]\nregion = [\"eu\", \"us\"]")
                .unwrap()
                .matches(&e)
        );
        assert!(pattern("data = { total = [{ numeric = [\">\", 100] }] }")
            .unwrap()
            .matches(&e));
        assert!(!pattern("data = { total = [{ numeric = [\"<\", 100] }] }")
            .unwrap()
            .matches(&e));
        assert!(pattern("data = { items = [\"b\"] }").unwrap().matches(&e));
    }

    #[test]
    fn cesql_filters_and_errors() {
        let e = event();
        assert!(
            Filter::compile(None, Some("region = 'eu' AND type LIKE 'order.%'"))
                .unwrap()
                .matches(&e)
        );
        assert!(!Filter::compile(None, Some("region = 'us'"))
            .unwrap()
            .matches(&e));
        let err = Filter::compile(None, Some("region = ")).unwrap_err();
        assert!(err.contains("position"), "{err}");
        let err = pattern("type = [{ numeric = \"x\" }]").unwrap_err();
        assert!(err.contains("$.type"), "{err}");
        let both = Filter::compile(Some(&toml::Table::new()), Some("true")).unwrap_err();
        assert!(both.contains("not both"));
    }

    #[test]
    fn transforms_compile_from_toml() {
        let spec: toml::Value =
            toml::from_str::<toml::Table>("t = { form = \"JSONPATH\", value = \"$.data.total\" }")
                .unwrap()["t"]
                .clone();
        assert!(compile_transform(&spec).is_ok());
        let bad: toml::Value =
            toml::from_str::<toml::Table>("t = { form = \"NOPE\" }").unwrap()["t"].clone();
        assert!(compile_transform(&bad).is_err());
    }
}
