//! The bodies of the gateway's fuzz targets (`gateway/fuzz`), shared with the stable corpus
//! test (`gateway/tests/fuzz_corpora.rs`) so both check the same invariants. Each takes the
//! raw input and panics when an invariant breaks. Not part of the crate's API: thin
//! wrappers around the real code, which stays where it is.
//!
//! The invariant behind most of them: an event ingress accepts (answers `202` for) is an
//! event delivery can read back, and it is the event the producer sent, whichever way it
//! leaves (stored record, HTTP binary or structured mode, RocketMQ message).

use std::collections::BTreeMap;
use std::io::Cursor;

use bytes::Bytes;
use cloudevents::event::Data;
use cloudevents::{AttributesReader, Event};
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::event::http::{self as cloudevent, ContentMode, Parsed};
use crate::event::{self, EventError};
use crate::ingress::limits::Limits;
use crate::store::embedded::{encode_record, read_record, HEADER, MAX_RECORD};
use crate::store::Record;
use crate::targets::config::BodyMode;
use crate::targets::Envelope;

const SHARDS: u32 = 4;
const MAX_BATCH: usize = 64;

/// What ingress does with a parsed event before it answers: size limit, read-back check,
/// shard. The stored form when it is accepted.
fn accept(parsed: Result<Parsed, EventError>) -> Option<Bytes> {
    crate::ingress::accept::entry(parsed, SHARDS, &Limits::default())
        .ok()
        .map(|(_, bytes, shard)| {
            assert!(shard < SHARDS, "shard {shard} out of range");
            bytes
        })
}

/// The context attributes and extensions of an event as text, by name (data left out):
/// what the targets carry (`EventText`) and the `datacontenttype`.
fn context(event: &Event) -> BTreeMap<String, String> {
    let mut all: BTreeMap<String, String> = (crate::event::EventText::of(event).attributes)
        .into_iter()
        .map(|(name, value)| (name.into_owned(), value.into_owned()))
        .collect();
    if let Some(ct) = event.datacontenttype() {
        all.insert("datacontenttype".into(), ct.to_string());
    }
    all
}

/// The context an event should come back with from binary mode (HTTP or a RocketMQ
/// message): its own, and the content type the binding always states when it had none.
fn context_through_binary(event: &Event, back: &Event) -> BTreeMap<String, String> {
    let mut expected = context(event);
    if event.datacontenttype().is_none() {
        if let Some(ct) = back.datacontenttype() {
            expected.insert("datacontenttype".into(), ct.to_string());
        }
    }
    expected
}

fn show(bytes: &[u8]) -> String {
    String::from_utf8_lossy(&bytes[..bytes.len().min(300)]).into_owned()
}

/// Reads `stored` back as delivery does: through the embedded store's record format, then
/// the decoder. Panics if it does not read back.
fn deliver(stored: &Bytes) -> Event {
    let mut segment = Vec::new();
    encode_record(&mut segment, 7, 1_700_000_000_000, stored);
    let mut payload = Vec::new();
    let seq = match read_record(&mut Cursor::new(&segment), &mut payload) {
        Ok(Some(seq)) => seq,
        other => panic!("a stored record does not read back: {other:?}"),
    };
    let record = Record::from_stored(seq, Bytes::from(payload));
    assert_eq!(record.seq, 7);
    assert_eq!(record.accepted_ms, 1_700_000_000_000);
    assert_eq!(&record.payload, stored, "the record's payload changed");
    match event::decode(&record.payload) {
        Ok(event) => event,
        Err(e) => panic!(
            "ingress accepted an event delivery cannot decode: {e}\n{}",
            show(stored)
        ),
    }
}

