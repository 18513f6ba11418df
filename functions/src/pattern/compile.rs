//! Compiling a JSON pattern into disjunctive normal form, with the JSON path of any bad
//! part in the error.

use std::fmt;

use serde_json::{Map, Value};

use super::matcher::{Bound, Cidr, Conjunction, FieldCondition, Matcher, Range, Scalar, Wildcard};
use crate::view::{canonical_key, fold, is_attribute_name, Attr, Num};

/// Deepest nesting of objects/`$or` a pattern may have; bounds compiler recursion.
pub const MAX_PATTERN_DEPTH: usize = 32;
/// Most alternatives the `$or` combinations of one pattern may expand to.
pub const MAX_PATTERN_ALTERNATIVES: usize = 1024;

/// A pattern that could not be compiled, with the JSON path of the offending part.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid pattern at {path}: {message}")]
pub struct PatternError {
    /// JSON path of the bad part, e.g. `$.data.price[0].numeric[1]`.
    pub path: String,
    /// The same place as a JSON Pointer (RFC 6901), e.g. `/data/price/0/numeric/1`.
    pub pointer: String,
    /// What is wrong there.
    pub message: String,
}

/// Compiles a JSON pattern into its alternatives.
pub(super) fn compile_pattern(pattern: &Value) -> Result<Vec<Conjunction>, PatternError> {
    let mut at = ErrPath::default();
    let Value::Object(obj) = pattern else {
        return Err(at.error("a pattern must be a JSON object"));
    };
    compile_object(obj, &[], &mut at, 0)
}

/// Where the compiler is in the pattern, for error messages.
#[derive(Default)]
struct ErrPath {
    segs: Vec<Seg>,
}

enum Seg {
    Key(String),
    Index(usize),
}

impl fmt::Display for ErrPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("$")?;
        for s in &self.segs {
            match s {
                Seg::Key(k) if is_plain_key(k) => write!(f, ".{k}")?,
                Seg::Key(k) => write!(f, "[{}]", Value::String(k.clone()))?,
                Seg::Index(i) => write!(f, "[{i}]")?,
            }
        }
        Ok(())
    }
}

fn is_plain_key(k: &str) -> bool {
    !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '$')
}

impl ErrPath {
    fn error(&self, message: impl Into<String>) -> PatternError {
        PatternError {
            path: self.to_string(),
            pointer: self.pointer(),
            message: message.into(),
        }
    }

    /// The JSON Pointer of where the compiler is (`~` and `/` escaped as RFC 6901 says).
    fn pointer(&self) -> String {
        let mut pointer = String::new();
        for s in &self.segs {
            pointer.push('/');
            match s {
                Seg::Key(k) => pointer.push_str(&k.replace('~', "~0").replace('/', "~1")),
                Seg::Index(i) => pointer.push_str(&i.to_string()),
            }
        }
        pointer
    }

    fn with_key<T>(
        &mut self,
        k: &str,
        f: impl FnOnce(&mut Self) -> Result<T, PatternError>,
    ) -> Result<T, PatternError> {
        self.segs.push(Seg::Key(k.to_owned()));
        let r = f(self);
        self.segs.pop();
        r
    }

    fn with_index<T>(
        &mut self,
        i: usize,
        f: impl FnOnce(&mut Self) -> Result<T, PatternError>,
    ) -> Result<T, PatternError> {
        self.segs.push(Seg::Index(i));
        let r = f(self);
        self.segs.pop();
        r
    }
}

fn compile_object(
    obj: &Map<String, Value>,
    field_path: &[String],
    at: &mut ErrPath,
    depth: usize,
) -> Result<Vec<Conjunction>, PatternError> {
    if depth > MAX_PATTERN_DEPTH {
        return Err(at.error(format!(
            "pattern nests deeper than {MAX_PATTERN_DEPTH} levels"
        )));
    }
    let mut dnf = vec![Conjunction {
        conditions: Vec::new(),
    }];
    for (key, value) in obj {
        let part = at.with_key(key, |at| compile_member(key, value, field_path, at, depth))?;
        dnf = cross(dnf, part, at)?;
    }
    Ok(dnf)
}

