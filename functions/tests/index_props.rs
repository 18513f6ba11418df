#![allow(clippy::unwrap_used, clippy::expect_used)]

//! Property: the index answers exactly as matching each rule alone.

use cloudevents::Event;
use proptest::prelude::*;
use serde_json::{json, Map, Value};
use sluice_functions::{Pattern, RuleIndex};

const STRINGS: &[&str] = &["a", "ab", "abc", "b", "B", "x", "", "10.0.0.1", "Straße"];
const NUMBERS: &[f64] = &[0.0, -0.0, 1.0, 2.0, 2.5, -1.0, 300.0, 1e300];

fn string() -> impl Strategy<Value = String> {
    prop::sample::select(STRINGS).prop_map(str::to_owned)
}

fn number() -> impl Strategy<Value = Value> {
    prop::sample::select(NUMBERS).prop_map(|n| {
        if n.fract() == 0.0 && n > -10.0 && n < 1e6 && !(n == 0.0 && n.is_sign_negative()) {
            json!(n as i64)
        } else {
            json!(n)
        }
    })
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => string().prop_map(Value::String),
        3 => number(),
        1 => any::<bool>().prop_map(Value::Bool),
        1 => Just(Value::Null),
    ]
}

fn matcher() -> impl Strategy<Value = Value> {
    let op = prop::sample::select(&["<", "<=", ">", ">=", "="][..]);
    prop_oneof![
        6 => scalar(),
        2 => string().prop_map(|s| json!({"prefix": s})),
        2 => string().prop_map(|s| json!({"suffix": s})),
        1 => string().prop_map(|s| json!({"prefix": {"equals-ignore-case": s}})),
        1 => string().prop_map(|s| json!({"suffix": {"equals-ignore-case": s}})),
        2 => string().prop_map(|s| json!({"equals-ignore-case": s})),
        1 => string().prop_map(|s| json!({"wildcard": format!("{s}*")})),
        1 => string().prop_map(|s| json!({"anything-but": s})),
        1 => prop::collection::vec(number(), 1..3).prop_map(|v| json!({"anything-but": v})),
        1 => string().prop_map(|s| json!({"anything-but": {"prefix": s}})),
        3 => (op, number()).prop_map(|(o, n)| json!({"numeric": [o, n]})),
        2 => (number(), number()).prop_map(|(a, b)| {
            let (x, y) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            let (lo, hi) = if x <= y { (a, b) } else { (b, a) };
            json!({"numeric": [">=", lo, "<=", hi]})
        }),
        2 => any::<bool>().prop_map(|b| json!({"exists": b})),
        1 => Just(json!({"cidr": "10.0.0.0/8"})),
    ]
}

fn field_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => scalar(),
        3 => prop::collection::vec(matcher(), 1..4).prop_map(Value::Array),
    ]
}

const DATA_FIELDS: &[&str] = &["a", "b", "n"];

fn data_pattern() -> impl Strategy<Value = Value> {
    (
        prop::collection::btree_map(prop::sample::select(DATA_FIELDS), field_value(), 1..3),
        prop::option::of((field_value(), prop::option::of(field_value()))),
    )
        .prop_map(|(fields, nested)| {
            let mut m: Map<String, Value> =
                fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            match nested {
                Some((d, Some(e))) => {
                    m.insert("c".into(), json!({ "d": d, "e": e }));
                }
                Some((d, None)) => {
                    m.insert("c".into(), json!({ "d": d }));
                }
                None => {}
            }
            Value::Object(m)
        })
}

fn pattern() -> impl Strategy<Value = Value> {
    let top = (
        prop::option::of(field_value()),
        prop::option::of(field_value()),
        prop::option::of(data_pattern()),
        prop::option::of(prop::collection::vec(data_pattern(), 2..3)),
    );
    top.prop_map(|(subject, region, data, or)| {
        let mut m = Map::new();
        if let Some(v) = subject {
            m.insert("subject".into(), v);
        }
        if let Some(v) = region {
            m.insert("region".into(), v);
        }
        if let Some(v) = data {
            m.insert("data".into(), v);
        }
        if let Some(alts) = or {
            let alts: Vec<Value> = alts.into_iter().map(|d| json!({ "data": d })).collect();
            m.insert("$or".into(), Value::Array(alts));
        }
        Value::Object(m)
    })
}

