//! The RocketMQ target against a real name server and broker (see `sluice_tests::rocketmq`),
//! as a new user meets it: topics nobody warmed up, events posted one request at a time and
//! in batches, a broker restart, a broker that does not create topics, a topic whose queue
//! count changes. Every check reads each queue of the topic from its first offset and looks
//! at the queue id and queue offset the consumer reports: per partition key one queue and
//! the posted order, nothing lost, nothing duplicated unless a fault was injected. Plus the
//! CloudEvents RocketMQ binding (CE_ properties, data as the body) and what the remoting
//! format cannot carry (separators in values, no data, attributes too large for properties).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_tests::rocketmq::{Received, RocketMq};
use sluice_tests::{post_batch, target_rule, Sluice};

/// A rule from bus `default` to a `rocketmq` target with default settings plus `extra`.
fn target(name_server: &str, topic: &str, extra: &str) -> String {
    target_rule(
        "to-mq",
        "rocketmq",
        "mq",
        &format!("name_server = \"{name_server}\"\ntopic = \"{topic}\"\n{extra}"),
    )
}

/// The gateway of the issue: a bus of 4 shards with one rule to the topic.
async fn gateway(mq: &RocketMq, topic: &str, extra: &str) -> Sluice {
    Sluice::builder()
        .shards(4)
        .extra(&target(&mq.name_server(), topic, extra))
        .start()
        .await
}

