//! All rules of a bus compiled into one matcher.
//!
//! Patterns are broken into alternatives (one per `$or` combination), each a conjunction of
//! field conditions keyed by field path. For every alternative the builder picks one
//! *anchor* condition: the one expected to be satisfied by the fewest events, judged by how
//! many conditions of the whole rule set share its value (a `type` shared by a thousand
//! rules is a poor anchor, a per-rule `orderId` a good one). Only anchors are indexed.
//!
//! At match time a trie of the anchor paths guides a walk over the event, so only fields
//! some anchor looks at are visited. Each leaf found is looked up in its path's tables
//! (hash maps for exact and case-folded values, hash maps probed once per distinct length
//! for prefixes and suffixes, a segment tree for numeric ranges, and a short list of
//! operators that do not index well: wildcard, anything-but, cidr). An alternative whose
//! anchor is satisfied becomes a candidate, and its remaining conditions are checked
//! directly against the event. The work per event therefore grows with the number of
//! fields visited and candidates produced, not with the number of rules. CESQL filters are
//! evaluated one by one.

use std::cell::RefCell;
use std::collections::HashMap;

use cloudevents::Event;
use rustc_hash::FxBuildHasher;

use crate::cesql::CesqlFilter;
use crate::pattern::{conjunction_matches, FieldCondition, Matcher, Pattern, Range, Scalar};
use crate::view::{fold_into, with_pattern_leaves, Attr, EventView, Leaf, NumKey};

type CondId = u32;

/// FxHash (rustc's hasher): much faster than SipHash for the short keys looked up per
/// leaf. Flooding is not a concern: only rule values (configuration) are stored as keys,
/// and a lookup of event data costs one probe sequence whatever its value.
type FastMap<K, V> = HashMap<K, V, FxBuildHasher>;

/// Builds a [`RuleIndex`].
#[derive(Debug, Default, Clone)]
pub struct RuleIndexBuilder {
    alternatives: Vec<(usize, Vec<FieldCondition>)>,
    match_all: Vec<usize>,
    filters: Vec<(usize, CesqlFilter)>,
}

/// Field paths and their tables.
#[derive(Debug, Default)]
struct Paths {
    ids: HashMap<Vec<String>, u32>,
    paths: Vec<Vec<String>>,
    tables: Vec<TableBuilder>,
}

impl Paths {
    fn table(&mut self, path: &[String]) -> (u32, &mut TableBuilder) {
        let id = match self.ids.get(path) {
            Some(id) => *id,
            None => {
                let id = self.paths.len() as u32;
                self.ids.insert(path.to_vec(), id);
                self.paths.push(path.to_vec());
                self.tables.push(TableBuilder::default());
                id
            }
        };
        let idx = id as usize;
        if self.tables.len() <= idx {
            self.tables.resize_with(idx + 1, TableBuilder::default);
        }
        (id, &mut self.tables[idx])
    }
}

#[derive(Debug, Default, Clone)]
struct TableBuilder {
    table: PathTable,
    ranges: Vec<(Range, CondId)>,
}

/// An alternative of a pattern: its anchor condition is indexed; once the anchor fires,
/// the whole conjunction is verified (with array consistency).
#[derive(Debug, Clone)]
struct Alternative {
    rule_id: usize,
    conditions: Vec<FieldCondition>,
    /// One condition of exact values only (`type = ["a", "b"]`, the most common rule):
    /// its anchor's table hit is the condition holding, so it is not evaluated again.
    exact: bool,
}

/// Per-path lookup tables.
#[derive(Debug, Default, Clone)]
struct PathTable {
    exact_str: FastMap<Box<str>, Vec<CondId>>,
    exact_num: FastMap<NumKey, Vec<CondId>>,
    exact_bool: [Vec<CondId>; 2],
    exact_null: Vec<CondId>,
    folded: FastMap<Box<str>, Vec<CondId>>,
    prefix: AffixTable,
    prefix_folded: AffixTable,
    suffix: AffixTable,
    suffix_folded: AffixTable,
    numeric: NumericIndex,
    exists: Vec<CondId>,
    absent: Vec<CondId>,
    other: Vec<(CondId, Matcher)>,
    needs_fold: bool,
}

