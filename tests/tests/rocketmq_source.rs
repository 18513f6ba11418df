//! The RocketMQ source connector against a real broker: CloudEvents messages become those
//! events, other messages are wrapped, and positions survive a restart (kept in the store).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use rocketmq_model::common::message::message_single::Message;
use sluice_tests::rocketmq::RocketMq;
use sluice_tests::{ids, Sluice};

fn source(name_server: &str, topic: &str) -> String {
    format!(
        r#"
[[sources]]
type = "rocketmq"
name = "mq-in"
name_server = "{name_server}"
topic = "{topic}"
bus = "default"
wrap_type = "com.example.legacy"
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

    // Stop (positions committed), send more, start again: only the new ones arrive.
    assert!(sluice.terminate().success());
    for i in 3..6 {
        producer.send(plain(topic, i)).await.unwrap();
    }
    sluice.restart().await;
    sluice
        .wait_delivered(Duration::from_secs(60), |e| e.len() >= 8)
        .await;
    // Give a wrongly rewound source time to show itself.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let events = sluice.delivered();
    let mut all = ids(&events);
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 8, "{:?}", ids(&events));
    assert_eq!(
        events.len(),
        8,
        "no message read twice after a clean restart: {:?}",
        ids(&events)
    );
}
