//! The Knative broker ingress and Knative Triggers against the real binary: events in the
//! Knative broker's format (binary and structured) at `/{namespace}/{broker}`, answered as
//! knative/eventing's `pkg/broker/ingress/ingress_handler.go` answers (202 with an empty
//! body, 400 for what is not a CloudEvent, 404 for an unknown broker, 405 for other
//! methods, 200 to OPTIONS), stored on the bus the broker maps to and delivered to a rule's
//! http target; and Trigger YAML applied with `sluice ctl apply -f`, routing by its
//! filter. The Knative filter conformance table is in `functions/src/knative_tests.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use serde_json::json;
use sluice_tests::admin::{ctl, ctl_ok};
use sluice_tests::receiver::Receiver;
use sluice_tests::{bus_to_file, client, wait_ids, Sluice};

fn knative_binary(
    client: &reqwest::Client,
    url: &str,
    id: &str,
    ty: &str,
) -> reqwest::RequestBuilder {
    // The headers a Knative source (the CloudEvents Go SDK) sends in binary mode.
    client
        .post(url)
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/apis/v1/namespaces/shop/pingsources/ping")
        .header("ce-type", ty)
        .header("content-type", "application/json")
        .body(r#"{"message":"Hello world!"}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_ingress_answers_as_knative_and_delivers() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .http_target("to-receiver", &receiver.url("/sink"), "")
        .extra(&bus_to_file("orders-bus"))
        .extra("\n[knative]\nbrokers = { \"shop/orders\" = \"orders-bus\" }\n")
        .start()
        .await;
    let http = client();

    // Binary mode into the bus named like the broker: 202, empty body.
    let r = knative_binary(
        &http,
        &sluice.url("/shop/default"),
        "kn-1",
        "dev.knative.ping",
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 202);
    assert!(r.bytes().await.unwrap().is_empty());
    // Structured mode, with the trailing slash Knative ignores.
    let structured = json!({
        "specversion": "1.0", "id": "kn-2", "source": "/shop", "type": "dev.knative.ping",
        "datacontenttype": "application/json", "data": {"n": 2},
    });
    let r = http
        .post(sluice.url("/any-namespace/default/"))
        .header("content-type", "application/cloudevents+json")
        .body(structured.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert!(r.bytes().await.unwrap().is_empty());
    wait_ids(&sluice, "delivered.jsonl", &["kn-1", "kn-2"]).await;
    // ... and to the rule's http target, in binary mode.
    let got = receiver
        .wait_for(Duration::from_secs(15), |r| {
            r.iter().filter(|r| r.path == "/sink").count() >= 2
        })
        .await;
    let first = got
        .iter()
        .find(|r| r.header("ce-id") == Some("kn-1"))
        .expect("kn-1");
    assert_eq!(first.header("ce-type"), Some("dev.knative.ping"));
    assert_eq!(first.json()["message"], "Hello world!");

    // The mapping: shop/orders feeds `orders-bus`; other/orders has no bus `orders`.
    let r = knative_binary(&http, &sluice.url("/shop/orders"), "kn-3", "order.created")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    wait_ids(&sluice, "orders-bus.jsonl", &["kn-3"]).await;
    let r = knative_binary(&http, &sluice.url("/other/orders"), "kn-4", "order.created")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_eq!(problem["field"], "broker");

    // Not a CloudEvent: 400 (where /buses/{bus}/events says 415 for a foreign type).
    for request in [
        http.post(sluice.url("/shop/default"))
            .header("content-type", "text/plain")
            .body("hello"),
        // Knative takes one event per request.
        http.post(sluice.url("/shop/default"))
            .header("content-type", "application/cloudevents-batch+json")
            .body(json!([structured]).to_string()),
        http.post(sluice.url("/shop/default"))
            .header("content-type", "application/cloudevents+json")
            .body("{not json"),
        http.post(sluice.url("/shop/default"))
            .header("content-type", "application/cloudevents+json")
            .body(json!({"specversion": "1.0", "id": "x", "type": "t"}).to_string()),
        // Binary without ce-id.
        http.post(sluice.url("/shop/default"))
            .header("ce-specversion", "1.0")
            .header("ce-source", "/s")
            .header("ce-type", "t")
            .body("{}"),
        // Not a CloudEvent, to an unknown broker: Knative reads the event first.
        http.post(sluice.url("/nowhere/nobroker"))
            .header("content-type", "text/plain")
            .body("hello"),
    ] {
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), 400, "{:?}", r.text().await);
    }
    // Hostile sizes: over the event limit is refused, not buffered.
    // (Just over the 256 KiB default: a body far larger is refused before it is read, and
    // the client may then see a broken pipe instead of the answer.)
    let big = "x".repeat(256 * 1024 + 1);
    let r = knative_binary(&http, &sluice.url("/shop/default"), "big", "t")
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    // Methods: GET is 405 on a broker that exists (404 on any other two-segment path, so
    // a typo is not answered as a resource), OPTIONS is the CloudEvents webhook handshake.
    let r = http.get(sluice.url("/shop/default")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    let r = http.get(sluice.url("/nothing/here")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let r = http
        .request(reqwest::Method::OPTIONS, sluice.url("/shop/default"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()
            .get("webhook-allowed-origin")
            .and_then(|v| v.to_str().ok()),
        Some("*")
    );
    // The reserved first segments stay theirs: a webhook source that does not exist is the
    // webhooks' own 404, not a broker's.
    let r = http
        .post(sluice.url("/webhooks/nope"))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_ne!(problem["field"], "broker", "{problem}");

    // Metrics carry the mode `knative`.
    let metrics = sluice.metrics().await;
    assert!(
        sluice_tests::metric_sum(
            &metrics,
            "sluice_ingress_requests_total",
            "mode=\"knative\",status=\"202\""
        ) >= 3.0,
        "{metrics}"
    );
    assert!(
        sluice_tests::metric_sum(
            &metrics,
            "sluice_ingress_requests_total",
            "bus=\"unknown\",mode=\"knative\",status=\"404\""
        ) >= 1.0,
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_ingress_keeps_the_bus_keys_and_dedup() {
    let sluice = Sluice::builder()
        .extra(&sluice_tests::bus_to_file_with(
            "guarded",
            1,
            "auth = { keys = [\"sha256:e8f2a1007449f6aae3e1eadaf60dca51f65ba0ac11f769a10072cc9cc4553390\"] }\ndedup_window = \"1m\"",
        ))
        .start()
        .await;
    let http = client();
    let url = sluice.url("/ns/guarded");
    let r = knative_binary(&http, &url, "g-1", "t")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    for _ in 0..2 {
        let r = knative_binary(&http, &url, "g-1", "t")
            .header("x-api-key", "producer-a-key")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    wait_ids(&sluice, "guarded.jsonl", &["g-1"]).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let lines = sluice_tests::read_jsonl(&sluice.data_dir().join("guarded.jsonl"));
    assert_eq!(lines.len(), 1, "a duplicate was stored again: {lines:?}");
}

const TRIGGERS: &str = r#"
apiVersion: eventing.knative.dev/v1
kind: Trigger
metadata:
  name: orders-placed
  namespace: shop
spec:
  broker: default
  filters:
    - any:
        - exact:
            type: order.created
        - prefix:
            type: order.paid.
    - not:
        exact:
          source: /test
  subscriber:
    uri: RECEIVER/placed
---
apiVersion: eventing.knative.dev/v1
kind: Trigger
metadata:
  name: orders-cancelled
  namespace: shop
spec:
  broker: default
  filter:
    attributes:
      type: order.cancelled
      region: ""
  subscriber:
    uri: RECEIVER/cancelled
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn triggers_applied_with_ctl_route_by_their_filters() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .extra(&sluice_tests::bus("shop-events", 2, ""))
        .extra("\n[knative]\nbrokers = { \"shop/default\" = \"shop-events\" }\n")
        .start()
        .await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("triggers.yaml");
    std::fs::write(&file, TRIGGERS.replace("RECEIVER", &receiver.url(""))).unwrap();
    let out = ctl_ok(&sluice, &["apply", "-f", file.to_str().unwrap()]);
    assert!(
        out.contains("rule/shop-events/orders-placed created"),
        "{out}"
    );
    assert!(
        out.contains("rule/shop-events/orders-cancelled created"),
        "{out}"
    );
    // The rule as stored: on the mapped bus, with the translated filter.
    let rule = ctl_ok(&sluice, &["get", "rule", "shop-events/orders-placed"]);
    let rule: serde_json::Value = serde_json::from_str(&rule).unwrap();
    assert_eq!(rule["targets"][0]["type"], "http");
    assert!(
        rule["filter"]
            .as_str()
            .unwrap()
            .contains("type LIKE 'order.paid.%'"),
        "{rule}"
    );

    let http = client();
    let url = sluice.url("/shop/default");
    let send = |id: &str, ty: &str, source: &str, region: Option<&str>| {
        let mut r = knative_binary(&http, &url, id, ty).header("ce-source", source);
        if let Some(region) = region {
            r = r.header("ce-region", region);
        }
        r.send()
    };
    // Not matching anything first, so that the matches arriving proves they were read.
    for (id, ty, source, region) in [
        ("no-1", "order.shipped", "/shop", None),
        ("no-2", "order.created", "/test", None),
        ("no-3", "order.cancelled", "/shop", None),
        ("yes-1", "order.created", "/shop", None),
        ("yes-2", "order.paid.card", "/shop", None),
        ("yes-3", "order.cancelled", "/shop", Some("eu")),
    ] {
        let r = send(id, ty, source, region).await.unwrap();
        assert_eq!(r.status(), 202, "{id}");
    }
    receiver
        .wait_for(Duration::from_secs(15), |r| r.len() >= 3)
        .await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let got = receiver.received();
    let at = |path: &str| -> Vec<String> {
        let mut ids: Vec<String> = got
            .iter()
            .filter(|r| r.path == path)
            .filter_map(|r| r.header("ce-id").map(str::to_string))
            .collect();
        ids.sort();
        ids
    };
    assert_eq!(at("/placed"), vec!["yes-1", "yes-2"]);
    assert_eq!(at("/cancelled"), vec!["yes-3"]);
    assert_eq!(got.len(), 3, "{got:?}");

    // What cannot be served is refused, naming the field; nothing is applied.
    let bad = |body: &str| {
        std::fs::write(&file, body).unwrap();
        let out = ctl(&sluice, &["apply", "-f", file.to_str().unwrap()], None);
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let trigger = |spec: &str| {
        format!(
            "apiVersion: eventing.knative.dev/v1\nkind: Trigger\nmetadata:\n  name: bad\nspec:\n{spec}"
        )
    };
    let err = bad(&trigger(
        "  broker: default\n  subscriber:\n    ref:\n      kind: Service\n      name: s\n",
    ));
    assert!(err.contains("/triggers/0/spec/subscriber/ref"), "{err}");
    let err = bad(&trigger(
        "  broker: default\n  filters:\n    - exact:\n        type: a\n      suffix:\n        type: b\n  subscriber:\n    uri: http://127.0.0.1:9/\n",
    ));
    assert!(err.contains("multiple dialects"), "{err}");
    let err = bad(&trigger(
        "  broker: default\n  filters:\n    - cesql: \"type = \"\n  subscriber:\n    uri: http://127.0.0.1:9/\n",
    ));
    assert!(err.contains("/triggers/0/spec/filters/0/cesql"), "{err}");
    // The subscriber goes through the egress policy of every http target.
    let err = bad(&trigger(
        "  broker: default\n  subscriber:\n    uri: http://169.254.169.254/latest/meta-data\n",
    ));
    assert!(err.contains("169.254"), "{err}");
    // The broker's bus must exist (the rule's normal validation).
    let err = bad(&trigger(
        "  broker: missing\n  subscriber:\n    uri: http://127.0.0.1:9/\n",
    ));
    assert!(err.contains("missing"), "{err}");
    let rules = ctl_ok(&sluice, &["get", "rules", "shop-events"]);
    assert!(!rules.contains("\"bad\""), "{rules}");
}
