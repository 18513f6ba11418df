//! Task allocation strategies. Pure functions of (members, tasks): every worker computes the
//! same assignment from the same inputs and starts only its own part, as in RocketMQ
//! Connect's allocation strategies.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::values::stable_hash;

/// How tasks are spread over workers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Strategy {
    /// Sort the worker ids and give each task to `workers[hash(task) % n]`. Even, but a
    /// membership change moves most tasks.
    #[default]
    SortedHash,
    /// A hash ring with virtual nodes: a membership change moves only about 1/n of the tasks.
    ConsistentHash,
}

impl Strategy {
    /// The name the configuration uses.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::SortedHash => "sorted-hash",
            Strategy::ConsistentHash => "consistent-hash",
        }
    }
}

crate::values::from_names!(
    Strategy,
    "rebalance strategy",
    "sorted-hash" => Strategy::SortedHash,
    "consistent-hash" => Strategy::ConsistentHash,
);

/// Virtual nodes per worker on the consistent-hash ring.
const VIRTUAL_NODES: u32 = 160;

/// The owner of each task. `members` need not be sorted or unique; no members, no owners.
pub fn assign<'a>(
    strategy: Strategy,
    members: &[String],
    tasks: &'a [String],
) -> BTreeMap<&'a str, String> {
    let mut sorted: Vec<&String> = members.iter().collect();
    sorted.sort();
    sorted.dedup();
    let mut out = BTreeMap::new();
    if sorted.is_empty() {
        return out;
    }
    match strategy {
        Strategy::SortedHash => {
            for task in tasks {
                let i = (stable_hash(task.as_bytes()) % sorted.len() as u64) as usize;
                out.insert(task.as_str(), sorted[i].clone());
            }
        }
        Strategy::ConsistentHash => {
            let mut ring: Vec<(u64, &String)> =
                Vec::with_capacity(sorted.len() * VIRTUAL_NODES as usize);
            for member in &sorted {
                for v in 0..VIRTUAL_NODES {
                    ring.push((stable_hash(format!("{member}#{v}").as_bytes()), member));
                }
            }
            ring.sort();
            for task in tasks {
                let h = stable_hash(task.as_bytes());
                let i = ring.partition_point(|(point, _)| *point < h);
                let (_, owner) = ring[i % ring.len()];
                out.insert(task.as_str(), owner.clone());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workers(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("worker-{i}")).collect()
    }

    fn tasks(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("orders/rule-{}/target#{}", i / 8, i % 8))
            .collect()
    }

    fn moved(a: &BTreeMap<&str, String>, b: &BTreeMap<&str, String>) -> usize {
        a.iter().filter(|(t, w)| b.get(*t) != Some(w)).count()
    }

    #[test]
    fn every_worker_computes_the_same_assignment() {
        let t = tasks(64);
        let mut shuffled = workers(3);
        shuffled.reverse();
        for s in [Strategy::SortedHash, Strategy::ConsistentHash] {
            assert_eq!(assign(s, &workers(3), &t), assign(s, &shuffled, &t));
            assert_eq!(assign(s, &workers(3), &t).len(), 64);
            assert!(assign(s, &[], &t).is_empty());
        }
    }

    #[test]
    fn sorted_hash_spreads_evenly() {
        let t = tasks(3000);
        let a = assign(Strategy::SortedHash, &workers(3), &t);
        for w in workers(3) {
            let n = a.values().filter(|o| **o == w).count();
            assert!((800..1200).contains(&n), "{w}: {n}");
        }
    }

    #[test]
    fn consistent_hash_moves_about_one_in_n_plus_one() {
        let t = tasks(4000);
        for n in [2usize, 3, 5, 8] {
            let before = assign(Strategy::ConsistentHash, &workers(n), &t);
            let after = assign(Strategy::ConsistentHash, &workers(n + 1), &t);
            let fraction = moved(&before, &after) as f64 / t.len() as f64;
            let ideal = 1.0 / (n as f64 + 1.0);
            assert!(
                (fraction - ideal).abs() < ideal * 0.35,
                "n={n}: moved {fraction:.3}, ideal {ideal:.3}"
            );
            // Only tasks that go to the new worker move.
            assert!(before
                .iter()
                .filter(|(task, w)| after.get(*task) != Some(w))
                .all(|(task, _)| after[task] == format!("worker-{n}")));
            // And the load stays reasonably even.
            for w in workers(n + 1) {
                let share = after.values().filter(|o| **o == w).count() as f64 / t.len() as f64;
                assert!(
                    share > ideal * 0.6 && share < ideal * 1.4,
                    "n={n} {w}: {share:.3}"
                );
            }
        }
    }

    #[test]
    fn sorted_hash_moves_more_than_consistent_hash() {
        let t = tasks(4000);
        let sorted = moved(
            &assign(Strategy::SortedHash, &workers(4), &t),
            &assign(Strategy::SortedHash, &workers(5), &t),
        );
        let ring = moved(
            &assign(Strategy::ConsistentHash, &workers(4), &t),
            &assign(Strategy::ConsistentHash, &workers(5), &t),
        );
        assert!(
            sorted > ring * 2,
            "sorted-hash {sorted}, consistent-hash {ring}"
        );
    }
}
