//! The `file` target: appends one JSON line per event (structured mode) to a file. With
//! durability `fsync` a batch counts as delivered only once the file is flushed to disk.
//! Targets writing to one path share one open file: ten thousand rules writing to one file
//! hold one descriptor, not ten thousand.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex, Weak};

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
        Ok(FileTarget {
            path: path.to_path_buf(),
            file: shared_file(path)?,
            durability,
        })
    }
}

/// The files open for targets, by path; an entry goes once its last target is dropped.
struct OpenFiles {
    files: HashMap<PathBuf, Weak<Mutex<File>>>,
    /// The map's size at which entries of dropped targets are swept out next.
    sweep_at: usize,
}

static OPEN_FILES: LazyLock<Mutex<OpenFiles>> = LazyLock::new(|| {
    Mutex::new(OpenFiles {
        files: HashMap::new(),
        sweep_at: 64,
    })
});

/// Ends a last line left without its newline: a process killed in the middle of a write
/// (SIGKILL stops a write of several pages part way) leaves a partial line, and the next
/// line appended would be glued to it and lost to a reader of the file with it.
fn end_last_line(path: &Path, file: &mut File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let meta = file.metadata()?;
    if !meta.is_file() || meta.len() == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    file.seek(SeekFrom::End(-1))?;
    file.read_exact(&mut last)?;
    if last[0] != b'\n' {
        tracing::warn!(path = %path.display(), "the file's last line was cut short (a crash in the middle of a write); it is ended so the next line stands on its own");
        file.write_all(b"\n")?;
    }
    Ok(())
}

/// The file at `path`, opened for appending, shared with the other targets writing to it.
/// Each write is one whole batch on an `O_APPEND` descriptor, so sharing changes nothing a
/// reader of the file can see.
fn shared_file(path: &Path) -> Result<Arc<Mutex<File>>, TargetError> {
    let mut open = OPEN_FILES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(file) = open.files.get(path).and_then(Weak::upgrade) {
        return Ok(file);
    }
    let cannot =
        |e: std::io::Error| TargetError::fatal(format!("cannot open {}: {e}", path.display()));
    let mut options = OpenOptions::new();
    options.create(true).append(true);
    let file = match options.clone().read(true).open(path) {
        Ok(mut file) => {
            end_last_line(path, &mut file).map_err(cannot)?;
            file
        }
        // Write-only (a pipe or a file it may not read): appended to as it is.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            options.open(path).map_err(cannot)?
        }
        Err(e) => return Err(cannot(e)),
    };
    let file = Arc::new(Mutex::new(file));
    open.files.insert(path.to_path_buf(), Arc::downgrade(&file));
    if open.files.len() >= open.sweep_at {
        open.files.retain(|_, f| f.strong_count() > 0);
        open.sweep_at = (open.files.len() * 2).max(64);
    }
    Ok(file)
}

#[async_trait]
impl Target for FileTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let lines = json_lines(events);
        let failed = |path: &Path, e: std::io::Error| {
            TargetError::retryable(format!("cannot write {}: {e}", path.display()))
        };
        if self.durability == Durability::Os {
            // A page-cache write of one batch: cheaper inline than a hop to a blocking thread.
            let mut file = self.file.lock().unwrap_or_else(|p| p.into_inner());
            // One write per batch: with O_APPEND it lands whole after any other writer's lines.
            return file.write_all(&lines).map_err(|e| failed(&self.path, e));
        }
        let file = self.file.clone();
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || {
            let mut file = file.lock().unwrap_or_else(|p| p.into_inner());
            file.write_all(&lines)?;
            file.sync_data()
        })
        .await
        .map_err(|e| TargetError::retryable(format!("file task failed: {e}")))?
        .map_err(|e| failed(&path, e))
    }

    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn envelope(line: &str) -> Envelope {
        Envelope {
            raw: Bytes::from(line.to_string()),
            accepted_ms: 0,
            event: None,
            body: None,
        }
    }

    #[tokio::test]
    async fn targets_on_one_path_share_one_open_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let other = dir.path().join("other.jsonl");
        let a = FileTarget::open(&path, Durability::Os).unwrap();
        let b = FileTarget::open(&path, Durability::Fsync).unwrap();
        let c = FileTarget::open(&other, Durability::Os).unwrap();
        assert!(Arc::ptr_eq(&a.file, &b.file));
        assert!(!Arc::ptr_eq(&a.file, &c.file));
        a.deliver(&[envelope("{\"n\":1}")]).await.unwrap();
        b.deliver(&[envelope("{\"n\":2}"), envelope("{\"n\":3}")])
            .await
            .unwrap();
        c.deliver(&[envelope("{\"n\":4}")]).await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text, "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n");
        assert_eq!(std::fs::read_to_string(&other).unwrap(), "{\"n\":4}\n");
        // Once every target of a path is gone the file is closed; a new target opens it again.
        let weak = Arc::downgrade(&a.file);
        drop((a, b));
        assert!(weak.upgrade().is_none());
        let d = FileTarget::open(&path, Durability::Os).unwrap();
        d.deliver(&[envelope("{\"n\":5}")]).await.unwrap();
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .ends_with("{\"n\":3}\n{\"n\":5}\n"));
    }

    #[tokio::test]
    async fn a_line_cut_short_by_a_crash_is_ended_before_the_next_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        std::fs::write(&path, "{\"n\":1}\n{\"n\":2,\"da").unwrap();
        let target = FileTarget::open(&path, Durability::Os).unwrap();
        target.deliver(&[envelope("{\"n\":2}")]).await.unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":2,\"da\n{\"n\":2}\n"
        );
        // A file that ends whole is left as it is.
        drop(target);
        let again = FileTarget::open(&path, Durability::Os).unwrap();
        again.deliver(&[envelope("{\"n\":3}")]).await.unwrap();
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .ends_with("{\"n\":2}\n{\"n\":3}\n"));
    }
}
