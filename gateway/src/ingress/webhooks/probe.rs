//! Reads only the fields a webhook source needs (delivery id, event name, timestamp, a
//! handshake's challenge) out of a JSON body, in one pass that allocates nothing for the
//! rest of the document: every other member is skipped as it is read (`IgnoredAny`), so a
//! large payload costs a scan, not a tree. The body is still read to its end, so a body
//! that is not JSON yields no fields at all, as a full parse would.

use std::borrow::Cow;
use std::fmt;

use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// One step of a path into the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    Key(String),
    Index(usize),
}

/// The paths to read, as a tree: a node's children are the next steps of the paths that
/// pass through it; `slot` is set where a path ends.
#[derive(Debug, Default, Clone)]
pub(crate) struct Paths {
    root: Node,
    /// Every path, in slot order (what `Fields::get` looks up).
    paths: Vec<Vec<Step>>,
}

#[derive(Debug, Default, Clone)]
struct Node {
    keys: Vec<(String, Node)>,
    indexes: Vec<(usize, Node)>,
    slot: Option<usize>,
}

impl Node {
    fn is_empty(&self) -> bool {
        self.keys.is_empty() && self.indexes.is_empty() && self.slot.is_none()
    }

    fn child(&self, key: &str) -> Option<&Node> {
        self.keys.iter().find(|(k, _)| k == key).map(|(_, n)| n)
    }
}

impl Paths {
    /// Adds a path (once) to what is read.
    pub(crate) fn add(&mut self, path: &[Step]) {
        if self.paths.iter().any(|p| p == path) {
            return;
        }
        let slot = self.paths.len();
        self.paths.push(path.to_vec());
        let mut node = &mut self.root;
        for step in path {
            node = match step {
                Step::Key(k) => {
                    let at = match node.keys.iter().position(|(have, _)| have == k) {
                        Some(at) => at,
                        None => {
                            node.keys.push((k.clone(), Node::default()));
                            node.keys.len() - 1
                        }
                    };
                    &mut node.keys[at].1
                }
                Step::Index(i) => {
                    let at = match node.indexes.iter().position(|(have, _)| have == i) {
                        Some(at) => at,
                        None => {
                            node.indexes.push((*i, Node::default()));
                            node.indexes.len() - 1
                        }
                    };
                    &mut node.indexes[at].1
                }
            };
        }
        node.slot = Some(slot);
    }

    /// Adds a dotted path of member names (`payload.plainToken`).
    pub(crate) fn add_dotted(&mut self, dotted: &str) {
        let steps: Vec<Step> = dotted
            .split('.')
            .map(|k| Step::Key(k.to_string()))
            .collect();
        self.add(&steps);
    }

    /// No fields (a body that is not JSON).
    pub(crate) fn nothing(&self) -> Fields<'_> {
        Fields {
            paths: self,
            values: vec![None; self.paths.len()],
        }
    }

    /// Reads the body: the value at each path (`None` where absent), or no fields when the
    /// body is not a JSON document.
    pub(crate) fn read(&self, body: &[u8]) -> Fields<'_> {
        if self.paths.is_empty() {
            return self.nothing();
        }
        let mut values = vec![None; self.paths.len()];
        let mut de = serde_json::Deserializer::from_slice(body);
        let read = Seed {
            node: &self.root,
            values: &mut values,
        }
        .deserialize(&mut de)
        .and_then(|()| de.end());
        if read.is_err() {
            values.iter_mut().for_each(|v| *v = None);
        }
        Fields {
            paths: self,
            values,
        }
    }
}

/// What `Paths::read` found.
pub(crate) struct Fields<'a> {
    paths: &'a Paths,
    values: Vec<Option<Value>>,
}

impl Fields<'_> {
    /// The value at `path` (which must have been added to the paths read).
    pub(crate) fn get(&self, path: &[Step]) -> Option<&Value> {
        let at = self.paths.paths.iter().position(|p| p == path)?;
        self.values.get(at)?.as_ref()
    }

    /// The value at a dotted path of member names.
    pub(crate) fn get_dotted(&self, dotted: &str) -> Option<&Value> {
        let at = self.paths.paths.iter().position(|p| {
            let mut names = dotted.split('.');
            p.iter()
                .all(|s| matches!((s, names.next()), (Step::Key(k), Some(n)) if k == n))
                && names.next().is_none()
        })?;
        self.values.get(at)?.as_ref()
    }
}