fn event_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        3 => scalar(),
        1 => prop::collection::vec(scalar(), 0..3).prop_map(Value::Array),
    ]
}

fn event() -> impl Strategy<Value = Event> {
    (
        prop::option::of(string()),
        prop::option::of(prop_oneof![
            string().prop_map(Value::String),
            Just(json!(5)),
            Just(json!(true))
        ]),
        prop::collection::btree_map(prop::sample::select(DATA_FIELDS), event_value(), 0..3),
        prop::collection::vec(
            (
                prop::option::of(event_value()),
                prop::option::of(event_value()),
            ),
            0..4,
        ),
    )
        .prop_map(|(subject, region, fields, elements)| {
            let mut data: Map<String, Value> =
                fields.into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
            if !elements.is_empty() {
                // An array of objects, so conditions on c.d and c.e must agree on the element.
                let items: Vec<Value> = elements
                    .into_iter()
                    .map(|(d, e)| {
                        let mut o = Map::new();
                        if let Some(d) = d {
                            o.insert("d".into(), d);
                        }
                        if let Some(e) = e {
                            o.insert("e".into(), e);
                        }
                        Value::Object(o)
                    })
                    .collect();
                data.insert("c".into(), Value::Array(items));
            }
            let mut ev = json!({
                "specversion": "1.0", "id": "1", "source": "/s", "type": "t",
                "datacontenttype": "application/json", "data": data,
            });
            if let Some(s) = subject {
                ev["subject"] = json!(s);
            }
            if let Some(r) = region {
                ev["region"] = r;
            }
            serde_json::from_value(ev).unwrap()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn index_agrees_with_each_pattern(
        patterns in prop::collection::vec(pattern(), 1..25),
        events in prop::collection::vec(event(), 1..8),
    ) {
        let compiled: Vec<Pattern> = patterns
            .iter()
            .filter_map(|p| Pattern::compile(p).ok())
            .collect();
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

    #[test]
    fn pattern_compiler_never_panics(v in arbitrary_json()) {
        let _ = Pattern::compile(&v);
    }
}

fn arbitrary_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        scalar(),
        prop::sample::select(
            &[
                "prefix",
                "numeric",
                "anything-but",
                "exists",
                "$or",
                "cidr",
                ">",
                "wildcard"
            ][..]
        )
        .prop_map(|s| json!(s)),
    ];
    leaf.prop_recursive(6, 64, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(
                prop::sample::select(
                    &[
                        "data",
                        "a",
                        "prefix",
                        "numeric",
                        "anything-but",
                        "exists",
                        "$or",
                        "suffix",
                        "equals-ignore-case",
                        "cidr",
                        "wildcard"
                    ][..]
                ),
                inner,
                0..3,
            )
            .prop_map(|m| Value::Object(m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())),
        ]
    })
}

#[test]
fn generators_exercise_matches() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let (mut compiled, mut total, mut matched) = (0, 0, 0);
    for _ in 0..400 {
        let p = pattern().new_tree(&mut runner).unwrap().current();
        let e = event().new_tree(&mut runner).unwrap().current();
        total += 1;
        if let Ok(p) = Pattern::compile(&p) {
            compiled += 1;
            if p.matches(&e) {
                matched += 1;
            }
        }
    }
    // The generators must produce mostly valid patterns and a fair share of matches,
    // or the equivalence property above would be vacuous.
    assert!(compiled * 10 >= total * 8, "{compiled}/{total} compiled");
    assert!(matched * 20 >= compiled, "{matched}/{compiled} matched");
}
