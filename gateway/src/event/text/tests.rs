use cloudevents::{EventBuilder, EventBuilderV10};
use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::event::{decode, encode};

/// What `read` gives for `stored` is what decoding it gives: the same attributes (the
/// decoder's extensions come in no set order), content type and data (JSON data as the same
/// JSON value: the decoder writes it out again).
fn reads_as_decoded(stored: &[u8]) {
    let shown = String::from_utf8_lossy(stored);
    let read = EventText::read(stored).unwrap_or_else(|| panic!("not read: {shown}"));
    let decoded = decode(stored).unwrap_or_else(|e| panic!("{shown}: {e}"));
    let of = EventText::of(&decoded);
    let sorted = |t: &EventText| {
        let mut a: Vec<_> = (t.attributes.iter())
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        a.sort();
        a
    };
    assert_eq!(sorted(&read), sorted(&of), "{shown}");
    let context: Vec<_> = (read.attributes.iter())
        .map(|(n, _)| n.as_ref())
        .take_while(|n| attribute_rank(n) < 8)
        .collect();
    let of_context: Vec<_> = (of.attributes.iter())
        .map(|(n, _)| n.as_ref())
        .take_while(|n| attribute_rank(n) < 8)
        .collect();
    assert_eq!(
        context, of_context,
        "context attributes in the SDK's order: {shown}"
    );
    assert_eq!(read.datacontenttype, of.datacontenttype, "{shown}");
    assert_eq!(read.content_type(), of.content_type(), "{shown}");
    assert_eq!(read.id(), cloudevents::AttributesReader::id(&decoded));
    match (&read.data, &of.data) {
        (DataText::Json(a), DataText::Json(b)) => {
            let a: serde_json::Value = serde_json::from_slice(a).unwrap();
            let b: serde_json::Value = serde_json::from_slice(b).unwrap();
            assert_eq!(a, b, "{shown}");
        }
        (a, b) => assert_eq!(a, b, "{shown}"),
    }
}

fn event() -> EventBuilderV10 {
    EventBuilderV10::new()
        .id("order-1")
        .source("/shop/orders")
        .ty("com.example.order.created")
}

#[test]
fn stored_events_read_as_they_decode() {
    let time = chrono::DateTime::parse_from_rfc3339("2024-05-01T10:00:00.123+02:00")
        .unwrap()
        .with_timezone(&chrono::Utc);
    let events = [
        event().build().unwrap(),
        event()
            .time(time)
            .subject("o/1")
            .extension("partitionkey", "k1")
            .extension(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )
            .extension("seq", 42)
            .extension("neg", -7)
            .extension("urgent", true)
            .data(
                "application/json",
                json!({"b": [1, 2.5, {"c": null}], "a": "é\"\\\n"}),
            )
            .build()
            .unwrap(),
        event()
            .data("text/plain; charset=utf-8", "plain \"text\" ü")
            .build()
            .unwrap(),
        event()
            .data("application/octet-stream", vec![0u8, 1, 255])
            .build()
            .unwrap(),
        event()
            .data("application/cloudevents+json", json!("a JSON string"))
            .build()
            .unwrap(),
        event()
            .data("application/json", json!([1, "two", [3]]))
            .build()
            .unwrap(),
        event()
            .id("quote \" backslash \\ tab \t control \u{1} emoji 🦀")
            .build()
            .unwrap(),
    ];
    for event in &events {
        reads_as_decoded(&encode(event).unwrap());
    }
    // With a data schema (a URL the decoder parses).
    let stored = br#"{"specversion":"1.0","id":"1","source":"s","type":"t","dataschema":"https://example.com/schema.json","data":{}}"#;
    reads_as_decoded(stored);
}

