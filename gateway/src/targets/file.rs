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
        let path = self.path.clone();
        let failed = move |e: std::io::Error| {
            TargetError::retryable(format!("cannot write {}: {e}", path.display()))
        };
        if self.durability == Durability::Os {
            // A page-cache write of one batch: cheaper inline than a hop to a blocking thread.
            let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
            // One write per batch: with O_APPEND it lands whole after any other writer's lines.
            return file.write_all(&lines).map_err(failed);
        }
        let file = self.file.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            file.write_all(&lines)?;
            file.sync_data()
        })
        .await
        .map_err(|e| TargetError::retryable(format!("file task failed: {e}")))?
        .map_err(failed)
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }
}