/// Prefixes (or suffixes) by value, probed once per distinct length.
#[derive(Debug, Default, Clone)]
struct AffixTable {
    by_value: FastMap<Box<str>, Vec<CondId>>,
    lengths: Vec<usize>,
}

impl AffixTable {
    fn insert(&mut self, affix: &str, cond: CondId) {
        self.by_value.entry(affix.into()).or_default().push(cond);
        if let Err(at) = self.lengths.binary_search(&affix.len()) {
            self.lengths.insert(at, affix.len());
        }
    }

    fn lookup_prefixes(&self, s: &str, f: &mut impl FnMut(CondId)) {
        for &len in &self.lengths {
            if len > s.len() {
                break;
            }
            if let Some(conds) = s.get(..len).and_then(|p| self.by_value.get(p)) {
                conds.iter().for_each(|c| f(*c));
            }
        }
    }

    fn lookup_suffixes(&self, s: &str, f: &mut impl FnMut(CondId)) {
        for &len in &self.lengths {
            if len > s.len() {
                break;
            }
            if let Some(conds) = s.get(s.len() - len..).and_then(|p| self.by_value.get(p)) {
                conds.iter().for_each(|c| f(*c));
            }
        }
    }
}

/// Static segment tree over the elementary intervals cut by all range endpoints; a stabbing
/// query walks one root-to-leaf path, O(log n + matches).
#[derive(Debug, Default, Clone)]
struct NumericIndex {
    points: Vec<f64>,
    slots: usize,
    tree: Vec<Vec<CondId>>,
}

impl NumericIndex {
    fn build(ranges: &[(Range, CondId)]) -> NumericIndex {
        if ranges.is_empty() {
            return NumericIndex::default();
        }
        let mut points: Vec<f64> = ranges
            .iter()
            .flat_map(|(r, _)| r.lower.iter().chain(r.upper.iter()).map(|b| b.value))
            .collect();
        points.sort_by(f64::total_cmp);
        points.dedup();
        let slots = 2 * points.len() + 1;
        let mut index = NumericIndex {
            points,
            slots,
            tree: vec![Vec::new(); 4 * slots],
        };
        for (range, cond) in ranges {
            let lo = match &range.lower {
                None => Some(0),
                Some(b) => {
                    index
                        .point(b.value)
                        .map(|i| if b.inclusive { 2 * i + 1 } else { 2 * i + 2 })
                }
            };
            let hi = match &range.upper {
                None => Some(slots - 1),
                Some(b) => index
                    .point(b.value)
                    .map(|i| if b.inclusive { 2 * i + 1 } else { 2 * i }),
            };
            if let (Some(lo), Some(hi)) = (lo, hi) {
                if lo <= hi {
                    index.insert(1, 0, slots - 1, lo, hi, *cond);
                }
            }
        }
        index
    }

    fn point(&self, v: f64) -> Option<usize> {
        self.points.binary_search_by(|p| p.total_cmp(&v)).ok()
    }

    // Recursion depth is log2(slots), at most ~40.
    fn insert(&mut self, node: usize, lo: usize, hi: usize, from: usize, to: usize, c: CondId) {
        if to < lo || hi < from {
            return;
        }
        if from <= lo && hi <= to {
            if let Some(list) = self.tree.get_mut(node) {
                list.push(c);
            }
            return;
        }
        let mid = (lo + hi) / 2;
        self.insert(2 * node, lo, mid, from, to, c);
        self.insert(2 * node + 1, mid + 1, hi, from, to, c);
    }

