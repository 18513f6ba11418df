//! Webhook sources against the real binary: every preset's requests signed by the
//! provider's own library where one exists (`tests/scripts/sign_webhook.py`), valid ones
//! stored and delivered as CloudEvents, bad ones refused with 401 and nothing stored;
//! handshakes; delivery-id deduplication, also across two replicas.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use sluice_tests::{ids, post, python, repo_root, run_python, shared_redis, Sluice};

/// (preset, secret, whether it signs a timestamp).
const PRESETS: &[(&str, &str, bool)] = &[
    ("standard-webhooks", "whsec_c3RhbmRhcmQtc2VjcmV0", true),
    ("svix", "whsec_c3ZpeC1zZWNyZXQ=", true),
    ("github", "gh-secret", false),
    ("stripe", "whsec_stripe-secret", true),
    ("slack", "slack-signing-secret", true),
    ("shopify", "shopify-secret", false),
    ("gitlab", "gitlab-token", false),
    ("twilio", "twilio-auth-token", false),
    ("zoom", "zoom-secret-token", true),
    ("square", "square-signature-key", false),
    ("hubspot", "hubspot-client-secret", true),
    ("linear", "linear-secret", false),
    ("intercom", "intercom-client-secret", false),
    ("paddle", "pdl_ntfset_secret", true),
    ("typeform", "typeform-secret", false),
    ("calendly", "calendly-signing-key", true),
    ("bitbucket", "bitbucket-secret", false),
    ("jira", "jira-secret", false),
    ("woocommerce", "woo-secret", false),
    ("sentry", "sentry-client-secret", false),
    ("vercel", "vercel-secret", false),
    ("twitch", "twitch-secret-0123", true),
    ("hmac", "generic-secret", true),
    ("basic", "user:password", false),
    ("api-key", "key-123", false),
];

/// The old secret each source still accepts (rotation).
fn old_secret(preset: &str) -> &'static str {
    match preset {
        "standard-webhooks" | "svix" => "whsec_b2xkLXNlY3JldA==",
        "basic" => "old:password",
        _ => "old-secret",
    }
}

fn public_url(preset: &str) -> String {
    format!("https://hooks.example.com/{preset}?tenant=1")
}

