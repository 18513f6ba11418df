//! The admin API (`/api/v1`) and `sluice ctl` against the real binary: resources created,
//! read, replaced and deleted in both modes, validation errors naming the field by JSON
//! pointer, optimistic concurrency, a rule created on one replica running on another, no
//! rollback by a replica restarted with its original file, credentials, `ctl apply`
//! idempotence and `--prune`, and every answer checked against the OpenAPI document.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use reqwest::{Client, Method, StatusCode};
use serde_json::{json, Value};
use sluice_tests::*;

/// Every exchange of a test, recorded for the OpenAPI check.
#[derive(Default)]
struct Recorder {
    exchanges: std::sync::Mutex<Vec<Value>>,
}

struct Api<'a> {
    sluice: &'a Sluice,
    client: Client,
    token: Option<String>,
    recorder: &'a Recorder,
}

struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: Value,
}

impl Api<'_> {
    /// `template` is the documented path (`/api/v1/buses/{bus}`), `path` the real one.
    async fn call(
        &self,
        method: Method,
        template: &str,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut request = self.client.request(method.clone(), self.sluice.url(path));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.expect("admin request");
        let status = response.status();
        let headers = response.headers().clone();
        let content_type = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let text = response.text().await.unwrap();
        let body: Value = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        self.recorder.exchanges.lock().unwrap().push(json!({
            "method": method.as_str(),
            "path": template,
            "status": status.as_u16(),
            "content_type": content_type,
            "body": body,
        }));
        Answer {
            status,
            headers,
            body,
        }
    }

    async fn get(&self, template: &str, path: &str) -> Answer {
        self.call(Method::GET, template, path, None, &[]).await
    }

    async fn put(&self, template: &str, path: &str, body: Value) -> Answer {
        self.call(Method::PUT, template, path, Some(body), &[])
            .await
    }

    /// Starts a replay on `bus` (it must be accepted) and returns its first status.
    async fn start_replay(&self, bus: &str, body: Value) -> Value {
        let started = self
            .call(
                Method::POST,
                "/api/v1/buses/{bus}/replays",
                &format!("/api/v1/buses/{bus}/replays"),
                Some(body),
                &[],
            )
            .await;
        assert_eq!(started.status, 202, "{}", started.body);
        started.body
    }
}

fn api<'a>(sluice: &'a Sluice, recorder: &'a Recorder) -> Api<'a> {
    Api {
        sluice,
        client: Client::builder()
            .timeout(Duration::from_secs(10))
            .build()
            .unwrap(),
        token: None,
        recorder,
    }
}

const BUS: &str = "/api/v1/buses/{bus}";
const RULE: &str = "/api/v1/buses/{bus}/rules/{rule}";

fn file_rule(sluice: &Sluice, name: &str) -> Value {
    json!({
        "pattern": {"type": ["order.created"]},
        "targets": [{"type": "file", "name": "out", "path": sluice.data_dir().join(format!("{name}.jsonl")).to_string_lossy()}]
    })
}

async fn post_typed(sluice: &Sluice, bus: &str, id: &str, ty: &str) {
    let response = Client::new()
        .post(sluice.url(&format!("/buses/{bus}/events")))
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/admin-test")
        .header("ce-type", ty)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 202, "{}", response.text().await.unwrap());
}

