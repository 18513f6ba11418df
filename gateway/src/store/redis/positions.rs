//! Positions in Redis: `{p}:{S}:pos` (`S` the shard's tag) (a bus shard's subscriptions, committed
//! as differences) and `{p}:{source/{name}}:pos:{broker}` (source connectors), every commit
//! fenced by the task's lease, which shares the positions' hash slot.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use redis::{AsyncCommands as _, Script};

use crate::store::cluster::Lease;
use crate::store::redis::client::{redis_error, Redis};
use crate::store::{GroupPositions, PositionStore, Seq, StoreError};

const COMMIT: &str = include_str!("lua/commit.lua");

/// Commits a bus shard's positions: the changed fields and the removed ones, in one step.
/// ARGV: lease value, number of fields to set, then name/value pairs, then fields to delete.
const COMMIT_GROUP: &str = include_str!("lua/commit_group.lua");

const SHARED_FIELD: &str = "~shared";
const KNOWN_FIELD: &str = "~known";

/// Positions in Redis; every commit is checked against the task's lease (fencing).
pub struct RedisPositions {
    redis: Redis,
    worker: String,
    commit: Script,
    commit_group: Script,
    state: Mutex<PositionState>,
}

#[derive(Default)]
struct PositionState {
    pending: HashMap<(String, u32), Seq>,
    /// The lease (task, epoch) each owned position is committed under.
    owners: HashMap<(String, u32), (String, u64)>,
    /// Bus shards run by this worker, by (bus, shard).
    groups: HashMap<(String, u32), GroupState>,
}

#[derive(Default)]
struct GroupState {
    owner: Option<(String, u64)>,
    /// What Redis holds, as last read or committed: commits send only the difference.
    committed: Option<GroupPositions>,
    latest: Option<GroupPositions>,
    /// Bumped by every `set_group`; `committed_version` is the one Redis holds. A flush
    /// looks only at groups whose versions differ, so an idle shard costs nothing per
    /// subscription (comparing whole groups on every commit tick did).
    version: u64,
    committed_version: u64,
}

impl RedisPositions {
    pub fn new(redis: Redis, worker: &str) -> RedisPositions {
        RedisPositions {
            redis,
            worker: worker.to_string(),
            commit: Script::new(COMMIT),
            commit_group: Script::new(COMMIT_GROUP),
            state: Mutex::new(PositionState::default()),
        }
    }

    fn group_hash(&self, bus: &str, shard: u32) -> String {
        self.redis.shard_key(bus, shard, &["pos"])
    }

    /// Commits every bus shard whose positions moved; returns the fenced tasks.
    async fn flush_groups(&self) -> Result<Vec<String>, StoreError> {
        type Work = (
            (String, u32),
            (String, u64),
            Option<GroupPositions>,
            GroupPositions,
            u64,
        );
        let work: Vec<Work> = {
            let state = self.lock();
            state
                .groups
                .iter()
                .filter_map(|(key, g)| {
                    if g.version == g.committed_version {
                        return None;
                    }
                    let latest = g.latest.as_ref()?;
                    let owner = g.owner.clone()?;
                    Some((
                        key.clone(),
                        owner,
                        g.committed.clone(),
                        latest.clone(),
                        g.version,
                    ))
                })
                .collect()
        };
        let mut fenced = Vec::new();
        for ((bus, shard), (task, epoch), committed, latest, version) in work {
            let (set, del) = group_diff(committed.as_ref(), &latest);
            if set.is_empty() && del.is_empty() {
                if let Some(g) = self.lock().groups.get_mut(&(bus, shard)) {
                    g.committed_version = version;
                }
                continue;
            }
            let mut invocation = self.commit_group.prepare_invoke();
            invocation
                .key(self.redis.task_key(&task, "lease"))
                .key(self.group_hash(&bus, shard))
                .arg(format!("{}|{epoch}", self.worker))
                .arg(set.len());
            for (field, value) in &set {
                invocation.arg(field).arg(value);
            }
            for field in &del {
                invocation.arg(field);
            }
            match invocation
                .invoke_async::<i64>(&mut self.redis.conn())
                .await
                .map_err(|e| redis_error("commit positions", &e))?
            {
                1 => {
                    if let Some(g) = self.lock().groups.get_mut(&(bus, shard)) {
                        g.committed = Some(latest);
                        g.committed_version = version;
                    }
                }
                _ => fenced.push(task),
            }
        }
        Ok(fenced)
    }
}

