//! The router driven with `oneshot` over a real embedded log: hostile inputs either get
//! a 4xx problem naming the field or are stored in a form delivery decodes.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt as _;
use tower::ServiceExt as _;

use crate::app::router::router;
use crate::ingress::limits::Limits;
use crate::ingress::state::IngressState;
use crate::ingress::state::Settings;
use crate::store::cluster::LocalCluster;
use crate::store::embedded::{DataDir, EmbeddedLog, LogOptions};
use crate::store::BusLog;
use crate::store::Durability;

struct Fixture {
    _dir: tempfile::TempDir,
    _data: DataDir,
    log: Arc<EmbeddedLog>,
    state: Arc<IngressState>,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let data = DataDir::open(dir.path()).unwrap();
    let options = LogOptions {
        durability: Durability::Os,
        segment_bytes: 1 << 20,
        cache_bytes: 1 << 20,
    };
    let log = Arc::new(data.open_bus("b", 1, &options).unwrap());
    let buses: HashMap<String, Arc<dyn BusLog>> =
        HashMap::from([("b".to_string(), log.clone() as Arc<dyn BusLog>)]);
    let state = Arc::new(IngressState::new(
        Settings {
            buses: Arc::new(buses),
            ..Settings::empty()
        },
        Limits::default(),
        Arc::new(LocalCluster::new("w")),
        Arc::new(crate::ingress::ratelimit::LocalLimiter::default()),
        Arc::new(crate::store::embedded::MemoryDedup::bounded(1 << 20)),
    ));
    Fixture {
        _dir: dir,
        _data: data,
        log,
        state,
    }
}

async fn send(state: &Arc<IngressState>, request: Request<Body>) -> (u16, serde_json::Value) {
    let response = router(state.clone(), None).oneshot(request).await.unwrap();
    let status = response.status().as_u16();
    let problem = response
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|v| v == crate::problem::PROBLEM_JSON);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
    assert!(
        status < 400 || problem,
        "{status} without a problem body: {json}"
    );
    (status, json)
}

fn binary(id: &str, content_type: &str, body: &[u8]) -> Request<Body> {
    Request::post("/buses/b/events")
        .header("ce-specversion", "1.0")
        .header("ce-id", id)
        .header("ce-source", "/t")
        .header("ce-type", "t")
        .header("content-type", content_type)
        .body(Body::from(body.to_vec()))
        .unwrap()
}

fn structured(json: &str) -> Request<Body> {
    Request::post("/buses/b/events")
        .header("content-type", "application/cloudevents+json")
        .body(Body::from(json.to_string()))
        .unwrap()
}

fn batch(json: &str) -> Request<Body> {
    Request::post("/buses/b/events")
        .header("content-type", "application/cloudevents-batch+json")
        .body(Body::from(json.to_string()))
        .unwrap()
}

fn depth(n: usize) -> Vec<u8> {
    format!("{}{}", "[".repeat(n), "]".repeat(n)).into_bytes()
}

