#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{data_event, event};
use serde_json::{json, Value};
use sluice_functions::{Pattern, RuleIndex};

/// Checks the pattern against the event both directly and through a one-rule index.
fn check(pattern: Value, ev: &cloudevents::Event, expected: bool) {
    let p = Pattern::compile(&pattern).unwrap_or_else(|e| panic!("{pattern}: {e}"));
    assert_eq!(p.matches(ev), expected, "pattern {pattern} on {ev}");
    let mut b = RuleIndex::builder();
    b.add_pattern(7, &p);
    let idx = b.build();
    let mut out = Vec::new();
    idx.matches(ev, &mut out);
    assert_eq!(out == vec![7], expected, "index for pattern {pattern}");
}

fn table(cases: &[(Value, Value, bool)]) {
    for (pattern, data, expected) in cases {
        check(pattern.clone(), &data_event(data.clone()), *expected);
    }
}

#[test]
fn attributes_exact_and_shorthand() {
    let ev = event(
        json!({}),
        json!({"region": "eu", "priority": 5, "urgent": true}),
    );
    check(json!({"type": ["com.example.order.created"]}), &ev, true);
    check(json!({"type": "com.example.order.created"}), &ev, true);
    check(
        json!({"type": ["x", "com.example.order.created"]}),
        &ev,
        true,
    );
    check(json!({"type": ["x"]}), &ev, false);
    check(
        json!({"source": "/orders/eu", "subject": "order/42"}),
        &ev,
        true,
    );
    check(json!({"specversion": "1.0"}), &ev, true);
    check(json!({"id": "e-1"}), &ev, true);
    check(
        json!({"time": [{"prefix": "2024-05-01T10:00:00"}]}),
        &ev,
        true,
    );
    check(json!({"datacontenttype": "application/json"}), &ev, true);
    check(json!({"region": "eu"}), &ev, true);
    check(json!({"priority": [5]}), &ev, true);
    check(json!({"priority": ["5"]}), &ev, false);
    check(json!({"urgent": [true]}), &ev, true);
    check(json!({"urgent": [false]}), &ev, false);
    check(json!({"missing": [{"exists": false}]}), &ev, true);
    check(json!({}), &ev, true);
}

#[test]
fn exact_values_of_every_type() {
    table(&[
        (json!({"data": {"a": ["x"]}}), json!({"a": "x"}), true),
        (json!({"data": {"a": ["x"]}}), json!({"a": "X"}), false),
        (json!({"data": {"a": [1]}}), json!({"a": 1}), true),
        (json!({"data": {"a": [true]}}), json!({"a": true}), true),
        (json!({"data": {"a": [true]}}), json!({"a": "true"}), false),
        (json!({"data": {"a": [null]}}), json!({"a": null}), true),
        (json!({"data": {"a": ["1"]}}), json!({"a": 1}), false),
        (
            json!({"data": {"a": {"b": ["deep"]}}}),
            json!({"a": {"b": "deep"}}),
            true,
        ),
        (
            json!({"data": {"a": ["x"]}}),
            json!({"a": {"b": "x"}}),
            false,
        ),
    ]);
}