fn compile_member(
    key: &str,
    value: &Value,
    field_path: &[String],
    at: &mut ErrPath,
    depth: usize,
) -> Result<Vec<Conjunction>, PatternError> {
    if key == "$or" {
        let Value::Array(items) = value else {
            return Err(at.error("`$or` must be an array of pattern objects"));
        };
        if items.is_empty() {
            return Err(at.error("`$or` must not be empty"));
        }
        let mut union = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let alts = at.with_index(i, |at| match item {
                Value::Object(o) if !o.is_empty() => compile_object(o, field_path, at, depth + 1),
                Value::Object(_) => Err(at.error("an empty object inside `$or` is not allowed")),
                _ => Err(at.error("each `$or` alternative must be a pattern object")),
            })?;
            union.extend(alts);
            if union.len() > MAX_PATTERN_ALTERNATIVES {
                return Err(at.error(format!(
                    "`$or` expands to more than {MAX_PATTERN_ALTERNATIVES} alternatives"
                )));
            }
        }
        return Ok(union);
    }
    // AWS envelope names (`detail-type`, `detail`) read the CloudEvent fields they map to:
    // the path holds the CloudEvents name, so the index and the matcher see one field.
    let key = if field_path.is_empty() {
        canonical_key(key)
    } else {
        key
    };
    if field_path.is_empty() && !is_attribute_name(key) {
        return Err(at.error(format!(
            "`{key}` is not a CloudEvents attribute name (lowercase a-z and 0-9), `data`, nor an AWS envelope key (`detail-type`, `detail`)"
        )));
    }
    let mut path = field_path.to_vec();
    path.push(key.to_owned());
    let matchers = match value {
        Value::Object(o) if o.is_empty() => {
            return Err(at.error("an empty object matches nothing; remove it or add fields"))
        }
        Value::Object(o) => return compile_object(o, &path, at, depth + 1),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(at.error("an empty list matches nothing"));
            }
            let mut ms = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                ms.push(at.with_index(i, |at| compile_matcher(item, at))?);
            }
            ms
        }
        scalar => vec![compile_matcher(scalar, at)?],
    };
    let attr = Attr::from_name(path.first().map(String::as_str).unwrap_or(key));
    Ok(vec![Conjunction {
        conditions: vec![FieldCondition {
            path,
            attr,
            matchers,
        }],
    }])
}

fn cross(
    left: Vec<Conjunction>,
    right: Vec<Conjunction>,
    at: &ErrPath,
) -> Result<Vec<Conjunction>, PatternError> {
    if left.len().saturating_mul(right.len()) > MAX_PATTERN_ALTERNATIVES {
        return Err(at.error(format!(
            "`$or` combinations expand to more than {MAX_PATTERN_ALTERNATIVES} alternatives"
        )));
    }
    let mut out = Vec::with_capacity(left.len() * right.len());
    for l in &left {
        for r in &right {
            let mut conditions = l.conditions.clone();
            conditions.extend(r.conditions.iter().cloned());
            out.push(Conjunction { conditions });
        }
    }
    Ok(out)
}

fn scalar_of(v: &Value, at: &ErrPath) -> Result<Scalar, PatternError> {
    Ok(match v {
        Value::Null => Scalar::Null,
        Value::Bool(b) => Scalar::Bool(*b),
        Value::Number(n) => Scalar::Num(number(n, at)?.key),
        Value::String(s) => Scalar::Str(s.clone()),
        _ => return Err(at.error("expected a string, number, boolean or null")),
    })
}

fn number(n: &serde_json::Number, at: &ErrPath) -> Result<Num, PatternError> {
    Num::from_json(n).ok_or_else(|| at.error("number is out of range"))
}

