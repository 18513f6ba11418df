//! CloudEvents SQL (CESQL) v1 filters: a hand-written lexer and recursive-descent parser
//! and a total evaluator that returns a value together with the list of errors raised.
//!
//! Precedence, loosest first: `AND`/`OR`/`XOR` (one level, left to right); comparisons;
//! `+ -`; `* / %`; `LIKE`/`IN` (postfix); unary `NOT`/`-`. This follows the precedence of
//! the official ANTLR grammar, so `NOT a = b` reads `(NOT a) = b`; write `NOT (a = b)`.
//! Binary chains are stored flat, and nesting (parentheses, unary operators, function
//! arguments, postfix operators) is bounded by [`MAX_CESQL_DEPTH`], so hostile input can
//! neither overflow the stack at parse nor at evaluation time.

mod ast;
mod eval;
mod functions;
mod lexer;
mod like;
mod parser;
mod value;

use cloudevents::Event;

pub use parser::MAX_CESQL_DEPTH;
pub use value::{CesqlError, CesqlValue, EvalError};

use ast::Expr;

/// The result of evaluating an expression: always a value, plus any errors raised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evaluation {
    pub value: CesqlValue,
    pub errors: Vec<EvalError>,
}

/// A parsed CESQL filter.
#[derive(Debug, Clone)]
pub struct CesqlFilter {
    source: String,
    expr: Expr,
}

impl CesqlFilter {
    /// Parses an expression.
    pub fn parse(source: &str) -> Result<CesqlFilter, CesqlError> {
        Ok(CesqlFilter {
            source: source.to_owned(),
            expr: parser::parse(source)?,
        })
    }

    /// The expression text this filter was parsed from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Evaluates the expression in complete-evaluation mode.
    pub fn evaluate(&self, event: &Event) -> Evaluation {
        let mut errors = Vec::new();
        let value = eval::eval(&self.expr, event, &mut errors);
        Evaluation { value, errors }
    }

    /// True only when the expression evaluates to `true` without any error (as the CESQL
    /// spec requires of filters).
    pub fn matches(&self, event: &Event) -> bool {
        let ev = self.evaluate(event);
        ev.errors.is_empty() && ev.value == CesqlValue::Boolean(true)
    }
}
