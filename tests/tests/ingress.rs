//! HTTP ingress end to end: each CloudEvents mode, each error, the limits, probes and
//! graceful shutdown, against the real binary.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use reqwest::StatusCode;
use serde_json::{json, Value};
use sluice_tests::receiver::Receiver;
use sluice_tests::{binary, binary_raw, ids, post, structured_event, Sluice};
use tokio::io::AsyncWriteExt;

const WAIT: Duration = Duration::from_secs(20);

async fn problem(response: reqwest::Response, status: StatusCode) -> Value {
    assert_eq!(response.status(), status);
    assert_eq!(
        response.headers()["content-type"],
        "application/problem+json",
        "errors are problem+json"
    );
    response.json().await.unwrap()
}

#[tokio::test]
async fn binary_mode_event_is_accepted_and_delivered() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let r = binary(&client, &sluice.events_url(), "b-1", r#"{"order":42}"#)
        .header("ce-subject", "caf%C3%A9")
        .header("ce-partitionkey", "customer-7")
        .header(
            "ce-traceparent",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let body: Value = r.json().await.unwrap();
    assert_eq!(
        body,
        json!({"failedEntryCount": 0, "entries": [{"id": "b-1", "status": "accepted"}]})
    );
    let events = sluice.wait_delivered(WAIT, |e| !e.is_empty()).await;
    let e = &events[0];
    assert_eq!(e["id"], "b-1");
    assert_eq!(e["specversion"], "1.0");
    assert_eq!(e["subject"], "café");
    assert_eq!(e["data"], json!({"order": 42}));
    assert_eq!(e["partitionkey"], "customer-7", "extensions are kept");
    assert!(e["traceparent"].as_str().unwrap().starts_with("00-"));
    assert!(e.get("time").is_none(), "no attribute is invented");
}

#[tokio::test]
async fn structured_mode_event_is_accepted_and_delivered() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let mut event = structured_event("s-1");
    event["time"] = json!("2026-12-03T10:00:00Z");
    event["count"] = json!(3);
    event["urgent"] = json!(true);
    let r = client
        .post(sluice.events_url())
        .header(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )
        .body(event.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let events = sluice.wait_delivered(WAIT, |e| !e.is_empty()).await;
    assert_eq!(events[0]["id"], "s-1");
    assert_eq!(events[0]["count"], 3);
    assert_eq!(events[0]["urgent"], true);
    assert_eq!(events[0]["data"], json!({"n": "s-1"}));
}

#[tokio::test]
async fn batch_mode_stores_good_entries_and_reports_bad_ones() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let mut bad_time = structured_event("bad-time");
    bad_time["time"] = json!("yesterday");
    let mut no_type = structured_event("no-type");
    no_type.as_object_mut().unwrap().remove("type");
    let batch = json!([
        structured_event("ok-1"),
        bad_time,
        structured_event("ok-2"),
        no_type,
        17
    ]);
    let r = sluice_tests::send_batch(&client, &sluice.events_url(), batch.to_string()).await;
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["failedEntryCount"], 3);
    let entries = body["entries"].as_array().unwrap();
    assert_eq!(entries[0]["status"], "accepted");
    assert_eq!(entries[1]["status"], "failed");
    assert_eq!(entries[1]["error"]["field"], "time");
    assert_eq!(entries[1]["index"], 1);
    assert_eq!(entries[2]["status"], "accepted");
    assert_eq!(entries[3]["error"]["field"], "type");
    assert_eq!(entries[4]["error"]["field"], "entry");
    let events = sluice.wait_delivered(WAIT, |e| e.len() >= 2).await;
    let mut got = ids(&events);
    got.sort();
    assert_eq!(got, vec!["ok-1", "ok-2"]);

    // A batch where nothing is valid is refused as a whole, with the per-entry reasons.
    let r = sluice_tests::send_batch(
        &client,
        &sluice.events_url(),
        json!([{"specversion": "1.0"}]).to_string(),
    )
    .await;
    let p = problem(r, StatusCode::BAD_REQUEST).await;
    assert_eq!(p["failedEntryCount"], 1);
    assert_eq!(p["entries"][0]["error"]["field"], "id");
}