#[test]
fn numeric_precision_and_exponents() {
    let parse = |s: &str| -> Value { serde_json::from_str(s).unwrap() };
    table(&[
        (json!({"data": {"n": [300]}}), parse(r#"{"n": 3e2}"#), true),
        (
            json!({"data": {"n": [300]}}),
            parse(r#"{"n": 300.0}"#),
            true,
        ),
        (
            parse(r#"{"data": {"n": [3.0e2]}}"#),
            json!({"n": 300}),
            true,
        ),
        (json!({"data": {"n": [0.1]}}), parse(r#"{"n": 1e-1}"#), true),
        (
            json!({"data": {"n": [300]}}),
            json!({"n": 300.000001}),
            false,
        ),
        // Integers beyond 2^53 stay exact.
        (
            parse(r#"{"data": {"n": [9007199254740993]}}"#),
            parse(r#"{"n": 9007199254740992}"#),
            false,
        ),
        (
            parse(r#"{"data": {"n": [9007199254740993]}}"#),
            parse(r#"{"n": 9007199254740993}"#),
            true,
        ),
        (json!({"data": {"n": [-0.0]}}), json!({"n": 0}), true),
        (
            json!({"data": {"n": [{"numeric": ["=", 300]}]}}),
            parse(r#"{"n": 3e2}"#),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 0, "<=", 5]}]}}),
            json!({"n": 5}),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 0, "<=", 5]}]}}),
            json!({"n": 0}),
            false,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 0, "<=", 5]}]}}),
            json!({"n": 5.0001}),
            false,
        ),
        (
            json!({"data": {"n": [{"numeric": [">=", 0, "<", 5]}]}}),
            json!({"n": 0}),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": [">=", 0, "<", 5]}]}}),
            json!({"n": 4.999}),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": ["<", 5, ">", 1]}]}}),
            json!({"n": 3}),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": ["<", -1]}]}}),
            json!({"n": -1.5}),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 1e9]}]}}),
            parse(r#"{"n": 1.5e9}"#),
            true,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 0]}]}}),
            json!({"n": "5"}),
            false,
        ),
        (
            json!({"data": {"n": [{"numeric": [">", 0]}]}}),
            json!({"n": [-1, 2]}),
            true,
        ),
    ]);
}

#[test]
fn prefix_suffix_equals_ignore_case() {
    table(&[
        (
            json!({"data": {"s": [{"prefix": "ab"}]}}),
            json!({"s": "abc"}),
            true,
        ),
        (
            json!({"data": {"s": [{"prefix": "ab"}]}}),
            json!({"s": "a"}),
            false,
        ),
        (
            json!({"data": {"s": [{"prefix": ""}]}}),
            json!({"s": "x"}),
            true,
        ),
        (
            json!({"data": {"s": [{"prefix": "1"}]}}),
            json!({"s": 12}),
            false,
        ),
        (
            json!({"data": {"s": [{"suffix": ".png"}]}}),
            json!({"s": "a.png"}),
            true,
        ),
        (
            json!({"data": {"s": [{"suffix": ".png"}]}}),
            json!({"s": "a.PNG"}),
            false,
        ),
        (
            json!({"data": {"s": [{"prefix": {"equals-ignore-case": "AB"}}]}}),
            json!({"s": "abc"}),
            true,
        ),
        (
            json!({"data": {"s": [{"suffix": {"equals-ignore-case": ".PNG"}}]}}),
            json!({"s": "a.png"}),
            true,
        ),
        (
            json!({"data": {"s": [{"equals-ignore-case": "Hello"}]}}),
            json!({"s": "hELLO"}),
            true,
        ),
        (
            json!({"data": {"s": [{"equals-ignore-case": "Hello"}]}}),
            json!({"s": "hELL"}),
            false,
        ),
        // Beyond ASCII: full case folding.
        (
            json!({"data": {"s": [{"equals-ignore-case": "STRASSE"}]}}),
            json!({"s": "straße"}),
            true,
        ),
        (
            json!({"data": {"s": [{"equals-ignore-case": "ΟΔΟΣ"}]}}),
            json!({"s": "οδος"}),
            true,
        ),
        (
            json!({"data": {"s": [{"equals-ignore-case": "ÉCOLE"}]}}),
            json!({"s": "école"}),
            true,
        ),
        (
            json!({"data": {"s": [{"prefix": {"equals-ignore-case": "ÄB"}}]}}),
            json!({"s": "äbc"}),
            true,
        ),
        (
            json!({"data": {"s": [{"prefix": "é"}]}}),
            json!({"s": "e\u{301}"}),
            false,
        ),
    ]);
}