/// The fields to set and to delete to turn `from` (what Redis holds) into `to`.
fn group_diff(
    from: Option<&GroupPositions>,
    to: &GroupPositions,
) -> (Vec<(String, String)>, Vec<String>) {
    let empty = GroupPositions::default();
    let from = from.unwrap_or(&empty);
    let mut set = Vec::new();
    let mut del = Vec::new();
    if to.shared != from.shared {
        match to.shared {
            Some(seq) => set.push((SHARED_FIELD.to_string(), seq.to_string())),
            None => del.push(SHARED_FIELD.to_string()),
        }
    }
    if to.known != from.known {
        let known: Vec<&str> = to.known.iter().map(String::as_str).collect();
        set.push((KNOWN_FIELD.to_string(), known.join("\n")));
    }
    for (name, seq) in &to.own {
        if from.own.get(name) != Some(seq) {
            set.push((name.clone(), seq.to_string()));
        }
    }
    for name in from.own.keys() {
        if !to.own.contains_key(name) {
            del.push(name.clone());
        }
    }
    (set, del)
}

fn parse_group(fields: HashMap<String, String>) -> Result<GroupPositions, StoreError> {
    let mut group = GroupPositions::default();
    let number = |field: &str, value: &str| {
        value.parse::<Seq>().map_err(|_| {
            StoreError::Corrupt(format!("position `{field}` is not a number: {value}"))
        })
    };
    for (field, value) in fields {
        match field.as_str() {
            SHARED_FIELD => group.shared = Some(number(&field, &value)?),
            KNOWN_FIELD => {
                group.known = Arc::new(
                    value
                        .split('\n')
                        .filter(|s| !s.is_empty())
                        .map(str::to_string)
                        .collect(),
                );
            }
            _ => {
                let seq = number(&field, &value)?;
                group.own.insert(field, seq);
            }
        }
    }
    Ok(group)
}

impl RedisPositions {
    fn lock(&self) -> std::sync::MutexGuard<'_, PositionState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hash(&self, subscription: &str) -> String {
        self.redis.source_key(subscription)
    }
}

#[async_trait]
impl PositionStore for RedisPositions {
    async fn load(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        self.committed(subscription, shard).await
    }

    async fn init(&self, subscription: &str, shard: u32, next: Seq) -> Result<(), StoreError> {
        self.redis
            .conn()
            .hset_nx::<_, _, _, ()>(self.hash(subscription), shard, next)
            .await
            .map_err(|e| redis_error("init position", &e))
    }

    fn set(&self, subscription: &str, shard: u32, next: Seq) {
        self.lock()
            .pending
            .insert((subscription.to_string(), shard), next);
    }

    fn own(&self, subscription: &str, shard: u32, lease: &Lease) {
        self.lock().owners.insert(
            (subscription.to_string(), shard),
            (lease.task.clone(), lease.epoch),
        );
    }

    fn disown(&self, task: &str) {
        let mut state = self.lock();
        let gone: Vec<(String, u32)> = state
            .owners
            .iter()
            .filter(|(_, (t, _))| t == task)
            .map(|(key, _)| key.clone())
            .collect();
        for key in gone {
            state.owners.remove(&key);
            state.pending.remove(&key);
        }
        state
            .groups
            .retain(|_, g| g.owner.as_ref().is_none_or(|(t, _)| t != task));
    }

