//! The HTTP target against a real receiver: body modes, headers, auth, Standard Webhooks
//! signatures (verified by the `standardwebhooks` reference package), rate limit, circuit
//! breaker.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::json;
use sluice_tests::receiver::{HyperReceiver, Receiver, Reply};
use sluice_tests::{http_rule, post, repo_root, run_python, Sluice};

/// Posts `count` events with ids `{prefix}-{i}` and an empty JSON object as data.
async fn post_empty(sluice: &Sluice, prefix: &str, count: usize) {
    let client = reqwest::Client::new();
    for i in 0..count {
        post(
            &client,
            &sluice.events_url(),
            &format!("{prefix}-{i}"),
            "{}",
        )
        .await;
    }
}

#[tokio::test]
async fn http_target_binary_mode_carries_attributes_headers_and_bearer_auth() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder().http_target(
        "hook",
        &receiver.url("/hook"),
        "headers = { x-team = \"blue\" }\nauth = { type = \"bearer\", token = \"env:SLUICE_SECRET_HOOK_TOKEN\" }",
    )
    .env("SLUICE_SECRET_HOOK_TOKEN", "t0ken")
    .start()
    .await;
    let client = reqwest::Client::new();
    sluice_tests::send_expecting(
        client
            .post(sluice.events_url())
            .header("ce-specversion", "1.0")
            .header("ce-id", "b-1")
            .header("ce-source", "/tests")
            .header("ce-type", "com.example.test")
            .header("ce-subject", "caf%C3%A9 au lait")
            .header("ce-tenant", "acme")
            .header("content-type", "application/json")
            .body(r#"{"n":1}"#),
        202,
    )
    .await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    let req = &got[0];
    assert_eq!(req.method, "POST");
    assert_eq!(req.path, "/hook");
    assert_eq!(req.header("ce-id"), Some("b-1"));
    assert_eq!(req.header("ce-specversion"), Some("1.0"));
    assert_eq!(req.header("ce-type"), Some("com.example.test"));
    assert_eq!(req.header("ce-tenant"), Some("acme"));
    assert_eq!(req.header("ce-subject"), Some("caf%C3%A9%20au%20lait"));
    assert_eq!(req.header("content-type"), Some("application/json"));
    assert_eq!(req.header("x-team"), Some("blue"));
    assert_eq!(req.header("authorization"), Some("Bearer t0ken"));
    assert_eq!(req.json(), json!({"n": 1}));
}

#[tokio::test]
async fn http_target_structured_and_raw_modes_with_basic_and_api_key_auth() {
    let structured = Receiver::start().await;
    let raw = Receiver::start().await;
    let extra = http_rule(
        "structured",
        &structured.url("/s"),
        "mode = \"structured\"\nauth = { type = \"basic\", username = \"u\", password = \"env:SLUICE_SECRET_BASIC\" }",
    ) + &http_rule(
        "raw",
        &raw.url("/r"),
        "mode = \"raw\"\nauth = { type = \"api-key\", header = \"x-api-key\", key = \"env:SLUICE_SECRET_API_KEY\" }",
    );
    let sluice = Sluice::builder()
        .extra(&extra)
        .env("SLUICE_SECRET_BASIC", "p")
        .env("SLUICE_SECRET_API_KEY", "k1")
        .start()
        .await;
    post(
        &reqwest::Client::new(),
        &sluice.events_url(),
        "m-1",
        r#"{"v":"x"}"#,
    )
    .await;
    let s = structured
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    assert!(s[0]
        .header("content-type")
        .unwrap()
        .starts_with("application/cloudevents+json"));
    assert_eq!(s[0].header("authorization"), Some("Basic dTpw"));
    let event = s[0].json();
    assert_eq!(event["id"], "m-1");
    assert_eq!(event["data"], json!({"v": "x"}));
    let r = raw
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    assert!(
        r[0].header("ce-id").is_none(),
        "raw mode sends no ce- headers"
    );
    assert_eq!(r[0].header("x-api-key"), Some("k1"));
    assert_eq!(r[0].json(), json!({"v": "x"}));
}

