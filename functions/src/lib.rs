//! Pure event logic for Sluice: event patterns, CESQL filters, transforms and the
//! compiled rule index. Nothing in this crate performs I/O.

pub mod cesql;
pub mod index;
pub mod pattern;
mod view;

pub use cesql::{CesqlError, CesqlFilter, CesqlValue, EvalError, Evaluation};
pub use index::{RuleIndex, RuleIndexBuilder};
pub use pattern::{Pattern, PatternError};
