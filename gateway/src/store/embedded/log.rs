//! The embedded bus log: per shard, a directory of segment files of length-prefixed,
//! CRC-checked records, written by one thread per shard with group commit.
//!
//! Record: `len: u32 LE | crc32(seq ‖ payload): u32 LE | seq: u64 LE | payload`.
//! Segment files are named by the sequence number of their first record.
//!
//! Group commit: appends queue on a channel; the writer takes everything queued, writes it
//! with one `write`, makes it durable with one `fdatasync` (durability `fsync`), then answers
//! every append of the group. While one flush runs the next group gathers, so the flush cost
//! is shared by all concurrent requests instead of paid by each.

use std::fs::{self, File, OpenOptions};
use std::io::{BufReader, ErrorKind, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot, watch};

use crate::config::Durability;
use crate::store::{BusLog, Record, Seq, ShardAppend, ShardReader, StoreError};

const HEADER: usize = 16;
/// Larger lengths can only come from a torn or corrupt header.
const MAX_RECORD: u32 = 64 * 1024 * 1024;
/// Upper bound on one group, so one huge burst does not delay its first requests for long.
const MAX_GROUP_BYTES: usize = 8 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct LogOptions {
    pub durability: Durability,
    pub segment_bytes: u64,
    pub max_pending: usize,
}

enum Message {
    Append {
        records: Vec<Bytes>,
        done: oneshot::Sender<Result<Seq, StoreError>>,
    },
    Close {
        done: oneshot::Sender<()>,
    },
}

/// Segment base sequence numbers of one shard, oldest first; shared by writer and readers.
type Segments = Arc<Mutex<Vec<Seq>>>;

struct Shard {
    dir: PathBuf,
    tx: mpsc::Sender<Message>,
    tail: watch::Receiver<Seq>,
    segments: Segments,
}

/// One bus's log on local disk.
pub struct EmbeddedLog {
    bus: String,
    shards: Vec<Shard>,
    healthy: Arc<AtomicBool>,
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
        let healthy = Arc::new(AtomicBool::new(true));
        let mut handles = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            let dir = dir.join(format!("shard-{shard}"));
            let recovered = recover(&dir)?;
            let (tail_tx, tail_rx) = watch::channel(recovered.next_seq);
            let (tx, rx) = mpsc::channel(options.max_pending.max(1));
            let segments: Segments = Arc::new(Mutex::new(recovered.bases));
            let writer = Writer {
                dir: dir.clone(),
                file: recovered.file,
                file_len: recovered.file_len,
                next_seq: recovered.next_seq,
                options: options.clone(),
                tail: tail_tx,
                segments: segments.clone(),
                healthy: healthy.clone(),
            };
            std::thread::Builder::new()
                .name(format!("log-{bus}-{shard}"))
                .spawn(move || writer.run(rx))
                .map_err(|e| StoreError::io("cannot start the log writer thread", &e))?;
            handles.push(Shard {
                dir,
                tx,
                tail: tail_rx,
                segments,
            });
        }
        Ok(EmbeddedLog {
            bus: bus.to_string(),
            shards: handles,
            healthy,
        })
    }

    fn shard(&self, shard: u32) -> Result<&Shard, StoreError> {
        self.shards.get(shard as usize).ok_or_else(|| {
            StoreError::Unavailable(format!("bus `{}` has no shard {shard}", self.bus))
        })
    }

    /// Flushes everything written and stops the writers. Appends after this fail.
    pub async fn close(&self) {
        for shard in &self.shards {
            let (done, wait) = oneshot::channel();
            if shard.tx.send(Message::Close { done }).await.is_ok() {
                let _ = wait.await;
            }
        }
    }
}

#[async_trait]
impl BusLog for EmbeddedLog {
    fn shards(&self) -> u32 {
        self.shards.len() as u32
    }

