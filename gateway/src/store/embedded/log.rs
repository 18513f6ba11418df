//! The embedded bus log: per shard, a directory of segment files of length-prefixed,
//! CRC-checked records.
//!
//! Record: `len: u32 LE | crc32(seq ‖ payload): u32 LE | seq: u64 LE | payload`.
//! Segment files are named by the sequence number of their first record.
//!
//! Appends write straight from the request's task under the shard's lock (a page-cache
//! write of a few KiB): no thread hand-off on the hot path. Durability `fsync` adds group
//! commit, one per log: an appender that needs its records durable records how far
//! (`Commit`) and waits for its shard's tail to pass them. The first to find no flusher
//! running starts the log's flusher on a blocking thread, off the async workers. A flush
//! round covers every record written so far to every shard that has appenders waiting,
//! publishes them, and goes again while appenders asked for more; then the flusher ends.
//! So an appender waits for at most the round in progress and the next, never for a queue
//! of earlier appenders. Under load (many appenders waiting) a round that follows another
//! first waits, up to `GATHER`, while appenders keep arriving, so it covers more of them.
//!
//! The shards of a round share one device flush where the file system allows (ext4 and
//! XFS, every shard on one device; `shared_flush`): every file but one is written back and
//! waited on (`sync_file_range`), then one `fdatasync` flushes the device's write cache,
//! which covers every write completed before it. That is safe because a segment is only
//! ever overwritten in place within space that a full `fdatasync` already made durable
//! (see the zero-filled chunks below); a file whose size changed since its last flush gets
//! a full `fdatasync` of its own. Elsewhere each shard's file gets its own `fdatasync`.
//!
//! With `fsync`, segment files grow in zero-filled chunks ahead of the records: a flush of
//! writes into space that already exists needs no file-size (metadata) journal commit, which
//! makes `fdatasync` an order of magnitude cheaper on ext4 (measured here: 0.17 ms instead of
//! 2.1 ms). Recovery stops at the first record that does not check out, so the zeros are
//! never mistaken for records.
//!
//! Readers see records only once durable (the shard's tail). Recent records stay in a
//! bounded in-memory cache, so readers that keep up never touch the file.

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
#[cfg(test)]
use std::sync::atomic::AtomicU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use crate::store::embedded::reader::{lock, poisoned, Cache, EmbeddedReader, Segments, ShardView};
use crate::store::embedded::segment::{encode_record, recover, segment_path, sync_dir, zero_fill};
use crate::store::Durability;
use crate::store::{BusLog, Seq, ShardAppend, ShardReader, StoreError};

/// How far ahead of the records a segment is zero-filled (durability `fsync` only).
const PREALLOCATE: u64 = 1024 * 1024;

#[derive(Debug, Clone)]
pub struct LogOptions {
    pub durability: Durability,
    pub segment_bytes: u64,
    /// Bytes of recent records kept in memory per shard for readers at the tail.
    pub cache_bytes: usize,
}

/// The writing side of a shard, behind its lock.
struct Active {
    file: Arc<File>,
    /// End of the records in the active segment: the next write goes here.
    file_len: u64,
    /// Bytes of the file that exist (records plus zero-filled space).
    allocated: u64,
    next_seq: Seq,
    buf: Vec<u8>,
    /// The file's size changed since its last full `fdatasync` (it grew into new zero-filled
    /// space, or is new): its next flush must be a full `fdatasync`, not a write-back only.
    resized: bool,
}

struct Shard {
    dir: PathBuf,
    active: Mutex<Active>,
    /// Next sequence number not yet durable-and-visible: the readers' limit.
    tail: watch::Sender<Seq>,
    segments: Segments,
    cache: Arc<Mutex<Cache>>,
    /// `sluice_events_appended_total` of this shard.
    appended: prometheus_client::metrics::counter::Counter,
}

