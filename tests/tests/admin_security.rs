//! The admin surface is secure by default, through the binary: what a browser can send
//! cross-site (a foreign `Origin`, `Sec-Fetch-Site`, a `text/plain` body, a rebound `Host`)
//! changes nothing; without a token the admin API answers only an explicit local opt-in
//! (loopback peers, `::ffff:127.0.0.1` included, never through a proxy) or a token it
//! generates and keeps owner-only; `/api/v1/scaling` reads the store at most once a second
//! whatever the flood; a webhook timestamp at the ends of `i64` is refused, not a panic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use sluice_tests::{client, post, sluice_bin, RedisServer, Sluice};

async fn catalog_version(sluice: &Sluice, token: Option<&str>) -> u64 {
    let mut request = client().get(sluice.url("/api/v1/catalog"));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let answer: Value = request.send().await.unwrap().json().await.unwrap();
    answer["version"].as_u64().expect("catalog version")
}

/// The status and problem of an answer.
/// `GET /api/v1/catalog` with `token`: it must answer 200.
async fn assert_admitted(sluice: &Sluice, token: &str) {
    let request = client()
        .get(sluice.url("/api/v1/catalog"))
        .bearer_auth(token);
    sluice_tests::send_expecting(request, 200).await;
}

async fn problem(response: reqwest::Response) -> (StatusCode, Value) {
    let status = response.status();
    let body = response.json().await.unwrap_or(Value::Null);
    (status, body)
}

/// The request of the issue: a page on another site posts a catalog change whose file target
/// writes anywhere, as `text/plain` (no preflight), possibly after rebinding its name to
/// 127.0.0.1. Every variant is refused before anything runs, and nothing changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cross_site_catalog_takeover_is_refused_and_changes_nothing() {
    let sluice = Sluice::start().await;
    let outside = tempfile::tempdir().unwrap();
    let pwned = outside.path().join("anywhere/pwned.jsonl");
    let body = json!({"rules": [{"name": "x", "bus": "default", "targets": [
        {"type": "file", "name": "f", "path": pwned.to_string_lossy()}
    ]}]})
    .to_string();
    let before = catalog_version(&sluice, None).await;
    let port = sluice.addr().port();
    let own = format!("127.0.0.1:{port}");
    let apply = sluice.url("/api/v1/catalog/apply");
    // (headers, the status, the field the problem names)
    type Case = (Vec<(&'static str, String)>, u16, &'static str);
    let cases: Vec<Case> = vec![
        // The curl, exactly.
        (
            vec![
                ("host", format!("rebind.evil.example:{port}")),
                ("origin", "https://evil.example".to_string()),
                ("content-type", "text/plain".to_string()),
            ],
            403,
            "host",
        ),
        // The same from a page on another site, without rebinding.
        (
            vec![
                ("host", own.clone()),
                ("origin", "https://evil.example".to_string()),
                ("content-type", "text/plain".to_string()),
            ],
            403,
            "origin",
        ),
        // A browser that sends no Origin still says where the request comes from.
        (
            vec![
                ("sec-fetch-site", "cross-site".to_string()),
                ("content-type", "application/json".to_string()),
            ],
            403,
            "sec-fetch-site",
        ),
        (
            vec![
                ("sec-fetch-site", "same-site".to_string()),
                ("content-type", "application/json".to_string()),
            ],
            403,
            "sec-fetch-site",
        ),
        // JSON as text/plain (the type that needs no preflight), or as a form.
        (
            vec![("content-type", "text/plain".to_string())],
            415,
            "content-type",
        ),
        (
            vec![(
                "content-type",
                "application/x-www-form-urlencoded".to_string(),
            )],
            415,
            "content-type",
        ),
        (Vec::new(), 415, "content-type"),
    ];
    for (headers, status, field) in cases {
        let mut request = client().post(&apply).body(body.clone());
        for (k, v) in &headers {
            request = request.header(*k, v.as_str());
        }
        let response = request.send().await.unwrap();
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{headers:?}"
        );
        assert!(
            response
                .headers()
                .keys()
                .all(|k| !k.as_str().starts_with("access-control-")),
            "{headers:?}"
        );
        let (got, problem) = problem(response).await;
        assert_eq!(got.as_u16(), status, "{headers:?}: {problem}");
        assert_eq!(problem["field"], field, "{headers:?}: {problem}");
    }
    // The other state-changing routes are guarded the same way (a body-less action too).
    let evil = ("origin", "https://evil.example");
    for (method, path, (header, value)) in [
        (
            Method::DELETE,
            "/api/v1/buses/default/rules/all-events",
            evil,
        ),
        (
            Method::POST,
            "/api/v1/connectors/default/all-events/delivered/pause",
            ("sec-fetch-site", "cross-site"),
        ),
        (
            Method::POST,
            "/admin/connectors/default/all-events/delivered/pause",
            evil,
        ),
    ] {
        let request = client()
            .request(method, sluice.url(path))
            .header(header, value);
        sluice_tests::send_expecting(request, 403).await;
    }
    // A preflight gets no CORS permission.
    let preflight = client()
        .request(reqwest::Method::OPTIONS, &apply)
        .header("origin", "https://evil.example")
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "content-type")
        .send()
        .await
        .unwrap();
    assert!(preflight
        .headers()
        .keys()
        .all(|k| !k.as_str().starts_with("access-control-")));

    // Nothing changed: same catalog version, and the next event goes only where it went.
    assert_eq!(catalog_version(&sluice, None).await, before);
    post(&client(), &sluice.events_url(), "after-attack", "{}").await;
    sluice
        .wait_delivered(Duration::from_secs(10), |e| {
            e.iter().any(|e| e["id"] == "after-attack")
        })
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!pwned.exists(), "the file target of the attack was created");
    assert!(!pwned.parent().unwrap().exists());

    // The console's own requests (same origin, JSON) are answered.
    let ok_rule = json!({"targets": [{"type": "file", "name": "f",
        "path": sluice.data_dir().join("same-origin.jsonl").to_string_lossy()}]});
    let same_origin = client()
        .put(sluice.url("/api/v1/buses/default/rules/from-console"))
        .header("origin", format!("http://{own}"))
        .header("sec-fetch-site", "same-origin")
        .header("content-type", "application/json; charset=utf-8")
        .body(ok_rule.to_string())
        .send()
        .await
        .unwrap();
    let (status, answer) = problem(same_origin).await;
    assert_eq!(status.as_u16(), 201, "{answer}");
    assert!(catalog_version(&sluice, None).await > before);
    let action = client()
        .post(sluice.url("/api/v1/connectors/default/all-events/delivered/pause"))
        .header("origin", format!("http://{own}"))
        .send()
        .await
        .unwrap();
    assert_eq!(action.status(), 202, "a body-less action needs no type");
}

