//! The translation's unit tests, and the Knative conformance table: Trigger filters from
//! Knative's own tests and docs, translated and evaluated by the CESQL engine against real
//! CloudEvents, with the outcome Knative gives (delivered or not). Each case cites where it
//! comes from:
//! - `attributes_test`: knative/eventing `pkg/eventfilter/attributes/filter_test.go`
//!   (`TestAttributesFilter_Filter`);
//! - `exact_test`, `prefix_test`, `suffix_test`, `cesql_test`, `not_test`, `any_test`,
//!   `all_test`: knative/eventing `pkg/eventfilter/subscriptionsapi/<dialect>_filter_test.go`;
//! - `validation_test`: knative/eventing `pkg/apis/eventing/v1/trigger_validation_test.go`;
//! - `docs`: knative/docs `docs/versioned/eventing/triggers/README.md`;
//! - `code`: derived from the filter code itself (`any_filter.go`, `all_filter.go`,
//!   `not_filter.go`, `create.go`: "no filter" outcomes), where no test states the case.
//!
//! Knative's test events (`makeEvent`): type `dev.knative.example`, source
//! `knativesource`, id `1234`, extension `knativebrokerttl` = 20.

use serde_json::{json, Value};

use super::*;

fn event(extra: Value) -> cloudevents::Event {
    let mut e = json!({
        "specversion": "1.0",
        "type": "dev.knative.example",
        "source": "knativesource",
        "id": "1234",
        "knativebrokerttl": 20,
    });
    if let (Some(base), Some(extra)) = (e.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            base.insert(k.clone(), v.clone());
        }
    }
    serde_json::from_value(e).expect("a CloudEvent")
}

/// The Trigger `spec` (its `filter` and `filters`) translated, then evaluated.
fn delivered(spec: &Value, event: &cloudevents::Event) -> Result<bool, KnativeFilterError> {
    let filter: Option<AttributesFilter> = spec
        .get("filter")
        .map(|f| serde_json::from_value(f.clone()).expect("filter"));
    let filters: Vec<SubscriptionsFilter> = spec
        .get("filters")
        .map(|f| serde_json::from_value(f.clone()).expect("filters"))
        .unwrap_or_default();
    Ok(match translate(filter.as_ref(), &filters)? {
        None => true,
        Some(text) => CesqlFilter::parse(&text)
            .expect("the translation parses")
            .matches(event),
    })
}

fn ext() -> Value {
    json!({"myextension": "my-extension-value"})
}