/// One bus's log on local disk.
pub struct EmbeddedLog {
    bus: String,
    shards: Arc<Vec<Shard>>,
    options: LogOptions,
    /// The log's group commit (durability `fsync`).
    commit: Arc<Commit>,
    /// The shards of a flush round share one device flush (see the module's comment).
    shared_flush: bool,
    /// False once a flush failed (or the log closed): the log is fenced, it takes no writes
    /// and publishes nothing more until a restart has re-verified its segments.
    healthy: Arc<AtomicBool>,
    /// Why the last write failed (no space, file too large), while it keeps failing: the log
    /// is not fenced, every write is tried again, and the first to succeed clears this.
    write_problem: Mutex<Option<String>>,
    /// Test-only fault injection: the next `n` data flushes fail with an I/O error.
    #[cfg(test)]
    fail_syncs: Arc<AtomicU32>,
    /// Test-only: write-backs that shared a device flush.
    #[cfg(test)]
    write_backs: Arc<AtomicU32>,
}

/// `fdatasync`, or the injected failure of a test.
fn sync_data(file: &File, #[cfg(test)] fail: &AtomicU32) -> std::io::Result<()> {
    #[cfg(test)]
    injected_failure(fail, "fsync")?;
    file.sync_data()
}

/// Test-only fault injection: fails while the counter of failures to inject is above zero.
#[cfg(test)]
fn injected_failure(fail: &AtomicU32, what: &str) -> std::io::Result<()> {
    match fail.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
        Ok(_) => Err(std::io::Error::other(format!("injected {what} failure"))),
        Err(_) => Ok(()),
    }
}

