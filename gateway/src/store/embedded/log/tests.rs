//! The embedded log's tests: records, recovery, group commit and its failures.

use super::*;
use crate::store::embedded::segment::HEADER;

fn options(segment_bytes: u64) -> LogOptions {
    LogOptions {
        durability: Durability::Fsync,
        segment_bytes,
        // Small, so tests read both from the cache and from the files.
        cache_bytes: 40,
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
        append_one(&log, &[&format!("event-{i}")]).await;
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

fn open_one(dir: &Path) -> EmbeddedLog {
    EmbeddedLog::open("b", dir, 1, &options(1 << 20)).unwrap()
}

async fn append_one(log: &EmbeddedLog, payloads: &[&str]) {
    log.append(vec![append(0, payloads)]).await[0]
        .as_ref()
        .unwrap();
}

/// Writes `payloads` to a new one-shard log in `dir`, closed or (`close` false) dropped
/// as by SIGKILL; the path of its segment.
async fn write_one_segment(dir: &Path, payloads: &[&str], close: bool) -> PathBuf {
    let log = open_one(dir);
    append_one(&log, payloads).await;
    if close {
        log.close().await;
    }
    segment_path(&dir.join("shard-0"), 0)
}

/// Reopens the log of [`write_one_segment`]: it must recover `one` and `two` (and
/// nothing after them), and take `three` next.
async fn assert_recovers_one_two(dir: &Path) {
    let log = open_one(dir);
    assert_eq!(*log.tail(0).borrow(), 2);
    append_one(&log, &["three"]).await;
    let all: Vec<String> = read_all(&log, 0, 0)
        .await
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    assert_eq!(all, vec!["one", "two", "three"]);
}

#[tokio::test]
async fn torn_tail_is_cut_off_on_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let segment = write_one_segment(dir.path(), &["one", "two"], true).await;
    use std::io::Write;
    let mut f = OpenOptions::new().append(true).open(&segment).unwrap();
    // Half a header and a garbage record: what a crash mid-write leaves.
    f.write_all(&[9, 0, 0, 0, 1, 2]).unwrap();
    drop(f);
    assert_recovers_one_two(dir.path()).await;
}

#[tokio::test]
async fn a_crash_leaves_zero_filled_space_that_recovery_ignores() {
    let dir = tempfile::tempdir().unwrap();
    // Dropped without close, as by SIGKILL: the file still has its zeroed chunk.
    let segment = write_one_segment(dir.path(), &["one", "two"], false).await;
    assert!(fs::metadata(&segment).unwrap().len() >= PREALLOCATE);
    assert_recovers_one_two(dir.path()).await;
}

#[tokio::test]
async fn corrupt_checksum_stops_recovery_at_that_record() {
    let dir = tempfile::tempdir().unwrap();
    let segment = write_one_segment(dir.path(), &["aaaa", "bbbb"], true).await;
    let mut bytes = fs::read(&segment).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    fs::write(&segment, bytes).unwrap();
    let log = open_one(dir.path());
    assert_eq!(*log.tail(0).borrow(), 1);
}

#[tokio::test]
async fn concurrent_appends_share_flushes_and_stay_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let log = std::sync::Arc::new(open_one(dir.path()));
    let mut tasks = Vec::new();
    for t in 0..8 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..50 {
                append_one(&log, &[&format!("{t}-{i}")]).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let all = read_all(&log, 0, 0).await;
    assert_eq!(all.len(), 400);
    assert!(all.iter().enumerate().all(|(i, (seq, _))| *seq == i as Seq));
    for t in 0..8 {
        let mine: Vec<_> = all
            .iter()
            .filter_map(|(_, p)| {
                p.strip_prefix(&format!("{t}-"))
                    .map(|i| i.parse::<u32>().unwrap())
            })
            .collect();
        assert_eq!(
            mine,
            (0..50).collect::<Vec<_>>(),
            "each producer's order is kept"
        );
    }
}

#[tokio::test]
async fn a_failed_flush_fails_every_waiting_appender_and_fences_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log = std::sync::Arc::new(open_one(dir.path()));
    log.fail_syncs.store(1, Ordering::SeqCst);
    let mut tasks = Vec::new();
    for t in 0..8 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            log.append(vec![append(0, &[&format!("{t}")])])
                .await
                .remove(0)
        }));
    }
    let mut failed = 0;
    for t in tasks {
        if t.await.unwrap().is_err() {
            failed += 1;
        }
    }
    // Only one flush failed; a second flush of the same file succeeds on Linux, which
    // is exactly why the appenders queued behind the failed one must not try again.
    assert_eq!(log.fail_syncs.load(Ordering::SeqCst), 0);
    assert_eq!(
        failed, 8,
        "every appender waiting on the failed flush fails"
    );
    assert_eq!(*log.tail(0).borrow(), 0, "nothing was published to readers");
    assert!(!log.healthy());
    let err = log.append(vec![append(0, &["later"])]).await.remove(0);
    assert!(err.unwrap_err().to_string().contains("restart"));
    drop(log);
    // A restart re-verifies the segment: what made it to disk is kept (never
    // acknowledged, so delivering it is at-least-once, not a lie).
    let log = open_one(dir.path());
    assert!(log.healthy());
    append_one(&log, &["after restart"]).await;
}

