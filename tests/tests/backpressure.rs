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
    sluice_tests::post_many(&client, &sluice.events_url(), "bp", 0..N, |_| {
        "{}".to_string()
    })
    .await;
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

/// Item 15: a paused subscription and one whose target fails with no dead-letter
/// destination cannot hold their bus's log forever: events older than the bus's
/// `max_backlog_age` are skipped by the subscriptions that hold them, counted and logged,
/// the log is trimmed, and the next events are delivered as usual. A subscription that
/// keeps up loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_subscription_skips_what_is_older_than_the_max_backlog_age() {
    let (url, prefix) = sluice_tests::shared_redis("backlog");
    let steady = Receiver::start().await;
    let failing = Receiver::start().await;
    failing.default_reply(Reply::Status(500));
    let target = |rule: &str, url: &str| {
        format!(
            "\n[[rules]]\nname = \"{rule}\"\nbus = \"aging\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"t\"\nurl = \"{url}\"\ntimeout = \"2s\"\n"
        )
    };
    let paused_file = "\n[[rules]]\nname = \"paused\"\nbus = \"aging\"\n\n[[rules.targets]]\ntype = \"file\"\nname = \"t\"\npath = \"{data_dir}/paused.jsonl\"\n";
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .extra(&format!(
            "\n[[buses]]\nname = \"aging\"\nshards = 1\nmax_backlog_age = \"4s\"\n{}{}{paused_file}",
            target("steady", &steady.url("/")),
            target("failing", &failing.url("/")),
        ))
        .start()
        .await;
    let client = reqwest::Client::new();
    sluice_tests::admin::act(&sluice, "/api/v1/connectors/aging/paused/t/pause").await;
    sluice.wait_states("aging/paused/t#", "PAUSED", 1).await;

    let events = sluice.url("/buses/aging/events");
    let old: Vec<String> = (0..40).map(|i| format!("old-{i}")).collect();
    for id in &old {
        post(&client, &events, id, "{}").await;
    }
    let got = steady
        .wait_for(Duration::from_secs(20), |r| r.len() >= 40)
        .await;
    assert_eq!(
        sluice_tests::receiver::event_ids(&got),
        old,
        "the steady subscription"
    );

    // Both stuck subscriptions skip the 40 once they are older than 4 s (checked every
    // second), and say so.
    let metric = |text: &str, sub: &str| {
        sluice_tests::metric_sum(
            text,
            "sluice_subscription_expired_events_total",
            &format!("subscription=\"{sub}\""),
        )
    };
    let text = sluice_tests::eventually(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let text = sluice.metrics().await;
            let (p, f) = (
                metric(&text, "aging/paused/t"),
                metric(&text, "aging/failing/t"),
            );
            if p >= 40.0 && f >= 40.0 {
                Ok(text)
            } else {
                Err(format!(
                    "not expired: paused {p}, failing {f}\n{}",
                    sluice.log()
                ))
            }
        },
    )
    .await;
    assert_eq!(
        (
            metric(&text, "aging/paused/t"),
            metric(&text, "aging/failing/t")
        ),
        (40.0, 40.0),
        "each skipped exactly the 40 old events"
    );
    assert_eq!(metric(&text, "aging/steady/t"), 0.0);
    let log = sluice.log();
    for lane in ["aging/paused/t#0", "aging/failing/t#0"] {
        // One line per skip (the 40 may go in more than one step as they age).
        let skipped: u64 = log
            .lines()
            .filter(|l| l.contains("older than the bus's max_backlog_age") && l.contains(lane))
            .filter_map(|l| {
                let at = l.find("skipped=")? + "skipped=".len();
                let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<u64>().ok()
            })
            .sum();
        assert_eq!(skipped, 40, "logged skips of {lane}:\n{log}");
    }

    // The log is trimmed although one subscription is still paused.
    let stream = sluice_tests::redis::shard_key(&prefix, "aging", 0, "log");
    sluice_tests::wait_stream_len(&url, &stream, 0, Duration::from_secs(20)).await;

    // New events reach everyone once the target is back and the subscription resumed,
    // and none of the skipped ones do.
    failing.default_reply(Reply::Status(200));
    sluice_tests::admin::act(&sluice, "/api/v1/connectors/aging/paused/t/resume").await;
    let new: Vec<String> = (0..10).map(|i| format!("new-{i}")).collect();
    for id in &new {
        post(&client, &events, id, "{}").await;
    }
    let resumed = sluice_tests::wait_file(&sluice, "paused.jsonl", Duration::from_secs(20), |e| {
        e.len() >= 10
    })
    .await;
    assert_eq!(sluice_tests::ids(&resumed), new, "the resumed subscription");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let accepted: Vec<String> = failing
            .received()
            .iter()
            .filter(|r| r.was_accepted())
            .filter_map(|r| r.header("ce-id").map(str::to_string))
            .collect();
        if accepted.len() >= 10 {
            assert_eq!(accepted, new, "the recovered subscription");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "recovered target got {accepted:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all = steady
        .wait_for(Duration::from_secs(10), |r| r.len() >= 50)
        .await;
    let expected: Vec<String> = old.iter().chain(&new).cloned().collect();
    assert_eq!(sluice_tests::receiver::event_ids(&all), expected);
}

