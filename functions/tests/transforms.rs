#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use cloudevents::{AttributesReader, Data, Event};
use serde_json::{json, Value};
use sluice_functions::{
    test_rule, Condition, Output, RuleTestError, TransformChain, TransformError,
};

fn ev() -> Event {
    common::event(
        json!({"name": "Ann \"the\" <b>", "price": 12.5, "items": [{"sku": "a"}, {"sku": "b"}], "user": {"id": 7}}),
        json!({"region": "eu"}),
    )
}

fn apply(spec: Value) -> Output {
    TransformChain::compile(&spec)
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
        .apply(&ev())
        .unwrap_or_else(|e| panic!("{spec}: {e}"))
}

fn body(spec: Value) -> (String, String) {
    match apply(spec) {
        Output::Body {
            content_type,
            bytes,
        } => (content_type, String::from_utf8(bytes).unwrap()),
        Output::Event(e) => panic!("expected a body, got {e}"),
    }
}

fn event_out(spec: Value) -> Event {
    match apply(spec) {
        Output::Event(e) => e,
        Output::Body { .. } => panic!("expected an event"),
    }
}

fn data_of(e: &Event) -> Value {
    match e.data() {
        Some(Data::Json(v)) => v.clone(),
        other => panic!("expected JSON data, got {other:?}"),
    }
}

#[test]
fn original_and_empty_chain_pass_the_event() {
    assert_eq!(event_out(json!({"form": "ORIGINAL"})), ev());
    assert_eq!(event_out(json!([])), ev());
}

