//! Arbitrary text through the CESQL parser; whatever parses is evaluated.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sluice_functions::CesqlFilter;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(filter) = CesqlFilter::parse(text) else {
        return;
    };
    let event: cloudevents::Event = match serde_json::from_value(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t.a", "subject": "Grüße",
        "sequence": "10", "hop": 3, "flag": true
    })) {
        Ok(e) => e,
        Err(_) => return,
    };
    let _ = filter.evaluate(&event);
    let _ = filter.matches(&event);
});
