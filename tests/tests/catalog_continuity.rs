//! The catalog as replicas follow it, through the real binary: after Redis comes back from
//! an older backup under running replicas, every replica converges on what the store holds
//! (not on the newest version it remembers), and later changes reach all of them; what a
//! change removes leaves no metric series behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::{ids, read_jsonl, RedisServer, Sluice};

/// A rule of bus `default` taking every event to `{data_dir}/{name}.jsonl`.
fn rule(name: &str) -> serde_json::Value {
    json!({"targets": [{"type": "file", "name": "f", "path": format!("{{data_dir}}/{name}.jsonl")}]})
}

/// `PUT`s [`rule`] `name` through `replica`'s admin API (see [`change`]): 201.
async fn put_rule(client: &reqwest::Client, replica: &Sluice, name: &str) {
    let url = rule_url(replica, name);
    change(client, reqwest::Method::PUT, &url, Some(rule(name)), 201).await;
}

/// `DELETE`s rule `name` through `replica`'s admin API (see [`change`]): 204.
async fn delete_rule(client: &reqwest::Client, replica: &Sluice, name: &str) {
    let url = rule_url(replica, name);
    change(client, reqwest::Method::DELETE, &url, None, 204).await;
}

fn rule_url(replica: &Sluice, name: &str) -> String {
    replica.url(&format!("/api/v1/buses/default/rules/{name}"))
}