fn compile_matcher(v: &Value, at: &mut ErrPath) -> Result<Matcher, PatternError> {
    let obj = match v {
        Value::Array(_) => return Err(at.error("nested arrays are not allowed in a value list")),
        Value::Object(o) => o,
        scalar => return Ok(Matcher::Exact(scalar_of(scalar, at)?)),
    };
    let mut entries = obj.iter();
    let (op, arg) = match (entries.next(), entries.next()) {
        (Some(e), None) => e,
        (None, _) => return Err(at.error("an empty object is not a valid matcher")),
        (Some(_), Some(_)) => {
            return Err(at.error("a matcher object must have exactly one operator"))
        }
    };
    at.with_key(op, |at| compile_operator(op, arg, at))
}

fn expect_str<'v>(v: &'v Value, at: &ErrPath, what: &str) -> Result<&'v str, PatternError> {
    v.as_str()
        .ok_or_else(|| at.error(format!("`{what}` expects a string")))
}

/// `{"equals-ignore-case": "x"}` inside `prefix`/`suffix`.
fn ignore_case_arg(
    v: &Value,
    at: &mut ErrPath,
    what: &str,
) -> Result<Option<String>, PatternError> {
    match v {
        Value::String(_) => Ok(None),
        Value::Object(o) if o.len() == 1 => match o.get("equals-ignore-case") {
            Some(s) => at.with_key("equals-ignore-case", |at| {
                Ok(Some(fold(expect_str(s, at, "equals-ignore-case")?)))
            }),
            None => Err(at.error(format!(
                "`{what}` expects a string or {{\"equals-ignore-case\": string}}"
            ))),
        },
        _ => Err(at.error(format!(
            "`{what}` expects a string or {{\"equals-ignore-case\": string}}"
        ))),
    }
}

fn compile_operator(op: &str, arg: &Value, at: &mut ErrPath) -> Result<Matcher, PatternError> {
    match op {
        "prefix" => Ok(match ignore_case_arg(arg, at, op)? {
            Some(folded) => Matcher::PrefixIgnoreCase(folded),
            None => Matcher::Prefix(expect_str(arg, at, op)?.to_owned()),
        }),
        "suffix" => Ok(match ignore_case_arg(arg, at, op)? {
            Some(folded) => Matcher::SuffixIgnoreCase(folded),
            None => Matcher::Suffix(expect_str(arg, at, op)?.to_owned()),
        }),
        "equals-ignore-case" => Ok(Matcher::EqualsIgnoreCase(fold(expect_str(arg, at, op)?))),
        "wildcard" => Wildcard::parse(expect_str(arg, at, op)?)
            .map(Matcher::Wildcard)
            .map_err(|m| at.error(m)),
        "exists" => match arg {
            Value::Bool(b) => Ok(Matcher::Exists(*b)),
            _ => Err(at.error("`exists` expects true or false")),
        },
        "cidr" => Cidr::parse(expect_str(arg, at, op)?)
            .map(Matcher::Cidr)
            .map_err(|m| at.error(m)),
        "numeric" => compile_numeric(arg, at).map(Matcher::Numeric),
        "anything-but" => compile_anything_but(arg, at),
        other => Err(at.error(format!(
            "unknown operator `{other}` (expected prefix, suffix, equals-ignore-case, wildcard, \
             anything-but, numeric, exists or cidr)"
        ))),
    }
}