/// Everything an accepted event must satisfy on its way out. `expected` is the event
/// ingress built (its data left out in binary mode: `with_data`).
fn check_accepted(stored: &Bytes, expected: &Event, with_data: bool) -> Event {
    let delivered = deliver(stored);
    if with_data {
        assert_eq!(
            &delivered,
            expected,
            "the delivered event differs from the accepted one\n{}",
            show(stored)
        );
    } else {
        assert_eq!(
            context(&delivered),
            context(expected),
            "the delivered attributes differ from the accepted ones\n{}",
            show(stored)
        );
    }
    // The stored form is stable: the delivered event encodes to an event that decodes equal.
    let again = event::encode(&delivered)
        .ok()
        .and_then(|b| event::decode(&b).ok());
    assert_eq!(
        again.as_ref(),
        Some(&delivered),
        "re-encoding is not stable"
    );
    // What this gateway delivers in structured mode (the stored form), a gateway accepts.
    match cloudevent::from_structured(stored) {
        Ok(event) => assert_eq!(
            context(&event),
            context(&delivered),
            "the structured form does not parse back to the same attributes\n{}",
            show(stored)
        ),
        Err(e) => panic!(
            "the delivered structured form is refused by ingress: {e}\n{}",
            show(stored)
        ),
    }
    let envelope = Envelope {
        raw: stored.clone(),
        accepted_ms: 0,
        event: None,
        body: None,
    };
    check_http(&envelope, &delivered);
    check_rocketmq(&envelope, &delivered);
    delivered
}

/// The HTTP target's binary and structured modes: every header valid, and a gateway reading
/// the binary request gets the same event back.
fn check_http(envelope: &Envelope, event: &Event) {
    let request = match crate::targets::http::encode(envelope, BodyMode::Structured) {
        Ok(r) => r,
        Err(e) => panic!("structured mode cannot send an accepted event: {e}"),
    };
    assert_eq!(request.body, envelope.raw.as_ref());
    let request = match crate::targets::http::encode(envelope, BodyMode::Binary) {
        Ok(r) => r,
        Err(e) => panic!("binary mode cannot send an accepted event: {e}"),
    };
    assert_eq!(request.id, event.id());
    for (name, value) in &request.headers {
        if name.as_str().starts_with("ce-") {
            assert!(
                plain_token(value.as_bytes()),
                "{name}: {value:?} is not a plain token"
            );
        }
    }
    let parsed = cloudevent::from_binary(&request.headers, &request.body);
    let stored = match accept(parsed) {
        Some(stored) => stored,
        None => panic!(
            "a gateway refuses the binary-mode request of an accepted event: {:?}\nheaders {:?}\nbody {}",
            cloudevent::from_binary(&request.headers, &request.body).err(),
            request.headers,
            show(&request.body)
        ),
    };
    let back = deliver(&stored);
    // Binary mode always says what the body is.
    let expected = context_through_binary(event, &back);
    assert_eq!(
        context(&back),
        expected,
        "binary mode changed the attributes"
    );
    assert_eq!(
        data_value(back.data()),
        data_value(event.data()),
        "binary mode changed the data"
    );
}

/// The data as the receiver reads it: bytes, or a JSON value for JSON data.
#[derive(Debug, PartialEq)]
enum DataValue {
    None,
    Bytes(Vec<u8>),
    Json(serde_json::Value),
}

fn data_value(data: Option<&Data>) -> DataValue {
    match data {
        None => DataValue::None,
        Some(Data::Binary(b)) => DataValue::Bytes(b.clone()),
        Some(Data::String(s)) => DataValue::Bytes(s.as_bytes().to_vec()),
        Some(Data::Json(v)) => DataValue::Json(v.clone()),
    }
}

fn rocketmq_config() -> Option<crate::targets::config::RocketMqConfig> {
    toml::from_str(
        "name = \"mq\"\nname_server = \"127.0.0.1:9876\"\ntopic = \"T\"\ntag_attribute = \"type\"\n",
    )
    .ok()
}

fn rocketmq_source_config() -> Option<crate::sources::rocketmq::RocketMqSourceConfig> {
    toml::from_str("name = \"src\"\nname_server = \"127.0.0.1:9876\"\ntopic = \"T\"\nbus = \"b\"\n")
        .ok()
}

/// Replaces a message's properties with what a broker and a consumer read back of them:
/// the properties through the remoting format's property text. Returns them as sent and
/// as read back.
fn through_the_wire(
    message: &mut rocketmq_model::common::message::message_single::Message,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let sent = string_map(message.properties().as_map());
    let text = rocketmq_model::codec::message_properties_to_string(message.properties().as_map());
    message.set_properties(rocketmq_model::codec::string_to_message_properties(Some(
        &text,
    )));
    (sent, string_map(message.properties().as_map()))
}