fn config() -> String {
    let mut text = String::new();
    for (preset, secret, _) in PRESETS {
        let extra = match *preset {
            "hmac" => ", header = \"x-signature\", algorithm = \"sha512\", prefix = \"sha512=\", signed = \"{timestamp}.{body}\", timestamp_header = \"x-timestamp\"",
            "api-key" => ", header = \"x-api-key\"",
            _ => "",
        };
        let id = match *preset {
            "hmac" | "basic" | "api-key" => "id = { jsonpath = \"$.meta.delivery\" }\ntype = { jsonpath = \"$.kind\", prefix = \"com.example.\" }\n",
            _ => "",
        };
        text.push_str(&format!(
            "[[webhooks]]\nname = \"{preset}\"\nbus = \"default\"\nverify = {{ preset = \"{preset}\", secrets = [\"{}\", \"{secret}\"]{extra} }}\nurl = \"{}\"\nextensions = {{ tenant = \"x-tenant\" }}\n{id}\n",
            old_secret(preset),
            public_url(preset),
        ));
    }
    text.push_str(
        "[[webhooks]]\nname = \"guarded\"\nbus = \"default\"\nverify = { preset = \"github\", secret = \"g\" }\nallowed_origins = [\"https://sender.example\"]\nallowed_rate = 120\n",
    );
    text
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// The body a provider would send, with its delivery id where the provider puts it there.
fn body_of(preset: &str, id: &str) -> (String, &'static str) {
    match preset {
        "twilio" => (
            format!("MessageSid={id}&Body=hello+there&From=%2B15551234567"),
            "application/x-www-form-urlencoded",
        ),
        _ => (
            json!({
                "id": id, "event_id": id, "eventId": id, "type": "thing.happened",
                "event": {"type": "app_mention"}, "action": "opened", "object_kind": "push",
                "event_type": "order.paid", "topic": "conversation.created",
                "meta": {"delivery": id}, "kind": "order.paid", "created": now(),
                "payload": {"n": 1}
            })
            .to_string(),
            "application/json",
        ),
    }
}

fn sign(preset: &str, secret: &str, body: &str, ts: i64, id: &str) -> Vec<(String, String)> {
    sign_with(preset, secret, body, ts, id, json!({}))
}

fn sign_with(
    preset: &str,
    secret: &str,
    body: &str,
    ts: i64,
    id: &str,
    extra: Value,
) -> Vec<(String, String)> {
    let mut input = json!({
        "preset": preset, "secret": secret, "body": body, "timestamp": ts, "id": id,
        "url": public_url(preset),
    });
    if let (Value::Object(i), Value::Object(e)) = (&mut input, extra) {
        i.extend(e);
    }
    let out = run_python("sign_webhook.py", &[], input.to_string().as_bytes());
    let headers: BTreeMap<String, String> = serde_json::from_slice(&out).unwrap();
    headers.into_iter().collect()
}

/// [`send`] with a JSON body.
async fn send_json(
    client: &reqwest::Client,
    url: &str,
    body: &str,
    headers: &[(String, String)],
) -> (u16, Value) {
    send(client, url, body, "application/json", headers).await
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &str,
    content_type: &str,
    headers: &[(String, String)],
) -> (u16, Value) {
    let mut r = client
        .post(url)
        .header("content-type", content_type)
        .header("x-tenant", "acme")
        .body(body.to_string());
    for (k, v) in headers {
        r = r.header(k.as_str(), v.as_str());
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    if status >= 400 {
        assert_eq!(
            r.headers()["content-type"],
            "application/problem+json",
            "{url}"
        );
    }
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn every_preset_stores_valid_deliveries_and_refuses_bad_ones() {
    let sluice = Sluice::builder().shards(1).extra(&config()).start().await;
    let client = reqwest::Client::new();
    let mut accepted: Vec<String> = Vec::new();
    for (preset, secret, timed) in PRESETS {
        let url = sluice.url(&format!("/webhooks/{preset}"));
        let id = format!("{preset}-d1");
        let (body, ct) = body_of(preset, &id);
        let ts = now();

        // Valid, with the current secret.
        let h = sign(preset, secret, &body, ts, &id);
        let (status, answer) = send(&client, &url, &body, ct, &h).await;
        assert_eq!(status, 202, "{preset}: {answer}");
        accepted.push(answer["id"].as_str().unwrap().to_string());

        // Rotation: the old secret still verifies.
        let id2 = format!("{preset}-d2");
        let (body2, _) = body_of(preset, &id2);
        let h = sign(preset, old_secret(preset), &body2, ts, &id2);
        let (status, answer) = send(&client, &url, &body2, ct, &h).await;
        assert_eq!(status, 202, "{preset} rotated: {answer}");
        accepted.push(answer["id"].as_str().unwrap().to_string());

        // A secret it does not know.
        let id3 = format!("{preset}-bad");
        let (body3, _) = body_of(preset, &id3);
        let wrong = if preset.contains("webhooks") || *preset == "svix" {
            "whsec_d3Jvbmc="
        } else if *preset == "basic" {
            "user:wrong"
        } else {
            "wrong-secret"
        };
        let h = sign(preset, wrong, &body3, ts, &id3);
        let (status, answer) = send(&client, &url, &body3, ct, &h).await;
        assert_eq!(status, 401, "{preset} wrong secret: {answer}");
        assert!(answer["field"].is_string(), "{preset}: {answer}");

        // The body changed after signing (token and basic schemes do not sign the body).
        if !matches!(*preset, "gitlab" | "basic" | "api-key") {
            let h = sign(preset, secret, &body3, ts, &id3);
            let changed = body3.replacen("1", "2", 1);
            assert_ne!(changed, body3);
            let (status, answer) = send(&client, &url, &changed, ct, &h).await;
            assert_eq!(status, 401, "{preset} body changed: {answer}");
        }

        // Signed, but too long ago (replay).
        if *timed {
            let h = sign(preset, secret, &body3, ts - 3600, &id3);
            let (status, answer) = send(&client, &url, &body3, ct, &h).await;
            assert_eq!(status, 401, "{preset} expired: {answer}");
            assert!(
                answer["detail"].as_str().unwrap().contains("timestamp")
                    || answer["field"].as_str().unwrap().contains("timestamp"),
                "{preset}: {answer}"
            );
        }

        // No signature at all.
        let (status, _) = send(&client, &url, &body3, ct, &[]).await;
        assert_eq!(status, 401, "{preset} unsigned");
    }

    // A marker through the bus: delivered after everything stored before it (one shard).
    post(&client, &sluice.events_url(), "marker", "{}").await;
    let events = sluice
        .wait_delivered(Duration::from_secs(30), |e| {
            ids(e).contains(&"marker".to_string())
        })
        .await;
    let delivered = ids(&events);
    let mut expected = accepted.clone();
    expected.push("marker".to_string());
    assert_eq!(
        delivered, expected,
        "exactly the accepted deliveries, in order"
    );

    let by_id: HashMap<String, &Value> = events
        .iter()
        .map(|e| (e["id"].as_str().unwrap().to_string(), e))
        .collect();
    let github = by_id["github-d1"];
    assert_eq!(github["type"], "com.github.issues.opened");
    assert_eq!(github["source"], "/webhooks/github");
    assert_eq!(
        github["tenant"], "acme",
        "configured header kept as extension"
    );
    assert_eq!(github["datacontenttype"], "application/json");
    assert_eq!(github["data"]["payload"]["n"], 1, "the body as received");
    assert_eq!(by_id["stripe-d1"]["type"], "com.stripe.thing.happened");
    assert!(
        by_id["stripe-d1"]["time"].is_string(),
        "time from `created`"
    );
    assert_eq!(by_id["slack-d1"]["type"], "com.slack.app_mention");
    assert_eq!(by_id["standard-webhooks-d1"]["type"], "thing.happened");
    assert!(by_id["standard-webhooks-d1"]["time"].is_string());
    assert_eq!(by_id["shopify-d1"]["type"], "com.shopify.orders/create");
    assert_eq!(by_id["hmac-d1"]["type"], "com.example.order.paid");
    let twilio = events
        .iter()
        .find(|e| e["source"] == "/webhooks/twilio")
        .unwrap();
    assert_eq!(twilio["id"], "twilio-d1", "from I-Twilio-Idempotency-Token");
    assert_eq!(
        twilio["datacontenttype"],
        "application/x-www-form-urlencoded"
    );
    // Not JSON and not text: the body as received, in base64.
    assert!(twilio["data_base64"].is_string(), "{twilio}");
}

#[tokio::test]
async fn handshakes_are_answered() {
    let sluice = Sluice::builder().shards(1).extra(&config()).start().await;
    let client = reqwest::Client::new();
    let ts = now();

    // Slack's url_verification, signed like every Slack request.
    let body = json!({"type": "url_verification", "token": "t", "challenge": "ch-123"}).to_string();
    let h = sign("slack", "slack-signing-secret", &body, ts, "x");
    let slack = sluice.url("/webhooks/slack");
    let (status, answer) = send_json(&client, &slack, &body, &h).await;
    assert_eq!((status, &answer["challenge"]), (200, &json!("ch-123")));
    // Unsigned: refused, so the endpoint cannot be claimed by someone else.
    let (status, _) = send_json(&client, &slack, &body, &[]).await;
    assert_eq!(status, 401);

    // Zoom's endpoint.url_validation: encryptedToken = hex HMAC-SHA256(secret, plainToken).
    let body = json!({"event": "endpoint.url_validation", "payload": {"plainToken": "qgg8vlvZRS6UYooatFL8Aw"}, "event_ts": ts * 1000}).to_string();
    let h = sign("zoom", "zoom-secret-token", &body, ts, "x");
    let zoom = sluice.url("/webhooks/zoom");
    let (status, answer) = send_json(&client, &zoom, &body, &h).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["plainToken"], "qgg8vlvZRS6UYooatFL8Aw");
    let out = Command::new(python())
        .args([
            "-c",
            "import hmac,hashlib;print(hmac.new(b'zoom-secret-token',b'qgg8vlvZRS6UYooatFL8Aw',hashlib.sha256).hexdigest())",
        ])
        .output()
        .unwrap();
    assert_eq!(
        answer["encryptedToken"],
        String::from_utf8_lossy(&out.stdout).trim()
    );

    // Twitch EventSub's callback verification: the challenge as plain text.
    let body = json!({"challenge": "pogchamp-kappa-360noscope-vohiyo", "subscription": {"type": "channel.follow"}}).to_string();
    let h = sign_with(
        "twitch",
        "twitch-secret-0123",
        &body,
        ts,
        "m-1",
        json!({"message_type": "webhook_callback_verification"}),
    );
    let mut r = client
        .post(sluice.url("/webhooks/twitch"))
        .header("content-type", "application/json")
        .body(body);
    for (k, v) in &h {
        r = r.header(k.as_str(), v.as_str());
    }
    let r = r.send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "pogchamp-kappa-360noscope-vohiyo");

    // CloudEvents Web Hook abuse protection, on a bus and on a webhook source.
    let options = |url: String, origin: &'static str| {
        client
            .request(reqwest::Method::OPTIONS, url)
            .header("WebHook-Request-Origin", origin)
            .send()
    };
    let r = options(sluice.events_url(), "https://any.example")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.headers()["webhook-allowed-origin"], "https://any.example");
    let r = options(sluice.url("/webhooks/guarded"), "https://sender.example")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(
        r.headers()["webhook-allowed-origin"],
        "https://sender.example"
    );
    assert_eq!(r.headers()["webhook-allowed-rate"], "120");
    let r = options(sluice.url("/webhooks/guarded"), "https://other.example")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 403);
    assert!(r.headers().get("webhook-allowed-origin").is_none());
    let r = options(sluice.url("/buses/nope/events"), "https://any.example")
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 404);

    // Unknown source.
    let nope = sluice.url("/webhooks/nope");
    let (status, answer) = send_json(&client, &nope, "{}", &[]).await;
    assert_eq!(status, 404);
    assert_eq!(answer["field"], "name");

    // Nothing of the above was stored: the marker is the only event.
    post(&client, &sluice.events_url(), "marker", "{}").await;
    let events = sluice
        .wait_delivered(Duration::from_secs(30), |e| !e.is_empty())
        .await;
    assert_eq!(ids(&events), vec!["marker".to_string()]);
}

