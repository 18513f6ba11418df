//! A catalog that cannot be poisoned or frozen, through the real binary: a change is
//! accepted only if the replica that takes it can build it (else 400 naming the field, and
//! nothing stored); a resource one replica cannot build fails alone there (FAILED with why,
//! its events held, not skipped) while every later change runs everywhere; a restart with
//! such a catalog serves the rest; a bus whose keys or webhook whose secret cannot be read
//! answers 503 and never lets anything in without them; and a bus name cannot come back
//! with another shard count while its log is in the store.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sluice_tests::receiver::{event_ids, Receiver};
use sluice_tests::{binary, client, ids, post_spread, read_jsonl, shared_redis, Sluice};

/// `method` `path` with a JSON body (or none); the status and the body (problem+json
/// checked as such).
async fn call(
    sluice: &Sluice,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = client().request(method, sluice.url(path));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let text = response.text().await.unwrap();
    if status >= 400 {
        assert_eq!(content_type, "application/problem+json", "{status}: {text}");
    }
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

async fn put(sluice: &Sluice, path: &str, body: Value) -> (u16, Value) {
    call(sluice, reqwest::Method::PUT, path, Some(body)).await
}

async fn get(sluice: &Sluice, path: &str) -> (u16, Value) {
    call(sluice, reqwest::Method::GET, path, None).await
}

async fn catalog_version(sluice: &Sluice) -> u64 {
    let (status, body) = get(sluice, "/api/v1/catalog").await;
    assert_eq!(status, 200, "{body}");
    body["version"].as_u64().unwrap()
}

/// A rule of one http target whose bearer token is the variable `var`.
fn token_rule(url: &str, var: &str) -> Value {
    json!({"targets": [{
        "type": "http",
        "name": "h",
        "url": url,
        "auth": {"type": "bearer", "token": format!("env:{var}")},
    }]})
}

/// A rule of one file target writing to `path`.
fn file_rule(path: &str) -> Value {
    json!({"targets": [{"type": "file", "name": "f", "path": path}]})
}

/// Waits until `pred` holds for the connector's view (`/api/v1/connectors/{id}`).
async fn wait_connector(sluice: &Sluice, id: &str, pred: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, view) = get(sluice, &format!("/api/v1/connectors/{id}")).await;
        if status == 200 && pred(&view) {
            return view;
        }
        assert!(Instant::now() < deadline, "{id}: {status} {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn tasks(view: &Value) -> Vec<Value> {
    view["tasks"].as_array().cloned().unwrap_or_default()
}

fn all_running(view: &Value) -> bool {
    let tasks = tasks(view);
    !tasks.is_empty() && tasks.iter().all(|t| t["state"] == "RUNNING")
}

/// A webhook source verified by an API key in `x-api-key` that is the variable `var`.
fn hook(var: &str) -> Value {
    json!({
        "bus": "default",
        "verify": {"preset": "api-key", "header": "x-api-key", "secret": format!("env:{var}")},
        "id": {"header": "x-delivery"},
        "type": {"value": "hook.received"},
    })
}

async fn deliver_hook(sluice: &Sluice, name: &str, key: &str, id: &str) -> (u16, String) {
    let response = client()
        .post(sluice.url(&format!("/webhooks/{name}")))
        .header("x-api-key", key)
        .header("x-delivery", id)
        .header("content-type", "application/json")
        .body(r#"{"n": 1}"#)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// (a) A rule whose target names a variable the replica does not have is refused with
/// the field's pointer, by `PUT` and by `apply` (also a dry run), and nothing is stored;
/// so is a bus whose keys it cannot read and a webhook whose secret it cannot read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_the_replica_cannot_build_is_refused_with_its_pointer() {
    let sluice = Sluice::builder()
        .durability("os")
        .env("SLUICE_SECRET_RES_A_SET", "value")
        .start()
        .await;
    let before = catalog_version(&sluice).await;
    let var = "SLUICE_SECRET_RES_A_UNSET";
    let (status, body) = put(
        &sluice,
        "/api/v1/buses/default/rules/exfil",
        token_rule("http://127.0.0.1:9/x", var),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["pointer"], "/targets/0/auth/token", "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains(&format!(
            "environment variable {var} is not set on the replica that took this request"
        )),
        "{detail}"
    );
    assert_eq!(catalog_version(&sluice).await, before, "nothing was stored");
    let (status, _) = get(&sluice, "/api/v1/buses/default/rules/exfil").await;
    assert_eq!(status, 404);

    // In an apply, the pointer is into the body; a dry run says the same.
    let body = json!({"rules": [
        {"name": "fine", "bus": "default", "targets": [{"type": "log", "name": "l"}]},
        {"name": "exfil", "bus": "default", "targets": token_rule("http://127.0.0.1:9/x", var)["targets"]},
    ]});
    for path in [
        "/api/v1/catalog/apply",
        "/api/v1/catalog/apply?dry_run=true",
    ] {
        let (status, answer) = call(&sluice, reqwest::Method::POST, path, Some(body.clone())).await;
        assert_eq!(status, 400, "{path}: {answer}");
        assert_eq!(
            answer["pointer"], "/rules/1/targets/0/auth/token",
            "{answer}"
        );
        assert_eq!(answer["resource"], "rule/default/exfil", "{answer}");
    }
    assert_eq!(
        catalog_version(&sluice).await,
        before,
        "nothing was applied"
    );

    // A bus whose keys, or a webhook whose secret, this replica cannot read.
    let (status, body) = put(
        &sluice,
        "/api/v1/buses/guarded",
        json!({"shards": 1, "auth": {"keys": ["sha256:a4ae87b73fa5645e6aee415a6f72be4dcbd99d057a7b40cb1b867c181d179260", format!("env:{var}")]}}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["pointer"], "/auth/keys/1", "{body}");
    let apply = json!({"webhooks": [{"name": "gh", "bus": "default", "verify": {"preset": "github", "secret": format!("env:{var}")}}]});
    let (status, body) = call(
        &sluice,
        reqwest::Method::POST,
        "/api/v1/catalog/apply",
        Some(apply),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["pointer"], "/webhooks/0/verify/secret", "{body}");
    assert_eq!(catalog_version(&sluice).await, before);

    // With the variable set here, the same rule is accepted.
    let (status, body) = put(
        &sluice,
        "/api/v1/buses/default/rules/exfil",
        token_rule("http://127.0.0.1:9/x", "SLUICE_SECRET_RES_A_SET"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
}

/// (b) Two replicas, the variable set on the first only. The rule made through the first
/// runs there and fails on the second (FAILED, with the variable named, seen from either
/// replica), holding the second's shards' events; a later rule runs on both; once the
/// second dies, the first delivers the held events: nothing skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rule_one_replica_cannot_build_fails_there_alone_and_its_events_wait() {
    let (url, prefix) = shared_redis("resilience-one-replica");
    let var = "SLUICE_SECRET_RES_B_TOKEN";
    let receiver = Receiver::start().await;
    let start = |with_var: bool| {
        let mut builder = Sluice::builder()
            .durability("os")
            .distributed(&url, &prefix)
            .without_default_rule()
            .shards(4);
        if with_var {
            builder = builder.env(var, "b-token");
        }
        builder.start()
    };
    let one = start(true).await;
    let mut two = start(false).await;
    one.wait_members(2).await;
    one.wait_tasks_settled(4, 2).await;
    let worker = |view: Value| view["worker"].as_str().unwrap().to_string();
    let (one_id, two_id) = (
        worker(one.cluster_view().await),
        worker(two.cluster_view().await),
    );

    // The second cannot take it (it would not run there), the first can.
    let rule = token_rule(&receiver.url("/hook"), var);
    let (status, body) = put(&two, "/api/v1/buses/default/rules/needs-var", rule.clone()).await;
    assert_eq!(status, 400, "{body}");
    let (status, body) = put(&one, "/api/v1/buses/default/rules/needs-var", rule).await;
    assert_eq!(status, 201, "{body}");

    // Each replica runs its own shards of it: running on the first, FAILED on the second.
    let split = |view: &Value| {
        let tasks = tasks(view);
        tasks.len() == 4
            && tasks.iter().any(|t| t["state"] == "FAILED")
            && tasks.iter().all(|t| match t["state"].as_str() {
                Some("RUNNING") => t["worker"] == one_id.as_str(),
                Some("FAILED") => {
                    t["worker"] == two_id.as_str()
                        && t["reason"].as_str().is_some_and(|r| r.contains(var))
                }
                _ => false,
            })
    };
    let view = wait_connector(&one, "default/needs-var/h", split).await;
    eprintln!("{view}");
    wait_connector(&two, "default/needs-var/h", split).await;
    let metrics = two.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("default/needs-var/h#") && l.contains("state=\"FAILED\"")),
        "no FAILED task state in the second's metrics"
    );

    // A later change, made through the replica that lacks the variable, runs on both.
    let (status, body) = put(
        &two,
        "/api/v1/buses/default/rules/later",
        file_rule("{data_dir}/later.jsonl"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    wait_connector(&one, "default/later/f", all_running).await;

    let owners: BTreeMap<u32, String> = one
        .running_tasks()
        .await
        .into_iter()
        .filter_map(|(task, w)| Some((task.strip_prefix("bus/default#")?.parse().ok()?, w)))
        .collect();
    assert_eq!(owners.len(), 4, "{owners:?}");
    let sent = post_spread(&[one.events_url(), two.events_url()], "held", 40).await;
    assert_eq!(sent.len(), 40);
    let on_one: HashSet<String> = sent
        .iter()
        .filter(|id| owners[&sluice::event::shard_of(id, 4)] == one_id)
        .cloned()
        .collect();
    assert!(
        !on_one.is_empty() && on_one.len() < sent.len(),
        "the events cover both replicas' shards: {owners:?}"
    );

    // The later rule delivers everything, on both replicas.
    let later = |s: &Sluice| ids(&read_jsonl(&s.data_dir().join("later.jsonl")));
    let (a, b) = sluice_tests::wait_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || (later(&one), later(&two)),
        |(a, b)| {
            let all: HashSet<&String> = a.iter().chain(b).collect();
            sent.iter().all(|id| all.contains(id))
        },
        |_| "the later rule did not deliver everything".to_string(),
    )
    .await;
    assert!(
        !a.is_empty() && !b.is_empty(),
        "both replicas run the later rule"
    );
    // The rule the second cannot build delivers the first's shards only.
    receiver
        .wait_for(Duration::from_secs(20), |r| {
            let got: HashSet<String> = event_ids(r).into_iter().collect();
            on_one.iter().all(|id| got.contains(id))
        })
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got: HashSet<String> = event_ids(&receiver.received()).into_iter().collect();
    assert!(
        got.iter().all(|id| on_one.contains(id)),
        "events of the second's shards were delivered while it held them: {:?}",
        got.difference(&on_one).collect::<Vec<_>>()
    );

    // The second dies: the first takes its shards and delivers what they held.
    two.kill9();
    receiver
        .wait_for(Duration::from_secs(40), |r| {
            let got: HashSet<String> = event_ids(r).into_iter().collect();
            sent.iter().all(|id| got.contains(id))
        })
        .await;
    wait_connector(&one, "default/needs-var/h", all_running).await;
}

/// (c) A standalone gateway restarted without a variable its catalog needs stays up: the
/// rule that needs it is FAILED with why, every other rule delivers, and later changes
/// apply. (e) The webhook source whose secret is missing answers 503, another one works.
/// (f) The bus whose keys are missing answers 503 and never takes an event without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_a_variable_serves_everything_else() {
    let data = tempfile::tempdir().unwrap();
    let (token, hook_a, hook_b, key) = (
        "SLUICE_SECRET_RES_C_TOKEN",
        "SLUICE_SECRET_RES_C_HOOK_A",
        "SLUICE_SECRET_RES_C_HOOK_B",
        "SLUICE_SECRET_RES_C_KEY",
    );
    let path = |name: &str| data.path().join(name).to_string_lossy().to_string();
    let mut first = Sluice::builder()
        .durability("os")
        .data_dir(data.path())
        .env(token, "t")
        .env(hook_a, "key-a")
        .env(hook_b, "key-b")
        .env(key, "bus-key")
        .start()
        .await;
    for (resource, body) in [
        (
            "/api/v1/buses/default/rules/needs-token",
            token_rule("http://127.0.0.1:9/x", token),
        ),
        ("/api/v1/webhooks/hook-a", hook(hook_a)),
        ("/api/v1/webhooks/hook-b", hook(hook_b)),
        (
            "/api/v1/buses/guarded",
            json!({"shards": 1, "auth": {"keys": [format!("env:{key}")]}}),
        ),
        (
            "/api/v1/buses/guarded/rules/to-file",
            file_rule(&path("guarded.jsonl")),
        ),
    ] {
        let (status, body) = put(&first, resource, body).await;
        assert_eq!(status, 201, "{resource}: {body}");
    }
    let version = catalog_version(&first).await;
    first.terminate();

    // Without three of the four variables: it starts (the harness waits for /readyz).
    let second = Sluice::builder()
        .durability("os")
        .data_dir(data.path())
        .env(hook_b, "key-b")
        .start()
        .await;
    assert!(second.is_alive());
    let ready = client().get(second.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    assert_eq!(catalog_version(&second).await, version);
    assert!(second
        .log()
        .contains("cannot run this resource of the catalog"));

    let view = wait_connector(&second, "default/needs-token/h", |v| {
        v["state"] == "FAILED" && tasks(v).iter().all(|t| t["state"] == "FAILED")
    })
    .await;
    let reason = view["reason"].as_str().unwrap_or_default();
    assert!(reason.contains(token), "{view}");

    // The other rules deliver; a rule made now runs and delivers.
    let (status, body) = put(
        &second,
        "/api/v1/buses/default/rules/after",
        file_rule(&path("after.jsonl")),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    wait_connector(&second, "default/after/f", all_running).await;
    let c = client();
    for i in 0..5 {
        sluice_tests::post(&c, &second.events_url(), &format!("c-{i}"), "{}").await;
    }
    second
        .wait_delivered(Duration::from_secs(10), |e| ids(e).len() >= 5)
        .await;
    sluice_tests::wait_jsonl(
        &data.path().join("after.jsonl"),
        Duration::from_secs(10),
        |e| ids(e).len() >= 5,
    )
    .await;

    // (e) The webhook whose secret is missing here: 503; the other one works.
    let (status, text) = deliver_hook(&second, "hook-a", "key-a", "d-1").await;
    assert_eq!(status, 503, "{text}");
    assert!(text.contains(hook_a), "{text}");
    let (status, text) = deliver_hook(&second, "hook-b", "key-b", "d-2").await;
    assert_eq!(status, 202, "{text}");

    // (f) The bus whose keys are missing here: closed, with or without a key.
    let guarded = second.url("/buses/guarded/events");
    for key in [None, Some("bus-key"), Some("anything")] {
        let mut request = binary(&c, &guarded, "g-1", "{}");
        if let Some(key) = key {
            request = request.header("x-api-key", key);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 503, "{key:?}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
        let body: Value = response.json().await.unwrap();
        assert!(
            body["detail"]
                .as_str()
                .is_some_and(|d| d.contains("keys are unavailable on this replica")),
            "{body}"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        read_jsonl(&data.path().join("guarded.jsonl")).is_empty(),
        "nothing entered the bus without its keys"
    );
}

/// (d) A bus deleted and made again with another shard count while its log is in the
/// store is refused (409 naming `/shards`), by `PUT` and by `apply`; with its count it
/// comes back, and later changes apply.
async fn a_bus_keeps_its_shard_count_while_its_log_exists(sluice: &Sluice) {
    let c = client();
    let (status, body) = put(sluice, "/api/v1/buses/orders", json!({"shards": 2})).await;
    assert_eq!(status, 201, "{body}");
    // Once the bus runs, its log exists.
    let orders = sluice.url("/buses/orders/events");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = binary(&c, &orders, "o-1", "{}")
            .send()
            .await
            .unwrap()
            .status();
        if status == 202 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the bus never took events: {status}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, body) = call(
        sluice,
        reqwest::Method::DELETE,
        "/api/v1/buses/orders",
        None,
    )
    .await;
    assert_eq!(status, 204, "{body}");
    let before = catalog_version(sluice).await;

    let (status, body) = put(sluice, "/api/v1/buses/orders", json!({"shards": 4})).await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["pointer"], "/shards", "{body}");
    let detail = body["detail"].as_str().unwrap();
    assert!(
        detail.contains("with 2 shards") && detail.contains("another name"),
        "{detail}"
    );
    let (status, body) = call(
        sluice,
        reqwest::Method::POST,
        "/api/v1/catalog/apply",
        Some(json!({"buses": [{"name": "other", "shards": 1}, {"name": "orders", "shards": 4}]})),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["pointer"], "/buses/1/shards", "{body}");
    assert_eq!(catalog_version(sluice).await, before, "nothing was stored");

    // Later changes apply: another bus, and the same one with its count.
    let (status, body) = put(sluice, "/api/v1/buses/other", json!({"shards": 3})).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = put(sluice, "/api/v1/buses/orders", json!({"shards": 2})).await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = put(
        sluice,
        "/api/v1/buses/orders/rules/to-file",
        file_rule("{data_dir}/orders.jsonl"),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    wait_connector(sluice, "orders/to-file/f", all_running).await;
    for bus in ["other", "orders"] {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let url = sluice.url(&format!("/buses/{bus}/events"));
            let status = binary(&c, &url, "o-2", "{}").send().await.unwrap().status();
            if status == 202 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{bus} never took events: {status}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    sluice_tests::wait_file(sluice, "orders.jsonl", Duration::from_secs(10), |e| {
        ids(e).contains(&"o-2".to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_keeps_its_shard_count_while_its_log_exists_standalone() {
    let sluice = Sluice::builder().durability("os").start().await;
    a_bus_keeps_its_shard_count_while_its_log_exists(&sluice).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_keeps_its_shard_count_while_its_log_exists_distributed() {
    let (url, prefix) = shared_redis("resilience-shards");
    let sluice = Sluice::builder()
        .durability("os")
        .distributed(&url, &prefix)
        .start()
        .await;
    a_bus_keeps_its_shard_count_while_its_log_exists(&sluice).await;
}

/// A bus whose log does not open on this replica (its data was placed by another shard
/// count: here the catalog was lost and the file seeds it again with another count) fails
/// alone: the gateway starts, that bus answers 503 and its rule is FAILED, the rest runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_whose_log_does_not_open_fails_alone() {
    let extra = "[[buses]]\nname = \"x\"\nshards = 3\n\n[[rules]]\nname = \"to-file\"\nbus = \"x\"\n[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"{data_dir}/x.jsonl\"\n";
    let mut sluice = Sluice::builder()
        .durability("os")
        .extra(extra)
        .start()
        .await;
    let c = client();
    sluice_tests::post(&c, &sluice.url("/buses/x/events"), "x-1", "{}").await;
    sluice.terminate();
    std::fs::remove_file(sluice.data_dir().join("catalog.json")).unwrap();
    let config = std::fs::read_to_string(sluice.config_path()).unwrap();
    let changed = config.replace("name = \"x\"\nshards = 3", "name = \"x\"\nshards = 5");
    assert_ne!(config, changed);
    std::fs::write(sluice.config_path(), changed).unwrap();
    sluice.restart().await;

    let ready = c.get(sluice.url("/readyz")).send().await.unwrap();
    assert_eq!(ready.status(), 200);
    sluice_tests::send_expecting(binary(&c, &sluice.url("/buses/x/events"), "x-2", "{}"), 503)
        .await;
    let view = wait_connector(&sluice, "x/to-file/f", |v| v["state"] == "FAILED").await;
    assert!(
        view["reason"]
            .as_str()
            .is_some_and(|r| r.contains("3 shards")),
        "{view}"
    );
    sluice_tests::post(&c, &sluice.events_url(), "d-1", "{}").await;
    sluice
        .wait_delivered(Duration::from_secs(10), |e| {
            ids(e).contains(&"d-1".to_string())
        })
        .await;
    // Later changes apply.
    let (status, body) = put(&sluice, "/api/v1/buses/later", json!({"shards": 1})).await;
    assert_eq!(status, 201, "{body}");
}