    async fn append(&self, appends: Vec<ShardAppend>) -> Vec<Result<Seq, StoreError>> {
        // Queue every shard's part first so the shards' writers work in parallel.
        let pending: Vec<_> = appends
            .into_iter()
            .map(|append| {
                let shard = self.shard(append.shard)?;
                let (done, wait) = oneshot::channel();
                let message = Message::Append {
                    records: append.records,
                    done,
                };
                match shard.tx.try_send(message) {
                    Ok(()) => Ok(wait),
                    Err(mpsc::error::TrySendError::Full(_)) => Err(StoreError::Busy(
                        "too many appends are waiting for the disk".to_string(),
                    )),
                    Err(mpsc::error::TrySendError::Closed(_)) => Err(StoreError::Unavailable(
                        "the log is shutting down".to_string(),
                    )),
                }
            })
            .collect();
        let mut results = Vec::with_capacity(pending.len());
        for p in pending {
            results.push(match p {
                Ok(wait) => wait.await.unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(
                        "the log writer stopped".to_string(),
                    ))
                }),
                Err(e) => Err(e),
            });
        }
        results
    }

    async fn reader(&self, shard: u32, from: Seq) -> Result<Box<dyn ShardReader>, StoreError> {
        let s = self.shard(shard)?;
        let dir = s.dir.clone();
        let segments = s.segments.clone();
        let tail = s.tail.clone();
        let bus = self.bus.clone();
        let state = tokio::task::spawn_blocking(move || {
            ReadState::open(&bus, shard, dir, segments, *tail.borrow(), from)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("reader task failed: {e}")))??;
        Ok(Box::new(EmbeddedReader {
            tail: s.tail.clone(),
            state: Some(state),
        }))
    }

    fn tail(&self, shard: u32) -> watch::Receiver<Seq> {
        match self.shards.get(shard as usize) {
            Some(s) => s.tail.clone(),
            None => watch::channel(0).1,
        }
    }

    async fn release(&self, shard: u32, seq: Seq) -> Result<(), StoreError> {
        let s = self.shard(shard)?;
        let doomed: Vec<Seq> = {
            let mut bases = s.segments.lock().map_err(poisoned)?;
            // A segment can go once the next one starts at or below `seq`; the newest stays.
            let keep_from = bases.windows(2).take_while(|w| w[1] <= seq).count();
            bases.drain(..keep_from).collect()
        };
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
        self.healthy.load(Ordering::Relaxed)
    }
}

fn poisoned<T>(_: T) -> StoreError {
    StoreError::Unavailable("a log lock was poisoned".to_string())
}

fn segment_path(dir: &Path, base: Seq) -> PathBuf {
    dir.join(format!("{base:020}.log"))
}

struct Recovered {
    file: File,
    file_len: u64,
    next_seq: Seq,
    bases: Vec<Seq>,
}

fn recover(dir: &Path) -> Result<Recovered, StoreError> {
    fs::create_dir_all(dir)
        .map_err(|e| StoreError::io(&format!("cannot create {}", dir.display()), &e))?;
    let mut bases = Vec::new();
    let entries = fs::read_dir(dir)
        .map_err(|e| StoreError::io(&format!("cannot list {}", dir.display()), &e))?;
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io("cannot list a shard", &e))?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if let Some(base) = name
            .strip_suffix(".log")
            .and_then(|b| b.parse::<Seq>().ok())
        {
            bases.push(base);
        }
    }
    bases.sort_unstable();
    if bases.is_empty() {
        bases.push(0);
    }
    let base = bases[bases.len() - 1];
    let path = segment_path(dir, base);
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .open(&path)
        .map_err(|e| StoreError::io(&format!("cannot open {}", path.display()), &e))?;
    let (count, valid_len) = scan(&mut file, base)
        .map_err(|e| StoreError::io(&format!("cannot read {}", path.display()), &e))?;
    let len = file
        .metadata()
        .map_err(|e| StoreError::io("cannot stat a segment", &e))?
        .len();
    if valid_len < len {
        tracing::warn!(
            path = %path.display(),
            dropped_bytes = len - valid_len,
            "cutting off a record torn by a crash (it was never acknowledged)"
        );
        file.set_len(valid_len)
            .and_then(|_| file.sync_all())
            .map_err(|e| StoreError::io("cannot truncate a torn segment", &e))?;
    }
    sync_dir(dir).map_err(|e| StoreError::io("cannot sync a shard directory", &e))?;
    Ok(Recovered {
        file,
        file_len: valid_len,
        next_seq: base + count,
        bases,
    })
}