    fn query(&self, x: f64, f: &mut impl FnMut(CondId)) {
        if self.slots == 0 || x.is_nan() {
            return;
        }
        let i = self.points.partition_point(|p| *p < x);
        let slot = if self.points.get(i) == Some(&x) {
            2 * i + 1
        } else {
            2 * i
        };
        let (mut node, mut lo, mut hi) = (1, 0, self.slots - 1);
        loop {
            if let Some(list) = self.tree.get(node) {
                list.iter().for_each(|c| f(*c));
            }
            if lo == hi {
                break;
            }
            let mid = (lo + hi) / 2;
            if slot <= mid {
                node *= 2;
                hi = mid;
            } else {
                node = 2 * node + 1;
                lo = mid + 1;
            }
        }
    }
}

impl RuleIndexBuilder {
    /// Adds every alternative of a pattern under `rule_id`.
    pub fn add_pattern(&mut self, rule_id: usize, pattern: &Pattern) -> &mut Self {
        for alt in &pattern.alternatives {
            if alt.conditions.is_empty() {
                self.match_all.push(rule_id);
            } else {
                self.alternatives.push((rule_id, alt.conditions.clone()));
            }
        }
        self
    }

    /// Adds a CESQL filter; filters are evaluated one by one.
    pub fn add_filter(&mut self, rule_id: usize, filter: CesqlFilter) -> &mut Self {
        self.filters.push((rule_id, filter));
        self
    }

    /// Adds a rule that matches every event.
    pub fn add_match_all(&mut self, rule_id: usize) -> &mut Self {
        self.match_all.push(rule_id);
        self
    }

    /// Freezes the rules added so far into an index.
    pub fn build(&self) -> RuleIndex {
        // Census: how many conditions share each indexed key.
        let mut census = Paths::default();
        for (_, conds) in &self.alternatives {
            for cond in conds {
                let (_, t) = census.table(&cond.path);
                for m in &cond.matchers {
                    t.register(m, 0);
                }
            }
        }
        let mut paths = Paths::default();
        let mut alternatives = Vec::with_capacity(self.alternatives.len());
        for (alt_id, (rule_id, conds)) in self.alternatives.iter().enumerate() {
            let cost = |c: &FieldCondition| -> usize {
                let t = census
                    .ids
                    .get(&c.path)
                    .and_then(|id| census.tables.get(*id as usize));
                t.map_or(usize::MAX, |t| {
                    c.matchers
                        .iter()
                        .map(|m| t.cost(m))
                        .fold(0, usize::saturating_add)
                })
            };
            let anchor = (0..conds.len()).min_by_key(|i| conds.get(*i).map_or(usize::MAX, cost));
            let Some(anchor) = anchor.and_then(|i| conds.get(i)) else {
                continue;
            };
            let (_, t) = paths.table(&anchor.path);
            for m in &anchor.matchers {
                t.register(m, alt_id as CondId);
            }
            let exact = conds.len() == 1
                && anchor
                    .matchers
                    .iter()
                    .all(|m| matches!(m, Matcher::Exact(_)));
            alternatives.push(Alternative {
                rule_id: *rule_id,
                conditions: conds.clone(),
                exact,
            });
        }

        let mut nodes = vec![Node::default()];
        let mut top: Vec<(Attr, usize)> = Vec::new();
        for (path_id, path) in paths.paths.iter().enumerate() {
            let Some((head, rest)) = path.split_first() else {
                continue;
            };
            let attr = Attr::from_name(head);
            let mut node = match top.iter().find(|(a, _)| *a == attr) {
                Some((_, n)) => *n,
                None => {
                    nodes.push(Node::default());
                    top.push((attr, nodes.len() - 1));
                    nodes.len() - 1
                }
            };
            for key in rest {
                let existing = nodes
                    .get(node)
                    .and_then(|n| n.children.iter().find(|(k, _)| k == key).map(|(_, c)| *c));
                node = match existing {
                    Some(c) => c,
                    None => {
                        nodes.push(Node::default());
                        let child = nodes.len() - 1;
                        if let Some(n) = nodes.get_mut(node) {
                            n.children.push((key.clone(), child));
                        }
                        child
                    }
                };
            }
            if let Some(n) = nodes.get_mut(node) {
                n.path_id = Some(path_id as u32);
            }
        }
        let tables: Vec<PathTable> = paths
            .tables
            .iter()
            .map(|tb| {
                let mut t = tb.table.clone();
                t.numeric = NumericIndex::build(&tb.ranges);
                t
            })
            .collect();
        let absent = tables
            .iter()
            .enumerate()
            .filter(|(_, t)| !t.absent.is_empty())
            .map(|(p, _)| p as u32)
            .collect();
        let mut match_all = self.match_all.clone();
        match_all.sort_unstable();
        match_all.dedup();
        RuleIndex {
            top,
            nodes,
            tables,
            absent,
            alternatives,
            match_all,
            filters: self.filters.clone(),
        }
    }
}

