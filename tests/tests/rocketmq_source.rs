//! The RocketMQ source connector against a real broker: CloudEvents messages become those
//! events, other messages are wrapped, and positions survive a restart (kept in the store).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeSet, HashSet};
use std::time::{Duration, Instant};

use rocketmq_model::common::message::message_single::Message;
use serde_json::Value;
use sluice_tests::rocketmq::RocketMq;
use sluice_tests::{ids, shared_redis, Sluice};

fn source(name_server: &str, topic: &str) -> String {
    source_with_tasks(name_server, topic, 1)
}

fn source_with_tasks(name_server: &str, topic: &str, tasks: u32) -> String {
    format!(
        r#"
[[sources]]
type = "rocketmq"
name = "mq-in"
name_server = "{name_server}"
topic = "{topic}"
bus = "default"
wrap_type = "com.example.legacy"
tasks = {tasks}
"#
    )
}

fn plain(topic: &str, i: usize) -> Message {
    Message::builder()
        .topic(topic)
        .tags("legacy")
        .key(format!("k-{i}"))
        .body(format!(r#"{{"plain":{i}}}"#).into_bytes())
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq_source_maps_cloudevents_wraps_others_and_resumes_from_stored_positions() {
    let mq = RocketMq::start().await;
    let topic = "SluiceSource";
    mq.ensure_topic(topic).await;
    let producer = mq.producer("source-test-producer").await;
    let ce = Message::builder()
        .topic(topic)
        .body(br#"{"hello":"world"}"#.to_vec())
        .raw_property("CE_specversion", "1.0")
        .unwrap()
        .raw_property("CE_id", "ce-1")
        .unwrap()
        .raw_property("CE_source", "/mq")
        .unwrap()
        .raw_property("CE_type", "com.example.native")
        .unwrap()
        .raw_property("CE_tenant", "acme")
        .unwrap()
        .raw_property("CE_datacontenttype", "application/json")
        .unwrap()
        .build()
        .unwrap();
    producer.send(ce).await.unwrap();
    for i in 0..3 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    let mut sluice = Sluice::builder()
        .extra(&source(&mq.name_server(), topic))
        .start()
        .await;
    // The warm-up message of ensure_topic is wrapped too: 1 + 1 + 3.
    let events = sluice
        .wait_delivered(Duration::from_secs(60), |e| e.len() >= 5)
        .await;
    let native = events
        .iter()
        .find(|e| e["id"] == "ce-1")
        .expect("the CloudEvent");
    assert_eq!(native["type"], "com.example.native");
    assert_eq!(native["source"], "/mq");
    assert_eq!(native["tenant"], "acme");
    assert_eq!(native["data"]["hello"], "world");
    let wrapped: Vec<_> = events
        .iter()
        .filter(|e| e["type"] == "com.example.legacy")
        .collect();
    assert_eq!(wrapped.len(), 4);
    let w0 = wrapped
        .iter()
        .find(|e| e["data"]["plain"] == 0)
        .expect("plain 0");
    assert_eq!(w0["source"], format!("rocketmq://{topic}"));
    assert_eq!(w0["subject"], "legacy");
    assert_eq!(w0["partitionkey"], "k-0");

    // Stop (positions committed), send more, start again: only the new ones arrive. The
    // broker stores a batch send as one entry with consecutive offsets; the positions must
    // land after its last message, checked by the next restart.
    assert!(sluice.terminate().success());
    producer
        .send_batch((3..6).map(|i| plain(topic, i)).collect::<Vec<_>>())
        .await
        .unwrap();
    for (round, total) in [(0, 8), (1, 9)] {
        if round == 1 {
            assert!(sluice.terminate().success());
            producer.send(plain(topic, 6)).await.unwrap();
        }
        sluice.restart().await;
        sluice
            .wait_delivered(Duration::from_secs(60), |e| e.len() >= total)
            .await;
        // Give a wrongly rewound source time to show itself.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let events = sluice.delivered();
        let mut all = ids(&events);
        all.sort();
        all.dedup();
        assert_eq!(all.len(), total, "{:?}", ids(&events));
        assert_eq!(
            events.len(),
            total,
            "no message read twice after a clean restart: {:?}",
            ids(&events)
        );
    }
}

/// The `plain` numbers delivered by any of the replicas, and how many lines carried one.
fn plain_numbers(replicas: &[&Sluice]) -> (BTreeSet<u64>, usize) {
    let events: Vec<Value> = replicas.iter().flat_map(|r| r.delivered()).collect();
    let numbers: Vec<u64> = events
        .iter()
        .filter_map(|e| e["data"]["plain"].as_u64())
        .collect();
    (numbers.iter().copied().collect(), numbers.len())
}

async fn wait_plain(replicas: &[&Sluice], count: u64) -> usize {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let (seen, lines) = plain_numbers(replicas);
        if (0..count).all(|i| seen.contains(&i)) {
            return lines;
        }
        let missing: Vec<u64> = (0..count).filter(|i| !seen.contains(i)).take(10).collect();
        assert!(
            Instant::now() < deadline,
            "messages never delivered (first missing: {missing:?})"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The replicas' running source tasks: task id → worker.
async fn source_tasks(sluice: &Sluice) -> Vec<(String, String)> {
    sluice
        .running_tasks()
        .await
        .into_iter()
        .filter(|(id, _)| id.starts_with("source/mq-in#"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq_source_queues_are_tasks_spread_over_replicas_and_taken_over_after_a_kill() {
    let mq = RocketMq::start().await;
    let topic = "SluiceSourceSpread";
    mq.ensure_topic(topic).await;
    let producer = mq.producer("source-spread-producer").await;
    let (url, prefix) = shared_redis("source-spread");
    let config = source_with_tasks(&mq.name_server(), topic, 4);
    let start = || {
        Sluice::builder()
            .distributed(&url, &prefix)
            .extra(&config)
            .start()
    };
    let mut a = start().await;
    let b = start().await;
    b.wait_members(2).await;

    // All four tasks run, spread over both replicas (sorted-hash of 4 source tasks and 4
    // delivery tasks over 2 workers), each on one worker.
    let deadline = Instant::now() + Duration::from_secs(30);
    let tasks = loop {
        let tasks = source_tasks(&b).await;
        let workers: HashSet<&String> = tasks.iter().map(|(_, w)| w).collect();
        if tasks.len() == 4 && workers.len() == 2 {
            break tasks;
        }
        assert!(
            Instant::now() < deadline,
            "source tasks not spread over both replicas: {tasks:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("source tasks: {tasks:?}");

    for i in 0..200 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    wait_plain(&[&a, &b], 200).await;

    // Kill one replica: its queues move to the other, which resumes from the committed
    // positions (re-reading at most what was not committed).
    a.kill9();
    for i in 200..400 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    let lines = wait_plain(&[&a, &b], 400).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let tasks = source_tasks(&b).await;
        let workers: HashSet<&String> = tasks.iter().map(|(_, w)| w).collect();
        if tasks.len() == 4 && workers.len() == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the survivor never took every source task: {tasks:?}\n{}\n{}",
            b.cluster_view().await,
            b.log()
                .lines()
                .filter(|l| l.contains("source") || l.contains("lease"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eprintln!(
        "400 messages, {lines} delivered lines, {} duplicates",
        lines - 400
    );
    // At least once, and a kill re-reads at most the uncommitted tail, not the topic.
    assert!(lines < 600, "{lines} lines for 400 messages");

    // Paused from the admin API, the source reads nothing; resumed, it catches up.
    let client = reqwest::Client::new();
    let act = |action: &str| {
        client
            .post(b.url(&format!("/admin/sources/mq-in/{action}")))
            .send()
    };
    assert_eq!(act("pause").await.unwrap().status(), 202);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !source_tasks(&b).await.is_empty() {
        assert!(Instant::now() < deadline, "source tasks never stopped");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for i in 400..450 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (seen, _) = plain_numbers(&[&a, &b]);
    assert!(
        !(400..450).any(|i| seen.contains(&i)),
        "a paused source delivered"
    );
    assert_eq!(act("resume").await.unwrap().status(), 202);
    wait_plain(&[&a, &b], 450).await;
}
