//! The embedded store of standalone mode: everything under one data directory.
//!
//! ```text
//! {data_dir}/LOCK                         held (flock) by the one process using the directory
//! {data_dir}/positions.json               positions of every subscription and shard
//! {data_dir}/buses/{bus}/bus.json         the bus's stored configuration (shard count)
//! {data_dir}/buses/{bus}/shard-{n}/{first-seq}.log   log segments
//! ```

mod log;
mod positions;

use std::fs::{self, File};
use std::path::{Path, PathBuf};

/// The record codec, for the fuzz targets (`crate::fuzzing`).
pub(crate) use log::{encode_record, read_record, HEADER, MAX_RECORD};
pub use log::{EmbeddedLog, LogOptions};
pub use positions::EmbeddedPositions;
use serde::{Deserialize, Serialize};

use crate::store::StoreError;

/// Holds the data directory for this process until dropped.
pub struct DataDir {
    path: PathBuf,
    _lock: File,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct BusMeta {
    shards: u32,
}

impl DataDir {
    /// Creates the directory if needed and takes its lock, so two processes never write the
    /// same logs.
    pub fn open(path: &Path) -> Result<DataDir, StoreError> {
        fs::create_dir_all(path)
            .map_err(|e| StoreError::io(&format!("cannot create {}", path.display()), &e))?;
        let lock_path = path.join("LOCK");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| StoreError::io(&format!("cannot open {}", lock_path.display()), &e))?;
        lock.try_lock().map_err(|_| {
            StoreError::Unavailable(format!(
                "{} is in use by another sluice process",
                path.display()
            ))
        })?;
        Ok(DataDir {
            path: path.to_path_buf(),
            _lock: lock,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens a bus's log. The shard count is stored with the bus the first time; a later
    /// configuration with another count is refused, since it would move keys between shards.
    pub fn open_bus(
        &self,
        bus: &str,
        shards: u32,
        options: &LogOptions,
    ) -> Result<EmbeddedLog, StoreError> {
        let dir = self.path.join("buses").join(bus);
        fs::create_dir_all(&dir)
            .map_err(|e| StoreError::io(&format!("cannot create {}", dir.display()), &e))?;
        let meta_path = dir.join("bus.json");
        match fs::read(&meta_path) {
            Ok(bytes) => {
                let meta: BusMeta = serde_json::from_slice(&bytes)
                    .map_err(|e| StoreError::Corrupt(format!("{}: {e}", meta_path.display())))?;
                if meta.shards != shards {
                    return Err(StoreError::Unavailable(format!(
                        "bus `{bus}` was created with {} shards and the configuration now says {shards}; \
                         changing the shard count of a bus that holds events is not supported",
                        meta.shards
                    )));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let bytes = serde_json::to_vec(&BusMeta { shards })
                    .map_err(|e| StoreError::Unavailable(e.to_string()))?;
                let tmp = dir.join("bus.json.tmp");
                fs::write(&tmp, bytes)
                    .and_then(|_| File::open(&tmp)?.sync_all())
                    .and_then(|_| fs::rename(&tmp, &meta_path))
                    .and_then(|_| File::open(&dir)?.sync_all())
                    .map_err(|e| StoreError::io("cannot write bus.json", &e))?;
            }
            Err(e) => return Err(StoreError::io("cannot read bus.json", &e)),
        }
        EmbeddedLog::open(bus, &dir, shards, options)
    }

    pub fn open_positions(&self) -> Result<EmbeddedPositions, StoreError> {
        EmbeddedPositions::open(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Durability;

    #[test]
    fn second_process_is_refused_and_shard_count_is_fixed() {
        let dir = tempfile::tempdir().unwrap();
        let data = DataDir::open(dir.path()).unwrap();
        assert!(DataDir::open(dir.path()).is_err());
        let options = LogOptions {
            durability: Durability::Os,
            segment_bytes: 1 << 20,
            cache_bytes: 1024,
        };
        drop(data.open_bus("orders", 4, &options).unwrap());
        let err = data.open_bus("orders", 8, &options).err().unwrap();
        assert!(err.to_string().contains("4 shards"), "{err}");
    }
}
