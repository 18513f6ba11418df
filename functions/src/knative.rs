//! Knative Trigger filters as CESQL: the legacy `filter.attributes` map and the
//! Subscriptions API `filters` dialects (`exact`, `prefix`, `suffix`, `all`, `any`, `not`,
//! `cesql`), translated once into one CESQL expression a rule can take as its `filter`.
//!
//! The semantics are Knative's own (`knative/eventing`, `pkg/eventfilter/attributes` and
//! `pkg/eventfilter/subscriptionsapi`), not the letter of the CloudEvents Subscriptions
//! API: a filter there yields *pass*, *fail* or *no filter*, and only *fail* drops the
//! event. Empty dialect objects (`{}`), `not: {}` and `all`/`any` lists with nothing left in
//! them are "no filter", which changes what an enclosing `not` or `any` yields; the
//! translation keeps the three outcomes (as a pass and a fail condition) so that such
//! nestings come out as Knative evaluates them. Missing attributes fail `exact`, `prefix`
//! and `suffix` (translated with an `EXISTS` guard, so no CESQL error is raised), and
//! `""` in `filter.attributes` means "present and not empty".
//!
//! What Knative's admission webhook refuses is refused here too (several dialects in one
//! object, attribute names other than `^[a-z][a-z0-9]*$`, a `cesql` that does not parse),
//! and so is what Knative would silently drop at run time (an empty `exact`/`prefix`/
//! `suffix` value), since a rule that quietly matches everything is worse than an error.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cesql::CesqlFilter;

/// How deep `all`/`any`/`not` may nest (hostile input cannot exhaust the stack, and the
/// CESQL produced stays within the parser's nesting bound).
pub const MAX_KNATIVE_DEPTH: usize = 16;

/// A Trigger's legacy `spec.filter`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AttributesFilter {
    /// Exact match per context attribute; `""` matches any non-empty value.
    #[serde(default)]
    pub attributes: BTreeMap<String, String>,
}

/// One expression of a Trigger's `spec.filters` (CloudEvents Subscriptions API dialects).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SubscriptionsFilter {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub all: Vec<SubscriptionsFilter>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub any: Vec<SubscriptionsFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not: Option<Box<SubscriptionsFilter>>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exact: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prefix: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub suffix: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cesql: String,
}

/// A Knative filter that cannot be translated: `at` is where (`filters[0].exact.Type`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {message}")]
pub struct KnativeFilterError {
    pub at: String,
    pub message: String,
}

fn error(at: &str, message: impl Into<String>) -> KnativeFilterError {
    KnativeFilterError {
        at: at.to_string(),
        message: message.into(),
    }
}

/// The CESQL filter equivalent to a Trigger's `filter` and `filters` (`filters` wins when
/// it has any expression, as in Knative). `None`: every event matches (no filter).
pub fn translate(
    filter: Option<&AttributesFilter>,
    filters: &[SubscriptionsFilter],
) -> Result<Option<String>, KnativeFilterError> {
    let condition = if !filters.is_empty() {
        let mut kids = Vec::new();
        for (i, f) in filters.iter().enumerate() {
            if let Some(t) = materialize(f, &format!("filters[{i}]"), 0)? {
                kids.push(t);
            }
        }
        all(kids).outcome()
    } else {
        match filter {
            Some(f) => attributes(&f.attributes)?,
            None => B::Const(true),
        }
    };
    let text = match condition {
        B::Const(true) => return Ok(None),
        other => other.render(true),
    };
    // What is produced must parse; a failure here is a bug of the translation, reported
    // as the filter's own error rather than a rule that never matches.
    CesqlFilter::parse(&text).map_err(|e| {
        error(
            "filters",
            format!("cannot be written as CESQL ({e}): {text}"),
        )
    })?;
    Ok(Some(text))
}

/// `filter.attributes`: every key must be present with that value (`""`: any non-empty).
fn attributes(attrs: &BTreeMap<String, String>) -> Result<B, KnativeFilterError> {
    let mut parts = Vec::new();
    for (name, value) in attrs {
        let at = format!("filter.attributes.{name}");
        let attr = attribute(name, &at)?;
        parts.push(B::atom(format!("EXISTS {attr}")));
        parts.push(if value.is_empty() {
            B::atom(format!("{attr} <> ''"))
        } else {
            B::atom(format!("{attr} = {}", literal(value)))
        });
    }
    Ok(and(parts))
}

/// A Knative filter outcome: the condition under which it passes and the one under which
/// it fails (neither: "no filter"). `two` when it always does one or the other.
#[derive(Debug, Clone)]
struct Tri {
    pass: B,
    fail: B,
    two: bool,
}

impl Tri {
    fn leaf(pass: B) -> Tri {
        Tri {
            fail: not(pass.clone()),
            pass,
            two: true,
        }
    }