/// Counts the valid records of a segment from its start; returns (records, bytes they span).
fn scan(file: &mut File, base: Seq) -> std::io::Result<(u64, u64)> {
    file.seek(SeekFrom::Start(0))?;
    let mut reader = BufReader::with_capacity(1 << 20, &*file);
    let mut count = 0u64;
    let mut offset = 0u64;
    let mut payload = Vec::new();
    loop {
        match read_record(&mut reader, &mut payload) {
            Ok(Some(seq)) if seq == base + count => {
                count += 1;
                offset += (HEADER + payload.len()) as u64;
            }
            Ok(_) => break,
            Err(e)
                if e.kind() == ErrorKind::InvalidData || e.kind() == ErrorKind::UnexpectedEof =>
            {
                break
            }
            Err(e) => return Err(e),
        }
    }
    Ok((count, offset))
}

/// Reads one record into `payload`. `Ok(None)` at a clean end of file; `InvalidData` for a
/// bad checksum or length; `UnexpectedEof` for a record cut short.
fn read_record(reader: &mut impl Read, payload: &mut Vec<u8>) -> std::io::Result<Option<Seq>> {
    let mut header = [0u8; HEADER];
    let mut filled = 0;
    while filled < HEADER {
        match reader.read(&mut header[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let crc = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    let seq_bytes: [u8; 8] = [
        header[8], header[9], header[10], header[11], header[12], header[13], header[14],
        header[15],
    ];
    if len > MAX_RECORD {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "record length out of range",
        ));
    }
    payload.resize(len as usize, 0);
    reader.read_exact(payload)?;
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq_bytes);
    hasher.update(payload);
    if hasher.finalize() != crc {
        return Err(std::io::Error::new(
            ErrorKind::InvalidData,
            "record checksum mismatch",
        ));
    }
    Ok(Some(u64::from_le_bytes(seq_bytes)))
}

fn encode_record(buf: &mut Vec<u8>, seq: Seq, payload: &[u8]) {
    let seq_bytes = seq.to_le_bytes();
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&seq_bytes);
    hasher.update(payload);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(&hasher.finalize().to_le_bytes());
    buf.extend_from_slice(&seq_bytes);
    buf.extend_from_slice(payload);
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

struct Writer {
    dir: PathBuf,
    file: File,
    file_len: u64,
    next_seq: Seq,
    options: LogOptions,
    tail: watch::Sender<Seq>,
    segments: Segments,
    healthy: Arc<AtomicBool>,
}

type Done = oneshot::Sender<Result<Seq, StoreError>>;

impl Writer {
    fn run(mut self, mut rx: mpsc::Receiver<Message>) {
        let mut buf = Vec::with_capacity(1 << 20);
        let mut group: Vec<(Vec<Bytes>, Done)> = Vec::new();
        let mut close = None;
        while let Some(first) = rx.blocking_recv() {
            let mut bytes = 0;
            let mut next = Some(first);
            while let Some(message) = next.take() {
                match message {
                    Message::Append { records, done } => {
                        bytes += records.iter().map(|r| r.len() + HEADER).sum::<usize>();
                        group.push((records, done));
                    }
                    Message::Close { done } => {
                        close = Some(done);
                        break;
                    }
                }
                if bytes < MAX_GROUP_BYTES {
                    next = rx.try_recv().ok();
                }
            }
            if !group.is_empty() {
                self.commit(&mut group, &mut buf);
            }
            if let Some(done) = close.take() {
                if let Err(e) = self.file.sync_all() {
                    tracing::error!(error = %e, "final flush of the log failed");
                }
                let _ = done.send(());
                return;
            }
        }
        let _ = self.file.sync_all();
    }