/// Posts one binary-mode event with id `mq-{key}-{n}` and partition key `key`.
async fn post_keyed(client: &reqwest::Client, url: &str, key: &str, n: usize) {
    let r = sluice_tests::binary(
        client,
        url,
        &format!("mq-{key}-{n}"),
        &format!(r#"{{"key":"{key}","n":{n}}}"#),
    )
    .header("ce-partitionkey", key)
    .send()
    .await
    .expect("post");
    assert_eq!(r.status().as_u16(), 202, "{}", r.text().await.unwrap());
}

/// A structured-mode event `mq-{key}-{n}` for batch requests.
fn keyed_event(key: &str, n: usize) -> Value {
    serde_json::json!({
        "specversion": "1.0",
        "id": format!("mq-{key}-{n}"),
        "source": "/tests",
        "type": "com.example.test",
        "partitionkey": key,
        "datacontenttype": "application/json",
        "data": {"key": key, "n": n}
    })
}

/// What the topic holds, per partition key: the queues its events are on and their
/// sequence numbers in stored order (queue by queue, by queue offset).
#[derive(Debug, Default)]
struct Ledger {
    queues: BTreeMap<String, BTreeSet<i32>>,
    seqs: BTreeMap<String, Vec<usize>>,
    duplicates: usize,
    lost: Vec<String>,
}

impl Ledger {
    /// `posted`: per key, how many events were posted (ids `mq-{key}-0..n`).
    fn of(stored: &[Received], posted: &BTreeMap<String, usize>) -> Ledger {
        let mut ledger = Ledger::default();
        let mut copies: HashMap<String, usize> = HashMap::new();
        for m in stored {
            let id = m.property("CE_id").expect("CE_id");
            let (key, n) = id
                .strip_prefix("mq-")
                .and_then(|rest| rest.rsplit_once('-'))
                .expect("an id mq-{key}-{n}");
            assert_eq!(m.property("CE_partitionkey"), Some(key), "{id}");
            ledger
                .queues
                .entry(key.to_string())
                .or_default()
                .insert(m.queue_id);
            ledger
                .seqs
                .entry(key.to_string())
                .or_default()
                .push(n.parse().unwrap());
            *copies.entry(id.to_string()).or_default() += 1;
        }
        ledger.duplicates = copies.values().map(|c| c - 1).sum();
        for (key, n) in posted {
            for i in 0..*n {
                let id = format!("mq-{key}-{i}");
                if !copies.contains_key(&id) {
                    ledger.lost.push(id);
                }
            }
        }
        ledger
    }

    /// Per key, one queue; and the first occurrences of its events in the posted order.
    fn assert_one_queue_and_posted_order(&self, posted: &BTreeMap<String, usize>) {
        assert!(self.lost.is_empty(), "lost: {:?}", self.lost);
        for (key, n) in posted {
            assert_eq!(
                self.queues[key].len(),
                1,
                "key {key} is on queues {:?}",
                self.queues[key]
            );
            let mut seen = BTreeSet::new();
            let first: Vec<usize> = self.seqs[key]
                .iter()
                .copied()
                .filter(|s| seen.insert(*s))
                .collect();
            assert_eq!(
                first,
                (0..*n).collect::<Vec<_>>(),
                "order of key {key} (stored: {:?})",
                self.seqs[key]
            );
        }
    }

    /// The route the producer started with (for a new topic, the default one) is the route
    /// the topic got: no key moved.
    fn assert_no_queue_change(sluice: &Sluice) {
        assert!(
            !sluice.log().contains("the topic's queues changed"),
            "{}",
            sluice.log()
        );
    }

    fn report(&self, what: &str, stored: usize) {
        let per_key: Vec<String> = self
            .queues
            .iter()
            .map(|(k, q)| format!("{k}:{q:?}"))
            .collect();
        println!(
            "{what}: {stored} messages stored, {} duplicates, {} lost; queues per key {}",
            self.duplicates,
            self.lost.len(),
            per_key.join(" ")
        );
    }
}

/// Reads back what `keys` (`per_key` events each, posted without faults) left in `topic`:
/// each key on one queue in posted order, no queue change, no duplicate, nothing lost.
async fn assert_stored_in_order(
    mq: &RocketMq,
    topic: &str,
    sluice: &Sluice,
    keys: &[impl AsRef<str>],
    per_key: usize,
    what: &str,
) {
    let stored = mq.read_queues(topic, keys.len() * per_key).await;
    let posted: BTreeMap<String, usize> = keys
        .iter()
        .map(|k| (k.as_ref().to_string(), per_key))
        .collect();
    let ledger = Ledger::of(&stored, &posted);
    ledger.report(what, stored.len());
    ledger.assert_one_queue_and_posted_order(&posted);
    Ledger::assert_no_queue_change(sluice);
    assert_eq!(
        ledger.duplicates, 0,
        "no duplicates in a run without faults"
    );
    assert_eq!(stored.len(), keys.len() * per_key);
}

/// The issue's reproduction: a fresh topic, 300 binary-mode events posted one request at a
/// time, keys a..e in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_stays_on_one_queue_in_order_posted_one_request_at_a_time() {
    let mq = RocketMq::start().await;
    let topic = "SluiceOneByOne";
    let sluice = gateway(&mq, topic, "").await;
    let client = reqwest::Client::new();
    let keys = ["a", "b", "c", "d", "e"];
    const PER_KEY: usize = 60;
    for n in 0..PER_KEY {
        for key in keys {
            post_keyed(&client, &sluice.events_url(), key, n).await;
        }
    }
    assert_stored_in_order(&mq, topic, &sluice, &keys, PER_KEY, "one request at a time").await;
}

/// Batch-mode requests of several keys interleaved, on a fresh topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_key_stays_on_one_queue_in_order_posted_in_batches() {
    let mq = RocketMq::start().await;
    let topic = "SluiceBatches";
    let sluice = gateway(&mq, topic, "").await;
    let client = reqwest::Client::new();
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    const PER_KEY: usize = 100;
    const ROUNDS_PER_REQUEST: usize = 5;
    for first in (0..PER_KEY).step_by(ROUNDS_PER_REQUEST) {
        let batch: Vec<Value> = (first..first + ROUNDS_PER_REQUEST)
            .flat_map(|n| keys.iter().map(move |k| keyed_event(k, n)))
            .collect();
        post_batch(&client, &sluice.events_url(), batch).await;
    }
    assert_stored_in_order(&mq, topic, &sluice, &keys, PER_KEY, "batches").await;
}

