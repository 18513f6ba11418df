//! The catalog through the admin API (`/api/v1`), against the real binary in both modes:
//! buses and rules created, read, replaced and deleted, validation errors naming the field
//! by JSON pointer, optimistic concurrency, a rule created on one replica running on
//! another, no rollback by a replica restarted with its original file, and every answer
//! checked against the OpenAPI document.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sluice_tests::admin::{gateway, Api, Recorder, Refusal, BUS, RULE};
use sluice_tests::{in_both_modes, post_typed, wait_ids, Sluice};

/// A rule taking events of type `order.created` to `{data_dir}/{name}.jsonl`.
fn file_rule(sluice: &Sluice, name: &str) -> Value {
    json!({
        "pattern": {"type": ["order.created"]},
        "targets": [{"type": "file", "name": "out", "path": sluice.data_dir().join(format!("{name}.jsonl")).to_string_lossy()}]
    })
}

/// Creates the bus `orders` (2 shards) and its rule `created` (to `created.jsonl`), and
/// returns the rule's version.
async fn orders_with_a_rule(api: &Api<'_>) -> u64 {
    api.create(BUS, "/api/v1/buses/orders", json!({"shards": 2}))
        .await;
    let rule = api
        .create(
            RULE,
            "/api/v1/buses/orders/rules/created",
            file_rule(api.sluice, "created"),
        )
        .await;
    rule.body["version"].as_u64().unwrap()
}

in_both_modes!(
    buses_are_created_read_replaced_and_keep_their_shard_count,
    a_rule_made_through_the_api_delivers_without_a_restart,
    bad_requests_name_the_field_by_json_pointer,
    a_stale_version_is_refused_and_one_concurrent_writer_wins,
    a_bus_is_deleted_only_once_its_rules_are,
);

sluice_tests::on_a_redis_cluster!(
    buses_kept_on_a_cluster => buses_are_created_read_replaced_and_keep_their_shard_count,
    a_rule_made_through_the_api_on_a_cluster => a_rule_made_through_the_api_delivers_without_a_restart,
    one_concurrent_writer_wins_on_a_cluster => a_stale_version_is_refused_and_one_concurrent_writer_wins,
);

async fn buses_are_created_read_replaced_and_keep_their_shard_count(distributed: bool) {
    let sluice = gateway(distributed, "admin-buses").await;
    let api = Api::recorded(&sluice);

    // The bus of the file is in the catalog.
    let buses = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(buses.status, 200);
    assert_eq!(buses.body["items"][0]["name"], "default");

    // Create a bus (201, Location, ETag), read it, replace it (200).
    let created = api
        .create(BUS, "/api/v1/buses/orders", json!({"shards": 2}))
        .await;
    assert_eq!(created.headers["location"], "/api/v1/buses/orders");
    let v1 = created.body["version"].as_u64().unwrap();
    assert_eq!(created.headers["etag"], format!("\"{v1}\"").as_str());
    let read = api.get(BUS, "/api/v1/buses/orders").await;
    assert_eq!(
        (read.status, read.body["shards"].clone()),
        (StatusCode::OK, json!(2))
    );
    let replaced = api
        .put(
            BUS,
            "/api/v1/buses/orders",
            json!({"shards": 2, "dedup_window": "10m"}),
        )
        .await;
    assert_eq!(replaced.status, 200, "{}", replaced.body);
    let v2 = replaced.body["version"].as_u64().unwrap();
    assert!(v2 > v1);

    // The shard count of a bus cannot change.
    api.put(BUS, "/api/v1/buses/orders", json!({"shards": 4}))
        .await
        .assert_problem(400, "/shards", "reshard");
    api.check_openapi("buses");
}

async fn a_rule_made_through_the_api_delivers_without_a_restart(distributed: bool) {
    let sluice = gateway(distributed, "admin-rule").await;
    let api = Api::recorded(&sluice);
    orders_with_a_rule(&api).await;
    api.wait_connector("orders/created/out").await;
    post_typed(&sluice, "orders", "o-1", "order.created").await;
    post_typed(&sluice, "orders", "o-2", "order.cancelled").await;
    wait_ids(&sluice, "created.jsonl", &["o-1"]).await;
    let rules = api
        .get("/api/v1/buses/{bus}/rules", "/api/v1/buses/default/rules")
        .await;
    assert_eq!(rules.status, 200);
    api.check_openapi("rule");
}

