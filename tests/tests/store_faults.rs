//! The store failing under a running gateway, through the real binary: a store that cannot
//! write (a real `EFBIG`) or a full disk (a tmpfs of the test's own) answers 503, says so
//! on `/readyz` while liveness stays up, corrupts nothing and takes writes again once it
//! can; a log that lost its tail (the embedded log after a power loss, Redis restored from
//! an older snapshot under a running reader) delivers the new events instead of skipping
//! them, and says the store rolled back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::receiver::Receiver;
use sluice_tests::Sluice;

/// The HTTP target's settings in these tests.
const TIMEOUT: &str = "timeout = \"2s\"";

fn set_file_size_limit(pid: u32, limit: &str) {
    // Soft limit only: the hard one stays unlimited so it can be raised again.
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(pid.to_string())
        .arg(format!("--fsize={limit}:unlimited"))
        .status()
        .expect("prlimit (util-linux) runs");
    assert!(status.success(), "prlimit --fsize={limit} failed");
}

/// A binary-mode event with 32 KiB of data: a few fill a small store quickly.
fn big_event(client: &reqwest::Client, url: &str, id: &str) -> reqwest::RequestBuilder {
    client
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/tests")
        .header("ce-type", "com.example.big")
        .header("content-type", "application/json")
        .body(format!("{{\"data\":\"{}\"}}", "x".repeat(32 * 1024)))
}

/// Posts big events `{prefix}-{i}` (adding the accepted ones to `accepted`) until one is
/// refused with a `503` problem and `Retry-After`; returns its id and problem. Panics if
/// none of `max` is refused, or on any other answer.
async fn fill_until_refused(
    client: &reqwest::Client,
    url: &str,
    prefix: &str,
    max: usize,
    accepted: &mut Vec<String>,
) -> (String, Value) {
    for i in 0..max {
        let id = format!("{prefix}-{i}");
        let response = big_event(client, url, &id).send().await.unwrap();
        match response.status().as_u16() {
            202 => accepted.push(id),
            503 => {
                assert_eq!(
                    response.headers()["content-type"],
                    "application/problem+json"
                );
                assert!(response.headers().contains_key("retry-after"));
                return (id, response.json().await.unwrap());
            }
            other => panic!("unexpected status {other}"),
        }
    }
    panic!("none of {max} writes was refused");
}

#[tokio::test]
async fn a_store_that_cannot_write_answers_503_and_is_not_ready_until_it_can_again() {
    let receiver = Receiver::start().await;
    // Only the HTTP target: the file target would write into the data directory too.
    let sluice = Sluice::builder()
        .http_target("hook", &receiver.url("/hook"), TIMEOUT)
        .without_default_rule()
        .shards(1)
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();
    let get = |path: &str| client.get(sluice.url(path)).send();
    let send = |id: String| big_event(&client, &url, &id).send();
    let mut accepted = Vec::new();
    for i in 0..4 {
        let id = format!("before-{i}");
        assert_eq!(send(id.clone()).await.unwrap().status(), 202);
        accepted.push(id);
    }
    // A real fault, made by the kernel: past 2 MiB every write of the process fails with
    // EFBIG (what a full disk does with ENOSPC). The segment grows in 1 MiB chunks.
    let pid = sluice.pid().expect("running");
    set_file_size_limit(pid, "2097152");
    let (refused_id, problem) =
        fill_until_refused(&client, &url, "during", 200, &mut accepted).await;
    eprintln!(
        "{} events accepted, then {refused_id} refused: {problem}",
        accepted.len()
    );
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("nothing was kept"), "{problem}");
    assert!(detail.to_lowercase().contains("too large"), "{problem}");
    assert!(
        sluice.is_alive(),
        "a file-size limit must not kill the process (SIGXFSZ)"
    );

    let ready = get("/readyz").await.unwrap();
    assert_eq!(ready.status(), 503);
    let ready: Value = ready.json().await.unwrap();
    assert!(
        ready["detail"]
            .as_str()
            .unwrap()
            .contains("writes are failing"),
        "{ready}"
    );
    // Not fenced: liveness stays up (a restart would not help), and every request tries.
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    assert_eq!(
        send("still-refused".to_string()).await.unwrap().status(),
        503
    );

    set_file_size_limit(pid, "unlimited");
    assert_eq!(send("after".to_string()).await.unwrap().status(), 202);
    accepted.push("after".to_string());
    assert_eq!(get("/readyz").await.unwrap().status(), 200);

    // Exactly what was accepted is delivered, in order (one shard); nothing refused is.
    let received = receiver
        .wait_for(Duration::from_secs(30), |r| {
            r.iter().filter(|r| r.was_accepted()).count() >= accepted.len()
        })
        .await;
    let ok: Vec<_> = received.into_iter().filter(|r| r.was_accepted()).collect();
    let ids = sluice_tests::receiver::event_ids(&ok);
    let mut seen = std::collections::HashSet::new();
    let delivered: Vec<String> = ids
        .into_iter()
        .filter(|id| seen.insert(id.clone()))
        .collect();
    assert_eq!(delivered, accepted);
    assert!(!delivered.contains(&refused_id));
    let log = sluice.log();
    assert!(log.contains("not ready until a write succeeds"), "{log}");
    assert!(log.contains("the log takes writes again"), "{log}");
}

