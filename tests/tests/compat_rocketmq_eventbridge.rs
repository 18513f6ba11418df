//! Apache RocketMQ EventBridge's HTTP API against the real binary: its control plane
//! (`/bus/*`, `/rule/*`, `/target/*`) making a bus, a rule with a `filterPattern` and an
//! http target on the harness's receiver, then `/putEvents` in binary, structured and
//! batch mode delivering; list paging; the project's error form for unknown resources,
//! unsupported target classes and hostile bodies; disable stopping delivery and enable
//! resuming it; the admin token.
//!
//! The request bodies are the project's own samples (repository `apache/rocketmq-eventbridge`):
//! - bus and rule: `docs/CreateFileTarget.md` ("Create EventBus", "Create EventRule");
//! - http target: `adapter/api/src/test/java/.../converter/EventTargetConverterTest.java`
//!   (`className` `http`, `config.url`);
//! - `/putEvents` binary mode: the `curl` of `README.md` ("Put Events to EventBus") and
//!   `sdk/main.dara` `putEventsWithOptions` (the `ce-*` headers, `ce-eventbusname`);
//! - the answers: `BaseResponse` (`requestId`, `code`, `message`), `PutEventsResponseBody`
//!   of `sdk/main.dara` (`failedEntryCount`, `entryList[{eventId, errorCode,
//!   errorMessage}]`), `ListEventBusesResponseBody` (`eventBuses`, `nextToken`, `total`,
//!   `maxResults`), the codes and statuses of `EventBridgeErrorCode.java`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::admin::{check_openapi, Api, Recorder};
use sluice_tests::receiver::{Received, Receiver};
use sluice_tests::{sluice_bin, Sluice};

/// Every control-plane exchange of the test, for the OpenAPI check.
fn recorder() -> &'static Recorder {
    static RECORDER: OnceLock<Recorder> = OnceLock::new();
    RECORDER.get_or_init(Recorder::default)
}

/// `POST path` with a JSON body: the status and the JSON answer (recorded).
async fn eb(sluice: &Sluice, path: &str, body: Value) -> (u16, Value) {
    let answer = Api::new(sluice, recorder())
        .post(path, path, Some(body))
        .await;
    (answer.status.as_u16(), answer.body)
}

async fn eb_raw(sluice: &Sluice, path: &str, body: Vec<u8>, token: Option<&str>) -> (u16, Value) {
    let mut request = reqwest::Client::new()
        .post(sluice.url(path))
        .header("content-type", "application/json; charset=utf-8")
        .body(body);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await.expect("request");
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, value)
}

/// A successful answer: 200 and `BaseResponse` with `code` `Success`.
fn ok(answer: &(u16, Value)) -> &Value {
    assert_eq!(answer.0, 200, "{}", answer.1);
    assert_eq!(answer.1["code"], "Success", "{}", answer.1);
    assert_eq!(
        answer.1["requestId"].as_str().map(str::len),
        Some(36),
        "{}",
        answer.1
    );
    &answer.1
}

/// A refusal in the project's form: its status and `EventBridgeErrorCode`.
fn refused(answer: &(u16, Value), status: u16, code: &str) -> String {
    assert_eq!(answer.0, status, "{}", answer.1);
    assert_eq!(answer.1["code"], code, "{}", answer.1);
    assert!(answer.1["requestId"].is_string(), "{}", answer.1);
    answer.1["message"].as_str().unwrap_or("").to_string()
}

/// The bus, rule and http target of `docs/CreateFileTarget.md`, the target pointing at
/// `receiver`, the rule taking the GitHub pull-request events of the README's sample.
async fn demo(sluice: &Sluice, receiver: &Receiver) {
    ok(&eb(
        sluice,
        "/bus/createEventBus",
        json!({"eventBusName": "demo-bus", "description": "a demo bus."}),
    )
    .await);
    ok(&eb(
        sluice,
        "/rule/createEventRule",
        json!({
            "eventBusName": "demo-bus",
            "eventRuleName": "demo-rule",
            "description": "A demo rule.",
            "filterPattern": "{\"source\":[\"https://github.com/cloudevents/spec/pull\"]}"
        }),
    )
    .await);
    ok(&eb(
        sluice,
        "/target/createEventTargets",
        json!({
            "eventBusName": "demo-bus",
            "eventRuleName": "demo-rule",
            "eventTargets": [{
                "eventTargetName": "demo-target",
                "className": "http",
                "config": {"url": receiver.url("/cloudevents")}
            }]
        }),
    )
    .await);
    wait_running(sluice).await;
}

