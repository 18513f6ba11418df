//! Deduplication of CloudEvents on a bus with a `dedup_window`, through the real binary:
//! records are fixed-size whatever the event's `id` (in the standalone dedup file and in
//! Redis), and scoped per producer key, so one producer cannot make another's event a
//! duplicate.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{bus_to_file_with, shared_redis, wait_jsonl, Sluice};

/// A bus `once` (one shard, a one-hour dedup window) whose events go to `once.jsonl`,
/// with `auth` when given.
fn once_bus(auth: &str) -> String {
    bus_to_file_with("once", 1, &format!("dedup_window = \"1h\"\n{auth}"))
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
    sluice_tests::wait_file(&sluice, "once.jsonl", Duration::from_secs(30), |e| {
        e.len() == 5
    })
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
        .arg(format!("{prefix}:*:dedup:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(keys.len(), 5, "{keys:?}");
    for key in &keys {
        // The shard's tag and 32 hex characters, whatever the id.
        assert_eq!(
            key.len(),
            sluice_tests::redis::shard_key(&prefix, "once", 0, "dedup:").len() + 32,
            "{key}"
        );
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

/// Redis memory docs/webhooks.md counts for one dedup record with its index entry: 275 bytes and
/// twice the key name (`{prefix}:{webhooks}:dedup:{32 hex}`; a bus shard's records are named
/// `{prefix}:{bus/NAME#N}:dedup:{32 hex}`, counted by `shard_record_bytes`).
fn redis_record_bytes(prefix: &str) -> usize {
    275 + 2 * (prefix.len() + ":{webhooks}:dedup:".len() + 32)
}

fn shard_record_bytes(prefix: &str, bus: &str, last_shard: u32) -> usize {
    275 + 2 * (sluice_tests::redis::shard_key(prefix, bus, last_shard, "dedup:").len() + 32)
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

async fn count_keys(conn: &mut redis::aio::MultiplexedConnection, pattern: &str) -> usize {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(pattern)
        .query_async(conn)
        .await
        .unwrap();
    keys.len()
}

/// The value of the first series of `/metrics` that starts with `series`.
fn metric(metrics: &str, series: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

/// Distributed, a bus's dedup keys in Redis are held to `limits.max_dedup_bytes` (here
/// room for 20): 200 distinct events are all accepted and delivered once, the keys stay
/// at the bound, the soonest-expiring are evicted (counted), the latest is still a
/// duplicate, and a late repeat of an evicted one is stored again (at least once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_dedup_keys_are_bounded_by_bytes_and_counted() {
    let (url, prefix) = shared_redis("dedup-bound");
    let cap = 20;
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .limits(&format!(
            "max_dedup_bytes = {}",
            cap * shard_record_bytes(&prefix, "once", 0)
        ))
        .extra(&once_bus(""))
        .start()
        .await;
    let client = reqwest::Client::new();
    // Batches of ten, so a call may evict keys it wrote itself.
    for batch in 0..20 {
        let events = (0..10)
            .map(|i| event(&format!("e-{}", batch * 10 + i), "d"))
            .collect();
        sluice_tests::post_batch(&client, &sluice.url("/buses/once/events"), events).await;
    }
    let mut conn = redis_conn(&url).await;
    let keys = count_keys(&mut conn, &format!("{prefix}:*:dedup:*")).await;
    assert!(
        (1..=cap).contains(&keys),
        "{keys} dedup keys for a bound of {cap}"
    );
    let index = sluice_tests::redis::shard_key(&prefix, "once", 0, "dedup-index");
    let members: usize = redis::cmd("ZCARD")
        .arg(&index)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(members, keys);
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&index)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(ttl > 0, "the index expires with the window: {ttl}");

    let metrics = sluice.metrics().await;
    let evicted = metric(&metrics, "sluice_dedup_evicted_total").unwrap();
    assert!(evicted >= (200 - cap) as f64, "{evicted}");
    let series = "sluice_dedup_entries{store=\"redis\",bus=\"once\",shard=\"0\"}";
    assert_eq!(metric(&metrics, series), Some(keys as f64), "{metrics}");
    let bytes = "sluice_dedup_memory_bytes{store=\"redis\",bus=\"once\",shard=\"0\"}";
    assert_eq!(
        metric(&metrics, bytes),
        Some((keys * shard_record_bytes(&prefix, "once", 0)) as f64)
    );

    assert_eq!(
        post(&client, &sluice, None, &event("e-199", "again")).await,
        (202, "duplicate".to_string())
    );
    assert_eq!(
        post(&client, &sluice, None, &event("e-0", "late")).await,
        (202, "accepted".to_string()),
        "an evicted key's late repeat is stored again"
    );
    let path = sluice.data_dir().join("once.jsonl");
    wait_jsonl(&path, Duration::from_secs(30), |e| e.len() >= 201).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = sluice_tests::read_jsonl(&path);
    let mut ids = sluice_tests::ids(&events);
    assert_eq!(ids.len(), 201);
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 200, "every event delivered, once");
}

/// The same for a webhook source on a bus of two shards: each shard's index gets half of
/// the bound, and the provider's latest delivery is still a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_webhook_dedup_keys_are_bounded_per_shard() {
    let (url, prefix) = shared_redis("dedup-hook-bound");
    let cap = 10;
    let config = sluice_tests::bus_to_file("hooked").replace("shards = 1", "shards = 2")
        + r#"
[[webhooks]]
name = "hook"
bus = "hooked"
verify = { preset = "none" }
id = { header = "x-id" }
dedup_window = "1h"
"#;
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .limits(&format!(
            "max_dedup_bytes = {}",
            2 * cap * shard_record_bytes(&prefix, "hooked", 1)
        ))
        .extra(&config)
        .start()
        .await;
    let client = reqwest::Client::new();
    let deliver = |id: String| {
        client
            .post(sluice.url("/webhooks/hook"))
            .header("content-type", "application/json")
            .header("x-id", id)
            .body("{\"n\":1}")
            .send()
    };
    // 50 over two shards: one of them gets at least 25, past its 10.
    for i in 0..50 {
        assert_eq!(deliver(format!("d-{i}")).await.unwrap().status(), 202);
    }
    let mut conn = redis_conn(&url).await;
    for shard in 0..2 {
        let members: usize = redis::cmd("ZCARD")
            .arg(sluice_tests::redis::shard_key(
                &prefix,
                "hooked",
                shard,
                "dedup-index",
            ))
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(members <= cap, "shard {shard}: {members}");
    }
    let keys = count_keys(&mut conn, &format!("{prefix}:*:dedup:*")).await;
    assert!(keys <= 2 * cap, "{keys}");
    let metrics = sluice.metrics().await;
    assert!(metric(&metrics, "sluice_dedup_evicted_total").unwrap() >= (50 - 2 * cap) as f64);
    let r = deliver("d-49".to_string()).await.unwrap();
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "duplicate");
    let path = sluice.data_dir().join("hooked.jsonl");
    wait_jsonl(&path, Duration::from_secs(30), |e| e.len() >= 50).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(sluice_tests::read_jsonl(&path).len(), 50);
}

/// The reserve/confirm path (`RedisDedup`, for logs that cannot deduplicate in their
/// append) keeps its confirmed keys under the same bound, in its own index.
#[tokio::test]
async fn redis_reserve_confirm_keys_are_bounded() {
    use sluice::store::dedup::{key, Dedup, Reserve};
    use sluice::store::redis::RedisDedup;
    let (url, prefix) = shared_redis("dedup-confirm-bound");
    let cap = 8;
    let redis = sluice::store::redis::Redis::connect(&url, &prefix, Duration::from_secs(2))
        .await
        .unwrap()
        .with_dedup_bytes(cap * redis_record_bytes(&prefix));
    let dedup = RedisDedup::new(redis);
    let keys: Vec<String> = (0..30).map(|i| key(&[&i.to_string()])).collect();
    for k in &keys {
        let Reserve::Taken(token) = dedup.reserve(k).await.unwrap() else {
            panic!("{k} not taken")
        };
        dedup
            .confirm(k, &token, Duration::from_secs(3600))
            .await
            .unwrap();
        // Apart in time, so the order of their expiries is the order of confirmation.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let mut conn = redis_conn(&url).await;
    assert_eq!(
        count_keys(&mut conn, &format!("{prefix}:*:dedup:*")).await,
        cap
    );
    let members: usize = redis::cmd("ZCARD")
        .arg(format!("{prefix}:{{webhooks}}:dedup-index"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(members, cap);
    assert_eq!(dedup.reserve(&keys[29]).await.unwrap(), Reserve::Duplicate);
    assert!(matches!(
        dedup.reserve(&keys[0]).await.unwrap(),
        Reserve::Taken(_)
    ));
}
