//! Secrets, files and egress stay where the operator put them (issue 26): catalog resources
//! read only the environment variables exposed for them (`admin.secret_env_prefix`), hold
//! no literal secret and show none, file targets write only under the data directory or
//! `targets.file_roots`, http targets do not reach link-local or metadata addresses, and the
//! data directory's files are private to the gateway's user.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::receiver::{Receiver, Reply};
use sluice_tests::{check_config, post, wait_jsonl, Sluice};

/// The answer to a JSON request to the admin API: status and body.
async fn send(method: reqwest::Method, url: &str, body: Option<Value>) -> (u16, Value) {
    let client = reqwest::Client::new();
    let mut request = client.request(method, url);
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let text = response.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

async fn put(sluice: &Sluice, path: &str, body: Value) -> (u16, Value) {
    send(reqwest::Method::PUT, &sluice.url(path), Some(body)).await
}

async fn get(sluice: &Sluice, path: &str) -> (u16, Value) {
    send(reqwest::Method::GET, &sluice.url(path), None).await
}

/// A rule of the bus `default` with one http target.
/// `PUT`s rule `name` of bus `default`: one HTTP target to `url`.
async fn put_http_rule(sluice: &Sluice, name: &str, url: &str) -> (u16, Value) {
    let path = format!("/api/v1/buses/default/rules/{name}");
    put(sluice, &path, http_rule(url, json!({}))).await
}

fn http_rule(url: &str, extra: Value) -> Value {
    let mut target = json!({"type": "http", "name": "out", "url": url});
    if let (Some(target), Some(extra)) = (target.as_object_mut(), extra.as_object()) {
        target.extend(extra.clone());
    }
    json!({"targets": [target]})
}

/// Asserts a 400 problem naming `pointer`, whose detail says `says`.
fn refused(answer: &(u16, Value), pointer: &str, says: &str) {
    let (status, body) = answer;
    assert_eq!(*status, 400, "{body}");
    assert_eq!(body["pointer"], pointer, "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(says), "`{says}` not in: {body}");
}

async fn catalog_version(sluice: &Sluice) -> Value {
    let (status, body) = get(sluice, "/api/v1/catalog").await;
    assert_eq!(status, 200, "{body}");
    body["version"].clone()
}

/// The exfiltration rule of the issue: an http target to the caller's URL whose token is
/// another variable of the replica. Refused, naming the field, and nothing is ever sent.
#[tokio::test]
async fn a_rule_cannot_read_variables_that_are_not_exposed() {
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .env("OTHER_SECRET", "the-other-secret-value")
        .env("SLUICE_REDIS_URL", "redis://:redis-password@127.0.0.1:1/")
        .start()
        .await;
    let before = catalog_version(&sluice).await;
    for name in ["OTHER_SECRET", "SLUICE_REDIS_URL", "SLUICE_ADMIN_TOKEN"] {
        let rule = http_rule(
            &receiver.url("/exfil"),
            json!({"auth": {"type": "bearer", "token": format!("env:{name}")}}),
        );
        let answer = put(&sluice, "/api/v1/buses/default/rules/exfil", rule).await;
        refused(
            &answer,
            "/targets/0/auth/token",
            &format!(
                "`{name}` is not an exposed secret: catalog resources may read only environment variables whose names start with `SLUICE_SECRET_` (admin.secret_env_prefix)"
            ),
        );
    }
    // Through `apply` too, with the pointer into the applied document.
    let apply = json!({"rules": [{"name": "exfil", "bus": "default", "targets": [
        {"type": "http", "name": "out", "url": receiver.url("/exfil"),
         "signing_secret": "env:OTHER_SECRET"}]}]});
    let answer = send(
        reqwest::Method::POST,
        &sluice.url("/api/v1/catalog/apply"),
        Some(apply),
    )
    .await;
    refused(
        &answer,
        "/rules/0/targets/0/signing_secret",
        "`OTHER_SECRET`",
    );
    assert_eq!(catalog_version(&sluice).await, before);
    let (status, _) = get(&sluice, "/api/v1/buses/default/rules/exfil").await;
    assert_eq!(status, 404);

    sluice_tests::post_event(&sluice, "e-1").await;
    sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() == 1)
        .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        receiver.received().is_empty(),
        "an event left for the caller"
    );
}