/// Waits until the demo target's connector runs: a new subscription starts at the end of
/// the bus, so events put before it runs are not its.
async fn wait_running(sluice: &Sluice) {
    sluice_tests::admin::wait_connector_view(
        sluice,
        "demo-bus/demo-rule/demo-target",
        Duration::from_secs(10),
        sluice_tests::admin::all_running,
    )
    .await;
}

/// The README's `curl`: binary mode, `Content-Type: application/json`, the bus in
/// `ce-eventbusname`.
async fn put_binary(sluice: &Sluice, id: &str, bus: &str) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("Content-Type", "application/json; charset=UTF-8")
        .header("ce-specversion", "1.0")
        .header("ce-type", "com.github.pull_request.opened")
        .header("ce-source", "https://github.com/cloudevents/spec/pull")
        .header("ce-subject", "demo")
        .header("ce-id", id)
        .header("ce-datacontenttype", "application/json")
        .header("ce-time", "2018-04-05T17:31:00Z")
        .header("ce-eventbusname", bus)
        .body("{\"text\":\"A test event.\"}")
        .send()
        .await
        .expect("putEvents");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn put(sluice: &Sluice, content_type: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("content-type", content_type)
        .body(body.to_string())
        .send()
        .await
        .expect("putEvents");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn event(id: &str, source: &str, bus: Option<&str>) -> Value {
    let mut e = json!({
        "specversion": "1.0",
        "id": id,
        "source": source,
        "type": "com.github.pull_request.opened",
        "datacontenttype": "application/json",
        "data": {"number": 1}
    });
    if let Some(bus) = bus {
        e["aliyuneventbusname"] = json!(bus);
    }
    e
}

fn ce_ids(received: &[Received]) -> Vec<String> {
    received
        .iter()
        .filter_map(|r| r.header("ce-id").map(str::to_string))
        .collect()
}

async fn wait_ids(receiver: &Receiver, want: &[&str]) {
    receiver
        .wait_for(Duration::from_secs(20), |r| {
            let got = ce_ids(r);
            want.iter().all(|w| got.iter().any(|g| g == w))
        })
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_plane_then_put_events_in_every_mode() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .limits("max_event_bytes = 16384\nmax_batch_bytes = 32768")
        .start()
        .await;
    demo(&sluice, &receiver).await;

    // The bus and rule read back as the project's DTOs.
    let bus = eb(
        &sluice,
        "/bus/getEventBus",
        json!({"eventBusName": "demo-bus"}),
    )
    .await;
    assert_eq!(ok(&bus)["eventBusName"], "demo-bus");
    let rule = eb(
        &sluice,
        "/rule/getEventRule",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule"}),
    )
    .await;
    let rule = ok(&rule);
    assert_eq!(rule["status"], "ENABLE");
    assert_eq!(
        serde_json::from_str::<Value>(rule["filterPattern"].as_str().unwrap()).unwrap(),
        json!({"source": ["https://github.com/cloudevents/spec/pull"]})
    );
    assert_eq!(rule["eventTargets"][0]["eventTargetName"], "demo-target");
    assert_eq!(rule["eventTargets"][0]["className"], "http");
    assert_eq!(
        rule["eventTargets"][0]["config"]["url"],
        receiver.url("/cloudevents")
    );
    let targets = eb(
        &sluice,
        "/target/listEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule"}),
    )
    .await;
    assert_eq!(ok(&targets)["eventTargets"].as_array().unwrap().len(), 1);
    // The same rule through /api/v1: one catalog.
    let (status, v1) =
        sluice_tests::admin::get(&sluice, "/api/v1/buses/demo-bus/rules/demo-rule").await;
    assert_eq!(status, 200, "{v1}");
    assert_eq!(v1["targets"][0]["type"], "http");

    // Binary mode, the README's request.
    let answer = put_binary(&sluice, "1234-1234-1234", "demo-bus").await;
    let body = ok(&answer);
    assert_eq!(body["failedEntryCount"], 0, "{body}");
    assert_eq!(body["entryList"][0]["eventId"], "1234-1234-1234");
    assert_eq!(body["entryList"][0]["errorCode"], "Success");
    // Structured mode, the bus in the `aliyuneventbusname` extension.
    let source = "https://github.com/cloudevents/spec/pull";
    let answer = put(
        &sluice,
        "application/cloudevents+json",
        event("structured-1", source, Some("demo-bus")),
    )
    .await;
    assert_eq!(ok(&answer)["failedEntryCount"], 0);
    // Batch mode, the bus in the header: one event the pattern takes, one it does not,
    // one invalid (no `type`): failed alone.
    let mut invalid = event("batch-bad", source, None);
    invalid.as_object_mut().unwrap().remove("type");
    let response = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("content-type", "application/cloudevents-batch+json")
        .header("aliyuneventbusname", "demo-bus")
        .body(
            json!([
                event("batch-1", source, None),
                event("batch-other", "https://example.com/other", None),
                invalid
            ])
            .to_string(),
        )
        .send()
        .await
        .unwrap();
    let answer = (
        response.status().as_u16(),
        response.json::<Value>().await.unwrap(),
    );
    let body = ok(&answer);
    assert_eq!(body["failedEntryCount"], 1, "{body}");
    let list = body["entryList"].as_array().unwrap();
    assert_eq!(list.len(), 3);
    assert_eq!(list[0]["eventId"], "batch-1");
    assert_eq!(list[0]["errorCode"], "Success");
    assert_eq!(list[1]["errorCode"], "Success");
    assert_eq!(list[2]["errorCode"], "EventInvalid");
    assert!(
        list[2]["errorMessage"].as_str().unwrap().contains("type"),
        "{body}"
    );
    // A plain `application/json` structured event, as the project's clients also send.
    let answer = put(
        &sluice,
        "application/json",
        event("plain-json", source, Some("demo-bus")),
    )
    .await;
    assert_eq!(ok(&answer)["failedEntryCount"], 0);

    wait_ids(
        &receiver,
        &["1234-1234-1234", "structured-1", "batch-1", "plain-json"],
    )
    .await;
    let got = ce_ids(&receiver.received());
    assert!(!got.iter().any(|id| id == "batch-other"), "{got:?}");
    let first = receiver
        .received()
        .into_iter()
        .find(|r| r.header("ce-id") == Some("1234-1234-1234"))
        .unwrap();
    assert_eq!(first.header("ce-eventbusname"), Some("demo-bus"));
    assert_eq!(first.json(), json!({"text": "A test event."}));

    // The data plane's whole-request refusals.
    let unknown = put_binary(&sluice, "x", "no-such-bus").await;
    assert!(refused(&unknown, 409, "EventBusNotExist").contains("no-such-bus"));
    let no_bus = put(
        &sluice,
        "application/cloudevents+json",
        event("x", source, None),
    )
    .await;
    refused(&no_bus, 409, "EventBusEmpty");
    let two = put(
        &sluice,
        "application/cloudevents-batch+json",
        json!([
            event("a", source, Some("demo-bus")),
            event("b", source, Some("default"))
        ]),
    )
    .await;
    refused(&two, 409, "PutEventsRequestMoreThanOneEventBus");
    let text = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("content-type", "text/plain")
        .body("hello")
        .send()
        .await
        .unwrap();
    let text = (text.status().as_u16(), text.json::<Value>().await.unwrap());
    refused(&text, 409, "EventHTTPProtocolBindingInvalid");
    let garbage = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("content-type", "application/cloudevents-batch+json")
        .header("aliyuneventbusname", "demo-bus")
        .body("[{\"id\": ")
        .send()
        .await
        .unwrap();
    let garbage = (
        garbage.status().as_u16(),
        garbage.json::<Value>().await.unwrap(),
    );
    refused(&garbage, 409, "EventInvalid");
    let huge = reqwest::Client::new()
        .post(sluice.url("/putEvents"))
        .header("content-type", "application/cloudevents-batch+json")
        .header("aliyuneventbusname", "demo-bus")
        .body(vec![b' '; 40 * 1024])
        .send()
        .await
        .unwrap();
    let huge = (
        huge.status().as_u16(),
        huge.json::<Value>().await.unwrap_or(Value::Null),
    );
    assert_eq!(huge.0, 413, "{}", huge.1);

    // The requests were counted under the bus, mode `eventbridge`.
    let metrics = reqwest::get(sluice.url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.contains("mode=\"eventbridge\"") && l.contains("bus=\"demo-bus\"")),
        "no eventbridge ingress metrics"
    );
    check_openapi(recorder(), "eventbridge-control-plane");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_stops_delivery_and_enable_resumes_it() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::start().await;
    demo(&sluice, &receiver).await;
    let names = json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule"});
    ok(&put_binary(&sluice, "before", "demo-bus").await);
    wait_ids(&receiver, &["before"]).await;

    ok(&eb(&sluice, "/rule/disableEventRule", names.clone()).await);
    let rule = eb(&sluice, "/rule/getEventRule", names.clone()).await;
    assert_eq!(ok(&rule)["status"], "DISABLE");
    // The pause reaches every task of the running connector.
    sluice_tests::admin::wait_connector_view(
        &sluice,
        "demo-bus/demo-rule/demo-target",
        Duration::from_secs(10),
        |view| {
            let tasks = view["tasks"].as_array().cloned().unwrap_or_default();
            !tasks.is_empty() && tasks.iter().all(|t| t["state"] == "PAUSED")
        },
    )
    .await;
    ok(&put_binary(&sluice, "while-disabled", "demo-bus").await);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let got = ce_ids(&receiver.received());
    assert!(!got.iter().any(|id| id == "while-disabled"), "{got:?}");

    // Enabled again: the paused connector resumes from where it stopped.
    ok(&eb(&sluice, "/rule/enableEventRule", names.clone()).await);
    let rule = eb(&sluice, "/rule/getEventRule", names.clone()).await;
    assert_eq!(ok(&rule)["status"], "ENABLE");
    ok(&put_binary(&sluice, "after", "demo-bus").await);
    wait_ids(&receiver, &["while-disabled", "after"]).await;

    // The shorter names of the issue are served too.
    ok(&eb(&sluice, "/rule/disableRule", names.clone()).await);
    let rule = eb(&sluice, "/rule/getRule", names.clone()).await;
    assert_eq!(ok(&rule)["status"], "DISABLE");
    ok(&eb(&sluice, "/rule/enableRule", names).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paging_unknown_resources_and_unsupported_targets() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::start().await;
    demo(&sluice, &receiver).await;
    for i in 0..4 {
        ok(&eb(
            &sluice,
            "/bus/createEventBus",
            json!({"eventBusName": format!("bus-{i}")}),
        )
        .await);
    }
    // `default` (the file's), `demo-bus` and four more: six, in pages of four.
    let first = eb(&sluice, "/bus/listEventBuses", json!({"maxResults": 4})).await;
    let first = ok(&first);
    assert_eq!(first["eventBuses"].as_array().unwrap().len(), 4, "{first}");
    assert_eq!(first["total"], 6);
    assert_eq!(first["maxResults"], 4);
    assert_eq!(first["nextToken"], "4");
    let second = eb(
        &sluice,
        "/bus/listEventBuses",
        json!({"maxResults": 4, "nextToken": "4"}),
    )
    .await;
    let second = ok(&second);
    assert_eq!(
        second["eventBuses"].as_array().unwrap().len(),
        2,
        "{second}"
    );
    assert!(second["nextToken"].is_null(), "{second}");
    let mut names: Vec<Value> = first["eventBuses"].as_array().unwrap().clone();
    names.extend(second["eventBuses"].as_array().unwrap().iter().cloned());
    assert!(
        names.iter().any(|b| b["eventBusName"] == "bus-3"),
        "{names:?}"
    );
    refused(
        &eb(&sluice, "/bus/listEventBuses", json!({"maxResults": 1000})).await,
        409,
        "LimitSizeInvalid",
    );
    refused(
        &eb(&sluice, "/bus/listEventBuses", json!({"nextToken": "x"})).await,
        409,
        "NextTokenInvalid",
    );

    // Rules, paged the same way.
    for i in 0..2 {
        ok(&eb(
            &sluice,
            "/rule/createEventRule",
            json!({"eventBusName": "demo-bus", "eventRuleName": format!("r-{i}"), "filterPattern": "{}"}),
        )
        .await);
    }
    let rules = eb(
        &sluice,
        "/rule/listEventRules",
        json!({"eventBusName": "demo-bus", "maxResults": 2}),
    )
    .await;
    let rules = ok(&rules);
    assert_eq!(rules["total"], 3);
    assert_eq!(rules["nextToken"], "2");
    let rest = eb(
        &sluice,
        "/rule/listRules",
        json!({"eventBusName": "demo-bus", "maxResults": 2, "nextToken": "2"}),
    )
    .await;
    assert_eq!(ok(&rest)["eventRules"].as_array().unwrap().len(), 1);
    // A rule without targets has none to show, and matches nothing.
    let empty = eb(
        &sluice,
        "/target/listEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "r-0"}),
    )
    .await;
    assert_eq!(ok(&empty)["eventTargets"], json!([]));
    let r0 = eb(
        &sluice,
        "/rule/getEventRule",
        json!({"eventBusName": "demo-bus", "eventRuleName": "r-0"}),
    )
    .await;
    assert_eq!(ok(&r0)["filterPattern"], "{}");

    // Unknown resources.
    let missing = eb(&sluice, "/bus/getEventBus", json!({"eventBusName": "nope"})).await;
    assert!(refused(&missing, 409, "EventBusNotExist").contains("[nope]"));
    refused(
        &eb(
            &sluice,
            "/bus/deleteEventBus",
            json!({"eventBusName": "nope"}),
        )
        .await,
        409,
        "EventBusNotExist",
    );
    refused(
        &eb(
            &sluice,
            "/rule/getEventRule",
            json!({"eventBusName": "demo-bus", "eventRuleName": "nope"}),
        )
        .await,
        409,
        "EventRuleNotExist",
    );
    refused(
        &eb(
            &sluice,
            "/rule/deleteEventRule",
            json!({"eventBusName": "demo-bus", "eventRuleName": "nope"}),
        )
        .await,
        409,
        "EventRuleNotExist",
    );
    refused(
        &eb(
            &sluice,
            "/target/updateEventTargets",
            json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargets": [
                {"eventTargetName": "nope", "className": "http", "config": {"url": receiver.url("/x")}}
            ]}),
        )
        .await,
        409,
        "EventTargetNotExist",
    );
    refused(
        &eb(
            &sluice,
            "/bus/createEventBus",
            json!({"eventBusName": "demo-bus"}),
        )
        .await,
        409,
        "EventBusAlreadyExist",
    );
    refused(
        &eb(
            &sluice,
            "/rule/createEventRule",
            json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "filterPattern": "{}"}),
        )
        .await,
        409,
        "EventRuleAlreadyExist",
    );
    refused(
        &eb(
            &sluice,
            "/bus/deleteEventBus",
            json!({"eventBusName": "demo-bus"}),
        )
        .await,
        409,
        "EventBusRuleNotEmptyForDelete",
    );

    // A target class with no Sluice equivalent is named.
    let dingtalk = eb(
        &sluice,
        "/target/createEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargets": [{
            "eventTargetName": "ding",
            "className": "acs.dingtalk",
            "config": {"WebHook": "https://oapi.dingtalk.com/robot/send?access_token=x", "SecretKey": "s"}
        }]}),
    )
    .await;
    assert!(refused(&dingtalk, 409, "EventTargetClassNotExist").contains("acs.dingtalk"));
    let missing_url = eb(
        &sluice,
        "/target/createEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargets": [{
            "eventTargetName": "t2", "className": "http", "config": {}
        }]}),
    )
    .await;
    refused(&missing_url, 409, "EventTargetMissingAttribute");
    // A target the catalog's checks refuse (not a URL) is refused by them.
    let bad_url = eb(
        &sluice,
        "/target/createEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargets": [{
            "eventTargetName": "t3", "className": "http", "config": {"url": "not a url"}
        }]}),
    )
    .await;
    assert_eq!(bad_url.0, 409, "{}", bad_url.1);

    // Update and delete of targets, then the rule, then the bus.
    ok(&eb(
        &sluice,
        "/target/updateEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargets": [{
            "eventTargetName": "demo-target", "className": "http",
            "config": {"url": receiver.url("/v2")},
            "runOptions": {"retryStrategy": {"pushRetryStrategy": "BACKOFF_RETRY", "maximumRetryAttempts": 3, "maximumEventAgeInSeconds": 60}}
        }]}),
    )
    .await);
    let targets = eb(
        &sluice,
        "/target/listEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule"}),
    )
    .await;
    let target = &ok(&targets)["eventTargets"][0];
    assert_eq!(target["config"]["url"], receiver.url("/v2"));
    assert_eq!(
        target["runOptions"]["retryStrategy"]["maximumRetryAttempts"],
        3
    );
    assert_eq!(
        target["runOptions"]["retryStrategy"]["maximumEventAgeInSeconds"],
        60
    );
    ok(&eb(
        &sluice,
        "/rule/updateEventRule",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "filterPattern": "{\"type\":[{\"prefix\":\"com.github.\"}]}"}),
    )
    .await);
    ok(&eb(
        &sluice,
        "/target/deleteEventTargets",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule", "eventTargetNames": ["demo-target"]}),
    )
    .await);
    let rule = eb(
        &sluice,
        "/rule/getEventRule",
        json!({"eventBusName": "demo-bus", "eventRuleName": "demo-rule"}),
    )
    .await;
    let rule = ok(&rule);
    assert_eq!(rule["eventTargets"], json!([]));
    assert_eq!(
        serde_json::from_str::<Value>(rule["filterPattern"].as_str().unwrap()).unwrap(),
        json!({"type": [{"prefix": "com.github."}]})
    );
    for rule in ["demo-rule", "r-0", "r-1"] {
        ok(&eb(
            &sluice,
            "/rule/deleteEventRule",
            json!({"eventBusName": "demo-bus", "eventRuleName": rule}),
        )
        .await);
    }
    ok(&eb(
        &sluice,
        "/bus/deleteEventBus",
        json!({"eventBusName": "demo-bus"}),
    )
    .await);
    refused(
        &eb(
            &sluice,
            "/bus/getEventBus",
            json!({"eventBusName": "demo-bus"}),
        )
        .await,
        409,
        "EventBusNotExist",
    );
    check_openapi(recorder(), "eventbridge-paging");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_bodies_get_clear_errors() {
    let sluice = Sluice::start().await;
    let not_json = eb_raw(&sluice, "/bus/createEventBus", b"{not json".to_vec(), None).await;
    assert!(refused(&not_json, 409, "RequestParameterInvalid").contains("not JSON"));
    let array = eb(&sluice, "/bus/createEventBus", json!(["demo"])).await;
    refused(&array, 409, "RequestParameterInvalid");
    let wrong_type = eb(&sluice, "/bus/createEventBus", json!({"eventBusName": 5})).await;
    assert!(refused(&wrong_type, 409, "RequestParameterInvalid").contains("eventBusName"));
    let missing = eb(&sluice, "/bus/createEventBus", json!({"description": "x"})).await;
    refused(&missing, 409, "EventBusNameInvalid");
    let long = eb(
        &sluice,
        "/bus/createEventBus",
        json!({"eventBusName": "b".repeat(10_000)}),
    )
    .await;
    refused(&long, 409, "EventBusNameInvalid");
    let slash = eb(
        &sluice,
        "/bus/createEventBus",
        json!({"eventBusName": "../etc"}),
    )
    .await;
    refused(&slash, 409, "EventBusNameInvalid");
    let pattern = eb(
        &sluice,
        "/rule/createEventRule",
        json!({"eventBusName": "default", "eventRuleName": "r", "filterPattern": "{source"}),
    )
    .await;
    refused(&pattern, 409, "EventRuleFilterPatternSchemaError");
    let not_object = eb(
        &sluice,
        "/rule/createEventRule",
        json!({"eventBusName": "default", "eventRuleName": "r", "filterPattern": "[1]"}),
    )
    .await;
    refused(&not_object, 409, "EventRuleFilterPatternSchemaError");
    let bad_pattern = eb(
        &sluice,
        "/rule/createEventRule",
        json!({"eventBusName": "default", "eventRuleName": "r", "filterPattern": "{\"source\": [{\"no-such-operator\": 1}]}"}),
    )
    .await;
    refused(&bad_pattern, 409, "EventRuleFilterPatternSchemaError");
    let no_pattern = eb(
        &sluice,
        "/rule/createEventRule",
        json!({"eventBusName": "default", "eventRuleName": "r"}),
    )
    .await;
    refused(&no_pattern, 409, "EventRuleFilterPatternEmpty");
    let no_bus = eb(
        &sluice,
        "/rule/createEventRule",
        json!({"eventBusName": "nope", "eventRuleName": "r", "filterPattern": "{}"}),
    )
    .await;
    refused(&no_bus, 409, "EventBusNotExist");
    let targets = eb(
        &sluice,
        "/target/createEventTargets",
        json!({"eventBusName": "default", "eventRuleName": "all-events", "eventTargets": "x"}),
    )
    .await;
    refused(&targets, 409, "RequestParameterInvalid");
    let names = eb(
        &sluice,
        "/target/deleteEventTargets",
        json!({"eventBusName": "default", "eventRuleName": "all-events", "eventTargetNames": [1]}),
    )
    .await;
    refused(&names, 409, "RequestParameterInvalid");
    // Over the admin API's body limit (1 MiB): refused before it is read. (Only just over
    // it: a body far larger may meet a closed connection before the answer is read.)
    let huge = eb_raw(
        &sluice,
        "/bus/createEventBus",
        format!("{{\"eventBusName\": \"{}\"}}", "b".repeat(1024 * 1024)).into_bytes(),
        None,
    )
    .await;
    assert_eq!(huge.0, 413, "{}", huge.1);
    // Nothing of that reached the catalog.
    let list = eb(&sluice, "/bus/listEventBuses", json!({})).await;
    assert_eq!(ok(&list)["total"], 1);
    assert!(sluice.is_alive());
    check_openapi(recorder(), "eventbridge-hostile");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_is_required_when_the_gateway_has_one() {
    let token = "eventbridge-admin-token";
    let out = std::process::Command::new(sluice_bin())
        .args(["ctl", "hash-token", token])
        .output()
        .unwrap();
    let hash = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let sluice = Sluice::builder()
        .admin(&format!("tokens = [\"{hash}\"]"))
        .start()
        .await;
    let body = json!({"eventBusName": "guarded"}).to_string().into_bytes();
    let none = eb_raw(&sluice, "/bus/createEventBus", body.clone(), None).await;
    assert_eq!(none.0, 401, "{}", none.1);
    let wrong = eb_raw(&sluice, "/bus/createEventBus", body.clone(), Some("wrong")).await;
    assert_eq!(wrong.0, 401, "{}", wrong.1);
    let good = eb_raw(&sluice, "/bus/createEventBus", body, Some(token)).await;
    ok(&good);
    // Cross-site requests are refused as on /api/v1, whatever the token.
    let response = reqwest::Client::new()
        .post(sluice.url("/bus/listEventBuses"))
        .header("content-type", "application/json")
        .header("origin", "https://evil.example")
        .bearer_auth(token)
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 403);
}
