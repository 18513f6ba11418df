//! Distributed mode on a Redis Cluster (`redis_cluster_nodes`): six `redis-server`
//! processes on loopback (three primaries, three replicas) started by the harness
//! (`sluice_tests::RedisCluster`). The scenarios of `distributed.rs` that exercise the
//! store, run against the cluster: keys spread over every primary with nothing refused as
//! `CROSSSLOT`, a replica killed, dedup, webhooks, an admin API change reaching every
//! replica; and the move of a deployment from the first (untagged) key layout on one
//! server. Primary failover and slot migration under load are in the fault suite
//! (`faults.rs`), with the no-loss ledger.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{
    bus_to_file_with, http_rule, ids, post_spread, shared_redis, RedisCluster, Sluice,
};

/// Waits until every acknowledged id shows up in some replica's delivered file, then
/// returns (delivered lines, distinct ids).
async fn wait_all_delivered(replicas: &[&Sluice], acked: &HashSet<String>) -> (usize, usize) {
    sluice_tests::wait_all_acked(Duration::from_secs(60), acked, || {
        replicas.iter().flat_map(|r| ids(&r.delivered())).collect()
    })
    .await
}

/// Posts one structured event to `/buses/{bus}/events`; the entry's status.
async fn post_to(client: &reqwest::Client, sluice: &Sluice, bus: &str, id: &str) -> String {
    let event = json!({"specversion": "1.0", "id": id, "source": "/cluster", "type": "order.created", "data": {"n": 1}});
    let r = client
        .post(sluice.url(&format!("/buses/{bus}/events")))
        .header("content-type", "application/cloudevents+json")
        .body(event.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let body: serde_json::Value = r.json().await.unwrap();
    body["entries"][0]["status"]
        .as_str()
        .or(body["status"].as_str())
        .unwrap_or("")
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_run_on_a_cluster_with_shards_on_every_primary() {
    let redis = RedisCluster::start();
    let (_, prefix) = shared_redis("cluster-spread");
    let nodes = redis.urls();
    let webhook = r#"
[[webhooks]]
name = "hook"
bus = "once"
verify = { preset = "none" }
id = { header = "x-id" }
dedup_window = "1h"
"#;
    let shared_out = tempfile::tempdir().unwrap();
    let start = || {
        Sluice::builder()
            .on_cluster(&nodes, &prefix)
            .file_root(shared_out.path())
            .shards(12)
            .extra(&(bus_to_file_with("once", 2, "dedup_window = \"1h\"") + webhook))
            .start()
    };
    let a = start().await;
    let mut b = start().await;
    a.wait_members(2).await;

    // 12 shards of events from both replicas.
    let urls = vec![a.events_url(), b.events_url()];
    let mut acked: HashSet<String> = post_spread(&urls, "before", 240)
        .await
        .into_iter()
        .collect();
    assert_eq!(acked.len(), 240, "every event accepted");

    // Every primary holds shard streams: the tags spread the shards over the slots.
    let primaries: Vec<_> = redis
        .view()
        .into_iter()
        .filter(|n| n.primary && !n.failed && !n.slots.is_empty())
        .collect();
    assert_eq!(primaries.len(), 3, "{:?}", redis.view());
    for node in &primaries {
        let keys = redis.cli(node.port, &["KEYS", &format!("{prefix}:*:next")]);
        assert!(
            keys.lines().any(|k| k.contains("{bus/default#")),
            "primary {} holds no shard: {keys}",
            node.port
        );
    }

    // Dedup on a cluster: the records live in the slot of the shard's stream.
    let client = reqwest::Client::new();
    assert_eq!(post_to(&client, &a, "once", "dup-1").await, "accepted");
    assert_eq!(post_to(&client, &b, "once", "dup-1").await, "duplicate");
    // A webhook delivery id sent to both replicas: stored once, the second a duplicate.
    let mut answers = Vec::new();
    for replica in [&a, &b] {
        let r = client
            .post(replica.url("/webhooks/hook"))
            .header("x-id", "delivery-1")
            .header("content-type", "application/json")
            .body(r#"{"n":1}"#)
            .send()
            .await
            .unwrap();
        assert!(r.status().is_success(), "{}", r.status());
        let body: serde_json::Value = r.json().await.unwrap();
        answers.push(body["status"].as_str().unwrap_or("").to_string());
    }
    assert_eq!(answers[1], "duplicate", "{answers:?}");

    // An admin API change made at one replica reaches the other (notices over pub/sub).
    let (status, _) =
        sluice_tests::admin::put(&b, "/api/v1/buses/orders", json!({"shards": 3})).await;
    assert_eq!(status, 201);
    let out = shared_out.path().join("orders.jsonl");
    let (status, body) = sluice_tests::admin::put(
        &b,
        "/api/v1/buses/orders/rules/created",
        json!({"pattern": {"type": ["order.created"]}, "targets": [{"type": "file", "name": "out", "path": out.to_string_lossy()}]}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        n += 1;
        post_to(&client, &a, "orders", &format!("order-{n}")).await;
        if !sluice_tests::read_jsonl(&out).is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the rule made at b never ran");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // A replica killed: the other takes its shards over and delivers everything.
    b.kill9();
    let after = post_spread(&[a.events_url()], "after", 240).await;
    assert_eq!(after.len(), 240);
    acked.extend(after);
    let (lines, distinct) = wait_all_delivered(&[&a, &b], &acked).await;
    eprintln!(
        "acked {}, delivered {lines} lines, {distinct} distinct",
        acked.len()
    );

    let once = sluice_tests::read_jsonl(&a.data_dir().join("once.jsonl"));
    let once_b = sluice_tests::read_jsonl(&b.data_dir().join("once.jsonl"));
    let mut all = ids(&once);
    all.extend(ids(&once_b));
    assert_eq!(all.iter().filter(|id| *id == "dup-1").count(), 1, "{all:?}");
    for log in [a.log(), b.log()] {
        assert!(
            !log.contains("CROSSSLOT"),
            "a command was refused as CROSSSLOT"
        );
    }
}

/// A deployment on the first key layout (untagged names, one server) with events in
/// flight: a bus whose file rule has delivered everything and whose HTTP rule's receiver
/// has been failing, so its position is behind; plus a fencing epoch and dedup records.
/// The new version moves the keys once on start: the held events arrive, nothing the file
/// rule delivered comes again, and the recorded duplicate is still known.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_from_the_first_key_layout_keeps_events_in_flight() {
    let (url, prefix) = shared_redis("layout-upgrade");
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(503));
    let extra = bus_to_file_with("once", 1, "dedup_window = \"1h\"")
        + &http_rule("held", &receiver.url("/held"), "");
    let client = reqwest::Client::new();
    let mut gateway = Sluice::builder()
        .distributed(&url, &prefix)
        .shards(2)
        .extra(&extra)
        .start()
        .await;
    let posted = post_spread(&[gateway.events_url()], "old", 40).await;
    assert_eq!(posted.len(), 40);
    assert_eq!(
        post_to(&client, &gateway, "once", "dup-old").await,
        "accepted"
    );
    gateway
        .wait_delivered(Duration::from_secs(30), |e| e.len() >= 40)
        .await;
    // The positions of the file rule are committed; the HTTP rule's stay behind.
    tokio::time::sleep(Duration::from_millis(500)).await;
    gateway.terminate();
    assert!(
        receiver.received().iter().all(|r| !r.was_accepted()),
        "the receiver refused everything so far"
    );

    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let renamed: i64 = redis::Script::new(BACK_TO_THE_FIRST_LAYOUT)
        .arg(&prefix)
        .invoke_async(&mut conn)
        .await
        .unwrap();
    assert!(renamed >= 6, "{renamed} keys put back");
    let old = sluice_tests::redis_keys(&url, &format!("{prefix}:bus:default:*")).await;
    assert!(!old.is_empty(), "the first layout's streams are there");

    // The new version starts on it: the keys move, the held events arrive.
    receiver.default_reply(Reply::Status(200));
    gateway.restart().await;
    let layout: Option<String> = redis::cmd("GET")
        .arg(format!("{prefix}:layout"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(layout.as_deref(), Some("2"));
    assert!(gateway
        .log()
        .contains("moved the store to the hash-tagged key layout"));
    assert!(
        sluice_tests::redis_keys(&url, &format!("{prefix}:bus:default:*"))
            .await
            .is_empty()
    );
    let want: HashSet<String> = posted.iter().cloned().collect();
    sluice_tests::wait_all_acked(Duration::from_secs(60), &want, || {
        receiver
            .received()
            .iter()
            .filter(|r| r.was_accepted())
            .filter_map(|r| r.header("ce-id").map(str::to_string))
            .collect()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let file = ids(&gateway.delivered());
    assert_eq!(file.len(), 40, "nothing the file rule delivered came again");
    assert_eq!(
        post_to(&client, &gateway, "once", "dup-old").await,
        "duplicate"
    );
}

/// Renames every tagged key of a prefix to its name in the first layout (what a deployment
/// of the previous version holds): streams, counters, positions, leases, epochs, dedup
/// indexes and their records. ARGV: the prefix.
const BACK_TO_THE_FIRST_LAYOUT: &str = r#"
local p = ARGV[1]
local n = 0
for _, k in ipairs(redis.call('KEYS', p .. ':{*')) do
  local tag, rest = string.match(string.sub(k, #p + 2), '^{([^}]*)}:(.*)$')
  local bus, shard = string.match(tag or '', '^bus/(.+)#(%d+)%.%d+$')
  local old = nil
  if bus then
    if rest == 'log' then old = p .. ':bus:' .. bus .. ':' .. shard
    elseif rest == 'next' then old = p .. ':bus:' .. bus .. ':' .. shard .. ':next'
    elseif rest == 'pos' then old = p .. ':gpos:' .. bus .. ':' .. shard
    elseif rest == 'lease' or rest == 'epoch' then old = p .. ':' .. rest .. ':bus/' .. bus .. '#' .. shard
    elseif rest == 'dedup-index' then
      local index = p .. ':dedup-index:' .. bus .. ':' .. shard
      local members = redis.call('ZRANGE', k, 0, -1, 'WITHSCORES')
      redis.call('DEL', k)
      for i = 1, #members, 2 do
        local was = p .. ':dedup:' .. string.match(members[i], ':dedup:(.*)$')
        if redis.call('EXISTS', members[i]) == 1 then redis.call('RENAME', members[i], was) end
        redis.call('ZADD', index, members[i + 1], was)
      end
      n = n + 1
    end
  end
  if old then
    redis.call('RENAME', k, old)
    n = n + 1
  end
end
redis.call('DEL', p .. ':layout')
return n
"#;

/// A worker of the older version still heartbeating: the new one refuses to move the keys
/// under it, and says what to do.
#[tokio::test]
async fn an_upgrade_under_running_older_workers_is_refused() {
    let (url, prefix) = shared_redis("layout-refused");
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let (secs, micros): (u64, u64) = redis::cmd("TIME").query_async(&mut conn).await.unwrap();
    let now_ms = secs * 1000 + micros / 1000;
    let _: () = redis::cmd("ZADD")
        .arg(format!("{prefix}:members"))
        .arg(now_ms + 60_000)
        .arg("old-worker")
        .query_async(&mut conn)
        .await
        .unwrap();
    let redis = sluice_tests::redis::connect(&url, &prefix, Duration::from_secs(2)).await;
    let found = sluice::store::redis::prepare_layout(&redis, Duration::from_secs(3))
        .await
        .unwrap();
    assert_eq!(found, sluice::store::redis::Layout::OlderWorkersRunning(1));
    let layout: Option<String> = redis::cmd("GET")
        .arg(format!("{prefix}:layout"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(layout, None, "nothing moved, nothing marked");
    let _: () = redis::cmd("DEL")
        .arg(format!("{prefix}:members"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        sluice::store::redis::prepare_layout(&redis, Duration::from_secs(3))
            .await
            .unwrap(),
        sluice::store::redis::Layout::Migrated(0)
    );
}

/// `redis_durability = "replicated"` on a Redis with no replica: nothing can be
/// acknowledged, so every append is answered 503 with Retry-After and a reason naming the
/// replicas, and counted; the setting is not silently ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicated_durability_without_replicas_refuses_with_503() {
    let (url, prefix) = shared_redis("replicated-alone");
    let sluice = Sluice::builder()
        .distributed(&url, &prefix)
        .cluster_settings("redis_durability = \"replicated\"\nreplication_timeout = \"100ms\"")
        .start()
        .await;
    let r = sluice_tests::binary(
        &reqwest::Client::new(),
        &sluice.events_url(),
        "lonely",
        "{}",
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let body = r.text().await.unwrap();
    assert!(body.contains("0 of the 1 Redis replicas"), "{body}");
    let metrics = sluice.metrics().await;
    let refused = metrics
        .lines()
        .find_map(|l| l.strip_prefix("sluice_redis_replication_shortfall_total "))
        .and_then(|v| v.trim().parse::<f64>().ok());
    assert!(refused.is_some_and(|n| n >= 1.0), "{metrics}");
}
