//! The `file` target: appends one JSON line per event (structured mode) to a file. With
//! durability `fsync` a batch counts as delivered only once the file is flushed to disk.
//! Targets writing to one path share one open file: ten thousand rules writing to one file
//! hold one descriptor, not ten thousand.
//!
//! Events are data like the bus logs: a file the target creates is readable by its owner
//! only (0600, and 0700 for directories it creates); a file that exists keeps its mode. The
//! path is the one the policy resolved (`targets::allowed_file_path`).

use std::cell::RefCell;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, LazyLock, Mutex, OnceLock, Weak};
use std::task::{Context, Poll, Waker};

use async_trait::async_trait;

use crate::store::Durability;
use crate::targets::target::{json_lines, Envelope, Target, TargetError};

pub struct FileTarget {
    path: PathBuf,
    file: Arc<Mutex<File>>,
    durability: Durability,
}

impl FileTarget {
    pub fn open(path: &Path, durability: Durability) -> Result<FileTarget, TargetError> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            use std::os::unix::fs::DirBuilderExt as _;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(|e| {
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
/// Each write is one or more whole batches (see [`combine_writes`]) on an `O_APPEND`
/// descriptor, so sharing changes nothing a reader of the file can see.
fn shared_file(path: &Path) -> Result<Arc<Mutex<File>>, TargetError> {
    let mut open = OPEN_FILES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(file) = open.files.get(path).and_then(Weak::upgrade) {
        return Ok(file);
    }
    let cannot =
        |e: std::io::Error| TargetError::fatal(format!("cannot open {}: {e}", path.display()));
    let mut options = OpenOptions::new();
    {
        use std::os::unix::fs::OpenOptionsExt as _;
        options.create(true).append(true).mode(0o600);
    }
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

/// Why a write failed, the same for a delivery's own write and a combined one.
fn write_failed(path: &Path, e: &std::io::Error) -> String {
    format!("cannot write {}: {e}", path.display())
}

/// Writes deferred on this thread while a caller delivers for several subscriptions in a
/// row (see [`combine_writes`]).
#[derive(Default)]
struct Combine {
    files: Vec<Deferred>,
}

/// The lines deferred for one file, and the outcome their deliveries wait for.
struct Deferred {
    file: Arc<Mutex<File>>,
    path: PathBuf,
    lines: Vec<u8>,
    written: Arc<Written>,
}

/// The outcome of one combined write, and the deliveries waiting for it.
#[derive(Default)]
struct Written {
    result: OnceLock<Result<(), String>>,
    wakers: Mutex<Vec<Waker>>,
}

impl Written {
    fn set(&self, result: Result<(), String>) {
        let _ = self.result.set(result);
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|p| p.into_inner()));
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// Waits for a combined write.
struct WaitWritten(Arc<Written>);

impl Future for WaitWritten {
    type Output = Result<(), String>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(r) = self.0.result.get() {
            return Poll::Ready(r.clone());
        }
        self.0
            .wakers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(cx.waker().clone());
        match self.0.result.get() {
            Some(r) => Poll::Ready(r.clone()),
            None => Poll::Pending,
        }
    }
}

thread_local! {
    static COMBINE: RefCell<Option<Combine>> = const { RefCell::new(None) };
}

/// While the returned guard lives, file targets with durability `os` on this thread do not
/// write each delivery: they add its lines to one buffer per file, and the guard, when
/// dropped, writes each buffer with one `write` and completes the deliveries waiting for it
/// (their futures are `Pending` until then). For a caller that polls the deliveries of
/// many subscriptions in a row, such as a shard reader handing one batch to thousands of
/// rules that each take one event: one system call instead of one per subscription. A
/// delivery still counts as done only once its lines are written. Nested guards leave
/// the writing to the outermost.
pub fn combine_writes() -> CombineGuard {
    let outer = COMBINE.with(|c| match c.try_borrow_mut() {
        Ok(mut c) if c.is_none() => {
            *c = Some(Combine::default());
            true
        }
        _ => false,
    });
    CombineGuard { outer }
}

/// Whether deliveries on this thread are being combined (see [`combine_writes`]).
pub fn combining() -> bool {
    COMBINE.with(|c| c.try_borrow().is_ok_and(|c| c.is_some()))
}

/// Writes what was deferred when dropped (see [`combine_writes`]).
pub struct CombineGuard {
    outer: bool,
}

impl Drop for CombineGuard {
    fn drop(&mut self) {
        if !self.outer {
            return;
        }
        let Some(combine) = COMBINE.with(|c| c.try_borrow_mut().ok().and_then(|mut c| c.take()))
        else {
            return;
        };
        for d in combine.files {
            let result = d
                .file
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .write_all(&d.lines)
                .map_err(|e| write_failed(&d.path, &e));
            d.written.set(result);
        }
    }
}

impl FileTarget {
    /// Adds the lines to this thread's combined write of the file, if writes are being
    /// combined: the outcome to wait for.
    fn defer(&self, lines: &[u8]) -> Option<WaitWritten> {
        COMBINE.with(|c| {
            let mut c = c.try_borrow_mut().ok()?;
            let combine = c.as_mut()?;
            let at = match combine
                .files
                .iter()
                .position(|d| Arc::ptr_eq(&d.file, &self.file))
            {
                Some(at) => at,
                None => {
                    combine.files.push(Deferred {
                        file: self.file.clone(),
                        path: self.path.clone(),
                        lines: Vec::new(),
                        written: Arc::default(),
                    });
                    combine.files.len() - 1
                }
            };
            let d = combine.files.get_mut(at)?;
            d.lines.extend_from_slice(lines);
            Some(WaitWritten(d.written.clone()))
        })
    }
}

#[async_trait]
impl Target for FileTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let lines = json_lines(events);
        let failed =
            |path: &Path, e: std::io::Error| TargetError::retryable(write_failed(path, &e));
        if self.durability == Durability::Os {
            if let Some(written) = self.defer(&lines) {
                return written.await.map_err(TargetError::retryable);
            }
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
    async fn a_file_the_target_creates_is_private_and_an_existing_one_keeps_its_mode() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let new = dir.path().join("new/deeper/out.jsonl");
        drop(FileTarget::open(&new, Durability::Os).unwrap());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&new), 0o600);
        assert_eq!(mode(&dir.path().join("new/deeper")), 0o700);
        let shared = dir.path().join("shared.jsonl");
        std::fs::write(&shared, b"").unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o640)).unwrap();
        drop(FileTarget::open(&shared, Durability::Os).unwrap());
        assert_eq!(mode(&shared), 0o640);
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

    #[test]
    fn combined_writes_complete_their_deliveries_only_once_written() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out.jsonl");
        let a = FileTarget::open(&path, Durability::Os).unwrap();
        let b = FileTarget::open(&path, Durability::Os).unwrap();
        let one = [envelope("{\"n\":1}")];
        let two = [envelope("{\"n\":2}"), envelope("{\"n\":3}")];
        let (mut first, mut second);
        {
            let _combine = combine_writes();
            assert!(combining());
            first = a.deliver(&one);
            second = b.deliver(&two);
            // Deferred: nothing written, nothing done.
            assert!((&mut first).now_or_never().is_none());
            assert!((&mut second).now_or_never().is_none());
            assert_eq!(std::fs::read_to_string(&path).unwrap(), "");
            // A nested guard leaves the write to the outer one.
            drop(combine_writes());
            assert!((&mut first).now_or_never().is_none());
        }
        assert!(!combining());
        assert!(matches!(first.now_or_never(), Some(Ok(()))));
        assert!(matches!(second.now_or_never(), Some(Ok(()))));
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "{\"n\":1}\n{\"n\":2}\n{\"n\":3}\n"
        );
        // Outside a guard a delivery writes at once.
        assert!(matches!(
            a.deliver(&[envelope("{\"n\":4}")]).now_or_never(),
            Some(Ok(()))
        ));
        assert!(std::fs::read_to_string(&path)
            .unwrap()
            .ends_with("{\"n\":3}\n{\"n\":4}\n"));
    }

    #[test]
    fn a_failed_combined_write_fails_every_delivery_in_it() {
        use futures_util::FutureExt;
        let full = Path::new("/dev/full");
        if !full.exists() {
            return;
        }
        let target = FileTarget::open(full, Durability::Os).unwrap();
        let one = [envelope("{\"n\":1}")];
        let two = [envelope("{\"n\":2}")];
        let (mut first, mut second);
        {
            let _combine = combine_writes();
            first = target.deliver(&one);
            second = target.deliver(&two);
            assert!((&mut first).now_or_never().is_none());
            assert!((&mut second).now_or_never().is_none());
        }
        for delivery in [first, second] {
            let Some(Err(e)) = delivery.now_or_never() else {
                panic!("a write to /dev/full went through");
            };
            assert!(e.retryable);
            assert!(e.to_string().contains("cannot write /dev/full"), "{e}");
        }
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
