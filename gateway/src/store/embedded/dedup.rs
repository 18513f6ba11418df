//! Deduplication standalone: [`MemoryDedup`], a map in the process whose confirmed records
//! are kept in `webhook-dedup.jsonl` in the data directory (see `store::dedup`).

use std::collections::{BTreeSet, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use crate::store::dedup::{key, token, Dedup, Reserve, DEFAULT_MAX_BYTES, RESERVATION};
use crate::store::StoreError;

/// Memory one record takes, estimated: its map entry (16-byte key, state, expiry, table
/// overhead), and its place in the eviction order.
const RECORD_BYTES: usize = 96;
const ORDER_BYTES: usize = 48;

/// Bytes of one record in the file (`line`, with a 13-digit time).
const LINE_BYTES: usize = 60;

/// The file is compacted once it is larger than twice its live records, and this.
const COMPACT_FLOOR: u64 = 1024 * 1024;

enum Held {
    Pending(String),
    Done,
}

/// A key as the map holds it: the 128 bits [`key`] spells in hex. Any other text (keys
/// made before keys were hashed, tests' names) is hashed to 128 bits the same way.
fn slot(key: &str) -> u128 {
    if key.len() == 32 {
        if let Ok(v) = u128::from_str_radix(key, 16) {
            return v;
        }
    }
    u128::from_str_radix(&self::key(&[key]), 16).unwrap_or(0)
}

#[derive(Default)]
struct Records {
    entries: HashMap<u128, (Held, Instant)>,
    /// Every confirmed record by its expiry, the soonest first: expired records leave
    /// from the front exactly, whatever mix of windows, and past the memory bound the
    /// records closest to the end of their window go first.
    order: BTreeSet<(Instant, u128)>,
}

impl Records {
    fn bytes(&self) -> usize {
        self.entries
            .len()
            .saturating_mul(RECORD_BYTES)
            .saturating_add(self.order.len().saturating_mul(ORDER_BYTES))
    }

    /// Drops the record an entry of `order` points at if it is still that one.
    fn drop_ordered(&mut self, slot: u128, until: Instant) -> bool {
        match self.entries.get(&slot) {
            Some((Held::Done, u)) if *u == until => {
                self.entries.remove(&slot);
                true
            }
            _ => false,
        }
    }
}

/// Standalone: in the process, with confirmed records kept in a file when `persistent`.
pub struct MemoryDedup {
    records: Arc<Mutex<Records>>,
    file: Option<Arc<DedupFile>>,
    max_bytes: usize,
}

impl Default for MemoryDedup {
    fn default() -> Self {
        MemoryDedup::bounded(DEFAULT_MAX_BYTES)
    }
}

/// The file of confirmed records, appended to and compacted.
struct DedupFile {
    path: PathBuf,
    append: Mutex<std::fs::File>,
    /// Its size now.
    bytes: std::sync::atomic::AtomicU64,
    /// Compacted once larger than twice its live records and this.
    floor: u64,
    /// While a compaction writes the new file, records appended to the old one are also
    /// kept here, to be added to the new one before it replaces the old.
    during: Mutex<Option<Vec<u8>>>,
    compacting: AtomicBool,
}

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn millis_of(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One record of the file: `{"k":"<32 hex>","u":<until, ms since the epoch>}`.
fn line(slot: u128, until_ms: u64) -> String {
    format!("{{\"k\":\"{slot:032x}\",\"u\":{until_ms}}}\n")
}

fn io_error(what: &str, e: &std::io::Error) -> StoreError {
    StoreError::Unavailable(format!("dedup file: {what}: {e}"))
}

/// Opens (creating it, readable by the owner only) the file to append records to.
fn open_append(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt as _;
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// Replaces `path` with `bytes` atomically: written aside, synced, renamed, directory
/// synced.
fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let (aside, mut file) = create_aside(path)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    put_in_place(&aside, path)
}

/// The file a new version of `path` is written to before [`put_in_place`]: `.jsonl.tmp`
/// beside it, created empty, readable by the owner only.
fn create_aside(path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let aside = path.with_extension("jsonl.tmp");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(&aside)?;
    Ok((aside, file))
}

/// Renames `aside` (written and synced) over `path`, then syncs the directory.
fn put_in_place(aside: &Path, path: &Path) -> std::io::Result<()> {
    std::fs::rename(aside, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

impl MemoryDedup {
    /// In memory only, at most `max_bytes` of records.
    pub fn bounded(max_bytes: usize) -> MemoryDedup {
        MemoryDedup {
            records: Arc::new(Mutex::new(Records::default())),
            file: None,
            max_bytes: max_bytes.max(RECORD_BYTES + ORDER_BYTES),
        }
    }

    /// Loads the records of `path` that have not expired, rewrites the file with only them,
    /// and appends every new confirmed record to it.
    pub fn persistent(path: &Path, max_bytes: usize) -> std::io::Result<MemoryDedup> {
        MemoryDedup::persistent_with_floor(path, max_bytes, COMPACT_FLOOR)
    }

    fn persistent_with_floor(
        path: &Path,
        max_bytes: usize,
        floor: u64,
    ) -> std::io::Result<MemoryDedup> {
        let now_ms = unix_ms();
        let now = Instant::now();
        let mut live: Vec<(u128, u64)> = Vec::new();
        match std::fs::read_to_string(path) {
            Ok(text) => {
                for line in text.lines() {
                    // A torn last line (a crash mid-write) is skipped.
                    let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
                        continue;
                    };
                    let (Some(key), Some(until)) = (
                        record.get("k").and_then(|k| k.as_str()),
                        record.get("u").and_then(serde_json::Value::as_u64),
                    ) else {
                        continue;
                    };
                    // Records of keys in clear (before keys were hashed) can match no
                    // key made now: dropped.
                    if key.len() != 32 {
                        continue;
                    }
                    let Ok(slot) = u128::from_str_radix(key, 16) else {
                        continue;
                    };
                    if until > now_ms {
                        live.push((slot, until));
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        live.sort_by_key(|(_, until)| *until);
        let mut records = Records::default();
        let mut text = String::with_capacity(live.len() * LINE_BYTES);
        for (slot, until) in live {
            let Some(at) = now.checked_add(Duration::from_millis(until - now_ms)) else {
                continue;
            };
            records.entries.insert(slot, (Held::Done, at));
            records.order.insert((at, slot));
            text.push_str(&line(slot, until));
        }
        replace(path, text.as_bytes())?;
        let append = open_append(path)?;
        let dedup = MemoryDedup {
            records: Arc::new(Mutex::new(records)),
            file: Some(Arc::new(DedupFile {
                path: path.to_path_buf(),
                append: Mutex::new(append),
                bytes: std::sync::atomic::AtomicU64::new(text.len() as u64),
                floor,
                during: Mutex::new(None),
                compacting: AtomicBool::new(false),
            })),
            max_bytes: max_bytes.max(RECORD_BYTES + ORDER_BYTES),
        };
        dedup.with(|_| ());
        dedup.report_file();
        Ok(dedup)
    }

    fn report_file(&self) {
        if let Some(file) = &self.file {
            let bytes = file.bytes.load(Ordering::Relaxed);
            crate::metrics::get()
                .dedup_file
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
    }

    fn record(&self, slot: u128, window: Duration) -> Result<(), StoreError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        let until = unix_ms().saturating_add(millis_of(window));
        let line = line(slot, until);
        {
            let mut append = file.append.lock().unwrap_or_else(|p| p.into_inner());
            append
                .write_all(line.as_bytes())
                .map_err(|e| io_error("append", &e))?;
            if let Some(during) = file
                .during
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_mut()
            {
                during.extend_from_slice(line.as_bytes());
            }
        }
        let bytes = file.bytes.fetch_add(line.len() as u64, Ordering::Relaxed) + line.len() as u64;
        self.report_file();
        let live = {
            let records = self.records.lock().unwrap_or_else(|p| p.into_inner());
            records.entries.len() as u64 * line.len() as u64
        };
        if bytes > file.floor.max(live.saturating_mul(2))
            && !file.compacting.swap(true, Ordering::AcqRel)
        {
            let (records, file) = (self.records.clone(), file.clone());
            let compact = move || match compact(&records, &file) {
                Ok(()) => file.compacting.store(false, Ordering::Release),
                // Not tried again on every record: the start compacts it anyway.
                Err(e) => {
                    tracing::warn!(path = %file.path.display(), error = %e, "cannot compact the dedup file; it keeps growing until the next start")
                }
            };
            // Off the request path when there is a runtime to take it.
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    runtime.spawn_blocking(compact);
                }
                Err(_) => compact(),
            }
        }
        Ok(())
    }

    fn with<R>(&self, f: impl FnOnce(&mut Records) -> R) -> R {
        let mut records = self.records.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        // Reservations nobody confirmed nor released (a request that died): swept when the
        // map has grown, not on every call. Confirmed records leave by `order`.
        if records.entries.len() > 1024 && records.entries.len().is_power_of_two() {
            records
                .entries
                .retain(|_, (held, until)| matches!(held, Held::Done) || *until > now);
        }
        while let Some(&(until, slot)) = records.order.first() {
            if until > now {
                break;
            }
            records.order.pop_first();
            records.drop_ordered(slot, until);
        }
        let out = f(&mut records);
        // Past the bound, the records nearest the end of their window go before it.
        let mut evicted = 0u64;
        while records.bytes() > self.max_bytes {
            let Some((until, slot)) = records.order.pop_first() else {
                break;
            };
            if records.drop_ordered(slot, until) {
                evicted += 1;
            }
        }
        if self.file.is_some() {
            let metrics = crate::metrics::get();
            if evicted > 0 {
                metrics.dedup_evicted.inc_by(evicted);
            }
            let (entries, memory) = metrics.dedup_series(&[]);
            entries.set(i64::try_from(records.entries.len()).unwrap_or(i64::MAX));
            memory.set(i64::try_from(records.bytes()).unwrap_or(i64::MAX));
        }
        out
    }

    /// Rewrites the file with only the live records now (tests; `record` does it as the
    /// file grows).
    #[cfg(test)]
    fn compact_now(&self) -> Result<(), StoreError> {
        let Some(file) = &self.file else {
            return Ok(());
        };
        compact(&self.records, file).map_err(|e| io_error("compact", &e))?;
        self.report_file();
        Ok(())
    }
}

/// Writes the live records aside, adds what was appended meanwhile, and swaps the file in.
/// Appends wait only for the last step (the records appended during the rewrite, a sync and
/// a rename), not for the rewrite.
fn compact(records: &Mutex<Records>, file: &DedupFile) -> std::io::Result<()> {
    *file.during.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
    let now = Instant::now();
    let now_ms = unix_ms();
    let text = {
        let records = records.lock().unwrap_or_else(|p| p.into_inner());
        let mut text = Vec::with_capacity(records.entries.len() * LINE_BYTES);
        for (until, slot) in &records.order {
            if *until > now
                && matches!(records.entries.get(slot), Some((Held::Done, u)) if u == until)
            {
                let left = millis_of(until.saturating_duration_since(now));
                text.extend_from_slice(line(*slot, now_ms.saturating_add(left)).as_bytes());
            }
        }
        text
    };
    let written = (|| {
        let (aside, mut new) = create_aside(&file.path)?;
        new.write_all(&text)?;
        new.sync_data()?;
        let mut append = file.append.lock().unwrap_or_else(|p| p.into_inner());
        let during = file
            .during
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        new.write_all(&during)?;
        new.sync_all()?;
        put_in_place(&aside, &file.path)?;
        *append = open_append(&file.path)?;
        let size = (text.len() + during.len()) as u64;
        file.bytes.store(size, Ordering::Relaxed);
        Ok::<u64, std::io::Error>(size)
    })();
    // Whatever happened, appends stop being copied.
    file.during.lock().unwrap_or_else(|p| p.into_inner()).take();
    let size = written?;
    let metrics = crate::metrics::get();
    metrics.dedup_compactions.inc();
    metrics
        .dedup_file
        .set(i64::try_from(size).unwrap_or(i64::MAX));
    Ok(())
}

#[async_trait]
impl Dedup for MemoryDedup {
    async fn reserve(&self, key: &str) -> Result<Reserve, StoreError> {
        let slot = slot(key);
        Ok(self.with(|records| {
            let now = Instant::now();
            match records.entries.get(&slot) {
                Some((Held::Done, until)) if *until > now => Reserve::Duplicate,
                Some((Held::Pending(_), until)) if *until > now => Reserve::InFlight,
                _ => {
                    let t = token();
                    records
                        .entries
                        .insert(slot, (Held::Pending(t.clone()), now + RESERVATION));
                    Reserve::Taken(t)
                }
            }
        }))
    }

    async fn confirm(&self, key: &str, token: &str, window: Duration) -> Result<(), StoreError> {
        let slot = slot(key);
        let ours = self.with(|records| {
            let ours =
                matches!(records.entries.get(&slot), Some((Held::Pending(t), _)) if t == token);
            if ours {
                let until = Instant::now() + window;
                records.entries.insert(slot, (Held::Done, until));
                records.order.insert((until, slot));
            }
            ours
        });
        if ours && !window.is_zero() {
            self.record(slot, window)?;
        }
        Ok(())
    }

    async fn release(&self, key: &str, token: &str) -> Result<(), StoreError> {
        let slot = slot(key);
        self.with(|records| {
            if matches!(records.entries.get(&slot), Some((Held::Pending(t), _)) if t == token) {
                records.entries.remove(&slot);
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[tokio::test]
    async fn a_record_exists_only_once_confirmed() {
        let d = MemoryDedup::default();
        let Reserve::Taken(t) = d.reserve("a").await.unwrap() else {
            panic!("not taken")
        };
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::InFlight);
        d.release("a", &t).await.unwrap();
        let Reserve::Taken(t) = d.reserve("a").await.unwrap() else {
            panic!("not taken after release")
        };
        d.confirm("a", &t, Duration::from_secs(60)).await.unwrap();
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::Duplicate);
        d.release("a", &t).await.unwrap();
        assert_eq!(d.reserve("a").await.unwrap(), Reserve::Duplicate);
        let Reserve::Taken(t) = d.reserve("b").await.unwrap() else {
            panic!()
        };
        d.confirm("b", &t, Duration::ZERO).await.unwrap();
        assert!(matches!(d.reserve("b").await.unwrap(), Reserve::Taken(_)));
    }

    #[tokio::test]
    async fn confirmed_records_survive_a_reopen_until_they_expire() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup.jsonl");
        let d = MemoryDedup::persistent(&path, DEFAULT_MAX_BYTES).unwrap();
        for (key, window) in [("kept\nline", 3_600_000), ("short", 1)] {
            let Reserve::Taken(t) = d.reserve(key).await.unwrap() else {
                panic!()
            };
            d.confirm(key, &t, Duration::from_millis(window))
                .await
                .unwrap();
        }
        let Reserve::Taken(_) = d.reserve("pending").await.unwrap() else {
            panic!()
        };
        drop(d);
        std::thread::sleep(Duration::from_millis(5));
        let d = MemoryDedup::persistent(&path, DEFAULT_MAX_BYTES).unwrap();
        assert_eq!(d.reserve("kept\nline").await.unwrap(), Reserve::Duplicate);
        assert!(matches!(
            d.reserve("short").await.unwrap(),
            Reserve::Taken(_)
        ));
        assert!(matches!(
            d.reserve("pending").await.unwrap(),
            Reserve::Taken(_)
        ));
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
    }

    async fn confirm(d: &MemoryDedup, key: &str, window: Duration) {
        let Reserve::Taken(t) = d.reserve(key).await.unwrap() else {
            panic!("{key} not taken")
        };
        d.confirm(key, &t, window).await.unwrap();
    }

    #[tokio::test]
    async fn the_file_is_compacted_without_expired_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dedup.jsonl");
        // Never on its own here: compacted by hand.
        let d = MemoryDedup::persistent_with_floor(&path, DEFAULT_MAX_BYTES, u64::MAX).unwrap();
        for i in 0..40 {
            confirm(&d, &key(&[&format!("short-{i}")]), Duration::from_millis(1)).await;
        }
        confirm(&d, &key(&["kept"]), Duration::from_secs(3600)).await;
        std::thread::sleep(Duration::from_millis(5));
        let before = std::fs::metadata(&path).unwrap().len();
        assert!(before >= 41 * 50, "{before}");
        d.compact_now().unwrap();
        let after = std::fs::read_to_string(&path).unwrap();
        assert_eq!(after.lines().count(), 1, "{after}");
        assert!(after.len() < LINE_BYTES + 4, "{}", after.len());
        // Appends after a compaction go to the new file, and survive a reopen.
        confirm(&d, &key(&["later"]), Duration::from_secs(3600)).await;
        drop(d);
        let d = MemoryDedup::persistent(&path, DEFAULT_MAX_BYTES).unwrap();
        assert_eq!(
            d.reserve(&key(&["kept"])).await.unwrap(),
            Reserve::Duplicate
        );
        assert_eq!(
            d.reserve(&key(&["later"])).await.unwrap(),
            Reserve::Duplicate
        );

        // Growing past its floor (1 KiB here) and twice its live records, it compacts on
        // its own.
        let d = MemoryDedup::persistent_with_floor(&path, DEFAULT_MAX_BYTES, 1024).unwrap();
        for i in 0..200 {
            confirm(&d, &key(&[&format!("n-{i}")]), Duration::from_millis(1)).await;
            std::thread::sleep(Duration::from_millis(2));
        }
        let size = std::fs::metadata(&path).unwrap().len();
        assert!(
            size < 2048,
            "never compacted: {size} bytes; {} records",
            d.records.lock().unwrap().entries.len()
        );
    }

    #[tokio::test]
    async fn past_the_memory_bound_the_oldest_records_go_first() {
        let d = MemoryDedup::bounded(10 * (RECORD_BYTES + ORDER_BYTES));
        for i in 0..15 {
            confirm(&d, &key(&[&i.to_string()]), Duration::from_secs(3600)).await;
        }
        // The oldest were dropped early (a late duplicate of them is taken again); the
        // newest are still duplicates.
        assert!(matches!(
            d.reserve(&key(&["0"])).await.unwrap(),
            Reserve::Taken(_)
        ));
        assert_eq!(d.reserve(&key(&["14"])).await.unwrap(), Reserve::Duplicate);
        let records = d.records.lock().unwrap();
        assert!(records.bytes() <= 10 * (RECORD_BYTES + ORDER_BYTES));
    }
}
