//! Benchmark (ignored in normal runs; `make bench-targets`): end-to-end events/s through the
//! gateway into RocketMQ and into an HTTP receiver, each against the peer's own capacity
//! measured in the same run (the broker with the harness's batch producer, the receiver
//! with direct concurrent POSTs).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use rocketmq_model::common::message::message_single::Message;
use serde_json::Value;
use sluice_tests::receiver::Receiver;
use sluice_tests::rocketmq::RocketMq;
use sluice_tests::{post_batch, Sluice};

const BATCH: usize = 100;
const POSTERS: usize = 4;

/// Posts `n` events to the gateway in batches of 100 from `POSTERS` concurrent clients.
async fn post_events(url: &str, n: usize, tag: &str) {
    let client = reqwest::Client::new();
    let mut tasks = Vec::new();
    for p in 0..POSTERS {
        let client = client.clone();
        let url = url.to_string();
        let tag = tag.to_string();
        tasks.push(tokio::spawn(async move {
            let mut i = p * BATCH;
            while i < n {
                let batch: Vec<Value> = (i..(i + BATCH).min(n))
                    .map(|k| {
                        serde_json::json!({"specversion": "1.0", "id": format!("{tag}-{k}"), "source": "/bench",
                            "type": "bench", "partitionkey": format!("k{}", k % 64),
                            "datacontenttype": "application/json", "data": {"k": k, "pad": "x".repeat(100)}})
                    })
                    .collect();
                post_batch(&client, &url, batch).await;
                i += POSTERS * BATCH;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

async fn topic_messages(
    producer: &mut rocketmq_client_rust::DefaultMQProducer,
    topic: &str,
) -> i64 {
    let queues = producer
        .fetch_publish_message_queues(topic)
        .await
        .unwrap_or_default();
    let mut total = 0;
    for q in &queues {
        total += producer.max_offset(q).await.unwrap_or(0);
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
#[ignore = "benchmark: make bench-targets"]
async fn bench_targets_rocketmq_and_http() {
    let n: usize = std::env::var("SLUICE_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let mq = RocketMq::start().await;
    mq.ensure_topic("BenchRaw").await;
    mq.ensure_topic("BenchSluice").await;

    // 1. The broker's own producer throughput: batches of 100, 8 in flight.
    let producer = Arc::new(mq.producer("bench-raw").await);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..8 {
        let producer = producer.clone();
        tasks.push(tokio::spawn(async move {
            let mut i = w * BATCH;
            while i < n {
                let batch: Vec<Message> = (i..(i + BATCH).min(n))
                    .map(|k| {
                        Message::builder()
                            .topic("BenchRaw")
                            .body(
                                format!(r#"{{"k":{k},"pad":"{}"}}"#, "x".repeat(100)).into_bytes(),
                            )
                            .build()
                            .unwrap()
                    })
                    .collect();
                producer.send_batch(batch).await.unwrap();
                i += 8 * BATCH;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let raw_mq = n as f64 / start.elapsed().as_secs_f64();

    // 2. End to end into RocketMQ: HTTP batches in, until the broker holds them all.
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&format!(
            "\n[[rules]]\nname = \"mq\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"rocketmq\"\nname = \"mq\"\nname_server = \"{}\"\ntopic = \"BenchSluice\"\n",
            mq.name_server()
        ))
        .start()
        .await;
    let mut counter = mq.producer("bench-counter").await;
    let before = topic_messages(&mut counter, "BenchSluice").await;
    let start = Instant::now();
    post_events(&sluice.events_url(), n, "mq").await;
    let ingest = start.elapsed();
    let deadline = Instant::now() + Duration::from_secs(300);
    while topic_messages(&mut counter, "BenchSluice").await - before < n as i64 {
        assert!(
            Instant::now() < deadline,
            "not all events reached the broker"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let e2e_mq = n as f64 / start.elapsed().as_secs_f64();
    drop(sluice);

    // 3. The receiver's raw capacity: direct POSTs, 16 in flight.
    let receiver = Receiver::start().await;
    let client = reqwest::Client::new();
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..16 {
        let client = client.clone();
        let url = receiver.url("/raw");
        tasks.push(tokio::spawn(async move {
            let mut i = w;
            while i < n {
                client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(format!(r#"{{"k":{i}}}"#))
                    .send()
                    .await
                    .unwrap();
                i += 16;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let raw_http = n as f64 / start.elapsed().as_secs_f64();
    drop(receiver);

    // 4. End to end into the receiver (concurrent delivery, 16 in flight).
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&format!(
            "\n[[rules]]\nname = \"hook\"\nbus = \"default\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"hook\"\nurl = \"{}\"\nconcurrent = true\nmax_in_flight = 16\n",
            receiver.url("/hook")
        ))
        .start()
        .await;
    let start = Instant::now();
    post_events(&sluice.events_url(), n, "http").await;
    receiver.wait_accepted(n, Duration::from_secs(300)).await;
    let e2e_http = n as f64 / start.elapsed().as_secs_f64();

    sluice_tests::bench_summary_start("targets");
    sluice_tests::bench_summary("targets", "rocketmq.ratio", e2e_mq / raw_mq);
    sluice_tests::bench_summary("targets", "http.ratio", e2e_http / raw_http);
    println!("BENCH events={n} per phase, 4 shards, durability=os, 2 cores shared by gateway, broker and load");
    println!("BENCH rocketmq broker producer (batches of 100, 8 in flight): {raw_mq:.0} msg/s");
    println!("BENCH gateway -> rocketmq end to end: {e2e_mq:.0} events/s (ingest alone took {ingest:?}) = {:.0}% of the broker's producer rate", 100.0 * e2e_mq / raw_mq);
    println!("BENCH receiver raw capacity (16 concurrent POSTs): {raw_http:.0} req/s");
    println!("BENCH gateway -> http end to end: {e2e_http:.0} events/s = {:.0}% of the receiver's raw capacity", 100.0 * e2e_http / raw_http);
}