impl TableBuilder {
    /// Rough number of conditions at this path that fire together with `m`: lower is a
    /// better anchor. Operators that tend to fire on most events weigh more.
    fn cost(&self, m: &Matcher) -> usize {
        let t = &self.table;
        let len = |v: Option<&Vec<CondId>>| v.map_or(0, Vec::len);
        match m {
            Matcher::Exact(Scalar::Str(s)) => len(t.exact_str.get(s.as_str())),
            Matcher::Exact(Scalar::Num(k)) => len(t.exact_num.get(k)),
            Matcher::Exact(Scalar::Bool(b)) => t.exact_bool[usize::from(*b)].len(),
            Matcher::Exact(Scalar::Null) => t.exact_null.len(),
            Matcher::Prefix(p) => len(t.prefix.by_value.get(p.as_str())) + 1,
            Matcher::Suffix(p) => len(t.suffix.by_value.get(p.as_str())) + 1,
            Matcher::PrefixIgnoreCase(p) => len(t.prefix_folded.by_value.get(p.as_str())) + 1,
            Matcher::SuffixIgnoreCase(p) => len(t.suffix_folded.by_value.get(p.as_str())) + 1,
            Matcher::EqualsIgnoreCase(v) => len(t.folded.get(v.as_str())),
            Matcher::Numeric(_) => self.ranges.len() + 1,
            Matcher::Exists(true) => 4 * t.exists.len() + 4,
            Matcher::Exists(false) => 8 * t.absent.len() + 8,
            _ => 4 * t.other.len() + 4,
        }
    }

    fn register(&mut self, m: &Matcher, c: CondId) {
        let t = &mut self.table;
        match m {
            Matcher::Exact(Scalar::Str(s)) => {
                t.exact_str.entry(s.as_str().into()).or_default().push(c)
            }
            Matcher::Exact(Scalar::Num(k)) => t.exact_num.entry(*k).or_default().push(c),
            Matcher::Exact(Scalar::Bool(b)) => t.exact_bool[usize::from(*b)].push(c),
            Matcher::Exact(Scalar::Null) => t.exact_null.push(c),
            Matcher::Prefix(p) => t.prefix.insert(p, c),
            Matcher::Suffix(p) => t.suffix.insert(p, c),
            Matcher::PrefixIgnoreCase(p) => {
                t.needs_fold = true;
                t.prefix_folded.insert(p, c)
            }
            Matcher::SuffixIgnoreCase(p) => {
                t.needs_fold = true;
                t.suffix_folded.insert(p, c)
            }
            Matcher::EqualsIgnoreCase(v) => {
                t.needs_fold = true;
                t.folded.entry(v.as_str().into()).or_default().push(c)
            }
            Matcher::Numeric(r) => self.ranges.push((r.clone(), c)),
            Matcher::Exists(true) => t.exists.push(c),
            Matcher::Exists(false) => t.absent.push(c),
            other => t.other.push((c, other.clone())),
        }
    }
}

#[derive(Debug, Default, Clone)]
struct Node {
    path_id: Option<u32>,
    children: Vec<(String, usize)>,
}

