//! The stored form of an event, which every layer shares: CloudEvents structured JSON as
//! the SDK writes it (`encode`, `decode`), the check that a stored form reads back for
//! delivery (`check_stored`), how binary-mode data is written into it so that it does, the
//! shard an event belongs to (`partition_key`, `shard_of`), and the percent-encoding of
//! binary-mode header values (`percent_decode`, `header_text`).
//!
//! It sits at the bottom of the module tree: ingress writes events in this form, the store
//! keeps the bytes, and the runtime, targets, sources and replays read them back. It imports
//! nothing of the gateway.

use std::borrow::Cow;

use base64::Engine as _;
use cloudevents::event::{Data, ExtensionValue};
use cloudevents::{AttributesReader, Event};
use percent_encoding::{utf8_percent_encode, AsciiSet, CONTROLS};
use serde_json::Value;

/// Why an event (or a whole request) was refused. `field` names the attribute, header or limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct EventError {
    pub field: String,
    pub message: String,
    pub kind: ErrorKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    Invalid,
    TooLarge,
    /// The request is not in a media type this gateway reads (`415`).
    Unsupported,
}

impl EventError {
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        EventError {
            field: field.into(),
            message: message.into(),
            kind: ErrorKind::Invalid,
        }
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        EventError {
            field: "content-type".to_string(),
            message: message.into(),
            kind: ErrorKind::Unsupported,
        }
    }

    pub fn too_large(field: impl Into<String>, message: impl Into<String>) -> Self {
        EventError {
            field: field.into(),
            message: message.into(),
            kind: ErrorKind::TooLarge,
        }
    }
}

/// The stored form of an event: CloudEvents structured JSON, as the SDK writes it.
pub fn encode(event: &Event) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec(event)
}

/// Reads back the stored form.
pub fn decode(bytes: &[u8]) -> Result<Event, serde_json::Error> {
    serde_json::from_slice(bytes)
}

/// Refuses a stored form that delivery could not read back (`decode` is what the delivery
/// path runs). The parsers check each attribute, but the data is where they and the decoder
/// can differ: a lone surrogate escape (`"\ud800"`), invalid UTF-8 or a number out of range
/// inside a JSON body, nesting past the decoder's depth limit once the body sits inside the
/// event, non-string data with a non-JSON content type. Accepting such an event would stop
/// its shard's subscriptions for good, so it is a `400` here instead.
pub fn check_stored(stored: &[u8]) -> Result<(), EventError> {
    decode(stored).map(drop).map_err(|e| {
        EventError::invalid(
            "data",
            format!("the event would not read back as a CloudEvent for delivery: {e}"),
        )
    })
}

/// The key that decides an event's shard: the `partitionkey` extension, else the id.
pub fn partition_key(event: &Event) -> String {
    match event.extension("partitionkey") {
        Some(ExtensionValue::String(s)) => s.clone(),
        Some(other) => other.to_string(),
        None => event.id().to_string(),
    }
}

/// The shard of a partition key: FNV-1a 64, stable across processes, versions and machines
/// (every replica must agree on it).
pub fn shard_of(key: &str, shards: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u32
}

/// Nesting of JSON data up to which `strict_json` alone vouches for the stored event
/// (which adds a level): comfortably below the decoder's recursion limit of 128. Deeper
/// data is checked by decoding the whole event.
const STRICT_DEPTH: u32 = 100;

/// Whether the SDK's encoding of `event` certainly decodes again, judged from the event
/// alone. Attributes and extensions built by this gateway's parsers always do (the SDK
/// writes them as it reads them); the data is where decoding can fail:
/// - JSON data other than a string under a content type the decoder does not read as
///   JSON (`text/plain`, `Application/JSON`): the decoder wants a string there;
/// - JSON data nested near the decoder's recursion limit (the event adds a level).
///
/// Those, and anything else not certain, are `false`: `check_stored` decodes them once.
pub(crate) fn surely_reads_back(event: &Event) -> bool {
    match event.data() {
        None | Some(Data::Binary(_) | Data::String(_) | Data::Json(Value::String(_))) => true,
        Some(Data::Json(value)) => {
            decoder_reads_json(event.datacontenttype().unwrap_or("application/json"))
                && json_depth(value, 0) < STRICT_DEPTH
        }
    }
}

