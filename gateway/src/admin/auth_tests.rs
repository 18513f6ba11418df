use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request};
use axum::Router;
use serde_json::Value;

use super::auth::*;
use super::*;
use tower::ServiceExt as _;

use crate::catalog::{self, Catalog};
use crate::config::AdminConfig;

async fn router(hashes: Vec<[u8; 32]>) -> (Router, tempfile::TempDir) {
    let allow_local = hashes.is_empty();
    router_with(AdminAuth {
        hashes,
        allow_local,
        strategy: "sorted-hash".to_string(),
        replay_batch: 100,
        ..AdminAuth::default()
    })
    .await
}

async fn router_with(auth: AdminAuth) -> (Router, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let data = crate::store::embedded::DataDir::open(dir.path()).unwrap();
    let cluster: Arc<dyn crate::store::cluster::Cluster> =
        Arc::new(crate::store::cluster::LocalCluster::new("w"));
    let ingress = Arc::new(crate::ingress::state::IngressState::new(
        crate::ingress::state::Settings::empty(),
        crate::ingress::limits::Limits::default(),
        cluster.clone(),
        Arc::new(crate::ingress::ratelimit::LocalLimiter::default()),
        Arc::new(crate::store::embedded::MemoryDedup::bounded(1 << 20)),
    ));
    let catalog = Catalog::new(Arc::new(catalog::FileCatalog::new(dir.path())));
    let config = crate::config::Config::parse(std::path::Path::new("t.toml"), "").unwrap();
    let admission = crate::admission::Admission::new(
        config,
        crate::admission::Inventory::Embedded(dir.path().to_path_buf()),
    );
    let (_plans, plan) = tokio::sync::watch::channel(Arc::new(crate::runtime::Plan::default()));
    let state = AdminState::new(
        ingress,
        cluster,
        catalog,
        auth,
        admission,
        Arc::new(data.open_positions().unwrap()),
        Arc::new(crate::replay::LocalReplays::default()),
        plan,
    );
    (routes(Arc::new(state)), dir)
}

/// What the routes answer to `request`.
async fn send(router: &Router, request: Request) -> axum::response::Response {
    router.clone().oneshot(request).await.unwrap()
}

fn request(peer: [u8; 4], token: Option<&str>, path: &str) -> Request {
    let mut builder = axum::http::Request::get(path);
    if let Some(token) = token {
        builder = builder.header("authorization", format!("Bearer {token}"));
    }
    let mut request = builder.body(axum::body::Body::empty()).unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from((peer, 40000))));
    request
}

#[tokio::test]
async fn without_a_token_only_loopback_is_answered() {
    let (router, _dir) = router(Vec::new()).await;
    let local = send(&router, request([127, 0, 0, 1], None, "/api/v1/buses")).await;
    assert_eq!(local.status(), 200);
    let remote = send(&router, request([10, 1, 2, 3], None, "/api/v1/buses")).await;
    assert_eq!(remote.status(), 403);
    assert_eq!(remote.headers()["content-type"], "application/problem+json");
    // Open routes stay open.
    let doc = send(
        &router,
        request([10, 1, 2, 3], None, "/api/v1/openapi.json"),
    )
    .await;
    assert_eq!(doc.status(), 200);
}

#[tokio::test]
async fn with_tokens_any_peer_needs_one_of_them() {
    let hash = parse_hash(&hash_token("t0ken")).unwrap();
    let (router, _dir) = router(vec![hash]).await;
    for (peer, token, status) in [
        ([127, 0, 0, 1], None, 401),
        ([10, 1, 2, 3], None, 401),
        ([10, 1, 2, 3], Some("wrong"), 401),
        ([10, 1, 2, 3], Some("t0ken"), 200),
    ] {
        let answer = send(&router, request(peer, token, "/api/v1/buses")).await;
        assert_eq!(answer.status(), status, "{peer:?} {token:?}");
    }
}