    fn neutral() -> Tri {
        Tri {
            pass: B::Const(false),
            fail: B::Const(false),
            two: false,
        }
    }

    /// Whether the event is delivered: anything but a fail.
    fn outcome(self) -> B {
        if self.two {
            self.pass
        } else {
            not(self.fail)
        }
    }
}

/// Knative's `MaterializeSubscriptionsAPIFilter`: `None` for an object without a dialect
/// (it is skipped by the list that holds it).
fn materialize(
    f: &SubscriptionsFilter,
    at: &str,
    depth: usize,
) -> Result<Option<Tri>, KnativeFilterError> {
    if depth >= MAX_KNATIVE_DEPTH {
        return Err(error(
            at,
            format!("filters nest deeper than {MAX_KNATIVE_DEPTH} levels"),
        ));
    }
    let dialects = [
        !f.exact.is_empty(),
        !f.prefix.is_empty(),
        !f.suffix.is_empty(),
        !f.all.is_empty(),
        !f.any.is_empty(),
        f.not.is_some(),
        !f.cesql.is_empty(),
    ];
    if dialects.iter().filter(|d| **d).count() > 1 {
        return Err(error(
            at,
            "multiple dialects found, filters can have only one dialect set",
        ));
    }
    let list = |items: &[SubscriptionsFilter], name: &str| {
        let mut kids = Vec::new();
        for (i, item) in items.iter().enumerate() {
            if let Some(t) = materialize(item, &format!("{at}.{name}[{i}]"), depth + 1)? {
                kids.push(t);
            }
        }
        Ok::<_, KnativeFilterError>(kids)
    };
    Ok(Some(if !f.exact.is_empty() {
        matches(&f.exact, &format!("{at}.exact"), Match::Exact)?
    } else if !f.prefix.is_empty() {
        matches(&f.prefix, &format!("{at}.prefix"), Match::Prefix)?
    } else if !f.suffix.is_empty() {
        matches(&f.suffix, &format!("{at}.suffix"), Match::Suffix)?
    } else if !f.all.is_empty() {
        all(list(&f.all, "all")?)
    } else if !f.any.is_empty() {
        any(list(&f.any, "any")?)
    } else if let Some(inner) = &f.not {
        match materialize(inner, &format!("{at}.not"), depth + 1)? {
            Some(t) => Tri {
                pass: t.fail,
                fail: t.pass,
                two: t.two,
            },
            // Knative's `not` around nothing answers "no filter".
            None => Tri::neutral(),
        }
    } else if !f.cesql.is_empty() {
        CesqlFilter::parse(&f.cesql).map_err(|e| error(&format!("{at}.cesql"), e.to_string()))?;
        Tri::leaf(B::Atom(f.cesql.clone(), false))
    } else {
        return Ok(None);
    }))
}

#[derive(Clone, Copy)]
enum Match {
    Exact,
    Prefix,
    Suffix,
}

/// `exact`/`prefix`/`suffix`: every key must hold (Knative's validation allows several).
fn matches(
    map: &BTreeMap<String, String>,
    at: &str,
    how: Match,
) -> Result<Tri, KnativeFilterError> {
    let mut parts = Vec::new();
    for (name, value) in map {
        let at = format!("{at}.{name}");
        let attr = attribute(name, &at)?;
        if value.is_empty() {
            return Err(error(&at, "the value must not be empty"));
        }
        parts.push(B::atom(format!("EXISTS {attr}")));
        parts.push(B::atom(match how {
            Match::Exact => format!("{attr} = {}", literal(value)),
            Match::Prefix => format!("{attr} LIKE {}", literal(&format!("{}%", like(value)))),
            // A LIKE pattern is a plain literal, which cannot end in a backslash: compare
            // the tail instead.
            Match::Suffix if value.ends_with('\\') => format!(
                "RIGHT({attr}, {n}) = {}",
                literal(value),
                n = value.chars().count()
            ),
            Match::Suffix => format!("{attr} LIKE {}", literal(&format!("%{}", like(value)))),
        }));
    }
    Ok(Tri::leaf(and(parts)))
}

/// Knative's `all`: the first fail fails it, else it yields what its last member yields.
fn all(mut kids: Vec<Tri>) -> Tri {
    match kids.len() {
        0 => return Tri::neutral(),
        1 => return kids.remove(0),
        _ => {}
    }
    if kids.iter().all(|k| k.two) {
        return Tri::leaf(and(kids.into_iter().map(|k| k.pass).collect()));
    }
    let fail = or(kids.iter().map(|k| k.fail.clone()).collect());
    let last = kids.len() - 1;
    let mut pass: Vec<B> = kids[..last].iter().map(|k| not(k.fail.clone())).collect();
    pass.push(kids[last].pass.clone());
    Tri {
        pass: and(pass),
        fail,
        two: false,
    }
}