/// The broker restarts (SIGTERM, start again) while events keep coming: nothing is lost,
/// each key stays on its queue, the first occurrences keep the posted order; duplicates are
/// counted and bounded (a send cut by the restart may have been stored before it failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restart_loses_nothing_and_keeps_each_key_in_order() {
    let mut mq = RocketMq::start().await;
    let topic = "SluiceRestart";
    let sluice = gateway(&mq, topic, "").await;
    let keys = ["a", "b", "c", "d", "e", "f"];
    const PER_KEY: usize = 100;
    // Rounds of one event per key, 50 ms apart, from a task of their own: the restart
    // happens while they keep coming.
    let (started, mut running) = tokio::sync::mpsc::channel::<()>(1);
    let url = sluice.events_url();
    let poster = tokio::spawn(async move {
        let client = reqwest::Client::new();
        for n in 0..PER_KEY {
            let batch: Vec<Value> = keys.iter().map(|k| keyed_event(k, n)).collect();
            post_batch(&client, &url, batch).await;
            if n == PER_KEY / 5 {
                let _ = started.send(()).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    running.recv().await;
    mq.restart_broker().await;
    poster.await.unwrap();
    let stored = mq.read_queues(topic, keys.len() * PER_KEY).await;
    let posted: BTreeMap<String, usize> = keys.iter().map(|k| (k.to_string(), PER_KEY)).collect();
    let ledger = Ledger::of(&stored, &posted);
    ledger.report("broker restart", stored.len());
    ledger.assert_one_queue_and_posted_order(&posted);
    Ledger::assert_no_queue_change(&sluice);
    assert!(
        ledger.duplicates <= keys.len() * PER_KEY / 2,
        "{} duplicates",
        ledger.duplicates
    );
    let failed = sluice
        .log()
        .lines()
        .filter(|l| l.contains("delivery failed"))
        .count();
    println!("broker restart: {failed} failed delivery attempts while it was away");
    assert!(failed > 0, "the restart was noticed");
}

/// A broker without `autoCreateTopicEnable`: the task status says the topic must be created
/// and how; once it is, the pending event goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_the_broker_will_not_create_is_reported_with_how_to_create_it() {
    let mq = RocketMq::builder().auto_create_topics(false).start().await;
    let topic = "SluiceNotCreated";
    let sluice = gateway(&mq, topic, "").await;
    let client = reqwest::Client::new();
    post_keyed(&client, &sluice.events_url(), "a", 0).await;

    let reason = sluice_tests::eventually(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            let view = sluice.cluster_view().await;
            view["statuses"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|s| s["state"] == "FAILED")
                .filter_map(|s| s["reason"].as_str())
                .find(|r| r.contains(topic))
                .map(str::to_string)
                .ok_or_else(|| {
                    format!(
                        "no status about the missing topic: {view}\n{}",
                        sluice.log()
                    )
                })
        },
    )
    .await;
    println!("status: {reason}");
    assert!(
        reason.contains("autoCreateTopicEnable = false")
            && reason.contains(&format!("mqadmin updateTopic -n {}", mq.name_server()))
            && reason.contains(&format!("-t {topic}")),
        "{reason}"
    );

    mq.create_topic(topic, 4).await;
    let stored = mq.read_queues(topic, 1).await;
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].property("CE_id"), Some("mq-a-0"));
}