#[test]
fn binary_mode_ingest_keeps_the_producers_json_and_it_reads_back_as_stored() {
    // As `append_binary_data` stores a binary-mode body: the producer's bytes, in its order.
    let stored = br#"{"specversion":"1.0","id":"1","source":"/s","type":"t","datacontenttype":"application/json","data":{"z":1,"a":{"y":[true,false]}}}"#;
    reads_as_decoded(stored);
    let read = EventText::read(stored).unwrap();
    assert_eq!(read.data_bytes(), br#"{"z":1,"a":{"y":[true,false]}}"#);
    assert_eq!(read.content_type(), "application/json");
    assert_eq!(read.attribute("datacontenttype"), Some("application/json"));
    assert_eq!(read.attribute("type"), Some("t"));
    assert_eq!(read.attribute("missing"), None);
    // Whitespace and member order as a hand-written stored form might have them.
    reads_as_decoded(
        b" { \"data\" : [ 1 , \"]}\" ] , \"type\" : \"t\" ,\n\"source\":\"s\", \"id\" : \"1\", \"specversion\" : \"1.0\" , \"x\" : null } ",
    );
}

#[test]
fn what_the_reading_does_not_vouch_for_is_left_to_the_decoder() {
    let not = [
        // Not 1.0, or not an event.
        r#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#,
        r#"{"id":"1","source":"s","type":"t"}"#,
        r#"{"specversion":"1.0","source":"s","type":"t"}"#,
        r#"{"specversion":"1.0","id":null,"source":"s","type":"t"}"#,
        r#"{"specversion":"1.0","id":1,"source":"s","type":"t"}"#,
        r#"["specversion"]"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t""#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t"} x"#,
        "",
        // Names with escapes, extensions the SDK does not hold, a time it does not parse.
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","\u0078":"a"}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":1.5}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":-0}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":99999999999999999999}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","x":{"a":1}}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","time":"yesterday"}"#,
        // Data the decoder decides on.
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":null}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data_base64":"e30="}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"application/json","data_base64":"e30="}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":"a","data_base64":"e30="}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"text/plain","data":{"a":1}}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","datacontenttype":"image/png","data_base64":"%%%"}"#,
    ];
    for text in not {
        assert_eq!(EventText::read(text.as_bytes()), None, "{text}");
    }
}

#[test]
fn members_are_the_top_level_ones_with_their_json_text() {
    let text = r#"{"a":"x\"}","b":{"c":[1,{"d":"]"}]},"e":-1.5e3,"f":true}"#;
    assert_eq!(
        members(text),
        Some(vec![
            ("a", r#""x\"}""#),
            ("b", r#"{"c":[1,{"d":"]"}]}"#),
            ("e", "-1.5e3"),
            ("f", "true"),
        ])
    );
    assert_eq!(members("{}"), Some(vec![]));
    for bad in [
        "{,}",
        r#"{"a":1,}"#,
        r#"{"a"}"#,
        r#"{"a":}"#,
        r#"{"a":[1}"#,
        "{",
    ] {
        let _ = members(bad); // no panic; the stored form is trusted to be JSON
    }
    assert_eq!(members(r#"{"a":1"#), None);
    assert_eq!(members(r#"{"a":1} {"#), None);
}

#[test]
fn structured_text_is_the_stored_form_when_its_data_is_json_or_absent() {
    let ok = [
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"a":[1,2]}}"#,
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t"}"#,
        r#"{"specversion":"1.0","id":"a\"data\":\"x","source":"s","type":"t","seq":5,"ok":true,"data":7}"#,
        r#" { "id" : "1" , "data" : null } "#,
    ];
    for text in ok {
        assert_eq!(structured_text(text.as_bytes()), Some(text), "{text}");
    }
    let not = [
        r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":"{\"a\":1}"}"#,
        r#"{"specversion":"1.0","id":"1","data_base64":"e30=","source":"s","type":"t"}"#,
        r#"{"id":"1","x":{"data":1},"data":{}}"#,
        r#"["data"]"#,
        r#"{"id":"1""#,
        r#"{"id":"1","data""#,
        "",
    ];
    for text in not {
        assert_eq!(structured_text(text.as_bytes()), None, "{text}");
    }
    assert_eq!(structured_text(b"{\"id\":\"\xff\"}"), None);
    // What the gateway stores reads so.
    let event = cloudevents::EventBuilderV10::new()
        .id("1")
        .source("s")
        .ty("t")
        .extension("seq", 5i64)
        .data("application/json", serde_json::json!({"a": 1}))
        .build()
        .unwrap();
    let stored = encode(&event).unwrap();
    assert!(structured_text(&stored).is_some());
    let text = cloudevents::EventBuilderV10::new()
        .id("1")
        .source("s")
        .ty("t")
        .data("text/plain", "hello")
        .build()
        .unwrap();
    assert_eq!(structured_text(&encode(&text).unwrap()), None);
}

proptest! {
    /// Any text in the string attributes and extensions, any integer: read as decoded.
    #[test]
    fn any_attribute_text_reads_as_it_decodes(
        id in "\\PC{1,20}|[\"\\\\\u{0}-\u{1f}\u{7f}-\u{10ffff}]{1,8}",
        subject in "\\PC{0,20}",
        ext in "\\PC{0,20}",
        number in any::<i64>(),
        text in "\\PC{0,40}",
    ) {
        let mut builder = event().id(id).extension("ext", ext).extension("n", number);
        if !subject.is_empty() {
            builder = builder.subject(subject);
        }
        let with_json = builder.clone().data("application/json", json!({ "t": text })).build().unwrap();
        reads_as_decoded(&encode(&with_json).unwrap());
        let with_text = builder.data("text/plain", text).build().unwrap();
        reads_as_decoded(&encode(&with_text).unwrap());
    }
}
