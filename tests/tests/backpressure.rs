//! Back-pressure: a slow target slows only its own subscription.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::receiver::{event_ids, Receiver, Reply};
use sluice_tests::{ids, post, post_batch, Sluice};

/// `got` is a prefix of `posted` within each shard: nothing skipped, nothing reordered
/// (retries of the request at the head may repeat it).
fn assert_shard_prefix(got: &[String], posted: &[String], shards: u32, what: &str) {
    for shard in 0..shards {
        let of = |ids: &[String]| -> Vec<String> {
            let mut out: Vec<String> = Vec::new();
            for id in ids {
                if sluice::event::shard_of(id, shards) == shard && out.last() != Some(id) {
                    out.push(id.clone());
                }
            }
            out
        };
        let got = of(got);
        let posted = of(posted);
        assert!(
            got.len() <= posted.len() && got[..] == posted[..got.len()],
            "{what}: shard {shard} got {got:?}"
        );
    }
}

#[tokio::test]
async fn backpressure_slow_target_does_not_slow_a_fast_one() {
    let slow = Receiver::start().await;
    slow.default_reply(Reply::Sleep(Duration::from_millis(500), 200));
    let fast = Receiver::start().await;
    let rule = |name: &str, url: &str| {
        format!(
            "\n[[rules]]\nname = \"{name}\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"{name}\"\nurl = \"{url}\"\n"
        )
    };
    let sluice = Sluice::builder()
        .shards(2)
        .extra(&(rule("slow", &slow.url("/")) + &rule("fast", &fast.url("/"))))
        .start()
        .await;
    let client = reqwest::Client::new();
    const N: usize = 200;
    let start = Instant::now();
    for i in 0..N {
        post(&client, &sluice.events_url(), &format!("bp-{i}"), "{}").await;
    }
    fast.wait_for(Duration::from_secs(20), |r| r.len() >= N)
        .await;
    let fast_done = start.elapsed();
    let slow_seen = slow.received().len();
    // The slow endpoint takes 500 ms per event on each of 2 shards: ~4 events/s. By the
    // time the fast one has everything, the slow one has a small part.
    assert!(
        slow_seen < N / 4,
        "slow target got {slow_seen} of {N} in {fast_done:?}"
    );
    let posted: Vec<String> = (0..N).map(|i| format!("bp-{i}")).collect();
    let got = event_ids(&fast.received());
    assert_eq!(got.len(), N, "the fast target got each event once");
    assert_shard_prefix(&got, &posted, 2, "fast");
    // The slow one keeps making progress, in order per shard.
    let seen = slow
        .wait_for(Duration::from_secs(10), |r| r.len() > slow_seen)
        .await;
    assert_shard_prefix(&event_ids(&seen), &posted, 2, "slow");
}

/// Posts `batches` batches of 100 events with `data_bytes` of data each.
async fn post_batches(sluice: &Sluice, from: usize, batches: usize, data_bytes: usize) {
    let client = reqwest::Client::new();
    let filler = "x".repeat(data_bytes);
    for b in from..from + batches {
        let batch: Vec<Value> = (0..100)
            .map(|i| {
                serde_json::json!({
                    "specversion": "1.0",
                    "id": format!("mem-{b}-{i}"),
                    "source": "/tests",
                    "type": "com.example.test",
                    "data": {"filler": filler},
                })
            })
            .collect();
        post_batch(&client, &sluice.events_url(), batch).await;
    }
}

#[tokio::test]
async fn backpressure_memory_stays_bounded_while_a_target_hangs() {
    let stuck = Receiver::start().await;
    stuck.default_reply(Reply::Hang);
    let extra = format!(
        "\n[[rules]]\nname = \"stuck\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"stuck\"\nurl = \"{}\"\ntimeout = \"1s\"\n\n[store]\ncache_bytes = 1048576\n",
        stuck.url("/")
    );
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&extra)
        .start()
        .await;
    // Warm up (allocator arenas, connection pools, caches), then measure.
    post_batches(&sluice, 0, 20, 4096).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = sluice.rss_kib().unwrap();
    // 200 batches of 100 events of ~4 KiB: ~80 MiB the stuck target cannot take.
    post_batches(&sluice, 20, 200, 4096).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = sluice.rss_kib().unwrap();
    let grown = after.saturating_sub(before);
    eprintln!("RSS {before} KiB -> {after} KiB (+{grown} KiB) with ~80 MiB pending");
    // Pending events stay on disk: the stuck subscription holds one batch per shard.
    assert!(
        grown < 32 * 1024,
        "RSS grew by {grown} KiB while a target hung"
    );
    // The hanging target was really asked (and never answered), so its events are all
    // pending; the other subscription got every event, in order per shard.
    let asked = stuck
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    let asked: std::collections::HashSet<String> = event_ids(&asked).into_iter().collect();
    assert!(
        asked.len() <= 4 * 100,
        "at most a batch per shard is in flight to the hanging target: {}",
        asked.len()
    );
    let posted: Vec<String> = (0..220)
        .flat_map(|b| (0..100).map(move |i| format!("mem-{b}-{i}")))
        .collect();
    let delivered = sluice
        .wait_delivered(Duration::from_secs(60), |e| e.len() >= posted.len())
        .await;
    let delivered = ids(&delivered);
    assert_eq!(delivered.len(), posted.len(), "each event once");
    assert_shard_prefix(&delivered, &posted, 4, "the other subscription");
}