/// (source, case name, trigger spec, event extras, delivered)
fn table() -> Vec<(&'static str, &'static str, Value, Value, bool)> {
    vec![
        // Legacy attributes filter.
        (
            "attributes_test",
            "Wrong type",
            json!({"filter": {"attributes": {"type": "some-other-type", "source": ""}}}),
            json!({}),
            false,
        ),
        (
            "attributes_test",
            "Wrong source",
            json!({"filter": {"attributes": {"type": "", "source": "some-other-source"}}}),
            json!({}),
            false,
        ),
        (
            "attributes_test",
            "Any",
            json!({"filter": {"attributes": {"type": "", "source": ""}}}),
            json!({}),
            true,
        ),
        (
            "attributes_test",
            "Specific",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource"}}}),
            json!({}),
            true,
        ),
        (
            "attributes_test",
            "Extension with attribs",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "myextension": "my-extension-value"}}}),
            ext(),
            true,
        ),
        (
            "attributes_test",
            "Any Extension with attribs - without Extension in Event",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "myextension": ""}}}),
            json!({}),
            false,
        ),
        (
            "attributes_test",
            "Any Extension with attribs - with Extension in Event",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "myextension": ""}}}),
            ext(),
            true,
        ),
        (
            "attributes_test",
            "Any Subject with attribs - without Subject in Event",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "subject": ""}}}),
            json!({}),
            false,
        ),
        (
            "attributes_test",
            "Any Subject with attribs - with Subject in Event",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "subject": ""}}}),
            json!({"subject": "subject-value"}),
            true,
        ),
        (
            "attributes_test",
            "Wrong Extension with attribs",
            json!({"filter": {"attributes": {"type": "dev.knative.example", "source": "knativesource", "myextension": "some-other-extension-value"}}}),
            ext(),
            false,
        ),
        // exact
        (
            "exact_test",
            "Wrong type",
            json!({"filters": [{"exact": {"type": "some-other-type"}}]}),
            json!({}),
            false,
        ),
        (
            "exact_test",
            "Match type",
            json!({"filters": [{"exact": {"type": "dev.knative.example"}}]}),
            json!({}),
            true,
        ),
        (
            "exact_test",
            "Match extension",
            json!({"filters": [{"exact": {"myextension": "my-extension-value"}}]}),
            ext(),
            true,
        ),
        (
            "exact_test",
            "Missing attribute",
            json!({"filters": [{"exact": {"missingattribute": "missingvalue"}}]}),
            json!({}),
            false,
        ),
        (
            "exact_test",
            "Multiple: Match type and wrong source",
            json!({"filters": [{"exact": {"type": "dev.knative.example", "source": "some-other-source"}}]}),
            json!({}),
            false,
        ),
        (
            "exact_test",
            "Multiple: Match type and miss extension",
            json!({"filters": [{"exact": {"type": "dev.knative.example", "myextension": "my-extension-value"}}]}),
            json!({}),
            false,
        ),
        (
            "exact_test",
            "Multiple: Match type and match extension",
            json!({"filters": [{"exact": {"type": "dev.knative.example", "myextension": "my-extension-value"}}]}),
            ext(),
            true,
        ),
        // prefix ("some-other-attribute" of the Go test is not a valid name: a valid one)
        (
            "prefix_test",
            "Missing attribute",
            json!({"filters": [{"prefix": {"someotherattribute": "wrong.prefix"}}]}),
            json!({}),
            false,
        ),
        (
            "prefix_test",
            "Wrong source prefix",
            json!({"filters": [{"prefix": {"source": "wrong.prefix"}}]}),
            json!({}),
            false,
        ),
        (
            "prefix_test",
            "Match type prefix",
            json!({"filters": [{"prefix": {"type": "dev.knative"}}]}),
            json!({}),
            true,
        ),
        (
            "prefix_test",
            "Match extension prefix",
            json!({"filters": [{"prefix": {"myextension": "my-extension"}}]}),
            ext(),
            true,
        ),
        (
            "prefix_test",
            "Multiple: Match type and missing extension",
            json!({"filters": [{"prefix": {"type": "dev.knative", "myextension": "attri.prefix"}}]}),
            json!({}),
            false,
        ),
        // suffix
        (
            "suffix_test",
            "Wrong type suffix",
            json!({"filters": [{"suffix": {"type": "wrong.suffix"}}]}),
            json!({}),
            false,
        ),
        (
            "suffix_test",
            "Match type suffix",
            json!({"filters": [{"suffix": {"type": ".knative.example"}}]}),
            json!({}),
            true,
        ),
        (
            "suffix_test",
            "Match extension suffix",
            json!({"filters": [{"suffix": {"myextension": "extension-value"}}]}),
            ext(),
            true,
        ),
        (
            "suffix_test",
            "Multiple: Match type and match source",
            json!({"filters": [{"suffix": {"type": ".knative.example", "source": "source"}}]}),
            json!({}),
            true,
        ),
        // cesql
        (
            "cesql_test",
            "Wrong type",
            json!({"filters": [{"cesql": "type = 'wrong.type'"}]}),
            json!({}),
            false,
        ),
        (
            "cesql_test",
            "Match type",
            json!({"filters": [{"cesql": "type = 'dev.knative.example'"}]}),
            json!({}),
            true,
        ),
        (
            "cesql_test",
            "Match numeric extension",
            json!({"filters": [{"cesql": "knativebrokerttl < 30"}]}),
            json!({}),
            true,
        ),
        (
            "cesql_test",
            "Match type OR Source",
            json!({"filters": [{"cesql": "(type = 'dev.knative.example') OR (source = 'some-other-source')"}]}),
            json!({}),
            true,
        ),
        (
            "cesql_test",
            "Missing attribute less than comparison",
            json!({"filters": [{"cesql": "missingattribute < 5"}]}),
            json!({}),
            false,
        ),
        (
            "cesql_test",
            "Missing attribute equals comparison",
            json!({"filters": [{"cesql": "missingattribute = missinsvalue"}]}),
            json!({}),
            false,
        ),
        // not
        (
            "not_test",
            "Empty (not around nothing: no filter)",
            json!({"filters": [{"not": {}}]}),
            json!({}),
            true,
        ),
        (
            "not_test",
            "Not Pass",
            json!({"filters": [{"not": {"exact": {"type": "dev.knative.example"}}}]}),
            json!({}),
            false,
        ),
        (
            "not_test",
            "Not Fail",
            json!({"filters": [{"not": {"exact": {"type": "some-other-type"}}}]}),
            json!({}),
            true,
        ),
        // any
        (
            "any_test",
            "Pass and Fail",
            json!({"filters": [{"any": [{"exact": {"type": "dev.knative.example"}}, {"exact": {"type": "x"}}]}]}),
            json!({}),
            true,
        ),
        (
            "any_test",
            "Fail and Fail",
            json!({"filters": [{"any": [{"exact": {"type": "x"}}, {"exact": {"source": "y"}}]}]}),
            json!({}),
            false,
        ),
        (
            "any_test",
            "Any(Fail,Any(Pass))",
            json!({"filters": [{"any": [{"exact": {"type": "x"}}, {"any": [{"exact": {"source": "knativesource"}}]}]}]}),
            json!({}),
            true,
        ),
        (
            "any_test",
            "Any(Fail,Any(Fail))",
            json!({"filters": [{"any": [{"exact": {"type": "x"}}, {"any": [{"exact": {"source": "y"}}]}]}]}),
            json!({}),
            false,
        ),
        // all
        (
            "all_test",
            "Pass and Fail",
            json!({"filters": [{"all": [{"exact": {"type": "dev.knative.example"}}, {"exact": {"type": "x"}}]}]}),
            json!({}),
            false,
        ),
        (
            "all_test",
            "Pass and Pass",
            json!({"filters": [{"all": [{"exact": {"type": "dev.knative.example"}}, {"prefix": {"source": "knative"}}]}]}),
            json!({}),
            true,
        ),
        (
            "all_test",
            "All(Pass,All(Fail))",
            json!({"filters": [{"all": [{"exact": {"type": "dev.knative.example"}}, {"all": [{"exact": {"source": "y"}}]}]}]}),
            json!({}),
            false,
        ),
        // The docs' examples.
        (
            "docs",
            "cesql: source LIKE and type IN",
            json!({"filters": [{"cesql": "source LIKE '%commerce%' AND type IN ('order.created', 'order.updated', 'order.canceled')"}]}),
            json!({"source": "/ecommerce/eu", "type": "order.updated"}),
            true,
        ),
        (
            "docs",
            "cesql: type not in the list",
            json!({"filters": [{"cesql": "source LIKE '%commerce%' AND type IN ('order.created', 'order.updated', 'order.canceled')"}]}),
            json!({"source": "/ecommerce/eu", "type": "order.shipped"}),
            false,
        ),
        (
            "docs",
            "all: exact type and exact subject",
            json!({"filters": [{"all": [{"exact": {"type": "com.github.push"}}, {"exact": {"subject": "https://github.com/cloudevents/spec"}}]}]}),
            json!({"type": "com.github.push", "subject": "https://github.com/cloudevents/spec"}),
            true,
        ),
        (
            "docs",
            "any: exact type or exact subject",
            json!({"filters": [{"any": [{"exact": {"type": "com.github.push"}}, {"exact": {"subject": "https://github.com/cloudevents/spec"}}]}]}),
            json!({"type": "com.github.pull", "subject": "https://github.com/cloudevents/spec"}),
            true,
        ),
        (
            "docs",
            "not: exact type com.github.push",
            json!({"filters": [{"not": {"exact": {"type": "com.github.push"}}}]}),
            json!({"type": "com.github.push"}),
            false,
        ),
        (
            "docs",
            "filters overrides filter (type dev.knative.a delivered)",
            json!({"filters": [{"exact": {"type": "dev.knative.a"}}], "filter": {"attributes": {"type": "dev.knative.b"}}}),
            json!({"type": "dev.knative.a"}),
            true,
        ),
        (
            "docs",
            "filters overrides filter (type dev.knative.b not delivered)",
            json!({"filters": [{"exact": {"type": "dev.knative.a"}}], "filter": {"attributes": {"type": "dev.knative.b"}}}),
            json!({"type": "dev.knative.b"}),
            false,
        ),
        (
            "docs",
            "legacy attributes: type and extension",
            json!({"filter": {"attributes": {"type": "dev.knative.foo.bar", "myextension": "my-extension-value"}}}),
            json!({"type": "dev.knative.foo.bar", "myextension": "my-extension-value"}),
            true,
        ),
        // "No filter" outcomes, from the code.
        (
            "code",
            "filters: [] is no filter",
            json!({"filters": []}),
            json!({}),
            true,
        ),
        (
            "code",
            "filters: [{}] is no filter",
            json!({"filters": [{}]}),
            json!({}),
            true,
        ),
        (
            "code",
            "all: [exact pass, {}] (the empty object is skipped)",
            json!({"filters": [{"all": [{"exact": {"type": "dev.knative.example"}}, {}]}]}),
            json!({}),
            true,
        ),
        (
            "code",
            "any: [not {}, exact fail]: the last result (fail)",
            json!({"filters": [{"any": [{"not": {}}, {"exact": {"type": "x"}}]}]}),
            json!({}),
            false,
        ),
        (
            "code",
            "any: [exact fail, not {}]: the last result (no filter)",
            json!({"filters": [{"any": [{"exact": {"type": "x"}}, {"not": {}}]}]}),
            json!({}),
            true,
        ),
        (
            "code",
            "not all: [exact pass, not {}]: not of no filter",
            json!({"filters": [{"not": {"all": [{"exact": {"type": "dev.knative.example"}}, {"not": {}}]}}]}),
            json!({}),
            true,
        ),
        (
            "code",
            "not all: [not {}, exact pass]: not of pass",
            json!({"filters": [{"not": {"all": [{"not": {}}, {"exact": {"type": "dev.knative.example"}}]}}]}),
            json!({}),
            false,
        ),
        (
            "code",
            "not any: [exact fail, not {}]: not of no filter",
            json!({"filters": [{"not": {"any": [{"exact": {"type": "x"}}, {"not": {}}]}}]}),
            json!({}),
            true,
        ),
    ]
}

