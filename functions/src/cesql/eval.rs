//! Evaluation of a syntax tree against an event.
//!
//! Semantics follow the spec and its TCK:
//! - A failed implicit cast records a cast error and yields the zero value of the target
//!   type (0, false, ""); the operator then proceeds (`NOT 10` is `true` plus an error).
//! - Boolean casts to Integer as 1/0; Integer does not cast to Boolean implicitly (BOOL(x)
//!   does, as x != 0); everything casts to String.
//! - Errors propagate: an operator or function whose operand raised any error (a missing
//!   attribute, a division by zero, a failed cast inside it...) yields the zero value of its
//!   own return type without computing (`missing / 0` is 0 with only the missing-attribute
//!   error; `true AND (1 != 1 / 0)` is false). Only the casts an operator applies to its
//!   own operands let it go on.

use cloudevents::event::AttributeValue;
use cloudevents::Event;

use super::ast::{BinOp, Expr, Func};
use super::functions;
use super::like::like_matches;
use super::value::{
    cast_like, to_bool, to_int, to_string, CesqlValue, EvalError, ZERO_BOOL, ZERO_INT,
};
use crate::view::{attribute_value, time_string};

/// A value plus whether an error was raised while computing it.
struct Ev {
    value: CesqlValue,
    failed: bool,
}

impl Ev {
    fn of(value: CesqlValue) -> Ev {
        Ev {
            value,
            failed: false,
        }
    }

    fn failed(zero: CesqlValue) -> Ev {
        Ev {
            value: zero,
            failed: true,
        }
    }
}

fn attribute(event: &Event, name: &str) -> Option<CesqlValue> {
    Some(match attribute_value(event, name)? {
        AttributeValue::Boolean(b) => CesqlValue::Boolean(*b),
        AttributeValue::Integer(i) => match i32::try_from(*i) {
            Ok(i) => CesqlValue::Integer(i),
            Err(_) => CesqlValue::String(i.to_string()),
        },
        AttributeValue::Time(t) => CesqlValue::String(time_string(t)),
        other => CesqlValue::String(other.to_string()),
    })
}