/// A variable under the prefix works: its value goes out in the request and nowhere else:
/// not in the catalog, the rule, the connectors, nor the log.
#[tokio::test]
async fn an_exposed_secret_is_sent_and_never_shown() {
    let value = "exposed-token-4bd1c0ffee";
    let receiver = Receiver::start().await;
    let sluice = Sluice::builder()
        .env("SLUICE_SECRET_X", value)
        .start()
        .await;
    let rule = http_rule(
        &receiver.url("/hook"),
        json!({"auth": {"type": "bearer", "token": "env:SLUICE_SECRET_X"}}),
    );
    let (status, body) = put(&sluice, "/api/v1/buses/default/rules/hook", rule).await;
    assert_eq!(status, 201, "{body}");
    // The new subscription starts at the end of the bus: post until one arrives.
    let client = reqwest::Client::new();
    for i in 0..50 {
        post(&client, &sluice.events_url(), &format!("h-{i}"), "{}").await;
        if !receiver.received().is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let got = receiver
        .wait_for(Duration::from_secs(10), |r| !r.is_empty())
        .await;
    assert_eq!(
        got[0].header("authorization"),
        Some(format!("Bearer {value}").as_str())
    );
    for path in [
        "/api/v1/catalog",
        "/api/v1/buses/default/rules/hook",
        "/api/v1/buses/default/rules",
        "/api/v1/connectors",
        "/api/v1/cluster",
    ] {
        let (status, body) = get(&sluice, path).await;
        assert_eq!(status, 200, "{path}: {body}");
        assert!(!body.to_string().contains(value), "{path} shows it: {body}");
    }
    assert!(!sluice.log().contains(value), "the log shows it");
    let stored = std::fs::read_to_string(sluice.data_dir().join("catalog.json")).unwrap();
    assert!(stored.contains("env:SLUICE_SECRET_X") && !stored.contains(value));
}

/// No kind of resource takes a literal secret, and the refusal does not repeat it.
#[tokio::test]
async fn literal_secrets_are_refused_in_every_resource() {
    let sluice = Sluice::builder().start().await;
    let before = catalog_version(&sluice).await;
    let literal = "literal-s3cret-value";
    let url = "http://127.0.0.1:9/hook";
    for (rule, pointer) in [
        (
            http_rule(url, json!({"auth": {"type": "bearer", "token": literal}})),
            "/targets/0/auth/token",
        ),
        (
            http_rule(
                url,
                json!({"signing_secret": "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"}),
            ),
            "/targets/0/signing_secret",
        ),
        (
            http_rule(
                url,
                json!({"auth": {"type": "basic", "username": "u", "password": literal}}),
            ),
            "/targets/0/auth/password",
        ),
        (
            http_rule(
                url,
                json!({"auth": {"type": "api-key", "header": "x-key", "key": literal}}),
            ),
            "/targets/0/auth/key",
        ),
        (
            http_rule(&format!("http://user:{literal}@127.0.0.1:9/"), json!({})),
            "/targets/0/url",
        ),
        (
            http_rule(
                url,
                json!({"headers": {"authorization": format!("Bearer {literal}")}}),
            ),
            "/targets/0/headers/authorization",
        ),
        (
            json!({"targets": [{"type": "redis-stream", "name": "out", "stream": "s",
                "url": format!("redis://:{literal}@127.0.0.1:6379/0")}]}),
            "/targets/0/url",
        ),
    ] {
        let answer = put(&sluice, "/api/v1/buses/default/rules/leak", rule).await;
        refused(&answer, pointer, "the catalog never holds");
        assert!(!answer.1.to_string().contains(literal), "{}", answer.1);
    }
    let bus = json!({"shards": 1, "auth": {"keys": [literal]}});
    let answer = put(&sluice, "/api/v1/buses/keyed", bus).await;
    refused(
        &answer,
        "/auth/keys/0",
        "the catalog never holds a key in clear",
    );
    assert!(!answer.1.to_string().contains(literal), "{}", answer.1);
    // Digests are not secrets.
    let digest = "sha256:a4ae87b73fa5645e6aee415a6f72be4dcbd99d057a7b40cb1b867c181d179260";
    let bus = json!({"shards": 1, "auth": {"keys": [digest]}});
    let (status, body) = put(&sluice, "/api/v1/buses/keyed", bus).await;
    assert_eq!(status, 201, "{body}");
    assert_ne!(catalog_version(&sluice).await, before);
}

/// The configuration file seeds the catalog, so it follows the same rules: `check-config`
/// refuses a literal secret or an unexposed variable, naming the target.
#[test]
fn the_configuration_file_follows_the_catalog_policy() {
    let check = |admin: &str, target: &str| {
        check_config(&format!(
            "[admin]\nallow_local_without_token = true\n{admin}\n\n[[buses]]\nname = \"b\"\n\n[[rules]]\nname = \"r\"\nbus = \"b\"\n[[rules.targets]]\ntype = \"http\"\nname = \"h\"\nurl = \"http://127.0.0.1:9/\"\n{target}\n"
        ))
    };
    let (ok, out) = check(
        "",
        "auth = { type = \"bearer\", token = \"t0ken-in-the-file\" }",
    );
    assert!(!ok, "{out}");
    assert!(
        out.contains("c.toml:")
            && out.contains("rule `r`: target `h`: the catalog never holds a secret"),
        "{out}"
    );
    assert!(!out.contains("t0ken-in-the-file"), "{out}");
    let (ok, out) = check("", "auth = { type = \"bearer\", token = \"env:HOME\" }");
    assert!(
        !ok && out.contains("`HOME` is not an exposed secret"),
        "{out}"
    );
    let (ok, out) = check(
        "",
        "auth = { type = \"bearer\", token = \"env:SLUICE_SECRET_T\" }",
    );
    assert!(ok, "{out}");
    // Another prefix, chosen by the operator.
    let hooks = "secret_env_prefix = \"HOOKS_\"";
    let (ok, out) = check(
        hooks,
        "auth = { type = \"bearer\", token = \"env:HOOKS_T\" }",
    );
    assert!(ok, "{out}");
    let (ok, out) = check(
        hooks,
        "auth = { type = \"bearer\", token = \"env:SLUICE_SECRET_T\" }",
    );
    assert!(!ok && out.contains("start with `HOOKS_`"), "{out}");
    // A file target outside the data directory and the roots.
    let (ok, out) = check(
        "",
        "[[rules.targets]]\ntype = \"file\"\nname = \"f\"\npath = \"/etc/sluice-pwned.jsonl\"",
    );
    assert!(
        !ok && out.contains("outside the allowed file roots"),
        "{out}"
    );
}

/// Files, directories and the catalog of the data directory are the gateway user's only;
/// a catalog left 0644 by an older version is tightened at start.
#[tokio::test]
async fn data_files_are_private_to_the_gateway_user() {
    let mut sluice = Sluice::builder()
        .extra("\n[[buses]]\nname = \"dedup\"\nshards = 2\ndedup_window = \"1m\"\n")
        .start()
        .await;
    let client = reqwest::Client::new();
    sluice_tests::post_many(&client, &sluice.events_url(), "p", 0..5, |_| {
        "{}".to_string()
    })
    .await;
    let bus = sluice.url("/buses/dedup/events");
    sluice_tests::post_many(&client, &bus, "d", 0..3, |_| "{}".to_string()).await;
    // A change through the API rewrites catalog.json.
    let rule =
        json!({"targets": [{"type": "file", "name": "f", "path": "{data_dir}/api/out.jsonl"}]});
    let (status, body) = put(&sluice, "/api/v1/buses/default/rules/api", rule).await;
    assert_eq!(status, 201, "{body}");
    sluice
        .wait_delivered(Duration::from_secs(10), |e| e.len() == 5)
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    sluice.terminate();
    assert_private(sluice.data_dir());

    let catalog = sluice.data_dir().join("catalog.json");
    std::fs::set_permissions(&catalog, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::set_permissions(sluice.data_dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
    sluice.restart().await;
    let mode = std::fs::metadata(&catalog).unwrap().permissions().mode();
    assert_eq!(
        mode & 0o777,
        0o600,
        "catalog.json is {mode:o} after a restart"
    );
    let mode = std::fs::metadata(sluice.data_dir())
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "the data directory is {mode:o}");
}

/// Every file and directory under `dir` is closed to group and others.
fn assert_private(dir: &Path) {
    let mut seen = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        let meta = std::fs::symlink_metadata(&at).unwrap();
        let mode = meta.permissions().mode();
        assert_eq!(mode & 0o077, 0, "{} is {:o}", at.display(), mode & 0o777);
        seen += 1;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&at).unwrap() {
                stack.push(entry.unwrap().path());
            }
        }
    }
    // The catalog, positions, worker id, the LOCK, logs, outputs: not an empty directory.
    assert!(seen > 10, "only {seen} entries under {}", dir.display());
}