impl EmbeddedLog {
    /// Opens (or creates) the log under `dir`, recovering each shard: a record torn by a
    /// crash at the end of the newest segment is cut off, everything before it is kept.
    pub fn open(
        bus: &str,
        dir: &Path,
        shards: u32,
        options: &LogOptions,
    ) -> Result<EmbeddedLog, StoreError> {
        let mut handles = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            let dir = dir.join(format!("shard-{shard}"));
            let recovered = recover(&dir)?;
            handles.push(Shard {
                dir,
                active: Mutex::new(Active {
                    file: Arc::new(recovered.file),
                    file_len: recovered.file_len,
                    allocated: recovered.file_len,
                    next_seq: recovered.next_seq,
                    buf: Vec::new(),
                    resized: true,
                }),
                tail: watch::Sender::new(recovered.next_seq),
                segments: Arc::new(Mutex::new(recovered.bases)),
                cache: Arc::new(Mutex::new(Cache {
                    records: VecDeque::new(),
                    bytes: 0,
                    first: recovered.next_seq,
                })),
                appended: crate::metrics::get().appended(bus, shard),
            });
        }
        let wanted = handles.iter().map(|s| *s.tail.borrow()).collect();
        let shared_flush = shares_device_flush(&handles);
        Ok(EmbeddedLog {
            bus: bus.to_string(),
            shards: Arc::new(handles),
            options: options.clone(),
            commit: Arc::new(Commit {
                state: Mutex::new(CommitState {
                    wanted,
                    waiting: 0,
                    running: false,
                }),
            }),
            shared_flush,
            healthy: Arc::new(AtomicBool::new(true)),
            write_problem: Mutex::new(None),
            #[cfg(test)]
            fail_syncs: Arc::new(AtomicU32::new(0)),
            #[cfg(test)]
            write_backs: Arc::new(AtomicU32::new(0)),
        })
    }

    /// Fences the log after a failure that may have lost acknowledged-to-be data.
    fn fence(&self, what: &str, e: &std::io::Error) -> StoreError {
        fence(&self.healthy, &self.bus, what, e)
    }

    fn fenced() -> StoreError {
        StoreError::Unavailable(
            "an earlier flush of the log failed; it takes no writes until a restart re-verifies it"
                .to_string(),
        )
    }

    /// Remembers (and logs once) why writes fail, for readiness.
    fn write_failed(&self, what: &str, e: &std::io::Error) -> StoreError {
        let problem = format!("{what} failed: {e}");
        let mut current = lock(&self.write_problem);
        if current.as_deref() != Some(problem.as_str()) {
            tracing::error!(bus = %self.bus, "{problem}; the log is not ready until a write succeeds");
            *current = Some(problem);
        }
        StoreError::io(&format!("{what} failed"), e)
    }

    fn shard(&self, shard: u32) -> Result<&Shard, StoreError> {
        self.shards.get(shard as usize).ok_or_else(|| {
            StoreError::Unavailable(format!("bus `{}` has no shard {shard}", self.bus))
        })
    }

    /// Flushes everything written to disk (also with durability `os`) and gives back the
    /// preallocated space. The log takes no writes afterwards.
    pub async fn close(&self) {
        self.healthy.store(false, Ordering::Relaxed);
        for shard in self.shards.iter() {
            let (file, len) = {
                let mut active = lock(&shard.active);
                active.allocated = active.file_len;
                (active.file.clone(), active.file_len)
            };
            let result = tokio::task::spawn_blocking(move || {
                file.set_len(len).and_then(|()| file.sync_all())
            })
            .await;
            if !matches!(result, Ok(Ok(()))) {
                tracing::error!(bus = %self.bus, "final flush of the log failed");
            }
        }
    }

    /// Writes one shard's records; returns (first seq, end seq). Visible to nobody yet.
    fn write(&self, shard: &Shard, records: &[Bytes]) -> Result<(Seq, Seq), StoreError> {
        let mut active = lock(&shard.active);
        if !self.healthy.load(Ordering::SeqCst) {
            return Err(Self::fenced());
        }
        let active = &mut *active;
        let first = active.next_seq;
        let accepted = crate::store::now_ms();
        active.buf.clear();
        for (i, record) in records.iter().enumerate() {
            encode_record(&mut active.buf, first + i as Seq, accepted, record);
        }
        let needed = active.file_len + active.buf.len() as u64;
        if self.options.durability == Durability::Fsync && needed > active.allocated {
            let target = needed.max(active.allocated + PREALLOCATE);
            active.resized = true;
            zero_fill(&active.file, active.allocated, target)
                .map_err(|e| self.write_failed("extending the log", &e))?;
            active.allocated = target;
        }
        if let Err(e) = active.file.write_all_at(&active.buf, active.file_len) {
            // A partial write is overwritten by the next one (the end does not move); cut
            // it off now so no half record can ever be followed by good ones.
            if active.allocated <= active.file_len {
                active.resized = true;
                if let Err(t) = active.file.set_len(active.file_len) {
                    return Err(self.fence("undoing a failed write", &t));
                }
            }
            return Err(self.write_failed("writing the log", &e));
        }
        active.file_len += active.buf.len() as u64;
        active.allocated = active.allocated.max(active.file_len);
        let end = first + records.len() as Seq;
        active.next_seq = end;
        {
            let mut cache = lock(&shard.cache);
            for (i, record) in records.iter().enumerate() {
                cache.bytes += record.len();
                cache
                    .records
                    .push_back((first + i as Seq, accepted, record.clone()));
            }
            while cache.bytes > self.options.cache_bytes {
                let Some((seq, _, old)) = cache.records.pop_front() else {
                    break;
                };
                cache.bytes -= old.len();
                cache.first = seq + 1;
            }
        }
        if lock(&self.write_problem).take().is_some() {
            tracing::info!(bus = %self.bus, "the log takes writes again");
        }
        if active.file_len >= self.options.segment_bytes {
            self.roll(shard, active)?;
        }
        Ok((first, end))
    }

    /// Starts a new segment, in an order a crash at any point recovers from: the old
    /// segment is finished first (cut to its last record and flushed), and only then is the
    /// new one created and its directory entry flushed. A crash before the new file exists
    /// leaves a complete old segment; a crash after leaves an empty newest segment that
    /// starts right where the old one ends. A failure to finish the old segment fences the
    /// log (its records may not be on disk); a failure to create the new one keeps writing
    /// in the old one, with no new file left behind.
    fn roll(&self, shard: &Shard, active: &mut Active) -> Result<(), StoreError> {
        // With `fsync` the old segment's end must be on disk before its successor exists
        // (recovery could not tell it from lost records); little is left to flush by then,
        // group commits did the rest. With `os` nothing survives a power loss for sure, and
        // a process crash keeps the page cache: no flush, so no stall of the shard.
        active
            .file
            .set_len(active.file_len)
            .and_then(|()| {
                if self.options.durability == Durability::Fsync {
                    sync_data(
                        &active.file,
                        #[cfg(test)]
                        &self.fail_syncs,
                    )
                } else {
                    Ok(())
                }
            })
            .map_err(|e| self.fence("finishing a log segment", &e))?;
        active.allocated = active.file_len;
        let path = segment_path(&shard.dir, active.next_seq);
        let file = match OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => file,
            Err(e) => {
                tracing::error!(path = %path.display(), error = %e, "cannot start a new log segment; writing on in the current one");
                if e.kind() != ErrorKind::AlreadyExists {
                    let _ = fs::remove_file(&path);
                }
                return Ok(());
            }
        };
        if self.options.durability == Durability::Fsync {
            sync_dir(&shard.dir)
                .map_err(|e| self.fence("flushing a new segment's directory entry", &e))?;
        }
        active.file = Arc::new(file);
        active.file_len = 0;
        active.allocated = 0;
        active.resized = true;
        lock(&shard.segments).push(active.next_seq);
        Ok(())
    }

    /// Makes the shard's records below `end` durable: records how far, starts the log's
    /// flusher unless it runs, and waits for the shard's tail to pass `end` (or for a flush
    /// to fail).
    async fn sync_to(&self, index: u32, shard: &Shard, end: Seq) -> Result<(), StoreError> {
        let mut tail = shard.tail.subscribe();
        if *tail.borrow_and_update() >= end {
            return Ok(());
        }
        let start = {
            let mut commit = lock(&self.commit.state);
            commit.want(index, end);
            commit.waiting += 1;
            !std::mem::replace(&mut commit.running, true)
        };
        let _waiting = Waiting(&self.commit);
        if start {
            let flusher = Flusher {
                bus: self.bus.clone(),
                shards: self.shards.clone(),
                commit: self.commit.clone(),
                healthy: self.healthy.clone(),
                shared_flush: self.shared_flush,
                #[cfg(test)]
                fail: self.fail_syncs.clone(),
                #[cfg(test)]
                write_backs: self.write_backs.clone(),
            };
            // The flusher holds a blocking thread while appenders keep it busy, and gives
            // it back once a round finds nothing more wanted.
            tokio::task::spawn_blocking(move || flusher.run());
        }
        loop {
            // The appenders waiting on a failed flush must fail too: flushing the same file
            // again can report success (Linux clears the error once reported) while their
            // records are gone from the page cache.
            if !self.healthy.load(Ordering::SeqCst) {
                return Err(Self::fenced());
            }
            if tail.changed().await.is_err() {
                return Err(Self::fenced());
            }
            if *tail.borrow_and_update() >= end {
                return Ok(());
            }
        }
    }
}