async fn wait_ids(sluice: &Sluice, file: &str, want: &[&str]) {
    let path = sluice.data_dir().join(file);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let got = if path.exists() {
            ids(&read_jsonl(&path))
        } else {
            Vec::new()
        };
        if want.iter().all(|w| got.iter().any(|g| g == w)) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{file}: want {want:?}, got {got:?}\n{}",
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Checks the recorded answers against the OpenAPI document (and the document itself)
/// with the PyPI validators.
fn check_openapi(recorder: &Recorder, name: &str) {
    let exchanges = recorder.exchanges.lock().unwrap().clone();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join(format!("{name}.json"));
    std::fs::write(&file, serde_json::to_vec_pretty(&exchanges).unwrap()).unwrap();
    let out = std::process::Command::new(python())
        .arg(repo_root().join("tests/scripts/check_openapi.py"))
        .arg(&file)
        .output()
        .expect("run check_openapi.py");
    assert!(
        out.status.success(),
        "OpenAPI check failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn crud_and_validation(sluice: &Sluice, recorder: &Recorder) {
    let api = api(sluice, recorder);

    // The bus of the file is in the catalog.
    let buses = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(buses.status, 200);
    assert_eq!(buses.body["items"][0]["name"], "default");

    // Create a bus (201, Location, ETag), read it, replace it (200), list it.
    let created = api
        .put(BUS, "/api/v1/buses/orders", json!({"shards": 2}))
        .await;
    assert_eq!(created.status, 201, "{}", created.body);
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
    let reshard = api
        .put(BUS, "/api/v1/buses/orders", json!({"shards": 4}))
        .await;
    assert_eq!(reshard.status, 400);
    assert_eq!(reshard.body["pointer"], "/shards", "{}", reshard.body);

    // A rule through the API delivers events, with no restart.
    let rule = api
        .put(
            RULE,
            "/api/v1/buses/orders/rules/created",
            file_rule(sluice, "created"),
        )
        .await;
    assert_eq!(rule.status, 201, "{}", rule.body);
    let rule_version = rule.body["version"].as_u64().unwrap();
    wait_connector(&api, "orders/created/out").await;
    post_typed(sluice, "orders", "o-1", "order.created").await;
    post_typed(sluice, "orders", "o-2", "order.cancelled").await;
    wait_ids(sluice, "created.jsonl", &["o-1"]).await;

    // Validation: the configuration loader's, the field by JSON pointer.
    let cases = [
        (
            json!({"targets": [{"type": "http", "name": "h", "url": "http://127.0.0.1:9/", "retry": {"max_attempts": "three"}}]}),
            "/targets/0/retry/max_attempts",
        ),
        (
            json!({"targets": [{"type": "log", "name": "l", "colour": "red"}]}),
            "/targets/0/colour",
        ),
        (
            json!({"targets": [{"type": "nope", "name": "l"}]}),
            "/targets/0",
        ),
        (
            json!({"pattern": {"data": {"price": [{"numeric": [">", "cheap"]}]}}, "targets": [{"type": "log", "name": "l"}]}),
            "/pattern/data/price/0",
        ),
        (
            json!({"filter": "type = ", "targets": [{"type": "log", "name": "l"}]}),
            "/filter",
        ),
        (json!({"targets": []}), "/targets"),
        (
            json!({"targets": [{"type": "log", "name": "bad name"}]}),
            "/targets/0/name",
        ),
        (
            json!({"targets": [{"type": "bus", "name": "b", "bus": "missing"}]}),
            "/targets/0",
        ),
        (
            json!({"name": "other", "targets": [{"type": "log", "name": "l"}]}),
            "/name",
        ),
    ];
    for (body, pointer) in cases {
        let answer = api
            .put(RULE, "/api/v1/buses/orders/rules/bad", body.clone())
            .await;
        assert_eq!(answer.status, 400, "{body}: {}", answer.body);
        assert_eq!(
            answer.headers["content-type"], "application/problem+json",
            "{body}"
        );
        let got = answer.body["pointer"].as_str().unwrap();
        assert!(
            got.starts_with(pointer),
            "{body}: pointer {got}, want {pointer}: {}",
            answer.body
        );
    }
    let not_json = api
        .call(
            Method::PUT,
            RULE,
            "/api/v1/buses/orders/rules/bad",
            None,
            &[("content-type", "application/json")],
        )
        .await;
    assert_eq!(not_json.status, 400);
    let no_bus = api
        .put(RULE, "/api/v1/buses/ghost/rules/r", file_rule(sluice, "r"))
        .await;
    assert_eq!(no_bus.status, 404);
    let missing = api.get(RULE, "/api/v1/buses/orders/rules/ghost").await;
    assert_eq!(missing.status, 404);

    // Optimistic concurrency: a stale If-Match is 412; the current one wins.
    let stale = format!("\"{}\"", rule_version - 1);
    let current = format!("\"{rule_version}\"");
    let answer = api
        .call(
            Method::PUT,
            RULE,
            "/api/v1/buses/orders/rules/created",
            Some(file_rule(sluice, "created")),
            &[("if-match", &stale)],
        )
        .await;
    assert_eq!(answer.status, 412, "{}", answer.body);
    // Unchanged: 200, same version.
    let answer = api
        .call(
            Method::PUT,
            RULE,
            "/api/v1/buses/orders/rules/created",
            Some(file_rule(sluice, "created")),
            &[("if-match", &current)],
        )
        .await;
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

    // Deleting a bus that has rules is refused; the rule, then the bus, can go.
    let refused = api
        .call(Method::DELETE, BUS, "/api/v1/buses/orders", None, &[])
        .await;
    assert_eq!(refused.status, 409, "{}", refused.body);
    assert!(refused.body["detail"]
        .as_str()
        .unwrap()
        .contains("rule `created`"));
    let gone = api
        .call(
            Method::DELETE,
            RULE,
            "/api/v1/buses/orders/rules/created",
            None,
            &[],
        )
        .await;
    assert_eq!(gone.status, 204);
    let again = api
        .call(
            Method::DELETE,
            RULE,
            "/api/v1/buses/orders/rules/created",
            None,
            &[],
        )
        .await;
    assert_eq!(again.status, 404);
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
    let rules = api
        .get("/api/v1/buses/{bus}/rules", "/api/v1/buses/default/rules")
        .await;
    assert_eq!(rules.status, 200);

    // Sources: validation, create, read, delete.
    let bad = api
        .put(
            "/api/v1/sources/{source}",
            "/api/v1/sources/mq",
            json!({"type": "rocketmq", "bus": "default"}),
        )
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    let sources = api.get("/api/v1/sources", "/api/v1/sources").await;
    assert_eq!(sources.status, 200);
    let ghost = api
        .get("/api/v1/sources/{source}", "/api/v1/sources/ghost")
        .await;
    assert_eq!(ghost.status, 404);

    // Connectors, the cluster, the catalog, the rule test.
    let connectors = api.get("/api/v1/connectors", "/api/v1/connectors").await;
    assert_eq!(connectors.status, 200);
    let one = &connectors.body["items"][0];
    assert_eq!(
        one["id"], "default/all-events/delivered",
        "{}",
        connectors.body
    );
    assert_eq!(one["tasks"].as_array().unwrap().len(), 4);
    assert!(one["tasks"][0]["lag"].is_u64(), "{one}");
    let connector = api
        .get(
            "/api/v1/connectors/{bus}/{rule}/{target}",
            "/api/v1/connectors/default/all-events/delivered",
        )
        .await;
    assert_eq!(connector.status, 200);
    let pause = api
        .call(
            Method::POST,
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            "/api/v1/connectors/default/all-events/delivered/pause",
            None,
            &[],
        )
        .await;
    assert_eq!(pause.status, 202);
    let resume = api
        .call(
            Method::POST,
            "/api/v1/connectors/{bus}/{rule}/{target}/tasks/{shard}/{action}",
            "/api/v1/connectors/default/all-events/delivered/tasks/1/resume",
            None,
            &[],
        )
        .await;
    assert_eq!(resume.status, 202);
    let resume = api
        .call(
            Method::POST,
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            "/api/v1/connectors/default/all-events/delivered/resume",
            None,
            &[],
        )
        .await;
    assert_eq!(resume.status, 202);
    let unknown = api
        .call(
            Method::POST,
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            "/api/v1/connectors/default/all-events/delivered/explode",
            None,
            &[],
        )
        .await;
    assert_eq!(unknown.status, 400);
    let cluster = api.get("/api/v1/cluster", "/api/v1/cluster").await;
    assert_eq!(cluster.status, 200);
    assert_eq!(cluster.body["strategy"], "sorted-hash");
    let workers = cluster.body["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 1, "{}", cluster.body);
    assert!(
        workers[0]["heartbeat_age_ms"].as_u64().unwrap() < 5_000,
        "{}",
        cluster.body
    );
    assert!(one.get("rate").is_some(), "{one}");
    let hooks = api.get("/api/v1/webhooks", "/api/v1/webhooks").await;
    assert_eq!(hooks.status, 200);
    assert_eq!(hooks.body["items"], json!([]));
    let catalog = api.get("/api/v1/catalog", "/api/v1/catalog").await;
    assert_eq!(catalog.status, 200);

    let event = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "order.created", "datacontenttype": "application/json", "data": {"total": 5}});
    let test = api
        .call(
            Method::POST,
            "/api/v1/rules/test",
            "/api/v1/rules/test",
            Some(json!({
                "event": event,
                "pattern": {"type": ["order.created"]},
                "transform": [
                    {"form": "SET_ATTRIBUTES", "attributes": {"subject": "$.data.total"}},
                    {"form": "JSONPATH", "value": "$.subject"},
                ]
            })),
            &[],
        )
        .await;
    assert_eq!(test.status, 200, "{}", test.body);
    assert_eq!(test.body["matched"], true);
    assert_eq!(
        test.body["steps"][0]["output"]["subject"], "5",
        "{}",
        test.body
    );
    assert_eq!(test.body["output"], 5, "{}", test.body);
    let test = api
        .call(
            Method::POST,
            "/api/v1/rules/test",
            "/api/v1/rules/test",
            Some(json!({"event": event, "filter": "type = 'x'"})),
            &[],
        )
        .await;
    assert_eq!(
        (test.status, test.body["matched"].clone()),
        (StatusCode::OK, json!(false))
    );
    let test = api
        .call(
            Method::POST,
            "/api/v1/rules/test",
            "/api/v1/rules/test",
            Some(json!({"event": event, "rule": "default/all-events"})),
            &[],
        )
        .await;
    assert_eq!(test.body["matched"], true, "{}", test.body);
    let test = api
        .call(
            Method::POST,
            "/api/v1/rules/test",
            "/api/v1/rules/test",
            Some(json!({"event": event, "pattern": {"type": [{"numeric": 1}]}})),
            &[],
        )
        .await;
    assert_eq!(test.status, 400, "{}", test.body);
    assert!(
        test.body["pointer"]
            .as_str()
            .unwrap()
            .starts_with("/pattern/type"),
        "{}",
        test.body
    );

    let doc = api
        .get("/api/v1/openapi.json", "/api/v1/openapi.json")
        .await;
    assert_eq!(doc.status, 200);
    assert_eq!(doc.body["openapi"], "3.1.0");
}

async fn wait_connector(api: &Api<'_>, id: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let answer = api.sluice_get(&format!("/api/v1/connectors/{id}")).await;
        if answer.0 == 200
            && answer.1["tasks"]
                .as_array()
                .is_some_and(|t| t.iter().all(|t| t["state"] == "RUNNING"))
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{id} is not running: {}",
            answer.1
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Api<'_> {
    /// Unrecorded GET (polling).
    async fn sluice_get(&self, path: &str) -> (u16, Value) {
        let mut request = self.client.get(self.sluice.url(path));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request.send().await.unwrap();
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(Value::Null))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_crud_validation_and_concurrency_standalone() {
    let sluice = Sluice::builder().durability("os").start().await;
    let recorder = Recorder::default();
    crud_and_validation(&sluice, &recorder).await;
    check_openapi(&recorder, "standalone");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resources_crud_validation_and_concurrency_distributed() {
    let (url, prefix) = shared_redis("admin-crud");
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .start()
        .await;
    let recorder = Recorder::default();
    crud_and_validation(&sluice, &recorder).await;
    check_openapi(&recorder, "distributed");
}

/// A rule created through one replica runs on the other within 2 s; restarting a replica
/// with its original file (which lacks the rule) does not roll it back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_made_on_one_replica_runs_on_the_other_and_survives_a_restart_with_the_old_file() {
    let (url, prefix) = shared_redis("admin-replicas");
    // b's data directory, where a may write too (`targets.file_roots`).
    let b_data = tempfile::tempdir().unwrap();
    let a = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .shards(2)
        .file_root(b_data.path())
        .start()
        .await;
    let mut b = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .shards(2)
        .data_dir(b_data.path())
        .start()
        .await;
    a.wait_members(2).await;
    let recorder = Recorder::default();
    let api_a = api(&a, &recorder);
    // The file target writes where replica b can see it: b's data directory.
    let rule = json!({
        "pattern": {"type": ["made.by.api"]},
        "targets": [{"type": "file", "name": "out", "path": b.data_dir().join("api.jsonl").to_string_lossy()}]
    });
    let t0 = Instant::now();
    let created = api_a
        .put(RULE, "/api/v1/buses/default/rules/from-api", rule)
        .await;
    assert_eq!(created.status, 201, "{}", created.body);
    loop {
        let api_b = api(&b, &recorder);
        let (status, _) = api_b
            .sluice_get("/api/v1/connectors/default/from-api/out")
            .await;
        if status == 200 {
            break;
        }
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
    let api_b = api(&b, &recorder);
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
        let (_, view) = api_b
            .sluice_get("/api/v1/connectors/default/from-api/out")
            .await;
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
    let api_b = api(&b, &recorder);
    let (status, body) = api_b
        .sluice_get("/api/v1/buses/default/rules/from-api")
        .await;
    assert_eq!(status, 200, "{body}");
    post_typed(&b, "default", "api-2", "made.by.api").await;
    wait_ids(&b, "api.jsonl", &["api-1", "api-2"]).await;
}

/// Standalone: the catalog lives in the data directory and outlives a restart too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_catalog_survives_a_restart_with_the_original_file() {
    let mut sluice = Sluice::builder().durability("os").start().await;
    let recorder = Recorder::default();
    let api = api(&sluice, &recorder);
    let created = api
        .put(BUS, "/api/v1/buses/extra", json!({"shards": 1}))
        .await;
    assert_eq!(created.status, 201);
    sluice.terminate();
    sluice.restart().await;
    let api = self::api(&sluice, &recorder);
    let read = api.get(BUS, "/api/v1/buses/extra").await;
    assert_eq!(read.status, 200, "{}", read.body);
    post_typed(&sluice, "extra", "e-1", "t").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_credentials() {
    let token = "s3cret-admin-token";
    let hash = {
        let out = std::process::Command::new(sluice_bin())
            .args(["ctl", "hash-token", token])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert!(hash.starts_with("sha256:"), "{hash}");
    let sluice = Sluice::builder()
        .admin(&format!("tokens = [\"{hash}\"]"))
        .start()
        .await;
    let recorder = Recorder::default();
    let mut api = api(&sluice, &recorder);
    let none = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(none.status, 401);
    assert_eq!(none.headers["content-type"], "application/problem+json");
    assert!(none.headers.contains_key("www-authenticate"));
    api.token = Some("wrong".to_string());
    let bad = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(bad.status, 401);
    // The old aliases are guarded too.
    let alias = api.get("/admin/cluster", "/admin/cluster").await;
    assert_eq!(alias.status, 401);
    api.token = Some(token.to_string());
    let good = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(good.status, 200);
    // Open: the OpenAPI document and the scaling signal (read by autoscalers).
    api.token = None;
    assert_eq!(
        api.get("/api/v1/openapi.json", "/api/v1/openapi.json")
            .await
            .status,
        200
    );
    assert_eq!(
        api.get("/api/v1/scaling", "/api/v1/scaling").await.status,
        200
    );
    check_openapi(&recorder, "auth");

    // SLUICE_ADMIN_TOKEN works for the server and for ctl.
    let env = Sluice::builder()
        .env("SLUICE_ADMIN_TOKEN", token)
        .start()
        .await;
    let out = ctl(&env, &["get", "buses"], Some(token));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(&env, &["get", "buses"], Some("nope"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
}

/// A separate admin address: the admin API is there and not on the ingress address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_serves_the_admin_api_apart_from_ingress() {
    let port = free_port();
    let sluice = Sluice::builder()
        .admin(&format!(
            "allow_local_without_token = true\nlisten = \"127.0.0.1:{port}\""
        ))
        .start()
        .await;
    let on_ingress = reqwest::get(sluice.url("/api/v1/buses")).await.unwrap();
    assert_eq!(on_ingress.status(), 404);
    let on_admin = reqwest::get(format!("http://127.0.0.1:{port}/api/v1/buses"))
        .await
        .unwrap();
    assert_eq!(on_admin.status(), 200);
    // Events still go to the ingress address.
    post_typed(&sluice, "default", "i-1", "t").await;

    // The same through SLUICE_ADMIN_LISTEN (the top-level key `admin_listen`).
    let port = free_port();
    let env = Sluice::builder()
        .env("SLUICE_ADMIN_LISTEN", &format!("127.0.0.1:{port}"))
        .start()
        .await;
    let on_admin = reqwest::get(format!("http://127.0.0.1:{port}/api/v1/cluster"))
        .await
        .unwrap();
    assert_eq!(on_admin.status(), 200);
    assert_eq!(
        reqwest::get(env.url("/api/v1/cluster"))
            .await
            .unwrap()
            .status(),
        404
    );
}

fn ctl(sluice: &Sluice, args: &[&str], token: Option<&str>) -> std::process::Output {
    let mut command = std::process::Command::new(sluice_bin());
    command
        .arg("ctl")
        .arg("--server")
        .arg(sluice.url(""))
        .args(args);
    command.env_remove("SLUICE_ADMIN_TOKEN");
    if let Some(token) = token {
        command.env("SLUICE_ADMIN_TOKEN", token);
    }
    command.output().unwrap()
}

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "ctl failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_apply_is_idempotent_prunes_and_dry_runs() {
    let sluice = Sluice::builder()
        .durability("os")
        .env("SLUICE_SECRET_TEST_GH", "gh-secret")
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("channels.toml");
    let out_path = sluice.data_dir().join("gitops.jsonl");
    let channels = format!(
        "[[buses]]\nname = \"default\"\nshards = 4\n\n[[buses]]\nname = \"gitops\"\nshards = 2\n\n\
         [[rules]]\nname = \"all\"\nbus = \"gitops\"\n[[rules.targets]]\ntype = \"file\"\nname = \"out\"\npath = \"{}\"\n",
        out_path.display()
    );
    std::fs::write(&file, &channels).unwrap();
    let f = file.to_str().unwrap();

    let dry = stdout(&ctl(&sluice, &["apply", "-f", f, "--dry-run"], None));
    assert!(dry.contains("bus/gitops created (dry run)"), "{dry}");
    let first = stdout(&ctl(&sluice, &["apply", "-f", f], None));
    assert!(first.contains("bus/gitops created"), "{first}");
    assert!(first.contains("rule/gitops/all created"), "{first}");
    assert!(first.contains("bus/default unchanged"), "{first}");
    let second = stdout(&ctl(&sluice, &["apply", "-f", f], None));
    assert!(
        !second.contains("created") && !second.contains("updated"),
        "idempotent: {second}"
    );
    // The applied rule runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    post_typed(&sluice, "gitops", "g-1", "t").await;
    wait_ids(&sluice, "gitops.jsonl", &["g-1"]).await;

    // Without --prune, what the file lacks stays; with it, it goes.
    let kept = stdout(&ctl(&sluice, &["apply", "-f", f], None));
    assert!(!kept.contains("deleted"), "{kept}");
    let listed = stdout(&ctl(&sluice, &["get", "rules", "default"], None));
    assert!(listed.contains("all-events"), "{listed}");
    let pruned = stdout(&ctl(&sluice, &["apply", "-f", f, "--prune"], None));
    assert!(
        pruned.contains("rule/default/all-events deleted"),
        "{pruned}"
    );
    let listed = stdout(&ctl(&sluice, &["get", "rules", "default"], None));
    assert!(!listed.contains("all-events"), "{listed}");

    // An invalid file changes nothing and says where.
    std::fs::write(
        &file,
        channels.replace("type = \"file\"", "type = \"file\"\nretry = 3"),
    )
    .unwrap();
    let bad = ctl(&sluice, &["apply", "-f", f], None);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("400") && err.contains("/rules/0/targets/0"),
        "{err}"
    );

    // A webhook source applied to the catalog must take its secret from the environment.
    let hooks = dir.path().join("hooks.toml");
    std::fs::write(
        &hooks,
        "[[webhooks]]\nname = \"gh\"\nbus = \"default\"\nverify = { preset = \"github\", secret = \"literal\" }\n",
    )
    .unwrap();
    let bad = ctl(&sluice, &["apply", "-f", hooks.to_str().unwrap()], None);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("400") && err.contains("/webhooks/0/verify/secret"),
        "{err}"
    );
    // With an `env:` reference to a variable the replica has, it is applied and listed
    // (one it does not have is refused: see catalog_resilience).
    std::fs::write(
        &hooks,
        "[[webhooks]]\nname = \"gh\"\nbus = \"default\"\nverify = { preset = \"github\", secret = \"env:SLUICE_SECRET_TEST_GH\" }\n",
    )
    .unwrap();
    let applied = stdout(&ctl(
        &sluice,
        &["apply", "-f", hooks.to_str().unwrap()],
        None,
    ));
    assert!(applied.contains("webhook/gh created"), "{applied}");
    let listed = stdout(&ctl(&sluice, &["get", "webhooks"], None));
    assert!(
        listed.contains("\"gh\"") && listed.contains("SLUICE_SECRET_TEST_GH"),
        "{listed}"
    );
    let gone = stdout(&ctl(&sluice, &["delete", "webhook", "gh"], None));
    assert!(gone.contains("webhook gh deleted"), "{gone}");

    // YAML with the same fields.
    let yaml = dir.path().join("more.yaml");
    std::fs::write(
        &yaml,
        "buses:\n  - name: from-yaml\n    shards: 1\n    retention: 1h\nrules:\n  - name: y\n    bus: from-yaml\n    pattern:\n      type: [a.b]\n    targets:\n      - type: log\n        name: l\n",
    )
    .unwrap();
    let applied = stdout(&ctl(
        &sluice,
        &["apply", "-f", yaml.to_str().unwrap()],
        None,
    ));
    assert!(
        applied.contains("bus/from-yaml created") && applied.contains("rule/from-yaml/y created"),
        "{applied}"
    );
    std::fs::write(&yaml, "buses: [{name: bad name}]\n").unwrap();
    let bad = ctl(&sluice, &["apply", "-f", yaml.to_str().unwrap()], None);
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("/buses/0/name"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    stdout(&ctl(&sluice, &["delete", "rule", "from-yaml/y"], None));
    stdout(&ctl(&sluice, &["delete", "bus", "from-yaml"], None));

    // describe, pause/resume, test-rule, delete.
    let described = stdout(&ctl(&sluice, &["describe", "rule", "gitops/all"], None));
    assert!(described.contains("gitops/all/out"), "{described}");
    stdout(&ctl(&sluice, &["pause", "gitops/all/out"], None));
    stdout(&ctl(
        &sluice,
        &["resume", "gitops/all/out", "--task", "1"],
        None,
    ));
    let event = dir.path().join("event.json");
    std::fs::write(
        &event,
        r#"{"specversion":"1.0","id":"1","source":"/s","type":"t"}"#,
    )
    .unwrap();
    let tested = stdout(&ctl(
        &sluice,
        &[
            "test-rule",
            "--event",
            event.to_str().unwrap(),
            "--rule",
            "gitops/all",
        ],
        None,
    ));
    assert!(tested.contains("\"matched\": true"), "{tested}");
    let refused = ctl(&sluice, &["delete", "bus", "gitops"], None);
    assert!(String::from_utf8_lossy(&refused.stderr).contains("409"));
    stdout(&ctl(&sluice, &["delete", "rule", "gitops/all"], None));
    stdout(&ctl(&sluice, &["delete", "bus", "gitops"], None));
}

/// The OpenAPI document is a valid OpenAPI 3.1 description and documents exactly the
/// routes of `api.rs` and `admin.rs`; the shipped configurations validate against the
/// configuration's JSON Schema.
#[test]
fn the_openapi_document_matches_the_routes_and_the_config_schema_the_configs() {
    for args in [&["--routes"][..], &["--config-schema"][..]] {
        let out = std::process::Command::new(python())
            .arg(repo_root().join("tests/scripts/check_openapi.py"))
            .args(args)
            .current_dir(repo_root())
            .output()
            .expect("run check_openapi.py");
        assert!(
            out.status.success(),
            "check_openapi.py {args:?}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Replay of a time range into one rule while live traffic continues: exactly the events
/// accepted in the range come again, marked `sluicereplay`, to that rule only; live events
/// are delivered once, unmarked.
async fn replay_a_time_range(sluice: &Sluice) {
    let recorder = Recorder::default();
    let api = api(sluice, &recorder);
    let rule = |name: &str| json!({"targets": [{"type": "file", "name": "out", "path": sluice.data_dir().join(format!("{name}.jsonl")).to_string_lossy()}]});
    assert_eq!(
        api.put(
            BUS,
            "/api/v1/buses/archive",
            json!({"shards": 2, "retention": "1h"})
        )
        .await
        .status,
        201
    );
    assert_eq!(
        api.put(RULE, "/api/v1/buses/archive/rules/main", rule("main"))
            .await
            .status,
        201
    );
    assert_eq!(
        api.put(RULE, "/api/v1/buses/archive/rules/other", rule("other"))
            .await
            .status,
        201
    );
    wait_connector(&api, "archive/main/out").await;
    wait_connector(&api, "archive/other/out").await;
    let ms = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
    };
    let ids_of = |prefix: &str| (0..6).map(|i| format!("{prefix}-{i}")).collect::<Vec<_>>();
    let before = ids_of("before");
    for id in &before {
        post_typed(sluice, "archive", id, "t").await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let from = ms();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let inside = ids_of("inside");
    for id in &inside {
        post_typed(sluice, "archive", id, "t").await;
    }
    tokio::time::sleep(Duration::from_millis(30)).await;
    let to = ms();
    tokio::time::sleep(Duration::from_millis(30)).await;
    let after = ids_of("after");
    for id in &after {
        post_typed(sluice, "archive", id, "t").await;
    }
    let all: Vec<&str> = before
        .iter()
        .chain(&inside)
        .chain(&after)
        .map(String::as_str)
        .collect();
    wait_ids(sluice, "main.jsonl", &all).await;

    // Bad requests name the field.
    for (body, pointer) in [
        (json!({"from": from}), "/rule"),
        (json!({"rule": "ghost"}), "/rule"),
        (json!({"rule": "main", "target": "ghost"}), "/target"),
        (json!({"rule": "main", "from": "yesterday"}), "/from"),
        (json!({"rule": "main", "from": to, "to": from}), "/to"),
        (
            json!({"rule": "main", "positions": {"9": [0, 1]}}),
            "/positions/9",
        ),
    ] {
        let answer = api
            .call(
                Method::POST,
                "/api/v1/buses/{bus}/replays",
                "/api/v1/buses/archive/replays",
                Some(body.clone()),
                &[],
            )
            .await;
        assert_eq!(answer.status, 400, "{body}: {}", answer.body);
        assert_eq!(answer.body["pointer"], pointer, "{body}: {}", answer.body);
    }

    let started = api
        .start_replay("archive", json!({"rule": "main", "from": from, "to": to}))
        .await;
    let id = started["id"].as_str().unwrap().to_string();
    // Live traffic meanwhile.
    let live = ids_of("live");
    for id in &live {
        post_typed(sluice, "archive", id, "t").await;
    }
    let status = wait_replay_end(&api, "archive", &id, Duration::from_secs(15)).await;
    assert_eq!(status["state"], "COMPLETED", "{status}");
    assert_eq!(status["matched"], 6, "{status}");
    assert_eq!(status["delivered"], 6, "{status}");
    let all_live: Vec<&str> = all
        .iter()
        .copied()
        .chain(live.iter().map(String::as_str))
        .collect();
    wait_ids(sluice, "main.jsonl", &all_live).await;
    let main = read_jsonl(&sluice.data_dir().join("main.jsonl"));
    let replayed: Vec<&Value> = main
        .iter()
        .filter(|e| e.get("sluicereplay").is_some())
        .collect();
    let mut replayed_ids: Vec<String> = replayed
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    replayed_ids.sort();
    let mut want = inside.clone();
    want.sort();
    assert_eq!(
        replayed_ids, want,
        "exactly the events accepted in the range, once"
    );
    assert!(replayed.iter().all(|e| e["sluicereplay"] == id.as_str()));
    let unmarked = main
        .iter()
        .filter(|e| e.get("sluicereplay").is_none())
        .count();
    assert_eq!(unmarked, all_live.len(), "live delivery once each");
    // The other rule got nothing replayed.
    let other = read_jsonl(&sluice.data_dir().join("other.jsonl"));
    assert!(other.iter().all(|e| e.get("sluicereplay").is_none()));
    let list = api
        .get(
            "/api/v1/buses/{bus}/replays",
            "/api/v1/buses/archive/replays",
        )
        .await;
    assert_eq!(list.body["items"][0]["id"], id.as_str());

    // Recent events, newest first, with their delivery state per subscription.
    // (Positions are committed every 50 ms: poll until the state shows it.)
    let deadline = Instant::now() + Duration::from_secs(5);
    let recent = loop {
        let recent = api
            .get(
                "/api/v1/buses/{bus}/events",
                "/api/v1/buses/archive/events?limit=5",
            )
            .await;
        assert_eq!(recent.status, 200, "{}", recent.body);
        let all_delivered = recent.body["items"].as_array().is_some_and(|i| {
            i.iter()
                .all(|i| i["subscriptions"]["main/out"] == "delivered")
        });
        if all_delivered || Instant::now() > deadline {
            break recent;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let items = recent.body["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 5);
    assert!(
        items
            .iter()
            .all(|i| i["event"]["id"].as_str().unwrap().starts_with("live-")),
        "{}",
        recent.body
    );
    assert!(
        items
            .iter()
            .all(|i| i["subscriptions"]["main/out"] == "delivered"),
        "{}",
        recent.body
    );
    assert!(items
        .windows(2)
        .all(|w| w[0]["accepted_ms"].as_u64() >= w[1]["accepted_ms"].as_u64()));
    let bad = api
        .get(
            "/api/v1/buses/{bus}/events",
            "/api/v1/buses/archive/events?limit=0",
        )
        .await;
    assert_eq!(bad.status, 400);

    // Redelivery of one event (a dead letter's extensions removed) to one rule only.
    let mut letter = items[0]["event"].clone();
    letter["deadletterreason"] = json!("503 from the receiver");
    let again = api
        .call(
            Method::POST,
            "/api/v1/buses/{bus}/rules/{rule}/redeliver",
            "/api/v1/buses/archive/rules/main/redeliver",
            Some(json!({"event": letter})),
            &[],
        )
        .await;
    assert_eq!(again.status, 202, "{}", again.body);
    let redelivery = again.body["id"].as_str().unwrap().to_string();
    let path = sluice.data_dir().join("main.jsonl");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let found: Vec<Value> = read_jsonl(&path)
            .into_iter()
            .filter(|e| e["sluicereplay"] == redelivery.as_str())
            .collect();
        if let Some(e) = found.first() {
            assert_eq!(e["id"], letter["id"]);
            assert!(e.get("deadletterreason").is_none(), "{e}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the redelivered event never arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ghost = api
        .call(
            Method::POST,
            "/api/v1/buses/{bus}/rules/{rule}/redeliver",
            "/api/v1/buses/archive/rules/ghost/redeliver",
            Some(json!({"event": letter})),
            &[],
        )
        .await;
    assert_eq!(ghost.status, 404);
    check_openapi(&recorder, "replay");

    // ctl replay by positions' worth: the whole range before `from`, waited for.
    let out = stdout(&ctl(
        sluice,
        &[
            "replay",
            "archive/main",
            "--target",
            "out",
            "--to",
            &from.to_string(),
            "--wait",
        ],
        None,
    ));
    assert!(
        out.contains("COMPLETED") && out.contains("\"delivered\": 6"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_a_time_range_into_one_rule_standalone() {
    let sluice = Sluice::builder().durability("os").start().await;
    replay_a_time_range(&sluice).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_of_a_time_range_into_one_rule_distributed() {
    let (url, prefix) = shared_redis("admin-replay");
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .start()
        .await;
    replay_a_time_range(&sluice).await;
}

/// The console is served by the gateway, offline (its files compiled in), next to the
/// admin API it uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_next_to_the_admin_api() {
    let sluice = Sluice::builder().start().await;
    let client = Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let redirect = client.get(sluice.url("/console")).send().await.unwrap();
    assert!(redirect.status().is_redirection());
    let page = client.get(sluice.url("/console/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("default-src 'self'"));
    let html = page.text().await.unwrap();
    assert!(html.contains("app.js"), "{html}");
    let js = client
        .get(sluice.url("/console/app.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(js.status(), 200);
    assert!(js.headers()["content-type"]
        .to_str()
        .unwrap()
        .contains("javascript"));
    let missing = client
        .get(sluice.url("/console/nope.js"))
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    assert_eq!(
        missing.headers()["content-type"],
        "application/problem+json"
    );

    // With the admin API on its own address, the console is there (it calls /api/v1 on its
    // own origin) and not on the ingress address.
    let port = free_port();
    let apart = Sluice::builder()
        .admin(&format!(
            "allow_local_without_token = true\nlisten = \"127.0.0.1:{port}\""
        ))
        .start()
        .await;
    let there = client
        .get(format!("http://127.0.0.1:{port}/console/"))
        .send()
        .await
        .unwrap();
    assert_eq!(there.status(), 200);
    let not_here = client.get(apart.url("/console/")).send().await.unwrap();
    assert_eq!(not_here.status(), 404);
}

/// Waits until the replay `id` of `bus` is no longer `RUNNING` (asked of `sluice`).
async fn wait_replay_end(api: &Api<'_>, bus: &str, id: &str, limit: Duration) -> Value {
    let deadline = Instant::now() + limit;
    loop {
        let answer = api
            .get(
                "/api/v1/buses/{bus}/replays/{replay}",
                &format!("/api/v1/buses/{bus}/replays/{id}"),
            )
            .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        if answer.body["state"] != "RUNNING" {
            return answer.body;
        }
        assert!(
            Instant::now() < deadline,
            "the replay did not end: {}\n{}",
            answer.body,
            api.sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A replay whose replica is killed mid-way is claimed by the other replica, which resumes
/// it from the positions recorded per shard: every event of the range is replayed, the
/// shards finished before the kill are not replayed again, and the status names the new
/// worker and counts the takeover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_taken_over_when_its_replica_dies() {
    replay_takeover(false).await;
}

/// A replica with a fixed `worker_id` that is killed and started again finds its own
/// replay still `RUNNING` under its id, and resumes it (no other replica needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_with_a_fixed_worker_id_resumes_its_replay_after_a_restart() {
    replay_takeover(true).await;
}

async fn replay_takeover(restart_same_id: bool) {
    let (url, prefix) = shared_redis("replay-takeover");
    let receiver = receiver::Receiver::start().await;
    let extra = format!(
        r#"
[[buses]]
name = "archive"
shards = 4
retention = "1h"

[[rules]]
name = "slow"
bus = "archive"

[[rules.targets]]
type = "http"
name = "hook"
url = "{}"
max_in_flight = 1
"#,
        receiver.url("/hook")
    );
    let start = |id: Option<&str>| {
        let mut builder = Sluice::builder()
            .durability("os")
            .without_default_rule()
            .distributed(&url, &prefix)
            .extra(&extra);
        if let Some(id) = id {
            builder = builder.env("SLUICE_WORKER_ID", id);
        }
        builder.start()
    };
    let mut a = start(restart_same_id.then_some("fixed-a")).await;
    let b = if restart_same_id {
        None
    } else {
        let b = start(None).await;
        b.wait_members(2).await;
        Some(b)
    };
    let recorder = Recorder::default();
    let api_a = api(&a, &recorder);
    wait_connector(&api_a, "archive/slow/hook").await;

    const N: usize = 120;
    let urls: Vec<String> = [Some(&a), b.as_ref()]
        .into_iter()
        .flatten()
        .map(|s| s.url("/buses/archive/events"))
        .collect();
    let posted = post_spread(&urls, "ev", N).await;
    assert_eq!(posted.len(), N);
    receiver
        .wait_for(Duration::from_secs(30), |r| {
            r.iter().filter(|r| r.was_accepted()).count() >= N
        })
        .await;

    // Each replayed event takes the receiver 40 ms, one at a time: the replay runs for
    // about 5 s, shard after shard.
    receiver.default_reply(receiver::Reply::Sleep(Duration::from_millis(40), 200));
    let started = api_a.start_replay("archive", json!({"rule": "slow"})).await;
    let id = started["id"].as_str().unwrap().to_string();
    let first_worker = started["worker"].as_str().unwrap().to_string();

    // Kill A once at least one shard is done (as recorded).
    let deadline = Instant::now() + Duration::from_secs(20);
    let done_at_kill = loop {
        let s = api_a
            .get(
                "/api/v1/buses/{bus}/replays/{replay}",
                &format!("/api/v1/buses/archive/replays/{id}"),
            )
            .await
            .body;
        assert_eq!(
            s["state"], "RUNNING",
            "the replay ended before the kill: {s}"
        );
        let shards = s["shards"].as_object().unwrap();
        let done: u64 = shards
            .values()
            .map(|p| p["next"].as_u64().unwrap() - p["from"].as_u64().unwrap())
            .sum();
        if shards
            .values()
            .any(|p| p["next"] == p["to"] && p["to"] != p["from"])
        {
            break done;
        }
        assert!(Instant::now() < deadline, "no shard finished: {s}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    drop(api_a);
    a.kill9();
    if restart_same_id {
        a.restart().await;
    }
    // The replica that ends up running the replay.
    let survivor = b.as_ref().unwrap_or(&a);
    let api_s = api(survivor, &recorder);

    let end = wait_replay_end(&api_s, "archive", &id, Duration::from_secs(60)).await;
    assert_eq!(end["state"], "COMPLETED", "{end}\n{}", survivor.log());
    if restart_same_id {
        assert_eq!(end["worker"], "fixed-a", "{end}");
    } else {
        assert_ne!(end["worker"], first_worker.as_str(), "{end}");
    }
    assert_eq!(end["takeovers"], 1, "{end}");
    assert_eq!(end["read"].as_u64(), Some(N as u64), "{end}");
    assert!(
        survivor
            .log()
            .contains("took over a replay whose worker left the cluster"),
        "{}",
        survivor.log()
    );

    // Every event of the range replayed at least once; what came twice is at most what
    // the dead worker had not recorded as done.
    let replayed: Vec<String> = receiver
        .received()
        .iter()
        .filter(|r| r.was_accepted() && r.header("ce-sluicereplay") == Some(id.as_str()))
        .filter_map(|r| r.header("ce-id").map(str::to_string))
        .collect();
    let unique: std::collections::HashSet<&String> = replayed.iter().collect();
    assert_eq!(unique.len(), N, "not every event was replayed");
    let duplicates = replayed.len() - N;
    assert!(
        duplicates as u64 <= N as u64 - done_at_kill,
        "{duplicates} replayed twice, though {done_at_kill} of {N} were recorded done at the kill"
    );
    eprintln!(
        "replay takeover: {done_at_kill} of {N} recorded done at the kill, {duplicates} replayed twice"
    );
    check_openapi(&recorder, "replay-takeover");
}

/// One stream entry as XRANGE returns it: id and fields.
type StreamEntry = (String, Vec<(String, Vec<u8>)>);

/// `retention_bytes` keeps the newest bytes of what every subscription passed, and no
/// more: after a burst is delivered, the stream holds just under the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_by_size_keeps_the_newest_bytes_of_passed_events() {
    const BOUND: usize = 20_000;
    let (url, prefix) = shared_redis("retention-size");
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .start()
        .await;
    let recorder = Recorder::default();
    let api = api(&sluice, &recorder);
    let bad = api
        .put(
            BUS,
            "/api/v1/buses/sized",
            json!({"shards": 1, "retention_bytes": 0}),
        )
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.body["pointer"], "/retention_bytes", "{}", bad.body);
    // The backlog bound: at least a second, and shown as set.
    let bad = api
        .put(
            BUS,
            "/api/v1/buses/sized",
            json!({"shards": 1, "max_backlog_age": "500ms"}),
        )
        .await;
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.body["pointer"], "/max_backlog_age", "{}", bad.body);
    assert_eq!(
        api.put(
            BUS,
            "/api/v1/buses/sized",
            json!({"shards": 1, "retention_bytes": BOUND, "max_backlog_age": "72h"})
        )
        .await
        .status,
        201
    );
    assert_eq!(
        api.put(RULE, "/api/v1/buses/sized/rules/all", json!({"targets": [{"type": "file", "name": "out", "path": sluice.data_dir().join("sized.jsonl").to_string_lossy()}]}))
            .await
            .status,
        201
    );
    wait_connector(&api, "sized/all/out").await;
    let body = format!("{{\"pad\":\"{}\"}}", "x".repeat(300));
    let client = Client::new();
    let ids: Vec<String> = (0..200).map(|i| format!("sz-{i:03}")).collect();
    for id in &ids {
        post(&client, &sluice.url("/buses/sized/events"), id, &body).await;
    }
    let want: Vec<&str> = ids.iter().map(String::as_str).collect();
    wait_ids(&sluice, "sized.jsonl", &want).await;

    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let stream = format!("{prefix}:bus:sized:0");
    // Released every 5 s: wait for a round to have passed everything.
    let deadline = Instant::now() + Duration::from_secs(20);
    let (kept, bytes, largest) = loop {
        let entries: Vec<StreamEntry> = redis::cmd("XRANGE")
            .arg(&stream)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .unwrap();
        // The payload is an entry's largest field.
        let sizes: Vec<usize> = entries
            .iter()
            .map(|(_, fields)| fields.iter().map(|(_, v)| v.len()).max().unwrap_or(0))
            .collect();
        let bytes: usize = sizes.iter().sum();
        if bytes <= BOUND {
            break (entries.len(), bytes, sizes.into_iter().max().unwrap_or(0));
        }
        assert!(
            Instant::now() < deadline,
            "the stream still holds {bytes} bytes in {} events\n{}",
            entries.len(),
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Kept: the newest that fit, to within one chunk (1/64 of the bound) and one event.
    assert!(
        bytes + BOUND / 64 + largest >= BOUND,
        "only {bytes} bytes kept in {kept} events"
    );
    assert!(kept < ids.len(), "nothing was released");
    // What is kept is the newest: a replay of everything brings exactly those back.
    let started = api.start_replay("sized", json!({"rule": "all"})).await;
    let id = started["id"].as_str().unwrap().to_string();
    let end = wait_replay_end(&api, "sized", &id, Duration::from_secs(20)).await;
    assert_eq!(end["state"], "COMPLETED", "{end}");
    assert_eq!(end["read"].as_u64(), Some(kept as u64), "{end}");
    let newest: Vec<&str> = want[want.len() - kept..].to_vec();
    let delivered = read_jsonl(&sluice.data_dir().join("sized.jsonl"));
    let mut replayed: Vec<String> = delivered
        .iter()
        .filter(|e| e["sluicereplay"] == id.as_str())
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    while replayed.len() < kept && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        replayed = read_jsonl(&sluice.data_dir().join("sized.jsonl"))
            .iter()
            .filter(|e| e["sluicereplay"] == id.as_str())
            .map(|e| e["id"].as_str().unwrap().to_string())
            .collect();
    }
    assert_eq!(replayed, newest);
    eprintln!(
        "retention_bytes {BOUND}: {kept} events ({bytes} bytes) kept of {}",
        ids.len()
    );
    check_openapi(&recorder, "retention-size");
}

/// A webhook source made through one replica's API is served by every replica within
/// seconds; its secrets are `env:` references each replica reads (a literal secret, an
/// unset variable, a bad preset are refused with the field's pointer), a replica without
/// the variable answers 503 and says why, a delivery is stored once whichever replica takes
/// its retries, the source keeps its bus from being deleted, and deleting it stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_sources_made_through_the_api_are_served_by_every_replica() {
    const HOOK: &str = "/api/v1/webhooks/{name}";
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
    let api_a = api(&a, &recorder);
    let client = Client::new();
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
    wait_connector(&api_a, "default/hooks/out").await;
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
    let api_c = api(&c, &recorder);
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
    let bus = api_a
        .call(Method::DELETE, BUS, "/api/v1/buses/default", None, &[])
        .await;
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
    let deleted = api_a
        .call(Method::DELETE, HOOK, "/api/v1/webhooks/orders", None, &[])
        .await;
    assert_eq!(deleted.status, 204, "{}", deleted.body);
    let t0 = Instant::now();
    while deliver(&b, "k-123", "d-4").await.unwrap().status() != 404 {
        assert!(t0.elapsed() < Duration::from_secs(10), "b still serves it");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check_openapi(&recorder, "webhooks");
}