/// Knative's `any`: the first pass passes it, else it yields what its last member yields.
fn any(mut kids: Vec<Tri>) -> Tri {
    match kids.len() {
        0 => return Tri::neutral(),
        1 => return kids.remove(0),
        _ => {}
    }
    if kids.iter().all(|k| k.two) {
        return Tri::leaf(or(kids.into_iter().map(|k| k.pass).collect()));
    }
    let pass = or(kids.iter().map(|k| k.pass.clone()).collect());
    let last = kids[kids.len() - 1].fail.clone();
    Tri {
        fail: and(vec![not(pass.clone()), last]),
        pass,
        two: false,
    }
}

/// An attribute name as a CESQL identifier: Knative's rule for names, and not one of
/// CESQL's keywords (which cannot be written as an identifier).
fn attribute(name: &str, at: &str) -> Result<String, KnativeFilterError> {
    let mut bytes = name.bytes();
    let valid = bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    if !valid {
        return Err(error(
            at,
            format!(
                "`{name}`: attribute name must start with a letter and can only contain lowercase alphanumeric"
            ),
        ));
    }
    const KEYWORDS: [&str; 9] = [
        "and", "or", "xor", "not", "like", "in", "exists", "true", "false",
    ];
    if KEYWORDS.contains(&name) {
        return Err(error(
            at,
            format!("`{name}` is a CESQL keyword and cannot be filtered on here"),
        ));
    }
    Ok(match name {
        // Knative reads the CloudEvents 0.3 name as `dataschema`.
        "schemaurl" => "dataschema".to_string(),
        "datamediatype" | "datacontentencoding" => {
            return Err(error(
                at,
                format!("`{name}` is not supported; filter on `datacontenttype`"),
            ))
        }
        other => other.to_string(),
    })
}

/// `s` as a CESQL string: `'` escaped as `\'`, and a backslash elsewhere is itself. A
/// literal cannot end in a backslash (it would escape the closing quote), so such a text
/// is written with one more character and cut back with `LEFT`.
fn literal(s: &str) -> String {
    let quoted = |s: &str| format!("'{}'", s.replace('\'', "\\'"));
    if s.ends_with('\\') {
        format!("LEFT({}, {})", quoted(&format!("{s} ")), s.chars().count())
    } else {
        quoted(s)
    }
}

/// `s` as a LIKE pattern that matches it literally.
fn like(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '%' | '_' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A boolean condition, folded as it is built and written with every grouping explicit
/// (in CESQL `AND`, `OR` and `XOR` share one level, and `NOT a = b` reads `(NOT a) = b`).
#[derive(Debug, Clone, PartialEq)]
enum B {
    Const(bool),
    /// CESQL text; `true` when it binds tighter than `AND`/`OR` (a comparison, `LIKE`,
    /// `EXISTS`) and needs no parentheses as their operand.
    Atom(String, bool),
    Not(Box<B>),
    And(Vec<B>),
    Or(Vec<B>),
}

impl B {
    fn atom(text: String) -> B {
        B::Atom(text, true)
    }

    fn render(&self, top: bool) -> String {
        let group = |parts: &[B], op: &str| {
            let text = parts
                .iter()
                .map(|p| p.render(false))
                .collect::<Vec<_>>()
                .join(op);
            if top {
                text
            } else {
                format!("({text})")
            }
        };
        match self {
            B::Const(true) => "TRUE".to_string(),
            B::Const(false) => "FALSE".to_string(),
            B::Atom(text, simple) => {
                if top || *simple {
                    text.clone()
                } else {
                    format!("({text})")
                }
            }
            B::Not(inner) => format!("NOT ({})", inner.render(true)),
            B::And(parts) => group(parts, " AND "),
            B::Or(parts) => group(parts, " OR "),
        }
    }
}

fn not(b: B) -> B {
    match b {
        B::Const(v) => B::Const(!v),
        B::Not(inner) => *inner,
        other => B::Not(Box::new(other)),
    }
}

fn and(parts: Vec<B>) -> B {
    let mut out = Vec::new();
    for p in parts {
        match p {
            B::Const(true) => {}
            B::Const(false) => return B::Const(false),
            B::And(inner) => out.extend(inner),
            other => out.push(other),
        }
    }
    match out.len() {
        0 => B::Const(true),
        1 => out.remove(0),
        _ => B::And(out),
    }
}

fn or(parts: Vec<B>) -> B {
    let mut out = Vec::new();
    for p in parts {
        match p {
            B::Const(false) => {}
            B::Const(true) => return B::Const(true),
            B::Or(inner) => out.extend(inner),
            other => out.push(other),
        }
    }
    match out.len() {
        0 => B::Const(false),
        1 => out.remove(0),
        _ => B::Or(out),
    }
}

#[cfg(test)]
#[path = "knative_tests.rs"]
mod tests;