/// Fences a log (see [`EmbeddedLog::fence`]): logged once, by whoever fences it first.
fn fence(healthy: &AtomicBool, bus: &str, what: &str, e: &std::io::Error) -> StoreError {
    if healthy.swap(false, Ordering::SeqCst) {
        tracing::error!(
            bus = %bus,
            error = %e,
            "{what} failed; the log takes no more writes (liveness fails) until a restart re-verifies it"
        );
    }
    StoreError::io(&format!("{what} failed"), e)
}

/// At most how long a flush round that follows another waits, on the flusher's thread, for
/// the appenders on their way before it syncs, when `GATHER_SIBLINGS` or more wait: fewer,
/// larger flushes under load (each flush costs the process CPU in the kernel and in
/// wake-ups, which the requests share), none of it for a quiet or lightly loaded log. It
/// waits in `GATHER_STEP`s and stops early once a step saw no more appenders waiting.
/// Measured (64 connections, 4 shards, one bus): 4.7 events per flush of a shard became
/// about 26 per round of the log, CPU per event 57-67 µs became 42-45, +30 % req/s.
const GATHER: Duration = Duration::from_micros(500);

/// One step of the gathering.
const GATHER_STEP: Duration = Duration::from_micros(100);

/// Appenders waiting for a flush at which a round that follows another gathers.
const GATHER_SIBLINGS: usize = 8;

/// Counts an appender waiting for a flush, for as long as it waits.
struct Waiting<'a>(&'a Commit);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut commit = lock(&self.0.state);
        commit.waiting = commit.waiting.saturating_sub(1);
    }
}

/// A log's group commit (durability `fsync`).
struct Commit {
    state: Mutex<CommitState>,
}

struct CommitState {
    /// Per shard, the end its appenders wait for.
    wanted: Vec<Seq>,
    /// Appenders waiting for a flush now (many: more are on their way).
    waiting: usize,
    /// The log's flusher runs.
    running: bool,
}

impl CommitState {
    /// Records that an appender waits for shard `index`'s records below `end`.
    fn want(&mut self, index: u32, end: Seq) {
        if let Some(wanted) = self.wanted.get_mut(index as usize) {
            *wanted = (*wanted).max(end);
        }
    }
}

