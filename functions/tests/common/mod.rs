#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use cloudevents::Event;
use serde_json::{json, Value};

/// A structured-mode event with the given data and extra attributes merged in.
pub(crate) fn event(data: Value, extra: Value) -> Event {
    let mut base = json!({
        "specversion": "1.0",
        "id": "e-1",
        "source": "/orders/eu",
        "type": "com.example.order.created",
        "subject": "order/42",
        "time": "2024-05-01T10:00:00Z",
        "datacontenttype": "application/json",
        "data": data,
    });
    if let (Some(b), Some(e)) = (base.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            if v.is_null() {
                b.remove(k);
            } else {
                b.insert(k.clone(), v.clone());
            }
        }
    }
    serde_json::from_value(base).expect("valid test event")
}

pub(crate) fn data_event(data: Value) -> Event {
    event(data, json!({}))
}