#[test]
fn wildcard_and_escapes() {
    table(&[
        (
            json!({"data": {"s": [{"wildcard": "*.png"}]}}),
            json!({"s": "dir/a.png"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a*b*c"}]}}),
            json!({"s": "axxbyyc"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a*b*c"}]}}),
            json!({"s": "axxcyyb"}),
            false,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a*a"}]}}),
            json!({"s": "a"}),
            false,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a*a"}]}}),
            json!({"s": "aa"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "*"}]}}),
            json!({"s": ""}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "abc"}]}}),
            json!({"s": "abc"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a\\*c"}]}}),
            json!({"s": "a*c"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a\\*c"}]}}),
            json!({"s": "abc"}),
            false,
        ),
        (
            json!({"data": {"s": [{"wildcard": "a\\\\*"}]}}),
            json!({"s": "a\\zz"}),
            true,
        ),
        (
            json!({"data": {"s": [{"wildcard": "*ü*"}]}}),
            json!({"s": "grün"}),
            true,
        ),
    ]);
}

#[test]
fn anything_but_forms() {
    table(&[
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"s": "y"}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"s": "x"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": ["x", "y"]}]}}),
            json!({"s": "y"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": [1, 2]}]}}),
            json!({"s": 3}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": [1, 2]}]}}),
            json!({"s": 2.0}),
            false,
        ),
        // Missing field: anything-but does not match (as in EventBridge).
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"t": "y"}),
            false,
        ),
        // Null is a value that is not "x".
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"s": null}),
            true,
        ),
        // Arrays: matches when any element is not excluded.
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"s": ["x", "y"]}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": "x"}]}}),
            json!({"s": ["x", "x"]}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": ["x", "y"]}]}}),
            json!({"s": ["x", "y"]}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"prefix": "in"}}]}}),
            json!({"s": "out"}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"prefix": "in"}}]}}),
            json!({"s": "inner"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"prefix": ["a", "b"]}}]}}),
            json!({"s": "bx"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"suffix": ".tmp"}}]}}),
            json!({"s": "a.txt"}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"suffix": ".tmp"}}]}}),
            json!({"s": "a.tmp"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"wildcard": "*.tmp"}}]}}),
            json!({"s": "a.tmp"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"wildcard": ["*.tmp", "x*"]}}]}}),
            json!({"s": "xy"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"equals-ignore-case": ["ABC"]}}]}}),
            json!({"s": "abc"}),
            false,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"equals-ignore-case": "ABC"}}]}}),
            json!({"s": "abd"}),
            true,
        ),
        (
            json!({"data": {"s": [{"anything-but": {"prefix": "in"}}]}}),
            json!({"s": 5}),
            false,
        ),
    ]);
}

#[test]
fn exists_and_missing_versus_null() {
    table(&[
        (
            json!({"data": {"a": [{"exists": true}]}}),
            json!({"a": null}),
            true,
        ),
        (
            json!({"data": {"a": [{"exists": true}]}}),
            json!({"b": 1}),
            false,
        ),
        (
            json!({"data": {"a": [{"exists": false}]}}),
            json!({"b": 1}),
            true,
        ),
        (
            json!({"data": {"a": [{"exists": false}]}}),
            json!({"a": null}),
            false,
        ),
        (json!({"data": {"a": [null]}}), json!({"b": 1}), false),
        (json!({"data": {"a": [null]}}), json!({"a": null}), true),
        // exists applies to leaves only: an object is not a leaf.
        (
            json!({"data": {"a": [{"exists": true}]}}),
            json!({"a": {"b": 1}}),
            false,
        ),
        (
            json!({"data": {"a": [{"exists": true}]}}),
            json!({"a": []}),
            false,
        ),
        (
            json!({"data": {"a": [{"exists": false}]}}),
            json!({"a": []}),
            true,
        ),
        (
            json!({"data": {"a": ["x", {"exists": false}]}}),
            json!({"b": 1}),
            true,
        ),
        (
            json!({"data": {"a": ["x", {"exists": false}]}}),
            json!({"a": "y"}),
            false,
        ),
    ]);
    // No data at all.
    let ev = event(Value::Null, json!({"data": null}));
    check(json!({"data": {"a": [{"exists": false}]}}), &ev, true);
    check(json!({"data": {"a": [{"exists": true}]}}), &ev, false);
    check(json!({"subject": [{"exists": true}]}), &ev, true);
    let no_subject = event(json!({}), json!({"subject": null}));
    check(json!({"subject": [{"exists": false}]}), &no_subject, true);
}