/// Properties as plain strings, in order (to compare).
fn string_map<K: ToString, V: ToString>(
    pairs: impl IntoIterator<Item = (K, V)>,
) -> BTreeMap<String, String> {
    pairs
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The RocketMQ target: the properties survive the wire format unchanged (no value forges
/// another property), and a RocketMQ source reading the message gets the event back.
fn check_rocketmq(envelope: &Envelope, event: &Event) {
    let Some(config) = rocketmq_config() else {
        panic!("the RocketMQ test configuration does not parse");
    };
    let encoded = match crate::targets::rocketmq::message::encode(&config, envelope) {
        Ok(e) => e,
        // Only a message too large for RocketMQ is refused.
        Err(e) if e.message.contains("RocketMQ takes at most") => return,
        Err(e) => panic!("RocketMQ cannot send an accepted event: {e}"),
    };
    let mut message = encoded.message;
    let (sent, received) = through_the_wire(&mut message);
    assert_eq!(
        received, sent,
        "the properties do not survive the wire format"
    );
    for (name, value) in &sent {
        assert!(
            !name.contains(['\u{1}', '\u{2}']) && !value.contains(['\u{1}', '\u{2}']),
            "a separator in property {name:?}={value:?}"
        );
    }
    let mut ext = rocketmq_model::common::message::message_ext::MessageExt::default();
    ext.set_message_inner(message);
    let Some(source) = rocketmq_source_config() else {
        panic!("the RocketMQ source test configuration does not parse");
    };
    let (_, stored) = match crate::sources::rocketmq::event(&source, &ext, SHARDS) {
        Ok(s) => s,
        Err(e) => panic!("the RocketMQ source cannot read the message: {e}"),
    };
    let back = deliver(&stored);
    let expected = context_through_binary(event, &back);
    assert_eq!(
        context(&back),
        expected,
        "RocketMQ target → source changed the attributes\n{}",
        show(&envelope.raw)
    );
    // An event without data travels with the binding's one-NUL body, so data that is one NUL
    // byte comes back as no data (the binding cannot tell them apart).
    if data_value(event.data()) != DataValue::Bytes(vec![0]) {
        assert_eq!(
            data_value(back.data()),
            data_value(event.data()),
            "RocketMQ target → source changed the data\n{}",
            show(&envelope.raw)
        );
    }
}

/// Splits the input at its first `\n`: the first line lists trace-context headers (used by
/// structured and batch mode), the rest is the body.
fn trace_headers(data: &[u8]) -> (HeaderMap, &[u8]) {
    let mut headers = HeaderMap::new();
    let (line, body) = match data.iter().position(|b| *b == b'\n') {
        Some(i) if data.first() == Some(&b'#') => (&data[1..i], &data[i + 1..]),
        _ => return (headers, data),
    };
    for part in line.split(|b| *b == b' ') {
        let (name, value) = if let Some(v) = part.strip_prefix(b"tp=") {
            ("traceparent", v)
        } else if let Some(v) = part.strip_prefix(b"ts=") {
            ("tracestate", v)
        } else {
            continue;
        };
        if let Ok(v) = HeaderValue::from_bytes(value) {
            headers.insert(HeaderName::from_static(name), v);
        }
    }
    (headers, body)
}

/// Ingress of one event as the structured-mode handler does it.
fn ingest_structured(
    event: Result<Event, EventError>,
    headers: &HeaderMap,
) -> Result<Parsed, EventError> {
    event
        .map(|mut e| {
            cloudevent::inherit_trace_context(&mut e, headers);
            e
        })
        .and_then(Parsed::encode)
}

/// Structured mode: whatever is accepted is delivered as it was sent.
pub fn ce_structured(data: &[u8]) {
    let (headers, body) = trace_headers(data);
    let event = cloudevent::from_structured(body);
    let parsed = ingest_structured(event, &headers);
    let expected = parsed.as_ref().ok().map(|p| p.event.clone());
    if let (Some(stored), Some(expected)) = (accept(parsed), expected) {
        check_accepted(&stored, &expected, true);
    }
}

/// Batch mode: each entry is judged as the same object sent alone in structured mode, and
/// every accepted entry is delivered as it was sent.
pub fn ce_batch(data: &[u8]) {
    let (headers, body) = trace_headers(data);
    let Ok(entries) = cloudevent::from_batch(body, MAX_BATCH) else {
        return;
    };
    let objects: Vec<serde_json::Value> = match serde_json::from_slice(body) {
        Ok(serde_json::Value::Array(a)) => a,
        other => panic!("a batch parsed but is not a JSON array: {other:?}"),
    };
    assert_eq!(objects.len(), entries.len());
    for (entry, object) in entries.into_iter().zip(objects) {
        let alone = serde_json::to_vec(&object)
            .ok()
            .filter(|_| object.is_object())
            .map(|b| cloudevent::from_structured(&b));
        match (&entry, &alone) {
            (Ok(a), Some(Ok(b))) => assert_eq!(a, b, "batch entry and structured event differ"),
            (Err(a), Some(Err(b))) => assert_eq!(a.field, b.field),
            (Err(_), None) => {}
            _ => panic!("batch entry {entry:?} but alone {alone:?}"),
        }
        let parsed = ingest_structured(entry, &headers);
        let expected = parsed.as_ref().ok().map(|p| p.event.clone());
        if let (Some(stored), Some(expected)) = (accept(parsed), expected) {
            check_accepted(&stored, &expected, true);
        }
    }
}

/// The input of `ce_binary`: header lines (`name: value`, `%XX` escapes for any byte), an
/// empty line, then the body.
pub fn split_binary(data: &[u8]) -> (HeaderMap, &[u8]) {
    let mut headers = HeaderMap::new();
    let mut rest = data;
    loop {
        let (line, after) = match rest.iter().position(|b| *b == b'\n') {
            Some(i) => (&rest[..i], &rest[i + 1..]),
            None => (rest, &rest[rest.len()..]),
        };
        rest = after;
        if line.is_empty() {
            break;
        }
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            continue;
        };
        let name = line[..colon].trim_ascii().to_ascii_lowercase();
        let value = unescape(line[colon + 1..].trim_ascii());
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&name),
            HeaderValue::from_bytes(&value),
        ) {
            headers.append(name, value);
        }
        if rest.is_empty() {
            break;
        }
    }
    (headers, rest)
}