struct Seed<'n, 'v> {
    node: &'n Node,
    values: &'v mut Vec<Option<Value>>,
}

impl<'de> DeserializeSeed<'de> for Seed<'_, '_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if let Some(slot) = self.node.slot {
            // A path ends here: keep the whole value (and serve deeper paths from it).
            let value = Value::deserialize(d)?;
            fill(self.node, &value, self.values);
            if let Some(v) = self.values.get_mut(slot) {
                *v = Some(value);
            }
            return Ok(());
        }
        if self.node.is_empty() {
            d.deserialize_ignored_any(IgnoredAny)?;
            return Ok(());
        }
        d.deserialize_any(self)
    }
}

use serde::Deserialize as _;

/// Deeper paths under a value that was kept whole.
fn fill(node: &Node, value: &Value, values: &mut [Option<Value>]) {
    for (key, child) in &node.keys {
        if let Some(v) = value.get(key) {
            if let Some(slot) = child.slot {
                values[slot] = Some(v.clone());
            }
            fill(child, v, values);
        }
    }
    for (index, child) in &node.indexes {
        if let Some(v) = value.get(index) {
            if let Some(slot) = child.slot {
                values[slot] = Some(v.clone());
            }
            fill(child, v, values);
        }
    }
}

/// A member name, borrowed from the body unless it had escapes.
struct Key<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a member name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Visitor<'de> for Seed<'_, '_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            match self.node.child(&key) {
                Some(child) => map.next_value_seed(Seed {
                    node: child,
                    values: &mut *self.values,
                })?,
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let mut i = 0usize;
        loop {
            let child = self
                .node
                .indexes
                .iter()
                .find(|(at, _)| *at == i)
                .map(|(_, n)| n);
            let more = match child {
                Some(child) => seq
                    .next_element_seed(Seed {
                        node: child,
                        values: &mut *self.values,
                    })?
                    .is_some(),
                None => seq.next_element::<IgnoredAny>()?.is_some(),
            };
            if !more {
                return Ok(());
            }
            i += 1;
        }
    }

    // Scalars where an object or array was expected: the paths below are absent.
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn paths(list: &[&[Step]]) -> Paths {
        let mut p = Paths::default();
        for path in list {
            p.add(path);
        }
        p
    }

    fn key(k: &str) -> Step {
        Step::Key(k.to_string())
    }

    #[test]
    fn reads_the_same_values_as_a_full_parse() {
        let body = json!({
            "action": "opened",
            "issue": {"number": 7, "labels": [{"name": "a"}, {"name": "b\"q"}], "big": "x".repeat(4096)},
            "esc\u{e9}aped": "v",
            "payload": {"plainToken": "tok"},
            "n": null,
        });
        let text = serde_json::to_vec(&body).unwrap();
        let wanted: Vec<Vec<Step>> = vec![
            vec![key("action")],
            vec![key("issue"), key("number")],
            vec![key("issue"), key("labels"), Step::Index(1), key("name")],
            vec![key("issue"), key("labels"), Step::Index(5), key("name")],
            vec![key("esc\u{e9}aped")],
            vec![key("payload")],
            vec![key("payload"), key("plainToken")],
            vec![key("n")],
            vec![key("missing"), key("deeper")],
            vec![key("action"), key("not-an-object")],
        ];
        let refs: Vec<&[Step]> = wanted.iter().map(Vec::as_slice).collect();
        let p = paths(&refs);
        let fields = p.read(&text);
        for path in &wanted {
            let full = path.iter().try_fold(&body, |v, s| match s {
                Step::Key(k) => v.get(k),
                Step::Index(i) => v.get(i),
            });
            assert_eq!(fields.get(path), full, "{path:?}");
        }
        assert_eq!(fields.get_dotted("payload.plainToken"), Some(&json!("tok")));
        assert_eq!(fields.get_dotted("payload.plain"), None);
    }

    #[test]
    fn a_body_that_is_not_json_has_no_fields() {
        let p = paths(&[&[key("a")]]);
        for body in [&b"{\"a\": 1,"[..], b"{\"a\": 1} trailing", b"not json", b""] {
            assert_eq!(p.read(body).get(&[key("a")]), None, "{body:?}");
        }
        assert_eq!(p.read(b"{\"a\": 1}").get(&[key("a")]), Some(&json!(1)));
        // An escaped member name is still matched.
        assert_eq!(
            p.read(br#"{"\u0061": "x"}"#).get(&[key("a")]),
            Some(&json!("x"))
        );
    }
}