#[tokio::test]
async fn a_redelivered_id_is_stored_once() {
    let mut sluice = Sluice::builder().shards(1).extra(&config()).start().await;
    let client = reqwest::Client::new();
    let url = sluice.url("/webhooks/github");
    let (body, ct) = body_of("github", "dup-1");
    let h = sign("github", "gh-secret", &body, now(), "dup-1");
    let (status, answer) = send(&client, &url, &body, ct, &h).await;
    assert_eq!((status, &answer["status"]), (202, &json!("accepted")));
    for _ in 0..3 {
        let (status, answer) = send(&client, &url, &body, ct, &h).await;
        assert_eq!((status, &answer["status"]), (200, &json!("duplicate")));
    }
    // A refused request does not take the id: its valid retry is stored.
    let (body2, _) = body_of("github", "dup-2");
    let bad = sign("github", "wrong", &body2, now(), "dup-2");
    assert_eq!(send(&client, &url, &body2, ct, &bad).await.0, 401);
    let good = sign("github", "gh-secret", &body2, now(), "dup-2");
    assert_eq!(send(&client, &url, &body2, ct, &good).await.0, 202);
    post(&client, &sluice.events_url(), "marker", "{}").await;
    let events = sluice
        .wait_delivered(Duration::from_secs(30), |e| {
            ids(e).contains(&"marker".to_string())
        })
        .await;
    assert_eq!(ids(&events), vec!["dup-1", "dup-2", "marker"]);

    // The records survive a restart (standalone: a file in the data directory).
    sluice.terminate();
    sluice.restart().await;
    let (status, answer) = send(&client, &url, &body, ct, &h).await;
    assert_eq!((status, &answer["status"]), (200, &json!("duplicate")));
    post(&client, &sluice.events_url(), "marker-2", "{}").await;
    let events = sluice
        .wait_delivered(Duration::from_secs(30), |e| {
            ids(e).contains(&"marker-2".to_string())
        })
        .await;
    assert_eq!(ids(&events), vec!["dup-1", "dup-2", "marker", "marker-2"]);
}