fn compile_numeric(arg: &Value, at: &mut ErrPath) -> Result<Range, PatternError> {
    let Value::Array(items) = arg else {
        return Err(at.error("`numeric` expects an array like [\">\", 0, \"<=\", 5]"));
    };
    if items.len() != 2 && items.len() != 4 {
        return Err(at.error(
            "`numeric` expects one or two (operator, number) pairs, e.g. [\">\", 0, \"<=\", 5]",
        ));
    }
    let mut range = Range {
        lower: None,
        upper: None,
    };
    for (pair, chunk) in items.chunks(2).enumerate() {
        let (Some(op), Some(num)) = (chunk.first(), chunk.get(1)) else {
            return Err(at.error("`numeric` expects (operator, number) pairs"));
        };
        let op_at = pair * 2;
        let op = at.with_index(op_at, |at| match op {
            Value::String(s) if ["=", "<", "<=", ">", ">="].contains(&s.as_str()) => Ok(s.clone()),
            _ => Err(at.error("expected one of \"=\", \"<\", \"<=\", \">\", \">=\"")),
        })?;
        let value = at.with_index(op_at + 1, |at| match num {
            // `+ 0.0` turns -0.0 into 0.0, so the index sees one zero.
            Value::Number(n) => Ok(number(n, at)?.f + 0.0),
            _ => Err(at.error("expected a number")),
        })?;
        let bound = |inclusive| Bound { value, inclusive };
        let slot_taken = at.with_index(op_at, |at| {
            let (slot, b) = match op.as_str() {
                "=" if items.len() == 2 => {
                    range.upper = Some(bound(true));
                    (&mut range.lower, bound(true))
                }
                "=" => return Err(at.error("\"=\" cannot be combined with another bound")),
                ">" => (&mut range.lower, bound(false)),
                ">=" => (&mut range.lower, bound(true)),
                "<" => (&mut range.upper, bound(false)),
                _ => (&mut range.upper, bound(true)),
            };
            if slot.is_some() {
                return Err(at.error("two lower bounds or two upper bounds in one range"));
            }
            *slot = Some(b);
            Ok(())
        });
        slot_taken?;
    }
    if let (Some(lo), Some(hi)) = (&range.lower, &range.upper) {
        let empty =
            lo.value > hi.value || (lo.value == hi.value && !(lo.inclusive && hi.inclusive));
        if empty {
            return Err(at.error("the numeric range is empty (lower bound above upper bound)"));
        }
    }
    Ok(range)
}

fn string_list(arg: &Value, at: &mut ErrPath, what: &str) -> Result<Vec<String>, PatternError> {
    match arg {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) if !items.is_empty() => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                out.push(at.with_index(i, |at| Ok(expect_str(item, at, what)?.to_owned()))?);
            }
            Ok(out)
        }
        _ => Err(at.error(format!(
            "`{what}` expects a string or a non-empty list of strings"
        ))),
    }
}

fn compile_anything_but(arg: &Value, at: &mut ErrPath) -> Result<Matcher, PatternError> {
    match arg {
        Value::String(_) | Value::Number(_) => Ok(Matcher::AnythingBut(vec![scalar_of(arg, at)?])),
        Value::Array(items) if !items.is_empty() => {
            let mut list = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                list.push(at.with_index(i, |at| match item {
                    Value::String(_) | Value::Number(_) => scalar_of(item, at),
                    _ => Err(at.error("`anything-but` lists hold strings or numbers")),
                })?);
            }
            Ok(Matcher::AnythingBut(list))
        }
        Value::Object(o) if o.len() == 1 => {
            let Some((op, inner)) = o.iter().next() else {
                return Err(at.error("empty `anything-but` object"));
            };
            at.with_key(op, |at| match op.as_str() {
                "prefix" => Ok(Matcher::AnythingButPrefix(string_list(inner, at, op)?)),
                "suffix" => Ok(Matcher::AnythingButSuffix(string_list(inner, at, op)?)),
                "equals-ignore-case" => Ok(Matcher::AnythingButIgnoreCase(
                    string_list(inner, at, op)?
                        .iter()
                        .map(|s| fold(s))
                        .collect(),
                )),
                "wildcard" => {
                    let mut ws = Vec::new();
                    for s in string_list(inner, at, op)? {
                        ws.push(Wildcard::parse(&s).map_err(|m| at.error(m))?);
                    }
                    Ok(Matcher::AnythingButWildcard(ws))
                }
                other => Err(at.error(format!(
                    "`anything-but` supports prefix, suffix, wildcard and equals-ignore-case, \
                     not `{other}`"
                ))),
            })
        }
        _ => Err(at.error(
            "`anything-but` expects a string, a number, a non-empty list of them, or an object \
             with prefix, suffix, wildcard or equals-ignore-case",
        )),
    }
}
