#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Patterns written against the AWS EventBridge envelope read the CloudEvent fields AWS
//! PutEvents maps to: `detail-type` is `type`, `detail` is `data` (nested keys and all),
//! `resources` matches any element of the JSON-array extension; `source`, `id`, `time`,
//! `account` and `region` read the attributes of those names. The index answers as the
//! reference matcher for every one of them.

mod common;

use common::event;
use proptest::prelude::*;
use serde_json::{json, Value};
use sluice_functions::{Pattern, RuleIndex};

fn check(pattern: Value, ev: &cloudevents::Event, expected: bool) {
    let p = Pattern::compile(&pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
    assert_eq!(p.matches(ev), expected, "pattern {pattern} on {ev}");
    let mut b = RuleIndex::builder();
    b.add_pattern(3, &p);
    let index = b.build();
    let mut out = Vec::new();
    index.matches(ev, &mut out);
    assert_eq!(out == vec![3], expected, "index for pattern {pattern}");
}

/// An event as AWS PutEvents maps it.
fn put_event(detail: Value, resources: &[&str]) -> cloudevents::Event {
    event(
        detail,
        json!({
            "source": "shop",
            "type": "OrderPlaced",
            "account": "123456789012",
            "region": "eu-west-1",
            "resources": serde_json::to_string(resources).unwrap(),
        }),
    )
}

#[test]
fn the_issue_pattern_matches_as_on_aws() {
    let pattern = json!({
        "source": ["shop"],
        "detail-type": ["OrderPlaced"],
        "detail": {"total": [{"numeric": [">", 10]}]}
    });
    check(pattern.clone(), &put_event(json!({"total": 12}), &[]), true);
    check(pattern.clone(), &put_event(json!({"total": 9}), &[]), false);
    check(pattern, &put_event(json!({"other": 12}), &[]), false);
}

#[test]
fn detail_type_reads_type() {
    let ev = put_event(json!({}), &[]);
    check(json!({"detail-type": ["OrderPlaced"]}), &ev, true);
    check(json!({"detail-type": [{"prefix": "Order"}]}), &ev, true);
    check(json!({"detail-type": ["OrderShipped"]}), &ev, false);
    check(
        json!({"detail-type": [{"anything-but": "OrderPlaced"}]}),
        &ev,
        false,
    );
    // Both names together: one field.
    check(
        json!({"detail-type": ["OrderPlaced"], "type": ["OrderPlaced"]}),
        &ev,
        true,
    );
    check(
        json!({"detail-type": ["OrderPlaced"], "type": ["x"]}),
        &ev,
        false,
    );
}

#[test]
fn detail_reads_data_as_data_does() {
    let ev = put_event(
        json!({"customer": {"tier": "gold", "tags": ["a", "b"]}, "items": [{"sku": "x", "qty": 2}, {"sku": "y", "qty": 5}]}),
        &[],
    );
    for (detail, expected) in [
        (json!({"customer": {"tier": ["gold"]}}), true),
        (json!({"customer": {"tier": ["silver"]}}), false),
        (json!({"customer": {"tags": ["b"]}}), true),
        (json!({"customer": {"vip": [{"exists": false}]}}), true),
        (json!({"customer": {"vip": [{"exists": true}]}}), false),
        // Array-consistent: one element must carry both.
        (json!({"items": {"sku": ["x"], "qty": [2]}}), true),
        (json!({"items": {"sku": ["x"], "qty": [5]}}), false),
    ] {
        check(json!({"detail": detail.clone()}), &ev, expected);
        // The same as written against `data`, and mixed with it.
        check(json!({"data": detail.clone()}), &ev, expected);
    }
    check(
        json!({"detail": {"items": {"sku": ["x"]}}, "data": {"items": {"qty": [5]}}}),
        &ev,
        false,
    );
    check(
        json!({"detail": {"items": {"sku": ["y"]}}, "data": {"items": {"qty": [5]}}}),
        &ev,
        true,
    );
}

#[test]
fn resources_match_any_element() {
    let ev = put_event(json!({}), &["arn:aws:ec2:r:1:instance/i-1", "arn:x:2"]);
    check(json!({"resources": ["arn:x:2"]}), &ev, true);
    check(
        json!({"resources": ["arn:aws:ec2:r:1:instance/i-1"]}),
        &ev,
        true,
    );
    check(json!({"resources": [{"prefix": "arn:aws:ec2"}]}), &ev, true);
    check(json!({"resources": ["arn:x:3"]}), &ev, false);
    check(json!({"resources": [{"exists": true}]}), &ev, true);
    let none = put_event(json!({}), &[]);
    check(json!({"resources": ["arn:x:2"]}), &none, false);
    check(json!({"resources": [{"exists": false}]}), &none, true);
    // A `resources` extension that is not a JSON array is matched as it is.
    let plain = event(json!({}), json!({"resources": "thing"}));
    check(json!({"resources": ["thing"]}), &plain, true);
}

#[test]
fn account_region_time_source_id_read_their_attributes() {
    let ev = put_event(json!({}), &[]);
    check(
        json!({"account": ["123456789012"], "region": ["eu-west-1"]}),
        &ev,
        true,
    );
    check(json!({"region": ["us-east-1"]}), &ev, false);
    check(json!({"time": [{"prefix": "2024-05-01"}]}), &ev, true);
    check(json!({"source": ["shop"], "id": ["e-1"]}), &ev, true);
}

#[test]
fn other_dashed_keys_are_still_refused() {
    let err = Pattern::compile(&json!({"detail-kind": ["x"]})).unwrap_err();
    assert!(err.to_string().contains("detail-kind"), "{err}");
    // Nested keys keep their names: `detail-type` inside `detail` is a data field.
    let ev = put_event(json!({"detail-type": "inner"}), &[]);
    check(json!({"detail": {"detail-type": ["inner"]}}), &ev, true);
    check(json!({"detail": {"type": ["inner"]}}), &ev, false);
}

const KEYS: &[&str] = &["detail-type", "type", "source", "resources", "region"];
const VALUES: &[&str] = &["OrderPlaced", "shop", "arn:a", "arn:b", "eu", "x"];

fn leaf_matcher() -> impl Strategy<Value = Value> {
    let value = prop::sample::select(VALUES);
    prop_oneof![
        3 => value.clone().prop_map(|v| json!(v)),
        1 => value.clone().prop_map(|v| json!({"prefix": &v[..1]})),
        1 => value.prop_map(|v| json!({"anything-but": v})),
        1 => any::<bool>().prop_map(|b| json!({"exists": b})),
    ]
}

fn aws_pattern() -> impl Strategy<Value = Value> {
    let attr = (
        prop::sample::select(KEYS),
        prop::collection::vec(leaf_matcher(), 1..3),
    )
        .prop_map(|(k, m)| (k.to_string(), Value::Array(m)));
    let detail = (
        prop::sample::select(&["detail", "data"][..]),
        prop::sample::select(&["n", "s"][..]),
        prop_oneof![
            (0i64..4).prop_map(|n| json!([{"numeric": [">", n]}])),
            prop::sample::select(VALUES).prop_map(|v| json!([v])),
            any::<bool>().prop_map(|b| json!([{"exists": b}])),
        ],
    )
        .prop_map(|(k, f, m)| (k.to_string(), json!({ f: m })));
    prop::collection::vec(prop_oneof![attr, detail], 1..4).prop_map(|members| {
        let mut out = serde_json::Map::new();
        for (k, v) in members {
            out.insert(k, v);
        }
        Value::Object(out)
    })
}

fn aws_event() -> impl Strategy<Value = cloudevents::Event> {
    (
        prop::sample::select(VALUES),
        prop::collection::vec(prop::sample::select(VALUES), 0..3),
        prop::option::of(prop::sample::select(VALUES)),
        0i64..5,
        prop::sample::select(VALUES),
    )
        .prop_map(|(ty, resources, region, n, s)| {
            let mut extra = json!({
                "type": ty,
                "resources": serde_json::to_string(&resources).unwrap(),
            });
            if let Some(r) = region {
                extra["region"] = json!(r);
            }
            event(json!({"n": n, "s": s}), extra)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_the_matcher_on_aws_keys(
        patterns in prop::collection::vec(aws_pattern(), 1..12),
        events in prop::collection::vec(aws_event(), 1..6),
    ) {
        let compiled: Vec<Pattern> =
            patterns.iter().filter_map(|p| Pattern::compile(p).ok()).collect();
        let mut b = RuleIndex::builder();
        for (i, p) in compiled.iter().enumerate() {
            b.add_pattern(i, p);
        }
        let index = b.build();
        let mut out = Vec::new();
        for ev in &events {
            index.matches(ev, &mut out);
            let expected: Vec<usize> = compiled
                .iter()
                .enumerate()
                .filter(|(_, p)| p.matches(ev))
                .map(|(i, _)| i)
                .collect();
            prop_assert_eq!(&out, &expected, "event {}", ev);
        }
    }
}
