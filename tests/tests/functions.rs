//! WebAssembly functions through the binary: map, filter, fan-out and chains with the
//! built-in steps; errors, traps, time and memory limits and invalid output dead-lettered
//! with their cause; the `functions` API (upload, checks, hot update, 409 while used, the
//! rule test) and replicas loading a function created through the API.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use reqwest::Method;
use serde_json::{json, Value};
use sluice_tests::admin::{call, get, put};
use sluice_tests::bench::post_batches;
use sluice_tests::wasm::{
    component, reads_the_clock, uses_host, wrong_signature, Behaviour, HostUse,
};
use sluice_tests::{bus_to_file, client, post, read_jsonl, rule_on, wait_jsonl, Sluice};

/// Writes a component for `behaviour` to `dir/{name}.wasm` and returns the TOML of the
/// function (with `limits` lines).
fn function(dir: &Path, name: &str, behaviour: &Behaviour, limits: &str) -> String {
    let path = dir.join(format!("{name}.wasm"));
    std::fs::write(&path, component(behaviour)).expect("write component");
    format!(
        "\n[[functions]]\nname = \"{name}\"\npath = \"{}\"\n{limits}\n",
        path.display()
    )
}

/// A rule of bus `default` sending every event through `transform` into the bus `out`
/// (stored in `out.jsonl`), dead letters to the bus `dlq` (`dlq.jsonl`).
fn through(rule: &str, transform: &str) -> String {
    rule_on(
        "default",
        rule,
        "bus",
        &format!("{rule}-out"),
        &format!(
            "bus = \"out\"\ntransform = {transform}\n[rules.targets.dead_letter]\nbus = \"dlq\""
        ),
    )
}

/// A standalone gateway (`os` durability, no default rule) with `extra` in its file.
async fn start(extra: &str) -> Sluice {
    Sluice::builder()
        .durability("os")
        .without_default_rule()
        .extra(extra)
        .start()
        .await
}

async fn post_one(sluice: &Sluice, id: &str, data: &str) {
    post(&client(), &sluice.events_url(), id, data).await;
}

fn ext<'a>(event: &'a Value, name: &str) -> Option<&'a str> {
    event.get(name).and_then(Value::as_str)
}