    fn commit(&mut self, group: &mut Vec<(Vec<Bytes>, Done)>, buf: &mut Vec<u8>) {
        if !self.healthy.load(Ordering::Relaxed) {
            let error =
                StoreError::Unavailable("an earlier flush failed; restart to recover".to_string());
            for (_, done) in group.drain(..) {
                let _ = done.send(Err(error.clone()));
            }
            return;
        }
        buf.clear();
        let mut seq = self.next_seq;
        let mut firsts: Vec<(Seq, Done)> = Vec::with_capacity(group.len());
        for (records, done) in group.drain(..) {
            firsts.push((seq, done));
            for record in &records {
                encode_record(buf, seq, record);
                seq += 1;
            }
        }
        if let Err(e) = self.file.write_all(buf) {
            // Undo a partial write so no half record is ever followed by good ones.
            if let Err(t) = self.file.set_len(self.file_len) {
                tracing::error!(error = %t, "cannot undo a failed write; the log stops taking writes");
                self.healthy.store(false, Ordering::Relaxed);
            }
            let error = StoreError::io("writing the log failed", &e);
            for (_, done) in firsts {
                let _ = done.send(Err(error.clone()));
            }
            return;
        }
        if self.options.durability == Durability::Fsync {
            if let Err(e) = self.file.sync_data() {
                // After a failed fsync the page cache may not match the disk: stop taking
                // writes rather than acknowledge something that may be gone.
                tracing::error!(error = %e, "fsync of the log failed; the log stops taking writes");
                self.healthy.store(false, Ordering::Relaxed);
                let error = StoreError::io("flushing the log failed", &e);
                for (_, done) in firsts {
                    let _ = done.send(Err(error.clone()));
                }
                return;
            }
        }
        self.file_len += buf.len() as u64;
        self.next_seq = seq;
        self.tail.send_replace(seq);
        for (first, done) in firsts {
            let _ = done.send(Ok(first));
        }
        if self.file_len >= self.options.segment_bytes {
            if let Err(e) = self.roll() {
                tracing::error!(error = %e, "cannot start a new log segment; writing on in the current one");
            }
        }
    }

    fn roll(&mut self) -> std::io::Result<()> {
        let path = segment_path(&self.dir, self.next_seq);
        let file = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&path)?;
        if self.options.durability == Durability::Fsync {
            self.file.sync_all()?;
            sync_dir(&self.dir)?;
        }
        self.file = file;
        self.file_len = 0;
        if let Ok(mut bases) = self.segments.lock() {
            bases.push(self.next_seq);
        }
        Ok(())
    }
}

struct EmbeddedReader {
    tail: watch::Receiver<Seq>,
    state: Option<ReadState>,
}

struct ReadState {
    dir: PathBuf,
    segments: Segments,
    file: BufReader<File>,
    next: Seq,
    payload: Vec<u8>,
}

impl ReadState {
    fn open(
        bus: &str,
        shard: u32,
        dir: PathBuf,
        segments: Segments,
        tail: Seq,
        from: Seq,
    ) -> Result<ReadState, StoreError> {
        let bases = segments.lock().map_err(poisoned)?.clone();
        let oldest = bases.first().copied().unwrap_or(0);
        let start = if from < oldest {
            tracing::warn!(
                bus,
                shard,
                from,
                oldest,
                "position is older than the log; starting at its oldest record"
            );
            oldest
        } else if from > tail {
            tracing::warn!(
                bus,
                shard,
                from,
                tail,
                "position is past the end of the log; starting at its end"
            );
            tail
        } else {
            from
        };
        let base = bases
            .iter()
            .rev()
            .find(|b| **b <= start)
            .copied()
            .unwrap_or(oldest);
        let mut state = ReadState {
            file: open_segment(&dir, base)?,
            dir,
            segments,
            next: base,
            payload: Vec::new(),
        };
        state.skip_to(start)?;
        Ok(state)
    }

