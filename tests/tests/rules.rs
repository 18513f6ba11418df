//! Rules end to end: EventBridge patterns, CESQL filters and transforms from the
//! configuration, in the running gateway; and `sluice rule test`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use sluice_tests::{ids, read_jsonl, sluice_bin, structured_event, Sluice};

const RULES: &str = r#"
[[rules]]
name = "big-orders"
bus = "default"
pattern = { type = ["order.created"], data = { total = [{ numeric = [">=", 100] }] } }

[[rules.targets]]
type = "file"
name = "big"
path = "{data_dir}/big.jsonl"
transform = { form = "TEMPLATE", value = { id = "$.id", total = "$.data.total" }, template = '{"order": "${id}", "amount": ${total}}' }

[[rules]]
name = "eu"
bus = "default"
filter = "region = 'eu' AND type LIKE 'order.%'"

[[rules.targets]]
type = "file"
name = "eu"
path = "{data_dir}/eu.jsonl"
"#;

#[tokio::test]
async fn patterns_filters_and_transforms_route_events() {
    let sluice = Sluice::builder().extra(RULES).start().await;
    let client = reqwest::Client::new();
    let event = |id: &str, ty: &str, total: i64, region: &str| {
        let mut e = structured_event(id);
        e["type"] = json!(ty);
        e["region"] = json!(region);
        e["data"] = json!({"total": total});
        e
    };
    let batch = json!([
        event("small-eu", "order.created", 20, "eu"),
        event("big-us", "order.created", 250, "us"),
        event("big-eu", "order.created", 100, "eu"),
        event("refund-eu", "refund.created", 500, "eu"),
    ]);
    let r = sluice_tests::send_batch(&client, &sluice.events_url(), batch.to_string()).await;
    assert_eq!(r.status(), 202);
    let data = sluice.data_dir().to_path_buf();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let big = read_jsonl(&data.join("big.jsonl"));
        let eu = read_jsonl(&data.join("eu.jsonl"));
        if big.len() >= 2 && eu.len() >= 2 && sluice.delivered().len() >= 4 {
            let mut amounts: Vec<Value> = big.iter().map(|b| b["amount"].clone()).collect();
            amounts.sort_by_key(|a| a.as_i64());
            assert_eq!(amounts, vec![json!(100), json!(250)], "{big:?}");
            assert!(big.iter().any(|b| b["order"] == "big-us"));
            let mut eu_ids = ids(&eu);
            eu_ids.sort();
            assert_eq!(eu_ids, vec!["big-eu", "small-eu"]);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "big: {big:?}, eu: {eu:?}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[test]
fn bad_patterns_and_filters_are_refused_at_load_with_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    let check = |text: &str| {
        std::fs::write(&path, text).unwrap();
        let out = Command::new(sluice_bin())
            .arg("check-config")
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let base = "[[buses]]\nname = \"b\"\n[[rules]]\nname = \"r\"\nbus = \"b\"\n";
    let target = "[[rules.targets]]\ntype = \"log\"\nname = \"l\"\n";
    let (ok, err) = check(&format!(
        "{base}pattern = {{ data = {{ n = [{{ numeric = [\">\", \"x\"] }}] }} }}\n{target}"
    ));
    assert!(!ok);
    assert!(err.contains("$.data.n") && err.contains(":6:"), "{err}");
    let (ok, err) = check(&format!("{base}filter = \"a = \"\n{target}"));
    assert!(!ok);
    assert!(err.contains("position"), "{err}");
    let (ok, err) = check(&format!(
        "{base}{target}transform = {{ form = \"NOPE\" }}\n"
    ));
    assert!(!ok);
    assert!(err.contains("target `l`"), "{err}");
}

#[test]
fn rule_test_command_matches_and_transforms() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, value: Value| {
        let p = dir.path().join(name);
        std::fs::write(&p, value.to_string()).unwrap();
        p
    };
    let event = write(
        "event.json",
        json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "order", "data": {"total": 150, "name": "Ann \"A\""}}),
    );
    let pattern = write(
        "pattern.json",
        json!({"data": {"total": [{"numeric": [">", 100]}]}}),
    );
    let transform = write(
        "transform.json",
        json!({"form": "TEMPLATE", "value": {"n": "$.data.name"}, "template": "{\"who\": \"${n}\"}"}),
    );
    let run = |args: &[&std::ffi::OsStr]| {
        let out = Command::new(sluice_bin())
            .args(["rule", "test"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, out, _) = run(&[
        "--event".as_ref(),
        event.as_os_str(),
        "--pattern".as_ref(),
        pattern.as_os_str(),
        "--transform".as_ref(),
        transform.as_os_str(),
    ]);
    assert_eq!(code, Some(0));
    let answer: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        answer,
        json!({"matched": true, "output": {"who": "Ann \"A\""}})
    );

    // The event against a filter.
    let filter = |expr: &str| {
        run(&[
            "--event".as_ref(),
            event.as_os_str(),
            "--filter".as_ref(),
            expr.as_ref(),
        ])
    };
    let (code, out, _) = filter("type = 'refund'");
    assert_eq!(code, Some(0));
    assert_eq!(
        serde_json::from_str::<Value>(&out).unwrap(),
        json!({"matched": false})
    );

    let (code, _, err) = filter("type = ");
    assert_eq!(code, Some(2));
    assert!(err.contains("filter"), "{err}");
    let bad = write("bad.json", json!({"id": "no specversion"}));
    let (code, _, err) = run(&[
        "--event".as_ref(),
        bad.as_os_str(),
        "--pattern".as_ref(),
        pattern.as_os_str(),
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("event"), "{err}");
}