/// DNS rebinding: without a token only this gateway's own names are answered (the console
/// too); with a token any name is, unless `admin.allowed_hosts` lists some.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebound_host_is_refused_without_a_token_and_answered_with_one() {
    let sluice = Sluice::start().await;
    let port = sluice.addr().port();
    let get = |sluice: &Sluice, path: &str, host: String, token: Option<&str>| {
        let mut request = client().get(sluice.url(path)).header("host", host);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    for path in ["/api/v1/catalog", "/console/", "/admin/cluster"] {
        let rebound = get(&sluice, path, format!("rebind.evil.example:{port}"), None)
            .await
            .unwrap();
        let (status, problem) = problem(rebound).await;
        assert_eq!(status, 403, "{path}");
        assert_eq!(problem["field"], "host", "{path}");
        for own in [format!("127.0.0.1:{port}"), format!("localhost:{port}")] {
            let answer = get(&sluice, path, own.clone(), None).await.unwrap();
            assert_eq!(answer.status(), 200, "{path} {own}");
        }
    }
    // Another port of a loopback name is another origin.
    let other_port = get(&sluice, "/api/v1/catalog", "localhost:1".to_string(), None)
        .await
        .unwrap();
    assert_eq!(other_port.status(), 403);

    // With a token: any name, with the token.
    let token = "rebinding-is-no-use-without-me";
    let with_token = |admin: &str| {
        Sluice::builder()
            .admin(admin)
            .env("SLUICE_ADMIN_TOKEN", token)
            .start()
    };
    let guarded = with_token("").await;
    let port = guarded.addr().port();
    let foreign = format!("sluice.example.net:{port}");
    let with = get(&guarded, "/api/v1/catalog", foreign.clone(), Some(token))
        .await
        .unwrap();
    assert_eq!(with.status(), 200);
    let without = get(&guarded, "/api/v1/catalog", foreign, None)
        .await
        .unwrap();
    assert_eq!(without.status(), 401);

    // A token and a list: the list (and this gateway's own names) only.
    let listed = with_token("allowed_hosts = [\"sluice.internal\"]").await;
    let port = listed.addr().port();
    for (host, status) in [
        (format!("sluice.internal:{port}"), 200),
        ("sluice.internal".to_string(), 200),
        (format!("127.0.0.1:{port}"), 200),
        (format!("sluice.example.net:{port}"), 403),
    ] {
        let answer = get(&listed, "/api/v1/catalog", host.clone(), Some(token))
            .await
            .unwrap();
        assert_eq!(answer.status(), status, "{host}");
    }
}

