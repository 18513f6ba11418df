//! The values CESQL computes with, the errors it reports, and the implicit casts between
//! value types.

use std::fmt;

/// A CESQL expression that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CESQL syntax error at position {position}: {message}")]
pub struct CesqlError {
    /// 1-based character position in the expression.
    pub position: usize,
    /// What was found and what was expected.
    pub message: String,
}

/// A CESQL value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CesqlValue {
    Boolean(bool),
    Integer(i32),
    String(String),
}

impl fmt::Display for CesqlValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CesqlValue::Boolean(b) => write!(f, "{b}"),
            CesqlValue::Integer(i) => write!(f, "{i}"),
            CesqlValue::String(s) => f.write_str(s),
        }
    }
}

impl CesqlValue {
    fn type_name(&self) -> &'static str {
        match self {
            CesqlValue::Boolean(_) => "Boolean",
            CesqlValue::Integer(_) => "Integer",
            CesqlValue::String(_) => "String",
        }
    }
}

/// An error raised while evaluating; evaluation still yields a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EvalError {
    #[error("cannot cast {from} `{value}` to {to}")]
    Cast {
        from: &'static str,
        to: &'static str,
        value: String,
    },
    #[error("missing attribute `{0}`")]
    MissingAttribute(String),
    #[error("division by zero")]
    DivisionByZero,
    #[error("integer overflow in {0}")]
    Overflow(&'static str),
    #[error("{function}: {message}")]
    Function {
        function: &'static str,
        message: String,
    },
}

// The zero value of each type: what a failed cast or a failed operation yields.
pub(super) const ZERO_BOOL: CesqlValue = CesqlValue::Boolean(false);
pub(super) const ZERO_INT: CesqlValue = CesqlValue::Integer(0);

pub(super) fn zero_string() -> CesqlValue {
    CesqlValue::String(String::new())
}

fn cast_error(v: &CesqlValue, to: &'static str) -> EvalError {
    EvalError::Cast {
        from: v.type_name(),
        to,
        value: v.to_string(),
    }
}

pub(super) fn parse_int(s: &str) -> Option<i32> {
    s.trim().parse::<i32>().ok()
}

pub(super) fn parse_bool(s: &str) -> Option<bool> {
    let s = s.trim();
    if s.eq_ignore_ascii_case("true") {
        Some(true)
    } else if s.eq_ignore_ascii_case("false") {
        Some(false)
    } else {
        None
    }
}

pub(super) fn to_int(v: CesqlValue, errors: &mut Vec<EvalError>) -> i32 {
    match v {
        CesqlValue::Integer(i) => i,
        CesqlValue::Boolean(b) => i32::from(b),
        CesqlValue::String(ref s) => parse_int(s).unwrap_or_else(|| {
            errors.push(cast_error(&v, "Integer"));
            0
        }),
    }
}

pub(super) fn to_bool(v: CesqlValue, errors: &mut Vec<EvalError>) -> bool {
    match v {
        CesqlValue::Boolean(b) => b,
        CesqlValue::String(ref s) => parse_bool(s).unwrap_or_else(|| {
            errors.push(cast_error(&v, "Boolean"));
            false
        }),
        CesqlValue::Integer(_) => {
            errors.push(cast_error(&v, "Boolean"));
            false
        }
    }
}

pub(super) fn to_string(v: CesqlValue) -> String {
    match v {
        CesqlValue::String(s) => s,
        other => other.to_string(),
    }
}

/// Casts `v` to the type of `like`.
pub(super) fn cast_like(
    v: CesqlValue,
    like: &CesqlValue,
    errors: &mut Vec<EvalError>,
) -> CesqlValue {
    match like {
        CesqlValue::Boolean(_) => CesqlValue::Boolean(to_bool(v, errors)),
        CesqlValue::Integer(_) => CesqlValue::Integer(to_int(v, errors)),
        CesqlValue::String(_) => CesqlValue::String(to_string(v)),
    }
}
