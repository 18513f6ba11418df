//! Matching a conjunction of field conditions against an event, with EventBridge's
//! array-consistent semantics: leaves taken from inside arrays of objects must come from
//! the same array element for every condition that looks there.

use super::matcher::{FieldCondition, Matcher};
use crate::view::{compatible, Attr, EventView};

impl FieldCondition {
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
