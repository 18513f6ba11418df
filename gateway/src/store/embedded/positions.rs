//! Positions on local disk: one JSON file, replaced atomically (write, fsync, rename, fsync
//! the directory) on each flush. Tasks record progress in memory as they deliver; the runtime
//! flushes on a short interval and at shutdown, so positions commit in batches.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;

use crate::runtime::cluster::Lease;
use crate::store::{PositionStore, Seq, StoreError};

type Map = BTreeMap<String, BTreeMap<u32, Seq>>;

#[derive(Default)]
struct State {
    current: Map,
    durable: Map,
    /// Bumped by every `set`; a flush that saw generation N leaves `dirty` only if it moved on.
    generation: u64,
    flushed_generation: u64,
}

pub struct EmbeddedPositions {
    path: PathBuf,
    state: Mutex<State>,
    /// Serialises flushes so an older snapshot never overwrites a newer one.
    flush_lock: tokio::sync::Mutex<()>,
}

impl EmbeddedPositions {
    pub fn open(data_dir: &Path) -> Result<EmbeddedPositions, StoreError> {
        let path = data_dir.join("positions.json");
        let current = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                StoreError::Corrupt(format!("{} is not a positions file: {e}", path.display()))
            })?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Map::new(),
            Err(e) => {
                return Err(StoreError::io(
                    &format!("cannot read {}", path.display()),
                    &e,
                ))
            }
        };
        Ok(EmbeddedPositions {
            path,
            state: Mutex::new(State {
                durable: current.clone(),
                current,
                ..State::default()
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
        let shards = state.current.entry(subscription.to_string()).or_default();
        if shards.insert(shard, next) != Some(next) {
            state.generation += 1;
        }
    }

    /// One process owns the data directory (its lock), so there is nothing to fence.
    fn own(&self, _subscription: &str, _shard: u32, _lease: &Lease) {}

    fn disown(&self, _task: &str) {}

    async fn flush(&self) -> Result<Vec<String>, StoreError> {
        let _guard = self.flush_lock.lock().await;
        let (snapshot, generation) = {
            let state = self.lock();
            if state.generation == state.flushed_generation {
                return Ok(Vec::new());
            }
            (state.current.clone(), state.generation)
        };
        let path = self.path.clone();
        let snapshot = tokio::task::spawn_blocking(move || {
            write_atomically(&path, &snapshot).map(|()| snapshot)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("position flush task failed: {e}")))??;
        let mut state = self.lock();
        state.flushed_generation = generation;
        state.durable = snapshot;
        Ok(Vec::new())
    }

    async fn committed(&self, subscription: &str, shard: u32) -> Result<Option<Seq>, StoreError> {
        Ok(self
            .lock()
            .durable
            .get(subscription)
            .and_then(|s| s.get(&shard))
            .copied())
    }
}

fn write_atomically(path: &Path, map: &Map) -> Result<(), StoreError> {
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(map)
        .map_err(|e| StoreError::Unavailable(format!("cannot encode positions: {e}")))?;
    let io = |e: std::io::Error| StoreError::io(&format!("cannot write {}", path.display()), &e);
    let mut file = File::create(&tmp).map_err(io)?;
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
