//! Pure event logic for Sluice: event patterns, CESQL filters, transforms and the
//! compiled rule index. Nothing in this crate performs I/O.

pub mod cesql;
#[doc(hidden)]
pub mod fuzzing;
pub mod index;
pub mod knative;
pub mod pattern;
pub mod template;
pub mod transform;
mod view;

pub use cesql::{CesqlError, CesqlFilter, CesqlValue, EvalError, Evaluation};
pub use index::{RuleIndex, RuleIndexBuilder};
pub use pattern::{Pattern, PatternError};
pub use transform::{FunctionHost, Output, TextOutput, TransformChain, TransformError};

use serde_json::{json, Value};

/// The condition of a rule under test.
#[derive(Debug, Clone, Copy)]
pub enum Condition<'a> {
    /// An event pattern (JSON).
    Pattern(&'a Value),
    /// A CESQL filter expression.
    Filter(&'a str),
}

/// Which input of [`test_rule`] was bad.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuleTestError {
    #[error("bad event: {0}")]
    Event(String),
    #[error("bad pattern: {0}")]
    Pattern(#[from] PatternError),
    #[error("bad filter: {0}")]
    Filter(#[from] CesqlError),
    #[error("bad transform: {0}")]
    Transform(TransformError),
    #[error("the transform failed on this event: {0}")]
    TransformFailed(TransformError),
}

/// Tests one rule against one structured-mode CloudEvent (JSON bytes), as `sluice rule test`
/// and the admin API do. Returns `{"matched": bool}` plus `"output"` when the event matched
/// and a transform was given: an event in structured JSON form, or a body as a JSON value
/// when it parses as JSON, else as a string.
pub fn test_rule(
    event_json: &[u8],
    condition: Condition<'_>,
    transform: Option<&Value>,
) -> Result<Value, RuleTestError> {
    enum Compiled {
        Pattern(Pattern),
        Filter(CesqlFilter),
    }
    let compiled = match condition {
        Condition::Pattern(p) => Compiled::Pattern(Pattern::compile(p)?),
        Condition::Filter(f) => Compiled::Filter(CesqlFilter::parse(f)?),
    };
    let chain = transform
        .map(TransformChain::compile)
        .transpose()
        .map_err(RuleTestError::Transform)?;
    let event: cloudevents::Event =
        serde_json::from_slice(event_json).map_err(|e| RuleTestError::Event(e.to_string()))?;
    let matched = match &compiled {
        Compiled::Pattern(p) => p.matches(&event),
        Compiled::Filter(f) => f.matches(&event),
    };
    let Some(chain) = chain.filter(|_| matched) else {
        return Ok(json!({ "matched": matched }));
    };
    let output = match chain
        .apply(&event)
        .map_err(RuleTestError::TransformFailed)?
    {
        Output::Event(e) => transform::structured(&e).map_err(RuleTestError::Event)?,
        Output::Body { bytes, .. } => serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned())),
    };
    Ok(json!({ "matched": true, "output": output }))
}