#[test]
fn cidr_v4_and_v6() {
    table(&[
        (
            json!({"data": {"ip": [{"cidr": "10.0.0.0/24"}]}}),
            json!({"ip": "10.0.0.200"}),
            true,
        ),
        (
            json!({"data": {"ip": [{"cidr": "10.0.0.0/24"}]}}),
            json!({"ip": "10.0.1.1"}),
            false,
        ),
        (
            json!({"data": {"ip": [{"cidr": "10.0.0.7/32"}]}}),
            json!({"ip": "10.0.0.7"}),
            true,
        ),
        (
            json!({"data": {"ip": [{"cidr": "0.0.0.0/0"}]}}),
            json!({"ip": "192.168.1.1"}),
            true,
        ),
        (
            json!({"data": {"ip": [{"cidr": "2001:db8::/32"}]}}),
            json!({"ip": "2001:db8:ffff::1"}),
            true,
        ),
        (
            json!({"data": {"ip": [{"cidr": "2001:db8::/32"}]}}),
            json!({"ip": "2001:db9::1"}),
            false,
        ),
        (
            json!({"data": {"ip": [{"cidr": "2001:db8::/32"}]}}),
            json!({"ip": "10.0.0.1"}),
            false,
        ),
        (
            json!({"data": {"ip": [{"cidr": "10.0.0.0/8"}]}}),
            json!({"ip": "not an ip"}),
            false,
        ),
        (
            json!({"data": {"ip": [{"cidr": "10.0.0.0/8"}]}}),
            json!({"ip": 10}),
            false,
        ),
    ]);
}

#[test]
fn arrays_nested_and_or() {
    table(&[
        (
            json!({"data": {"tags": ["b"]}}),
            json!({"tags": ["a", "b"]}),
            true,
        ),
        (
            json!({"data": {"tags": ["c"]}}),
            json!({"tags": ["a", "b"]}),
            false,
        ),
        (
            json!({"data": {"items": {"sku": ["x"]}}}),
            json!({"items": [{"sku": "y"}, {"sku": "x"}]}),
            true,
        ),
        (json!({"data": {"m": [1]}}), json!({"m": [[0, [1]]]}), true),
        (
            json!({"data": {"$or": [{"a": ["1"]}, {"b": ["2"]}]}}),
            json!({"b": "2"}),
            true,
        ),
        (
            json!({"data": {"$or": [{"a": ["1"]}, {"b": ["2"]}]}}),
            json!({"b": "3"}),
            false,
        ),
        (
            json!({"data": {"c": ["k"], "$or": [{"a": ["1"]}, {"b": ["2"]}]}}),
            json!({"a": "1", "c": "k"}),
            true,
        ),
        (
            json!({"data": {"c": ["k"], "$or": [{"a": ["1"]}, {"b": ["2"]}]}}),
            json!({"a": "1", "c": "z"}),
            false,
        ),
    ]);
    let ev = event(json!({"a": 1}), json!({}));
    check(
        json!({"$or": [{"type": ["nope"]}, {"data": {"a": [1]}}]}),
        &ev,
        true,
    );
    check(
        json!({"$or": [{"type": ["nope"]}, {"$or": [{"id": "x"}, {"id": "e-1"}]}]}),
        &ev,
        true,
    );
}