/// Whether appenders wait for records of `shard` below `wanted` that its tail has not passed.
fn behind(shard: &Shard, wanted: Seq) -> bool {
    wanted > *shard.tail.borrow()
}

/// A shard to flush in a round: its active file, how far the flush covers it, and whether
/// its size changed since the file's last full flush.
struct Dirty {
    index: usize,
    file: Arc<File>,
    upto: Seq,
    resized: bool,
}

/// The log's flusher: what it needs of its log.
struct Flusher {
    bus: String,
    shards: Arc<Vec<Shard>>,
    commit: Arc<Commit>,
    healthy: Arc<AtomicBool>,
    shared_flush: bool,
    #[cfg(test)]
    fail: Arc<AtomicU32>,
    #[cfg(test)]
    write_backs: Arc<AtomicU32>,
}

impl Flusher {
    /// Flush rounds, on a blocking thread, while appenders want more; then it ends. A failed
    /// flush fences the log and wakes every appender, which fails.
    fn run(self) {
        let metrics = crate::metrics::get();
        // The first round after a quiet spell starts at once.
        let mut busy = false;
        loop {
            if busy && lock(&self.commit.state).waiting >= GATHER_SIBLINGS {
                self.gather();
            }
            let dirty = self.dirty();
            if dirty.is_empty() {
                if self.done() {
                    return;
                }
                continue;
            }
            let synced = if self.healthy.load(Ordering::SeqCst) {
                let started = Instant::now();
                let synced = self.sync(&dirty);
                metrics
                    .flush_duration
                    .observe(started.elapsed().as_secs_f64());
                synced
            } else {
                Err(std::io::Error::other("the log is fenced"))
            };
            if let Err(e) = synced {
                // After a failed fsync the page cache may not match the disk: stop taking
                // writes rather than acknowledge something that may be gone.
                if self.healthy.load(Ordering::SeqCst) {
                    metrics.flush_errors.inc();
                    fence(&self.healthy, &self.bus, "flushing the log", &e);
                }
                lock(&self.commit.state).running = false;
                for shard in self.shards.iter() {
                    shard.tail.send_modify(|_| {});
                }
                return;
            }
            for d in &dirty {
                if let Some(shard) = self.shards.get(d.index) {
                    publish(shard, d.upto);
                }
            }
            if self.done() {
                return;
            }
            busy = true;
        }
    }

    /// Ends the flusher's run (under the lock that appenders start it with) unless some
    /// shard's appenders still wait.
    fn done(&self) -> bool {
        let mut commit = lock(&self.commit.state);
        let more = (self.shards.iter())
            .zip(&commit.wanted)
            .any(|(shard, wanted)| behind(shard, *wanted));
        if !more {
            commit.running = false;
        }
        !more
    }

    /// Waits while the appenders waiting grow in number, in `GATHER_STEP`s, for at most
    /// `GATHER`. (Counting arrivals instead, which keeps gathering longer, measured no better.)
    fn gather(&self) {
        let deadline = Instant::now() + GATHER;
        let mut seen = lock(&self.commit.state).waiting;
        while Instant::now() < deadline {
            std::thread::sleep(GATHER_STEP);
            let now = lock(&self.commit.state).waiting;
            if now <= seen {
                break;
            }
            seen = now;
        }
    }

    /// The shards whose appenders wait, each with everything written to it so far.
    fn dirty(&self) -> Vec<Dirty> {
        let wanted = lock(&self.commit.state).wanted.clone();
        let mut dirty = Vec::new();
        for (index, (shard, wanted)) in self.shards.iter().zip(wanted).enumerate() {
            if !behind(shard, wanted) {
                continue;
            }
            let mut active = lock(&shard.active);
            dirty.push(Dirty {
                index,
                file: active.file.clone(),
                upto: active.next_seq,
                resized: std::mem::replace(&mut active.resized, false),
            });
        }
        dirty
    }