#[tokio::test]
async fn shards_share_flush_rounds_and_a_failed_flush_fences_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let log =
        std::sync::Arc::new(EmbeddedLog::open("b", dir.path(), 4, &options(1 << 20)).unwrap());
    // Concurrent appenders on four shards: every record durable, in order per shard.
    let mut tasks = Vec::new();
    for t in 0..16u32 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let result = log
                    .append(vec![append(t % 4, &[&format!("{t}-{i}")])])
                    .await
                    .remove(0);
                result.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for shard in 0..4 {
        assert_eq!(read_all(&log, shard, 0).await.len(), 100);
        assert_eq!(*log.tail(shard).borrow(), 100);
    }
    // The log's flusher ends once nothing more is asked of it.
    for _ in 0..200 {
        if !lock(&log.commit.state).running {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert!(!lock(&log.commit.state).running);
    // A failed flush fences the log: its waiters fail, and so does every later append.
    log.fail_syncs.store(1, Ordering::SeqCst);
    let mut tasks = Vec::new();
    for t in 0..8u32 {
        let log = log.clone();
        tasks.push(tokio::spawn(async move {
            log.append(vec![append(t % 4, &["x"])]).await.remove(0)
        }));
    }
    let mut failed = 0;
    for t in tasks {
        if t.await.unwrap().is_err() {
            failed += 1;
        }
    }
    assert!(failed >= 1, "the appenders of the failed flush fail");
    assert!(!log.healthy());
    let later = log.append(vec![append(2, &["later"])]).await.remove(0);
    assert!(later.is_err());
}

#[tokio::test]
async fn the_shards_of_a_round_share_one_device_flush_where_the_file_system_allows() {
    for shared in [true, false] {
        let dir = tempfile::tempdir().unwrap();
        let mut log = EmbeddedLog::open("b", dir.path(), 4, &options(1 << 20)).unwrap();
        log.shared_flush = shared;
        let all = |p: &str| (0..4).map(|s| append(s, &[p])).collect::<Vec<_>>();
        // The first records of each file grow it into zero-filled space: every file gets
        // a full `fdatasync` of its own, for its size.
        for r in log.append(all("one")).await {
            r.unwrap();
        }
        assert_eq!(log.write_backs.load(Ordering::SeqCst), 0);
        // Then one round covers the four shards of the batch: with a shared flush, three
        // write-backs and one `fdatasync`.
        for r in log.append(all("two")).await {
            r.unwrap();
        }
        let expected = if shared { 3 } else { 0 };
        assert_eq!(log.write_backs.load(Ordering::SeqCst), expected);
        for shard in 0..4 {
            assert_eq!(*log.tail(shard).borrow(), 2);
            let read: Vec<String> = read_all(&log, shard, 0)
                .await
                .into_iter()
                .map(|(_, p)| p)
                .collect();
            assert_eq!(read, ["one", "two"]);
        }
        // A failed write-back fences the log like a failed `fdatasync`.
        log.fail_syncs.store(1, Ordering::SeqCst);
        let failed = log
            .append(all("three"))
            .await
            .into_iter()
            .filter(Result::is_err)
            .count();
        assert_eq!(failed, 4, "every appender of the failed round fails");
        assert!(!log.healthy());
    }
}

#[cfg(target_os = "linux")]
#[test]
fn data_journal_mounts_do_not_share_a_device_flush() {
    let mountinfo = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard\n\
                     31 27 254:1 / /data rw,relatime shared:1 - ext4 /dev/vdb rw,data=journal\n\
                     32 27 0:30 / /tmp rw - tmpfs tmpfs rw,size=1024k\n";
    assert!(!mounted_data_journal(mountinfo, "254:0"));
    assert!(mounted_data_journal(mountinfo, "254:1"));
    assert!(!mounted_data_journal(mountinfo, "0:30"));
    assert!(!mounted_data_journal(mountinfo, "8:1"));
    // No shard, or a shard directory that cannot be looked at, does not share.
    assert!(!shares_device_flush(&[]));
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open("b", dir.path(), 2, &options(64)).unwrap();
    std::fs::remove_dir_all(dir.path().join("shard-1")).unwrap();
    assert!(!shares_device_flush(&log.shards));
}

#[tokio::test]
async fn a_roll_that_cannot_finish_the_old_segment_fences_and_creates_no_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let log = EmbeddedLog::open("b", dir.path(), 1, &options(64)).unwrap();
    append_one(&log, &["first"]).await;
    log.fail_syncs.store(1, Ordering::SeqCst);
    // 16 bytes of header each: this append crosses 64 bytes and rolls.
    let result = log
        .append(vec![append(0, &["second-record-x", "third-record-xx"])])
        .await;
    assert!(result[0].is_err(), "{result:?}");
    assert!(!log.healthy());
    let files = fs::read_dir(dir.path().join("shard-0")).unwrap().count();
    assert_eq!(
        files, 1,
        "no new segment exists before the old one is finished"
    );
    drop(log);
    let log = EmbeddedLog::open("b", dir.path(), 1, &options(64)).unwrap();
    assert_eq!(read_all(&log, 0, 0).await.len(), 3);
}