/// The topic's queue count goes from 4 to 8 while events keep coming: the change is logged,
/// and from the moment the gateway sees it every key is on one queue in order again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_of_the_queue_count_is_logged_and_order_holds_from_then_on() {
    let mq = RocketMq::start().await;
    let topic = "SluiceResized";
    mq.create_topic(topic, 4).await;
    let sluice = gateway(&mq, topic, "").await;
    let client = reqwest::Client::new();
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let mut n = 0;
    let post_round = |n: usize| {
        let batch: Vec<Value> = keys.iter().map(|k| keyed_event(k, n)).collect();
        let client = client.clone();
        let url = sluice.events_url();
        async move { post_batch(&client, &url, batch).await }
    };
    for _ in 0..20 {
        post_round(n).await;
        n += 1;
    }
    // Delivery runs behind ingest: the gateway must have sent under 4 queues before the
    // topic grows, or its first route already lists 8 and there is no change to see (on a
    // loaded machine its first send can come after the resize).
    mq.read_queues(topic, keys.len() * n).await;
    mq.create_topic(topic, 8).await;
    // The producer refreshes its routes every 30 s: keep posting until it sees the change.
    let deadline = Instant::now() + Duration::from_secs(120);
    while !sluice.log().contains("the topic's queues changed") {
        assert!(
            Instant::now() < deadline,
            "the change was never logged:\n{}",
            sluice.log()
        );
        post_round(n).await;
        n += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for _ in 0..20 {
        post_round(n).await;
        n += 1;
    }
    let stored = mq.read_queues(topic, keys.len() * n).await;
    // The error that refused the batches grouped under 4 queues (the task status's reason).
    assert!(
        sluice
            .log()
            .contains("the queues of topic `SluiceResized` changed from 4 to 8"),
        "{}",
        sluice.log()
    );
    let posted: BTreeMap<String, usize> = keys.iter().map(|k| (k.clone(), n)).collect();
    let ledger = Ledger::of(&stored, &posted);
    ledger.report("queue count change", stored.len());
    assert!(ledger.lost.is_empty(), "lost: {:?}", ledger.lost);
    // Per key: at most one queue before the change and one after; within each queue the
    // events are in order, and the old queue's events then the new queue's, first
    // occurrences only, are the posted order.
    for key in &keys {
        let mut by_queue: BTreeMap<i32, Vec<usize>> = BTreeMap::new();
        for m in &stored {
            if m.property("CE_partitionkey") == Some(key.as_str()) {
                let id = m.property("CE_id").unwrap();
                let seq: usize = id.rsplit_once('-').unwrap().1.parse().unwrap();
                by_queue.entry(m.queue_id).or_default().push(seq);
            }
        }
        assert!(by_queue.len() <= 2, "{key}: {by_queue:?}");
        for seqs in by_queue.values() {
            // At least once: a batch sent again after a timeout (the first sends to a new
            // topic are the slow ones) repeats events; their first occurrences are in order.
            let mut seen = BTreeSet::new();
            let firsts: Vec<usize> = seqs.iter().copied().filter(|s| seen.insert(*s)).collect();
            assert!(
                firsts.windows(2).all(|w| w[0] < w[1]),
                "{key}: {by_queue:?}"
            );
        }
        let mut runs: Vec<&Vec<usize>> = by_queue.values().collect();
        runs.sort_by_key(|seqs| seqs[0]);
        let mut seen = BTreeSet::new();
        let first: Vec<usize> = runs
            .into_iter()
            .flatten()
            .copied()
            .filter(|s| seen.insert(*s))
            .collect();
        assert_eq!(first, (0..n).collect::<Vec<_>>(), "{key}: {by_queue:?}");
    }
}