#[test]
fn data_as_string_with_json_content_type() {
    let ev: cloudevents::Event = serde_json::from_value(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t",
        "datacontenttype": "text/plain", "data": "{\"a\": 1}"
    }))
    .unwrap();
    check(json!({"data": {"a": [1]}}), &ev, false);
    let mut ev2 = ev.clone();
    ev2.set_data(
        "application/cloudevents-thing+json",
        "{\"a\": 1}".to_string(),
    );
    check(json!({"data": {"a": [1]}}), &ev2, true);
    let mut ev3 = ev.clone();
    ev3.set_data("application/json", b"{\"a\": 2}".to_vec());
    check(json!({"data": {"a": [2]}}), &ev3, true);
}

fn err(pattern: Value) -> (String, String) {
    let e = Pattern::compile(&pattern).expect_err(&pattern.to_string());
    (e.path, e.message)
}

#[test]
fn bad_patterns_carry_their_path() {
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!([1]), "$", "object"),
        (
            json!({"data": {"price": [{"numeric": [">", "x"]}]}}),
            "$.data.price[0].numeric[1]",
            "number",
        ),
        (
            json!({"data": {"price": [{"numeric": ["~", 1]}]}}),
            "$.data.price[0].numeric[0]",
            "expected one of",
        ),
        (
            json!({"data": {"price": [{"numeric": [">", 5, "<", 1]}]}}),
            "$.data.price[0].numeric",
            "empty",
        ),
        (
            json!({"data": {"price": [{"numeric": [">", 5, ">", 1]}]}}),
            "$.data.price[0].numeric[2]",
            "two lower",
        ),
        (
            json!({"data": {"price": [{"numeric": [">", 5, "<"]}]}}),
            "$.data.price[0].numeric",
            "pairs",
        ),
        (json!({"Type": ["x"]}), "$.Type", "attribute name"),
        (json!({"type": []}), "$.type", "empty list"),
        (json!({"type": [[1]]}), "$.type[0]", "nested arrays"),
        (
            json!({"type": [{"nope": 1}]}),
            "$.type[0].nope",
            "unknown operator",
        ),
        (
            json!({"type": [{"prefix": 1}]}),
            "$.type[0].prefix",
            "string",
        ),
        (
            json!({"type": [{"prefix": "a", "suffix": "b"}]}),
            "$.type[0]",
            "exactly one",
        ),
        (
            json!({"type": [{"exists": "yes"}]}),
            "$.type[0].exists",
            "true or false",
        ),
        (
            json!({"type": [{"cidr": "10.0.0.0/33"}]}),
            "$.type[0].cidr",
            "prefix length",
        ),
        (
            json!({"type": [{"cidr": "10.0.0.0"}]}),
            "$.type[0].cidr",
            "CIDR",
        ),
        (
            json!({"type": [{"wildcard": "a**"}]}),
            "$.type[0].wildcard",
            "consecutive",
        ),
        (
            json!({"type": [{"wildcard": "a\\b"}]}),
            "$.type[0].wildcard",
            "followed by",
        ),
        (
            json!({"type": [{"anything-but": [true]}]}),
            "$.type[0].anything-but[0]",
            "strings or numbers",
        ),
        (
            json!({"type": [{"anything-but": {"numeric": [">", 1]}}]}),
            "$.type[0].anything-but.numeric",
            "anything-but",
        ),
        (json!({"$or": []}), "$.$or", "empty"),
        (
            json!({"$or": [{"type": "a"}, 3]}),
            "$.$or[1]",
            "pattern object",
        ),
        (json!({"data": {}}), "$.data", "empty object"),
        (
            json!({"data": {"my key": [{"prefix": 1}]}}),
            "$.data[\"my key\"][0].prefix",
            "string",
        ),
    ];
    for (pattern, path, msg) in cases {
        let (p, m) = err(pattern.clone());
        assert_eq!(p, path, "path for {pattern}: {m}");
        assert!(m.contains(msg), "message for {pattern}: {m}");
    }
}

#[test]
fn nesting_depth_is_bounded() {
    let mut v = json!(["x"]);
    for _ in 0..100 {
        v = json!({ "a": v });
    }
    let (_, m) = err(json!({ "data": v }));
    assert!(m.contains("deeper"), "{m}");
}

