//! The built-in functions (`LENGTH`, `CONCAT`, `SUBSTRING`, ...), applied to argument
//! values the evaluator has already computed without error.

use super::ast::Func;
use super::value::{
    parse_bool, parse_int, to_bool, to_int, to_string, zero_string, CesqlValue, EvalError,
    ZERO_BOOL, ZERO_INT,
};

impl Func {
    /// The zero value of the function's return type: its result when an argument failed.
    pub(super) fn zero(self) -> CesqlValue {
        match self {
            Func::Length | Func::Abs | Func::Int => ZERO_INT,
            Func::Bool | Func::IsInt | Func::IsBool => ZERO_BOOL,
            _ => zero_string(),
        }
    }
}

/// Applies `f` to its arguments (as many as `Func::lookup` allowed).
pub(super) fn apply(f: Func, args: Vec<CesqlValue>, errors: &mut Vec<EvalError>) -> CesqlValue {
    let argc = args.len();
    let mut vals = args.into_iter();
    let mut next = || vals.next().unwrap_or_else(zero_string);
    let fail = |errors: &mut Vec<EvalError>, message: String| {
        errors.push(EvalError::Function {
            function: f.name(),
            message,
        })
    };
    match f {
        Func::Length => {
            let n = to_string(next()).chars().count();
            CesqlValue::Integer(i32::try_from(n).unwrap_or(i32::MAX))
        }
        Func::Concat => {
            let mut s = String::new();
            for _ in 0..argc {
                s.push_str(&to_string(next()));
            }
            CesqlValue::String(s)
        }
        Func::ConcatWs => {
            let sep = to_string(next());
            let parts: Vec<String> = (1..argc).map(|_| to_string(next())).collect();
            CesqlValue::String(parts.join(&sep))
        }
        Func::Lower => CesqlValue::String(to_string(next()).to_lowercase()),
        Func::Upper => CesqlValue::String(to_string(next()).to_uppercase()),
        Func::Trim => CesqlValue::String(to_string(next()).trim().to_owned()),
        Func::Left | Func::Right => {
            let s = to_string(next());
            let n = to_int(next(), errors);
            if n < 0 {
                fail(errors, format!("negative length {n}"));
                return CesqlValue::String(s);
            }
            let len = s.chars().count();
            let n = (n as usize).min(len);
            let out: String = if f == Func::Left {
                s.chars().take(n).collect()
            } else {
                s.chars().skip(len - n).collect()
            };
            CesqlValue::String(out)
        }
        Func::Substring => {
            let s = to_string(next());
            let pos = to_int(next(), errors);
            let take = if argc == 3 {
                Some(to_int(next(), errors))
            } else {
                None
            };
            substring(&s, pos, take)
                .map(CesqlValue::String)
                .unwrap_or_else(|m| {
                    fail(errors, m);
                    zero_string()
                })
        }
        Func::Abs => {
            let i = to_int(next(), errors);
            CesqlValue::Integer(i.checked_abs().unwrap_or_else(|| {
                errors.push(EvalError::Overflow("ABS"));
                i32::MAX
            }))
        }
        Func::Int => CesqlValue::Integer(to_int(next(), errors)),
        Func::Bool => CesqlValue::Boolean(match next() {
            CesqlValue::Integer(i) => i != 0,
            other => to_bool(other, errors),
        }),
        Func::String => CesqlValue::String(to_string(next())),
        Func::IsInt => CesqlValue::Boolean(match next() {
            CesqlValue::Integer(_) => true,
            CesqlValue::String(s) => parse_int(&s).is_some(),
            CesqlValue::Boolean(_) => false,
        }),
        Func::IsBool => CesqlValue::Boolean(match next() {
            CesqlValue::Boolean(_) => true,
            CesqlValue::String(s) => parse_bool(&s).is_some(),
            CesqlValue::Integer(_) => false,
        }),
    }
}

fn substring(s: &str, pos: i32, take: Option<i32>) -> Result<String, String> {
    let len = s.chars().count() as i64;
    let pos = i64::from(pos);
    if pos > len || pos < -len {
        return Err(format!(
            "position {pos} is outside a string of length {len}"
        ));
    }
    if let Some(t) = take {
        if t < 0 {
            return Err(format!("negative length {t}"));
        }
    }
    if pos == 0 {
        return Ok(String::new());
    }
    let start = if pos > 0 { pos - 1 } else { len + pos } as usize;
    let chars = s.chars().skip(start);
    Ok(match take {
        Some(t) => chars.take(t as usize).collect(),
        None => chars.collect(),
    })
}
