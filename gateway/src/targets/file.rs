//! The `file` target: appends one JSON line per event (structured mode) to a file. With
//! durability `fsync` a batch counts as delivered only once the file is flushed to disk.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;

use super::{json_lines, Envelope, Target, TargetError};
use crate::config::Durability;

pub struct FileTarget {
    path: PathBuf,
    file: Arc<Mutex<File>>,
    durability: Durability,
}

impl FileTarget {
    pub fn open(path: &Path, durability: Durability) -> Result<FileTarget, TargetError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent).map_err(|e| {
                TargetError::fatal(format!("cannot create {}: {e}", parent.display()))
            })?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| TargetError::fatal(format!("cannot open {}: {e}", path.display())))?;
        Ok(FileTarget {
            path: path.to_path_buf(),
            file: Arc::new(Mutex::new(file)),
            durability,
        })
    }
}

#[async_trait]
impl Target for FileTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let lines = json_lines(events);
        let file = self.file.clone();
        let sync = self.durability == Durability::Fsync;
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            // One write per batch: with O_APPEND it lands whole after any other writer's lines.
            file.write_all(&lines)?;
            if sync {
                file.sync_data()?;
            }
            Ok::<_, std::io::Error>(())
        })
        .await
        .map_err(|e| TargetError::retryable(format!("file task failed: {e}")))?
        .map_err(|e| TargetError::retryable(format!("cannot write {}: {e}", path.display())))
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }
}