pub(super) fn eval(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> CesqlValue {
    eval_ev(e, event, errors).value
}

fn eval_ev(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    let before = errors.len();
    let mut ev = eval_node(e, event, errors);
    if errors.len() > before {
        ev.failed = true;
    }
    ev
}

fn eval_node(e: &Expr, event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    match e {
        Expr::Lit(v) => Ev::of(v.clone()),
        Expr::Attr(name) => match attribute(event, name) {
            Some(v) => Ev::of(v),
            None => {
                errors.push(EvalError::MissingAttribute(name.clone()));
                Ev::failed(ZERO_BOOL)
            }
        },
        Expr::Exists(name) => Ev::of(CesqlValue::Boolean(attribute_value(event, name).is_some())),
        Expr::Not(inner) => {
            let v = eval_ev(inner, event, errors);
            if v.failed {
                return Ev::failed(ZERO_BOOL);
            }
            Ev::of(CesqlValue::Boolean(!to_bool(v.value, errors)))
        }
        Expr::Neg(inner) => {
            let v = eval_ev(inner, event, errors);
            if v.failed {
                return Ev::failed(ZERO_INT);
            }
            let i = to_int(v.value, errors);
            Ev::of(CesqlValue::Integer(i.checked_neg().unwrap_or_else(|| {
                errors.push(EvalError::Overflow("unary minus"));
                i32::MAX
            })))
        }
        Expr::Chain(first, rest) => {
            let mut acc = eval_ev(first, event, errors);
            for (op, rhs) in rest {
                acc = if acc.failed {
                    Ev::failed(zero_of(*op))
                } else {
                    binary(*op, acc.value, rhs, event, errors)
                };
            }
            acc
        }
        Expr::Like {
            value,
            pattern,
            negated,
        } => predicate(value, *negated, event, errors, |v, _| {
            Some(like_matches(pattern, &to_string(v)))
        }),
        Expr::In {
            value,
            set,
            negated,
        } => predicate(value, *negated, event, errors, |x, errors| {
            for item in set {
                let v = eval_ev(item, event, errors);
                if v.failed {
                    return None;
                }
                if cast_like(v.value, &x, errors) == x {
                    return Some(true);
                }
            }
            Some(false)
        }),
        Expr::Call(f, args) => call(*f, args, event, errors),
    }
}

/// `LIKE` and `IN`: `test` on the value of the operand (`None` when the test raised an
/// error), inverted by `NOT`.
fn predicate(
    value: &Expr,
    negated: bool,
    event: &Event,
    errors: &mut Vec<EvalError>,
    test: impl FnOnce(CesqlValue, &mut Vec<EvalError>) -> Option<bool>,
) -> Ev {
    let v = eval_ev(value, event, errors);
    if v.failed {
        return Ev::failed(ZERO_BOOL);
    }
    match test(v.value, errors) {
        Some(found) => Ev::of(CesqlValue::Boolean(found != negated)),
        None => Ev::failed(ZERO_BOOL),
    }
}

fn zero_of(op: BinOp) -> CesqlValue {
    match op {
        BinOp::Add | BinOp::Sub | BinOp::Mul | BinOp::Div | BinOp::Mod => ZERO_INT,
        _ => ZERO_BOOL,
    }
}

/// One step of a chain; `left` is known not to have failed.
fn binary(
    op: BinOp,
    left: CesqlValue,
    right: &Expr,
    event: &Event,
    errors: &mut Vec<EvalError>,
) -> Ev {
    if matches!(op, BinOp::And | BinOp::Or) {
        let l = to_bool(left, errors);
        // Short-circuit: the right operand is not evaluated (and raises no errors).
        if (op == BinOp::And && !l) || (op == BinOp::Or && l) {
            return Ev::of(CesqlValue::Boolean(l));
        }
        let r = eval_ev(right, event, errors);
        if r.failed {
            return Ev::failed(ZERO_BOOL);
        }
        return Ev::of(CesqlValue::Boolean(to_bool(r.value, errors)));
    }
    let r = eval_ev(right, event, errors);
    if r.failed {
        return Ev::failed(zero_of(op));
    }
    let r = r.value;
    Ev::of(match op {
        BinOp::Xor => {
            let l = to_bool(left, errors);
            CesqlValue::Boolean(l != to_bool(r, errors))
        }
        BinOp::Eq | BinOp::Ne => {
            let l = cast_like(left, &r, errors);
            CesqlValue::Boolean((l == r) == (op == BinOp::Eq))
        }
        _ => {
            let l = to_int(left, errors);
            let r = to_int(r, errors);
            arithmetic(op, l, r, errors)
        }
    })
}

fn arithmetic(op: BinOp, l: i32, r: i32, errors: &mut Vec<EvalError>) -> CesqlValue {
    let checked = |v: Option<i32>, what: &'static str, errors: &mut Vec<EvalError>| {
        CesqlValue::Integer(v.unwrap_or_else(|| {
            errors.push(EvalError::Overflow(what));
            0
        }))
    };
    match op {
        BinOp::Lt => CesqlValue::Boolean(l < r),
        BinOp::Le => CesqlValue::Boolean(l <= r),
        BinOp::Gt => CesqlValue::Boolean(l > r),
        BinOp::Ge => CesqlValue::Boolean(l >= r),
        BinOp::Add => checked(l.checked_add(r), "+", errors),
        BinOp::Sub => checked(l.checked_sub(r), "-", errors),
        BinOp::Mul => checked(l.checked_mul(r), "*", errors),
        BinOp::Div | BinOp::Mod if r == 0 => {
            errors.push(EvalError::DivisionByZero);
            CesqlValue::Integer(0)
        }
        BinOp::Div => checked(l.checked_div(r), "/", errors),
        BinOp::Mod => checked(l.checked_rem(r), "%", errors),
        // Logic and equality are handled by the caller.
        _ => CesqlValue::Boolean(false),
    }
}

/// A function call: its arguments left to right, then the function unless one failed.
fn call(f: Func, args: &[Expr], event: &Event, errors: &mut Vec<EvalError>) -> Ev {
    let mut vals = Vec::with_capacity(args.len());
    for a in args {
        let v = eval_ev(a, event, errors);
        if v.failed {
            return Ev::failed(f.zero());
        }
        vals.push(v.value);
    }
    Ev::of(functions::apply(f, vals, errors))
}