    fn skip_to(&mut self, target: Seq) -> Result<(), StoreError> {
        while self.next < target {
            let mut header = [0u8; HEADER];
            self.file
                .read_exact(&mut header)
                .map_err(|e| StoreError::Corrupt(format!("seeking to record {target}: {e}")))?;
            let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
            self.file
                .seek_relative(i64::from(len))
                .map_err(|e| StoreError::io("seeking in a segment", &e))?;
            self.next += 1;
        }
        Ok(())
    }

    fn read(&mut self, max: usize, tail: Seq) -> Result<Vec<Record>, StoreError> {
        let mut records = Vec::new();
        while records.len() < max && self.next < tail {
            match read_record(&mut self.file, &mut self.payload) {
                Ok(Some(seq)) if seq == self.next => {
                    records.push(Record {
                        seq,
                        payload: Bytes::copy_from_slice(&self.payload),
                    });
                    self.next += 1;
                }
                Ok(Some(seq)) => {
                    return Err(StoreError::Corrupt(format!(
                        "expected record {} but found {seq}",
                        self.next
                    )))
                }
                // The end of a segment below the tail: the next segment starts here.
                Ok(None) => {
                    let next_segment = self
                        .segments
                        .lock()
                        .map_err(poisoned)?
                        .iter()
                        .any(|b| *b == self.next);
                    if !next_segment {
                        return Err(StoreError::Corrupt(format!(
                            "record {} is missing from the log",
                            self.next
                        )));
                    }
                    self.file = open_segment(&self.dir, self.next)?;
                }
                Err(e) => return Err(StoreError::Corrupt(format!("record {}: {e}", self.next))),
            }
        }
        Ok(records)
    }
}

fn open_segment(dir: &Path, base: Seq) -> Result<BufReader<File>, StoreError> {
    let path = segment_path(dir, base);
    File::open(&path)
        .map(|f| BufReader::with_capacity(256 * 1024, f))
        .map_err(|e| StoreError::io(&format!("cannot open {}", path.display()), &e))
}

