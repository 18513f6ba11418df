//! The fault suite: every scenario runs producers with the no-loss ledger
//! (`sluice_tests::ledger`) against the real binary, injects its faults under load, and
//! reconciles what the producers were told was accepted with what the receiver got: lost
//! must be 0; duplicated and reordered (per partition key) are counted and reported.
//! Each run prints one `FAULT-REPORT {json}` line (and appends it to `SLUICE_FAULT_REPORT`
//! when set). `make test` runs the short version; `make chaos` sets `SLUICE_CHAOS` to
//! stretch every phase and the number of faults (figures in RELIABILITY.md).
//!
//! Other fault tests keep their own files: the RocketMQ broker restarted
//! (`rocketmq_target.rs`), a store that cannot write (`store_faults.rs`, a real `EFBIG` from
//! a file-size limit), SIGTERM rolling restarts (`distributed.rs`), torn and damaged
//! segments and failed `fdatasync` (unit tests of the embedded log).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::ledger::{chaos_scale, peak_rss_kib, Load, Report};
use sluice_tests::receiver::{Received, Receiver, Reply};
use sluice_tests::{shared_redis, target_rule, RedisServer, Sluice, SluiceBuilder};

/// An HTTP target to the receiver, and nothing else on the bus.
fn to_receiver(builder: SluiceBuilder, receiver: &Receiver) -> SluiceBuilder {
    let url = receiver.url("/faults");
    builder.without_default_rule().extra(&target_rule(
        "faults",
        "http",
        "receiver",
        &format!("url = \"{url}\"\ntimeout = \"2s\""),
    ))
}

/// The ids the receiver accepted, in arrival order.
fn delivered(receiver: &Receiver) -> Vec<String> {
    receiver
        .received()
        .iter()
        .filter(|r| r.was_accepted())
        .filter_map(|r: &Received| r.header("ce-id").map(str::to_string))
        .collect()
}

/// Waits until every accepted event reached the receiver (or `limit` passes), then builds
/// the report, publishes it and fails the test if anything accepted was lost.
async fn conclude(
    scenario: &str,
    load: Load,
    receiver: &Receiver,
    limit: Duration,
    started: Instant,
    faults: usize,
    peak_rss_kib: u64,
) -> Report {
    let (accepted, refused) = load.stop().await;
    let deadline = Instant::now() + limit;
    loop {
        let got: std::collections::HashSet<String> = delivered(receiver).into_iter().collect();
        if accepted.iter().all(|a| got.contains(&a.id)) || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Late duplicates (a redelivery after a takeover) land within a commit interval or two.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut report = Report::of(scenario, &accepted, refused, &delivered(receiver));
    report.seconds = started.elapsed().as_secs_f64();
    report.faults = faults;
    report.peak_rss_kib = peak_rss_kib;
    report.publish();
    report.assert_no_loss();
    report
}

fn note_rss(peak: &mut u64, sluice: &Sluice) {
    if let Some(kib) = sluice.pid().and_then(peak_rss_kib) {
        *peak = (*peak).max(kib);
    }
}

/// Three replicas under load; one after another is SIGKILLed mid-batch and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_killed_under_load() {
    let scale = chaos_scale() as usize;
    let receiver = Receiver::start().await;
    let (url, prefix) = shared_redis("faults-kill");
    let start = || {
        to_receiver(
            Sluice::builder().distributed(&url, &prefix).ttl("1500ms"),
            &receiver,
        )
        .start()
    };
    let mut replicas = vec![start().await, start().await, start().await];
    replicas[0].wait_members(3).await;
    replicas[0].wait_tasks_settled(4, 3).await;
    let started = Instant::now();
    let urls = replicas.iter().map(Sluice::events_url).collect();
    let load = Load::start(urls, "kill", 8, 50_000 * scale);
    let mut peak = 0;
    let kills = 2 * scale;
    for k in 0..kills {
        // A while under load, then a kill mid-batch; the others keep taking the load.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        load.wait_progress(100, Duration::from_secs(30)).await;
        let victim = k % replicas.len();
        note_rss(&mut peak, &replicas[victim]);
        replicas[victim].kill9();
        load.wait_progress(100, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        replicas[victim].restart().await;
    }
    load.wait_progress(100, Duration::from_secs(30)).await;
    for r in &replicas {
        note_rss(&mut peak, r);
    }
    conclude(
        "replicas SIGKILLed under load (distributed, 3 replicas)",
        load,
        &receiver,
        Duration::from_secs(30),
        started,
        kills,
        peak,
    )
    .await;
}

/// Redis restarted (its append-only file kept), then unreachable for a while, under load:
/// producers get 503 meanwhile, and every event they were told was accepted arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restarted_and_unreachable() {
    let scale = chaos_scale();
    let receiver = Receiver::start().await;
    let mut redis = RedisServer::start();
    let url = redis.url();
    let start = || {
        to_receiver(
            Sluice::builder().distributed(&url, "faults-redis"),
            &receiver,
        )
        .start()
    };
    let replicas = [start().await, start().await];
    replicas[0].wait_members(2).await;
    replicas[0].wait_tasks_settled(4, 2).await;
    let started = Instant::now();
    let urls = replicas.iter().map(Sluice::events_url).collect();
    let load = Load::start(urls, "redis", 8, 50_000 * scale as usize);
    load.wait_progress(100, Duration::from_secs(30)).await;
    // A restart: gone and back at once.
    redis.kill();
    redis.restart();
    load.wait_progress(100, Duration::from_secs(60)).await;
    // Unreachable for 10 s (longer than every lease and membership TTL), 30 s in
    // `make chaos`.
    redis.kill();
    tokio::time::sleep(Duration::from_secs(10 * u64::from(scale.min(3)))).await;
    redis.restart();
    load.wait_progress(100, Duration::from_secs(60)).await;
    let mut peak = 0;
    for r in &replicas {
        note_rss(&mut peak, r);
    }
    let report = conclude(
        "Redis restarted, then unreachable (distributed, 2 replicas)",
        load,
        &receiver,
        Duration::from_secs(60),
        started,
        2,
        peak,
    )
    .await;
    assert!(
        report.refused.keys().all(|s| matches!(s, 0 | 429 | 503)),
        "only 503 (or no answer) while Redis is away: {:?}",
        report.refused
    );
}

