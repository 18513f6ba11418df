//! Interoperability: events posted by the official CloudEvents Python SDK (`cloudevents` on
//! PyPI), in binary and structured mode. The Makefile installs it into `.venv`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use sluice_tests::{repo_root, Sluice};

fn python() -> std::path::PathBuf {
    if let Ok(p) = std::env::var("SLUICE_E2E_PYTHON") {
        return p.into();
    }
    let venv = repo_root().join(".venv/bin/python");
    assert!(
        venv.exists(),
        "{} is missing: run `make venv` (make test does it) to install the CloudEvents Python SDK",
        venv.display()
    );
    venv
}

#[tokio::test]
async fn python_sdk_binary_and_structured_events_are_accepted() {
    let sluice = Sluice::start().await;
    let out = Command::new(python())
        .arg(repo_root().join("tests/scripts/post_with_python_sdk.py"))
        .arg(sluice.events_url())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let events = sluice
        .wait_delivered(Duration::from_secs(20), |e| e.len() >= 2)
        .await;
    let binary = events
        .iter()
        .find(|e| e["id"] == "py-binary")
        .expect("binary event");
    let structured = events
        .iter()
        .find(|e| e["id"] == "py-structured")
        .expect("structured event");
    for e in [binary, structured] {
        assert_eq!(e["type"], "com.example.python");
        assert_eq!(e["source"], "https://example.com/python-sdk");
        assert_eq!(e["data"]["message"], "hello from the python sdk");
        assert_eq!(e["tenant"], "acme", "extension kept");
        assert_eq!(
            e["subject"], "café au lait",
            "percent-encoded header decoded"
        );
        assert!(e["time"].is_string());
    }
}