#[tokio::test]
async fn invalid_events_get_400_naming_the_attribute() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();
    let cases: Vec<(reqwest::RequestBuilder, &str)> = vec![
        (binary(&client, &url, "x", "{}").header("ce-time", "not-a-time"), "ce-time"),
        (binary(&client, &url, "x", "{}").header("ce-specversion", "0.3"), "ce-specversion"),
        (binary(&client, &url, "x", "{broken json"), "data"),
        (
            client
                .post(&url)
                .header("ce-specversion", "1.0")
                .header("ce-id", "x")
                .header("ce-type", "t"),
            "ce-source",
        ),
        (client.post(&url).header("ce-id", "x"), "ce-specversion"),
        (
            client
                .post(&url)
                .header("content-type", "application/cloudevents+json")
                .body(r#"{"specversion":"1.0","id":"x","source":"s","type":"t","Bad_Name":1}"#),
            "Bad_Name",
        ),
        (
            client
                .post(&url)
                .header("content-type", "application/cloudevents+json")
                .body(r#"{"specversion":"1.0","id":"x","source":"s","type":"t","dataschema":"relative/path"}"#),
            "dataschema",
        ),
        (
            client
                .post(&url)
                .header("content-type", "application/cloudevents+json")
                .body(r#"{"specversion":"1.0","id":"x","source":"s","#),
            "body",
        ),
    ];
    for (request, field) in cases {
        let p = problem(request.send().await.unwrap(), StatusCode::BAD_REQUEST).await;
        assert_eq!(p["field"], field, "{p}");
        assert_eq!(p["status"], 400);
        assert!(p["detail"].as_str().unwrap().len() > 5);
    }
    // Nothing of the above was stored.
    binary(&client, &url, "good", "{}").send().await.unwrap();
    let events = sluice.wait_delivered(WAIT, |e| !e.is_empty()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ids(&sluice.delivered()), vec!["good"], "{events:?}");
}

#[tokio::test]
async fn routing_errors_are_problem_json() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let r = binary(&client, &sluice.url("/buses/nope/events"), "x", "{}")
        .send()
        .await
        .unwrap();
    let p = problem(r, StatusCode::NOT_FOUND).await;
    assert_eq!(p["field"], "bus");
    let r = client.get(sluice.events_url()).send().await.unwrap();
    assert_eq!(r.headers()["allow"], "POST, OPTIONS");
    problem(r, StatusCode::METHOD_NOT_ALLOWED).await;
    let r = client.delete(sluice.url("/healthz")).send().await.unwrap();
    problem(r, StatusCode::METHOD_NOT_ALLOWED).await;
    let r = client
        .get(sluice.url("/nothing/here"))
        .send()
        .await
        .unwrap();
    problem(r, StatusCode::NOT_FOUND).await;
    for content_type in [
        "application/json",
        "application/cloudevents+avro",
        "text/plain",
    ] {
        let r = client
            .post(sluice.events_url())
            .header("content-type", content_type)
            .body("{}")
            .send()
            .await
            .unwrap();
        let p = problem(r, StatusCode::UNSUPPORTED_MEDIA_TYPE).await;
        assert_eq!(p["field"], "content-type");
    }
}

#[tokio::test]
async fn limits_are_enforced_with_413() {
    let sluice = Sluice::builder()
        .limits("max_event_bytes = 2048\nmax_batch_events = 3\nmax_batch_bytes = 8192")
        .start()
        .await;
    let client = reqwest::Client::new();
    let big = format!("\"{}\"", "x".repeat(4000));
    let r = binary(&client, &sluice.events_url(), "big", &big)
        .send()
        .await
        .unwrap();
    let p = problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(p["field"], "limits.max_event_bytes");

    // The body fits but the stored event (attributes + data) does not.
    let near = format!("\"{}\"", "x".repeat(1990));
    let r = binary(&client, &sluice.events_url(), "near", &near)
        .header("ce-padding", "p".repeat(200))
        .send()
        .await
        .unwrap();
    let p = problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(p["field"], "limits.max_event_bytes");

    let four: Vec<Value> = (0..4).map(|i| structured_event(&format!("e{i}"))).collect();
    let r = sluice_tests::send_batch(
        &client,
        &sluice.events_url(),
        Value::Array(four).to_string(),
    )
    .await;
    let p = problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(p["field"], "limits.max_batch_events");

    let mut huge = structured_event("huge");
    huge["data"] = json!("y".repeat(9000));
    let r =
        sluice_tests::send_batch(&client, &sluice.events_url(), json!([huge]).to_string()).await;
    let p = problem(r, StatusCode::PAYLOAD_TOO_LARGE).await;
    assert_eq!(p["field"], "limits.max_batch_bytes");

    // One entry over the per-event limit fails alone; the rest of the batch is stored.
    let mut fat = structured_event("fat");
    fat["data"] = json!("z".repeat(3000));
    let r = sluice_tests::send_batch(
        &client,
        &sluice.events_url(),
        json!([structured_event("thin"), fat]).to_string(),
    )
    .await;
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["entries"][1]["error"]["status"], 413);
    assert_eq!(
        body["entries"][1]["error"]["field"],
        "limits.max_event_bytes"
    );
    let events = sluice.wait_delivered(WAIT, |e| !e.is_empty()).await;
    assert_eq!(ids(&events), vec!["thin"]);
}

