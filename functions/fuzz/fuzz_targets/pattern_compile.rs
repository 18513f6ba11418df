//! Arbitrary JSON through the pattern compiler; whatever compiles must match the same way
//! directly and through the rule index.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sluice_functions::{Pattern, RuleIndex};

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let Ok(pattern) = Pattern::compile(&value) else {
        return;
    };
    let event: cloudevents::Event = match serde_json::from_value(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t.a", "subject": "x",
        "region": "eu", "n": 5,
        "data": {"a": "x", "b": [1, 2.5, "y", null, true], "c": {"d": "10.0.0.1"}, "n": 300,
                 "items": [{"a": "x", "n": 1, "c": [{"d": "y"}, {"d": "x"}]}, {"a": "y", "n": 300},
                           [{"a": "z", "b": true}]]}
    })) {
        Ok(e) => e,
        Err(_) => return,
    };
    let direct = pattern.matches(&event);
    let mut b = RuleIndex::builder();
    b.add_pattern(0, &pattern);
    let mut out = Vec::new();
    b.build().matches(&event, &mut out);
    assert_eq!(direct, out == [0]);
});