/// The compiled matcher over all rules of a bus.
#[derive(Debug, Clone)]
pub struct RuleIndex {
    top: Vec<(Attr, usize)>,
    nodes: Vec<Node>,
    tables: Vec<PathTable>,
    absent: Vec<u32>,
    alternatives: Vec<Alternative>,
    match_all: Vec<usize>,
    filters: Vec<(usize, CesqlFilter)>,
}

#[derive(Default)]
struct Scratch {
    epoch: u32,
    alt: Vec<u32>,
    path: Vec<u32>,
    /// Reused buffer for case-folded values.
    fold: String,
}

impl Scratch {
    fn begin(&mut self, alts: usize, paths: usize) {
        self.epoch = self.epoch.wrapping_add(1);
        if self.epoch == 0 {
            self.alt.fill(0);
            self.path.fill(0);
            self.epoch = 1;
        }
        if self.alt.len() < alts {
            self.alt.resize(alts, 0);
        }
        if self.path.len() < paths {
            self.path.resize(paths, 0);
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

struct Run<'i, 's, 'v, 'e> {
    index: &'i RuleIndex,
    scratch: &'s mut Scratch,
    out: &'s mut Vec<usize>,
    view: &'v EventView<'e>,
}

impl Run<'_, '_, '_, '_> {
    /// The anchor of alternative `a` is satisfied: verify the rest once per event.
    fn satisfy(&mut self, a: CondId) {
        let epoch = self.scratch.epoch;
        let Some(stamp) = self.scratch.alt.get_mut(a as usize) else {
            return;
        };
        if *stamp == epoch {
            return;
        }
        *stamp = epoch;
        if let Some(alt) = self.index.alternatives.get(a as usize) {
            if alt.exact || conjunction_matches(&alt.conditions, self.view) {
                self.out.push(alt.rule_id);
            }
        }
    }

    fn leaf(&mut self, path_id: u32, leaf: Leaf<'_>) {
        let index = self.index;
        let Some(t) = index.tables.get(path_id as usize) else {
            return;
        };
        let epoch = self.scratch.epoch;
        if let Some(seen) = self.scratch.path.get_mut(path_id as usize) {
            if *seen != epoch {
                *seen = epoch;
                t.exists.iter().for_each(|c| self.satisfy(*c));
            }
        }
        let mut folded = std::mem::take(&mut self.scratch.fold);
        let mut hit = |c: CondId| self.satisfy(c);
        match leaf {
            Leaf::Str(s) => {
                if let Some(cs) = t.exact_str.get(s) {
                    cs.iter().for_each(|c| hit(*c));
                }
                t.prefix.lookup_prefixes(s, &mut hit);
                t.suffix.lookup_suffixes(s, &mut hit);
                if t.needs_fold {
                    fold_into(&mut folded, s);
                    if let Some(cs) = t.folded.get(folded.as_str()) {
                        cs.iter().for_each(|c| hit(*c));
                    }
                    t.prefix_folded.lookup_prefixes(&folded, &mut hit);
                    t.suffix_folded.lookup_suffixes(&folded, &mut hit);
                }
            }
            Leaf::Num(n) => {
                if let Some(cs) = t.exact_num.get(&n.key) {
                    cs.iter().for_each(|c| hit(*c));
                }
                t.numeric.query(n.f, &mut hit);
            }
            Leaf::Bool(b) => t.exact_bool[usize::from(b)].iter().for_each(|c| hit(*c)),
            Leaf::Null => t.exact_null.iter().for_each(|c| hit(*c)),
        }
        for (c, m) in &t.other {
            if m.test(leaf) {
                hit(*c);
            }
        }
        self.scratch.fold = folded;
    }

    fn walk(&mut self, view: &EventView<'_>) {
        let index = self.index;
        for (attr, node) in &index.top {
            let Some(n) = index.nodes.get(*node) else {
                continue;
            };
            if *attr == Attr::Data {
                if let Some(data) = view.data() {
                    self.walk_json(data, *node, 0);
                }
            } else if let Some(p) = n.path_id {
                with_pattern_leaves(view.event, attr, &mut |leaf| self.leaf(p, leaf));
            }
        }
    }

    /// Recursive while shallow (no allocation); hands deeper subtrees to the iterative walk
    /// so hostile nesting cannot overflow the stack.
    fn walk_json(&mut self, v: &serde_json::Value, node: usize, depth: usize) {
        use serde_json::Value;
        if depth > 48 {
            return self.walk_json_iter(v, node);
        }
        let index = self.index;
        let Some(n) = index.nodes.get(node) else {
            return;
        };
        match v {
            Value::Array(items) => {
                for i in items {
                    self.walk_json(i, node, depth + 1);
                }
            }
            Value::Object(map) => {
                for (key, child) in &n.children {
                    if let Some(cv) = map.get(key) {
                        self.walk_json(cv, *child, depth + 1);
                    }
                }
            }
            scalar => {
                if let (Some(p), Some(leaf)) = (n.path_id, Leaf::from_json(scalar)) {
                    self.leaf(p, leaf);
                }
            }
        }
    }

    fn walk_json_iter(&mut self, root: &serde_json::Value, node: usize) {
        use serde_json::Value;
        let index = self.index;
        let mut stack = vec![(root, node)];
        while let Some((v, node)) = stack.pop() {
            let Some(n) = index.nodes.get(node) else {
                continue;
            };
            match v {
                Value::Array(items) => stack.extend(items.iter().map(|i| (i, node))),
                Value::Object(map) => {
                    for (key, child) in &n.children {
                        if let Some(cv) = map.get(key) {
                            stack.push((cv, *child));
                        }
                    }
                }
                scalar => {
                    if let (Some(p), Some(leaf)) = (n.path_id, Leaf::from_json(scalar)) {
                        self.leaf(p, leaf);
                    }
                }
            }
        }
    }
}

impl RuleIndex {
    /// Starts an empty builder.
    pub fn builder() -> RuleIndexBuilder {
        RuleIndexBuilder::default()
    }

    /// True when no rule was added.
    pub fn is_empty(&self) -> bool {
        self.alternatives.is_empty() && self.match_all.is_empty() && self.filters.is_empty()
    }

    /// Clears `out` and fills it with the ids of the rules the event matches, sorted and
    /// deduplicated.
    pub fn matches(&self, event: &Event, out: &mut Vec<usize>) {
        out.clear();
        out.extend_from_slice(&self.match_all);
        if !self.alternatives.is_empty() {
            let view = EventView::new(event);
            SCRATCH.with(|cell| match cell.try_borrow_mut() {
                Ok(mut scratch) => self.run(&view, &mut scratch, out),
                Err(_) => self.run(&view, &mut Scratch::default(), out),
            });
        }
        for (rule_id, filter) in &self.filters {
            if filter.matches(event) {
                out.push(*rule_id);
            }
        }
        out.sort_unstable();
        out.dedup();
    }

    fn run(&self, view: &EventView<'_>, scratch: &mut Scratch, out: &mut Vec<usize>) {
        scratch.begin(self.alternatives.len(), self.tables.len());
        let mut run = Run {
            index: self,
            scratch,
            out,
            view,
        };
        run.walk(view);
        for p in &self.absent {
            let seen = run.scratch.path.get(*p as usize).copied() == Some(run.scratch.epoch);
            if !seen {
                if let Some(t) = self.tables.get(*p as usize) {
                    t.absent.iter().for_each(|c| run.satisfy(*c));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn similar_keys_start_their_probes_in_different_buckets() {
        // hashbrown picks the bucket from the low bits of the hash: 10,000 keys that differ
        // only past their first bytes must spread over a 16,384-bucket table about as
        // random hashes would (~7,500 distinct buckets), not crowd into a few hundred.
        let buckets: std::collections::HashSet<u64> = (0..10_000)
            .map(|i| FxBuildHasher.hash_one(format!("t{i}").as_str()) & 0x3fff)
            .collect();
        assert!(buckets.len() > 6_000, "only {} buckets", buckets.len());
    }
}