#[test]
fn oversized_headers_are_refused_with_431() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sluice = rt.block_on(Sluice::builder().limits("max_header_bytes = 8192").start());
    let mut stream = TcpStream::connect(sluice.addr()).unwrap();
    let request = format!(
        "POST /buses/default/events HTTP/1.1\r\nhost: x\r\nce-big: {}\r\ncontent-length: 0\r\n\r\n",
        "a".repeat(20_000)
    );
    let _ = stream.write_all(request.as_bytes());
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    assert!(response.starts_with("HTTP/1.1 431"), "{response}");
}

#[test]
fn slow_requests_time_out_and_idle_connections_close() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let sluice = rt.block_on(
        Sluice::builder()
            .limits("request_timeout = \"300ms\"\nidle_timeout = \"300ms\"")
            .start(),
    );
    // A body that never finishes: 408 after the request timeout, nothing stored.
    let mut stream = TcpStream::connect(sluice.addr()).unwrap();
    stream
        .write_all(
            b"POST /buses/default/events HTTP/1.1\r\nhost: x\r\nce-specversion: 1.0\r\nce-id: slow\r\nce-source: /s\r\nce-type: t\r\ncontent-length: 100\r\n\r\n{\"a\":",
        )
        .unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 4096];
    let n = stream.read(&mut buf).unwrap();
    let response = String::from_utf8_lossy(&buf[..n]);
    assert!(response.starts_with("HTTP/1.1 408"), "{response}");
    assert!(response.contains("limits.request_timeout"), "{response}");

    // An idle kept-alive connection is closed by the server.
    let mut idle = TcpStream::connect(sluice.addr()).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let n = idle.read(&mut buf).unwrap_or(0);
    assert_eq!(
        n, 0,
        "server closes the idle connection (within the 10 s read timeout)"
    );
    // Nothing of the timed-out request was stored: an event accepted after it is the only
    // one delivered.
    let client = reqwest::Client::new();
    let r = rt
        .block_on(binary(&client, &sluice.events_url(), "marker", "{}").send())
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let delivered = rt.block_on(sluice.wait_delivered(WAIT, |e| !e.is_empty()));
    assert_eq!(ids(&delivered), vec!["marker"]);
}

