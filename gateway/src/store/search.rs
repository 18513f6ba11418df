//! Searching a shard's log by what its records carry: the first record accepted after a
//! time (`first_after`, for retention by age, replays from a time and rollback recovery),
//! and the boundary below which a shard holds more than a size bound (`SizeWindow`).

use crate::store::{BusLog, Seq, StoreError};

/// The first seq in `[lo, hi)` whose record was accepted after `cutoff_ms` (`hi` if none):
/// every record below it was accepted at or before the cutoff. Acceptance times grow along
/// a shard; records stored without one count as old.
pub async fn first_after(
    log: &dyn BusLog,
    shard: u32,
    mut lo: Seq,
    mut hi: Seq,
    cutoff_ms: u64,
) -> Result<Seq, StoreError> {
    let end = hi;
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let mut reader = log.reader(shard, mid).await?;
        let record = reader.read(1).await?.into_iter().next();
        match record {
            // Trimmed up to `seq`: the record found stands for everything before it.
            Some(r) if r.accepted_ms <= cutoff_ms => lo = r.seq.max(mid) + 1,
            Some(_) => hi = mid,
            None => hi = mid,
        }
    }
    Ok(lo.min(end))
}

/// The passed records of a shard that a size retention keeps: the newest `max_bytes` of
/// them. Each record is counted once, as it is passed, into chunks of about 1/64 of the
/// bound; the boundary is the first chunk of the newest chunks that fit, so what is kept
/// lies within one chunk below the bound. A window that has not yet counted everything up
/// to the committed position (a new owner, a large backlog) only errs on keeping more.
#[derive(Debug, Default)]
pub struct SizeWindow {
    /// Records below it are counted (`None`: not started; it starts at the log's start).
    scanned: Option<Seq>,
    /// First seq and bytes of each chunk, oldest first.
    chunks: std::collections::VecDeque<(Seq, u64)>,
    total: u64,
}

/// At most this much is read per shard per release round, so counting a large backlog
/// never holds the worker loop long.
const SIZE_SCAN_BUDGET: u64 = 256 * 1024 * 1024;

impl SizeWindow {
    /// Counts the records passed up to `upto` and returns the position below which
    /// records may go (everything from it to `upto` fits in `max_bytes`).
    pub async fn advance(
        &mut self,
        log: &dyn BusLog,
        shard: u32,
        upto: Seq,
        max_bytes: u64,
    ) -> Result<Seq, StoreError> {
        if self.scanned.is_some_and(|scanned| upto < scanned) {
            // Positions went back (a reset): count again.
            *self = SizeWindow::default();
        }
        let mut scanned = match self.scanned {
            Some(scanned) => scanned,
            None => log.start(shard).await?.min(upto),
        };
        let chunk_limit = (max_bytes / 64).max(1);
        let mut read = 0u64;
        if scanned < upto {
            let mut reader = log.reader(shard, scanned).await?;
            'scan: while scanned < upto && read < SIZE_SCAN_BUDGET {
                let records = reader.read(512).await?;
                if records.is_empty() {
                    break;
                }
                for record in records {
                    if record.seq >= upto {
                        break 'scan;
                    }
                    let size = record.payload.len() as u64;
                    read += size;
                    match self.chunks.back_mut() {
                        Some(last) if last.1 + size <= chunk_limit => last.1 += size,
                        _ => self.chunks.push_back((record.seq, size)),
                    }
                    self.total += size;
                    scanned = record.seq + 1;
                }
            }
        }
        self.scanned = Some(scanned);
        while self.total > max_bytes {
            let Some((_, bytes)) = self.chunks.pop_front() else {
                break;
            };
            self.total -= bytes;
        }
        Ok(self.chunks.front().map_or(scanned, |c| c.0))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bytes::Bytes;

    use super::*;
    use crate::store::embedded::{DataDir, LogOptions};
    use crate::store::{Durability, ShardAppend};

    async fn log_with(
        dir: &std::path::Path,
        records: usize,
        size: usize,
    ) -> (DataDir, Arc<dyn BusLog>) {
        let data = DataDir::open(dir).unwrap();
        let options = LogOptions {
            durability: Durability::Os,
            // Small segments, so a release deletes some of them.
            segment_bytes: 4096,
            cache_bytes: 1024,
        };
        let log: Arc<dyn BusLog> = Arc::new(data.open_bus("b", 1, &options).unwrap());
        // Ten records per append, so the log rolls segments as it goes.
        for first in (0..records).step_by(10) {
            let appends = vec![ShardAppend {
                shard: 0,
                records: (first..(first + 10).min(records))
                    .map(|i| Bytes::from(format!("{i:0size$}")))
                    .collect(),
            }];
            for r in log.append(appends).await {
                r.unwrap();
            }
        }
        (data, log)
    }

    #[tokio::test]
    async fn a_size_window_keeps_the_newest_bytes_of_what_was_passed() {
        let dir = tempfile::tempdir().unwrap();
        let (_data, log) = log_with(dir.path(), 1000, 100).await;
        let mut window = SizeWindow::default();
        // Nothing passed yet: nothing may go.
        assert_eq!(window.advance(log.as_ref(), 0, 0, 10_000).await.unwrap(), 0);
        // 500 records of 100 bytes passed, 10,000 bytes kept: the newest 100 records (to
        // within one chunk of 10,000 / 64 bytes, i.e. one record).
        let boundary = window.advance(log.as_ref(), 0, 500, 10_000).await.unwrap();
        assert!((400..=401).contains(&boundary), "{boundary}");
        // Counting goes on from where it was; the bound holds as more is passed.
        let boundary = window.advance(log.as_ref(), 0, 1000, 10_000).await.unwrap();
        assert!((900..=901).contains(&boundary), "{boundary}");
        log.release(0, boundary).await.unwrap();
        assert!(log.start(0).await.unwrap() > 0, "old segments were deleted");
        // A new owner counts from the log's start without going below what it holds.
        let mut fresh = SizeWindow::default();
        let again = fresh.advance(log.as_ref(), 0, 1000, 10_000).await.unwrap();
        assert!((900..=901).contains(&again), "{again}");
        // A bound smaller than one record keeps nothing.
        let mut tiny = SizeWindow::default();
        assert_eq!(tiny.advance(log.as_ref(), 0, 1000, 50).await.unwrap(), 1000);
    }
}