/// The CloudEvents RocketMQ binding, and what the remoting format cannot carry: values
/// holding its separators (they must not forge properties such as `_SYS_MSG_PRIORITY_`,
/// which moves a message to another queue), an event without data (RocketMQ refuses empty
/// bodies) and attributes larger than properties can hold (structured mode).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_accepted_event_becomes_a_message_the_broker_takes() {
    let mq = RocketMq::start().await;
    let topic = "SluiceBinding";
    let sluice = gateway(&mq, topic, "tag_attribute = \"type\"").await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();

    // Binary mode, percent-encoded header: the value holds \u{2}_SYS_MSG_PRIORITY_\u{1}7.
    // CloudEvents forbids control characters in attributes, so ingress refuses it (the
    // target's own encoding of them is covered by its unit tests, for values a transform
    // makes).
    let r = sluice_tests::send_expecting(
        sluice_tests::binary(&client, &url, "forged", r#"{"key":"p"}"#)
            .header("ce-partitionkey", "p")
            .header("ce-evil", "x%02_SYS_MSG_PRIORITY_%017"),
        400,
    )
    .await;
    assert!(r.text().await.unwrap().contains("evil"));
    // No data at all.
    let r = client
        .post(&url)
        .header("ce-specversion", "1.0")
        .header("ce-id", "empty")
        .header("ce-source", "/tests")
        .header("ce-type", "com.example.empty")
        .header("ce-partitionkey", "p")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 202, "{}", r.text().await.unwrap());
    // An attribute larger than all properties together may be.
    let mut big = keyed_event("p", 0);
    big["id"] = "big".into();
    big["huge"] = "h".repeat(40 * 1024).into();
    post_batch(&client, &url, vec![big]).await;
    // And an ordinary one, to check the binding's properties.
    let mut plain = keyed_event("p", 1);
    plain["id"] = "plain".into();
    plain["subject"] = "orders".into();
    post_batch(&client, &url, vec![plain]).await;

    let stored = mq.read_queues(topic, 3).await;
    assert_eq!(stored.len(), 3, "{stored:?}");
    let by_id: HashMap<String, &Received> = stored
        .iter()
        .map(|m| {
            let id = m
                .property("CE_id")
                .or(m.keys.as_deref())
                .unwrap()
                .to_string();
            (id, m)
        })
        .collect();
    let queues: BTreeSet<i32> = stored.iter().map(|m| m.queue_id).collect();
    assert_eq!(queues.len(), 1, "one partition key, one queue: {queues:?}");
    let order: Vec<&str> = stored
        .iter()
        .map(|m| m.property("CE_id").or(m.keys.as_deref()).unwrap())
        .collect();
    assert_eq!(order, ["empty", "big", "plain"]);

    let empty = by_id["empty"];
    assert_eq!(empty.body, b"\0");
    assert_eq!(empty.property("CE_type"), Some("com.example.empty"));

    let big = by_id["big"];
    assert_eq!(
        big.property("CE_contenttype"),
        Some("application/cloudevents+json")
    );
    assert_eq!(big.keys.as_deref(), Some("big"));
    let event: Value = serde_json::from_slice(&big.body).unwrap();
    assert_eq!(event["huge"].as_str().map(str::len), Some(40 * 1024));

    let plain = by_id["plain"];
    assert_eq!(plain.property("CE_source"), Some("/tests"));
    assert_eq!(plain.property("CE_type"), Some("com.example.test"));
    assert_eq!(plain.property("CE_specversion"), Some("1.0"));
    assert_eq!(plain.property("CE_subject"), Some("orders"));
    assert_eq!(plain.property("CE_partitionkey"), Some("p"));
    assert_eq!(
        plain.property("CE_datacontenttype"),
        Some("application/json")
    );
    assert_eq!(plain.tags.as_deref(), Some("com.example.test"));
    assert_eq!(plain.keys.as_deref(), Some("plain"));
    let body: Value = serde_json::from_slice(&plain.body).unwrap();
    assert_eq!(body, serde_json::json!({"key": "p", "n": 1}));
    assert!(
        !sluice.log().contains("delivery failed"),
        "{}",
        sluice.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocketmq_target_unreachable_name_server_is_retried_not_dropped() {
    // The gateway starts while the name server is not there: it starts anyway (the producer
    // starts on first use) and the event stays pending, retried; once the name server and
    // the broker appear, it arrives, once.
    let port = sluice_tests::free_port();
    let sluice = Sluice::builder()
        .extra(&target(&format!("127.0.0.1:{port}"), "Late", ""))
        .start()
        .await;
    sluice_tests::post_event(&sluice, "late-1").await;
    let failures = |log: &str| log.matches("delivery failed").count();
    let deadline = Instant::now() + Duration::from_secs(30);
    while failures(&sluice.log()) < 3 {
        assert!(Instant::now() < deadline, "not retried:\n{}", sluice.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mq = RocketMq::builder().namesrv_port(port).start().await;
    let stored = mq.read_queues("Late", 1).await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(
        stored[0].property("CE_id").or(stored[0].keys.as_deref()),
        Some("late-1")
    );
}