/// A small tmpfs of the test's own (needs root, as in CI), unmounted when dropped.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "sluice-test"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        mounted.then_some(Tmpfs { dir })
    }

    fn resize(&self, size: &str) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={size}")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "remount to {size}");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// The fault suite's disk-full scenario on a real filesystem: the data directory on a
/// 3 MiB tmpfs fills up under writes. Producers get `503` (never a `202` for an event that
/// was not kept), `/readyz` says why, nothing already stored is damaged; once space returns
/// writes go on, everything accepted is delivered once and in order, and a restart recovers
/// the log without losing or cutting a record.
#[tokio::test]
async fn a_full_disk_answers_503_corrupts_nothing_and_recovers_once_space_returns() {
    let Some(fs) = Tmpfs::mount("3m") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs as root: a tmpfs must mount"
        );
        eprintln!("SKIPPED: mounting a tmpfs needs root");
        return;
    };
    let receiver = Receiver::start().await;
    let mut sluice = Sluice::builder()
        .http_target("hook", &receiver.url("/hook"), TIMEOUT)
        .without_default_rule()
        .shards(1)
        .data_dir(&fs.dir.path().join("data"))
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();
    let send = |id: String| big_event(&client, &url, &id).send();
    let mut accepted = Vec::new();
    let (_, problem) = fill_until_refused(&client, &url, "fill", 400, &mut accepted).await;
    eprintln!(
        "{} events accepted, then refused: {problem}",
        accepted.len()
    );
    assert!(accepted.len() >= 10, "only {} accepted", accepted.len());
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("nothing was kept"), "{problem}");
    assert!(
        detail.contains("No space left on device"),
        "the cause is named: {problem}"
    );
    let status = |path: &str| {
        let request = client.get(sluice.url(path)).send();
        async move { request.await.unwrap().status() }
    };
    assert_eq!(status("/readyz").await, 503);
    assert_eq!(status("/healthz").await, 200);
    for i in 0..3 {
        assert_eq!(send(format!("still-{i}")).await.unwrap().status(), 503);
    }

    // Space returns: writes go on (the next request tries again).
    fs.resize("64m");
    assert_eq!(send("after".to_string()).await.unwrap().status(), 202);
    accepted.push("after".to_string());
    assert_eq!(status("/readyz").await, 200);
    let delivered = |received: Vec<sluice_tests::receiver::Received>| {
        let ok: Vec<_> = received.into_iter().filter(|r| r.was_accepted()).collect();
        sluice_tests::receiver::event_ids(&ok)
    };
    let received = receiver
        .wait_for(Duration::from_secs(30), |r| {
            r.iter().filter(|r| r.was_accepted()).count() >= accepted.len()
        })
        .await;
    assert_eq!(delivered(received), accepted, "delivered once, in order");

    // A restart reads the whole log back: nothing cut, nothing damaged.
    sluice.terminate();
    sluice.restart().await;
    assert_eq!(send("restarted".to_string()).await.unwrap().status(), 202);
    accepted.push("restarted".to_string());
    let received = receiver
        .wait_for(Duration::from_secs(30), |r| {
            r.iter().filter(|r| r.was_accepted()).count() >= accepted.len()
        })
        .await;
    assert_eq!(delivered(received), accepted);
    let log = sluice.log();
    for bad in ["damaged", "skipping records", "cut the log", "corrupt"] {
        assert!(
            !log.to_lowercase().contains(bad),
            "`{bad}` in the log after a full disk:\n{log}"
        );
    }
    sluice.terminate();
}

