//! Crash safety: SIGKILL under load, restart, and every event answered 202 is delivered.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::Value;
use sluice_tests::{binary, ids, structured_event, Sluice};

/// Producers post as fast as they can (bounded: at most `PER_PRODUCER` requests each) while
/// the gateway is killed; they keep every id that got a 202.
const PRODUCERS: usize = 4;
const PER_PRODUCER: usize = 3000;

async fn kill_under_load_then_restart(durability: &'static str) {
    let mut sluice = Sluice::builder().durability(durability).start().await;
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let url = sluice.events_url();
    let mut producers = Vec::new();
    for p in 0..PRODUCERS {
        let acked = acked.clone();
        let url = url.clone();
        producers.push(tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            for i in 0..PER_PRODUCER {
                // Producer 0 sends batches of 10; the others single binary-mode events.
                let (request, batch_ids) = if p == 0 {
                    let batch_ids: Vec<String> = (0..10).map(|k| format!("p{p}-{i}-{k}")).collect();
                    let events: Vec<Value> =
                        batch_ids.iter().map(|id| structured_event(id)).collect();
                    let request = client
                        .post(&url)
                        .header("content-type", "application/cloudevents-batch+json")
                        .body(Value::Array(events).to_string());
                    (request, batch_ids)
                } else {
                    let id = format!("p{p}-{i}");
                    (binary(&client, &url, &id, r#"{"load":true}"#), vec![id])
                };
                match request.send().await {
                    Ok(r) if r.status() == StatusCode::ACCEPTED => {
                        let body: Value = r.json().await.unwrap_or(Value::Null);
                        let mut acked = acked.lock().unwrap();
                        for (k, id) in batch_ids.into_iter().enumerate() {
                            if body["entries"][k]["status"] == "accepted" {
                                acked.push(id);
                            }
                        }
                    }
                    Ok(_) => {}
                    // The process is gone: stop this producer.
                    Err(_) => return,
                }
            }
        }));
    }
    // Let load build up, then pull the plug in the middle of it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while acked.lock().unwrap().len() < 500 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    sluice.kill9();
    for p in producers {
        p.await.unwrap();
    }
    let acked: HashSet<String> = acked.lock().unwrap().iter().cloned().collect();
    assert!(
        acked.len() >= 500,
        "load was running: {} acked",
        acked.len()
    );

    // What was delivered before the crash (the file target writes whole lines).
    let before_restart = sluice.delivered().len();
    sluice.restart().await;
    let events = sluice
        .wait_delivered(Duration::from_secs(60), |events| {
            let got: HashSet<String> = ids(events).into_iter().collect();
            acked.is_subset(&got)
        })
        .await;
    let delivered = ids(&events);
    let unique: HashSet<&String> = delivered.iter().collect();
    eprintln!(
        "durability={durability}: acked {}, delivered {} lines ({} unique, {} duplicates re-sent after the crash)",
        acked.len(),
        delivered.len(),
        unique.len(),
        delivered.len() - unique.len()
    );
    // Only what was delivered before the crash and not yet committed is sent again.
    let mut first_seen: std::collections::HashMap<&String, usize> = Default::default();
    for (at, id) in delivered.iter().enumerate() {
        if let Some(first) = first_seen.get(id) {
            assert!(
                *first < before_restart,
                "{id} delivered twice after the restart (lines {first} and {at})"
            );
        } else {
            first_seen.insert(id, at);
        }
    }
    // In order per shard: each producer's events, in the order it posted them, in each
    // shard (first deliveries; re-sent ones repeat a stretch already in order).
    let key = |id: &str| -> (u32, String, Vec<u64>) {
        let mut parts = id.split('-');
        let producer = parts.next().unwrap_or_default().to_string();
        let numbers = parts.filter_map(|p| p.parse().ok()).collect();
        (sluice::event::shard_of(id, 4), producer, numbers)
    };
    let mut last: std::collections::HashMap<(u32, String), Vec<u64>> = Default::default();
    let mut seen = HashSet::new();
    for id in &delivered {
        if !seen.insert(id) {
            continue;
        }
        let (shard, producer, numbers) = key(id);
        let entry = last.entry((shard, producer)).or_default();
        assert!(
            numbers > *entry,
            "{id} delivered after {entry:?} in shard {shard}: out of order"
        );
        *entry = numbers;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_fsync_loses_no_acknowledged_event() {
    kill_under_load_then_restart("fsync").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_with_os_durability_loses_no_acknowledged_event() {
    // A process crash (not a power loss) keeps what the OS already has.
    kill_under_load_then_restart("os").await;
}

/// Killed before the shard's first position commit (a one-hour commit interval stands in
/// for a crash in the first moments of a new bus): the accepted events were not delivered
/// yet (the receiver answered 503) and no position says where the subscription is. The
/// restart delivers them all. It once took the subscription for a new one and started it at
/// the end of the shard, skipping them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_first_commit_skips_nothing() {
    use sluice_tests::receiver::{event_ids, Receiver, Reply};
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(503));
    let rule = format!(
        "[[rules]]\nname = \"hook\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"hook\"\nurl = \"{}\"\ntimeout = \"2s\"\n",
        receiver.url("/hook")
    );
    let mut sluice = Sluice::builder()
        .without_default_rule()
        .commit_interval("1h")
        .extra(&rule)
        .start()
        .await;
    let client = reqwest::Client::new();
    let sent: Vec<String> = (0..20).map(|i| format!("early-{i}")).collect();
    for id in &sent {
        let r = binary(&client, &sluice.events_url(), id, r#"{"n":1}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED);
    }
    // Delivery is being tried (and refused): the events sit in the lanes.
    receiver
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    sluice.kill9();
    receiver.default_reply(Reply::Status(200));
    sluice.restart().await;
    receiver
        .wait_for(Duration::from_secs(30), |r| {
            let delivered: HashSet<String> = event_ids(
                &r.iter()
                    .filter(|r| r.status == 200)
                    .cloned()
                    .collect::<Vec<_>>(),
            )
            .into_iter()
            .collect();
            sent.iter().all(|id| delivered.contains(id))
        })
        .await;
    // It was the case above: no position had been committed.
    assert!(sluice.log().contains("no committed positions"));
}
