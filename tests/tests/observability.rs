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
fn sum(text: &str, name: &str, has: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) && l.contains(has))
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .sum()
}

#[tokio::test]
async fn metrics_count_requests_appends_deliveries_and_report_lag_and_tasks() {
    let sluice = Sluice::start().await;
    let client = reqwest::Client::new();
    for i in 0..3 {
        let r = binary(&client, &sluice.events_url(), &format!("m-{i}"), "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    // A bad event, and an unknown bus (whose name must not become a label).
    let r = client
        .post(sluice.events_url())
        .header("ce-specversion", "1.0")
        .header("ce-id", "x")
        .header("ce-type", "t")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = binary(
        &client,
        &sluice.url("/buses/no-such-bus-42/events"),
        "y",
        "{}",
    )
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 404);
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
        let r = binary(&client, &sluice.events_url(), &format!("paused-{i}"), "{}")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 202);
    }
    let lag = || async {
        let text = client
            .get(sluice.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        sum(&text, "sluice_subscription_lag_events", sub)
    };
    let deadline = Instant::now() + Duration::from_secs(15);
    while lag().await != 5.0 {
        assert!(Instant::now() < deadline, "lag never reached 5");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // In seconds: the age of the oldest event not delivered, growing while paused.
    let lag_seconds = || async {
        let text = client
            .get(sluice.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
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
    let r = client
        .post(a.url("/admin/connectors/default/all-events/delivered/pause"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
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
    let body: serde_json::Value = scaling(&a, "?target_lag=1")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["desired_replicas"], 4, "{body}");
    let body: serde_json::Value = scaling(&a, "?target_lag=1&max_replicas=2")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(body["desired_replicas"], 2, "{body}");
    // A bad parameter is a problem naming it.
    let r = scaling(&a, "?target_lag=none").await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = r.json().await.unwrap();
    assert_eq!(problem["field"], "target_lag", "{problem}");

    // Resumed, the backlog drains and one replica is enough.
    let r = client
        .post(b.url("/admin/connectors/default/all-events/delivered/resume"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
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
    let rules = format!(
        r#"
[[rules]]
name = "hooks"
bus = "default"

[[rules.targets]]
type = "http"
name = "bin"
url = "{}"

[[rules.targets]]
type = "http"
name = "structured"
url = "{}"
mode = "structured"
"#,
        binary_rx.url("/b"),
        structured_rx.url("/s")
    );
    let sluice = Sluice::builder().extra(&rules).start().await;
    let client = reqwest::Client::new();
    let parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let r = binary(&client, &sluice.events_url(), "traced", "{}")
        .header("traceparent", parent)
        .header("tracestate", "congo=t61rcWkgMzE")
        .header("x-request-id", "req-123")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    assert_eq!(r.headers()["x-request-id"], "req-123");
    let r = binary(&client, &sluice.events_url(), "bad-trace", "{}")
        .header(
            "traceparent",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
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