async fn bad_requests_name_the_field_by_json_pointer(distributed: bool) {
    let sluice = gateway(distributed, "admin-refusals").await;
    let api = Api::recorded(&sluice);
    api.create(BUS, "/api/v1/buses/orders", json!({"shards": 2}))
        .await;

    // A rule: the configuration loader's validation, the field by JSON pointer.
    let bad_rule = |body: Value, pointer| Refusal {
        method: Method::PUT,
        template: RULE,
        path: "/api/v1/buses/orders/rules/bad",
        body,
        status: 400,
        pointer,
    };
    let log = json!([{"type": "log", "name": "l"}]);
    let mut refusals = vec![
        bad_rule(
            json!({"targets": [{"type": "http", "name": "h", "url": "http://127.0.0.1:9/", "retry": {"max_attempts": "three"}}]}),
            "/targets/0/retry/max_attempts*",
        ),
        bad_rule(
            json!({"targets": [{"type": "log", "name": "l", "colour": "red"}]}),
            "/targets/0/colour*",
        ),
        bad_rule(
            json!({"targets": [{"type": "nope", "name": "l"}]}),
            "/targets/0*",
        ),
        bad_rule(
            json!({"pattern": {"data": {"price": [{"numeric": [">", "cheap"]}]}}, "targets": log}),
            "/pattern/data/price/0*",
        ),
        bad_rule(json!({"filter": "type = ", "targets": log}), "/filter*"),
        bad_rule(json!({"targets": []}), "/targets*"),
        bad_rule(
            json!({"targets": [{"type": "log", "name": "bad name"}]}),
            "/targets/0/name*",
        ),
        bad_rule(
            json!({"targets": [{"type": "bus", "name": "b", "bus": "missing"}]}),
            "/targets/0*",
        ),
        bad_rule(json!({"name": "other", "targets": log}), "/name*"),
    ];
    // An unknown bus or rule or source, a source without its settings, an
    // unknown connector action, a rule test with a bad pattern.
    let event = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "t"});
    let other = |method, template, path, body, status, pointer| Refusal {
        method,
        template,
        path,
        body,
        status,
        pointer,
    };
    refusals.extend([
        other(
            Method::PUT,
            RULE,
            "/api/v1/buses/ghost/rules/r",
            file_rule(&sluice, "r"),
            404,
            "",
        ),
        other(
            Method::GET,
            RULE,
            "/api/v1/buses/orders/rules/ghost",
            Value::Null,
            404,
            "",
        ),
        other(
            Method::PUT,
            "/api/v1/sources/{source}",
            "/api/v1/sources/mq",
            json!({"type": "rocketmq", "bus": "default"}),
            400,
            "",
        ),
        other(
            Method::GET,
            "/api/v1/sources/{source}",
            "/api/v1/sources/ghost",
            Value::Null,
            404,
            "",
        ),
        other(
            Method::POST,
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            "/api/v1/connectors/default/all-events/delivered/explode",
            Value::Null,
            400,
            "",
        ),
        other(
            Method::POST,
            "/api/v1/rules/test",
            "/api/v1/rules/test",
            json!({"event": event, "pattern": {"type": [{"numeric": 1}]}}),
            400,
            "/pattern/type*",
        ),
    ]);
    // A JSON content type without a body.
    api.call(
        Method::PUT,
        RULE,
        "/api/v1/buses/orders/rules/bad",
        None,
        &[("content-type", "application/json")],
    )
    .await
    .assert_problem(400, "", "not JSON");
    api.assert_refused(refusals).await;
    api.check_openapi("refusals");
}

async fn a_stale_version_is_refused_and_one_concurrent_writer_wins(distributed: bool) {
    let sluice = gateway(distributed, "admin-if-match").await;
    let api = Api::recorded(&sluice);
    let rule_version = orders_with_a_rule(&api).await;

    // Optimistic concurrency: a stale If-Match is 412; the current one wins.
    let stale = format!("\"{}\"", rule_version - 1);
    let current = format!("\"{rule_version}\"");
    let replace = |if_match: String| {
        let (api, body) = (&api, file_rule(&sluice, "created"));
        async move {
            let if_match = [("if-match", if_match.as_str())];
            let path = "/api/v1/buses/orders/rules/created";
            api.call(Method::PUT, RULE, path, Some(body), &if_match)
                .await
        }
    };
    let answer = replace(stale).await;
    assert_eq!(answer.status, 412, "{}", answer.body);
    // Unchanged: 200, same version.
    let answer = replace(current.clone()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["version"].as_u64(), Some(rule_version));

    // Concurrent replacements that all name the current version: exactly one wins.
    let mut tasks = Vec::new();
    for i in 0..6 {
        let body = json!({
            "pattern": {"type": ["order.created"], "source": [format!("/writer-{i}")]},
            "targets": [{"type": "log", "name": "out"}]
        });
        let client = api.client.clone();
        let url = sluice.url("/api/v1/buses/orders/rules/created");
        let current = current.clone();
        tasks.push(tokio::spawn(async move {
            client
                .put(url)
                .header("if-match", current)
                .json(&body)
                .send()
                .await
                .unwrap()
                .status()
        }));
    }
    let mut statuses = Vec::new();
    for t in tasks {
        statuses.push(t.await.unwrap().as_u16());
    }
    statuses.sort_unstable();
    assert_eq!(
        statuses,
        vec![200, 412, 412, 412, 412, 412],
        "exactly one writer wins"
    );
    api.check_openapi("if-match");
}

