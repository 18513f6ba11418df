//! Positions on local disk: JSON files, each replaced atomically (write, fsync, rename, fsync
//! the directory) on a flush that changed it. Tasks record progress in memory as they
//! deliver; the runtime flushes on a short interval and at shutdown, so positions commit in
//! batches.
//!
//! ```text
//! positions.json       source positions: key -> queue -> next offset
//! groups.json          bus shards: "{bus}#{shard}" -> { shared, own: subscription -> seq }
//! subscriptions.json   bus shards: "{bus}#{shard}" -> subscriptions with a position there
//! ```
//!
//! The subscription lists change only when rules do, so they live apart from the
//! positions that move with every delivery.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use crate::store::cluster::Lease;
use crate::store::embedded::files::create_private;
use crate::store::{GroupPositions, PositionStore, Seq, StoreError};
use serde::{Deserialize, Serialize};

type Map = BTreeMap<String, BTreeMap<u32, Seq>>;

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct StoredGroup {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shared: Option<Seq>,
    #[serde(default)]
    own: BTreeMap<String, Seq>,
}

type Groups = BTreeMap<String, StoredGroup>;
type Known = BTreeMap<String, Arc<BTreeSet<String>>>;

/// One file's content now and as last written, with change generations so a flush writes
/// only what moved and never lets an older snapshot overwrite a newer one.
struct Tracked<T> {
    current: T,
    durable: T,
    /// Bumped by every change; a flush that saw generation N marks N written.
    generation: u64,
    flushed_generation: u64,
}

impl<T: Clone> Tracked<T> {
    fn new(value: T) -> Self {
        Tracked {
            durable: value.clone(),
            current: value,
            generation: 0,
            flushed_generation: 0,
        }
    }

    /// A snapshot to write, if anything changed since the last flush.
    fn pending(&self) -> Option<(T, u64)> {
        (self.generation != self.flushed_generation)
            .then(|| (self.current.clone(), self.generation))
    }

    fn written(&mut self, snapshot: T, generation: u64) {
        self.flushed_generation = generation;
        self.durable = snapshot;
    }
}

struct State {
    positions: Tracked<Map>,
    groups: Tracked<Groups>,
    known: Tracked<Known>,
}

pub struct EmbeddedPositions {
    dir: PathBuf,
    state: Mutex<State>,
    /// Serialises flushes so an older snapshot never overwrites a newer one.
    flush_lock: tokio::sync::Mutex<()>,
}

