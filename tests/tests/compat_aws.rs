//! AWS EventBridge `PutEvents` through the binary, with the AWS SDKs no one on the project
//! wrote: boto3's `events.put_events` (tests/scripts/aws_put_events.py) and the JavaScript
//! SDK's `PutEventsCommand` (tests/scripts/aws_put_events.mjs), pointed at the gateway with
//! their endpoint setting, plus raw requests for hostile input.
//!
//! Shapes checked against the published API (Amazon EventBridge API Reference, "PutEvents",
//! docs.aws.amazon.com/eventbridge/latest/APIReference/API_PutEvents.html, and the user
//! guide's "Sending events with PutEvents", eb-putevents.html):
//!
//! ```text
//! POST / HTTP/1.1
//! X-Amz-Target: AWSEvents.PutEvents
//! Content-Type: application/x-amz-json-1.1
//! Authorization: AWS4-HMAC-SHA256 Credential=<Credential>, SignedHeaders=..., Signature=<Signature>
//!
//! {"Entries": [{"Source": "com.mycompany.myapp",
//!               "Detail": "{ \"key1\": \"value1\", \"key2\": \"value2\" }",
//!               "Resources": ["resource1", "resource2"], "DetailType": "myDetailType"}]}
//!
//! HTTP/1.1 200 OK
//! x-amzn-RequestId: <RequestId>
//! Content-Type: application/x-amz-json-1.1
//!
//! {"FailedEntryCount": 0, "Entries": [{"EventId": "11710aed-b79e-4468-a20b-bb3c0c3b4860"}]}
//! ```
//!
//! A failed entry is `{"ErrorCode": "...", "ErrorMessage": "..."}` in its place in
//! `Entries` (the user guide's failure example), and a whole-request error is the JSON 1.1
//! protocol's `{"__type": "ValidationException", "message": "..."}` with the
//! `X-Amzn-ErrorType` header, which both SDKs turn into the error code they raise.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::receiver::Receiver;
use sluice_tests::{bus_to_file_with, repo_root, run_python, wait_file, Sluice};

const KEY_ID: &str = "AKIASLUICETEST000001";
const SECRET: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
const SECRET_VAR: &str = "SLUICE_SECRET_AWS_TEST";

/// A gateway with bus `orders` (SigV4 keys, account and region; events to
/// `orders.jsonl`), bus `keyed` (API keys only) and the sample bus `default` (no keys).
async fn gateway(extra: &str) -> Sluice {
    let aws = format!(
        "aws = {{ access_keys = [{{ id = \"{KEY_ID}\", secret = \"env:{SECRET_VAR}\" }}], account = \"123456789012\", region = \"eu-west-1\" }}"
    );
    Sluice::builder()
        .env(SECRET_VAR, SECRET)
        .env("SLUICE_SECRET_AWS_API_KEY", "api-key-1")
        .extra(&bus_to_file_with("orders", 1, &aws))
        .extra(&bus_to_file_with(
            "keyed",
            1,
            "auth = { keys = [\"env:SLUICE_SECRET_AWS_API_KEY\"] }",
        ))
        .extra(extra)
        .start()
        .await
}

fn spec(sluice: &Sluice, key: &str, secret: &str, entries: Value) -> Vec<u8> {
    json!({
        "endpoint": sluice.url(""),
        "region": "eu-west-1",
        "access_key": key,
        "secret": secret,
        "entries": entries,
    })
    .to_string()
    .into_bytes()
}

/// boto3's answer: `{"status","response"}` or `{"error":{"code","message","status"}}`.
fn boto3(sluice: &Sluice, key: &str, secret: &str, entries: Value) -> Value {
    let out = run_python(
        "aws_put_events.py",
        &[],
        &spec(sluice, key, secret, entries),
    );
    serde_json::from_slice(&out).unwrap()
}