/// The file target of the cross-site request: a path outside the data directory and
/// `targets.file_roots` is refused (400, `/targets/0/path`) and nothing is created; so is a
/// symlink in the data directory that leads out; a directory listed in `file_roots` works.
#[tokio::test]
async fn file_targets_write_only_under_the_allowed_roots() {
    let outside = tempfile::tempdir().unwrap();
    let root = tempfile::tempdir().unwrap();
    let sluice = Sluice::builder().file_root(root.path()).start().await;
    let file_rule = |path: &str| json!({"targets": [{"type": "file", "name": "f", "path": path}]});
    let pwned = outside.path().join("anywhere/pwned.jsonl");
    let (x, at) = ("/api/v1/buses/default/rules/x", "/targets/0/path");
    let answer = put(&sluice, x, file_rule(&pwned.to_string_lossy())).await;
    refused(&answer, at, "is outside the allowed file roots");
    let answer = put(&sluice, x, file_rule("{data_dir}/../escape.jsonl")).await;
    refused(&answer, at, "contains `..`");
    std::os::unix::fs::symlink(outside.path(), sluice.data_dir().join("escape")).unwrap();
    let answer = put(&sluice, x, file_rule("{data_dir}/escape/pwned.jsonl")).await;
    refused(&answer, at, "resolves to");
    // Dead-letter targets are targets too.
    let dead = json!({"targets": [{"type": "http", "name": "h", "url": "http://127.0.0.1:9/",
        "dead_letter": {"target": {"type": "file", "name": "d", "path": pwned.to_string_lossy()}}}]});
    let answer = put(&sluice, x, dead).await;
    refused(&answer, "/targets/0/dead_letter/target/path", "outside");

    let listed = root.path().join("out/listed.jsonl");
    let (status, body) = put(
        &sluice,
        "/api/v1/buses/default/rules/listed",
        file_rule(&listed.to_string_lossy()),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let client = reqwest::Client::new();
    // The new subscription starts at the end of the bus: post until one arrives.
    for i in 0..50 {
        post(&client, &sluice.events_url(), &format!("f-{i}"), "{}").await;
        if listed.exists() && !sluice_tests::read_jsonl(&listed).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sluice_tests::wait_jsonl(&listed, Duration::from_secs(10), |e| !e.is_empty()).await;
    let mode = std::fs::metadata(&listed).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "a new output file is {mode:o}");

    post(&client, &sluice.events_url(), "last", "{}").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        std::fs::read_dir(outside.path()).unwrap().count() == 0,
        "something was written outside the roots"
    );
}