/// Neither a token nor the opt-in: the gateway makes a token, prints it once with how to use
/// it, keeps it owner-only in the data directory (the same one after a restart), and
/// answers only with it; `sluice ctl --data-dir` finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_or_the_opt_in_a_token_is_generated_and_required() {
    let mut sluice = Sluice::builder().admin("").start().await;
    let file = sluice.data_dir().join("admin-token");
    let token = std::fs::read_to_string(&file).unwrap().trim().to_string();
    assert_eq!(token.len(), 64, "{token}");
    assert!(token.bytes().all(|b| b.is_ascii_hexdigit()));
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{mode:o}");
    }
    let log = sluice.log();
    assert_eq!(
        log.matches(token.as_str()).count(),
        1,
        "printed once:\n{log}"
    );
    assert!(log.contains("sluice ctl --token"), "{log}");

    let none = client()
        .get(sluice.url("/api/v1/catalog"))
        .send()
        .await
        .unwrap();
    assert_eq!(none.status(), 401, "loopback alone is not enough any more");
    assert!(none.headers().contains_key("www-authenticate"));
    assert_admitted(&sluice, &token).await;
    // Open routes stay open.
    for path in ["/api/v1/openapi.json", "/api/v1/scaling", "/metrics"] {
        let open = client().get(sluice.url(path)).send().await.unwrap();
        assert_eq!(open.status(), 200, "{path}");
    }

    // `sluice ctl` with the data directory, and without (401).
    let ctl = |extra: &[&str]| {
        std::process::Command::new(sluice_bin())
            .arg("ctl")
            .arg("--server")
            .arg(sluice.url(""))
            .args(extra)
            .args(["get", "buses"])
            .env_remove("SLUICE_ADMIN_TOKEN")
            .env_remove("SLUICE_DATA_DIR")
            .output()
            .unwrap()
    };
    let found = ctl(&["--data-dir", sluice.data_dir().to_str().unwrap()]);
    assert!(
        found.status.success(),
        "{}",
        String::from_utf8_lossy(&found.stderr)
    );
    let missing = ctl(&[]);
    assert!(!missing.status.success());
    assert!(String::from_utf8_lossy(&missing.stderr).contains("401"));

    // Stable across restarts.
    sluice.terminate();
    sluice.restart().await;
    assert_eq!(
        std::fs::read_to_string(&file).unwrap().trim(),
        token,
        "the kept token is reused"
    );
    assert_admitted(&sluice, &token).await;
}

/// The local opt-in compares the canonical peer address: on a `[::]` listener 127.0.0.1
/// arrives as `::ffff:127.0.0.1` and is loopback (it was refused with 403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dual_stack_listener_answers_loopback_clients_with_the_opt_in() {
    let sluice = Sluice::builder().listen_ip("::").start().await;
    sluice_tests::admin::expect(&sluice, reqwest::Method::GET, "/api/v1/catalog", 200).await;
    sluice_tests::run_ok(
        std::process::Command::new(sluice_bin())
            .args(["ctl", "--server", &sluice.url(""), "get", "buses"])
            .env_remove("SLUICE_ADMIN_TOKEN"),
    );
}

/// Behind a proxy on the same host every client is "local": with the opt-in and no token,
/// a request carrying a proxy's headers is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_requests_are_not_local() {
    let sluice = Sluice::start().await;
    for (header, value) in [
        ("x-forwarded-for", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7"),
        ("x-real-ip", "203.0.113.7"),
        ("via", "1.1 nginx"),
    ] {
        let answer = client()
            .get(sluice.url("/api/v1/catalog"))
            .header(header, value)
            .send()
            .await
            .unwrap();
        let (status, problem) = problem(answer).await;
        assert_eq!(status, 403, "{header}");
        assert_eq!(problem["field"], header, "{problem}");
    }
}