/// `\xNN` escapes of the binary input (so header values can hold any byte).
fn unescape(text: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if text[i] == b'\\' && text.get(i + 1) == Some(&b'x') {
            if let Some(b) = text
                .get(i + 2..i + 4)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
            {
                out.push(b);
                i += 4;
                continue;
            }
        }
        out.push(text[i]);
        i += 1;
    }
    out
}

/// Binary mode: whatever is accepted is delivered with the attributes of the headers and the
/// body as its data; what the parser vouches for (`reads_back`) decodes.
pub fn ce_binary(data: &[u8]) {
    let (headers, body) = split_binary(data);
    if cloudevent::content_mode(&headers) != Ok(ContentMode::Binary) {
        return;
    }
    let parsed = cloudevent::from_binary(&headers, body);
    if let Ok(p) = &parsed {
        if p.reads_back {
            assert!(
                event::decode(&p.stored).is_ok(),
                "binary mode vouched for a stored form that does not decode\n{}",
                show(&p.stored)
            );
        }
    }
    let expected = parsed.as_ref().ok().map(|p| p.event.clone());
    let (Some(stored), Some(expected)) = (accept(parsed), expected) else {
        return;
    };
    let delivered = check_accepted(&stored, &expected, false);
    // The data is the body: its bytes, or the JSON value it holds.
    let value = data_value(delivered.data());
    let same = match &value {
        DataValue::None => body.is_empty(),
        DataValue::Bytes(b) => b == body,
        DataValue::Json(v) => {
            serde_json::from_slice::<serde_json::Value>(body).ok() == Some(v.clone())
        }
    };
    assert!(
        same,
        "binary mode delivers other data than the body: {value:?}\nbody {}\nstored {}",
        show(body),
        show(&stored)
    );
}