#[tokio::test]
async fn map_filter_and_fan_out_run_in_chains_with_built_in_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    extra += &function(dir.path(), "map", &Behaviour::map("1"), "");
    extra += &function(dir.path(), "drop", &Behaviour::Prefixes(vec![]), "");
    extra += &function(dir.path(), "fan", &Behaviour::fan_out(3), "");
    // Built-in steps before and after; the step after a fan-out runs on each event.
    extra += &through(
        "mapped",
        r#"[{ form = "SET_ATTRIBUTES", attributes = { before = "yes" } }, { wasm = "map" }, { form = "SET_ATTRIBUTES", attributes = { after = "$.wasmversion" } }]"#,
    );
    extra += &through("dropped", r#"[{ wasm = "drop" }]"#);
    extra += &through("fanned", r#"[{ wasm = "fan" }, { wasm = "map" }]"#);
    let sluice = start(&extra).await;
    for i in 0..5 {
        post_one(&sluice, &format!("e-{i}"), r#"{"n":1}"#).await;
    }
    let out = sluice.data_dir().join("out.jsonl");
    // 5 mapped + 0 dropped + 5 × 3 fanned.
    let got = wait_jsonl(&out, Duration::from_secs(20), |l| l.len() >= 20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got_now = read_jsonl(&out);
    assert_eq!(got_now.len(), 20, "{got_now:#?}");
    let mapped: Vec<&Value> = got
        .iter()
        .filter(|e| ext(e, "before") == Some("yes"))
        .collect();
    assert_eq!(mapped.len(), 5);
    for e in &mapped {
        assert_eq!(ext(e, "wasmversion"), Some("1"), "{e}");
        assert_eq!(
            ext(e, "after"),
            Some("1"),
            "the step after the function ran on its output"
        );
        assert_eq!(e["data"], json!({"n": 1}), "data kept: {e}");
    }
    // Each fanned event: parts 1, 2, 3 in order, each mapped by the second function.
    for i in 0..5 {
        let parts: Vec<&str> = got
            .iter()
            .filter(|e| e["id"] == format!("e-{i}") && e.get("part").is_some())
            .map(|e| {
                assert_eq!(ext(e, "wasmversion"), Some("1"));
                ext(e, "part").unwrap()
            })
            .collect();
        assert_eq!(parts, ["1", "2", "3"], "event e-{i}");
    }
    assert!(read_jsonl(&sluice.data_dir().join("dlq.jsonl")).is_empty());
    let metrics = sluice.metrics().await;
    assert!(
        metrics.contains(r#"sluice_function_calls_total{function="drop",outcome="ok"} 5"#),
        "{metrics}"
    );
}

/// A chain of functions alone reads the stored event as its text: an event every function
/// passes on unchanged is delivered as stored (never decoded), one a function changed goes
/// on as an event, and data stored as text or base64 still reaches the function as the
/// contract says (a JSON payload as JSON).
#[tokio::test]
async fn a_chain_of_functions_alone_passes_an_unchanged_event_on_as_stored() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    extra += &function(
        dir.path(),
        "same",
        &Behaviour::Prefixes(vec!["{".into()]),
        "",
    );
    extra += &function(dir.path(), "map", &Behaviour::map("1"), "");
    extra += &through("kept", r#"[{ wasm = "same" }]"#);
    extra += &through(
        "mapped",
        r#"[{ wasm = "same" }, { wasm = "map" }, { wasm = "same" }]"#,
    );
    let sluice = start(&extra).await;
    // Binary mode: the JSON body is stored as it came (its spaces too).
    post_one(&sluice, "spaced", r#"{"a": [1,  2]}"#).await;
    let base = |id: &str| json!({"specversion": "1.0", "id": id, "source": "/t", "type": "t"});
    let mut b64 = base("b64");
    b64["datacontenttype"] = json!("application/json");
    b64["data_base64"] = json!("eyJhIjoxfQ=="); // {"a":1}
    let mut text = base("text");
    text["datacontenttype"] = json!("text/plain");
    text["data"] = json!("hello");
    let events = vec![b64, text, base("none")];
    sluice_tests::post_batch(&client(), &sluice.events_url(), events).await;
    let out = sluice.data_dir().join("out.jsonl");
    let got = wait_jsonl(&out, Duration::from_secs(20), |l| l.len() >= 8).await;
    assert_eq!(got.len(), 8, "{got:#?}");
    let find = |id: &str, mapped: bool| {
        got.iter()
            .find(|e| e["id"] == id && e.get("wasmversion").is_some() == mapped)
            .unwrap_or_else(|| panic!("{id} (mapped: {mapped}) in {got:#?}"))
    };
    for mapped in [false, true] {
        assert_eq!(find("spaced", mapped)["data"], json!({"a": [1, 2]}));
        assert_eq!(
            find("b64", mapped)["data"],
            json!({"a": 1}),
            "base64 JSON as JSON"
        );
        assert_eq!(find("text", mapped)["data"], json!("hello"));
        assert!(find("none", mapped).get("data").is_none());
    }
    let lines = std::fs::read_to_string(&out).unwrap();
    let spaced: Vec<&str> = lines.lines().filter(|l| l.contains("spaced")).collect();
    assert_eq!(spaced.len(), 2);
    assert!(
        spaced
            .iter()
            .any(|l| l.contains(r#"[1,  2]"#) && !l.contains("wasmversion")),
        "an event passed on unchanged is delivered as stored: {spaced:#?}"
    );
    assert!(read_jsonl(&sluice.data_dir().join("dlq.jsonl")).is_empty());
    let metrics = sluice.metrics().await;
    for line in [
        r#"sluice_function_calls_total{function="same",outcome="ok"} 12"#,
        r#"sluice_function_calls_total{function="map",outcome="ok"} 4"#,
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

/// Replays and redeliveries run a chain's functions as live delivery does: the events a
/// function made are delivered marked with the replay's id, and those it refused go to the
/// dead-letter destination (a redelivery it refuses is a 400 with its reason).
#[tokio::test]
async fn replays_and_redeliveries_run_the_functions_of_the_chain() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    extra += &sluice_tests::bus("archive", 2, "retention = \"1h\"");
    extra += &function(dir.path(), "map", &Behaviour::map("1"), "");
    extra += &function(
        dir.path(),
        "fails",
        &Behaviour::Error("no price".into()),
        "",
    );
    for (rule, transform) in [
        ("mapped", r#"[{ wasm = "map" }]"#),
        ("fails", r#"[{ wasm = "fails" }]"#),
    ] {
        extra += &sluice_tests::rule_on(
            "archive",
            rule,
            "bus",
            &format!("{rule}-out"),
            &format!(
                "bus = \"out\"\ntransform = {transform}\n[rules.targets.dead_letter]\nbus = \"dlq\""
            ),
        );
    }
    let sluice = start(&extra).await;
    let url = sluice.url("/buses/archive/events");
    for i in 0..4 {
        post(&client(), &url, &format!("r-{i}"), r#"{"n":1}"#).await;
    }
    let out = sluice.data_dir().join("out.jsonl");
    let dlq = sluice.data_dir().join("dlq.jsonl");
    wait_jsonl(&out, Duration::from_secs(20), |l| l.len() >= 4).await;
    wait_jsonl(&dlq, Duration::from_secs(20), |l| l.len() >= 4).await;
    let api = sluice_tests::admin::Api::unrecorded(&sluice);
    for (rule, file) in [("mapped", &out), ("fails", &dlq)] {
        let started = api.start_replay("archive", json!({"rule": rule})).await;
        let id = started["id"].as_str().unwrap().to_string();
        let status = api
            .wait_replay_end("archive", &id, Duration::from_secs(20))
            .await;
        assert_eq!(status["state"], "COMPLETED", "{status}");
        assert_eq!(status["matched"], 4, "{status}");
        assert_eq!(status["delivered"], 4, "{status}");
        let got = wait_jsonl(file, Duration::from_secs(20), |l| {
            l.iter()
                .filter(|e| e["sluicereplay"] == id.as_str())
                .count()
                >= 4
        })
        .await;
        for e in got.iter().filter(|e| e["sluicereplay"] == id.as_str()) {
            if rule == "mapped" {
                assert_eq!(ext(e, "wasmversion"), Some("1"), "{e}");
            } else {
                let reason = ext(e, "deadletterreason").unwrap_or_default();
                assert!(reason.contains("no price"), "{e}");
            }
        }
    }
    const REDELIVER: &str = "/api/v1/buses/{bus}/rules/{rule}/redeliver";
    let event =
        json!({"specversion": "1.0", "id": "again", "source": "/t", "type": "t", "data": {"n": 2}});
    let again = api
        .post(
            REDELIVER,
            "/api/v1/buses/archive/rules/mapped/redeliver",
            Some(json!({"event": event})),
        )
        .await;
    assert_eq!(again.status, 202, "{}", again.body);
    let redelivery = again.body["id"].as_str().unwrap().to_string();
    wait_jsonl(&out, Duration::from_secs(20), |l| {
        l.iter().any(|e| {
            e["id"] == "again"
                && e["sluicereplay"] == redelivery.as_str()
                && ext(e, "wasmversion") == Some("1")
        })
    })
    .await;
    let refused = api
        .post(
            REDELIVER,
            "/api/v1/buses/archive/rules/fails/redeliver",
            Some(json!({"event": event})),
        )
        .await;
    assert_eq!(refused.status, 400, "{}", refused.body);
    assert!(
        refused.body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("no price")),
        "{}",
        refused.body
    );
}

#[tokio::test]
async fn failures_are_dead_lettered_with_their_cause_and_the_next_event_still_runs() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    let cases: Vec<(&str, Behaviour, &str, &str)> = vec![
        (
            "fails",
            Behaviour::Error("no price for item 7".into()),
            "",
            "returned an error: no price for item 7",
        ),
        ("traps", Behaviour::Trap, "", "trapped"),
        (
            "loops",
            Behaviour::Loop,
            "timeout = \"100ms\"",
            "time limit of 100ms",
        ),
        (
            "bomb",
            Behaviour::MemoryBomb,
            "max_memory_bytes = 8388608",
            "memory limit of 8388608 bytes",
        ),
        (
            "garbage",
            Behaviour::Constant(vec!["not json".into()]),
            "",
            "not JSON",
        ),
        (
            "nosource",
            Behaviour::Constant(vec![r#"{"specversion":"1.0","id":"x","type":"t"}"#.into()]),
            "",
            "the required attribute `source` is missing",
        ),
        (
            "toomany",
            Behaviour::fan_out(3),
            "max_events = 2",
            "more than its limit of 2 (max_events)",
        ),
    ];
    for (name, behaviour, limits, _) in &cases {
        extra += &function(dir.path(), name, behaviour, limits);
        extra += &through(name, &format!("[{{ wasm = \"{name}\" }}]"));
    }
    let clock = dir.path().join("clock.wasm");
    std::fs::write(&clock, reads_the_clock()).unwrap();
    extra += &format!(
        "\n[[functions]]\nname = \"clock\"\npath = \"{}\"\n",
        clock.display()
    );
    extra += &through("clock", r#"[{ wasm = "clock" }]"#);
    extra += &function(dir.path(), "map", &Behaviour::map("ok"), "");
    extra += &through("healthy", r#"[{ wasm = "map" }]"#);
    let sluice = start(&extra).await;
    post_one(&sluice, "bad-1", r#"{"n":1}"#).await;
    let dlq = sluice.data_dir().join("dlq.jsonl");
    let letters = wait_jsonl(&dlq, Duration::from_secs(30), |l| l.len() > cases.len()).await;
    for (name, _, _, says) in &cases {
        let letter = letters
            .iter()
            .find(|l| ext(l, "deadletterrule") == Some(name))
            .unwrap_or_else(|| panic!("no dead letter from rule {name}: {letters:#?}"));
        let reason = ext(letter, "deadletterreason").unwrap();
        assert!(reason.contains(says), "{name}: {reason}");
        assert!(
            reason.contains("WASM"),
            "{name}: the step is named: {reason}"
        );
        assert_eq!(letter["id"], "bad-1", "the original event is dead-lettered");
        assert_eq!(letter["data"], json!({"n": 1}));
    }
    let clock = letters
        .iter()
        .find(|l| ext(l, "deadletterrule") == Some("clock"))
        .unwrap();
    assert!(
        ext(clock, "deadletterreason")
            .unwrap()
            .contains("wasi:clocks/wall-clock"),
        "an import nothing granted traps: {clock}"
    );
    // The gateway is alive and each function runs again in a fresh instance.
    post_one(&sluice, "good-1", r#"{"n":2}"#).await;
    let out = sluice.data_dir().join("out.jsonl");
    wait_jsonl(&out, Duration::from_secs(10), |l| {
        l.iter()
            .any(|e| e["id"] == "good-1" && ext(e, "wasmversion") == Some("ok"))
    })
    .await;
    wait_jsonl(&dlq, Duration::from_secs(10), |l| {
        l.iter().filter(|e| e["id"] == "good-1").count() == cases.len() + 1
    })
    .await;
    assert!(sluice.is_running());
    let metrics = sluice.metrics().await;
    for (function, outcome) in [
        ("loops", "timeout"),
        ("bomb", "memory"),
        ("traps", "trap"),
        ("fails", "error"),
        ("garbage", "invalid_output"),
        ("map", "ok"),
    ] {
        let line = format!(
            r#"sluice_function_calls_total{{function="{function}",outcome="{outcome}"}} 2"#
        );
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
}

#[tokio::test]
async fn a_function_file_that_is_not_a_component_stops_the_start_with_its_name() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.wasm");
    std::fs::write(&bad, b"not wasm").unwrap();
    let rule = through("r", r#"[{ wasm = "nope" }]"#);
    let (ok, said) = sluice_tests::check_config(&format!(
        "{}{}{}[[functions]]\nname = \"f\"\npath = \"{}\"\n{rule}",
        sluice_tests::bus("default", 1, ""),
        bus_to_file("out"),
        bus_to_file("dlq"),
        bad.display()
    ));
    assert!(!ok);
    assert!(said.contains("function `nope` is not defined"), "{said}");
}

async fn upload(sluice: &Sluice, name: &str, bytes: Vec<u8>, query: &str) -> (u16, Value) {
    let response = client()
        .put(sluice.url(&format!("/api/v1/functions/{name}{query}")))
        .header("content-type", "application/wasm")
        .body(bytes)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    if status >= 400 {
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }
    (status, response.json().await.unwrap_or(Value::Null))
}

fn rule_through(rule: &str, transform: Value) -> Value {
    json!({
        "targets": [{
            "type": "bus", "name": format!("{rule}-out"), "bus": "out",
            "transform": transform,
            "dead_letter": {"bus": "dlq"},
        }]
    })
}

#[tokio::test]
async fn functions_are_uploaded_checked_updated_hot_and_kept_while_used() {
    let sluice = start(&(bus_to_file("out") + &bus_to_file("dlq"))).await;
    // Refusals, each naming what is wrong.
    let (status, body) = upload(&sluice, "map", b"\0asm nope".to_vec(), "").await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "/component", "{body}");
    let (status, body) = upload(&sluice, "map", wrong_signature(), "").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("result<list<string>, string>"),
        "{body}"
    );
    let (status, body) = upload(
        &sluice,
        "map",
        component(&Behaviour::map("1")),
        "?timeout=1h",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "timeout");
    let (status, _) = upload(
        &sluice,
        "map",
        component(&Behaviour::map("1")),
        "?colour=red",
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = upload(&sluice, "map", vec![0; 17 * 1024 * 1024], "").await;
    assert_eq!(status, 413);
    let (status, body) = put(&sluice, "/api/v1/functions/map", json!({"wasm": "x"})).await;
    assert_eq!(status, 415, "{body}");
    // A rule cannot name a function the catalog does not have.
    let (status, body) = put(
        &sluice,
        "/api/v1/buses/default/rules/mapped",
        rule_through("mapped", json!([{"wasm": "map"}])),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body["detail"]
        .as_str()
        .unwrap()
        .contains("function `map` is not defined"));

    // Version 1, used by two rules.
    let v1 = component(&Behaviour::map("1"));
    let (status, body) = upload(&sluice, "map", v1.clone(), "?timeout=200ms").await;
    assert_eq!(status, 201, "{body}");
    let sha1 = body["sha256"].as_str().unwrap().to_string();
    assert_eq!(body["timeout"], "200ms");
    for rule in ["mapped", "also"] {
        let (status, body) = put(
            &sluice,
            &format!("/api/v1/buses/default/rules/{rule}"),
            rule_through(rule, json!([{"wasm": "map"}])),
        )
        .await;
        assert!(status == 201, "{body}");
    }
    let (status, body) = get(&sluice, "/api/v1/functions/map").await;
    assert_eq!(status, 200);
    assert_eq!(body["sha256"], sha1.as_str());
    let bytes = client()
        .get(sluice.url("/api/v1/functions/map/component"))
        .send()
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(bytes.to_vec(), v1);

    // Events flow while version 2 replaces version 1: each event goes through exactly one.
    let poster = {
        let url = sluice.events_url();
        tokio::spawn(async move {
            let client = client();
            for i in 0..300 {
                post(&client, &url, &format!("hot-{i}"), r#"{"n":1}"#).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(400)).await;
    let (status, body) = upload(&sluice, "map", component(&Behaviour::map("2")), "").await;
    assert_eq!(status, 200, "{body}");
    poster.await.unwrap();
    let out = sluice.data_dir().join("out.jsonl");
    let got = wait_jsonl(&out, Duration::from_secs(30), |l| l.len() >= 600).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(read_jsonl(&out).len(), 600, "each event once per rule");
    let versions: Vec<&str> = got.iter().map(|e| ext(e, "wasmversion").unwrap()).collect();
    assert!(versions.iter().all(|v| *v == "1" || *v == "2"));
    assert!(
        versions.contains(&"1") && versions.contains(&"2"),
        "both versions ran"
    );
    let last = got.iter().rev().find(|e| e["id"] == "hot-299").unwrap();
    assert_eq!(ext(last, "wasmversion"), Some("2"));

    // The rule test shows what the function returned.
    let (status, body) = call(
        &sluice,
        Method::POST,
        "/api/v1/rules/test",
        Some(json!({
            "event": {"specversion": "1.0", "id": "t-1", "source": "s", "type": "t", "data": {"n": 1}},
            "transform": [{"wasm": "map"}],
        })),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["outputs"][0]["wasmversion"], "2", "{body}");
    assert_eq!(body["functions"][0]["function"], "map");
    assert_eq!(
        body["functions"][0]["returned"].as_array().unwrap().len(),
        1
    );

    // Not deleted while rules use it.
    let (status, body) = call(&sluice, Method::DELETE, "/api/v1/functions/map", None).await;
    assert_eq!(status, 409, "{body}");
    assert!(body["detail"].as_str().unwrap().contains("rule `mapped`"));
    for rule in ["mapped", "also"] {
        let (status, _) = call(
            &sluice,
            Method::DELETE,
            &format!("/api/v1/buses/default/rules/{rule}"),
            None,
        )
        .await;
        assert_eq!(status, 204);
    }
    let (status, _) = call(&sluice, Method::DELETE, "/api/v1/functions/map", None).await;
    assert_eq!(status, 204);
    let (status, _) = get(&sluice, "/api/v1/functions/map").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn replicas_load_a_function_created_through_the_api() {
    let prefix = "functions-replicas";
    let (url, prefix) = sluice_tests::shared_redis(prefix);
    let start = || {
        Sluice::builder()
            .durability("os")
            .without_default_rule()
            .distributed(&url, &prefix)
            .extra(&(bus_to_file("out") + &bus_to_file("dlq")))
            .start()
    };
    let a = start().await;
    let b = start().await;
    a.wait_members(2).await;
    let (status, body) = upload(&a, "fan", component(&Behaviour::fan_out(2)), "").await;
    assert_eq!(status, 201, "{body}");
    let sha = body["sha256"].as_str().unwrap().to_string();
    let (status, body) = put(
        &a,
        "/api/v1/buses/default/rules/fanned",
        rule_through("fanned", json!([{"wasm": "fan"}])),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    // The other replica loads it without a restart.
    let mut loaded = false;
    for _ in 0..200 {
        let (_, body) = get(&b, "/api/v1/functions/fan").await;
        if body["loaded"]["running"] == sha.as_str() {
            loaded = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(loaded, "replica b runs the function");
    for i in 0..20 {
        let to = if i % 2 == 0 { &a } else { &b };
        post_one(to, &format!("r-{i}"), r#"{"n":1}"#).await;
    }
    let all = || {
        let mut events = read_jsonl(&a.data_dir().join("out.jsonl"));
        events.extend(read_jsonl(&b.data_dir().join("out.jsonl")));
        events
    };
    let events = sluice_tests::wait_list(
        Duration::from_secs(30),
        Duration::from_millis(50),
        all,
        |l| l.len() >= 40,
        "fanned events on either replica",
    )
    .await;
    for i in 0..20 {
        let parts: Vec<&str> = events
            .iter()
            .filter(|e| e["id"] == format!("r-{i}"))
            .map(|e| ext(e, "part").unwrap())
            .collect();
        assert_eq!(parts, ["1", "2"], "event r-{i}");
    }
}

#[tokio::test]
async fn ctl_apply_uploads_the_functions_a_file_names_by_path() {
    let sluice = start(&(bus_to_file("out") + &bus_to_file("dlq"))).await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("m.wasm"), component(&Behaviour::map("ctl"))).unwrap();
    let file = dir.path().join("apply.yaml");
    std::fs::write(
        &file,
        r#"functions:
  - name: m
    path: ./m.wasm
    timeout: 120ms
    max_events: 5
    isolation: event
    grants: [clocks]
    env: { REGION: "eu west & more" }
rules:
  - name: mapped
    bus: default
    targets:
      - type: bus
        name: mapped-out
        bus: out
        transform: [{ wasm: m }]
"#,
    )
    .unwrap();
    let file = file.to_str().unwrap();
    // A dry run uploads nothing and says so.
    let said = sluice_tests::admin::ctl_ok(&sluice, &["apply", "-f", file, "--dry-run"]);
    assert!(said.contains("function/m"), "{said}");
    let (status, _) = get(&sluice, "/api/v1/functions/m").await;
    assert_eq!(status, 404, "a dry run changes nothing");
    let said = sluice_tests::admin::ctl_ok(&sluice, &["apply", "-f", file]);
    assert!(said.contains("rule/default/mapped created"), "{said}");
    let (status, body) = get(&sluice, "/api/v1/functions/m").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["timeout"], "120ms");
    assert_eq!(body["max_events"], 5);
    assert_eq!(body["isolation"], "event");
    assert_eq!(body["grants"], json!(["clocks"]));
    assert_eq!(body["env"], json!({"REGION": "eu west & more"}));
    assert_eq!(
        body["sha256"].as_str().unwrap(),
        sluice::wasm::sha256_hex(&component(&Behaviour::map("ctl")))
    );
    post_one(&sluice, "c-1", r#"{"n":1}"#).await;
    wait_jsonl(
        &sluice.data_dir().join("out.jsonl"),
        Duration::from_secs(20),
        |l| l.iter().any(|e| ext(e, "wasmversion") == Some("ctl")),
    )
    .await;
    // The same file again changes nothing; `ctl get`/`delete` know the kind.
    let said = sluice_tests::admin::ctl_ok(&sluice, &["apply", "-f", file]);
    assert!(said.contains("function/m unchanged"), "{said}");
    let listed = sluice_tests::admin::ctl_ok(&sluice, &["get", "functions"]);
    assert!(listed.contains("\"m\""), "{listed}");
    let refused = sluice_tests::admin::ctl_err(&sluice, &["delete", "function", "m"]);
    assert!(refused.contains("409"), "{refused}");
}

#[tokio::test]
async fn a_slow_function_holds_up_neither_the_reader_nor_other_rules() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    extra += &function(dir.path(), "slow", &Behaviour::Loop, "timeout = \"2s\"");
    extra += &through("slow", r#"[{ wasm = "slow" }]"#);
    let sluice = Sluice::builder()
        .durability("os")
        .extra(&extra)
        .start()
        .await;
    let started = std::time::Instant::now();
    for i in 0..10 {
        post_one(&sluice, &format!("s-{i}"), r#"{"n":1}"#).await;
    }
    // The sample rule (no function) delivers every event while the slow one still runs.
    sluice
        .wait_delivered(Duration::from_secs(10), |l| l.len() == 10)
        .await;
    let took = started.elapsed();
    let dead = read_jsonl(&sluice.data_dir().join("dlq.jsonl")).len();
    assert!(
        dead < 10,
        "the other rule was not waiting for the slow function ({dead} dead letters after {took:?})"
    );
    assert!(took < Duration::from_secs(8), "{took:?}");
}

#[tokio::test]
async fn an_instance_serves_a_batch_unless_the_function_asks_for_one_per_event() {
    let dir = tempfile::tempdir().unwrap();
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    extra += &function(dir.path(), "kept", &Behaviour::Remembers, "");
    extra += &function(
        dir.path(),
        "fresh",
        &Behaviour::Remembers,
        "isolation = \"event\"",
    );
    for name in ["kept", "fresh"] {
        extra += &through(
            name,
            &format!(
                r#"[{{ wasm = "{name}" }}, {{ form = "SET_ATTRIBUTES", attributes = {{ by = "{name}" }} }}]"#
            ),
        );
    }
    let sluice = start(&extra).await;
    let posted = post_batches(&sluice.events_url(), 60, 1, 30, |i| {
        json!({"specversion": "1.0", "id": format!("b-{i}"), "source": "t", "type": "t", "data": {"i": i}})
    })
    .await;
    assert_eq!(posted, 60);
    let out = sluice.data_dir().join("out.jsonl");
    let got = wait_jsonl(&out, Duration::from_secs(30), |l| l.len() >= 120).await;
    let firsts = |by: &str| -> Vec<&str> {
        got.iter()
            .filter(|e| ext(e, "by") == Some(by))
            .filter_map(|e| ext(e, "first"))
            .collect()
    };
    let (kept, fresh) = (firsts("kept"), firsts("fresh"));
    assert_eq!((kept.len(), fresh.len()), (60, 60), "{got:#?}");
    assert!(
        fresh.iter().all(|f| *f == "yes"),
        "`isolation = \"event\"`: every event has a fresh instance: {fresh:?}"
    );
    assert!(
        kept.iter().filter(|f| **f == "no").count() > 0,
        "by default an instance serves the events of a batch: {kept:?}"
    );
    assert!(read_jsonl(&sluice.data_dir().join("dlq.jsonl")).is_empty());
}

#[tokio::test]
async fn grants_open_the_clock_randomness_and_environment_and_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let event =
        |id: &str| format!(r#"{{"specversion":"1.0","id":"{id}","source":"t","type":"granted"}}"#);
    let mut extra = bus_to_file("out") + &bus_to_file("dlq");
    let cases = [
        ("clock", HostUse::Clock, "grants = [\"clocks\"]"),
        ("random", HostUse::Random, "grants = [\"random\"]"),
        ("env", HostUse::Env, ""),
    ];
    for (name, what, grant) in cases {
        for granted in [true, false] {
            let fname = format!("{name}-{}", if granted { "granted" } else { "denied" });
            let path = dir.path().join(format!("{fname}.wasm"));
            std::fs::write(&path, uses_host(what, &event(&fname))).unwrap();
            let settings = match (what, granted) {
                (HostUse::Env, true) => format!("env = {{ EVENT = '{}' }}", event(&fname)),
                (_, true) => grant.to_string(),
                // Another grant than the one it needs: still denied.
                (HostUse::Clock, false) => "grants = [\"random\"]".into(),
                (_, false) => "grants = [\"clocks\"]".into(),
            };
            extra += &format!(
                "\n[[functions]]\nname = \"{fname}\"\npath = \"{}\"\n{settings}\n",
                path.display()
            );
            extra += &through(&fname, &format!(r#"[{{ wasm = "{fname}" }}]"#));
        }
    }
    let sluice = start(&extra).await;
    post_one(&sluice, "g-1", r#"{"n":1}"#).await;
    let out = sluice.data_dir().join("out.jsonl");
    let dlq = sluice.data_dir().join("dlq.jsonl");
    let got = wait_jsonl(&out, Duration::from_secs(30), |l| l.len() >= 3).await;
    let letters = wait_jsonl(&dlq, Duration::from_secs(30), |l| l.len() >= 3).await;
    for (name, _, _) in cases {
        let granted = format!("{name}-granted");
        assert!(
            got.iter().any(|e| e["id"] == granted.as_str()),
            "{granted} delivers: {got:#?}"
        );
        let denied = format!("{name}-denied");
        let letter = letters
            .iter()
            .find(|l| ext(l, "deadletterrule") == Some(denied.as_str()))
            .unwrap_or_else(|| panic!("{denied} is dead-lettered: {letters:#?}"));
        let reason = ext(letter, "deadletterreason").unwrap();
        assert!(reason.contains("unknown import"), "{denied}: {reason}");
        assert!(reason.contains("not granted"), "{denied}: {reason}");
        assert!(reason.contains("not granted"), "{denied}: {reason}");
    }
    assert_eq!(got.len(), 3, "{got:#?}");

    // Through the API: the grants and environment are query parameters, checked.
    let bytes = uses_host(HostUse::Env, &event("api"));
    let (status, body) = upload(
        &sluice,
        "api-env",
        bytes.clone(),
        "?grant=clocks,random&env=A=1&env=B=x%3Dy&isolation=event",
    )
    .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["grants"], json!(["clocks", "random"]));
    assert_eq!(body["env"], json!({"A": "1", "B": "x=y"}));
    assert_eq!(body["isolation"], "event");
    let (status, body) = upload(&sluice, "api-net", bytes.clone(), "?grant=network").await;
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["field"], "grant", "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("never granted"),
        "{body}"
    );
    let (status, body) = upload(&sluice, "api-env2", bytes, "?env=NOEQUALS").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["detail"].as_str().unwrap().contains("NAME=value"),
        "{body}"
    );
}