#[tokio::test]
async fn recovery_drops_an_empty_segment_left_by_a_failed_roll() {
    let dir = tempfile::tempdir().unwrap();
    {
        let log = open_one(dir.path());
        append_one(&log, &["one", "two", "three"]).await;
        log.close().await;
    }
    // What the old roll order could leave: the next segment created (at record 1) while
    // records went on into the old one.
    let shard = dir.path().join("shard-0");
    File::create(segment_path(&shard, 1)).unwrap();
    let log = open_one(dir.path());
    assert_eq!(*log.tail(0).borrow(), 3);
    assert!(!segment_path(&shard, 1).exists());
    // With the bogus segment kept, this release would delete records 1 and 2.
    log.release(0, 2).await.unwrap();
    assert_eq!(read_all(&log, 0, 1).await.len(), 2);
    append_one(&log, &["four"]).await;
    assert_eq!(read_all(&log, 0, 0).await.len(), 4);
}

#[tokio::test]
async fn a_damaged_older_segment_is_found_at_recovery_and_skipped_by_readers() {
    let dir = tempfile::tempdir().unwrap();
    {
        let log = EmbeddedLog::open("b", dir.path(), 1, &options(64)).unwrap();
        for i in 0..12 {
            log.append(vec![append(0, &[&format!("event-{i:02}")])])
                .await[0]
                .as_ref()
                .unwrap();
        }
        log.close().await;
    }
    let shard = dir.path().join("shard-0");
    let mut bases: Vec<Seq> = fs::read_dir(&shard)
        .unwrap()
        .map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            name.trim_end_matches(".log").parse().unwrap()
        })
        .collect();
    bases.sort_unstable();
    assert!(bases.len() >= 3, "{bases:?}");
    // Flip a byte of the first record of the second segment (bit rot, a bad sector).
    let damaged = segment_path(&shard, bases[1]);
    let mut bytes = fs::read(&damaged).unwrap();
    bytes[HEADER] ^= 0xff;
    fs::write(&damaged, bytes).unwrap();

    let log = EmbeddedLog::open("b", dir.path(), 1, &options(64)).unwrap();
    assert_eq!(*log.tail(0).borrow(), 12, "the newest segment is intact");
    let seqs: Vec<Seq> = read_all(&log, 0, 0)
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let expected: Vec<Seq> = (0..12)
        .filter(|s| *s < bases[1] || *s >= bases[2])
        .collect();
    assert_eq!(
        seqs, expected,
        "everything but the damaged segment's records"
    );
    // A reader that starts inside the damaged range goes on after it.
    let from_inside: Vec<Seq> = read_all(&log, 0, bases[1])
        .await
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(from_inside.first(), Some(&bases[2]));
}

#[tokio::test]
async fn a_record_over_the_store_limit_is_refused_and_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let log = open_one(dir.path());
    let huge = Bytes::from(vec![b'x'; crate::store::MAX_RECORD_BYTES + 1]);
    let result = log
        .append(vec![ShardAppend {
            shard: 0,
            records: vec![Bytes::from_static(b"small"), huge],
        }])
        .await;
    assert!(
        matches!(result[0], Err(StoreError::TooLarge(_))),
        "{:?}",
        result[0].as_ref().map_err(ToString::to_string)
    );
    assert_eq!(*log.tail(0).borrow(), 0, "no record of the refused append");
    assert!(log.healthy() && log.write_problem().is_none());
    append_one(&log, &["next"]).await;
    assert_eq!(read_all(&log, 0, 0).await, vec![(0, "next".to_string())]);
}