#[tokio::test]
async fn http_target_signatures_verify_with_standardwebhooks_package() {
    // 24 random bytes, base64: a secret like the ones Standard Webhooks providers issue.
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .http_target(
            "signed",
            &receiver.url("/signed"),
            "signing_secret = \"env:SLUICE_SECRET_SIGNING\"",
        )
        .env("SLUICE_SECRET_SIGNING", secret)
        .start()
        .await;
    let client = reqwest::Client::new();
    sluice_tests::post_many(&client, &sluice.events_url(), "sig", 0..3, |i| {
        format!(r#"{{"i":{i}}}"#)
    })
    .await;
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| r.len() >= 3)
        .await;
    let requests: Vec<_> = got
        .iter()
        .map(|r| {
            assert!(r.header("webhook-signature").unwrap().starts_with("v1,"));
            assert_eq!(r.header("webhook-id"), r.header("ce-id"));
            let headers: serde_json::Map<String, serde_json::Value> = r
                .headers
                .iter()
                .filter(|(k, _)| k.starts_with("webhook-"))
                .map(|(k, v)| (k.clone(), json!(v)))
                .collect();
            json!({"headers": headers, "body": String::from_utf8(r.body.clone()).unwrap()})
        })
        .collect();
    let input = json!({"secret": secret, "requests": requests}).to_string();
    run_python("verify_webhook.py", &[], input.as_bytes());
}

#[tokio::test]
async fn http_target_rate_limit_spreads_requests() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .http_target("limited", &receiver.url("/l"), "rate_limit = 20.0")
        .start()
        .await;
    post_empty(&sluice, "rl", 100).await;
    let got = receiver
        .wait_for(Duration::from_secs(30), |r| r.len() >= 100)
        .await;
    assert_eq!(got.len(), 100);
    // Never faster than the limit: in any window, at most the burst (20) plus 20/s of the
    // window's length (and two for arrival jitter). A slow machine only makes this easier.
    for i in 0..got.len() {
        for j in i + 1..got.len() {
            let window = (got[j].at - got[i].at).as_secs_f64();
            let count = (j - i + 1) as f64;
            assert!(
                count <= 20.0 + 20.0 * window + 2.0,
                "{count} requests within {window:.3} s (from request {i})"
            );
        }
    }
    // And not much slower: the 80 beyond the burst take about 4 s at 20/s; the limiter
    // must not hold them back beyond 3 times that.
    let span = got.last().unwrap().at - got.first().unwrap().at;
    assert!(
        span >= Duration::from_millis(3500) && span <= Duration::from_secs(12),
        "100 requests in {span:?}"
    );
}

#[tokio::test]
async fn http_target_circuit_breaker_stops_hammering_a_dead_endpoint() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(503));
    let sluice = Sluice::builder().http_target(
        "breaker",
        &receiver.url("/b"),
        "circuit_breaker = { failures = 2, open_for = \"1s\" }\n[rules.targets.retry]\ninitial_backoff = \"10ms\"\nmax_backoff = \"20ms\"",
    )
    .start()
    .await;
    sluice_tests::post_event(&sluice, "cb-1").await;
    // Without the breaker, a request every 10–20 ms. With it: 2 failures, then it opens and
    // lets one probe through per `open_for` (a slow machine only makes the gaps longer).
    let tried = receiver
        .wait_for(Duration::from_secs(15), |r| r.len() >= 4)
        .await;
    let gaps: Vec<Duration> = tried.windows(2).map(|w| w[1].at - w[0].at).collect();
    assert!(
        gaps[1] >= Duration::from_millis(900) && gaps[2] >= Duration::from_millis(900),
        "requests to the dead endpoint {gaps:?} apart"
    );
    // It recovers: the next probe succeeds and the event is delivered.
    receiver.default_reply(Reply::Status(200));
    receiver
        .wait_for(Duration::from_secs(5), |r| {
            r.iter().filter(|x| x.was_accepted()).count() >= 1
        })
        .await;
    drop(sluice);
}