#[test]
fn token_hashes_are_checked() {
    assert!(parse_hash("sha256:00").is_err());
    assert!(parse_hash(&"g".repeat(64)).is_err());
    let h = hash_token("abc");
    assert_eq!(
        h,
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert!(parse_hash(&h).is_ok());
}

fn local_auth(hosts: &[&str], origins: &[&str]) -> AdminAuth {
    let config = AdminConfig {
        allow_local_without_token: true,
        allowed_hosts: hosts.iter().map(|h| h.to_string()).collect(),
        allowed_origins: origins.iter().map(|o| o.to_string()).collect(),
        ..AdminConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    AdminAuth::from_config(&config, "sorted-hash", 100, dir.path()).unwrap()
}

#[test]
fn host_names_are_checked_against_the_listener_loopback_and_the_list() {
    let auth = local_auth(&["sluice.internal", "gw.example:9000"], &[]);
    let local = Some(SocketAddr::from(([127, 0, 0, 1], 8080)));
    for (host, ok) in [
        ("127.0.0.1:8080", true),
        ("localhost:8080", true),
        ("LOCALHOST.:8080", true),
        ("[::1]:8080", true),
        ("127.0.0.1:9999", false),
        ("localhost", false),
        ("rebind.evil.example:8080", false),
        ("sluice.internal:1234", true),
        ("gw.example:9000", true),
        ("gw.example:9001", false),
        ("::1", false),
        ("a b", false),
    ] {
        assert_eq!(auth.host_allowed(Some(host), local), ok, "{host}");
    }
    // A `[::]` listener: the address the connection came in on counts as its name.
    let on_v6 = Some("[::ffff:10.0.0.5]:8080".parse::<SocketAddr>().unwrap());
    assert!(auth.host_allowed(Some("10.0.0.5:8080"), on_v6));
    assert!(!auth.host_allowed(Some("10.0.0.6:8080"), on_v6));
    // With a token and no list, any name; with a list, only the list and local names.
    let token = AdminAuth {
        hashes: vec![[0; 32]],
        ..AdminAuth::default()
    };
    assert!(token.host_allowed(Some("rebind.evil.example:8080"), local));
    let listed = AdminAuth {
        hashes: vec![[0; 32]],
        allowed_hosts: vec!["sluice.internal".to_string()],
        ..AdminAuth::default()
    };
    assert!(!listed.host_allowed(Some("rebind.evil.example:8080"), local));
    assert!(local_auth(&["*"], &[]).host_allowed(Some("anything:1"), local));
}

#[test]
fn origins_must_be_the_host_or_listed() {
    let auth = local_auth(&[], &["https://console.example.com/"]);
    let host = Some("127.0.0.1:8080");
    assert!(auth.origin_allowed("http://127.0.0.1:8080", host));
    assert!(!auth.origin_allowed("http://127.0.0.1:8081", host));
    assert!(!auth.origin_allowed("https://evil.example", host));
    assert!(!auth.origin_allowed("null", host));
    assert!(auth.origin_allowed("HTTPS://console.example.com", host));
    // Behind a proxy that ends TLS: `https://admin.example` against `Host: admin.example`.
    assert!(auth.origin_allowed("https://admin.example", Some("admin.example")));
    assert!(!auth.origin_allowed("https://admin.example", Some("admin.example:8080")));
    let bad = AdminConfig {
        allowed_origins: vec!["console.example.com".to_string()],
        allow_local_without_token: true,
        ..AdminConfig::default()
    };
    let dir = tempfile::tempdir().unwrap();
    assert!(AdminAuth::from_config(&bad, "sorted-hash", 1, dir.path()).is_err());
}

#[test]
fn json_types_are_json_and_nothing_else() {
    for t in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/merge-patch+json",
    ] {
        assert!(json_type(t), "{t}");
    }
    for t in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "text/json",
        "",
    ] {
        assert!(!json_type(t), "{t}");
    }
}

#[test]
fn a_generated_token_is_kept_owner_only_and_reused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(TOKEN_FILE);
    let first = generated_token(&path).unwrap();
    assert_eq!(first.len(), 64);
    assert!(first.bytes().all(|b| b.is_ascii_hexdigit()));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert_eq!(
        generated_token(&path).unwrap(),
        first,
        "stable across restarts"
    );
    let other = tempfile::tempdir().unwrap();
    assert_ne!(
        generated_token(&other.path().join(TOKEN_FILE)).unwrap(),
        first
    );
}

fn write(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Request {
    let mut builder = axum::http::Request::builder().method(method).uri(path);
    for (k, v) in headers {
        builder = builder.header(*k, *v);
    }
    let mut request = builder
        .body(axum::body::Body::from(body.to_string()))
        .unwrap();
    request
        .extensions_mut()
        .insert(ConnectInfo(SocketAddr::from(([127, 0, 0, 1], 40000))));
    request
        .extensions_mut()
        .insert(LocalAddr(SocketAddr::from(([127, 0, 0, 1], 8080))));
    request
}

#[tokio::test]
async fn cross_site_writes_are_refused_before_anything_runs() {
    let (router, _dir) = router(Vec::new()).await;
    let body = r#"{"rules":[]}"#;
    let host = ("host", "127.0.0.1:8080");
    for (headers, status, field) in [
        (
            vec![
                ("host", "rebind.evil.example:8080"),
                ("origin", "https://evil.example"),
                ("content-type", "text/plain"),
            ],
            403,
            "host",
        ),
        (
            vec![
                host,
                ("origin", "https://evil.example"),
                ("content-type", "application/json"),
            ],
            403,
            "origin",
        ),
        (
            vec![
                host,
                ("sec-fetch-site", "cross-site"),
                ("content-type", "application/json"),
            ],
            403,
            "sec-fetch-site",
        ),
        (
            vec![host, ("content-type", "text/plain")],
            415,
            "content-type",
        ),
        (vec![host], 415, "content-type"),
        (
            vec![
                host,
                ("x-forwarded-for", "10.0.0.1"),
                ("content-type", "application/json"),
            ],
            403,
            "x-forwarded-for",
        ),
    ] {
        let answer = send(
            &router,
            write("POST", "/api/v1/catalog/apply?dry_run=true", &headers, body),
        )
        .await;
        assert_eq!(answer.status(), status, "{headers:?}");
        let bytes = axum::body::to_bytes(answer.into_body(), 1 << 16)
            .await
            .unwrap();
        let problem: Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(problem["field"], field, "{headers:?}");
    }
    let same_origin = send(
        &router,
        write(
            "POST",
            "/api/v1/catalog/apply?dry_run=true",
            &[
                host,
                ("origin", "http://127.0.0.1:8080"),
                ("sec-fetch-site", "same-origin"),
                ("content-type", "application/json; charset=utf-8"),
            ],
            body,
        ),
    )
    .await;
    assert_eq!(same_origin.status(), 200);
    // A body-less action needs no type, and a preflight gets no CORS permission.
    let preflight = router
        .oneshot(write(
            "OPTIONS",
            "/api/v1/catalog/apply",
            &[
                host,
                ("origin", "https://evil.example"),
                ("access-control-request-method", "POST"),
            ],
            "",
        ))
        .await
        .unwrap();
    assert!(preflight
        .headers()
        .keys()
        .all(|k| !k.as_str().starts_with("access-control-")));
}