/// Two replicas sharing Redis get every delivery at the same time (a provider's retry
/// racing its first attempt): each delivery is stored exactly once.
#[tokio::test]
async fn distributed_replicas_store_a_concurrent_delivery_once() {
    let (redis_url, prefix) = shared_redis("webhook-dedup");
    let start = || {
        Sluice::builder()
            .shards(1)
            .distributed(&redis_url, &prefix)
            .extra(&config())
            .start()
    };
    let a = start().await;
    let b = start().await;
    let client = reqwest::Client::new();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let (url_a, url_b) = (a.url("/webhooks/github"), b.url("/webhooks/github"));
    const N: usize = 20;
    for i in 0..N {
        let id = format!("race-{i}");
        let (body, ct) = body_of("github", &id);
        let h = sign("github", "gh-secret", &body, now(), &id);
        let (ra, rb) = tokio::join!(
            send(&client, &url_a, &body, ct, &h),
            send(&client, &url_b, &body, ct, &h),
        );
        for (status, answer) in [ra, rb] {
            assert!(matches!(status, 200 | 202), "{status} {answer}");
            *statuses.entry(status).or_default() += 1;
        }
    }
    assert_eq!(statuses.get(&202), Some(&N), "{statuses:?}");
    assert_eq!(statuses.get(&200), Some(&N), "{statuses:?}");
    // What the bus took: one record per delivery (counted by the shard's sequence counter:
    // the stream itself is trimmed once every subscription has passed its entries).
    let client = redis::Client::open(redis_url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let (next, len): (usize, usize) = redis::pipe()
        .cmd("GET")
        .arg(sluice_tests::redis::shard_key(
            &prefix, "default", 0, "next",
        ))
        .cmd("XLEN")
        .arg(sluice_tests::redis::shard_key(&prefix, "default", 0, "log"))
        .query_async(&mut conn)
        .await
        .unwrap();
    eprintln!("sequence counter {next}, stream length {len}");
    assert_eq!(next, N);
    // And delivered once each, by whichever replica owns the shard.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let mut delivered = ids(&a.delivered());
        delivered.extend(ids(&b.delivered()));
        delivered.sort();
        let mut want: Vec<String> = (0..N).map(|i| format!("race-{i}")).collect();
        want.sort();
        if delivered == want {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline && delivered.len() <= N,
            "{delivered:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*:dedup:*"))
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(
        keys.len(),
        N,
        "one dedup record per delivery, under the prefix"
    );
}

