//! The embedded store of standalone mode: everything under one data directory.
//!
//! ```text
//! {data_dir}/LOCK                         held (flock) by the one process using the directory
//! {data_dir}/positions.json               positions of every subscription and shard
//! {data_dir}/buses/{bus}/bus.json         the bus's stored configuration (shard count)
//! {data_dir}/buses/{bus}/shard-{n}/{first-seq}.log   log segments
//! ```
//!
//! Events, positions and the catalog are nobody else's business on the host: every file
//! the gateway creates in the data directory is readable by its owner only (0600) and every
//! directory it creates is 0700 ([`create_private`], [`create_private_dirs`]); files and
//! directories of the store left looser by older versions are tightened at start.

mod dedup;
mod files;
mod log;
mod positions;
mod reader;
mod segment;

use std::fs::{self, File};
use std::path::{Path, PathBuf};

pub use dedup::MemoryDedup;
pub(crate) use files::{create_private, create_private_dirs};
pub use log::{EmbeddedLog, LogOptions};
pub use positions::EmbeddedPositions;
/// The record codec, for the fuzz targets (`crate::fuzzing`).
pub(crate) use segment::{encode_record, read_record, HEADER, MAX_RECORD};
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
        create_private_dirs(path)
            .map_err(|e| StoreError::io(&format!("cannot create {}", path.display()), &e))?;
        let lock_path = path.join("LOCK");
        let lock = {
            use std::os::unix::fs::OpenOptionsExt as _;
            File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&lock_path)
        }
        .map_err(|e| StoreError::io(&format!("cannot open {}", lock_path.display()), &e))?;
        lock.try_lock().map_err(|_| {
            StoreError::Unavailable(format!(
                "{} is in use by another sluice process",
                path.display()
            ))
        })?;
        tighten(path);
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
        create_private_dirs(&dir)
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
                create_private(&tmp)
                    .and_then(|mut file| {
                        std::io::Write::write_all(&mut file, &bytes)?;
                        file.sync_all()
                    })
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

/// The gateway's own files at the top of the data directory (besides `buses/`): the catalog,
/// positions, worker id, dedup records, generated admin token and their asides. (Only these
/// are tightened at start: a file target's output there keeps the mode it was given.)
const OWN_FILES: &[&str] = &[
    "LOCK",
    "catalog.json",
    "catalog.json.new",
    "positions.json",
    "positions.json.tmp",
    "groups.json",
    "groups.json.tmp",
    "subscriptions.json",
    "subscriptions.json.tmp",
    "worker-id",
    "webhook-dedup.jsonl",
    "webhook-dedup.jsonl.tmp",
    "admin-token",
];

/// Takes group and other access away from the data directory and the gateway's own files
/// in it (the whole `buses/` tree and the files of [`OWN_FILES`]),
/// which older versions created with the process's umask (often 0644). Files the gateway
/// did not create there (a file target's output) keep their mode. Failures are logged: a
/// file the process may not change is no reason not to start.
fn tighten(data_dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    fn fix(path: &Path, meta: &fs::Metadata) {
        let mode = meta.permissions().mode();
        if mode & 0o077 == 0 {
            return;
        }
        if let Err(e) = fs::set_permissions(path, fs::Permissions::from_mode(mode & !0o077)) {
            tracing::warn!(path = %path.display(), error = %e, "cannot restrict a data file to its owner");
        }
    }
    fn walk(dir: &Path, depth: usize) {
        // buses/{bus}/shard-{n}/{segment}: nothing deeper is the store's.
        let Ok(entries) = fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.file_type().is_symlink() {
                continue;
            }
            fix(&entry.path(), &meta);
            if meta.is_dir() && depth < 3 {
                walk(&entry.path(), depth + 1);
            }
        }
    }
    if let Ok(meta) = data_dir.metadata() {
        fix(data_dir, &meta);
    }
    let Ok(entries) = fs::read_dir(data_dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.file_type().is_symlink() {
            continue;
        }
        if name == "buses" && meta.is_dir() {
            fix(&entry.path(), &meta);
            walk(&entry.path(), 1);
        } else if OWN_FILES.contains(&name.as_ref()) {
            fix(&entry.path(), &meta);
        }
    }
}

/// The shard count the log of `bus` in the data directory `data_dir` was created with, if
/// it has a log there (kept after the bus is deleted from the catalog, with its events and
/// positions). Read without taking the directory's lock: the process holding it asks.
pub fn bus_shards(data_dir: &Path, bus: &str) -> Result<Option<u32>, StoreError> {
    let meta_path = data_dir.join("buses").join(bus).join("bus.json");
    match fs::read(&meta_path) {
        Ok(bytes) => serde_json::from_slice::<BusMeta>(&bytes)
            .map(|meta| Some(meta.shards))
            .map_err(|e| StoreError::Corrupt(format!("{}: {e}", meta_path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::io("cannot read bus.json", &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Durability;

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
        assert_eq!(bus_shards(dir.path(), "orders").unwrap(), Some(4));
        assert_eq!(bus_shards(dir.path(), "other").unwrap(), None);
    }

    fn mode(path: &Path) -> u32 {
        use std::os::unix::fs::PermissionsExt as _;
        fs::symlink_metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn the_data_directory_is_private_and_older_files_are_tightened() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let data_dir = dir.path().join("data");
        // Left by an older version: a readable directory, catalog and segment, and a file
        // target's output, which is not the store's to change.
        fs::create_dir_all(data_dir.join("buses/old/shard-0")).unwrap();
        let loose = fs::Permissions::from_mode(0o644);
        for file in [
            "catalog.json",
            "buses/old/shard-0/00000000000000000000.log",
            "out.jsonl",
        ] {
            fs::write(data_dir.join(file), b"").unwrap();
            fs::set_permissions(data_dir.join(file), loose.clone()).unwrap();
        }
        fs::set_permissions(&data_dir, fs::Permissions::from_mode(0o755)).unwrap();
        let data = DataDir::open(&data_dir).unwrap();
        assert_eq!(mode(&data_dir), 0o700);
        assert_eq!(mode(&data_dir.join("LOCK")), 0o600);
        assert_eq!(mode(&data_dir.join("catalog.json")), 0o600);
        assert_eq!(mode(&data_dir.join("buses/old")), 0o700);
        assert_eq!(
            mode(&data_dir.join("buses/old/shard-0/00000000000000000000.log")),
            0o600
        );
        assert_eq!(mode(&data_dir.join("out.jsonl")), 0o644);

        let options = LogOptions {
            durability: Durability::Os,
            segment_bytes: 1 << 20,
            cache_bytes: 1024,
        };
        drop(data.open_bus("orders", 2, &options).unwrap());
        drop(data.open_positions().unwrap());
        for entry in ["buses/orders", "buses/orders/bus.json"] {
            let m = mode(&data_dir.join(entry));
            assert_eq!(m & 0o077, 0, "{entry} is {m:o}");
        }
        let mut stack = vec![data_dir.join("buses/orders")];
        while let Some(at) = stack.pop() {
            assert_eq!(mode(&at) & 0o077, 0, "{} is {:o}", at.display(), mode(&at));
            if at.is_dir() {
                stack.extend(fs::read_dir(&at).unwrap().map(|e| e.unwrap().path()));
            }
        }
        // An aside left 0644 is made private when it is written again.
        let aside = data_dir.join("positions.json.tmp");
        fs::write(&aside, b"x").unwrap();
        fs::set_permissions(&aside, loose).unwrap();
        drop(create_private(&aside).unwrap());
        assert_eq!(mode(&aside), 0o600);
    }
}