/// http and function targets do not reach link-local and metadata addresses unless the
/// operator allows it; loopback stays allowed.
#[tokio::test]
async fn metadata_addresses_are_refused_unless_allowed() {
    let sluice = Sluice::builder().start().await;
    for url in [
        "http://169.254.169.254/latest/meta-data",
        "http://[fd00:ec2::254]/latest/meta-data",
        "http://[::ffff:169.254.169.254]/",
        "http://100.100.100.200/latest/meta-data",
    ] {
        let answer = put_http_rule(&sluice, "meta", url).await;
        refused(&answer, "/targets/0/url", "targets.allow_private_egress");
    }
    let function = json!({"targets": [{"type": "function", "name": "fn",
        "url": "http://169.254.169.254/fn", "reply_bus": "default"}]});
    let answer = put(&sluice, "/api/v1/buses/default/rules/meta", function).await;
    refused(&answer, "/targets/0/url", "cloud metadata");
    let (status, body) = put_http_rule(&sluice, "local", "http://127.0.0.1:9/hook").await;
    assert_eq!(status, 201, "{body}");

    let allowed = Sluice::builder()
        .extra("\n[targets]\nallow_private_egress = true\n")
        .start()
        .await;
    let metadata = "http://169.254.169.254/latest/meta-data";
    let (status, body) = put_http_rule(&allowed, "meta", metadata).await;
    assert_eq!(status, 201, "{body}");
}

/// Credentials and query strings of target URLs are never shown.
#[tokio::test]
async fn target_url_secrets_stay_out_of_logs_status_and_dead_letters() {
    let receiver = Receiver::start().await;
    receiver.default_reply(Reply::Status(400));
    // (A password in the URL itself is refused: the catalog holds no secret.)
    let refused = receiver.url("/hook?token=t0k3n");
    let closed_port = sluice_tests::free_port();
    let unreachable = format!("http://127.0.0.1:{closed_port}/hook?token=t0k3n");
    let dead = "[rules.targets.retry]\nmax_attempts = 1\n[rules.targets.dead_letter.target]\ntype = \"file\"\nname = \"dead\"\npath = \"{data_dir}/dead.jsonl\"";
    let dead = format!("timeout = \"2s\"\n{dead}");
    let sluice = Sluice::builder()
        .http_target("refused", &refused, &dead)
        .http_target("unreachable", &unreachable, &dead)
        .start()
        .await;
    sluice_tests::post_event(&sluice, "s-1").await;
    let dead_path = sluice.data_dir().join("dead.jsonl");
    let letters = wait_jsonl(&dead_path, Duration::from_secs(15), |e| e.len() >= 2).await;
    let status = sluice.cluster_view().await;
    let shown = format!(
        "{}\n{}\n{status}",
        std::fs::read_to_string(&dead_path).unwrap(),
        sluice.log()
    );
    assert!(
        letters
            .iter()
            .any(|l| l["deadlettertarget"].as_str().unwrap().contains("?***")),
        "{letters:?}"
    );
    assert!(!shown.contains("t0k3n"), "the token is shown:\n{shown}");
}