    /// Makes the records of a round durable. Every file's write-back starts first, so the
    /// disk works on all of them at once; then, with a shared device flush, every file but
    /// the last is waited on and the last one's `fdatasync` flushes the device's cache for
    /// all (a resized file gets its own `fdatasync`, for its size); else each file gets its
    /// own `fdatasync`.
    fn sync(&self, dirty: &[Dirty]) -> std::io::Result<()> {
        if dirty.len() > 1 {
            for d in dirty {
                start_write_back(&d.file);
            }
        }
        for (i, d) in dirty.iter().enumerate() {
            let last = i + 1 == dirty.len();
            if self.shared_flush && !last && !d.resized {
                write_back(
                    &d.file,
                    #[cfg(test)]
                    &self.fail,
                )?;
                #[cfg(test)]
                self.write_backs.fetch_add(1, Ordering::SeqCst);
            } else {
                sync_data(
                    &d.file,
                    #[cfg(test)]
                    &self.fail,
                )?;
            }
        }
        Ok(())
    }
}

/// Whether a log's shards can share one device flush: Linux, ext4 (not
/// mounted `data=journal`, where written-back data waits in the journal) or XFS (a data
/// overwrite of allocated, written blocks needs no metadata there, and their `fdatasync`
/// always flushes the device's cache), and every shard's directory on one device. Anything
/// else (btrfs copies on write, network and overlay file systems) gets a full `fdatasync`
/// per file.
fn shares_device_flush(shards: &[Shard]) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt as _;
        const EXT4: i64 = 0xEF53;
        const XFS: i64 = 0x5846_5342;
        let Some(Ok(first)) = shards.first().map(|s| fs::metadata(&s.dir)) else {
            return false;
        };
        let same_device = (shards.iter().skip(1))
            .all(|s| fs::metadata(&s.dir).is_ok_and(|m| m.dev() == first.dev()));
        let kind = (shards.first())
            .and_then(|s| File::open(&s.dir).ok())
            .and_then(|f| file_system_type(&f));
        same_device
            && match kind {
                Some(EXT4) => !journals_data(first.dev()),
                Some(XFS) => true,
                _ => false,
            }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = shards;
        false
    }
}

/// Whether the file system on device `dev` is mounted with `data=journal` (from
/// `/proc/self/mountinfo`; unreadable counts as yes, the safe answer).
#[cfg(target_os = "linux")]
fn journals_data(dev: u64) -> bool {
    let major = ((dev >> 32) & 0xffff_f000) | ((dev >> 8) & 0xfff);
    let minor = ((dev >> 12) & 0xffff_ff00) | (dev & 0xff);
    let id = format!("{major}:{minor}");
    fs::read_to_string("/proc/self/mountinfo").map_or(true, |m| mounted_data_journal(&m, &id))
}

/// Whether a mount of device `id` ("major:minor") in a `mountinfo` text has `data=journal`.
#[cfg(target_os = "linux")]
fn mounted_data_journal(mountinfo: &str, id: &str) -> bool {
    mountinfo
        .lines()
        .filter(|line| line.split(' ').nth(2) == Some(id))
        .any(|line| {
            // After the " - " separator: type, source, the super block's options.
            line.split_once(" - ")
                .and_then(|(_, rest)| rest.split(' ').nth(2))
                .is_some_and(|options| options.split(',').any(|o| o == "data=journal"))
        })
}

/// The file system type (`statfs`'s `f_type`) of an open file.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
// `f_type`'s type differs between targets (`i64` here, `i32` or `u32` elsewhere).
#[allow(clippy::useless_conversion)]
fn file_system_type(file: &File) -> Option<i64> {
    use std::os::fd::AsRawFd as _;
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `fstatfs` writes a `statfs` for a valid open descriptor into memory we own.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), stat.as_mut_ptr()) };
    // SAFETY: a successful `fstatfs` filled the struct (and it started zeroed).
    (rc == 0).then(|| i64::from(unsafe { stat.assume_init() }.f_type))
}

/// Starts writing a file's dirty pages back, without waiting (a hint: errors show in the
/// flush that follows).
#[allow(unsafe_code)]
fn start_write_back(file: &File) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd as _;
        // SAFETY: a plain system call on a valid open descriptor; no memory is passed.
        let _ =
            unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, libc::SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = file;
}