impl EmbeddedPositions {
    pub fn open(data_dir: &Path) -> Result<EmbeddedPositions, StoreError> {
        Ok(EmbeddedPositions {
            dir: data_dir.to_path_buf(),
            state: Mutex::new(State {
                positions: Tracked::new(read_json(&data_dir.join(POSITIONS))?),
                groups: Tracked::new(read_json(&data_dir.join(GROUPS))?),
                known: Tracked::new(read_json(&data_dir.join(KNOWN))?),
            }),
            flush_lock: tokio::sync::Mutex::new(()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the map half-updated (single inserts),
        // so a poisoned lock is still safe to use.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl EmbeddedPositions {
    fn latest(&self, subscription: &str, shard: u32) -> Option<Seq> {
        self.lock()
            .positions
            .current
            .get(subscription)
            .and_then(|s| s.get(&shard))
            .copied()
    }
}

#[async_trait]
impl PositionStore for EmbeddedPositions {
    async fn load(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        Ok(self.latest(subscription, shard))
    }

    async fn init(&self, subscription: &str, shard: u32, next: Seq) -> Result<(), StoreError> {
        if self.latest(subscription, shard).is_none() {
            self.set(subscription, shard, next);
            self.flush().await?;
        }
        Ok(())
    }

    fn set(&self, subscription: &str, shard: u32, next: Seq) {
        let mut state = self.lock();
        let positions = &mut state.positions;
        let shards = positions
            .current
            .entry(subscription.to_string())
            .or_default();
        if shards.insert(shard, next) != Some(next) {
            positions.generation += 1;
        }
    }

    /// One process owns the data directory (its lock), so there is nothing to fence.
    fn own(&self, _subscription: &str, _shard: u32, _lease: &Lease) {}

    fn disown(&self, _task: &str) {}

    async fn flush(&self) -> Result<Vec<String>, StoreError> {
        let _guard = self.flush_lock.lock().await;
        let (positions, groups, known) = {
            let state = self.lock();
            (
                state.positions.pending(),
                state.groups.pending(),
                state.known.pending(),
            )
        };
        // Subscription lists first: a group position of a subscription is only read once the
        // subscription is known, and a known subscription without a group entry is at `shared`.
        if let Some((snapshot, generation)) = known {
            let snapshot = self.write(KNOWN, snapshot).await?;
            self.lock().known.written(snapshot, generation);
        }
        if let Some((snapshot, generation)) = groups {
            let snapshot = self.write(GROUPS, snapshot).await?;
            self.lock().groups.written(snapshot, generation);
        }
        if let Some((snapshot, generation)) = positions {
            let snapshot = self.write(POSITIONS, snapshot).await?;
            self.lock().positions.written(snapshot, generation);
        }
        Ok(Vec::new())
    }

    async fn committed(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        Ok(self
            .lock()
            .positions
            .durable
            .get(subscription)
            .and_then(|s| s.get(&shard))
            .copied())
    }

    async fn load_group(&self, bus: &str, shard: u32) -> Result<GroupPositions, StoreError> {
        let key = group_key(bus, shard);
        let state = self.lock();
        let group = state.groups.current.get(&key).cloned().unwrap_or_default();
        Ok(GroupPositions {
            shared: group.shared,
            own: group.own,
            known: state.known.current.get(&key).cloned().unwrap_or_default(),
        })
    }

    fn own_group(&self, _bus: &str, _shard: u32, _lease: &Lease) {}

    fn set_group(&self, bus: &str, shard: u32, positions: GroupPositions) {
        let key = group_key(bus, shard);
        let mut state = self.lock();
        let group = StoredGroup {
            shared: positions.shared,
            own: positions.own,
        };
        if state.groups.current.get(&key) != Some(&group) {
            state.groups.current.insert(key.clone(), group);
            state.groups.generation += 1;
        }
        if state.known.current.get(&key) != Some(&positions.known) {
            state.known.current.insert(key, positions.known);
            state.known.generation += 1;
        }
    }

    fn committed_min(&self, bus: &str, shard: u32) -> Option<Seq> {
        let key = group_key(bus, shard);
        let state = self.lock();
        let group = state.groups.durable.get(&key)?;
        let own = group.own.values().copied().min();
        match (group.shared, own) {
            (Some(s), Some(o)) => Some(s.min(o)),
            (s, o) => s.or(o),
        }
    }

    fn committed_group(&self, bus: &str, shard: u32) -> Option<GroupPositions> {
        let key = group_key(bus, shard);
        let state = self.lock();
        let group = state.groups.durable.get(&key)?.clone();
        Some(GroupPositions {
            shared: group.shared,
            own: group.own,
            known: state.known.durable.get(&key).cloned().unwrap_or_default(),
        })
    }
}

const POSITIONS: &str = "positions.json";
const GROUPS: &str = "groups.json";
const KNOWN: &str = "subscriptions.json";

fn group_key(bus: &str, shard: u32) -> String {
    format!("{bus}#{shard}")
}

impl EmbeddedPositions {
    async fn write<T: Serialize + Send + 'static>(
        &self,
        name: &str,
        snapshot: T,
    ) -> Result<T, StoreError> {
        let path = self.dir.join(name);
        tokio::task::spawn_blocking(move || write_atomically(&path, &snapshot).map(|()| snapshot))
            .await
            .map_err(|e| StoreError::Unavailable(format!("position flush task failed: {e}")))?
    }
}

fn read_json<T: Default + serde::de::DeserializeOwned>(path: &Path) -> Result<T, StoreError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
            StoreError::Corrupt(format!("{} is not a positions file: {e}", path.display()))
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(StoreError::io(
            &format!("cannot read {}", path.display()),
            &e,
        )),
    }
}

fn write_atomically<T: Serialize>(path: &Path, value: &T) -> Result<(), StoreError> {
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec(value)
        .map_err(|e| StoreError::Unavailable(format!("cannot encode positions: {e}")))?;
    let io = |e: std::io::Error| StoreError::io(&format!("cannot write {}", path.display()), &e);
    let mut file = create_private(&tmp).map_err(io)?;
    file.write_all(&bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    fs::rename(&tmp, path).map_err(io)?;
    if let Some(dir) = path.parent() {
        File::open(dir).and_then(|d| d.sync_all()).map_err(io)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shard_positions_survive_reopen_and_only_changed_files_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let p = EmbeddedPositions::open(dir.path()).unwrap();
        assert_eq!(
            p.load_group("b", 0).await.unwrap(),
            GroupPositions::default()
        );
        let group = GroupPositions {
            shared: Some(40),
            own: [("slow/t".to_string(), 12)].into_iter().collect(),
            known: Arc::new(["fast/t", "slow/t"].iter().map(|s| s.to_string()).collect()),
        };
        p.set_group("b", 0, group.clone());
        assert_eq!(p.committed_group("b", 0), None, "not before a flush");
        p.flush().await.unwrap();
        assert_eq!(p.committed_group("b", 0), Some(group.clone()));
        assert_eq!(group.of("fast/t"), Some(40));
        assert_eq!(group.of("slow/t"), Some(12));
        assert_eq!(group.of("new/t"), None);
        assert_eq!(group.min(), Some(12));
        // Moving positions rewrites groups.json only; the subscription list stays as written.
        let known = std::fs::metadata(dir.path().join(KNOWN))
            .unwrap()
            .modified()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let moved = GroupPositions {
            shared: Some(50),
            own: BTreeMap::new(),
            ..group.clone()
        };
        p.set_group("b", 0, moved.clone());
        p.flush().await.unwrap();
        let after = std::fs::metadata(dir.path().join(KNOWN))
            .unwrap()
            .modified()
            .unwrap();
        assert_eq!(known, after);
        let reopened = EmbeddedPositions::open(dir.path()).unwrap();
        assert_eq!(reopened.load_group("b", 0).await.unwrap(), moved);
        assert_eq!(
            reopened.load_group("b", 1).await.unwrap(),
            GroupPositions::default()
        );
    }

    #[tokio::test]
    async fn positions_survive_reopen_only_after_flush() {
        let dir = tempfile::tempdir().unwrap();
        let p = EmbeddedPositions::open(dir.path()).unwrap();
        assert_eq!(p.load("r/t", 0).await.unwrap(), None);
        p.set("r/t", 0, 5);
        p.set("r/t", 1, 7);
        assert_eq!(p.load("r/t", 0).await.unwrap(), Some(5));
        let fresh = EmbeddedPositions::open(dir.path()).unwrap();
        assert_eq!(fresh.load("r/t", 0).await.unwrap(), None);
        p.flush().await.unwrap();
        p.set("r/t", 0, 9);
        assert_eq!(p.committed("r/t", 0).await.unwrap(), Some(5));
        assert_eq!(p.load("r/t", 0).await.unwrap(), Some(9));
        let reopened = EmbeddedPositions::open(dir.path()).unwrap();
        assert_eq!(reopened.load("r/t", 0).await.unwrap(), Some(5));
        assert_eq!(reopened.load("r/t", 1).await.unwrap(), Some(7));
        // init never overwrites a position.
        reopened.init("r/t", 0, 100).await.unwrap();
        reopened.init("r/x", 0, 100).await.unwrap();
        assert_eq!(reopened.committed("r/t", 0).await.unwrap(), Some(5));
        assert_eq!(reopened.committed("r/x", 0).await.unwrap(), Some(100));
    }
}