/// What a power loss with `durability = "os"` can leave: the log lost records that the
/// subscription's committed position had already passed. New events get those sequence
/// numbers again; they must be delivered, not skipped, and the loss must be said.
#[tokio::test]
async fn a_log_that_lost_its_tail_delivers_new_events_instead_of_skipping_them() {
    let mut sluice = Sluice::builder().shards(1).start().await;
    let client = reqwest::Client::new();
    sluice_tests::post_many(&client, &sluice.events_url(), "before", 0..10, |_| {
        "{}".to_string()
    })
    .await;
    sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() >= 10)
        .await;
    assert!(sluice.terminate().success());
    // The records are gone; the positions file (committed at shutdown) still says 10.
    let shard = sluice
        .data_dir()
        .join("buses")
        .join("default")
        .join("shard-0");
    for entry in std::fs::read_dir(&shard).unwrap() {
        std::fs::remove_file(entry.unwrap().path()).unwrap();
    }
    sluice.restart().await;
    sluice_tests::post_many(&client, &sluice.events_url(), "after", 0..3, |_| {
        "{}".to_string()
    })
    .await;
    let events = sluice
        .wait_delivered(Duration::from_secs(15), |e| {
            (0..3).all(|i| e.iter().any(|x| x["id"] == format!("after-{i}")))
        })
        .await;
    assert_eq!(events.len(), 13, "the new events once each");
    let log = sluice.log();
    assert!(log.contains("the store rolled back"), "{log}");
}

/// Item 5 with the reader running: Redis comes back from an older snapshot while a replica
/// is delivering. The shard's reader is past the restored log's end; the events producers
/// send from then on get sequence numbers it is already past. They are delivered (not
/// skipped), and the log says what happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_rolled_back_under_a_running_reader_delivers_the_new_events() {
    let mut redis = sluice_tests::RedisServer::start();
    let sluice = Sluice::builder()
        .distributed(&redis.url(), "rollback")
        .shards(1)
        .start()
        .await;
    sluice.wait_tasks_settled(1, 1).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    sluice_tests::post_many(&client, &sluice.events_url(), "a", 0..10, |_| {
        "{}".to_string()
    })
    .await;
    sluice
        .wait_delivered(Duration::from_secs(15), |e| e.len() >= 10)
        .await;
    // The backup: taken with Redis stopped, so it is exactly the 10.
    redis.kill();
    let backup = redis.snapshot();
    redis.restart();
    // Posting retries while the replica reconnects.
    let post_retrying = |id: String| {
        let client = client.clone();
        let url = sluice.events_url();
        async move {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let sent = sluice_tests::binary(&client, &url, &id, "{}").send().await;
                if sent.is_ok_and(|r| r.status() == 202) {
                    return;
                }
                assert!(Instant::now() < deadline, "{id} never accepted");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    for i in 0..10 {
        post_retrying(format!("b-{i}")).await;
    }
    sluice
        .wait_delivered(Duration::from_secs(15), |e| e.len() >= 20)
        .await;
    // Rolled back to the backup while the replica runs: positions say 20, the log ends
    // at 10.
    redis.kill();
    redis.restore(backup.path());
    redis.restart();
    let after: Vec<String> = (0..5).map(|i| format!("c-{i}")).collect();
    for id in &after {
        post_retrying(id.clone()).await;
    }
    let delivered = sluice
        .wait_delivered(Duration::from_secs(30), |e| {
            after
                .iter()
                .all(|id| e.iter().any(|x| x["id"] == id.as_str()))
        })
        .await;
    let ids = sluice_tests::ids(&delivered);
    for id in &after {
        assert_eq!(
            ids.iter().filter(|x| *x == id).count(),
            1,
            "{id} delivered once: {ids:?}"
        );
    }
    let log = sluice.log();
    assert!(log.contains("the store rolled back"), "{log}");
}