/// Writes a file's dirty pages back and waits for them (no metadata, no device flush: a
/// later `fdatasync` on the same device flushes its cache), or the injected failure of a
/// test. Linux only; elsewhere the flush is a full `fdatasync`.
#[allow(unsafe_code)]
fn write_back(file: &File, #[cfg(test)] fail: &AtomicU32) -> std::io::Result<()> {
    #[cfg(test)]
    injected_failure(fail, "write-back")?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd as _;
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: a plain system call on a valid open descriptor; no memory is passed.
        let rc = unsafe { libc::sync_file_range(file.as_raw_fd(), 0, 0, flags) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
    #[cfg(not(target_os = "linux"))]
    file.sync_data()
}

/// Moves the readers' limit forward (never back: appenders may finish out of order).
fn publish(shard: &Shard, end: Seq) {
    shard.tail.send_if_modified(|tail| {
        if end > *tail {
            *tail = end;
            true
        } else {
            false
        }
    });
}

#[async_trait]
impl BusLog for EmbeddedLog {
    fn shards(&self) -> u32 {
        self.shards.len() as u32
    }

    async fn append(&self, appends: Vec<ShardAppend>) -> Vec<Result<Seq, StoreError>> {
        let written: Vec<_> = appends
            .iter()
            .map(|append| {
                let shard = self.shard(append.shard)?;
                crate::store::check_record_sizes(append)?;
                self.write(shard, &append.records).map(|seqs| (shard, seqs))
            })
            .collect();
        if self.options.durability == Durability::Fsync && written.len() > 1 {
            // Every shard of the batch is wanted before the first wait: one round covers all.
            let mut commit = lock(&self.commit.state);
            for (w, append) in written.iter().zip(&appends) {
                if let Ok((_, (_, end))) = w {
                    commit.want(append.shard, *end);
                }
            }
        }
        let mut results = Vec::with_capacity(written.len());
        for (w, append) in written.into_iter().zip(&appends) {
            let result = match w {
                Ok((shard, (first, end))) => match self.options.durability {
                    Durability::Os => {
                        publish(shard, end);
                        Ok(first)
                    }
                    Durability::Fsync => {
                        self.sync_to(append.shard, shard, end).await.map(|()| first)
                    }
                }
                .inspect(|_| {
                    shard.appended.inc_by(append.records.len() as u64);
                }),
                Err(e) => Err(e),
            };
            if result.is_err() {
                crate::metrics::get().write_error(&self.bus, append.shard);
            }
            results.push(result);
        }
        results
    }

    async fn reader(&self, shard: u32, from: Seq) -> Result<Box<dyn ShardReader>, StoreError> {
        let s = self.shard(shard)?;
        let view = ShardView {
            dir: s.dir.clone(),
            segments: s.segments.clone(),
            cache: s.cache.clone(),
            tail: s.tail.subscribe(),
        };
        Ok(Box::new(EmbeddedReader::new(&self.bus, shard, view, from)))
    }

    fn tail(&self, shard: u32) -> watch::Receiver<Seq> {
        match self.shards.get(shard as usize) {
            Some(s) => s.tail.subscribe(),
            None => watch::channel(0).1,
        }
    }

    async fn end(&self, shard: u32) -> Result<Seq, StoreError> {
        Ok(*self.shard(shard)?.tail.borrow())
    }

    async fn start(&self, shard: u32) -> Result<Seq, StoreError> {
        let s = self.shard(shard)?;
        let bases = s.segments.lock().map_err(poisoned)?;
        Ok(bases.first().copied().unwrap_or(0))
    }

    async fn release(&self, shard: u32, seq: Seq) -> Result<(), StoreError> {
        let s = self.shard(shard)?;
        let doomed: Vec<Seq> = {
            let mut bases = lock(&s.segments);
            // A segment can go once the next one starts at or below `seq`; the newest stays.
            let keep_from = bases.windows(2).take_while(|w| w[1] <= seq).count();
            bases.drain(..keep_from).collect()
        };
        if doomed.is_empty() {
            return Ok(());
        }
        let dir = s.dir.clone();
        tokio::task::spawn_blocking(move || {
            for base in doomed {
                let path = segment_path(&dir, base);
                if let Err(e) = fs::remove_file(&path) {
                    if e.kind() != ErrorKind::NotFound {
                        tracing::warn!(path = %path.display(), error = %e, "cannot delete a released segment");
                    }
                }
            }
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("release task failed: {e}")))
    }

    fn healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    fn write_problem(&self) -> Option<String> {
        lock(&self.write_problem).clone()
    }
}

#[cfg(test)]
mod tests;