#[test]
fn constant() {
    assert_eq!(
        body(json!({"form": "CONSTANT", "value": {"a": 1}})),
        ("application/json".into(), r#"{"a":1}"#.into())
    );
    assert_eq!(
        body(json!({"form": "CONSTANT", "value": "hello"})),
        ("text/plain; charset=utf-8".into(), "hello".into())
    );
    let e = event_out(json!({"form": "CONSTANT", "value": {"a": 1}, "into": "data"}));
    assert_eq!(data_of(&e), json!({"a": 1}));
}

#[test]
fn jsonpath() {
    assert_eq!(
        body(json!({"form": "JSONPATH", "value": "$.data.user"})).1,
        r#"{"id":7}"#
    );
    assert_eq!(
        body(json!({"form": "JSONPATH", "value": "$.data.price"})).1,
        "12.5"
    );
    assert_eq!(
        body(json!({"form": "JSONPATH", "value": "$.type"})).1,
        "com.example.order.created"
    );
    assert_eq!(
        body(json!({"form": "JSONPATH", "value": "$.region"})).1,
        "eu"
    );
    assert_eq!(
        body(json!({"form": "JSONPATH", "value": "$.data.items[*].sku"})).1,
        r#"["a","b"]"#
    );
    let e = event_out(json!({"form": "JSONPATH", "value": "$.data.user", "into": "data"}));
    assert_eq!(data_of(&e), json!({"id": 7}));
    let err = TransformChain::compile(&json!({"form": "JSONPATH", "value": "$.data.nope"}))
        .unwrap()
        .apply(&ev())
        .unwrap_err();
    assert!(
        matches!(err, TransformError::Apply { step: 0, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("matched nothing"), "{err}");
}

#[test]
fn template_json_aware() {
    let (ct, text) = body(json!({
        "form": "TEMPLATE",
        "value": {"name": "$.data.name", "price": "$.data.price", "user": "$.data.user", "none": "$.data.none"},
        "template": "{\"who\": ${name}, \"greeting\": \"hi ${name}!\", \"p\": ${price}, \"u\": ${user}, \"n\": ${none}, \"in\": \"${user}\"}"
    }));
    assert_eq!(ct, "application/json");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(
        v,
        json!({"who": "Ann \"the\" <b>", "greeting": "hi Ann \"the\" <b>!", "p": 12.5, "u": {"id": 7}, "n": null, "in": "{\"id\":7}"})
    );
}

#[test]
fn template_escaped_quotes_in_literal_text() {
    let (_, text) = body(json!({
        "form": "TEMPLATE",
        "value": {"n": "$.data.name"},
        "template": "[\"say \\\"${n}\\\"\", ${n}]"
    }));
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v, json!(["say \"Ann \"the\" <b>\"", "Ann \"the\" <b>"]));
}

#[test]
fn template_plain_text() {
    let (ct, text) = body(json!({
        "form": "TEMPLATE",
        "value": {"name": "$.data.name", "id": "$.data.user.id", "missing": "$.data.x"},
        "template": "Order for ${name} (user ${id})${missing}, $5 off"
    }));
    assert_eq!(ct, "text/plain; charset=utf-8");
    assert_eq!(text, "Order for Ann \"the\" <b> (user 7), $5 off");
    let e = event_out(json!({
        "form": "TEMPLATE", "value": {"n": "$.data.name"}, "template": "hi ${n}", "into": "data"
    }));
    assert_eq!(e.data(), Some(&Data::String("hi Ann \"the\" <b>".into())));
    assert_eq!(e.datacontenttype(), Some("text/plain"));
}

#[test]
fn template_that_breaks_json_fails_on_the_event() {
    let chain = TransformChain::compile(&json!({
        "form": "TEMPLATE", "value": {"n": "$.data.name"}, "template": "{\"a\": ${n} ${n}}"
    }))
    .unwrap();
    let err = chain.apply(&ev()).unwrap_err();
    assert!(err.to_string().contains("valid JSON"), "{err}");
}

#[test]
fn attributes_set_remove_rename() {
    let e = event_out(json!([
        {"form": "SET_ATTRIBUTES", "attributes": {"type": "com.example.v2", "subject": "$.data.user.id", "tier": "gold", "retries": 3, "vip": true, "time": "2025-01-02T03:04:05Z"}},
        {"form": "REMOVE_ATTRIBUTES", "attributes": ["dataschema", "retries"]},
        {"form": "RENAME_ATTRIBUTES", "attributes": {"region": "zone", "absent": "x"}}
    ]));
    assert_eq!(e.ty(), "com.example.v2");
    assert_eq!(e.subject(), Some("7"));
    assert_eq!(
        e.time().map(|t| t.to_rfc3339()),
        Some("2025-01-02T03:04:05+00:00".into())
    );
    assert_eq!(
        e.extension("tier").map(|v| v.to_string()),
        Some("gold".into())
    );
    assert_eq!(
        e.extension("vip").map(|v| v.to_string()),
        Some("true".into())
    );
    assert!(e.extension("retries").is_none());
    assert!(e.extension("region").is_none());
    assert_eq!(
        e.extension("zone").map(|v| v.to_string()),
        Some("eu".into())
    );
    assert!(e.extension("x").is_none());
    // The payload is carried over untouched.
    assert_eq!(e.data(), ev().data());
}

#[test]
fn bad_attribute_values_fail_on_the_event() {
    let chain = TransformChain::compile(
        &json!({"form": "SET_ATTRIBUTES", "attributes": {"time": "yesterday"}}),
    )
    .unwrap();
    let err = chain.apply(&ev()).unwrap_err();
    assert!(err.to_string().contains("not a valid CloudEvent"), "{err}");
    let chain = TransformChain::compile(
        &json!({"form": "SET_ATTRIBUTES", "attributes": {"x": "$.data.user"}}),
    )
    .unwrap();
    assert!(chain.apply(&ev()).is_err());
    let chain = TransformChain::compile(
        &json!({"form": "SET_ATTRIBUTES", "attributes": {"x": "$.data.price"}}),
    )
    .unwrap();
    assert!(
        chain.apply(&ev()).is_err(),
        "extensions hold integers, not 12.5"
    );
}

#[test]
fn map_data() {
    let e = event_out(json!({
        "form": "MAP_DATA",
        "fields": {"customer.name": "$.data.name", "customer.id": "$.data.user.id", "kind": {"value": "order"}, "n": 5, "gone": "$.data.nope"}
    }));
    assert_eq!(
        data_of(&e),
        json!({"customer": {"name": "Ann \"the\" <b>", "id": 7}, "kind": "order", "n": 5})
    );
    let e = event_out(json!({
        "form": "MAP_DATA", "keep": true, "remove": ["items", "user.id"],
        "fields": {"src": "$.source"}
    }));
    assert_eq!(
        data_of(&e),
        json!({"name": "Ann \"the\" <b>", "price": 12.5, "user": {}, "src": "/orders/eu"})
    );
}

#[test]
fn chains_compose() {
    let (ct, text) = body(json!([
        {"form": "MAP_DATA", "fields": {"who": "$.data.name"}},
        {"form": "SET_ATTRIBUTES", "attributes": {"subject": "greeting"}},
        {"form": "TEMPLATE", "value": {"w": "$.data.who", "s": "$.subject"}, "template": "${s}: ${w}"}
    ]));
    assert_eq!(ct, "text/plain; charset=utf-8");
    assert_eq!(text, "greeting: Ann \"the\" <b>");
    let e = event_out(json!([
        {"form": "CONSTANT", "value": {"x": 1}, "into": "data"},
        {"form": "MAP_DATA", "keep": true, "fields": {"y": "$.data.x"}}
    ]));
    assert_eq!(data_of(&e), json!({"x": 1, "y": 1}));
}

#[test]
fn invalid_chains_name_the_step() {
    let cases = [
        (json!(3), 0, "step object"),
        (
            json!([{"form": "ORIGINAL"}, {"form": "NOPE"}]),
            1,
            "unknown form",
        ),
        (json!([{"nope": 1}]), 0, "`form`"),
        (json!({"form": "CONSTANT"}), 0, "needs `value`"),
        (
            json!({"form": "CONSTANT", "value": 1, "extra": 2}),
            0,
            "unknown field `extra`",
        ),
        (
            json!({"form": "CONSTANT", "value": 1, "into": "body"}),
            0,
            "into",
        ),
        (
            json!({"form": "JSONPATH", "value": "data.x"}),
            0,
            "must start with `$`",
        ),
        (
            json!({"form": "JSONPATH", "value": "$.data[?"}),
            0,
            "invalid JSONPath",
        ),
        (
            json!({"form": "TEMPLATE", "value": {"a": "$.id"}, "template": "${b}"}),
            0,
            "names no variable",
        ),
        (
            json!({"form": "TEMPLATE", "value": {"a": "$.id"}, "template": "${a"}),
            0,
            "unterminated",
        ),
        (
            json!({"form": "TEMPLATE", "value": {"a": 1}, "template": "x"}),
            0,
            "JSONPath string",
        ),
        (
            json!([{"form": "CONSTANT", "value": 1}, {"form": "ORIGINAL"}]),
            0,
            "must be the last step",
        ),
        (
            json!({"form": "REMOVE_ATTRIBUTES", "attributes": ["id"]}),
            0,
            "required",
        ),
        (
            json!({"form": "REMOVE_ATTRIBUTES", "attributes": ["Bad"]}),
            0,
            "not an attribute name",
        ),
        (
            json!({"form": "SET_ATTRIBUTES", "attributes": {"data": 1}}),
            0,
            "MAP_DATA",
        ),
        (
            json!({"form": "SET_ATTRIBUTES", "attributes": {"specversion": "0.3"}}),
            0,
            "cannot be set",
        ),
        (
            json!({"form": "RENAME_ATTRIBUTES", "attributes": {"type": "kind"}}),
            0,
            "cannot be renamed",
        ),
        (
            json!({"form": "MAP_DATA", "fields": {"a..b": "$.id"}}),
            0,
            "dotted",
        ),
        (
            json!({"form": "MAP_DATA", "fields": {"a": [1]}}),
            0,
            "JSONPath string",
        ),
    ];
    for (spec, step, msg) in cases {
        match TransformChain::compile(&spec) {
            Err(TransformError::Invalid { step: s, message }) => {
                assert_eq!(s, step, "{spec}: {message}");
                assert!(message.contains(msg), "{spec}: {message}");
            }
            other => panic!("{spec}: expected an invalid-step error, got {other:?}"),
        }
    }
}

#[test]
fn rule_test_helper() {
    let event = serde_json::to_vec(&ev()).unwrap();
    let p = json!({"type": ["com.example.order.created"]});
    assert_eq!(
        test_rule(&event, Condition::Pattern(&p), None).unwrap(),
        json!({"matched": true})
    );
    let miss = json!({"type": ["x"]});
    let t = json!({"form": "JSONPATH", "value": "$.data.user"});
    assert_eq!(
        test_rule(&event, Condition::Pattern(&miss), Some(&t)).unwrap(),
        json!({"matched": false})
    );
    assert_eq!(
        test_rule(&event, Condition::Filter("region = 'eu'"), Some(&t)).unwrap(),
        json!({"matched": true, "output": {"id": 7}})
    );
    let text =
        json!({"form": "TEMPLATE", "value": {"n": "$.data.user.id"}, "template": "user ${n}"});
    assert_eq!(
        test_rule(&event, Condition::Pattern(&p), Some(&text)).unwrap(),
        json!({"matched": true, "output": "user 7"})
    );
    let out = test_rule(
        &event,
        Condition::Pattern(&p),
        Some(&json!({"form": "ORIGINAL"})),
    )
    .unwrap();
    assert_eq!(out["output"]["data"]["user"]["id"], json!(7));
    assert_eq!(out["output"]["region"], json!("eu"));

    assert!(matches!(
        test_rule(b"{", Condition::Pattern(&p), None),
        Err(RuleTestError::Event(_))
    ));
    assert!(matches!(
        test_rule(&event, Condition::Pattern(&json!({"type": []})), None),
        Err(RuleTestError::Pattern(_))
    ));
    assert!(matches!(
        test_rule(&event, Condition::Filter("a ="), None),
        Err(RuleTestError::Filter(_))
    ));
    assert!(matches!(
        test_rule(&event, Condition::Pattern(&p), Some(&json!({"form": "X"}))),
        Err(RuleTestError::Transform(_))
    ));
    let e = test_rule(
        &event,
        Condition::Pattern(&p),
        Some(&json!({"form": "JSONPATH", "value": "$.nope"})),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("the transform failed on this event"),
        "{e}"
    );
}

#[test]
fn compiled_things_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<TransformChain>();
    assert_send_sync::<sluice_functions::Pattern>();
    assert_send_sync::<sluice_functions::CesqlFilter>();
    assert_send_sync::<sluice_functions::RuleIndex>();
}