/// Calls of one command, from Redis's own statistics.
async fn redis_calls(url: &str, command: &str) -> u64 {
    let client = redis::Client::open(url).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut conn)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// A flood of `/api/v1/scaling` (any query) reads the shards' positions about once a
/// second, not once per call (each call used to read every shard's end and positions).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scaling_signal_reads_redis_at_most_once_a_second() {
    let redis = RedisServer::start();
    let sluice = Sluice::builder()
        .distributed(&redis.url(), "scaling-cache")
        .shards(4)
        .start()
        .await;
    let client = client();
    // Settled: the first reading made, the tasks started (they read positions too).
    sluice_tests::admin::expect(&sluice, reqwest::Method::GET, "/api/v1/scaling", 200).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = redis_calls(&redis.url(), "hgetall").await;
    let started = Instant::now();
    for i in 0..50 {
        let query = match i % 3 {
            0 => "",
            1 => "?target_lag=10",
            _ => "?target_lag=5&max_replicas=2",
        };
        let answer = sluice_tests::send_expecting(
            client.get(sluice.url(&format!("/api/v1/scaling{query}"))),
            200,
        )
        .await;
        let body: Value = answer.json().await.unwrap();
        assert!(body["desired_replicas"].is_u64(), "{body}");
    }
    let seconds = started.elapsed().as_secs();
    let reads = redis_calls(&redis.url(), "hgetall").await - before;
    // One reading per second reads the 4 shards' positions; allow the background sampler
    // (every 5 s) on top. Uncached it was 50 x 4 = 200.
    let bound = 4 * (seconds + 2) + 8;
    assert!(
        reads <= bound,
        "{reads} HGETALL for 50 calls in {seconds} s (bound {bound})"
    );
}

/// A signed timestamp at the ends of `i64` is refused with the preset's 401 before the
/// signature is checked (it used to overflow `now - at`, a panic in debug builds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extreme_webhook_timestamps_are_refused() {
    let sluice = Sluice::builder()
        .extra(
            "[[webhooks]]\nname = \"sw\"\nbus = \"default\"\nverify = { preset = \"standard-webhooks\", secret = \"whsec_c3RhbmRhcmQtc2VjcmV0\" }\n\n\
             [[webhooks]]\nname = \"slack\"\nbus = \"default\"\nverify = { preset = \"slack\", secret = \"s\" }\n",
        )
        .start()
        .await;
    for at in [i64::MIN.to_string(), i64::MAX.to_string()] {
        for (hook, headers) in [
            (
                "sw",
                vec![
                    ("webhook-id", "msg_1".to_string()),
                    ("webhook-timestamp", at.clone()),
                    ("webhook-signature", "v1,AAAA".to_string()),
                ],
            ),
            (
                "slack",
                vec![
                    ("x-slack-request-timestamp", at.clone()),
                    ("x-slack-signature", "v0=00".to_string()),
                ],
            ),
        ] {
            let mut request = client()
                .post(sluice.url(&format!("/webhooks/{hook}")))
                .header("content-type", "application/json")
                .body("{}");
            for (k, v) in &headers {
                request = request.header(*k, v.as_str());
            }
            let (status, problem) = problem(request.send().await.unwrap()).await;
            assert_eq!(status, 401, "{hook} {at}: {problem}");
            assert!(
                problem["detail"]
                    .as_str()
                    .unwrap_or("")
                    .contains("away from now"),
                "{hook} {at}: {problem}"
            );
        }
    }
    assert!(sluice.is_alive());
}

/// Replicas cannot each generate a token (a request through a load balancer would meet
/// another replica's): distributed mode without a configured token or the local opt-in
/// stops at start with what to set, before it touches Redis or the data directory.
#[test]
fn distributed_mode_needs_a_configured_token() {
    let (dir, path) = sluice_tests::config_file("mode = \"distributed\"\nredis_url = \"redis://127.0.0.1:6379/\"\nredis_prefix = \"sluice-token-check\"\n");
    let data = dir.path().join("data");
    let out = std::process::Command::new(sluice_bin())
        .args(["serve", "--config"])
        .arg(&path)
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0"])
        .env_remove("SLUICE_ADMIN_TOKEN")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("distributed mode needs an admin token")
            && stderr.contains("SLUICE_ADMIN_TOKEN"),
        "{stderr}"
    );
    assert!(!data.join("admin-token").exists(), "no per-replica token");
}
