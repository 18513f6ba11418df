//! Interoperability: events posted by the official CloudEvents Python SDK (`cloudevents` on
//! PyPI), in binary and structured mode. The Makefile installs it into `.venv`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use sluice_tests::{run_python, Sluice};

#[tokio::test]
async fn python_sdk_binary_and_structured_events_are_accepted() {
    let sluice = Sluice::start().await;
    // (`make venv` installs the CloudEvents Python SDK it uses.)
    run_python("post_with_python_sdk.py", &[&sluice.events_url()], b"");
    let events = sluice
        .wait_delivered(Duration::from_secs(20), |e| e.len() >= 2)
        .await;
    let binary = sluice_tests::find_event(&events, "py-binary");
    let structured = sluice_tests::find_event(&events, "py-structured");
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