async fn a_bus_is_deleted_only_once_its_rules_are(distributed: bool) {
    let sluice = gateway(distributed, "admin-delete").await;
    let api = Api::recorded(&sluice);
    orders_with_a_rule(&api).await;

    // Deleting a bus that has rules is refused; the rule, then the bus, can go.
    let refused = api.delete(BUS, "/api/v1/buses/orders").await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert!(refused.body["detail"]
        .as_str()
        .unwrap()
        .contains("rule `created`"));
    let rule = "/api/v1/buses/orders/rules/created";
    assert_eq!(api.delete(RULE, rule).await.status, 204);
    assert_eq!(api.delete(RULE, rule).await.status, 404);
    let gone = api
        .call(
            Method::DELETE,
            BUS,
            "/api/v1/buses/orders",
            None,
            &[("if-match", "*")],
        )
        .await;
    assert_eq!(gone.status, 204, "{}", gone.body);
    api.check_openapi("delete");
}

/// A rule created through one replica runs on the other within 2 s; restarting a replica
/// with its original file (which lacks the rule) does not roll it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_made_on_one_replica_runs_on_the_other_and_survives_a_restart_with_the_old_file() {
    let (url, prefix) = sluice_tests::shared_redis("admin-replicas");
    // b's data directory, where a may write too (`targets.file_roots`).
    let b_data = tempfile::tempdir().unwrap();
    let replica = || {
        Sluice::builder()
            .durability("os")
            .distributed(&url, &prefix)
            .shards(2)
    };
    let a = replica().file_root(b_data.path()).start().await;
    let mut b = replica().data_dir(b_data.path()).start().await;
    a.wait_members(2).await;
    let recorder = Recorder::default();
    let api_a = Api::new(&a, &recorder);
    // The file target writes where replica b can see it: b's data directory.
    let rule = json!({
        "pattern": {"type": ["made.by.api"]},
        "targets": [{"type": "file", "name": "out", "path": b.data_dir().join("api.jsonl").to_string_lossy()}]
    });
    let t0 = Instant::now();
    api_a
        .create(RULE, "/api/v1/buses/default/rules/from-api", rule)
        .await;
    let connector = "/api/v1/connectors/default/from-api/out";
    while Api::unrecorded(&b).peek(connector).await.0 != 200 {
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "replica b did not take the rule within 2 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A new rule starts at the end of each shard once the replica running the shard has it:
    // post once every shard runs it.
    b.wait_states("default/from-api/out#", "RUNNING", 2).await;
    post_typed(&b, "default", "api-1", "made.by.api").await;
    wait_ids(&b, "api.jsonl", &["api-1"]).await;

    // The cluster view: both workers with their heartbeat age; a delivery rate per
    // connector once the backlog has been sampled twice (every 5 s, from the first ask).
    let api_b = Api::new(&b, &recorder);
    let cluster = api_b.get("/api/v1/cluster", "/api/v1/cluster").await;
    let workers = cluster.body["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2, "{}", cluster.body);
    assert!(
        workers
            .iter()
            .all(|w| w["heartbeat_age_ms"].as_u64().unwrap() < 3_000),
        "{}",
        cluster.body
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0.. {
        for i in 0..5 {
            post_typed(&b, "default", &format!("rate-{round}-{i}"), "made.by.api").await;
        }
        let (_, view) = api_b.peek(connector).await;
        if let Some(rate) = view["rate"].as_f64() {
            assert!(rate >= 0.0, "{view}");
            // Per task (shard) too, and the connector's is their sum.
            let tasks: Vec<f64> = view["tasks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["rate"].as_f64().unwrap())
                .collect();
            assert_eq!(tasks.len(), 2, "{view}");
            assert!((tasks.iter().sum::<f64>() - rate).abs() < 0.05, "{view}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no delivery rate after 30 s: {view}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // b restarts with its file, which never had the rule: the catalog keeps it.
    b.terminate();
    b.restart().await;
    assert!(
        b.log().contains("differ from the catalog"),
        "the start-up says the file differs"
    );
    let (status, body) = Api::unrecorded(&b)
        .peek("/api/v1/buses/default/rules/from-api")
        .await;
    assert_eq!(status, 200, "{body}");
    post_typed(&b, "default", "api-2", "made.by.api").await;
    wait_ids(&b, "api.jsonl", &["api-1", "api-2"]).await;
}

/// Standalone: the catalog lives in the data directory and outlives a restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_catalog_survives_a_restart_with_the_original_file() {
    let mut sluice = gateway(false, "").await;
    let recorder = Recorder::default();
    Api::new(&sluice, &recorder)
        .create(BUS, "/api/v1/buses/extra", json!({"shards": 1}))
        .await;
    sluice.terminate();
    sluice.restart().await;
    let read = Api::new(&sluice, &recorder)
        .get(BUS, "/api/v1/buses/extra")
        .await;
    assert_eq!(read.status, 200, "{}", read.body);
    post_typed(&sluice, "extra", "e-1", "t").await;
}