/// Item 9: memory is bounded by bytes, not counts. The largest inputs the default limits
/// allow, shaped for the worst memory use (event data `[0,0,…]`: 2 bytes of text, 32 of
/// JSON tree per element), posted by 48 producers at once in 1 MiB batches to a bus whose
/// 6 rules look inside every event (so each is decoded) and deliver to a slow receiver
/// (the lanes fill up and catch up from the log). Every request is answered 202, or 503
/// while the gateway holds `limits.max_inflight_bytes`; the peak RSS stays bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_stays_bounded_with_the_largest_inputs() {
    let slow = Receiver::start().await;
    slow.default_reply(Reply::Sleep(Duration::from_millis(200), 200));
    let mut extra = String::new();
    for i in 0..6 {
        extra.push_str(&format!(
            "\n[[rules]]\nname = \"big-{i}\"\nbus = \"default\"\npattern = {{ type = [\"big\"] }}\n\n[[rules.targets]]\ntype = \"http\"\nname = \"t\"\nurl = \"{}\"\ntimeout = \"5s\"\n",
            slow.url("/")
        ));
    }
    let sluice = Sluice::builder()
        .durability("os")
        .without_default_rule()
        .extra(&extra)
        .start()
        .await;
    let pid = sluice.pid().unwrap();
    // 4 entries of ~240 KB each (under `max_event_bytes`, 256 KiB): a ~960 KB batch (under
    // `max_batch_bytes`, 1 MiB).
    let data = format!("[{}0]", "0,".repeat(119_000));
    let batch = |n: usize| {
        let entries: Vec<String> = (0..4)
            .map(|i| {
                format!(
                    r#"{{"specversion":"1.0","id":"big-{n}-{i}","source":"/memory","type":"big","datacontenttype":"application/json","data":{data}}}"#
                )
            })
            .collect();
        format!("[{}]", entries.join(","))
    };
    assert!(batch(0).len() < 1024 * 1024);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .unwrap();
    let url = sluice.events_url();
    let mut producers = Vec::new();
    for p in 0..48 {
        let (client, url, body) = (client.clone(), url.clone(), batch(p));
        producers.push(tokio::spawn(async move {
            let mut statuses = Vec::new();
            for _ in 0..3 {
                let r = sluice_tests::send_batch(&client, &url, body.clone()).await;
                statuses.push(r.status().as_u16());
            }
            statuses
        }));
    }
    let mut statuses = std::collections::BTreeMap::new();
    for p in producers {
        for s in p.await.unwrap() {
            *statuses.entry(s).or_insert(0) += 1;
        }
    }
    let accepted = statuses.get(&202).copied().unwrap_or(0);
    assert!(
        statuses.keys().all(|s| *s == 202 || *s == 503),
        "only 202 or 503 (shed): {statuses:?}"
    );
    assert!(accepted > 0, "{statuses:?}");
    // Let the lanes work through a good part of it (they read it back and decode it).
    tokio::time::sleep(Duration::from_secs(5)).await;
    let peak = sluice_tests::ledger::peak_rss_kib(pid).unwrap();
    println!(
        "MEMORY-BOUND requests {statuses:?}, {} events accepted, peak RSS {} MiB",
        accepted * 4,
        peak / 1024
    );
    assert!(
        peak < 640 * 1024,
        "peak RSS {} MiB with the largest inputs",
        peak / 1024
    );
}