/// The target is down (connections closed without an answer) for a while, then back:
/// nothing accepted meanwhile is lost, in both modes.
async fn target_down_then_back(distributed: bool) {
    let scale = chaos_scale();
    let receiver = Receiver::start().await;
    let (url, prefix) = shared_redis("faults-target");
    let mut builder = Sluice::builder();
    if distributed {
        builder = builder.distributed(&url, &prefix);
    }
    let sluice = to_receiver(builder, &receiver).start().await;
    let started = Instant::now();
    let load = Load::start(
        vec![sluice.events_url()],
        "target",
        8,
        50_000 * scale as usize,
    );
    load.wait_progress(100, Duration::from_secs(30)).await;
    receiver.default_reply(Reply::Close);
    // Down for 3 s here; `make chaos` stretches it (30 s at SLUICE_CHAOS=10).
    tokio::time::sleep(Duration::from_secs(3 * u64::from(scale))).await;
    receiver.default_reply(Reply::Status(200));
    load.wait_progress(100, Duration::from_secs(60)).await;
    let mut peak = 0;
    note_rss(&mut peak, &sluice);
    let mode = if distributed {
        "distributed"
    } else {
        "standalone"
    };
    let report = conclude(
        &format!("HTTP target down for {} s, then back ({mode})", 3 * scale),
        load,
        &receiver,
        Duration::from_secs(60),
        started,
        1,
        peak,
    )
    .await;
    assert_eq!(
        report.reordered, 0,
        "a target that fails delays a key's events, it does not reorder them"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_down_then_back_standalone() {
    target_down_then_back(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_down_then_back_distributed() {
    target_down_then_back(true).await;
}

/// A standalone gateway with `durability = "fsync"` SIGKILLed under load, again and again
/// (a record may be torn at the tail of its segment): every accepted event is delivered
/// after the restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_killed_under_load() {
    let scale = chaos_scale() as usize;
    let receiver = Receiver::start().await;
    let mut sluice = to_receiver(Sluice::builder().durability("fsync"), &receiver)
        .start()
        .await;
    let started = Instant::now();
    let load = Load::start(vec![sluice.events_url()], "crash", 8, 50_000 * scale);
    let mut peak = 0;
    let kills = 2 * scale;
    for _ in 0..kills {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        load.wait_progress(100, Duration::from_secs(30)).await;
        note_rss(&mut peak, &sluice);
        sluice.kill9();
        // Producers see connection errors until it is back (and retry then).
        tokio::time::sleep(Duration::from_millis(300)).await;
        sluice.restart().await;
    }
    load.wait_progress(100, Duration::from_secs(30)).await;
    note_rss(&mut peak, &sluice);
    conclude(
        "standalone SIGKILLed under load (fsync)",
        load,
        &receiver,
        Duration::from_secs(30),
        started,
        kills,
        peak,
    )
    .await;
}
