//! Event patterns with the operator set of Amazon EventBridge / RocketMQ EventBridge.
//!
//! A pattern is compiled once into disjunctive normal form: a list of alternatives (one per
//! `$or` combination), each a conjunction of field conditions. A field condition holds a
//! path (attribute name, then keys inside `data`) and a list of matchers, any of which may
//! match any leaf found at that path. The rule index consumes the same compiled form.

use std::fmt;
use std::net::IpAddr;

use cloudevents::Event;
use serde_json::{Map, Value};

use crate::view::{compatible, fold, is_attribute_name, Attr, EventView, Leaf, Num, NumKey};

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
    /// What is wrong there.
    pub message: String,
}

/// A compiled event pattern.
#[derive(Debug, Clone)]
pub struct Pattern {
    pub(crate) alternatives: Vec<Conjunction>,
}

#[derive(Debug, Clone)]
pub(crate) struct Conjunction {
    pub(crate) conditions: Vec<FieldCondition>,
}

#[derive(Debug, Clone)]
pub(crate) struct FieldCondition {
    /// Full path; `path[0]` is the attribute name or `data`.
    pub(crate) path: Vec<String>,
    pub(crate) attr: Attr,
    pub(crate) matchers: Vec<Matcher>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Scalar {
    Null,
    Bool(bool),
    Num(NumKey),
    Str(String),
}

impl Scalar {
    fn equals(&self, leaf: Leaf<'_>) -> bool {
        match (self, leaf) {
            (Scalar::Null, Leaf::Null) => true,
            (Scalar::Bool(a), Leaf::Bool(b)) => *a == b,
            (Scalar::Num(k), Leaf::Num(n)) => *k == n.key,
            (Scalar::Str(a), Leaf::Str(b)) => a == b,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Bound {
    pub(crate) value: f64,
    pub(crate) inclusive: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Range {
    pub(crate) lower: Option<Bound>,
    pub(crate) upper: Option<Bound>,
}

impl Range {
    pub(crate) fn contains(&self, x: f64) -> bool {
        let lower_ok = match &self.lower {
            None => true,
            Some(b) if b.inclusive => x >= b.value,
            Some(b) => x > b.value,
        };
        let upper_ok = match &self.upper {
            None => true,
            Some(b) if b.inclusive => x <= b.value,
            Some(b) => x < b.value,
        };
        lower_ok && upper_ok
    }
}

/// A `*` glob; `parts` are the literal pieces between stars.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Wildcard {
    parts: Vec<String>,
}

impl Wildcard {
    fn parse(s: &str) -> Result<Wildcard, String> {
        let mut parts = vec![String::new()];
        let mut chars = s.chars();
        let mut last_was_star = false;
        while let Some(c) = chars.next() {
            match c {
                '*' => {
                    if last_was_star {
                        return Err("consecutive `*` are not allowed in a wildcard".into());
                    }
                    parts.push(String::new());
                    last_was_star = true;
                    continue;
                }
                '\\' => {
                    let escaped = match chars.next() {
                        Some(e @ ('*' | '\\')) => e,
                        _ => {
                            return Err(
                                "a `\\` in a wildcard must be followed by `*` or `\\`".into()
                            )
                        }
                    };
                    push_char(&mut parts, escaped);
                }
                other => push_char(&mut parts, other),
            }
            last_was_star = false;
        }
        Ok(Wildcard { parts })
    }

    pub(crate) fn matches(&self, s: &str) -> bool {
        let (first, rest) = match self.parts.split_first() {
            Some(x) => x,
            None => return s.is_empty(),
        };
        let Some((last, middle)) = rest.split_last() else {
            return s == first;
        };
        if s.len() < first.len() + last.len() || !s.starts_with(first.as_str()) {
            return false;
        }
        if !s.ends_with(last.as_str()) {
            return false;
        }
        let Some(mut region) = s.get(first.len()..s.len() - last.len()) else {
            return false;
        };
        for part in middle {
            match region.find(part.as_str()) {
                Some(at) => match region.get(at + part.len()..) {
                    Some(r) => region = r,
                    None => return false,
                },
                None => return false,
            }
        }
        true
    }
}

fn push_char(parts: &mut [String], c: char) {
    if let Some(last) = parts.last_mut() {
        last.push(c);
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Cidr {
    net: IpAddr,
    prefix: u8,
}

impl Cidr {
    fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, len) = s
            .split_once('/')
            .ok_or_else(|| format!("`{s}` is not in CIDR notation (address/prefix-length)"))?;
        let net: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("`{addr}` is not an IPv4 or IPv6 address"))?;
        let prefix: u8 = len
            .trim()
            .parse()
            .map_err(|_| format!("`{len}` is not a prefix length"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("prefix length {prefix} is larger than {max}"));
        }
        Ok(Cidr { net, prefix })
    }

    pub(crate) fn contains(&self, s: &str) -> bool {
        let Ok(ip) = s.trim().parse::<IpAddr>() else {
            return false;
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Matcher {
    Exact(Scalar),
    Prefix(String),
    /// Folded prefix.
    PrefixIgnoreCase(String),
    Suffix(String),
    SuffixIgnoreCase(String),
    /// Folded value.
    EqualsIgnoreCase(String),
    Wildcard(Wildcard),
    AnythingBut(Vec<Scalar>),
    AnythingButPrefix(Vec<String>),
    AnythingButSuffix(Vec<String>),
    AnythingButWildcard(Vec<Wildcard>),
    /// Folded values.
    AnythingButIgnoreCase(Vec<String>),
    Numeric(Range),
    Cidr(Cidr),
    Exists(bool),
}

impl Matcher {
    /// Whether one leaf satisfies this matcher. `Exists` is decided per path, not per leaf.
    pub(crate) fn test(&self, leaf: Leaf<'_>) -> bool {
        match self {
            Matcher::Exact(s) => s.equals(leaf),
            Matcher::Numeric(r) => matches!(leaf, Leaf::Num(n) if r.contains(n.f)),
            Matcher::AnythingBut(list) => !list.iter().any(|s| s.equals(leaf)),
            Matcher::Exists(_) => false,
            _ => match leaf {
                Leaf::Str(s) => self.test_str(s),
                _ => false,
            },
        }
    }

    fn test_str(&self, s: &str) -> bool {
        match self {
            Matcher::Prefix(p) => s.starts_with(p.as_str()),
            Matcher::PrefixIgnoreCase(p) => fold(s).starts_with(p.as_str()),
            Matcher::Suffix(p) => s.ends_with(p.as_str()),
            Matcher::SuffixIgnoreCase(p) => fold(s).ends_with(p.as_str()),
            Matcher::EqualsIgnoreCase(v) => fold(s) == *v,
            Matcher::Wildcard(w) => w.matches(s),
            Matcher::AnythingButPrefix(ps) => !ps.iter().any(|p| s.starts_with(p.as_str())),
            Matcher::AnythingButSuffix(ps) => !ps.iter().any(|p| s.ends_with(p.as_str())),
            Matcher::AnythingButWildcard(ws) => !ws.iter().any(|w| w.matches(s)),
            Matcher::AnythingButIgnoreCase(vs) => !vs.contains(&fold(s)),
            Matcher::Cidr(c) => c.contains(s),
            _ => false,
        }
    }
}

impl FieldCondition {
    pub(crate) fn rest(&self) -> &[String] {
        self.path.get(1..).unwrap_or(&[])
    }

    /// Whether the condition holds on its own (arrays flattened).
    fn eval(&self, view: &EventView<'_>) -> bool {
        let mut any_leaf = false;
        let mut hit = false;
        view.leaves(&self.attr, self.rest(), &mut |leaf, _| {
            any_leaf = true;
            if !hit && self.matchers.iter().any(|m| m.test(leaf)) {
                hit = true;
            }
        });
        hit || self
            .matchers
            .iter()
            .any(|m| matches!(m, Matcher::Exists(e) if *e == any_leaf))
    }

    /// The leaves that satisfy this condition, as coordinates to reconcile with the other
    /// conditions of the conjunction.
    fn witnesses(&self, view: &EventView<'_>) -> Witnesses {
        let exists_true = self.matchers.contains(&Matcher::Exists(true));
        let mut any_leaf = false;
        let mut free = false;
        let mut bound: Vec<Vec<(usize, usize)>> = Vec::new();
        view.leaves(&self.attr, self.rest(), &mut |leaf, coords| {
            any_leaf = true;
            if free || bound.len() >= MAX_WITNESSES {
                return;
            }
            if exists_true || self.matchers.iter().any(|m| m.test(leaf)) {
                if coords.is_empty() {
                    free = true;
                } else {
                    bound.push(coords.to_vec());
                }
            }
        });
        if free || (!any_leaf && self.matchers.contains(&Matcher::Exists(false))) {
            Witnesses::Free
        } else if bound.is_empty() {
            Witnesses::None
        } else {
            Witnesses::Bound(bound)
        }
    }
}

/// Leaves kept per condition when reconciling array elements.
const MAX_WITNESSES: usize = 4096;
/// Steps of the array-consistency search before falling back to the flattened answer.
const MAX_CONSISTENCY_STEPS: usize = 100_000;

enum Witnesses {
    /// Not satisfied.
    None,
    /// Satisfied by a leaf outside any array of objects (or by absence): no constraint.
    Free,
    /// Satisfied only by leaves inside arrays of objects, at these coordinates.
    Bound(Vec<Vec<(usize, usize)>>),
}

/// Whether all conditions hold, with leaves taken from the same element of every array of
/// objects they share (EventBridge's array-consistent matching).
pub(crate) fn conjunction_matches(conditions: &[FieldCondition], view: &EventView<'_>) -> bool {
    // Each condition holding on its own is necessary; it is also sufficient unless two or
    // more conditions look inside `data`, where arrays of objects can be shared.
    if !conditions.iter().all(|c| c.eval(view)) {
        return false;
    }
    if conditions.iter().filter(|c| c.attr == Attr::Data).count() < 2 {
        return true;
    }
    let mut lists: Vec<Vec<Vec<(usize, usize)>>> = Vec::new();
    for c in conditions {
        match c.witnesses(view) {
            Witnesses::None => return false,
            Witnesses::Free => {}
            Witnesses::Bound(w) => lists.push(w),
        }
    }
    if lists.len() < 2 {
        return true;
    }
    lists.sort_by_key(Vec::len);
    // Iterative backtracking: choose one witness per condition, pairwise compatible.
    let mut choice = vec![0usize; lists.len()];
    let mut level = 0usize;
    let mut steps = 0usize;
    loop {
        let (Some(list), Some(&at)) = (lists.get(level), choice.get(level)) else {
            return true; // every level has a compatible choice
        };
        let Some(candidate) = list.get(at) else {
            if level == 0 {
                return false;
            }
            if let Some(c) = choice.get_mut(level) {
                *c = 0;
            }
            level -= 1;
            if let Some(c) = choice.get_mut(level) {
                *c += 1;
            }
            continue;
        };
        steps += 1;
        if steps > MAX_CONSISTENCY_STEPS {
            // Pathological event: keep the flattened answer (every condition holds).
            return true;
        }
        let fits = (0..level).all(|l| match (lists.get(l), choice.get(l)) {
            (Some(prev), Some(&i)) => prev.get(i).is_some_and(|p| compatible(p, candidate)),
            _ => false,
        });
        if fits {
            level += 1;
        } else if let Some(c) = choice.get_mut(level) {
            *c += 1;
        }
    }
}

impl Pattern {
    /// Compiles a JSON pattern. The top level must be an object; `{}` matches every event.
    pub fn compile(pattern: &Value) -> Result<Pattern, PatternError> {
        let mut at = ErrPath::default();
        let Value::Object(obj) = pattern else {
            return Err(at.error("a pattern must be a JSON object"));
        };
        let alternatives = compile_object(obj, &[], &mut at, 0)?;
        Ok(Pattern { alternatives })
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
            message: message.into(),
        }
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
    if field_path.is_empty() && !is_attribute_name(key) {
        return Err(at.error(format!(
            "`{key}` is not a CloudEvents attribute name (lowercase a-z and 0-9) nor `data`"
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
