//! The bodies of the fuzz targets of this crate, shared by the cargo-fuzz binaries
//! (`functions/fuzz`) and the stable corpus test (`gateway/tests/fuzz_corpora.rs`), so both
//! check the same invariants. Each takes the raw input and panics when an invariant breaks.
//! Not part of the crate's API.

use serde_json::json;

use crate::{CesqlFilter, Output, Pattern, RuleIndex, TransformChain};

fn event(value: serde_json::Value) -> Option<cloudevents::Event> {
    serde_json::from_value(value).ok()
}

/// Arbitrary JSON through the pattern compiler; whatever compiles must match the same way
/// directly and through the rule index.
pub fn pattern_compile(data: &[u8]) {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(pattern) = Pattern::compile(&value) else {
        return;
    };
    let Some(event) = event(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t.a", "subject": "x",
        "region": "eu", "n": 5,
        "data": {"a": "x", "b": [1, 2.5, "y", null, true], "c": {"d": "10.0.0.1"}, "n": 300,
                 "items": [{"a": "x", "n": 1, "c": [{"d": "y"}, {"d": "x"}]}, {"a": "y", "n": 300},
                           [{"a": "z", "b": true}]]}
    })) else {
        return;
    };
    let direct = pattern.matches(&event);
    let mut b = RuleIndex::builder();
    b.add_pattern(0, &pattern);
    let mut out = Vec::new();
    b.build().matches(&event, &mut out);
    assert_eq!(direct, out == [0], "pattern and rule index disagree");
}

/// Arbitrary text through the CESQL parser; whatever parses is evaluated, and `matches`
/// agrees with the evaluation.
pub fn cesql_parse(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(filter) = CesqlFilter::parse(text) else {
        return;
    };
    let Some(event) = event(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t.a", "subject": "Grüße",
        "sequence": "10", "hop": 3, "flag": true
    })) else {
        return;
    };
    let _ = filter.evaluate(&event);
    let _ = filter.matches(&event);
}

/// Arbitrary template text through the TEMPLATE transform, applied to a fixed event whose
/// values contain quotes, backslashes, non-ASCII text and nested JSON. A JSON template
/// always renders valid JSON.
pub fn template(data: &[u8]) {
    let Ok(template) = std::str::from_utf8(data) else {
        return;
    };
    let spec = json!({
        "form": "TEMPLATE",
        "value": {"a": "$.data.text", "b": "$.data.obj", "c": "$.data.missing", "n": "$.data.n"},
        "template": template,
    });
    let Ok(chain) = TransformChain::compile(&spec) else {
        return;
    };
    let Some(event) = event(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t",
        "data": {"text": "q\"uo\\te \u{1F600} </x>\n", "obj": {"k": [1, "v\""]}, "n": -1.5e3}
    })) else {
        return;
    };
    if let Ok(Output::Body {
        content_type,
        bytes,
    }) = chain.apply(&event)
    {
        if content_type == "application/json" {
            assert!(
                serde_json::from_slice::<serde_json::Value>(&bytes).is_ok(),
                "a JSON template rendered invalid JSON: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
    }
}
