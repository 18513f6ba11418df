//! Webhook sources made through the admin API of a cluster, against the real binary: served
//! by every replica within seconds, secrets only as `env:` references each replica reads,
//! one delivery stored once whichever replica takes its retries; answers checked against
//! the OpenAPI document. (Webhook sources of the configuration file: `webhooks.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::admin::{check_openapi, Api, Recorder, BUS, HOOK, RULE};
use sluice_tests::{ids, read_jsonl, shared_redis, wait_ids, Sluice};

/// A webhook source made through one replica's API is served by every replica within
/// seconds; its secrets are `env:` references each replica reads (a literal secret, an
/// unset variable, a bad preset are refused with the field's pointer), a replica without
/// the variable answers 503 and says why, a delivery is stored once whichever replica takes
/// its retries, the source keeps its bus from being deleted, and deleting it stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_sources_made_through_the_api_are_served_by_every_replica() {
    let (url, prefix) = shared_redis("admin-webhooks");
    // a's data directory, where every replica writes the events (`targets.file_roots`).
    let a_data = tempfile::tempdir().unwrap();
    let start = |with_secret: bool, own: bool| {
        let mut builder = Sluice::builder()
            .durability("os")
            .distributed(&url, &prefix)
            .shards(2)
            .file_root(a_data.path());
        if own {
            builder = builder.data_dir(a_data.path());
        }
        if with_secret {
            builder = builder.env("SLUICE_SECRET_HOOK_KEY", "k-123");
        }
        builder.start()
    };
    let a = start(true, true).await;
    let b = start(true, false).await;
    let c = start(false, false).await;
    a.wait_members(3).await;
    let recorder = Recorder::default();
    let api_a = Api::new(&a, &recorder);
    let client = sluice_tests::client();
    let deliver = |sluice: &Sluice, key: &str, id: &str| {
        client
            .post(sluice.url("/webhooks/orders"))
            .header("x-api-key", key)
            .header("x-delivery", id)
            .header("content-type", "application/json")
            .body(r#"{"order": 7}"#)
            .send()
    };

    let hook = |secret: &str, preset: &str| {
        json!({
            "bus": "default",
            "verify": {"preset": preset, "header": "x-api-key", "secret": secret},
            "id": {"header": "x-delivery"},
            "type": {"value": "hook.received"},
        })
    };
    for (body, pointer, says) in [
        (hook("k-123", "api-key"), "/verify/secret", "env:NAME"),
        (
            hook("env:SLUICE_SECRET_NOT_SET_ANYWHERE", "api-key"),
            "/verify/secret",
            "NOT_SET_ANYWHERE",
        ),
        (
            hook("env:SLUICE_SECRET_HOOK_KEY", "nope"),
            "/verify/preset",
            "nope",
        ),
    ] {
        let refused = api_a.put(HOOK, "/api/v1/webhooks/orders", body).await;
        assert_eq!(refused.status, 400, "{}", refused.body);
        assert_eq!(refused.body["pointer"], pointer, "{}", refused.body);
        assert!(
            refused.body["detail"].as_str().unwrap().contains(says),
            "{}",
            refused.body
        );
    }
    let mut elsewhere = hook("env:SLUICE_SECRET_HOOK_KEY", "api-key");
    elsewhere["bus"] = json!("missing");
    let refused = api_a.put(HOOK, "/api/v1/webhooks/orders", elsewhere).await;
    assert_eq!(refused.status, 404, "{}", refused.body);
    assert_eq!(api_a.get(HOOK, "/api/v1/webhooks/orders").await.status, 404);

    // Where the events land: a rule of the catalog writing to a's data directory.
    let rule = json!({
        "pattern": {"type": ["hook.received"]},
        "targets": [{"type": "file", "name": "out", "path": a.data_dir().join("hooks.jsonl").to_string_lossy()}]
    });
    let made = api_a
        .put(RULE, "/api/v1/buses/default/rules/hooks", rule)
        .await;
    assert_eq!(made.status, 201, "{}", made.body);
    // A new subscription starts at the end of its bus: wait until it runs everywhere.
    api_a.wait_connector("default/hooks/out").await;
    let created = api_a
        .put(
            HOOK,
            "/api/v1/webhooks/orders",
            hook("env:SLUICE_SECRET_HOOK_KEY", "api-key"),
        )
        .await;
    assert_eq!(created.status, 201, "{}", created.body);
    assert_eq!(created.headers["location"], "/api/v1/webhooks/orders");
    assert_eq!(created.body["origin"], "catalog");
    assert_eq!(created.body["path"], "/webhooks/orders");
    assert_eq!(
        created.body["verify"]["secret"],
        "env:SLUICE_SECRET_HOOK_KEY"
    );

    // Replica b serves it within seconds, without a restart.
    let t0 = Instant::now();
    loop {
        let status = deliver(&b, "k-123", "d-1").await.unwrap().status();
        if status == 202 {
            break;
        }
        assert_eq!(status, 404, "before it arrives, the source is unknown");
        assert!(t0.elapsed() < Duration::from_secs(10), "b never served it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("served by b after {:?}", t0.elapsed());
    assert_eq!(deliver(&b, "wrong", "d-2").await.unwrap().status(), 401);
    // The provider's retry through another replica is a duplicate.
    let t0 = Instant::now();
    loop {
        let retry = deliver(&a, "k-123", "d-1").await.unwrap();
        let status = retry.status();
        if status == 200 {
            assert_eq!(retry.json::<Value>().await.unwrap()["status"], "duplicate");
            break;
        }
        assert_eq!(status, 404);
        assert!(t0.elapsed() < Duration::from_secs(10), "a never served it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Replica c lacks the variable: it says so, and answers 503 rather than 404 or 401.
    let api_c = Api::new(&c, &recorder);
    let t0 = Instant::now();
    loop {
        let listed = api_c.get("/api/v1/webhooks", "/api/v1/webhooks").await;
        assert_eq!(listed.status, 200, "{}", listed.body);
        let item = listed.body["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["name"] == "orders")
            .cloned();
        if let Some(why) = item.as_ref().and_then(|i| i["unavailable"].as_str()) {
            assert!(why.contains("HOOK_KEY"), "{why}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", listed.body);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let refused = deliver(&c, "k-123", "d-3").await.unwrap();
    assert_eq!(refused.status(), 503);
    assert!(refused
        .text()
        .await
        .unwrap()
        .contains("environment variable SLUICE_SECRET_HOOK_KEY"));

    wait_ids(&a, "hooks.jsonl", &["d-1"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        ids(&read_jsonl(&a.data_dir().join("hooks.jsonl"))),
        vec!["d-1"],
        "stored once"
    );

    // It keeps its bus; it is listed and read with its version.
    let bus = api_a.delete(BUS, "/api/v1/buses/default").await;
    assert_eq!(bus.status, 409, "{}", bus.body);
    assert!(
        bus.body["detail"]
            .as_str()
            .unwrap()
            .contains("webhook `orders`"),
        "{}",
        bus.body
    );
    let listed = api_a.get("/api/v1/webhooks", "/api/v1/webhooks").await;
    assert_eq!(listed.body["items"][0]["name"], "orders", "{}", listed.body);
    let read = api_a.get(HOOK, "/api/v1/webhooks/orders").await;
    assert_eq!(read.status, 200);
    assert_eq!(read.body["version"], created.body["version"]);
    let catalog = api_a.get("/api/v1/catalog", "/api/v1/catalog").await;
    assert_eq!(catalog.body["webhooks"][0]["name"], "orders");

    // Deleted: no replica serves it any more.
    let deleted = api_a.delete(HOOK, "/api/v1/webhooks/orders").await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let t0 = Instant::now();
    while deliver(&b, "k-123", "d-4").await.unwrap().status() != 404 {
        assert!(t0.elapsed() < Duration::from_secs(10), "b still serves it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check_openapi(&recorder, "webhooks");
}