#[tokio::test]
async fn a_body_cut_off_midway_stores_nothing() {
    let sluice = Sluice::start().await;
    {
        let mut stream = TcpStream::connect(sluice.addr()).unwrap();
        stream
            .write_all(
                b"POST /buses/default/events HTTP/1.1\r\nhost: x\r\ncontent-type: application/cloudevents-batch+json\r\ncontent-length: 400\r\n\r\n[{\"specversion\":\"1.0\",\"id\":\"cut\",\"source\":\"s\",\"type\":\"t\"},",
            )
            .unwrap();
        // Dropped here: the connection closes with the body incomplete.
    }
    let client = reqwest::Client::new();
    let r = binary(&client, &sluice.events_url(), "after", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    sluice.wait_delivered(WAIT, |e| !e.is_empty()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ids(&sluice.delivered()), vec!["after"]);
}

#[tokio::test]
async fn overload_is_shed_with_503_and_retry_after() {
    let sluice = Sluice::builder()
        .shards(1)
        .limits("max_concurrent_requests = 2")
        .start()
        .await;
    let client = reqwest::Client::new();

    // Two requests whose bodies have not arrived hold both slots: a third is shed.
    let head = |id: &str| {
        format!(
            "POST /buses/default/events HTTP/1.1\r\nhost: x\r\nce-specversion: 1.0\r\nce-id: {id}\r\nce-source: /tests\r\nce-type: t\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{"
        )
    };
    let hold = |id: &str| {
        let mut s = TcpStream::connect(sluice.addr()).unwrap();
        s.write_all(head(id).as_bytes()).unwrap();
        s.set_nonblocking(true).unwrap();
        s
    };
    // Whether a held request was answered already (shed, when a probe held a slot as it
    // arrived): then it holds nothing and is sent again.
    let answered = |s: &mut TcpStream| {
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(n) => {
                assert!(
                    n == 0 || String::from_utf8_lossy(&buf[..n]).contains(" 503 "),
                    "a held request was answered: {}",
                    String::from_utf8_lossy(&buf[..n])
                );
                true
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) => panic!("{e}"),
        }
    };
    let mut held: Vec<(String, TcpStream)> = ["held-1", "held-2"]
        .iter()
        .map(|id| (id.to_string(), hold(id)))
        .collect();
    let mut resent = 0;
    // The held requests reach the handler at their own pace: probe until one is refused
    // while both are still waiting for their bodies.
    let deadline = std::time::Instant::now() + WAIT;
    let mut refused = 0;
    let mut accepted = Vec::new();
    for n in 0.. {
        let id = format!("probe-{n}");
        let r = binary(&client, &sluice.events_url(), &id, "{}")
            .send()
            .await
            .unwrap();
        let status = r.status();
        match status {
            StatusCode::SERVICE_UNAVAILABLE => {
                assert!(r.headers().contains_key("retry-after"));
                let body = problem(r, StatusCode::SERVICE_UNAVAILABLE).await;
                assert_eq!(body["status"], 503, "{body}");
            }
            StatusCode::ACCEPTED => accepted.push(id),
            other => panic!("unexpected {other}"),
        }
        let mut all_held = true;
        for (id, s) in &mut held {
            if answered(s) {
                resent += 1;
                *id = format!("held-again-{resent}");
                *s = hold(id);
                all_held = false;
            }
        }
        if status == StatusCode::SERVICE_UNAVAILABLE && all_held {
            refused += 1;
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "with both slots held, {n} requests were still accepted"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The held requests finish and are accepted; the slots are free again.
    for (id, s) in &mut held {
        s.set_nonblocking(false).unwrap();
        s.write_all(b"}").unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 202"), "{answer}");
        accepted.push(id.clone());
    }
    let r = binary(&client, &sluice.events_url(), "after", "{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    accepted.push("after".to_string());

    // A burst: some are shed, every 202 is stored and delivered, every refusal is a clean
    // 503 (nothing queued without bound).
    let mut tasks = Vec::new();
    for i in 0..200 {
        let request = binary(&client, &sluice.events_url(), &format!("q-{i}"), "{}");
        tasks.push(tokio::spawn(async move { request.send().await.unwrap() }));
    }
    for (i, task) in tasks.into_iter().enumerate() {
        let r = task.await.unwrap();
        match r.status() {
            StatusCode::ACCEPTED => accepted.push(format!("q-{i}")),
            StatusCode::SERVICE_UNAVAILABLE => {
                assert!(r.headers().contains_key("retry-after"));
                refused += 1;
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert!(refused >= 1);
    let events = sluice
        .wait_delivered(WAIT, |e| e.len() >= accepted.len())
        .await;
    let mut got = ids(&events);
    got.sort();
    accepted.sort();
    assert_eq!(got, accepted, "refused: {refused}");
}

#[tokio::test]
async fn probes_and_graceful_shutdown() {
    let mut sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    let r = client.get(sluice.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = client.get(sluice.url("/readyz")).send().await.unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    for i in 0..50 {
        let r = binary(&client, &sluice.events_url(), &format!("g-{i}"), "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED);
    }
    let status = sluice.terminate();
    assert!(
        status.success(),
        "exit 0 after SIGTERM: {status}\n{}",
        sluice.log()
    );
    assert!(sluice.log().contains("shutdown complete"));
    // Positions were committed at shutdown: after a restart every event is delivered
    // exactly once (nothing lost, nothing sent again).
    sluice.restart().await;
    // An event accepted after the restart comes after anything its shard re-sends from
    // before it: once one such marker per shard is there, nothing more can come.
    let mut markers: Vec<String> = Vec::new();
    for n in 0.. {
        let id = format!("after-restart-{n}");
        let shard = sluice::event::shard_of(&id, 4);
        if markers
            .iter()
            .all(|m| sluice::event::shard_of(m, 4) != shard)
        {
            markers.push(id);
        }
        if markers.len() == 4 {
            break;
        }
    }
    for id in &markers {
        let r = binary(&client, &sluice.events_url(), id, "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), StatusCode::ACCEPTED);
    }
    let events = sluice
        .wait_delivered(WAIT, |e| {
            let got = ids(e);
            markers.iter().all(|m| got.contains(m))
        })
        .await;
    let mut got: Vec<String> = ids(&events)
        .into_iter()
        .filter(|id| !markers.contains(id))
        .collect();
    assert_eq!(got.len(), 50, "{events:?}");
    got.sort();
    got.dedup();
    assert_eq!(got.len(), 50);
}

/// A JSON document nested `depth` arrays deep.
fn nested(depth: usize) -> Vec<u8> {
    let mut body = "[".repeat(depth);
    body.push_str(&"]".repeat(depth));
    body.into_bytes()
}

/// Whatever a producer sends is refused with a 4xx or can be delivered.
#[tokio::test]
async fn hostile_events_are_refused_and_never_stall_the_shard() {
    let receiver = Receiver::start().await;
    // One shard and no dead-letter destination: an accepted event that cannot be delivered
    // would hold back every event after it.
    let sluice = Sluice::builder()
        .http_target("hook", &receiver.url("/hook"), "timeout = \"2s\"")
        .shards(1)
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();
    let json = "application/json";
    let hostile: Vec<(&str, reqwest::RequestBuilder, &str)> = vec![
        (
            "lone surrogate",
            binary_raw(&client, &url, &[("ce-id", "h-1")], json, br#""\ud800""#.to_vec()),
            "data",
        ),
        (
            "invalid UTF-8 in a JSON string",
            binary_raw(&client, &url, &[("ce-id", "h-2")], json, b"\"\xff\xfe\"".to_vec()),
            "data",
        ),
        (
            "nesting past the decoder's limit",
            binary_raw(&client, &url, &[("ce-id", "h-3")], json, nested(128)),
            "data",
        ),
        (
            "a number out of range",
            binary_raw(&client, &url, &[("ce-id", "h-4")], json, b"1e400".to_vec()),
            "data",
        ),
        (
            "a newline in the id",
            binary_raw(&client, &url, &[("ce-id", "h%0A5")], json, b"{}".to_vec()),
            "ce-id",
        ),
        (
            "text data that is an object",
            client
                .post(&url)
                .header("content-type", "application/cloudevents+json")
                .body(
                    r#"{"specversion":"1.0","id":"h-6","source":"/t","type":"t","datacontenttype":"text/plain","data":{"a":1}}"#,
                ),
            "data",
        ),
    ];
    let mut answers = Vec::new();
    for (what, request, field) in hostile {
        let r = request.send().await.unwrap();
        let status = r.status().as_u16();
        let content_type = r
            .headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string());
        let body: Value = r.json().await.unwrap_or(Value::Null);
        answers.push((what, status, content_type, body, field));
    }
    // An id that needs percent-encoding in a header is fine: it is encoded at delivery.
    // (Binary mode: the producer percent-encodes it; delivery encodes it the same way.)
    post(&client, &url, "caf%C3%A9%20%22quoted%22%20100%25", "{}").await;
    post(&client, &url, "good-after", r#"{"n":1}"#).await;
    let got = receiver
        .wait_for(Duration::from_secs(15), |r| {
            r.iter().any(|r| r.header("ce-id") == Some("good-after"))
        })
        .await;
    assert_eq!(
        got.iter()
            .filter_map(|r| r.header("ce-id"))
            .collect::<Vec<_>>(),
        vec!["caf%C3%A9%20%22quoted%22%20100%25", "good-after"],
        "only the two good events reach the target, in order"
    );
    for (what, status, content_type, body, field) in answers {
        assert_eq!(status, 400, "{what}: {body}");
        assert_eq!(
            content_type.as_deref(),
            Some("application/problem+json"),
            "{what}"
        );
        assert_eq!(body["field"], field, "{what}: {body}");
    }
}

/// Opens a request that holds a concurrency slot: the head and part of the body, then
/// nothing (the rest would come later).
async fn slow_request(sluice: &Sluice) -> tokio::net::TcpStream {
    let mut stream = tokio::net::TcpStream::connect(sluice.addr()).await.unwrap();
    let head = "POST /buses/default/events HTTP/1.1\r\nhost: x\r\nce-specversion: 1.0\r\nce-id: slow\r\nce-source: /t\r\nce-type: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{";
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// Probes (and the admin API) bypass the load shedder.
#[tokio::test]
async fn probes_answer_while_the_request_limit_is_saturated() {
    let sluice = Sluice::builder()
        .limits("max_concurrent_requests = 2\nrequest_timeout = \"60s\"")
        .start()
        .await;
    // Each must hold a slot: one that was itself shed (answered at once, as can happen on a
    // loaded machine when the two race) is opened again.
    let mut slow = Vec::new();
    for _ in 0..20 {
        if slow.len() == 2 {
            break;
        }
        let stream = slow_request(&sluice).await;
        let mut first = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(300), stream.peek(&mut first)).await {
            Err(_) => slow.push(stream),
            Ok(_) => continue,
        }
    }
    assert_eq!(slow.len(), 2, "two requests hold the two slots");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    // Saturated once a new event is shed.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = sluice_tests::binary(&client, &sluice.events_url(), "shed", "{}")
            .send()
            .await
            .unwrap();
        if r.status().as_u16() == 503 {
            break;
        }
        assert!(Instant::now() < deadline, "never saturated: {}", r.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The limit is one for the whole API, not one per route.
    let r = client
        .post(sluice.url("/webhooks/nope"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503, "other routes are shed too");
    // The admin API is not behind the ingress limit: operators can act on an overloaded
    // gateway.
    let r = client
        .get(sluice.url("/api/v1/cluster"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "the admin API under load");
    for probe in ["/healthz", "/readyz"] {
        let r = client.get(sluice.url(probe)).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{probe} under load");
    }
}
