//! Operations against the real binary: `GET /metrics` counters move with what really happened,
//! the scaling signal reports the backlog, and W3C trace context crosses the gateway.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use sluice_tests::{binary, Sluice};

/// The value of the one series whose line starts with `series` (name and labels).
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// The sum of every series of `name` whose labels contain `has`.
use sluice_tests::metric_sum as sum;

#[tokio::test]
async fn metrics_count_requests_appends_deliveries_and_report_lag_and_tasks() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    for i in 0..3 {
        sluice_tests::send_expecting(
            binary(&client, &sluice.events_url(), &format!("m-{i}"), "{}"),
            202,
        )
        .await;
    }
    // A bad event, and an unknown bus (whose name must not become a label).
    sluice_tests::send_expecting(
        client
            .post(sluice.events_url())
            .header("ce-specversion", "1.0")
            .header("ce-id", "x")
            .header("ce-type", "t")
            .header("content-type", "application/json")
            .body("{}"),
        400,
    )
    .await;
    sluice_tests::send_expecting(
        binary(
            &client,
            &sluice.url("/buses/no-such-bus-42/events"),
            "y",
            "{}",
        ),
        404,
    )
    .await;
    sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() >= 3)
        .await;

    // Lag is computed every 2 s per shard: wait for every shard's series to say 0.
    let sub = "subscription=\"default/all-events/delivered\"";
    let deadline = Instant::now() + Duration::from_secs(15);
    let text = loop {
        let r = client.get(sluice.url("/metrics")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        assert!(r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text"));
        let text = r.text().await.unwrap();
        let lag_series = text
            .lines()
            .filter(|l| l.starts_with("sluice_subscription_lag_events{") && l.contains(sub))
            .count();
        if lag_series == 4
            && sum(&text, "sluice_subscription_lag_events", sub) == 0.0
            && sum(&text, "sluice_subscription_delivered_events_total", sub) == 3.0
        {
            break text;
        }
        assert!(Instant::now() < deadline, "metrics never settled:\n{text}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        value(
            &text,
            "sluice_ingress_requests_total{bus=\"default\",mode=\"binary\",status=\"202\"}"
        ),
        Some(3.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "sluice_ingress_requests_total{bus=\"default\",mode=\"binary\",status=\"400\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(
            &text,
            "sluice_ingress_requests_total{bus=\"unknown\",mode=\"binary\",status=\"404\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert!(!text.contains("no-such-bus-42"), "{text}");
    assert_eq!(
        sum(&text, "sluice_events_appended_total", "bus=\"default\""),
        3.0
    );
    assert_eq!(
        sum(&text, "sluice_subscription_matched_events_total", sub),
        3.0
    );
    assert_eq!(
        sum(&text, "sluice_subscription_dead_lettered_events_total", sub),
        0.0
    );
    assert!(
        value(&text, "sluice_store_flush_duration_seconds_count").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert!(
        value(
            &text,
            "sluice_ingress_request_duration_seconds_count{bus=\"default\",mode=\"binary\"}"
        ) == Some(4.0),
        "{text}"
    );
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("sluice_task_state{") && l.contains("state=\"RUNNING\""))
            .filter(|l| l.contains("task=\"bus/default#"))
            .count(),
        4,
        "one RUNNING series per shard task:\n{text}"
    );
    assert_eq!(value(&text, "sluice_leases_held"), Some(4.0), "{text}");
    assert!(text.contains("sluice_build_info{version="), "{text}");
    assert!(text.trim_end().ends_with("# EOF"));

    // A paused subscription falls behind by exactly what arrives meanwhile, and its lag
    // goes back to 0 once it is resumed and has caught up.
    let admin = |action: &str| {
        client
            .post(sluice.url(&format!(
                "/admin/connectors/default/all-events/delivered/{action}"
            )))
            .send()
    };
    assert_eq!(admin("pause").await.unwrap().status(), 202);
    sluice
        .wait_states("default/all-events/delivered#", "PAUSED", 4)
        .await;
    for i in 0..5 {
        sluice_tests::send_expecting(
            binary(&client, &sluice.events_url(), &format!("paused-{i}"), "{}"),
            202,
        )
        .await;
    }
    let lag = || async {
        let text = sluice.metrics().await;
        sum(&text, "sluice_subscription_lag_events", sub)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while lag().await != 5.0 {
        assert!(Instant::now() < deadline, "lag never reached 5");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // In seconds: the age of the oldest event not delivered, growing while paused.
    let lag_seconds = || async {
        let text = sluice.metrics().await;
        text.lines()
            .filter(|l| l.starts_with("sluice_subscription_lag_seconds{") && l.contains(sub))
            .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
            .fold(0.0f64, f64::max)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while lag_seconds().await < 1.5 {
        assert!(
            Instant::now() < deadline,
            "lag in seconds never grew past 1.5 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        lag_seconds().await < 60.0,
        "the age is that of the paused events"
    );
    assert_eq!(admin("resume").await.unwrap().status(), 202);
    let deadline = Instant::now() + Duration::from_secs(15);
    while lag().await != 0.0 || lag_seconds().await != 0.0 {
        assert!(Instant::now() < deadline, "lag never went back to 0");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(sluice.delivered().len(), 8);
}

/// `GET /api/v1/scaling`: any replica reports the whole cluster's backlog (read from Redis)
/// and the replicas it wants for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scaling_signal_reports_the_cluster_backlog_from_any_replica() {
    let (url, prefix) = sluice_tests::shared_redis("scaling");
    let a = Sluice::builder().distributed(&url, &prefix).start().await;
    let b = Sluice::builder().distributed(&url, &prefix).start().await;
    a.wait_members(2).await;
    a.wait_tasks_settled(4, 2).await;
    let client = reqwest::Client::new();
    sluice_tests::admin::act(&a, "/admin/connectors/default/all-events/delivered/pause").await;
    a.wait_states("default/all-events/delivered#", "PAUSED", 4)
        .await;
    let accepted =
        sluice_tests::post_spread(&[a.events_url(), b.events_url()], "backlog", 30).await;
    assert_eq!(accepted.len(), 30);

    let scaling =
        |s: &Sluice, query: &str| client.get(s.url(&format!("/api/v1/scaling{query}"))).send();
    // Positions are committed every 50 ms; the backlog is what the stores say.
    let deadline = Instant::now() + Duration::from_secs(15);
    for replica in [&a, &b] {
        loop {
            let body: serde_json::Value = scaling(replica, "?target_lag=10")
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            if body["lag_events"] == 30 {
                assert_eq!(body["replicas"], 2, "{body}");
                assert_eq!(body["tasks"], 4, "{body}");
                assert_eq!(
                    body["desired_replicas"], 3,
                    "30 events / 10 per replica: {body}"
                );
                assert_eq!(
                    body["most_behind"][0]["subscription"],
                    "default/all-events/delivered"
                );
                assert_eq!(body["most_behind"][0]["lag_events"], 30);
                break;
            }
            assert!(Instant::now() < deadline, "backlog never reported: {body}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    // Capped by the tasks there are to run, and by max_replicas.
    for (query, desired) in [("?target_lag=1", 4), ("?target_lag=1&max_replicas=2", 2)] {
        let body: serde_json::Value = scaling(&a, query).await.unwrap().json().await.unwrap();
        assert_eq!(body["desired_replicas"], desired, "{query}: {body}");
    }
    // A bad parameter is a problem naming it.
    let r = scaling(&a, "?target_lag=none").await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_eq!(problem["field"], "target_lag", "{problem}");

    // Resumed, the backlog drains and one replica is enough.
    sluice_tests::admin::act(&b, "/admin/connectors/default/all-events/delivered/resume").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let body: serde_json::Value = scaling(&b, "").await.unwrap().json().await.unwrap();
        if body["lag_events"] == 0 {
            assert_eq!(body["desired_replicas"], 1, "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "backlog never drained: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A producer's W3C `traceparent`/`tracestate` become the event's distributed-tracing
/// extension and go on to the target as headers (binary and structured mode alike); an
/// invalid one is ignored; every answer carries the request id.
#[tokio::test]
async fn trace_context_crosses_the_gateway_and_requests_have_ids() {
    use sluice_tests::receiver::Receiver;
    let binary_rx = Receiver::start().await;
    let structured_rx = Receiver::start().await;
    // One rule, two targets: the second's table follows the first's settings.
    let rules = sluice_tests::target_rule(
        "hooks",
        "http",
        "bin",
        &format!(
            "url = \"{}\"\n\n[[rules.targets]]\ntype = \"http\"\nname = \"structured\"\nurl = \"{}\"\nmode = \"structured\"",
            binary_rx.url("/b"),
            structured_rx.url("/s")
        ),
    );
    let sluice = Sluice::builder().extra(&rules).start().await;
    let client = reqwest::Client::new();
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let r = sluice_tests::send_expecting(
        binary(&client, &sluice.events_url(), "traced", "{}")
            .header("traceparent", parent)
            .header("tracestate", "congo=t61rcWkgMzE")
            .header("x-request-id", "req-123"),
        202,
    )
    .await;
    assert_eq!(r.headers()["x-request-id"], "req-123");
    let r = sluice_tests::send_expecting(
        binary(&client, &sluice.events_url(), "bad-trace", "{}").header(
            "traceparent",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        ),
        202,
    )
    .await;
    let generated = r.headers()["x-request-id"].to_str().unwrap().to_string();
    assert_eq!(
        generated.len(),
        32,
        "a request id is made when none is given"
    );

    let events = sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() >= 2)
        .await;
    let traced = events.iter().find(|e| e["id"] == "traced").unwrap();
    assert_eq!(traced["traceparent"], parent);
    assert_eq!(traced["tracestate"], "congo=t61rcWkgMzE");
    let untraced = events.iter().find(|e| e["id"] == "bad-trace").unwrap();
    assert!(untraced.get("traceparent").is_none(), "{untraced}");

    for rx in [&binary_rx, &structured_rx] {
        let got = rx.wait_for(Duration::from_secs(10), |r| r.len() >= 2).await;
        let traced = got
            .iter()
            .find(|r| {
                r.header("ce-id") == Some("traced")
                    || r.json().get("id").and_then(|v| v.as_str()) == Some("traced")
            })
            .unwrap();
        assert_eq!(traced.header("traceparent"), Some(parent));
        assert_eq!(traced.header("tracestate"), Some("congo=t61rcWkgMzE"));
        let other = got.iter().find(|r| !std::ptr::eq(*r, traced)).unwrap();
        assert_eq!(other.header("traceparent"), None);
    }
    assert!(
        binary_rx
            .received()
            .iter()
            .any(|r| r.header("ce-traceparent") == Some(parent)),
        "binary mode also carries it as the extension"
    );
}

/// With `[tracing] otlp_endpoint`, the gateway's spans reach the collector as OTLP/HTTP
/// JSON: the `request` span continues the producer's `traceparent`, the `deliver` span
/// continues the delivered event's trace, and a collector that fails is survived. (No
/// OpenTelemetry collector runs here: the peer is the harness's HTTP receiver, and the
/// body is checked against the OTLP JSON mapping.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_are_exported_over_otlp_and_continue_the_callers_trace() {
    use sluice_tests::receiver::{Receiver, Reply};
    let collector = Receiver::start().await;
    // The first export fails: the next ones must still come.
    collector.script([Reply::Status(503)]);
    let target = Receiver::start().await;
    let tracing = format!(
        r#"
[tracing]
otlp_endpoint = "{}"
service_name = "sluice-e2e"
otlp_headers = {{ "x-collector-key" = "env:OTLP_TEST_KEY" }}
"#,
        collector.url("")
    );
    let extra = sluice_tests::target_rule(
        "hooks",
        "http",
        "bin",
        &format!("url = \"{}\"\n{tracing}", target.url("/b")),
    );
    let sluice = Sluice::builder()
        .extra(&extra)
        .env("OTLP_TEST_KEY", "k-123")
        .start()
        .await;
    let client = reqwest::Client::new();
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    for id in ["warm-up", "traced", "plain"] {
        let mut request = binary(&client, &sluice.events_url(), id, "{}");
        if id == "traced" {
            request = request.header("traceparent", parent);
        }
        assert_eq!(request.send().await.unwrap().status(), 202);
        target
            .wait_for(Duration::from_secs(10), |r| {
                r.iter().any(|r| r.header("ce-id") == Some(id))
            })
            .await;
        if id == "warm-up" {
            // Its spans went in the refused export.
            collector
                .wait_for(Duration::from_secs(10), |r| !r.is_empty())
                .await;
        }
    }

    let spans = |received: &[sluice_tests::receiver::Received]| -> Vec<serde_json::Value> {
        received
            .iter()
            .filter(|r| r.path == "/v1/traces" && r.status == 200)
            .flat_map(|r| {
                let body = r.json();
                let mut out = Vec::new();
                for rs in body["resourceSpans"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                {
                    for ss in rs["scopeSpans"].as_array().cloned().unwrap_or_default() {
                        for mut span in ss["spans"].as_array().cloned().unwrap_or_default() {
                            span["resource"] = rs["resource"].clone();
                            out.push(span);
                        }
                    }
                }
                out
            })
            .collect()
    };
    let traced = |s: &serde_json::Value| s["traceId"] == "0af7651916cd43dd8448eb211c80319c";
    let of_hook = |s: &serde_json::Value| {
        s["attributes"].as_array().is_some_and(|a| {
            a.contains(&serde_json::json!({"key": "subscription", "value": {"stringValue": "default/hooks/bin"}}))
        })
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    let received = loop {
        let received = collector.received();
        let got = spans(&received);
        let untraced_request = got
            .iter()
            .any(|s| s["name"] == "request" && !traced(s) && s.get("parentSpanId").is_none());
        if untraced_request
            && got.iter().any(|s| s["name"] == "request" && traced(s))
            && got
                .iter()
                .any(|s| s["name"] == "deliver" && traced(s) && of_hook(s))
        {
            break received;
        }
        assert!(
            Instant::now() < deadline,
            "spans of the trace not exported: {}\n{}",
            serde_json::Value::Array(got),
            sluice.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(received[0].status, 503, "the first export was refused");
    let post = received.iter().find(|r| r.status == 200).unwrap();
    assert_eq!(post.method, "POST");
    assert_eq!(post.header("content-type"), Some("application/json"));
    assert_eq!(post.header("x-collector-key"), Some("k-123"));
    let spans = spans(&received);
    let request = spans
        .iter()
        .find(|s| s["name"] == "request" && traced(s))
        .unwrap();
    assert_eq!(request["parentSpanId"], "b7ad6b7169203331", "{request}");
    assert_eq!(request["kind"], 2);
    let attributes = request["attributes"].as_array().unwrap();
    assert!(
        attributes
            .contains(&serde_json::json!({"key": "bus", "value": {"stringValue": "default"}})),
        "{request}"
    );
    assert_eq!(
        request["resource"]["attributes"][0],
        serde_json::json!({"key": "service.name", "value": {"stringValue": "sluice-e2e"}})
    );
    // One delivery span per subscription that took the event (the harness's file rule
    // too), each continuing the event's trace.
    let delivers: Vec<&serde_json::Value> = spans
        .iter()
        .filter(|s| s["name"] == "deliver" && traced(s))
        .collect();
    assert!(delivers.iter().any(|s| of_hook(s)), "{delivers:?}");
    for deliver in delivers {
        assert_eq!(deliver["parentSpanId"], "b7ad6b7169203331", "{deliver}");
        assert_eq!(deliver["kind"], 4);
    }
    for span in &spans {
        for key in ["traceId", "spanId", "startTimeUnixNano", "endTimeUnixNano"] {
            assert!(span[key].is_string(), "{key} of {span}");
        }
        assert_eq!(span["traceId"].as_str().unwrap().len(), 32);
        assert_eq!(span["spanId"].as_str().unwrap().len(), 16);
    }
    assert!(
        sluice.log().contains("OTLP export failed"),
        "the refused export is logged\n{}",
        sluice.log()
    );

    // A bad endpoint is refused before start, naming the key.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.toml");
    std::fs::write(&file, "[tracing]\notlp_endpoint = \"ftp://collector\"\n").unwrap();
    let out = std::process::Command::new(sluice_tests::sluice_bin())
        .arg("check-config")
        .arg(&file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("tracing.otlp_endpoint"), "{err}");
}