/// The nesting of arrays and objects in `value` (a scalar is 0), counted up to
/// `STRICT_DEPTH`: deeper is deep enough to answer.
fn json_depth(value: &Value, above: u32) -> u32 {
    if above >= STRICT_DEPTH {
        return above;
    }
    match value {
        Value::Array(items) => items
            .iter()
            .map(|v| json_depth(v, above + 1))
            .max()
            .unwrap_or(above + 1),
        Value::Object(map) => map
            .values()
            .map(|v| json_depth(v, above + 1))
            .max()
            .unwrap_or(above + 1),
        _ => above,
    }
}

/// Reads `body` the way the decoder reads JSON data into a `serde_json::Value` (strings
/// unescaped and checked, so a lone surrogate fails; numbers parsed, so `1e400` fails;
/// the parser's recursion limit), without building anything. Returns the deepest nesting.
fn strict_json(body: &[u8]) -> Result<u32, serde_json::Error> {
    use serde::de::{DeserializeSeed, MapAccess, SeqAccess, Visitor};

    struct Strict(u32);
    impl<'de> DeserializeSeed<'de> for Strict {
        type Value = u32;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Strict {
        type Value = u32;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_i64<E>(self, _: i64) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_u64<E>(self, _: u64) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_f64<E>(self, _: f64) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_str<E>(self, _: &str) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_unit<E>(self) -> Result<u32, E> {
            Ok(self.0)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u32, A::Error> {
            let mut deepest = self.0 + 1;
            while let Some(d) = seq.next_element_seed(Strict(self.0 + 1))? {
                deepest = deepest.max(d);
            }
            Ok(deepest)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u32, A::Error> {
            let mut deepest = self.0 + 1;
            // Keys are strings, read (and checked) like values.
            while map.next_key_seed(Strict(0))?.is_some() {
                deepest = deepest.max(map.next_value_seed(Strict(self.0 + 1))?);
            }
            Ok(deepest)
        }
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let depth = Strict(0).deserialize(&mut de)?;
    de.end()?;
    Ok(depth)
}

/// Whether the decoder (the SDK's JSON event format) reads a `data` member as JSON under
/// this `datacontenttype`: its own rule, case-sensitive and on the whole value, which is
/// not the media-type comparison `is_json` makes (`Application/JSON`,
/// `application/x+json; charset=utf-8` are JSON to `is_json`, not to the decoder).
pub(crate) fn decoder_reads_json(content_type: &str) -> bool {
    content_type.starts_with("application/json")
        || content_type.starts_with("text/json")
        || content_type.ends_with("+json")
}

/// JSON media types, as the JSON event format defines them (`application/json`, `+json`).
pub fn is_json(essence: &str) -> bool {
    essence == "application/json" || essence == "text/json" || essence.ends_with("+json")
}

/// Appends the body as the `data` member of an encoded event (which ends in `}`). Returns
/// whether the result is known to read back without decoding it
/// (`event::http::Parsed::reads_back`). `content_type` is the essence and whether
/// the decoder reads JSON data under the full value: JSON data is stored as JSON only when
/// both agree it is JSON (else the decoder would refuse the stored event); text only when
/// the decoder reads it as a string.
pub(crate) fn append_binary_data(
    stored: &mut Vec<u8>,
    content_type: Option<(&str, bool)>,
    body: &[u8],
) -> Result<bool, EventError> {
    if stored.pop() != Some(b'}') {
        return Err(EventError::invalid(
            "event",
            "unexpected encoding of the attributes",
        ));
    }
    let comma = |stored: &mut Vec<u8>| {
        if stored.len() > 1 {
            stored.push(b',');
        }
    };
    // Text and base64 data always read back.
    let mut reads_back = true;
    match content_type {
        Some((ct, true)) if is_json(ct) => {
            // The one-pass scan vouches for plain JSON; the full check decides the rest
            // (and names what is wrong).
            let (depth, lines) = match super::scan::scan(body) {
                super::scan::Scan::Valid { depth, lines } => Ok((depth, lines)),
                // memchr-backed scans: cheaper than one pass matching two bytes.
                super::scan::Scan::Unsure => strict_json(body)
                    .map(|depth| (depth, body.contains(&b'\n') || body.contains(&b'\r'))),
            }
            .map_err(|e| {
                EventError::invalid(
                    "data",
                    format!("the body is not valid JSON, but the content type is `{ct}`: {e}"),
                )
            })?;
            reads_back = depth < STRICT_DEPTH;
            comma(stored);
            stored.extend_from_slice(b"\"data\":");
            if lines {
                // Keep the stored form on one line (targets write JSON lines).
                let value: Value = serde_json::from_slice(body)
                    .map_err(|e| EventError::invalid("data", e.to_string()))?;
                serde_json::to_writer(&mut *stored, &value)
                    .map_err(|e| EventError::invalid("data", e.to_string()))?;
            } else {
                stored.extend_from_slice(body.trim_ascii());
            }
        }
        Some((ct, false)) if ct.starts_with("text/") && std::str::from_utf8(body).is_ok() => {
            comma(stored);
            stored.extend_from_slice(b"\"data\":");
            serde_json::to_writer(&mut *stored, &String::from_utf8_lossy(body))
                .map_err(|e| EventError::invalid("data", e.to_string()))?;
        }
        _ => {
            comma(stored);
            stored.extend_from_slice(b"\"data_base64\":\"");
            stored.extend_from_slice(
                base64::engine::general_purpose::STANDARD
                    .encode(body)
                    .as_bytes(),
            );
            stored.push(b'"');
        }
    }
    stored.push(b'}');
    Ok(reads_back)
}

/// What binary mode percent-encodes in a header value (HTTP binding §3.1.3.2): space, `"`,
/// `%` and the other non-printable ASCII bytes; `percent-encoding` always encodes non-ASCII
/// (as the bytes of its UTF-8), upper-case hex.
const HEADER_ENCODED: &AsciiSet = &CONTROLS.add(b' ').add(b'"').add(b'%');

/// Header values of binary mode are percent-encoded UTF-8 (HTTP binding §3.1.3.2). A `%`
/// that does not start an escape (two hex digits) is refused, not read as text.
pub(crate) fn percent_decode(raw: &[u8]) -> Option<String> {
    if !raw.contains(&b'%') {
        return String::from_utf8(raw.to_vec()).ok();
    }
    // `percent-encoding` passes a malformed escape through as text: refuse it first.
    let escapes_ok = raw.split(|b| *b == b'%').skip(1).all(|after| {
        after
            .get(..2)
            .is_some_and(|hex| hex.iter().all(u8::is_ascii_hexdigit))
    });
    if !escapes_ok {
        return None;
    }
    percent_encoding::percent_decode(raw)
        .decode_utf8()
        .ok()
        .map(Cow::into_owned)
}

/// Percent-encodes a binary-mode header value (space, `"`, `%`, non-printable ASCII and
/// non-ASCII).
pub(crate) fn header_text(value: &str) -> String {
    utf8_percent_encode(value, HEADER_ENCODED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn structured(content_type: Option<&str>, data: Value) -> Event {
        let mut event = serde_json::json!({
            "specversion": "1.0", "id": "1", "source": "/s", "type": "t", "data": data,
        });
        if let Some(ct) = content_type {
            event["datacontenttype"] = Value::from(ct);
        }
        let Value::Object(map) = event else {
            unreachable!()
        };
        crate::event::http::from_json_object(map).unwrap()
    }

    fn nested(depth: usize) -> Value {
        let text = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        serde_json::from_str(&text).unwrap()
    }

    /// What `surely_reads_back` vouches for decodes; what does not decode it leaves to
    /// `check_stored`.
    #[test]
    fn surely_reads_back_only_what_decodes() {
        let object = serde_json::json!({"a": [1, 2.5, "x", {"b": null}]});
        let cases = [
            (None, object.clone()),
            (Some("application/json"), object.clone()),
            (Some("application/cloudevents+json"), object.clone()),
            (Some("text/plain"), Value::from("text")),
            (Some("text/plain"), object.clone()),
            (Some("Application/JSON"), object.clone()),
            (Some("application/json"), nested(99)),
            (Some("application/json"), nested(126)),
            (None, nested(127)),
            (Some("application/xml"), serde_json::json!(12)),
        ];
        for (ct, data) in cases {
            let event = structured(ct, data.clone());
            let stored = encode(&event).unwrap();
            let sure = surely_reads_back(&event);
            if sure {
                assert!(
                    check_stored(&stored).is_ok(),
                    "vouched for {ct:?} {data}, which does not decode"
                );
            }
        }
        assert!(!surely_reads_back(&structured(Some("text/plain"), object)));
        assert!(!surely_reads_back(&structured(None, nested(127))));
        assert!(check_stored(&encode(&structured(None, nested(127))).unwrap()).is_err());
        assert!(surely_reads_back(&structured(None, nested(50))));
    }

    /// The shard of a key is part of the stored data's layout (order per key, positions per
    /// shard): FNV-1a 64 over the key's bytes, modulo the shard count. These values must
    /// never change.
    #[test]
    fn shard_of_is_pinned() {
        for (key, shards, want) in [
            ("", 4, 1),
            ("a", 4, 0),
            ("foobar", 16, 8),
            ("order-42", 4, 0),
            ("order-42", 7, 0),
            ("caf\u{e9}", 1000, 713),
            ("user:1001", 3, 2),
            ("anything", 0, 0),
        ] {
            assert_eq!(super::shard_of(key, shards), want, "{key:?} over {shards}");
        }
    }

    #[test]
    fn percent_decoding_rejects_garbage() {
        assert_eq!(percent_decode(b"a%20b").as_deref(), Some("a b"));
        assert_eq!(percent_decode(b"a%2"), None);
        assert_eq!(percent_decode(b"%FF"), None);
        assert_eq!(percent_decode(b"%+1"), None);
        assert_eq!(percent_decode(b"100%"), None);
        assert_eq!(percent_decode(b"%%41"), None);
        assert_eq!(percent_decode(b"caf%C3%a9").as_deref(), Some("caf\u{e9}"));
        assert_eq!(percent_decode(b"plain").as_deref(), Some("plain"));
    }

    /// The encoding binary mode pins (HTTP binding §3.1.3.2): printable ASCII but space,
    /// `"` and `%` as is, the rest as `%XX` of its UTF-8 bytes, upper-case hex.
    #[test]
    fn header_text_encodes_what_binary_mode_asks() {
        assert_eq!(
            header_text("a-b_c.~!#$&'()*+,/:;<=>?@[\\]^`{|}"),
            "a-b_c.~!#$&'()*+,/:;<=>?@[\\]^`{|}"
        );
        assert_eq!(header_text("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(header_text("\u{0}\u{1f}\u{7f}"), "%00%1F%7F");
        assert_eq!(
            header_text("Z\u{fc}rich \u{20ac}"),
            "Z%C3%BCrich%20%E2%82%AC"
        );
        for text in ["", "a b", "100%", "caf\u{e9}\u{0}\"x\"", "\u{1f600}"] {
            assert_eq!(
                percent_decode(header_text(text).as_bytes()).as_deref(),
                Some(text)
            );
        }
    }
}
