//! Read-only access to the parts of a CloudEvent that patterns and the index look at:
//! attributes by name, and the `data` payload when it is JSON. Shared by the reference
//! matcher (`Pattern::matches`) and the index so both see exactly the same leaves.

use std::borrow::Cow;

use cloudevents::event::{AttributeValue, ExtensionValue};
use cloudevents::{AttributesReader, Data, Event};
use serde_json::Value;

/// A number as both an `f64` (for ranges) and an exact, hashable key (for equality), so
/// `300`, `300.0` and `3e2` compare equal while large integers keep full precision.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Num {
    pub(crate) f: f64,
    pub(crate) key: NumKey,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum NumKey {
    Int(i128),
    Float(u64),
}

impl Num {
    pub(crate) fn from_json(n: &serde_json::Number) -> Option<Num> {
        if let Some(i) = n.as_i64() {
            return Some(Num::from_i64(i));
        }
        if let Some(u) = n.as_u64() {
            return Some(Num {
                f: u as f64,
                key: NumKey::Int(i128::from(u)),
            });
        }
        n.as_f64().and_then(Num::from_f64)
    }

    pub(crate) fn from_i64(i: i64) -> Num {
        Num {
            f: i as f64,
            key: NumKey::Int(i128::from(i)),
        }
    }

    pub(crate) fn from_f64(f: f64) -> Option<Num> {
        if !f.is_finite() {
            return None;
        }
        // 2^100 bounds keep the cast exact and far inside i128.
        let key = if f.fract() == 0.0 && f.abs() < 1.2676506002282294e30 {
            NumKey::Int(f as i128)
        } else {
            NumKey::Float(f.to_bits())
        };
        Some(Num { f, key })
    }
}

/// One leaf value seen at a field path.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Leaf<'a> {
    Null,
    Bool(bool),
    Num(Num),
    Str(&'a str),
}

impl<'a> Leaf<'a> {
    pub(crate) fn from_json(v: &'a Value) -> Option<Leaf<'a>> {
        match v {
            Value::Null => Some(Leaf::Null),
            Value::Bool(b) => Some(Leaf::Bool(*b)),
            Value::Number(n) => Num::from_json(n).map(Leaf::Num),
            Value::String(s) => Some(Leaf::Str(s)),
            Value::Array(_) | Value::Object(_) => None,
        }
    }
}

/// Case folding used by every case-insensitive operator: upper then lower, so that
/// `ß`/`SS`/`ss` and final/medial sigma fold together, beyond ASCII.
pub(crate) fn fold(s: &str) -> String {
    if s.is_ascii() {
        return s.to_ascii_lowercase();
    }
    s.to_uppercase().to_lowercase()
}

/// [`fold`] into a reused buffer; allocation-free for ASCII.
pub(crate) fn fold_into(buf: &mut String, s: &str) {
    buf.clear();
    if s.is_ascii() {
        buf.extend(s.chars().map(|c| c.to_ascii_lowercase()));
    } else {
        buf.push_str(&fold(s));
    }
}

pub(crate) fn is_json_content_type(ct: &str) -> bool {
    let ct = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    ct == "application/json" || ct == "text/json" || ct.ends_with("+json")
}

/// The payload as JSON: `Data::Json` as is; a string or binary payload only when the
/// content type is JSON (or absent, which CloudEvents defines as JSON) and it parses.
pub(crate) fn data_json(event: &Event) -> Option<Cow<'_, Value>> {
    let json_ct = event.datacontenttype().is_none_or(is_json_content_type);
    match event.data()? {
        Data::Json(v) => Some(Cow::Borrowed(v)),
        Data::String(s) if json_ct => serde_json::from_str(s).ok().map(Cow::Owned),
        Data::Binary(b) if json_ct => serde_json::from_slice(b).ok().map(Cow::Owned),
        _ => None,
    }
}

/// Which attribute a top-level pattern key names; resolved once at compile time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Attr {
    Id,
    Source,
    Type,
    Subject,
    Time,
    DataContentType,
    DataSchema,
    SpecVersion,
    Data,
    /// `resources`: a JSON array kept as text (AWS PutEvents' `Resources`); a pattern
    /// matches any of its elements.
    Resources,
    Extension(String),
}

/// The CloudEvents name of a top-level pattern key written against the AWS EventBridge
/// envelope: `detail-type` is `type`, `detail` is `data` (the others, `source`, `id`,
/// `time`, `account`, `region`, `resources`, already have their AWS names).
pub(crate) fn canonical_key(name: &str) -> &str {
    match name {
        "detail-type" => "type",
        "detail" => "data",
        other => other,
    }
}

impl Attr {
    pub(crate) fn from_name(name: &str) -> Attr {
        match canonical_key(name) {
            "id" => Attr::Id,
            "source" => Attr::Source,
            "type" => Attr::Type,
            "subject" => Attr::Subject,
            "time" => Attr::Time,
            "datacontenttype" => Attr::DataContentType,
            "dataschema" => Attr::DataSchema,
            "specversion" => Attr::SpecVersion,
            "data" => Attr::Data,
            "resources" => Attr::Resources,
            other => Attr::Extension(other.to_owned()),
        }
    }
}