#[test]
fn conformance_table() {
    let cases = table();
    assert!(cases.len() >= 20);
    let mut failures = Vec::new();
    for (source, name, spec, extra, want) in &cases {
        let e = event(extra.clone());
        match delivered(spec, &e) {
            Ok(got) if got == *want => {}
            Ok(got) => failures.push(format!(
                "{source} / {name}: delivered {got}, Knative {want} (filter {:?})",
                translate_spec(spec)
            )),
            Err(err) => failures.push(format!("{source} / {name}: {err}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn translate_spec(spec: &Value) -> Result<Option<String>, KnativeFilterError> {
    let filter: Option<AttributesFilter> = spec
        .get("filter")
        .map(|f| serde_json::from_value(f.clone()).expect("filter"));
    let filters: Vec<SubscriptionsFilter> = spec
        .get("filters")
        .map(|f| serde_json::from_value(f.clone()).expect("filters"))
        .unwrap_or_default();
    translate(filter.as_ref(), &filters)
}

/// What Knative's admission webhook refuses is refused, naming where.
#[test]
fn refusals() {
    let cases = [
        // validation_test "invalid multiple dialects"; also the docs' first example, which
        // sets `exact` and `suffix` in one object.
        (
            json!({"filters": [{"exact": {"myext": "abc"}, "suffix": {"myext": "abc"}}]}),
            "filters[0]",
        ),
        // validation_test "invalid exact filter attribute name, start with number"
        (
            json!({"filters": [{"exact": {"0invalid": "some-value"}}]}),
            "filters[0].exact.0invalid",
        ),
        // validation_test "invalid exact filter attribute name, capital letters"
        (
            json!({"filters": [{"exact": {"invALID": "some-value"}}]}),
            "filters[0].exact.invALID",
        ),
        // validation_test "all filter sub expression is invalid"
        (
            json!({"filters": [{"all": [{"exact": {"type": "t"}}, {"exact": {"myattr": "myval"}}, {"prefix": {"invALID": "abc"}}]}]}),
            "filters[0].all[2].prefix.invALID",
        ),
        // validation_test (CESQL that does not parse)
        (
            json!({"filters": [{"cesql": "type = "}]}),
            "filters[0].cesql",
        ),
        (
            json!({"filter": {"attributes": {"Type": "x"}}}),
            "filter.attributes.Type",
        ),
        // An empty value: Knative drops the filter at run time; refused here.
        (
            json!({"filters": [{"exact": {"type": ""}}]}),
            "filters[0].exact.type",
        ),
        (
            json!({"filters": [{"not": {"prefix": {"like": "x"}}}]}),
            "filters[0].not.prefix.like",
        ),
    ];
    for (spec, at) in cases {
        let err = translate_spec(&spec).expect_err(&spec.to_string());
        assert_eq!(err.at, at, "{spec}: {err}");
    }
    // Multiple keys in one dialect are valid (validation_test "valid exact filter
    // containing more than one attribute").
    translate_spec(&json!({"filters": [{"exact": {"myext": "abc", "anotherext": "xyz"}}]}))
        .expect("valid");
}

#[test]
fn nesting_is_bounded() {
    let mut f = json!({"exact": {"type": "t"}});
    for _ in 0..40 {
        f = json!({"not": f});
    }
    let err = translate_spec(&json!({"filters": [f]})).expect_err("too deep");
    assert!(err.message.contains("deeper"), "{err}");
}

#[test]
fn translations_read_as_expected() {
    let t = |spec: Value| translate_spec(&spec).expect("translates");
    assert_eq!(t(json!({})), None);
    assert_eq!(t(json!({"filter": {"attributes": {}}})), None);
    assert_eq!(
        t(json!({"filters": [{"exact": {"type": "a"}}]})).as_deref(),
        Some("EXISTS type AND type = 'a'")
    );
    assert_eq!(
        t(json!({"filters": [{"prefix": {"type": "a%_\\b"}}]})).as_deref(),
        Some("EXISTS type AND type LIKE 'a\\%\\_\\\\b%'")
    );
    assert_eq!(
        t(json!({"filters": [{"not": {"exact": {"type": "a"}}}]})).as_deref(),
        Some("NOT (EXISTS type AND type = 'a')")
    );
    assert_eq!(
        t(json!({"filters": [{"any": [{"exact": {"type": "a"}}, {"cesql": "source = 'x' OR id = 'y'"}]}]}))
            .as_deref(),
        Some("(EXISTS type AND type = 'a') OR (source = 'x' OR id = 'y')")
    );
    assert_eq!(
        t(json!({"filter": {"attributes": {"subject": "", "schemaurl": "s"}}})).as_deref(),
        Some("EXISTS dataschema AND dataschema = 's' AND EXISTS subject AND subject <> ''")
    );
}

/// Values that LIKE or the string literal would otherwise read as syntax match only
/// themselves.
#[test]
fn hostile_values_match_literally() {
    let values = [
        "it's",
        "a%b",
        "a_b",
        "back\\slash",
        "ends\\",
        "\\",
        "'",
        "\\'",
        "''",
        "%",
        "_",
        "日本%",
    ];
    for v in values {
        for (dialect, hit, miss) in [
            ("exact", v.to_string(), format!("{v}x")),
            ("prefix", format!("{v}tail"), format!("x{v}")),
            ("suffix", format!("head{v}"), format!("{v}x")),
        ] {
            let spec = json!({"filters": [{dialect: {"myext": v}}]});
            let text = translate_spec(&spec)
                .expect("translates")
                .expect("a filter");
            let filter = CesqlFilter::parse(&text).expect(&text);
            let hit_event = event(json!({"myext": hit}));
            let miss_event = event(json!({"myext": miss}));
            assert!(
                filter.matches(&hit_event),
                "{dialect} {v:?} on {hit:?}: {text}"
            );
            assert!(
                !filter.matches(&miss_event),
                "{dialect} {v:?} on {miss:?}: {text}"
            );
            // A value that only looks like the pattern does not match.
            if v.contains(['%', '_']) {
                let other = v.replace(['%', '_'], "Z");
                let e = event(json!({"myext": other}));
                assert!(!filter.matches(&e), "{dialect} {v:?} on {other:?}: {text}");
            }
        }
    }
}

/// `""` in `filter.attributes` is "present and not empty"; an empty extension fails.
#[test]
fn any_value_needs_a_non_empty_value() {
    let spec = json!({"filter": {"attributes": {"myext": ""}}});
    assert!(!delivered(&spec, &event(json!({"myext": ""}))).expect("translates"));
    assert!(delivered(&spec, &event(json!({"myext": "v"}))).expect("translates"));
    assert!(delivered(&spec, &event(json!({"myext": 5}))).expect("translates"));
}
