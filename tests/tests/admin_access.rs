//! How the admin API is reached, through the real binary: tokens (hashed in the file or
//! from `SLUICE_ADMIN_TOKEN`, for the server and for `ctl`), an admin address of its own
//! (`admin.listen`, `SLUICE_ADMIN_LISTEN`) apart from ingress, and the console served next
//! to the admin API. (Cross-site requests and the local opt-in: `admin_security.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use reqwest::Client;
use sluice_tests::admin::{check_openapi, ctl, Api, Recorder};
use sluice_tests::{free_port, post_typed, sluice_bin, Sluice};

/// A console request: its path, the status and a header of the answer, and what that
/// header's value must be.
type Check = (&'static str, u16, &'static str, fn(&str) -> bool);

/// A gateway whose admin API listens on a port of its own, and that port.
async fn with_admin_port() -> (Sluice, u16) {
    let port = free_port();
    let sluice = Sluice::builder()
        .admin(&format!(
            "allow_local_without_token = true\nlisten = \"127.0.0.1:{port}\""
        ))
        .start()
        .await;
    (sluice, port)
}

const TOKEN: &str = "s3cret-admin-token";

/// Tokens of the file (hashed by `ctl hash-token`): none or a wrong one is 401, the old
/// aliases too; the OpenAPI document and the scaling signal stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_credentials() {
    let token = TOKEN;
    let hash = {
        let out = std::process::Command::new(sluice_bin())
            .args(["ctl", "hash-token", token])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    };
    assert!(hash.starts_with("sha256:"), "{hash}");
    let sluice = Sluice::builder()
        .admin(&format!("tokens = [\"{hash}\"]"))
        .start()
        .await;
    let recorder = Recorder::default();
    let mut api = Api::new(&sluice, &recorder);
    let none = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(none.status, 401);
    assert_eq!(none.headers["content-type"], "application/problem+json");
    assert!(none.headers.contains_key("www-authenticate"));
    api.token = Some("wrong".to_string());
    let bad = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(bad.status, 401);
    // The old aliases are guarded too.
    let alias = api.get("/admin/cluster", "/admin/cluster").await;
    assert_eq!(alias.status, 401);
    api.token = Some(token.to_string());
    let good = api.get("/api/v1/buses", "/api/v1/buses").await;
    assert_eq!(good.status, 200);
    // Open: the OpenAPI document and the scaling signal (read by autoscalers).
    api.token = None;
    assert_eq!(
        api.get("/api/v1/openapi.json", "/api/v1/openapi.json")
            .await
            .status,
        200
    );
    assert_eq!(
        api.get("/api/v1/scaling", "/api/v1/scaling").await.status,
        200
    );
    check_openapi(&recorder, "auth");
}

/// `SLUICE_ADMIN_TOKEN` works for the server and for ctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_of_the_environment_guards_the_server_and_serves_ctl() {
    let token = TOKEN;
    let env = Sluice::builder()
        .env("SLUICE_ADMIN_TOKEN", token)
        .start()
        .await;
    let out = ctl(&env, &["get", "buses"], Some(token));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(&env, &["get", "buses"], Some("nope"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
}

/// A separate admin address: the admin API is there and not on the ingress address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listen_serves_the_admin_api_apart_from_ingress() {
    let (sluice, port) = with_admin_port().await;
    let on_ingress = reqwest::get(sluice.url("/api/v1/buses")).await.unwrap();
    assert_eq!(on_ingress.status(), 404);
    let on_admin = reqwest::get(format!("http://127.0.0.1:{port}/api/v1/buses"))
        .await
        .unwrap();
    assert_eq!(on_admin.status(), 200);
    // Events still go to the ingress address.
    post_typed(&sluice, "default", "i-1", "t").await;

    // The same through SLUICE_ADMIN_LISTEN (the top-level key `admin_listen`).
    let port = free_port();
    let env = Sluice::builder()
        .env("SLUICE_ADMIN_LISTEN", &format!("127.0.0.1:{port}"))
        .start()
        .await;
    let on_admin = reqwest::get(format!("http://127.0.0.1:{port}/api/v1/cluster"))
        .await
        .unwrap();
    assert_eq!(on_admin.status(), 200);
    assert_eq!(
        reqwest::get(env.url("/api/v1/cluster"))
            .await
            .unwrap()
            .status(),
        404
    );
}

/// The console is served by the gateway, offline (its files compiled in), next to the
/// admin API it uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_next_to_the_admin_api() {
    let sluice = Sluice::builder().start().await;
    let client = Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    // Each: the status, and a header with what its value must be.
    let get = |url: String| client.get(url).send();
    let redirect = get(sluice.url("/console")).await.unwrap();
    assert!(redirect.status().is_redirection());
    let mut html = String::new();
    let checks: [Check; 4] = [
        ("/console/", 200, "content-type", |v| {
            v.starts_with("text/html")
        }),
        ("/console/", 200, "content-security-policy", |v| {
            v.contains("default-src 'self'")
        }),
        ("/console/app.js", 200, "content-type", |v| {
            v.contains("javascript")
        }),
        ("/console/nope.js", 404, "content-type", |v| {
            v == "application/problem+json"
        }),
    ];
    for (path, status, header, ok) in checks {
        let answer = get(sluice.url(path)).await.unwrap();
        assert_eq!(answer.status(), status, "{path}");
        let value = answer.headers()[header].to_str().unwrap().to_string();
        assert!(ok(&value), "{path}: {header}: {value}");
        if path == "/console/" {
            html = answer.text().await.unwrap();
        }
    }
    assert!(html.contains("app.js"), "{html}");

    // With the admin API on its own address, the console is there (it calls /api/v1 on its
    // own origin) and not on the ingress address.
    let (apart, port) = with_admin_port().await;
    let there = get(format!("http://127.0.0.1:{port}/console/"))
        .await
        .unwrap();
    assert_eq!(there.status(), 200);
    let not_here = get(apart.url("/console/")).await.unwrap();
    assert_eq!(not_here.status(), 404);
}
