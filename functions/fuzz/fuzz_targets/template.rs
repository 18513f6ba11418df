//! Arbitrary template text through the TEMPLATE transform, applied to a fixed event whose
//! values contain quotes, backslashes, non-ASCII text and nested JSON.
#![no_main]

use libfuzzer_sys::fuzz_target;
use serde_json::json;
use sluice_functions::{Output, TransformChain};

fuzz_target!(|data: &[u8]| {
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
    let event: cloudevents::Event = match serde_json::from_value(json!({
        "specversion": "1.0", "id": "1", "source": "/s", "type": "t",
        "data": {"text": "q\"uo\\te \u{1F600} </x>\n", "obj": {"k": [1, "v\""]}, "n": -1.5e3}
    })) {
        Ok(e) => e,
        Err(_) => return,
    };
    if let Ok(Output::Body { content_type, bytes }) = chain.apply(&event) {
        // A JSON template must always render valid JSON.
        if content_type == "application/json" {
            assert!(serde_json::from_slice::<serde_json::Value>(&bytes).is_ok());
        }
    }
});