/// Sends a change until it gets `status` (a replica reconnecting to Redis answers 503 for
/// a moment), for 30 s at most.
async fn change(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    body: Option<serde_json::Value>,
    status: u16,
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut request = client.request(method.clone(), url);
        if let Some(body) = &body {
            request = request.json(body);
        }
        let answer = match request.send().await {
            Ok(r) => (r.status().as_u16(), r.text().await.unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        };
        if answer.0 == status {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{method} {url}: {answer:?}, not {status}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until every replica runs exactly these connectors.
async fn wait_running(replicas: &[&Sluice], want: &[&str], limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        let mut all = Vec::new();
        for r in replicas {
            all.push(r.connectors().await);
        }
        if all.iter().all(|c| c.as_deref().is_some_and(|c| c == want)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "replicas run {all:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Redis restored from an older backup under two running replicas: rule `a` existed in
/// the backup; `b` was created and `a` deleted after it. Once restored, both replicas run
/// what the store holds (`a`, not `b`) although they had run a newer version, say the
/// catalog went back, and a new rule `c` created afterwards reaches both: events are
/// delivered through `a` and `c`, none through `b`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_converge_on_a_catalog_restored_from_an_older_backup() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let start = || {
        Sluice::builder()
            .distributed(&url, "continuity")
            .without_default_rule()
            .start()
    };
    let one = start().await;
    let two = start().await;
    one.wait_members(2).await;
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let replicas = [&one, &two];
    let limit = Duration::from_secs(20);

    put_rule(&client, &one, "a").await;
    wait_running(&replicas, &["default/a/f"], limit).await;

    // The backup, taken with Redis stopped: the catalog with `a`.
    redis.kill();
    let backup = redis.snapshot();
    redis.restart();

    put_rule(&client, &two, "b").await;
    delete_rule(&client, &one, "a").await;
    wait_running(&replicas, &["default/b/f"], limit).await;

    // Back to the backup under the running replicas: they converge on it unasked.
    redis.kill();
    redis.restore(backup.path());
    redis.restart();
    wait_running(&replicas, &["default/a/f"], limit).await;
    for r in replicas {
        let log = r.log();
        assert!(
            log.contains("the catalog went back from version"),
            "no word of the restore:\n{log}"
        );
    }

    // A change after the restore reaches both.
    put_rule(&client, &two, "c").await;
    wait_running(&replicas, &["default/a/f", "default/c/f"], limit).await;
    // A rule starts at the end of each shard once its lane runs there: post after that.
    one.wait_states("default/c/f#", "RUNNING", 4).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let posted = sluice_tests::post_all(&[one.events_url(), two.events_url()], "e", 20).await;
    let through = |name: &str| -> HashSet<String> {
        replicas
            .iter()
            .flat_map(|r| ids(&read_jsonl(&r.data_dir().join(format!("{name}.jsonl")))))
            .filter(|id| posted.contains(id))
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while through("a") != posted || through("c") != posted {
        assert!(
            Instant::now() < deadline,
            "{} through a, {} through c, of 20",
            through("a").len(),
            through("c").len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        through("b").is_empty(),
        "the rule the restore removed delivered"
    );
}

/// The catalog's compare-and-set in Redis compares the version and the id: a writer that
/// read a head the store no longer holds loses, even where the version matches again (a
/// store written again after a restore); a catalog written before ids existed (no `id`
/// field) is matched as id 0 and still loads.
#[tokio::test]
async fn redis_catalog_writes_compare_version_and_id() {
    use sluice::catalog::{CatalogStore, Head, RedisCatalog, Stored};
    use sluice::store::cluster::Cluster as _;
    use sluice::store::redis::RedisCluster;
    use std::collections::BTreeMap;

    let (url, prefix) = sluice_tests::shared_redis("catalog-cas");
    let redis = sluice_tests::redis::connect(&url, &prefix, Duration::from_secs(2)).await;
    let options =
        sluice_tests::redis::cluster_options(Duration::from_millis(100), Duration::from_secs(1));
    let cluster = RedisCluster::join(redis.clone(), "cas", options);
    let store = RedisCatalog::new(cluster.clone());
    assert_eq!(store.head().await.unwrap(), None);

    // Written before ids existed: the hash has no `id`.
    let mut conn = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let key = format!("{prefix}:config");
    let _: () = redis::cmd("HSET")
        .arg(&key)
        .arg("version")
        .arg(3)
        .arg("toml")
        .arg("")
        .query_async(&mut conn)
        .await
        .unwrap();
    let old = Head { version: 3, id: 0 };
    assert_eq!(store.head().await.unwrap(), Some(old));
    assert_eq!(store.load().await.unwrap().unwrap().head(), old);

    // An empty catalog written with this head.
    let write = |version, id| Stored {
        version,
        id,
        text: String::new(),
        versions: BTreeMap::new(),
    };
    let first = Head { version: 4, id: 41 };
    assert_eq!(store.store(old, &write(4, 41)).await.unwrap(), Ok(()));
    assert_eq!(store.head().await.unwrap(), Some(first));
    // Stale version, then stale id at the right version: both refused, nothing written.
    assert_eq!(store.store(old, &write(5, 5)).await.unwrap(), Err(first));
    let stale = Head { version: 4, id: 40 };
    assert_eq!(store.store(stale, &write(5, 5)).await.unwrap(), Err(first));
    assert_eq!(store.head().await.unwrap(), Some(first));
    let second = Head { version: 5, id: 52 };
    assert_eq!(store.store(first, &write(5, 52)).await.unwrap(), Ok(()));
    assert_eq!(store.load().await.unwrap().unwrap().head(), second);
    cluster.leave().await;
}

/// A deleted rule's series (delivery counters and histograms, task states) leave
/// `/metrics` with it; the series of the rules that stay do not.
#[tokio::test]
async fn a_deleted_rule_leaves_no_metric_series() {
    let sluice = Sluice::builder()
        .without_default_rule()
        .shards(1)
        .extra(&sluice_tests::bus_to_file("kept"))
        .start()
        .await;
    let client = reqwest::Client::new();
    put_rule(&client, &sluice, "gone").await;
    sluice.wait_states("default/gone/f#", "RUNNING", 1).await;
    sluice_tests::post(&client, &sluice.events_url(), "m-1", "{}").await;
    sluice_tests::post(&client, &sluice.url("/buses/kept/events"), "k-1", "{}").await;
    sluice_tests::wait_file(&sluice, "gone.jsonl", Duration::from_secs(20), |e| {
        e.len() == 1
    })
    .await;
    sluice_tests::wait_file(&sluice, "kept.jsonl", Duration::from_secs(20), |e| {
        e.len() == 1
    })
    .await;
    let metrics = sluice.metrics().await;
    for series in [
        "sluice_subscription_delivered_events_total{subscription=\"default/gone/f\"}",
        "sluice_subscription_event_latency_seconds_count{subscription=\"default/gone/f\"}",
        "task=\"default/gone/f#0\"",
    ] {
        assert!(metrics.contains(series), "{series} missing:\n{metrics}");
    }

    delete_rule(&client, &sluice, "gone").await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let metrics = sluice.metrics().await;
        let left: Vec<&str> = metrics
            .lines()
            .filter(|l| l.contains("default/gone/"))
            .collect();
        if left.is_empty() {
            assert!(
                metrics.contains("subscription=\"kept/kept-to-file/kept-file\""),
                "{metrics}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "series of the deleted rule stay:\n{}",
            left.join("\n")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
