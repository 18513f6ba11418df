//! The RocketMQ source connector against a real broker: CloudEvents messages become those
//! events, other messages are wrapped, and positions survive a restart (kept in the store).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
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
    let native = sluice_tests::find_event(&events, "ce-1");
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

/// Where the duplicates are: lines per replica, and per queue how many messages came twice
/// and which numbers (first few).
fn duplicates(replicas: &[(&str, &Sluice)]) -> String {
    let mut out = String::new();
    let mut seen: BTreeMap<u64, Vec<(String, i64, i64, String)>> = BTreeMap::new();
    for (name, replica) in replicas {
        let events = replica.delivered();
        out.push_str(&format!("{name}: {} lines; ", events.len()));
        for e in events {
            if let Some(n) = e["data"]["plain"].as_u64() {
                seen.entry(n).or_default().push((
                    name.to_string(),
                    e["rocketmqqueue"].as_i64().unwrap_or(-1),
                    e["rocketmqoffset"].as_i64().unwrap_or(-1),
                    e["id"].as_str().unwrap_or("").to_string(),
                ));
            }
        }
    }
    let mut per_queue: BTreeMap<i64, Vec<String>> = BTreeMap::new();
    for (n, copies) in seen.iter().filter(|(_, c)| c.len() > 1) {
        let ids: HashSet<&String> = copies.iter().map(|c| &c.3).collect();
        let offsets: HashSet<i64> = copies.iter().map(|c| c.2).collect();
        let by: Vec<&str> = copies.iter().map(|c| c.0.as_str()).collect();
        per_queue.entry(copies[0].1).or_default().push(format!(
            "{n}x{}({}ids,{}offsets,{})",
            copies.len(),
            ids.len(),
            offsets.len(),
            by.join("")
        ));
    }
    for (queue, dups) in per_queue {
        out.push_str(&format!(
            "\n  queue {queue}: {} duplicated: {}",
            dups.len(),
            dups.iter().take(12).cloned().collect::<Vec<_>>().join(" ")
        ));
    }
    out
}

/// Waits until the store holds, for every queue a delivered message came from, the offset
/// after the last such message, and returns those committed positions (queue → next).
async fn wait_source_positions(
    url: &str,
    prefix: &str,
    replicas: &[&Sluice],
) -> BTreeMap<i64, i64> {
    let mut expected: BTreeMap<i64, i64> = BTreeMap::new();
    for e in replicas.iter().flat_map(|r| r.delivered()) {
        if let (Some(q), Some(o)) = (e["rocketmqqueue"].as_i64(), e["rocketmqoffset"].as_i64()) {
            let next = expected.entry(q).or_insert(0);
            *next = (*next).max(o + 1);
        }
    }
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let key = format!("{prefix}:{{source/mq-in}}:pos:broker-a");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let stored: BTreeMap<i64, i64> = redis::cmd("HGETALL")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        if expected
            .iter()
            .all(|(q, next)| stored.get(q).is_some_and(|s| s >= next))
        {
            return stored;
        }
        assert!(
            Instant::now() < deadline,
            "source positions never committed: stored {stored:?}, expected {expected:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every (queue, offset) the replica's source tasks logged resuming a queue from.
fn resumed_from(log: &str) -> Vec<(i64, i64)> {
    let field = |line: &str, name: &str| -> Option<i64> {
        let rest = &line[line.find(&format!(" {name}="))? + name.len() + 2..];
        rest.split(|c: char| !(c.is_ascii_digit() || c == '-'))
            .next()?
            .parse()
            .ok()
    };
    log.lines()
        .filter(|l| l.contains("resumes from its stored position"))
        .filter_map(|l| Some((field(l, "queue")?, field(l, "from")?)))
        .collect()
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

/// Waits until `replica` delivered every message numbered in `range`.
async fn wait_plain_range(replica: &Sluice, range: std::ops::Range<u64>) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !range
        .clone()
        .all(|i| plain_numbers(&[replica]).0.contains(&i))
    {
        assert!(
            Instant::now() < deadline,
            "messages {range:?} never delivered"
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
    // Every message read is committed to the store (per queue, the offset after the last
    // message delivered) before the kill, so the takeover has a position to resume from.
    let committed = wait_source_positions(&url, &prefix, &[&a, &b]).await;
    eprintln!("committed source positions before the kill: {committed:?}");

    // Kill one replica: its queues move to the other, which resumes from the committed
    // positions rather than from the start of the queue.
    let mark = b.log().len();
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
    // At least once (every number arrived, checked above); duplicates are reported. They
    // come from deliveries not yet committed when a task moved, which a loaded machine
    // makes more of, so their number is not a property to assert. What must hold: no
    // source task of the survivor started a queue below its committed position.
    eprintln!(
        "400 messages, {lines} delivered lines, {} duplicates\n{}",
        lines - 400,
        duplicates(&[("a", &a), ("b", &b)])
    );
    let log = b.log();
    let after_kill = log.get(mark..).unwrap_or_default();
    let resumed = resumed_from(after_kill);
    assert!(
        !resumed.is_empty(),
        "no source task resumed a queue after the kill:\n{log}"
    );
    for (queue, from) in &resumed {
        let floor = committed.get(queue).copied().unwrap_or(0);
        assert!(
            *from >= floor,
            "queue {queue} resumed at {from}, below its committed position {floor}: {resumed:?}\n{log}"
        );
    }
    assert!(
        !after_kill.contains("has no stored position"),
        "after the kill a queue was read from its first message:\n{after_kill}"
    );

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
    // The witness: a gateway of its own reading the same topic, never paused. Once it has
    // delivered the messages sent during the pause, a source that ignored the pause would
    // have had as long to deliver them too (a positive marker instead of a fixed sleep).
    let witness = Sluice::builder()
        .extra(&source(&mq.name_server(), topic).replace("mq-in", "mq-witness"))
        .start()
        .await;
    for i in 400..450 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    wait_plain_range(&witness, 400..450).await;
    let (seen, _) = plain_numbers(&[&a, &b]);
    assert!(
        !(400..450).any(|i| seen.contains(&i)),
        "a paused source delivered"
    );
    assert_eq!(act("resume").await.unwrap().status(), 202);
    wait_plain(&[&a, &b], 450).await;
}