#[tokio::test]
async fn http_target_h2c_prior_knowledge_shares_one_pooled_connection() {
    let receiver = HyperReceiver::h2c().await;
    let sluice = Sluice::builder()
        .http_target("h2", &receiver.url("/h2"), "http2_prior_knowledge = true")
        .start()
        .await;
    const N: usize = 40;
    post_empty(&sluice, "h2", N).await;
    receiver.wait_requests(N, Duration::from_secs(20)).await;
    let (requests, h2, connections) = receiver.counts();
    assert_eq!(requests, N, "each event once");
    assert_eq!(h2, N, "every request over HTTP/2");
    // Four shard tasks deliver concurrently, multiplexed on the pooled connection (a
    // second one may open while the first is still connecting).
    assert!(
        connections <= 2,
        "{connections} connections for {N} requests"
    );
}

#[tokio::test]
async fn http_target_https_with_a_private_ca_negotiates_h2() {
    let receiver = HyperReceiver::tls().await;
    let ca = repo_root().join("tests/fixtures/tls/ca.pem");
    let sluice = Sluice::builder()
        .http_target(
            "tls",
            &receiver.url("/tls"),
            &format!("ca_file = \"{}\"", ca.display()),
        )
        .start()
        .await;
    const N: usize = 20;
    post_empty(&sluice, "tls", N).await;
    let (requests, h2, _) = receiver.wait_requests(N, Duration::from_secs(20)).await;
    assert_eq!(requests, N, "each event once");
    assert_eq!(h2, N, "h2 chosen by ALPN");
}

#[tokio::test]
async fn http_target_https_refuses_an_untrusted_certificate() {
    let receiver = HyperReceiver::tls().await;
    let sluice = Sluice::builder()
        .http_target("untrusted", &receiver.url("/hook"), "")
        .start()
        .await;
    sluice_tests::post_event(&sluice, "tls-bad").await;
    // The handshake fails (the private CA is not trusted): nothing reaches the handler, and
    // the event stays pending with the reason in the task's status.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = sluice.cluster_view().await;
        let failed = view["statuses"].as_array().unwrap().iter().any(|s| {
            s["state"] == "FAILED"
                && s["id"]
                    .as_str()
                    .unwrap()
                    .starts_with("default/untrusted/untrusted#")
                && s["reason"]
                    .as_str()
                    .unwrap_or_default()
                    .contains("certificate")
        });
        if failed {
            break;
        }
        assert!(Instant::now() < deadline, "no FAILED status: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(receiver.counts().0, 0);
}

/// `concurrent = true` sends a batch's events at once, never more than `max_in_flight`;
/// by default a subscription sends one request at a time per shard, in order.
#[tokio::test]
async fn http_target_concurrent_sends_at_most_max_in_flight() {
    let ordered = Receiver::start().await;
    let parallel = Receiver::start().await;
    for r in [&ordered, &parallel] {
        r.default_reply(Reply::Sleep(Duration::from_millis(200), 200));
    }
    let sluice = Sluice::builder()
        .shards(1)
        .extra(
            &(http_rule("ordered", &ordered.url("/"), "")
                + &http_rule(
                    "parallel",
                    &parallel.url("/"),
                    "concurrent = true\nmax_in_flight = 4",
                )),
        )
        .start()
        .await;
    let events: Vec<serde_json::Value> = (0..24)
        .map(|i| sluice_tests::structured_event(&format!("c-{i}")))
        .collect();
    sluice_tests::post_batch(&reqwest::Client::new(), &sluice.events_url(), events).await;
    let got = parallel
        .wait_for(Duration::from_secs(30), |r| r.len() >= 24)
        .await;
    assert_eq!(got.len(), 24);
    assert_eq!(parallel.peak_in_flight(), 4, "up to max_in_flight at once");
    let got = ordered
        .wait_for(Duration::from_secs(30), |r| r.len() >= 24)
        .await;
    let order: Vec<&str> = got.iter().map(|r| r.header("ce-id").unwrap()).collect();
    let want: Vec<String> = (0..24).map(|i| format!("c-{i}")).collect();
    assert_eq!(order, want, "in order, one at a time");
    assert_eq!(ordered.peak_in_flight(), 1);
}