/// Distributed, a delivery id is recorded by the same Redis script that appends the event
/// (one round trip): when the append fails nothing is recorded, so the provider's retry is
/// stored, and once stored the id is kept for the dedup window.
#[tokio::test]
async fn a_failed_append_records_no_delivery_id() {
    let (redis_url, prefix) = shared_redis("webhook-dedup-failed-append");
    let sluice = Sluice::builder()
        .shards(1)
        .distributed(&redis_url, &prefix)
        .extra(&config())
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.url("/webhooks/github");
    let redis = redis::Client::open(redis_url.as_str()).unwrap();
    let mut conn = redis.get_multiplexed_async_connection().await.unwrap();
    // The shard's stream key holds a string: every append to it fails.
    let stream = sluice_tests::redis::shard_key(&prefix, "default", 0, "log");
    let _: () = redis::cmd("SET")
        .arg(&stream)
        .arg("not a stream")
        .query_async(&mut conn)
        .await
        .unwrap();
    let (body, ct) = body_of("github", "fail-1");
    let h = sign("github", "gh-secret", &body, now(), "fail-1");
    let (status, answer) = send(&client, &url, &body, ct, &h).await;
    assert_eq!(status, 503, "{answer}");
    // Keys are a fixed-size hash of (webhook, delivery id), never the raw id.
    let key = sluice_tests::redis::shard_key(
        &prefix,
        "default",
        0,
        &format!(
            "dedup:{}",
            sluice::store::dedup::key(&["webhook", "github", "fail-1"])
        ),
    );
    let exists: i64 = redis::cmd("EXISTS")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(exists, 0, "no record of a delivery that was not stored");

    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    let (status, answer) = send(&client, &url, &body, ct, &h).await;
    assert_eq!((status, &answer["status"]), (202, &json!("accepted")));
    let (held, ttl): (String, i64) = redis::pipe()
        .cmd("GET")
        .arg(&key)
        .cmd("PTTL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(held, "done");
    assert!(ttl > 23 * 3_600_000, "kept for the 24 h window: {ttl} ms");
    let (status, answer) = send(&client, &url, &body, ct, &h).await;
    assert_eq!((status, &answer["status"]), (200, &json!("duplicate")));
    let len: usize = redis::cmd("XLEN")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(len, 1);
}

/// A bus that opts in (`dedup_window`) stores a CloudEvent's `source` + `id` once, also
/// within one batch and across a restart; other buses are not deduplicated.
#[tokio::test]
async fn a_bus_with_a_dedup_window_stores_each_cloudevent_once() {
    let extra = sluice_tests::bus_to_file_with("once", 2, "dedup_window = \"1h\"");
    let mut sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    let url = sluice.url("/buses/once/events");
    let post_one = |id: &'static str, source: &'static str| {
        client
            .post(&url)
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", source)
            .header("ce-type", "t")
            .header("content-type", "application/json")
            .body("{}")
            .send()
    };
    // The status code and the entry's status of one event posted.
    let outcome = |id: &'static str, source: &'static str| {
        let sent = post_one(id, source);
        async move {
            let r = sent.await.unwrap();
            let code = r.status().as_u16();
            let body: Value = r.json().await.unwrap();
            let entry = body["entries"][0]["status"].as_str().unwrap_or("");
            (code, entry.to_string())
        }
    };
    assert_eq!(outcome("e1", "/a").await, (202, "accepted".into()));
    assert_eq!(outcome("e1", "/a").await, (202, "duplicate".into()));
    assert_eq!(outcome("e1", "/b").await, (202, "accepted".into()));
    let batch = json!([
        {"specversion": "1.0", "id": "e1", "source": "/a", "type": "t"},
        {"specversion": "1.0", "id": "e2", "source": "/a", "type": "t"},
        {"specversion": "1.0", "id": "e2", "source": "/a", "type": "t"},
    ]);
    let r = sluice_tests::send_expecting(
        client
            .post(&url)
            .header("content-type", "application/cloudevents-batch+json")
            .body(batch.to_string()),
        202,
    )
    .await;
    let body: Value = r.json().await.unwrap();
    let statuses: Vec<&str> = body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["duplicate", "accepted", "duplicate"], "{body}");
    assert_eq!(body["failedEntryCount"], 0);

    sluice.terminate();
    sluice.restart().await;
    assert_eq!(outcome("e2", "/a").await, (202, "duplicate".into()));
    assert_eq!(outcome("e3", "/a").await, (202, "accepted".into()));
    let path = sluice.data_dir().join("once.jsonl");
    let events = sluice_tests::wait_jsonl(&path, Duration::from_secs(30), |e| e.len() >= 4).await;
    let mut got: Vec<String> = events
        .iter()
        .map(|e| {
            format!(
                "{}{}",
                e["source"].as_str().unwrap(),
                e["id"].as_str().unwrap()
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, ["/ae1", "/ae2", "/ae3", "/be1"]);
    // The default bus does not deduplicate.
    post(&client, &sluice.events_url(), "same", "{}").await;
    post(&client, &sluice.events_url(), "same", "{}").await;
    sluice
        .wait_delivered(Duration::from_secs(30), |e| ids(e).len() == 2)
        .await;
}

/// A bus with `auth` takes only requests with one of its keys: 401 without one, 403 with
/// another; keys given hashed (`sha256:`) or through the environment.
#[tokio::test]
async fn a_bus_with_keys_refuses_requests_without_one() {
    let extra = sluice_tests::bus_to_file_with(
        "secured",
        1,
        r#"auth = { keys = ["env:SLUICE_SECRET_TEST_BUS_KEY", "sha256:a4ae87b73fa5645e6aee415a6f72be4dcbd99d057a7b40cb1b867c181d179260"] }"#,
    );
    let sluice = Sluice::builder()
        .extra(&extra)
        .env("SLUICE_SECRET_TEST_BUS_KEY", "from-the-env")
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.url("/buses/secured/events");
    let attempt = |id: &'static str, header: Option<(&'static str, &'static str)>| {
        let mut r = sluice_tests::binary(&client, &url, id, "{}");
        if let Some((k, v)) = header {
            r = r.header(k, v);
        }
        r.send()
    };
    let r = attempt("none", None).await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    let problem: Value = r.json().await.unwrap();
    assert_eq!(problem["field"], "authorization");
    for (id, header, status) in [
        ("wrong", ("authorization", "Bearer nope"), 403),
        ("wrong2", ("x-api-key", "from-the-env-not"), 403),
        ("env", ("authorization", "Bearer from-the-env"), 202),
        ("hashed", ("x-api-key", "hashed-key"), 202),
    ] {
        let r = attempt(id, Some(header)).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{id}");
    }
    // Other buses stay open.
    post(&client, &sluice.events_url(), "open", "{}").await;
    let path = sluice.data_dir().join("secured.jsonl");
    let events = sluice_tests::wait_jsonl(&path, Duration::from_secs(30), |e| e.len() >= 2).await;
    assert_eq!(ids(&events), ["env", "hashed"]);
}

// ---------------------------------------------------------------------------------------
// Rate limits (token buckets per bus and per webhook source).

fn limited_bus(per_second: &str, burst: u32) -> String {
    sluice_tests::bus_to_file("limited").replace(
        "shards = 1\n",
        &format!("shards = 1\nrate_limit = {{ per_second = {per_second}, burst = {burst} }}\n"),
    )
}

#[tokio::test]
async fn a_bus_over_its_rate_limit_answers_429_with_retry_after_and_stores_nothing_more() {
    let hook = r#"
[[webhooks]]
name = "open"
bus = "limited"
verify = { preset = "none" }
rate_limit = { per_second = 1, burst = 2 }
"#;
    let sluice = Sluice::builder()
        .extra(&(limited_bus("2", 3) + hook))
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.url("/buses/limited/events");
    let mut accepted = Vec::new();
    let mut refused = 0;
    for i in 0..6 {
        let id = format!("rl-{i}");
        let r = sluice_tests::binary(&client, &url, &id, "{}")
            .send()
            .await
            .unwrap();
        match r.status().as_u16() {
            202 => accepted.push(id),
            429 => {
                refused += 1;
                let wait: u64 = r.headers()["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!((1..=2).contains(&wait), "Retry-After {wait}");
                assert_eq!(r.headers()["content-type"], "application/problem+json");
                let problem: Value = r.json().await.unwrap();
                assert_eq!(problem["field"], "rate_limit", "{problem}");
            }
            other => panic!("unexpected {other}"),
        }
    }
    // A burst of 3, and at 2 per second at most one more refilled while posting.
    assert!((3..=4).contains(&accepted.len()), "{accepted:?}");
    assert_eq!(accepted.len() + refused, 6);
    // Other buses are not limited.
    post(&client, &sluice.events_url(), "free", "{}").await;
    // After the refill, accepted again.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    sluice_tests::send_expecting(sluice_tests::binary(&client, &url, "rl-later", "{}"), 202).await;
    accepted.push("rl-later".to_string());
    let delivered =
        sluice_tests::wait_file(&sluice, "limited.jsonl", Duration::from_secs(10), |e| {
            e.len() >= accepted.len()
        })
        .await;
    assert_eq!(
        ids(&delivered),
        accepted,
        "exactly the accepted events, nothing refused"
    );

    // The webhook source has its own bucket (2 at once), counted after verification.
    let send = || {
        client
            .post(sluice.url("/webhooks/open"))
            .header("content-type", "application/json")
            .body("{\"n\":1}")
            .send()
    };
    let statuses = [
        send().await.unwrap().status().as_u16(),
        send().await.unwrap().status().as_u16(),
        send().await.unwrap().status().as_u16(),
    ];
    assert_eq!(&statuses[..2], &[202, 202], "{statuses:?}");
    assert_eq!(statuses[2], 429, "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_is_shared_by_the_replicas_of_a_cluster() {
    let (url, prefix) = shared_redis("ratelimit");
    let config = limited_bus("0.2", 4);
    let a = Sluice::builder()
        .distributed(&url, &prefix)
        .extra(&config)
        .start()
        .await;
    let b = Sluice::builder()
        .distributed(&url, &prefix)
        .extra(&config)
        .start()
        .await;
    a.wait_members(2).await;
    let client = reqwest::Client::new();
    let mut accepted = 0;
    for i in 0..8 {
        let target = if i % 2 == 0 { &a } else { &b };
        let r = sluice_tests::binary(
            &client,
            &target.url("/buses/limited/events"),
            &format!("shared-{i}"),
            "{}",
        )
        .send()
        .await
        .unwrap();
        match r.status().as_u16() {
            202 => accepted += 1,
            429 => {}
            other => panic!("unexpected {other}"),
        }
    }
    // One bucket of 4 for the cluster (refilling one every 5 s), not 4 per replica.
    assert_eq!(accepted, 4);
}

// ---------------------------------------------------------------------------------------
// JSON Schema validation of event data.

/// Events of a type with a schema are checked in every mode (and through a webhook
/// source); a failure is a 400 naming the JSON pointer and the rule, nothing is stored;
/// `dataschema` selects a schema by its URI; valid events are stored unchanged.
#[tokio::test]
async fn event_data_is_validated_against_the_json_schema_of_its_type() {
    let schema = repo_root().join("schemas/events/com.example.order.created.json");
    let extra = format!(
        r#"
[[schemas]]
bus = "default"
type = "com.example.order.created"
file = "{}"
uri = "https://sluice.dev/schemas/events/com.example.order.created.json"

[[webhooks]]
name = "orders"
bus = "default"
verify = {{ preset = "none" }}
type = {{ value = "com.example.order.created" }}
"#,
        schema.display()
    );
    let sluice = Sluice::builder().extra(&extra).start().await;
    let client = reqwest::Client::new();
    let url = sluice.events_url();
    let order = |id: &str, ty: &str, data: &str| {
        client
            .post(&url)
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "/shop")
            .header("ce-type", ty)
            .header("content-type", "application/json")
            .body(data.to_string())
    };
    let good = r#"{"order_id":"o-1","total":42.5,"items":[{"sku":"a","quantity":2}]}"#;
    assert_eq!(
        order("ok-1", "com.example.order.created", good)
            .send()
            .await
            .unwrap()
            .status(),
        202
    );

    let r = sluice_tests::send_expecting(
        order(
            "bad-1",
            "com.example.order.created",
            r#"{"order_id":"o-2","total":1,"items":[{"sku":"a","quantity":0}]}"#,
        ),
        400,
    )
    .await;
    assert_eq!(r.headers()["content-type"], "application/problem+json");
    let problem: Value = r.json().await.unwrap();
    assert_eq!(problem["field"], "/data/items/0/quantity", "{problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("minimum"),
        "{problem}"
    );

    let r = sluice_tests::send_expecting(
        order("bad-2", "com.example.order.created", r#"{"total":1}"#),
        400,
    )
    .await;
    let problem: Value = r.json().await.unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("required"),
        "{problem}"
    );

    // Other types are not checked; dataschema picks the schema whatever the type.
    assert_eq!(
        order("free-1", "com.example.other", r#"{"x":1}"#)
            .send()
            .await
            .unwrap()
            .status(),
        202
    );
    sluice_tests::send_expecting(
        order("bad-3", "com.example.other", r#"{"x":1}"#).header(
            "ce-dataschema",
            "https://sluice.dev/schemas/events/com.example.order.created.json",
        ),
        400,
    )
    .await;

    // Structured mode and a batch: the bad entry fails alone.
    let structured = json!({"specversion":"1.0","id":"ok-2","source":"/shop","type":"com.example.order.created","data":{"order_id":"o-3","total":0}});
    sluice_tests::send_expecting(
        client
            .post(&url)
            .header("content-type", "application/cloudevents+json")
            .body(structured.to_string()),
        202,
    )
    .await;
    let batch = json!([
        {"specversion":"1.0","id":"ok-3","source":"/shop","type":"com.example.order.created","data":{"order_id":"o-4","total":3}},
        {"specversion":"1.0","id":"bad-4","source":"/shop","type":"com.example.order.created","data":{"order_id":"o-5","total":"three"}}
    ]);
    let r = sluice_tests::send_batch(&client, &url, batch.to_string()).await;
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["failedEntryCount"], 1, "{body}");

    // Through a webhook source too: its events are checked like any other.
    let hook = |body: &'static str| {
        client
            .post(sluice.url("/webhooks/orders"))
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let r = hook(r#"{"order_id":"o-6"}"#).await.unwrap();
    assert_eq!(r.status(), 400);
    let r = hook(r#"{"order_id":"o-7","total":7}"#).await.unwrap();
    assert_eq!(r.status(), 202);

    let events = sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() >= 5)
        .await;
    assert_eq!(events.len(), 5);
    let mut got: Vec<String> = ids(&events)
        .into_iter()
        .filter(|id| ["free-1", "ok-1", "ok-2", "ok-3"].contains(&id.as_str()))
        .collect();
    got.sort();
    assert_eq!(got, vec!["free-1", "ok-1", "ok-2", "ok-3"]);
    assert!(events.iter().any(|e| e["data"]["order_id"] == "o-7"));
    // Stored unchanged.
    let ok = events.iter().find(|e| e["id"] == "ok-1").unwrap();
    assert_eq!(ok["data"], serde_json::from_str::<Value>(good).unwrap());
}

/// Each API key of a bus gets its own bucket (`auth.rate_limit`): one key over its limit is
/// refused while another key of the same bus still gets through.
#[tokio::test]
async fn each_api_key_of_a_bus_has_its_own_rate_limit() {
    let bus = sluice_tests::bus_to_file("keyed").replace(
        "shards = 1\n",
        "shards = 1\nauth = { keys = [\"env:SLUICE_SECRET_KEY_A\", \"env:SLUICE_SECRET_KEY_B\"], rate_limit = { per_second = 0.2, burst = 2 } }\n",
    );
    let sluice = Sluice::builder()
        .extra(&bus)
        .env("SLUICE_SECRET_KEY_A", "key-a")
        .env("SLUICE_SECRET_KEY_B", "key-b")
        .start()
        .await;
    let client = reqwest::Client::new();
    let url = sluice.url("/buses/keyed/events");
    let send = |key: &'static str, id: String| {
        sluice_tests::binary(&client, &url, &id, "{}")
            .header("x-api-key", key)
            .send()
    };
    let mut statuses = Vec::new();
    for i in 0..3 {
        statuses.push(send("key-a", format!("a-{i}")).await.unwrap());
    }
    let codes: Vec<u16> = statuses.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(codes, [202, 202, 429], "key a: a burst of 2");
    let refused = statuses.pop().unwrap();
    assert!(refused.headers().contains_key("retry-after"));
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["field"], "auth.rate_limit", "{problem}");
    for i in 0..2 {
        let r = send("key-b", format!("b-{i}")).await.unwrap();
        assert_eq!(r.status(), 202, "key b has its own bucket");
    }
    let r = send("key-c", "c-0".to_string()).await.unwrap();
    assert_eq!(
        r.status(),
        403,
        "an unknown key is refused before any bucket"
    );
    let delivered = sluice_tests::wait_file(&sluice, "keyed.jsonl", Duration::from_secs(10), |e| {
        e.len() >= 4
    })
    .await;
    assert_eq!(ids(&delivered), ["a-0", "a-1", "b-0", "b-1"]);
}
