//! `POST /api/v1/rules/test` in both modes: an event against a pattern, a filter or a rule
//! of the catalog, with the output of each transform step; answers checked against the
//! OpenAPI document. (A bad pattern is refused with its pointer: see `admin_catalog.rs`.)
#![allow(clippy::unwrap_used, clippy::expect_used)]

use serde_json::{json, Value};
use sluice_tests::admin::{gateway, Answer, Api};
use sluice_tests::in_both_modes;

in_both_modes!(the_rule_test_matches_and_transforms_an_event);

async fn the_rule_test_matches_and_transforms_an_event(distributed: bool) {
    let sluice = gateway(distributed, "admin-rule-test").await;
    let api = Api::recorded(&sluice);
    let event = json!({"specversion": "1.0", "id": "1", "source": "/s", "type": "order.created", "datacontenttype": "application/json", "data": {"total": 5}});
    let test = |mut body: Value| {
        body["event"] = event.clone();
        let api = &api;
        async move {
            let answer: Answer = api
                .post("/api/v1/rules/test", "/api/v1/rules/test", Some(body))
                .await;
            assert_eq!(answer.status, 200, "{}", answer.body);
            answer.body
        }
    };

    let out = test(json!({
        "pattern": {"type": ["order.created"]},
        "transform": [
            {"form": "SET_ATTRIBUTES", "attributes": {"subject": "$.data.total"}},
            {"form": "JSONPATH", "value": "$.subject"},
        ]
    }))
    .await;
    assert_eq!(out["matched"], true);
    assert_eq!(out["steps"][0]["output"]["subject"], "5", "{out}");
    assert_eq!(out["output"], 5, "{out}");
    let out = test(json!({"filter": "type = 'x'"})).await;
    assert_eq!(out["matched"], false, "{out}");
    let out = test(json!({"rule": "default/all-events"})).await;
    assert_eq!(out["matched"], true, "{out}");
    api.check_openapi("rule-test");
}