    async fn peek_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        let fields: HashMap<String, String> = self
            .redis
            .conn()
            .hgetall(self.group_hash(bus, shard))
            .await
            .map_err(|e| redis_error("read positions", &e))?;
        parse_group(fields)
    }

    async fn load_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        let group = self.peek_group(bus, shard).await?;
        let mut state = self.lock();
        let g = state.groups.entry((bus.to_string(), shard)).or_default();
        g.committed = Some(group.clone());
        g.latest = None;
        g.committed_version = g.version;
        Ok(group)
    }

    fn own_group(&self, bus: &str, shard: u32, lease: &Lease) {
        self.lock()
            .groups
            .entry((bus.to_string(), shard))
            .or_default()
            .owner = Some((lease.task.clone(), lease.epoch));
    }

    fn set_group(&self, bus: &str, shard: u32, positions: GroupPositions) {
        let mut state = self.lock();
        let g = state.groups.entry((bus.to_string(), shard)).or_default();
        g.latest = Some(positions);
        g.version += 1;
    }

    fn committed_min(&self, bus: &str, shard: u32) -> Option<Seq> {
        self.lock()
            .groups
            .get(&(bus.to_string(), shard))?
            .committed
            .as_ref()?
            .min()
    }

    fn committed_group(&self, bus: &str, shard: u32) -> Option<GroupPositions> {
        self.lock()
            .groups
            .get(&(bus.to_string(), shard))?
            .committed
            .clone()
    }

    async fn flush(&self) -> Result<Vec<String>, StoreError> {
        let mut fenced = self.flush_groups().await?;
        let batch: Vec<((String, u32), Seq, Option<(String, u64)>)> = {
            let mut state = self.lock();
            let pending = std::mem::take(&mut state.pending);
            pending
                .into_iter()
                .map(|(key, seq)| {
                    let owner = state.owners.get(&key).cloned();
                    (key, seq, owner)
                })
                .collect()
        };
        let mut batch = batch.into_iter();
        while let Some(((sub, shard), seq, owner)) = batch.next() {
            // Progress of a task this worker no longer runs is never committed.
            let Some((task, epoch)) = owner else {
                fenced.push(crate::store::cluster::task_id(&sub, shard));
                continue;
            };
            let result = self
                .commit
                .key(self.redis.task_key(&task, "lease"))
                .key(self.hash(&sub))
                .arg(format!("{}|{epoch}", self.worker))
                .arg(shard)
                .arg(seq)
                .invoke_async::<i64>(&mut self.redis.conn())
                .await;
            match result {
                Ok(1) => {}
                Ok(_) => fenced.push(task),
                Err(e) => {
                    // Keep this one and every one not tried yet for the next flush, unless
                    // a newer position arrived meanwhile: a dropped position would leave
                    // the committed one behind until the shard moves again, and a takeover
                    // would re-send everything since.
                    let mut state = self.lock();
                    state.pending.entry((sub, shard)).or_insert(seq);
                    for (key, seq, _) in batch {
                        state.pending.entry(key).or_insert(seq);
                    }
                    return Err(redis_error("commit position", &e));
                }
            }
        }
        fenced.sort();
        fenced.dedup();
        Ok(fenced)
    }

    async fn committed(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        self.redis
            .conn()
            .hget::<_, _, Option<Seq>>(self.hash(subscription), shard)
            .await
            .map_err(|e| redis_error("read position", &e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_positions_are_committed_as_differences() {
        let from = GroupPositions {
            shared: Some(10),
            own: [("a/t".to_string(), 3), ("b/t".to_string(), 5)]
                .into_iter()
                .collect(),
            known: Arc::new(
                ["a/t", "b/t", "c/t"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect(),
            ),
        };
        let to = GroupPositions {
            shared: Some(20),
            own: [("a/t".to_string(), 3), ("c/t".to_string(), 25)]
                .into_iter()
                .collect(),
            known: from.known.clone(),
        };
        let (set, del) = group_diff(Some(&from), &to);
        assert_eq!(
            set,
            vec![
                ("~shared".to_string(), "20".to_string()),
                ("c/t".to_string(), "25".to_string())
            ]
        );
        assert_eq!(del, vec!["b/t".to_string()]);
        // What Redis then holds reads back as `to`.
        let mut fields: HashMap<String, String> = HashMap::new();
        let (all, _) = group_diff(None, &to);
        fields.extend(all);
        assert_eq!(parse_group(fields).unwrap(), to);
        assert!(parse_group([("~shared".to_string(), "x".to_string())].into()).is_err());
    }
}