#[tokio::test]
async fn hostile_inputs_are_refused_or_stored_decodable() {
    let f = fixture();
    let json = "application/json";
    // (what, request, the field a refusal must name; None = may be accepted)
    let cases: Vec<(&str, Request<Body>, Option<&str>)> = vec![
        (
            "lone surrogate",
            binary("1", json, br#""\ud800""#),
            Some("data"),
        ),
        (
            "lone trailing surrogate",
            binary("2", json, br#"["\udc00"]"#),
            Some("data"),
        ),
        (
            "surrogate pair",
            binary("3", json, br#""\ud83d\ude00""#),
            None,
        ),
        (
            "invalid UTF-8 in a string",
            binary("4", json, b"\"\xff\""),
            Some("data"),
        ),
        (
            "invalid UTF-8 bare",
            binary("5", json, b"\xff"),
            Some("data"),
        ),
        (
            "number out of range",
            binary("6", json, b"1e400"),
            Some("data"),
        ),
        (
            "huge integer",
            binary("7", json, b"123456789012345678901234567890"),
            None,
        ),
        // serde_json's limit counts the event object around the data too.
        ("depth 125", binary("8", json, &depth(125)), None),
        ("depth 126", binary("9", json, &depth(126)), None),
        ("depth 127", binary("9b", json, &depth(127)), Some("data")),
        ("depth 128", binary("10", json, &depth(128)), Some("data")),
        ("depth 129", binary("11", json, &depth(129)), Some("data")),
        ("depth 5000", binary("12", json, &depth(5000)), Some("data")),
        (
            "text body not UTF-8",
            binary("13", "text/plain", b"\xff\xfe"),
            None,
        ),
        (
            "octets",
            binary("14", "application/octet-stream", b"\0\x01"),
            None,
        ),
        ("newline in id", binary("a%0Ab", json, b"{}"), Some("ce-id")),
        (
            "NUL in an extension",
            {
                let mut r = binary("15", json, b"{}");
                r.headers_mut()
                    .insert("ce-tenant", "a%00b".parse().unwrap());
                r
            },
            Some("ce-tenant"),
        ),
        (
            "C1 control in subject",
            {
                let mut r = binary("16", json, b"{}");
                r.headers_mut()
                    .insert("ce-subject", "a%C2%85b".parse().unwrap());
                r
            },
            Some("ce-subject"),
        ),
        (
            "non-ASCII id",
            binary("caf%C3%A9 %22x%22", json, b"{}"),
            None,
        ),
        (
            "structured: object data with a text type",
            structured(
                r#"{"specversion":"1.0","id":"s1","source":"/t","type":"t","datacontenttype":"text/plain","data":{"a":1}}"#,
            ),
            Some("data"),
        ),
        (
            "structured: number data with an XML type",
            structured(
                r#"{"specversion":"1.0","id":"s2","source":"/t","type":"t","datacontenttype":"application/xml","data":5}"#,
            ),
            Some("data"),
        ),
        (
            "structured: control character in type",
            structured(
                r#"{"specversion":"1.0","id":"s3","source":"/t","type":"t\u0007","data":1}"#,
            ),
            Some("type"),
        ),
        (
            "structured: control character in an extension",
            structured(
                r#"{"specversion":"1.0","id":"s4","source":"/t","type":"t","ext":"\u007f"}"#,
            ),
            Some("ext"),
        ),
        (
            "structured: deep data",
            structured(&format!(
                r#"{{"specversion":"1.0","id":"s5","source":"/t","type":"t","data":{}}}"#,
                String::from_utf8(depth(126)).unwrap()
            )),
            None,
        ),
        (
            "structured: lone surrogate in data",
            structured(
                r#"{"specversion":"1.0","id":"s6","source":"/t","type":"t","data":"\ud800"}"#,
            ),
            Some("body"),
        ),
        (
            "structured: JSON data_base64",
            structured(
                r#"{"specversion":"1.0","id":"s7","source":"/t","type":"t","datacontenttype":"application/json","data_base64":"eyJhIjoxfQ=="}"#,
            ),
            None,
        ),
        (
            "batch: text type with object data",
            batch(
                r#"[{"specversion":"1.0","id":"b1","source":"/t","type":"t","datacontenttype":"text/plain","data":[1]}]"#,
            ),
            Some("entries"),
        ),
    ];
    let mut accepted = 0;
    for (what, request, refused_field) in cases {
        let (status, body) = send(&f.state, request).await;
        match refused_field {
            Some(field) => {
                assert!((400..500).contains(&status), "{what}: {status} {body}");
                assert_eq!(body["field"], field, "{what}: {body}");
            }
            None => {
                assert_eq!(status, 202, "{what}: {body}");
                accepted += 1;
            }
        }
    }
    // Every stored record reads back as a CloudEvent, as delivery reads it.
    let mut reader = f.log.reader(0, 0).await.unwrap();
    let records = reader.read(1000).await.unwrap();
    assert_eq!(records.len(), accepted);
    for record in records {
        crate::event::decode(&record.payload)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&record.payload)));
    }
}

#[tokio::test]
async fn a_batch_keeps_its_good_entries_and_refuses_the_undecodable() {
    let f = fixture();
    let (status, body) = send(
        &f.state,
        batch(r#"[{"specversion":"1.0","id":"ok","source":"/t","type":"t"},{"specversion":"1.0","id":"bad","source":"/t","type":"t","datacontenttype":"text/plain","data":{"a":1}}]"#),
    )
    .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["failedEntryCount"], 1);
    assert_eq!(body["entries"][1]["error"]["field"], "data", "{body}");
}

#[tokio::test]
async fn liveness_fails_once_the_store_stops_taking_writes() {
    let f = fixture();
    let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
    assert_eq!(send(&f.state, get("/healthz")).await.0, 200);
    // Closing the log is what a fatal error (a failed flush) does too: no more writes
    // until a restart recovers the log.
    f.log.close().await;
    let (status, body) = send(&f.state, get("/healthz")).await;
    assert_eq!(status, 503, "{body}");
    assert!(body["detail"].as_str().unwrap().contains('b'), "{body}");
    assert_eq!(send(&f.state, get("/readyz")).await.0, 503);
}
