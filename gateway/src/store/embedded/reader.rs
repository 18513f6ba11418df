//! Readers of the embedded log: from the shard's in-memory cache of recent records while
//! they keep up, else from the segment files (off the async threads), skipping what a
//! damaged segment lost. Also what the writer shares with them: the segment list, the
//! cache, the lock helpers.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufReader, ErrorKind, Read};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use crate::store::embedded::segment::{open_segment, read_record, HEADER};
use crate::store::{Record, Seq, ShardReader, StoreError};

/// Segment base sequence numbers of one shard, oldest first; shared by writer and readers.
pub(super) type Segments = Arc<Mutex<Vec<Seq>>>;

/// Recent records, oldest first, bounded by bytes.
pub(super) struct Cache {
    pub(super) records: VecDeque<(Seq, u64, Bytes)>,
    pub(super) bytes: usize,
    /// The first sequence number the cache can answer for.
    pub(super) first: Seq,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section leaves its data consistent before anything can panic, so a
    // poisoned lock still guards valid state.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(super) fn poisoned<T>(_: T) -> StoreError {
    StoreError::Unavailable("a log lock was poisoned".to_string())
}

/// A reader of one shard of an [`EmbeddedLog`](crate::store::embedded::EmbeddedLog).
pub(super) struct EmbeddedReader {
    bus: String,
    shard: u32,
    dir: PathBuf,
    segments: Segments,
    cache: Arc<Mutex<Cache>>,
    tail: watch::Receiver<Seq>,
    next: Seq,
    /// Positioned file reader for records no longer cached; opened on demand.
    file: Option<ReadState>,
    /// Most payload bytes one read returns (at least one record).
    max_bytes: usize,
}

/// Where a shard lives, as a reader needs it: its directory, segment list, cache and tail.
pub(super) struct ShardView {
    pub(super) dir: PathBuf,
    pub(super) segments: Segments,
    pub(super) cache: Arc<Mutex<Cache>>,
    pub(super) tail: watch::Receiver<Seq>,
}

impl EmbeddedReader {
    /// A reader of shard `shard` of bus `bus` that starts at `from`.
    pub(super) fn new(bus: &str, shard: u32, view: ShardView, from: Seq) -> EmbeddedReader {
        EmbeddedReader {
            bus: bus.to_string(),
            shard,
            dir: view.dir,
            segments: view.segments,
            cache: view.cache,
            tail: view.tail,
            next: from,
            file: None,
            max_bytes: crate::store::DEFAULT_READ_BYTES,
        }
    }
}