#[test]
fn or_explosion_is_bounded() {
    let alts: Vec<Value> = (0..40).map(|i| json!({"a": [i]})).collect();
    let p = json!({"data": {"$or": alts.clone(), "b": {"$or": alts.clone()}, "c": {"$or": alts}}});
    let (_, m) = err(p);
    assert!(m.contains("alternatives"), "{m}");
}

#[test]
fn error_display_is_clear() {
    let e = Pattern::compile(&json!({"data": {"price": [{"numeric": [">", "x"]}]}})).unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid pattern at $.data.price[0].numeric[1]: expected a number"
    );
}

#[test]
fn arrays_of_objects_match_within_one_element() {
    let employees = json!({"employees": [
        {"firstName": "John", "lastName": "Doe"},
        {"firstName": "Anna", "lastName": "Smith"},
        {"firstName": "Peter", "lastName": "Jones"}
    ]});
    let nested = json!({"employees": [
        [{"firstName": "John", "lastName": "Doe"}, {"firstName": "Anna", "lastName": "Smith"}],
        [{"firstName": "Peter", "lastName": "Jones"}]
    ]});
    let anna = json!({"data": {"employees": {"firstName": ["Anna"]}}});
    let anna_smith = json!({"data": {"employees": {"firstName": ["Anna"], "lastName": ["Smith"]}}});
    let anna_jones = json!({"data": {"employees": {"firstName": ["Anna"], "lastName": ["Jones"]}}});
    table(&[
        (anna.clone(), employees.clone(), true),
        (anna_smith.clone(), employees.clone(), true),
        (anna_jones.clone(), employees.clone(), false),
        (anna, nested.clone(), true),
        (anna_smith, nested.clone(), true),
        (anna_jones, nested, false),
        (
            json!({"data": {"items": {"sku": ["a"], "qty": [2]}}}),
            json!({"items": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}]}),
            false,
        ),
        (
            json!({"data": {"items": {"sku": ["a"], "qty": [2]}}}),
            json!({"items": [{"sku": "b", "qty": 1}, {"sku": "a", "qty": 2}]}),
            true,
        ),
        (
            json!({"data": {"items": {"sku": [{"anything-but": "a"}], "qty": [1]}}}),
            json!({"items": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 2}]}),
            false,
        ),
        (
            json!({"data": {"items": {"sku": ["a"], "qty": [{"numeric": [">", 1]}]}}}),
            json!({"items": [{"sku": "a", "qty": [0, 5]}]}),
            true,
        ),
        // A field outside the array combines with any element.
        (
            json!({"data": {"c": ["k"], "items": {"sku": ["b"]}}}),
            json!({"c": "k", "items": [{"sku": "a"}, {"sku": "b"}]}),
            true,
        ),
        // Scalars directly in an array are independent values.
        (
            json!({"data": {"tags": ["a"], "$or": [{"tags": ["b"]}, {"x": [1]}]}}),
            json!({"tags": ["a", "b"]}),
            true,
        ),
        // Different arrays do not constrain each other.
        (
            json!({"data": {"a": {"x": [1]}, "b": {"y": [2]}}}),
            json!({"a": [{"x": 0}, {"x": 1}], "b": [{"y": 2}, {"y": 3}]}),
            true,
        ),
    ]);
}

#[test]
fn bad_patterns_carry_their_json_pointer() {
    for (pattern, pointer) in [
        (json!([1]), ""),
        (
            json!({"data": {"price": [{"numeric": [">", "x"]}]}}),
            "/data/price/0/numeric/1",
        ),
        // Keys with `.`, `/` and `~` stay one segment, escaped as RFC 6901 says.
        (
            json!({"data": {"a.b/c~d": [{"prefix": 1}]}}),
            "/data/a.b~1c~0d/0/prefix",
        ),
    ] {
        let e = Pattern::compile(&pattern).expect_err(&pattern.to_string());
        assert_eq!(e.pointer, pointer, "{pattern}");
    }
}
