//! Event patterns with the operator set of Amazon EventBridge / RocketMQ EventBridge.
//!
//! A pattern is compiled once into disjunctive normal form: a list of alternatives (one per
//! `$or` combination), each a conjunction of field conditions. A field condition holds a
//! path (attribute name, then keys inside `data`) and a list of matchers, any of which may
//! match any leaf found at that path. The rule index consumes the same compiled form.

mod compile;
mod matcher;
mod matching;

use cloudevents::Event;
use serde_json::Value;

use crate::view::EventView;

pub use compile::{PatternError, MAX_PATTERN_ALTERNATIVES, MAX_PATTERN_DEPTH};
pub(crate) use matcher::{Conjunction, FieldCondition, Matcher, Range, Scalar};
pub(crate) use matching::conjunction_matches;

/// A compiled event pattern.
#[derive(Debug, Clone)]
pub struct Pattern {
    pub(crate) alternatives: Vec<Conjunction>,
}

impl Pattern {
    /// Compiles a JSON pattern. The top level must be an object; `{}` matches every event.
    pub fn compile(pattern: &Value) -> Result<Pattern, PatternError> {
        Ok(Pattern {
            alternatives: compile::compile_pattern(pattern)?,
        })
    }

    /// Whether the event matches this pattern.
    pub fn matches(&self, event: &Event) -> bool {
        let view = EventView::new(event);
        self.matches_view(&view)
    }

    pub(crate) fn matches_view(&self, view: &EventView<'_>) -> bool {
        self.alternatives
            .iter()
            .any(|alt| conjunction_matches(&alt.conditions, view))
    }

    /// True when the pattern places no condition at all (`{}`).
    pub fn is_match_all(&self) -> bool {
        self.alternatives.iter().any(|a| a.conditions.is_empty())
    }
}