/// The JavaScript SDK's answer, in the same form.
fn js_sdk(sluice: &Sluice, key: &str, secret: &str, entries: Value) -> Value {
    let mut child = Command::new("node")
        .arg(repo_root().join("tests/scripts/aws_put_events.mjs"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run node (make aws-node installs the SDK)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(&spec(sluice, key, secret, entries))
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "aws_put_events.mjs:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn order(bus: &str, total: i64) -> Value {
    json!({
        "EventBusName": bus,
        "Source": "shop",
        "DetailType": "OrderPlaced",
        "Detail": json!({"total": total, "customer": {"tier": "gold"}}).to_string(),
        "Resources": ["arn:aws:shop:eu-west-1:123456789012:order/1"],
    })
}

fn event_ids(answer: &Value) -> Vec<String> {
    answer["response"]["Entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["EventId"].as_str().map(str::to_string))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sdks_signed_with_configured_keys_are_accepted_and_delivered() {
    let sluice = gateway("").await;
    let arn = "arn:aws:events:eu-west-1:123456789012:event-bus/orders";
    let mut traced = order(arn, 12);
    traced["TraceHeader"] = json!("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
    traced["Time"] = json!("2024-05-01T10:00:00Z");
    let answer = boto3(
        &sluice,
        KEY_ID,
        SECRET,
        json!([order("orders", 20), traced]),
    );
    assert_eq!(answer["status"], 200, "{answer}");
    assert_eq!(answer["response"]["FailedEntryCount"], 0, "{answer}");
    let mut ids = event_ids(&answer);
    assert_eq!(ids.len(), 2, "{answer}");
    let js = js_sdk(&sluice, KEY_ID, SECRET, json!([order("orders", 30)]));
    assert_eq!(js["status"], 200, "{js}");
    assert_eq!(js["response"]["FailedEntryCount"], 0, "{js}");
    ids.extend(event_ids(&js));
    let delivered = wait_file(&sluice, "orders.jsonl", Duration::from_secs(20), |e| {
        e.len() >= 3
    })
    .await;
    for id in &ids {
        let event = delivered
            .iter()
            .find(|e| e["id"] == id.as_str())
            .unwrap_or_else(|| panic!("{id} not delivered: {delivered:?}"));
        assert_eq!(event["source"], "shop");
        assert_eq!(event["type"], "OrderPlaced");
        assert_eq!(event["datacontenttype"], "application/json");
        assert_eq!(event["data"]["customer"]["tier"], "gold");
        assert_eq!(event["account"], "123456789012");
        assert_eq!(event["region"], "eu-west-1");
        assert_eq!(
            event["resources"],
            "[\"arn:aws:shop:eu-west-1:123456789012:order/1\"]"
        );
        assert!(event["time"].is_string());
    }
    let traced = delivered.iter().find(|e| e["data"]["total"] == 12).unwrap();
    assert_eq!(
        traced["traceparent"],
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    );
    assert_eq!(traced["time"], "2024-05-01T10:00:00Z");
    // One request, two buses: each entry goes to its own (the signer may use both).
    let mixed = boto3(
        &sluice,
        KEY_ID,
        SECRET,
        json!([order("orders", 40), order("default", 41)]),
    );
    assert_eq!(mixed["response"]["FailedEntryCount"], 0, "{mixed}");
    let mixed_ids = event_ids(&mixed);
    sluice_tests::wait_ids(&sluice, "orders.jsonl", &[mixed_ids[0].as_str()]).await;
    sluice_tests::wait_ids(&sluice, "delivered.jsonl", &[mixed_ids[1].as_str()]).await;
    // Metrics count PutEvents under their own mode.
    let metrics = sluice.metrics().await;
    assert!(metrics.contains("mode=\"aws\""), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_are_refused_as_aws_refuses_them() {
    let sluice = gateway("").await;
    let wrong = boto3(
        &sluice,
        KEY_ID,
        "not-the-secret",
        json!([order("orders", 1)]),
    );
    assert_eq!(
        wrong["error"]["code"], "InvalidSignatureException",
        "{wrong}"
    );
    assert_eq!(wrong["error"]["status"], 400, "{wrong}");
    let unknown = boto3(&sluice, "AKIAUNKNOWN", SECRET, json!([order("orders", 1)]));
    assert_eq!(
        unknown["error"]["code"], "UnrecognizedClientException",
        "{unknown}"
    );
    let js = js_sdk(
        &sluice,
        KEY_ID,
        "not-the-secret",
        json!([order("orders", 1)]),
    );
    assert_eq!(js["error"]["code"], "InvalidSignatureException", "{js}");
    assert_eq!(js["error"]["status"], 400, "{js}");
    // A bus with API keys only: PutEvents cannot present them, and is told so.
    let keyed = boto3(&sluice, KEY_ID, SECRET, json!([order("keyed", 1)]));
    assert_eq!(keyed["error"]["code"], "AccessDeniedException", "{keyed}");
    assert!(
        keyed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("aws.access_keys"),
        "{keyed}"
    );
    // An unknown bus.
    let missing = boto3(&sluice, KEY_ID, SECRET, json!([order("nope", 1)]));
    assert_eq!(
        missing["error"]["code"], "ResourceNotFoundException",
        "{missing}"
    );
    // Nothing of these was stored.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(sluice_tests::read_jsonl(&sluice.data_dir().join("orders.jsonl")).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bus_without_keys_takes_any_credentials_and_partial_failures_parse() {
    let sluice = gateway("").await;
    // `default` has neither `aws.access_keys` nor `auth.keys`; EventBusName absent is it.
    let mut no_bus = order("default", 5);
    no_bus.as_object_mut().unwrap().remove("EventBusName");
    let bad_detail = json!({"Source": "shop", "DetailType": "OrderPlaced", "Detail": "[1, 2]"});
    let no_source = json!({"DetailType": "OrderPlaced", "Detail": "{}"});
    let answer = boto3(
        &sluice,
        "AKIAANYTHING",
        "whatever-the-laptop-has",
        json!([no_bus, bad_detail, order("default", 6), no_source]),
    );
    assert_eq!(answer["status"], 200, "{answer}");
    let response = &answer["response"];
    assert_eq!(response["FailedEntryCount"], 2, "{answer}");
    let entries = response["Entries"].as_array().unwrap();
    assert_eq!(entries.len(), 4);
    assert!(entries[0]["EventId"].is_string());
    assert_eq!(entries[1]["ErrorCode"], "MalformedDetail");
    assert!(entries[1].get("EventId").is_none());
    assert!(entries[2]["EventId"].is_string());
    assert_eq!(entries[3]["ErrorCode"], "InvalidArgument");
    assert!(entries[3]["ErrorMessage"]
        .as_str()
        .unwrap()
        .contains("Source"));
    let js = js_sdk(
        &sluice,
        "AKIAOTHER",
        "other",
        json!([order("default", 7), {"Source": "s", "DetailType": "t", "Detail": "not json"}]),
    );
    assert_eq!(js["response"]["FailedEntryCount"], 1, "{js}");
    assert_eq!(
        js["response"]["Entries"][1]["ErrorCode"], "MalformedDetail",
        "{js}"
    );
    let ids: Vec<String> = event_ids(&answer)
        .into_iter()
        .chain(event_ids(&js))
        .collect();
    let want: Vec<&str> = ids.iter().map(String::as_str).collect();
    sluice_tests::wait_ids(&sluice, "delivered.jsonl", &want).await;
    assert_eq!(sluice.delivered().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aws_pattern_routes_put_events_to_a_target() {
    let receiver = Receiver::start().await;
    let rule = format!(
        r#"
[[rules]]
name = "big-orders"
bus = "default"
pattern = {{ source = ["shop"], "detail-type" = ["OrderPlaced"], detail = {{ total = [{{ numeric = [">", 10] }}] }}, resources = [{{ prefix = "arn:aws:shop:" }}] }}

[[rules.targets]]
type = "http"
name = "big"
url = "{}"
"#,
        receiver.url("/big")
    );
    let sluice = gateway(&rule).await;
    let mut other_type = order("default", 50);
    other_type["DetailType"] = json!("OrderCancelled");
    let answer = boto3(
        &sluice,
        "AKIAANY",
        "any",
        json!([order("default", 5), order("default", 11), other_type]),
    );
    assert_eq!(answer["response"]["FailedEntryCount"], 0, "{answer}");
    let ids = event_ids(&answer);
    // Everything reaches the file; only the big order the receiver.
    sluice_tests::wait_ids(
        &sluice,
        "delivered.jsonl",
        &ids.iter().map(String::as_str).collect::<Vec<_>>(),
    )
    .await;
    let got = receiver
        .wait_for(Duration::from_secs(15), |r| !r.is_empty())
        .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let got_now = receiver.received();
    assert_eq!(got_now.len(), 1, "{got_now:?}");
    let ce_id = got[0]
        .header("ce-id")
        .map(str::to_string)
        .or_else(|| got[0].json()["id"].as_str().map(str::to_string));
    assert_eq!(ce_id.as_deref(), Some(ids[1].as_str()), "{got:?}");
}

/// A raw PutEvents request (unsigned: bus `default` takes any).
async fn raw(sluice: &Sluice, path: &str, target: &str, body: Vec<u8>) -> (u16, Value, String) {
    let response = reqwest::Client::new()
        .post(sluice.url(path))
        .header("x-amz-target", target)
        .header("content-type", "application/x-amz-json-1.1")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let kind = response
        .headers()
        .get("x-amzn-errortype")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    assert!(response.headers().contains_key("x-amzn-requestid"));
    assert_eq!(
        response.headers()["content-type"],
        "application/x-amz-json-1.1"
    );
    let body = response.json::<Value>().await.unwrap();
    if !kind.is_empty() {
        assert_eq!(body["__type"], kind.as_str(), "{body}");
        assert!(body["message"].is_string(), "{body}");
    }
    (status, body, kind)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_requests_get_aws_shaped_answers() {
    let sluice = gateway("").await;
    let put = "AWSEvents.PutEvents";
    let entry = json!({"Source": "s", "DetailType": "t", "Detail": "{}"});
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        ("not JSON", b"{not json".to_vec(), 400, "SerializationException"),
        ("an array body", b"[]".to_vec(), 400, "SerializationException"),
        (
            "Entries not an array",
            json!({"Entries": {"Source": "s"}}).to_string().into_bytes(),
            400,
            "SerializationException",
        ),
        (
            "no Entries",
            json!({}).to_string().into_bytes(),
            400,
            "ValidationException",
        ),
        (
            "empty Entries",
            json!({"Entries": []}).to_string().into_bytes(),
            400,
            "ValidationException",
        ),
        (
            "11 entries",
            json!({"Entries": vec![entry.clone(); 11]}).to_string().into_bytes(),
            400,
            "ValidationException",
        ),
        (
            "300 KB of entries",
            json!({"Entries": [{"Source": "s", "DetailType": "t",
                "Detail": json!({"x": "a".repeat(300 * 1024)}).to_string()}]})
            .to_string()
            .into_bytes(),
            400,
            "ValidationException",
        ),
        (
            "2 MB body",
            vec![b' '; 2 * 1024 * 1024],
            400,
            "ValidationException",
        ),
        (
            "EndpointId",
            json!({"Entries": [entry.clone()], "EndpointId": "abc.veo"})
                .to_string()
                .into_bytes(),
            400,
            "ValidationException",
        ),
        (
            "an entry not an object",
            json!({"Entries": ["x"]}).to_string().into_bytes(),
            400,
            "SerializationException",
        ),
        (
            "an unknown bus",
            json!({"Entries": [{"EventBusName": "nope", "Source": "s", "DetailType": "t", "Detail": "{}"}]})
                .to_string()
                .into_bytes(),
            400,
            "ResourceNotFoundException",
        ),
    ];
    for (what, body, status, kind) in cases {
        let (got, answer, got_kind) = raw(&sluice, "/", put, body).await;
        assert_eq!((got, got_kind.as_str()), (status, kind), "{what}: {answer}");
    }
    // Another operation, or none.
    let (status, _, kind) = raw(&sluice, "/", "AWSEvents.ListRules", b"{}".to_vec()).await;
    assert_eq!((status, kind.as_str()), (400, "UnknownOperationException"));
    // Detail that is not an object is an entry's failure, not the request's; /aws serves too.
    let body = json!({"Entries": [
        {"Source": "s", "DetailType": "t", "Detail": "\"text\""},
        {"Source": "s", "DetailType": "t", "Detail": "{\"ok\": true}", "Time": 1714557600},
        {"Source": "s", "DetailType": 5, "Detail": "{}"},
        {"Source": "s", "DetailType": "t", "Detail": "{}", "Resources": "arn:x"},
    ]});
    let (status, answer, kind) = raw(&sluice, "/aws", put, body.to_string().into_bytes()).await;
    assert_eq!((status, kind.as_str()), (200, ""), "{answer}");
    assert_eq!(answer["FailedEntryCount"], 3, "{answer}");
    assert_eq!(answer["Entries"][0]["ErrorCode"], "MalformedDetail");
    assert!(answer["Entries"][1]["EventId"].is_string());
    assert_eq!(answer["Entries"][2]["ErrorCode"], "InvalidArgument");
    assert_eq!(answer["Entries"][3]["ErrorCode"], "InvalidArgument");
    // A keyed bus: unsigned, a SigV4a signature.
    let keyed = json!({"Entries": [{"EventBusName": "orders", "Source": "s", "DetailType": "t", "Detail": "{}"}]});
    let (status, _, kind) = raw(&sluice, "/", put, keyed.to_string().into_bytes()).await;
    assert_eq!(
        (status, kind.as_str()),
        (403, "MissingAuthenticationTokenException")
    );
    let response = reqwest::Client::new()
        .post(sluice.url("/"))
        .header("x-amz-target", put)
        .header("content-type", "application/x-amz-json-1.1")
        .header("x-amz-date", "20240501T100000Z")
        .header(
            "authorization",
            format!("AWS4-ECDSA-P256-SHA256 Credential={KEY_ID}/20240501/events/aws4_request, SignedHeaders=host;x-amz-date, Signature=3045"),
        )
        .body(keyed.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["__type"], "InvalidSignatureException");
    assert!(
        answer["message"].as_str().unwrap().contains("SigV4a"),
        "{answer}"
    );
    // Not POST.
    let get = reqwest::get(sluice.url("/aws")).await.unwrap();
    assert_eq!(get.status(), 405);
    assert!(sluice.is_running());
}

#[test]
fn bad_aws_tables_are_refused_naming_the_field() {
    let cases = [
        (
            "aws = { access_keys = [{ id = \"AKIA1\", secret = \"in-clear\" }] }",
            "aws.access_keys[0].secret",
        ),
        ("aws = { account = \"12\" }", "aws.account"),
        ("aws = { region = \"EU West\" }", "aws.region"),
        (
            "aws = { access_keys = [{ id = \"AKIA 1\", secret = \"env:SLUICE_SECRET_X\" }] }",
            "aws.access_keys[0].id",
        ),
        ("aws = { acount = \"123456789012\" }", "acount"),
    ];
    for (table, field) in cases {
        let (ok, out) =
            sluice_tests::check_config(&format!("[[buses]]\nname = \"orders\"\n{table}\n"));
        assert!(!ok, "{table} was accepted");
        assert!(out.contains(field), "{table}: {out}");
        assert!(!out.contains("in-clear"), "the secret is shown: {out}");
    }
    let (ok, out) = sluice_tests::check_config(
        "[[buses]]\nname = \"orders\"\naws = { access_keys = [{ id = \"AKIA1\", secret = \"env:SLUICE_SECRET_X\" }], account = \"123456789012\", region = \"eu-west-1\" }\n",
    );
    assert!(ok, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buses_made_through_the_admin_api_take_aws_keys() {
    use sluice_tests::admin::{Api, BUS};
    let sluice = gateway("").await;
    let api = Api::recorded(&sluice);
    let aws = json!({
        "access_keys": [{"id": "AKIAADMIN", "secret": format!("env:{SECRET_VAR}")}],
        "account": "210987654321",
    });
    let created = api
        .create(
            BUS,
            "/api/v1/buses/api-made",
            json!({"shards": 1, "aws": aws}),
        )
        .await;
    assert_eq!(
        created.body["aws"]["access_keys"][0]["secret"],
        format!("env:{SECRET_VAR}")
    );
    let literal =
        json!({"shards": 1, "aws": {"access_keys": [{"id": "AKIA2", "secret": "in-clear"}]}});
    let refused = api.put(BUS, "/api/v1/buses/other", literal).await;
    refused.assert_problem(400, "/aws*", "a secret in clear");
    assert!(
        !refused.body.to_string().contains("in-clear"),
        "{}",
        refused.body
    );
    api.check_openapi("compat_aws_admin");
    // The catalog's bus takes PutEvents signed by its key, once ingress has it.
    sluice_tests::eventually(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let answer = boto3(&sluice, "AKIAADMIN", SECRET, json!([order("api-made", 3)]));
            if answer["response"]["FailedEntryCount"] == 0 {
                Ok(())
            } else {
                Err(answer.to_string())
            }
        },
    )
    .await;
    let wrong = boto3(&sluice, "AKIAADMIN", "nope", json!([order("api-made", 3)]));
    assert_eq!(
        wrong["error"]["code"], "InvalidSignatureException",
        "{wrong}"
    );
}