impl EmbeddedReader {
    /// Records `[next, limit)` from the cache, if it still holds `next`.
    fn cached(&self, limit: Seq) -> Option<Vec<Record>> {
        let cache = lock(&self.cache);
        let front = cache.records.front()?.0;
        if self.next < front || self.next < cache.first {
            return None;
        }
        let start = usize::try_from(self.next - front).ok()?;
        let mut bytes = 0;
        let records: Vec<Record> = cache
            .records
            .iter()
            .skip(start)
            .take_while(|(seq, _, payload)| {
                let room = bytes < self.max_bytes;
                bytes += payload.len().max(1);
                *seq < limit && room
            })
            .map(|(seq, accepted_ms, payload)| Record {
                seq: *seq,
                payload: payload.clone(),
                accepted_ms: *accepted_ms,
            })
            .collect();
        (!records.is_empty()).then_some(records)
    }
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
            let skipped = self.file.read_exact(&mut header).and_then(|()| {
                let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
                self.file.seek_relative(i64::from(len))
            });
            match skipped {
                Err(e) if damaged(&e) => self.skip_lost(&e.to_string())?,
                Err(e) => return Err(StoreError::io("seeking in a segment", &e)),
                Ok(()) => self.next += 1,
            }
        }
        Ok(())
    }

    /// The records from `next` to the end of its segment cannot be read (recovery logged
    /// the damage): goes on at the next segment, if there is one, so one damaged segment
    /// cannot stall a subscription forever. Within the newest segment it is an error.
    fn skip_lost(&mut self, why: &str) -> Result<(), StoreError> {
        let next_base = self
            .segments
            .lock()
            .map_err(poisoned)?
            .iter()
            .copied()
            .find(|b| *b > self.next);
        let Some(next_base) = next_base else {
            return Err(StoreError::Corrupt(format!("record {}: {why}", self.next)));
        };
        tracing::error!(
            lost_from = self.next,
            lost_to = next_base,
            reason = why,
            "skipping records a damaged log segment lost"
        );
        self.file = open_segment(&self.dir, next_base)?;
        self.next = next_base;
        Ok(())
    }

    /// Up to `max` records, stopping once they hold `max_bytes` of payload (so the last
    /// one may go past it).
    fn read(
        &mut self,
        max: usize,
        max_bytes: usize,
        limit: Seq,
    ) -> Result<Vec<Record>, StoreError> {
        let mut records = Vec::new();
        let mut bytes = 0;
        while records.len() < max && self.next < limit && bytes < max_bytes {
            match read_record(&mut self.file, &mut self.payload) {
                Ok(Some(seq)) if seq == self.next => {
                    bytes += self.payload.len().max(1);
                    records.push(Record::from_stored(
                        seq,
                        Bytes::copy_from_slice(&self.payload),
                    ));
                    self.next += 1;
                }
                Ok(Some(seq)) => {
                    self.skip_lost(&format!("found record {seq} in its place"))?;
                }
                // The end of a segment below the tail: the next segment starts here.
                Ok(None) => {
                    let next_segment = self.segments.lock().map_err(poisoned)?.contains(&self.next);
                    if next_segment {
                        self.file = open_segment(&self.dir, self.next)?;
                    } else {
                        self.skip_lost("the segment ends before it")?;
                    }
                }
                Err(e) if damaged(&e) => self.skip_lost(&e.to_string())?,
                Err(e) => return Err(StoreError::io("reading a segment", &e)),
            }
        }
        Ok(records)
    }
}

/// A record that does not check out (as opposed to a failing read).
fn damaged(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::InvalidData | ErrorKind::UnexpectedEof)
}

#[async_trait]
impl ShardReader for EmbeddedReader {
    fn set_max_bytes(&mut self, bytes: usize) {
        self.max_bytes = bytes.max(1);
    }

    async fn read(&mut self, max: usize) -> Result<Vec<Record>, StoreError> {
        let tail = *self.tail.borrow();
        if self.next >= tail {
            return Ok(Vec::new());
        }
        let limit = tail.min(self.next.saturating_add(max as Seq));
        if let Some(records) = self.cached(limit) {
            self.next = records.last().map_or(self.next, |r| r.seq + 1);
            return Ok(records);
        }
        // Behind the cache: read the segment files, off the async threads.
        let state = match self.file.take() {
            Some(state) if state.next == self.next => state,
            _ => {
                let (bus, shard, dir, segments, from) = (
                    self.bus.clone(),
                    self.shard,
                    self.dir.clone(),
                    self.segments.clone(),
                    self.next,
                );
                tokio::task::spawn_blocking(move || {
                    ReadState::open(&bus, shard, dir, segments, tail, from)
                })
                .await
                .map_err(|e| StoreError::Unavailable(format!("reader task failed: {e}")))??
            }
        };
        // Up to the tail, not `limit`: skipping a damaged stretch moves past `next + max`.
        let max_bytes = self.max_bytes;
        let (state, result) = tokio::task::spawn_blocking(move || {
            let mut state = state;
            let result = state.read(max, max_bytes, tail);
            (state, result)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("read task failed: {e}")))?;
        self.next = state.next;
        self.file = Some(state);
        result
    }

    async fn read_wait(&mut self, max: usize, wait: Duration) -> Result<Vec<Record>, StoreError> {
        let records = self.read(max).await?;
        if !records.is_empty() {
            return Ok(records);
        }
        let next = self.next;
        let waited = tokio::time::timeout(wait, self.tail.wait_for(|tail| *tail > next))
            .await
            .map(|r| r.is_ok());
        match waited {
            Ok(true) => self.read(max).await,
            // The log is closing: nothing more will come.
            Ok(false) => {
                tokio::time::sleep(wait).await;
                Ok(Vec::new())
            }
            Err(_) => Ok(Vec::new()),
        }
    }
}
