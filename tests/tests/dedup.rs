//! Deduplication of CloudEvents on a bus with a `dedup_window`, through the real binary:
//! records are fixed-size whatever the event's `id` (in the standalone dedup file and in
//! Redis), and scoped per producer key, so one producer cannot make another's event a
//! duplicate.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{shared_redis, wait_jsonl, Sluice};

/// A bus `once` (one shard, a one-hour dedup window) whose events go to `once.jsonl`,
/// with `auth` when given.
fn once_bus(auth: &str) -> String {
    format!(
        r#"
[[buses]]
name = "once"
shards = 1
dedup_window = "1h"
{auth}

[[rules]]
name = "once-to-file"
bus = "once"

[[rules.targets]]
type = "file"
name = "once-file"
path = "{{data_dir}}/once.jsonl"
"#
    )
}

/// Posts one structured event, with `key` as the bus's API key when given; returns the
/// status code and the entry's status (`accepted`, `duplicate`).
async fn post(
    client: &reqwest::Client,
    sluice: &Sluice,
    key: Option<&str>,
    event: &Value,
) -> (u16, String) {
    let mut request = client
        .post(sluice.url("/buses/once/events"))
        .header("content-type", "application/cloudevents+json")
        .body(event.to_string());
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    let r = request.send().await.unwrap();
    let code = r.status().as_u16();
    let body: Value = r.json().await.unwrap_or(Value::Null);
    let status = body["entries"][0]["status"]
        .as_str()
        .or(body["status"].as_str())
        .unwrap_or("")
        .to_string();
    (code, status)
}

fn event(id: &str, data: &str) -> Value {
    json!({"specversion": "1.0", "id": id, "source": "/shop", "type": "order", "data": {"d": data}})
}

/// Five events with 200 KB ids grow the standalone dedup file by a few hundred bytes
/// (each record is a fixed-size hash), and are still recognised as duplicates.
#[tokio::test]
async fn dedup_records_are_fixed_size_whatever_the_id() {
    let sluice = Sluice::builder().extra(&once_bus("")).start().await;
    let client = reqwest::Client::new();
    let file = sluice.data_dir().join("webhook-dedup.jsonl");
    let size = || std::fs::metadata(&file).map_or(0, |m| m.len());
    let before = size();
    let ids: Vec<String> = (0..5)
        .map(|i| format!("{i}-{}", "x".repeat(200_000)))
        .collect();
    for id in &ids {
        assert_eq!(
            post(&client, &sluice, None, &event(id, "first")).await,
            (202, "accepted".to_string())
        );
    }
    let grown = size() - before;
    assert!(
        grown <= 5 * 80,
        "five records grew the dedup file by {grown} bytes"
    );
    assert_eq!(
        post(&client, &sluice, None, &event(&ids[2], "again")).await,
        (202, "duplicate".to_string())
    );
    let metrics = sluice.metrics().await;
    let dedup: Vec<&str> = metrics.lines().filter(|l| l.contains("dedup")).collect();
    for series in [
        "sluice_dedup_entries 5",
        "sluice_dedup_memory_bytes ",
        &format!("sluice_dedup_file_bytes {}", size()),
        "sluice_dedup_compactions_total ",
        "sluice_dedup_evicted_total 0",
    ] {
        assert!(
            dedup.iter().any(|l| l.starts_with(series)),
            "{series}: {dedup:#?}"
        );
    }
    wait_jsonl(
        &sluice.data_dir().join("once.jsonl"),
        Duration::from_secs(30),
        |e| e.len() == 5,
    )
    .await;
}

/// The same in Redis: every dedup key name is short whatever the id.
#[tokio::test]
async fn redis_dedup_keys_are_fixed_size_whatever_the_id() {
    let (url, prefix) = shared_redis("dedup-size");
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .extra(&once_bus(""))
        .start()
        .await;
    let client = reqwest::Client::new();
    for i in 0..5 {
        let id = format!("{i}-{}", "y".repeat(200_000));
        assert_eq!(
            post(&client, &sluice, None, &event(&id, "d")).await,
            (202, "accepted".to_string())
        );
        assert_eq!(
            post(&client, &sluice, None, &event(&id, "d")).await,
            (202, "duplicate".to_string())
        );
    }
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:dedup:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 5, "{keys:?}");
    for key in &keys {
        assert!(key.len() <= prefix.len() + 48, "{key}");
    }
}

/// Two producers with different API keys on one bus send the same `source` and `id`:
/// both are accepted and delivered; a producer's own repeat is a duplicate.
async fn producers_do_not_collide(distributed: bool) {
    let auth = "auth = { keys = [\"sha256:e8f2a1007449f6aae3e1eadaf60dca51f65ba0ac11f769a10072cc9cc4553390\", \"sha256:86e8f65217038f4e1a8b155942014d3f7a11df2ba4632d118a549bf72d994fd2\"] }";
    let mut builder = Sluice::builder().extra(&once_bus(auth));
    if distributed {
        let (url, prefix) = shared_redis("dedup-producers");
        builder = builder.distributed(&url, &prefix);
    }
    let sluice = builder.start().await;
    let client = reqwest::Client::new();
    let (a, b) = (Some("producer-a-key"), Some("producer-b-key"));
    assert_eq!(
        post(&client, &sluice, a, &event("order-7", "from a")).await,
        (202, "accepted".to_string())
    );
    assert_eq!(
        post(&client, &sluice, b, &event("order-7", "from b")).await,
        (202, "accepted".to_string()),
        "another producer's event is not a duplicate"
    );
    assert_eq!(
        post(&client, &sluice, a, &event("order-7", "a again")).await,
        (202, "duplicate".to_string())
    );
    assert_eq!(
        post(&client, &sluice, b, &event("order-7", "b again")).await,
        (202, "duplicate".to_string())
    );
    let path = sluice.data_dir().join("once.jsonl");
    let events = wait_jsonl(&path, Duration::from_secs(30), |e| e.len() >= 2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = if events.len() == 2 {
        sluice_tests::read_jsonl(&path)
    } else {
        events
    };
    let mut data: Vec<&str> = events
        .iter()
        .filter_map(|e| e["data"]["d"].as_str())
        .collect();
    data.sort_unstable();
    assert_eq!(data, ["from a", "from b"]);
}

#[tokio::test]
async fn producers_with_different_keys_do_not_make_each_other_duplicates() {
    producers_do_not_collide(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_with_different_keys_do_not_make_each_other_duplicates_in_redis() {
    producers_do_not_collide(true).await;
}