/// A valid CloudEvents attribute name: lowercase ASCII letters and digits.
pub(crate) fn is_attribute_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// Calls `f` with the value of a context attribute (not `data`), if present.
pub(crate) fn with_attribute(event: &Event, attr: &Attr, f: &mut dyn FnMut(Leaf<'_>)) {
    match attr {
        Attr::Id => f(Leaf::Str(event.id())),
        Attr::Source => f(Leaf::Str(event.source())),
        Attr::Type => f(Leaf::Str(event.ty())),
        Attr::Subject => {
            if let Some(s) = event.subject() {
                f(Leaf::Str(s))
            }
        }
        Attr::Time => {
            if let Some(t) = event.time() {
                f(Leaf::Str(&time_string(t)))
            }
        }
        Attr::DataContentType => {
            if let Some(s) = event.datacontenttype() {
                f(Leaf::Str(s))
            }
        }
        Attr::DataSchema => {
            if let Some(s) = event.dataschema() {
                f(Leaf::Str(s.as_str()))
            }
        }
        Attr::SpecVersion => f(Leaf::Str(event.specversion().as_str())),
        Attr::Data => {}
        Attr::Resources => with_extension(event, "resources", f),
        Attr::Extension(name) => with_extension(event, name, f),
    }
}

fn with_extension(event: &Event, name: &str, f: &mut dyn FnMut(Leaf<'_>)) {
    match event.extension(name) {
        Some(ExtensionValue::String(s)) => f(Leaf::Str(s)),
        Some(ExtensionValue::Boolean(b)) => f(Leaf::Bool(*b)),
        Some(ExtensionValue::Integer(i)) => f(Leaf::Num(Num::from_i64(*i))),
        None => {}
    }
}

/// Calls `f` with each leaf a pattern sees at a context attribute: its value, except for
/// `resources`, whose elements are the leaves when it holds a JSON array of scalars (as
/// AWS EventBridge matches a pattern against any element of `resources`).
pub(crate) fn with_pattern_leaves(event: &Event, attr: &Attr, f: &mut dyn FnMut(Leaf<'_>)) {
    if *attr != Attr::Resources {
        return with_attribute(event, attr, f);
    }
    let Some(ExtensionValue::String(text)) = event.extension("resources") else {
        return with_attribute(event, attr, f);
    };
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Array(items)) => {
            for item in &items {
                if let Some(leaf) = Leaf::from_json(item) {
                    f(leaf);
                }
            }
        }
        _ => f(Leaf::Str(text)),
    }
}

/// A timestamp exactly as the structured JSON form writes it (RFC 3339, UTC, `Z`), so
/// patterns, CESQL and transforms all see the same text.
pub(crate) fn time_string<T: serde::Serialize>(t: &T) -> String {
    match serde_json::to_value(t) {
        Ok(Value::String(s)) => s,
        _ => String::new(),
    }
}

/// String form of an attribute as CloudEvents defines it (used by CESQL).
pub(crate) fn attribute_value<'a>(event: &'a Event, name: &str) -> Option<AttributeValue<'a>> {
    event.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
}

/// Where a leaf sits among arrays of objects: one `(array address, element index)` per
/// array whose object (or array) element was entered on the way down. Two leaves are
/// compatible when they agree on every array they share, i.e. they do not come from
/// different elements of the same array (EventBridge's array-consistent matching).
pub(crate) type Coords = [(usize, usize)];

pub(crate) fn compatible(a: &Coords, b: &Coords) -> bool {
    a.iter()
        .all(|(id, i)| b.iter().all(|(id2, j)| id != id2 || i == j))
}

/// Calls `f` for every leaf reached by `path` inside `root`, with its coordinates. Arrays
/// are transparent at every level: an array contributes each of its elements. Iterative,
/// so hostile nesting in the event cannot overflow the stack.
pub(crate) fn json_leaves<'a>(
    root: &'a Value,
    path: &[String],
    f: &mut dyn FnMut(Leaf<'a>, &Coords),
) {
    // (value, depth in `path`, coordinates so far)
    type Pending<'v> = (&'v Value, usize, Vec<(usize, usize)>);
    let mut stack: Vec<Pending<'a>> = vec![(root, 0, Vec::new())];
    while let Some((v, depth, coords)) = stack.pop() {
        match v {
            Value::Array(items) => {
                let id = items as *const Vec<Value> as usize;
                for (i, item) in items.iter().enumerate().rev() {
                    let mut c = coords.clone();
                    if matches!(item, Value::Object(_) | Value::Array(_)) {
                        c.push((id, i));
                    }
                    stack.push((item, depth, c));
                }
            }
            Value::Object(map) => {
                if let Some(key) = path.get(depth) {
                    if let Some(child) = map.get(key) {
                        stack.push((child, depth + 1, coords));
                    }
                }
            }
            scalar => {
                if depth == path.len() {
                    if let Some(leaf) = Leaf::from_json(scalar) {
                        f(leaf, &coords);
                    }
                }
            }
        }
    }
}

/// An event plus its payload, parsed at most once per match call and only when needed.
pub(crate) struct EventView<'a> {
    pub(crate) event: &'a Event,
    data: std::cell::OnceCell<Option<Cow<'a, Value>>>,
}

impl<'a> EventView<'a> {
    pub(crate) fn new(event: &'a Event) -> Self {
        EventView {
            event,
            data: std::cell::OnceCell::new(),
        }
    }

    pub(crate) fn data(&self) -> Option<&Value> {
        self.data.get_or_init(|| data_json(self.event)).as_deref()
    }

    /// All leaves at a full field path (first segment: attribute name or `data`), with
    /// their coordinates (empty for attributes).
    pub(crate) fn leaves(
        &self,
        attr: &Attr,
        rest: &[String],
        f: &mut dyn FnMut(Leaf<'_>, &Coords),
    ) {
        match attr {
            Attr::Data => {
                if let Some(d) = self.data() {
                    json_leaves(d, rest, f);
                }
            }
            other => {
                if rest.is_empty() {
                    with_pattern_leaves(self.event, other, &mut |leaf| f(leaf, &[]));
                }
            }
        }
    }
}