#[async_trait]
impl ShardReader for EmbeddedReader {
    async fn read(&mut self, max: usize) -> Result<Vec<Record>, StoreError> {
        let tail = *self.tail.borrow();
        let Some(mut state) = self.state.take() else {
            return Err(StoreError::Unavailable(
                "the reader failed earlier".to_string(),
            ));
        };
        if state.next >= tail {
            self.state = Some(state);
            return Ok(Vec::new());
        }
        let (state, result) = tokio::task::spawn_blocking(move || {
            let result = state.read(max, tail);
            (state, result)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("read task failed: {e}")))?;
        self.state = Some(state);
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(segment_bytes: u64) -> LogOptions {
        LogOptions {
            durability: Durability::Fsync,
            segment_bytes,
            max_pending: 64,
        }
    }

    fn append(shard: u32, payloads: &[&str]) -> ShardAppend {
        ShardAppend {
            shard,
            records: payloads
                .iter()
                .map(|p| Bytes::from(p.to_string()))
                .collect(),
        }
    }

    async fn read_all(log: &EmbeddedLog, shard: u32, from: Seq) -> Vec<(Seq, String)> {
        let mut reader = log.reader(shard, from).await.unwrap();
        let mut out = Vec::new();
        loop {
            let batch = reader.read(3).await.unwrap();
            if batch.is_empty() {
                return out;
            }
            out.extend(
                batch
                    .into_iter()
                    .map(|r| (r.seq, String::from_utf8(r.payload.to_vec()).unwrap())),
            );
        }
    }

    #[tokio::test]
    async fn append_read_reopen_and_roll_segments() {
        let dir = tempfile::tempdir().unwrap();
        let log = EmbeddedLog::open("b", dir.path(), 2, &options(64)).unwrap();
        let results = log
            .append(vec![
                append(0, &["a", "b"]),
                append(1, &["x"]),
                append(0, &["c"]),
            ])
            .await;
        assert_eq!(
            results.into_iter().map(Result::unwrap).collect::<Vec<_>>(),
            vec![0, 0, 2]
        );
        for i in 0..20 {
            log.append(vec![append(0, &[&format!("event-{i}")])]).await[0]
                .as_ref()
                .unwrap();
        }
        assert_eq!(*log.tail(0).borrow(), 23);
        assert!(
            log.shards[0].segments.lock().unwrap().len() > 3,
            "segments rolled"
        );
        let all = read_all(&log, 0, 0).await;
        assert_eq!(all.len(), 23);
        assert_eq!(all[2], (2, "c".to_string()));
        assert_eq!(read_all(&log, 0, 20).await.len(), 3);
        log.close().await;
        drop(log);

        let log = EmbeddedLog::open("b", dir.path(), 2, &options(64)).unwrap();
        assert_eq!(*log.tail(0).borrow(), 23);
        assert_eq!(*log.tail(1).borrow(), 1);
        assert_eq!(read_all(&log, 0, 5).await[0], (5, "event-2".to_string()));
        // Releasing drops whole segments below the position, never records at or after it.
        let before = log.shards[0].segments.lock().unwrap().len();
        log.release(0, 20).await.unwrap();
        assert!(log.shards[0].segments.lock().unwrap().len() < before);
        assert_eq!(read_all(&log, 0, 20).await.len(), 3);
    }

    #[tokio::test]
    async fn torn_tail_is_cut_off_on_recovery() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = EmbeddedLog::open("b", dir.path(), 1, &options(1 << 20)).unwrap();
            log.append(vec![append(0, &["one", "two"])]).await[0]
                .as_ref()
                .unwrap();
            log.close().await;
        }
        let segment = segment_path(&dir.path().join("shard-0"), 0);
        let mut f = OpenOptions::new().append(true).open(&segment).unwrap();
        // Half a header and a garbage record: what a crash mid-write leaves.
        f.write_all(&[9, 0, 0, 0, 1, 2]).unwrap();
        drop(f);
        let log = EmbeddedLog::open("b", dir.path(), 1, &options(1 << 20)).unwrap();
        assert_eq!(*log.tail(0).borrow(), 2);
        log.append(vec![append(0, &["three"])]).await[0]
            .as_ref()
            .unwrap();
        let all = read_all(&log, 0, 0).await;
        assert_eq!(
            all.into_iter().map(|(_, p)| p).collect::<Vec<_>>(),
            vec!["one", "two", "three"]
        );
    }

    #[tokio::test]
    async fn corrupt_checksum_stops_recovery_at_that_record() {
        let dir = tempfile::tempdir().unwrap();
        {
            let log = EmbeddedLog::open("b", dir.path(), 1, &options(1 << 20)).unwrap();
            log.append(vec![append(0, &["aaaa", "bbbb"])]).await[0]
                .as_ref()
                .unwrap();
            log.close().await;
        }
        let segment = segment_path(&dir.path().join("shard-0"), 0);
        let mut bytes = fs::read(&segment).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&segment, bytes).unwrap();
        let log = EmbeddedLog::open("b", dir.path(), 1, &options(1 << 20)).unwrap();
        assert_eq!(*log.tail(0).borrow(), 1);
    }

    #[tokio::test]
    async fn full_queue_is_busy_not_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let mut opts = options(1 << 20);
        opts.max_pending = 1;
        let log = EmbeddedLog::open("b", dir.path(), 1, &opts).unwrap();
        let many: Vec<_> = (0..64).map(|_| append(0, &["x"])).collect();
        let results = log.append(many).await;
        assert!(results
            .iter()
            .any(|r| matches!(r, Err(StoreError::Busy(_)))));
        assert!(results.iter().any(|r| r.is_ok()));
    }
}