/// The embedded store's record format read from arbitrary bytes (a damaged segment), and
/// every record that checks out decoded as delivery does. Records written by the encoder
/// read back exactly; cut short or changed, they are refused, not misread.
pub fn record_decode(data: &[u8]) {
    // Arbitrary bytes as a segment: records until the first that does not check out.
    let mut cursor = Cursor::new(data);
    let mut payload = Vec::new();
    let mut offset = 0usize;
    loop {
        match read_record(&mut cursor, &mut payload) {
            Ok(Some(seq)) => {
                assert!(payload.len() <= MAX_RECORD as usize);
                offset += HEADER + payload.len();
                assert_eq!(cursor.position() as usize, offset);
                let record = Record::from_stored(seq, Bytes::copy_from_slice(&payload));
                if let Ok(event) = event::decode(&record.payload) {
                    let envelope = Envelope {
                        raw: record.payload.clone(),
                        accepted_ms: record.accepted_ms,
                        event: None,
                        body: None,
                    };
                    assert!(envelope.decoded().is_ok());
                    // Whatever decodes can be handed to the targets' encoders.
                    let _ = crate::targets::http::encode(&envelope, BodyMode::Binary);
                    if let Some(config) = rocketmq_config() {
                        let _ = crate::targets::rocketmq::message::encode(&config, &envelope);
                    }
                    let _ = crate::event::partition_key(&event);
                }
            }
            Ok(None) => break,
            Err(_) => break,
        }
    }

    // The input as a payload: written, read back exactly, refused when damaged.
    let seq = u64::from_le_bytes(std::array::from_fn(|i| data.get(i).copied().unwrap_or(0)));
    let accepted_ms = seq.rotate_left(17);
    let mut segment = Vec::new();
    encode_record(&mut segment, seq, accepted_ms, data);
    let mut cursor = Cursor::new(&segment);
    match read_record(&mut cursor, &mut payload) {
        Ok(Some(s)) => assert_eq!(s, seq),
        other => panic!("an encoded record does not read back: {other:?}"),
    }
    let record = Record::from_stored(seq, Bytes::copy_from_slice(&payload));
    assert_eq!(record.accepted_ms, accepted_ms);
    assert_eq!(&record.payload[..], data, "the payload changed");
    assert!(matches!(read_record(&mut cursor, &mut payload), Ok(None)));
    // Cut short anywhere: never a record.
    let cut = data.len() % segment.len().max(1);
    assert!(
        !matches!(
            read_record(&mut Cursor::new(&segment[..cut]), &mut payload),
            Ok(Some(_))
        ),
        "a record cut short at {cut} was read"
    );
    // One byte changed after the length: the checksum refuses it.
    if let Some(&first) = data.first() {
        let at = 4 + usize::from(first) % (segment.len() - 4);
        let mut damaged = segment.clone();
        damaged[at] ^= first | 1;
        assert!(
            !matches!(
                read_record(&mut Cursor::new(&damaged), &mut payload),
                Ok(Some(_))
            ),
            "a record with byte {at} changed was read"
        );
    }
}

/// The header and property encoders: the HTTP target's binary-mode header values, the
/// RocketMQ source's (the same percent-encoding), the RocketMQ target's property text.
/// Header values are always valid and percent-decode back to the text; property text never
/// holds the remoting format's separators and survives the wire format as one property.
/// The input's first byte chooses: odd, the rest is a structured event sent through every
/// target encoder; even, the rest is text for the encoders directly.
pub fn header_encode(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 1 {
        let Ok(event) = cloudevent::from_structured(rest) else {
            return;
        };
        let parsed = Parsed::encode(event.clone());
        if let Some(stored) = accept(parsed) {
            check_accepted(&stored, &event, true);
        }
        return;
    }
    let text = String::from_utf8_lossy(rest);
    // One encoder serves the http target, the RocketMQ source and webhooks.
    let encoded = event::header_text(&text);
    let value = match HeaderValue::from_str(&encoded) {
        Ok(v) => v,
        Err(_) => panic!("{encoded:?} is not a header value"),
    };
    assert!(plain_token(value.as_bytes()), "{encoded:?}");
    assert_eq!(
        event::percent_decode(value.as_bytes()).as_deref(),
        Some(&*text),
        "{encoded:?} does not decode back"
    );
    let property = crate::targets::rocketmq::message::property_text(&text);
    assert!(
        !property.chars().any(char::is_control),
        "a control character in property text {property:?}"
    );
    if !text.chars().any(char::is_control) {
        assert_eq!(property, text, "text without control characters changed");
    }
    // Through the message builder and the wire format, next to another property.
    let message = rocketmq_model::common::message::message_single::Message::builder()
        .topic("T")
        .body(Bytes::from_static(b"x"))
        .raw_property("CE_x", property.into_owned())
        .and_then(|b| b.raw_property("CE_y", "after"))
        .and_then(|b| b.build());
    let Ok(mut message) = message else {
        panic!("a message with property text cannot be built");
    };
    let (sent, received) = through_the_wire(&mut message);
    assert_eq!(
        received, sent,
        "property text does not survive the wire format"
    );
}

/// Printable ASCII without space or `"`: what an encoded `ce-*` header value may hold.
fn plain_token(bytes: &[u8]) -> bool {
    bytes.iter().all(|b| (0x21..0x7f).contains(b) && *b != b'"')
}
