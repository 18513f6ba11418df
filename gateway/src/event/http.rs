//! CloudEvents 1.0 over HTTP: the three content modes (binary, structured, batch) parsed into
//! cloudevents-sdk `Event`s, with validation that names the failing attribute.
//!
//! The checks are ours rather than the SDK's so each error says which attribute is wrong and
//! why; the result is always an SDK `Event`, and the stored form is the SDK's structured JSON
//! (`crate::event::stored`).

use base64::Engine as _;
use chrono::{DateTime, Utc};
use cloudevents::event::{AttributesWriter, Data, ExtensionValue};
use cloudevents::{Event, EventBuilder, EventBuilderV10};
use http::HeaderMap;
use serde_json::{Map, Value};

use crate::event::stored::{
    append_binary_data, decoder_reads_json, encode, is_json, percent_decode, EventError,
};

/// How a request carries its events, decided from `Content-Type` and the `ce-specversion` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentMode {
    Binary,
    Structured,
    Batch,
}

pub const STRUCTURED_JSON: &str = "application/cloudevents+json";
pub const BATCH_JSON: &str = "application/cloudevents-batch+json";

/// The media type without parameters, lower-cased: `Application/JSON; charset=utf-8` → `application/json`.
pub fn essence(content_type: &str) -> String {
    content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase()
}

/// Chooses the content mode, or says why the request is not a CloudEvent this gateway reads.
pub fn content_mode(headers: &HeaderMap) -> Result<ContentMode, EventError> {
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .map(|v| v.to_str().map(essence))
        .transpose()
        .map_err(|_| EventError::invalid("content-type", "Content-Type is not valid ASCII"))?;
    match content_type.as_deref() {
        Some(STRUCTURED_JSON) => return Ok(ContentMode::Structured),
        Some(BATCH_JSON) => return Ok(ContentMode::Batch),
        Some(ct) if ct.starts_with("application/cloudevents") => {
            return Err(EventError::unsupported(format!(
                "event format `{ct}` is not supported; use {STRUCTURED_JSON}, {BATCH_JSON} or binary mode"
            )))
        }
        _ => {}
    }
    if headers.contains_key("ce-specversion") {
        return Ok(ContentMode::Binary);
    }
    if headers.keys().any(|k| k.as_str().starts_with("ce-")) {
        return Err(EventError::invalid(
            "ce-specversion",
            "binary mode needs the ce-specversion header",
        ));
    }
    Err(EventError::unsupported(format!(
        "not a CloudEvent: send binary mode (ce-* headers), or a body of type {STRUCTURED_JSON} or {BATCH_JSON}"
    )))
}

const REQUIRED: [&str; 3] = ["id", "source", "type"];

/// An event with empty required attributes and nothing else, for the parsers to fill in.
/// (`Event::default()` would invent an id, a source and a time.)
fn blank_event() -> Result<Event, EventError> {
    EventBuilderV10::new()
        .id("")
        .source("/")
        .ty("")
        .build()
        .map_err(|e| EventError::invalid("event", e.to_string()))
}

/// A CloudEvents attribute name: lower-case ASCII letters and digits only (spec §3.1.1).
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

/// An accepted event: the SDK event and its stored form (CloudEvents structured JSON).
#[derive(Debug)]
pub struct Parsed {
    /// The event's attributes and extensions. For binary mode its data is not decoded into
    /// it (that would cost a parse and a re-serialisation per event); `stored` has the data.
    pub event: Event,
    pub stored: Vec<u8>,
    /// The stored form is known to read back (`decode`) as it was built: the SDK's own
    /// encoding of the attributes, and data checked as the decoder reads it. Otherwise
    /// `check_stored` decodes it once before it is accepted.
    pub reads_back: bool,
}

impl Parsed {
    /// Encodes a complete event into its stored form. Whether it reads back is known
    /// from the event where that is certain (`surely_reads_back`), so that the common
    /// event is not decoded a second time to find out.
    pub fn encode(event: Event) -> Result<Parsed, EventError> {
        let stored = encode(&event)
            .map_err(|e| EventError::invalid("event", format!("cannot encode: {e}")))?;
        let reads_back = super::stored::surely_reads_back(&event);
        Ok(Parsed {
            event,
            stored,
            reads_back,
        })
    }
}

/// Binary mode: attributes in `ce-*` headers (percent-encoded), data in the body.
///
/// The stored form is written directly: the SDK serialises the attributes, the body is
/// appended as `data` (JSON, checked but not rebuilt), as a JSON string (text) or as
/// `data_base64`. It decodes to the same event the SDK would build from the request.
/// A W3C `traceparent`'s fields (Trace Context §3.2: `{version}-{trace-id}-{parent-id}-{flags}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub parent_id: [u8; 8],
    pub flags: u8,
}

impl TraceParent {
    /// The `sampled` flag.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }
}

/// Reads a W3C `traceparent` as the Trace Context specification says a receiver must, or
/// `None` when it is to be ignored. The one parser of the gateway: ingress checks the
/// trace context it passes on with it, and span export (`otlp`) reads the ids with it.
///
/// - Every field is lower-case hex (`HEXDIGLC`): "vendors MUST ignore the traceparent
///   when the parent-id is invalid (for example, if it contains non-lowercase hex
///   characters)", and likewise for the trace id. Upper case is refused.
/// - Version `ff` is invalid. Version `00` has exactly the four fields; a later version
///   may add fields after another `-`, and is read by its first four.
/// - A trace id or parent id of all zeros is invalid.
pub fn parse_traceparent(value: &str) -> Option<TraceParent> {
    let mut fields = value.split('-');
    let [version] = lower_hex::<1>(fields.next()?)?;
    let trace_id = lower_hex::<16>(fields.next()?)?;
    let parent_id = lower_hex::<8>(fields.next()?)?;
    let [flags] = lower_hex::<1>(fields.next()?)?;
    let valid = version != 0xff
        && (version != 0 || fields.next().is_none())
        && trace_id != [0; 16]
        && parent_id != [0; 8];
    valid.then_some(TraceParent {
        trace_id,
        parent_id,
        flags,
    })
}

/// Whether `value` is a W3C `traceparent` this gateway can pass on (`parse_traceparent`).
pub fn valid_traceparent(value: &str) -> bool {
    parse_traceparent(value).is_some()
}

/// `N` bytes written as exactly `2 * N` lower-case hex digits.
fn lower_hex<const N: usize>(text: &str) -> Option<[u8; N]> {
    fn digit(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            _ => None,
        }
    }
    let text = text.as_bytes();
    if text.len() != 2 * N {
        return None;
    }
    let mut out = [0u8; N];
    for (byte, pair) in out.iter_mut().zip(text.chunks_exact(2)) {
        *byte = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// The CloudEvents distributed-tracing extension from the request's W3C trace context
/// (`traceparent`, `tracestate` headers), for an event that does not carry its own: the
/// trace goes on through the gateway to every target. An invalid `traceparent` is ignored,
/// as the W3C specification asks.
pub fn inherit_trace_context(event: &mut Event, headers: &HeaderMap) {
    if event.extension("traceparent").is_some() {
        return;
    }
    let Some(parent) = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| valid_traceparent(v))
    else {
        return;
    };
    event.set_extension("traceparent", parent.to_string());
    if let Some(state) = headers
        .get("tracestate")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty() && v.len() <= 512 && check_text("tracestate", v).is_ok())
    {
        event.set_extension("tracestate", state.to_string());
    }
}

pub fn from_binary(headers: &HeaderMap, body: &[u8]) -> Result<Parsed, EventError> {
    let mut event = blank_event()?;
    let mut seen = [false; 3];
    let mut header_content_type: Option<String> = None;
    let mut spec_ok = false;
    for (name, value) in headers {
        let Some(attr) = name.as_str().strip_prefix("ce-") else {
            continue;
        };
        let field = name.as_str();
        let value = percent_decode(value.as_bytes()).ok_or_else(|| {
            EventError::invalid(field, "value is not valid percent-encoded UTF-8")
        })?;
        if !valid_name(attr) {
            return Err(EventError::invalid(
                field,
                format!(
                    "`{attr}` is not a valid attribute name (lower-case letters and digits only)"
                ),
            ));
        }
        match attr {
            "specversion" => {
                check_specversion(field, &value)?;
                spec_ok = true;
            }
            "datacontenttype" => header_content_type = Some(value),
            "data" => {
                return Err(EventError::invalid(
                    field,
                    "`data` is not an attribute; in binary mode data is the body",
                ))
            }
            _ => {
                if let Some(i) = REQUIRED.iter().position(|r| *r == attr) {
                    seen[i] = true;
                }
                set_string_attribute(&mut event, attr, field, value)?;
            }
        }
    }
    if !spec_ok {
        return Err(EventError::invalid("ce-specversion", "header is missing"));
    }
    for (i, name) in REQUIRED.iter().enumerate() {
        if !seen[i] {
            return Err(EventError::invalid(
                format!("ce-{name}"),
                "required attribute is missing",
            ));
        }
    }
    let content_type = match headers.get(http::header::CONTENT_TYPE) {
        Some(v) => {
            let ct = v
                .to_str()
                .map_err(|_| EventError::invalid("content-type", "not valid ASCII"))?
                .to_string();
            if let Some(h) = &header_content_type {
                if essence(h) != essence(&ct) {
                    return Err(EventError::invalid(
                        "ce-datacontenttype",
                        "contradicts Content-Type; in binary mode send only Content-Type",
                    ));
                }
            }
            Some(ct)
        }
        None => header_content_type,
    };
    if let Some(ct) = &content_type {
        check_media_type("datacontenttype", ct)?;
    }
    let ct = content_type
        .as_deref()
        .map(|raw| (essence(raw), decoder_reads_json(raw)));
    event.set_datacontenttype(content_type);
    inherit_trace_context(&mut event, headers);
    let mut stored =
        encode(&event).map_err(|e| EventError::invalid("event", format!("cannot encode: {e}")))?;
    let reads_back = if body.is_empty() {
        true
    } else {
        append_binary_data(
            &mut stored,
            ct.as_ref().map(|(e, j)| (e.as_str(), *j)),
            body,
        )?
    };
    Ok(Parsed {
        event,
        stored,
        reads_back,
    })
}

/// Structured mode: one event as a JSON object.
pub fn from_structured(body: &[u8]) -> Result<Event, EventError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| EventError::invalid("body", format!("not valid JSON: {e}")))?;
    match value {
        Value::Object(map) => from_json_object(map),
        _ => Err(EventError::invalid(
            "body",
            "a structured-mode CloudEvent must be a JSON object",
        )),
    }
}

/// Batch mode: a JSON array of structured events. The outer `Err` refuses the whole request
/// (not an array, too many entries); each entry then succeeds or fails on its own.
pub fn from_batch(
    body: &[u8],
    max_events: usize,
) -> Result<Vec<Result<Event, EventError>>, EventError> {
    let mut events = Vec::new();
    for_each_in_batch(body, max_events, |e| events.push(e))?;
    Ok(events)
}

/// Batch mode, one entry at a time: `each` gets every entry as it is parsed, so only one
/// entry's JSON tree is in memory at once (a tree takes up to ~16 times its text). The
/// outer `Err` refuses the whole request (not JSON, not an array, empty, too many entries);
/// entries handed out before it are to be dropped.
pub fn for_each_in_batch(
    body: &[u8],
    max_events: usize,
    each: impl FnMut(Result<Event, EventError>),
) -> Result<(), EventError> {
    let not_json =
        |e: serde_json::Error| EventError::invalid("body", format!("not valid JSON: {e}"));
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'[') {
        serde_json::from_slice::<serde::de::IgnoredAny>(body).map_err(not_json)?;
        return Err(EventError::invalid(
            "body",
            "a batch must be a JSON array of CloudEvents",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let count = serde::Deserializer::deserialize_seq(&mut de, BatchVisitor { max_events, each })
        .map_err(not_json)?;
    de.end().map_err(not_json)?;
    if count == 0 {
        return Err(EventError::invalid("body", "the batch is empty"));
    }
    if count > max_events {
        return Err(EventError::too_large(
            "limits.max_batch_events",
            format!("the batch has {count} entries; at most {max_events} are accepted"),
        ));
    }
    Ok(())
}

/// Hands each entry of a batch array to `each` (up to `max_events`; the rest are only
/// counted, without building them); yields the number of entries.
struct BatchVisitor<F> {
    max_events: usize,
    each: F,
}

impl<'de, F: FnMut(Result<Event, EventError>)> serde::de::Visitor<'de> for BatchVisitor<F> {
    type Value = usize;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON array of CloudEvents")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(mut self, mut seq: A) -> Result<usize, A::Error> {
        let mut count = 0;
        while count < self.max_events {
            let Some(entry) = seq.next_element::<Value>()? else {
                return Ok(count);
            };
            count += 1;
            (self.each)(match entry {
                Value::Object(map) => from_json_object(map),
                _ => Err(EventError::invalid(
                    "entry",
                    "a batch entry must be a JSON object",
                )),
            });
        }
        while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
            count += 1;
        }
        Ok(count)
    }
}

/// The JSON event format (CloudEvents JSON format 1.0).
pub fn from_json_object(mut map: Map<String, Value>) -> Result<Event, EventError> {
    match map.remove("specversion") {
        Some(Value::String(v)) => check_specversion("specversion", &v)?,
        Some(_) => return Err(EventError::invalid("specversion", "must be a string")),
        None => {
            return Err(EventError::invalid(
                "specversion",
                "required attribute is missing",
            ))
        }
    }
    let data = map.remove("data").filter(|v| !v.is_null());
    let data_base64 = map.remove("data_base64").filter(|v| !v.is_null());
    let mut event = blank_event()?;
    let mut content_type = None;
    for name in REQUIRED {
        match map.remove(name) {
            Some(Value::String(v)) => set_string_attribute(&mut event, name, name, v)?,
            Some(_) => return Err(EventError::invalid(name, "must be a string")),
            None => return Err(EventError::invalid(name, "required attribute is missing")),
        }
    }
    for (name, value) in map {
        if !valid_name(&name) {
            return Err(EventError::invalid(
                name.clone(),
                format!(
                    "`{name}` is not a valid attribute name (lower-case letters and digits only)"
                ),
            ));
        }
        match (name.as_str(), value) {
            (_, Value::Null) => {}
            ("datacontenttype", Value::String(v)) => {
                check_text("datacontenttype", &v)?;
                check_media_type("datacontenttype", &v)?;
                content_type = Some(v);
            }
            ("dataschema" | "subject" | "time", Value::String(v)) => {
                set_string_attribute(&mut event, &name, &name, v)?
            }
            ("datacontenttype" | "dataschema" | "subject" | "time", _) => {
                return Err(EventError::invalid(name, "must be a string"))
            }
            (_, Value::String(v)) => {
                check_text(&name, &v)?;
                event.set_extension(&name, ExtensionValue::String(v));
            }
            (_, Value::Bool(v)) => {
                event.set_extension(&name, ExtensionValue::Boolean(v));
            }
            (_, Value::Number(n)) => {
                // CloudEvents Integer is 32-bit signed.
                match n.as_i64().filter(|i| i32::try_from(*i).is_ok()) {
                    Some(i) => {
                        event.set_extension(&name, ExtensionValue::Integer(i));
                    }
                    None => return Err(EventError::invalid(
                        name,
                        "an extension number must be an integer between -2147483648 and 2147483647",
                    )),
                }
            }
            (_, _) => {
                return Err(EventError::invalid(
                    name,
                    "an extension value must be a string, boolean or integer",
                ))
            }
        }
    }
    let data = match (data, data_base64) {
        (Some(_), Some(_)) => {
            return Err(EventError::invalid(
                "data_base64",
                "an event carries `data` or `data_base64`, not both",
            ))
        }
        (None, Some(Value::String(b64))) => Some(Data::Binary(
            base64::engine::general_purpose::STANDARD
                .decode(b64.as_bytes())
                .map_err(|e| {
                    EventError::invalid("data_base64", format!("not valid base64: {e}"))
                })?,
        )),
        (None, Some(_)) => return Err(EventError::invalid("data_base64", "must be a string")),
        (Some(value), None) => Some(match (&content_type, value) {
            (Some(ct), Value::String(s)) if !is_json(&essence(ct)) => Data::String(s),
            (_, value) => Data::Json(value),
        }),
        (None, None) => None,
    };
    event.set_datacontenttype(content_type);
    if let Some(data) = data {
        event.set_data_unchecked(data);
    }
    Ok(event)
}

fn check_specversion(field: &str, value: &str) -> Result<(), EventError> {
    if value == "1.0" {
        Ok(())
    } else {
        Err(EventError::invalid(
            field,
            format!("specversion `{value}` is not supported; this gateway accepts 1.0"),
        ))
    }
}

/// Sets a context attribute given as a string (binary headers, or a JSON string).
fn set_string_attribute(
    event: &mut Event,
    attr: &str,
    field: &str,
    value: String,
) -> Result<(), EventError> {
    check_text(field, &value)?;
    match attr {
        "id" | "type" | "subject" if value.is_empty() => {
            return Err(EventError::invalid(field, "must be a non-empty string"))
        }
        "id" => {
            event.set_id(value);
        }
        "type" => {
            event.set_type(value);
        }
        "subject" => {
            event.set_subject(Some(value));
        }
        "source" => {
            check_uri_reference(field, &value)?;
            event.set_source(value);
        }
        "time" => {
            let time = DateTime::parse_from_rfc3339(&value).map_err(|e| {
                EventError::invalid(
                    field,
                    format!("`{value}` is not an RFC 3339 timestamp: {e}"),
                )
            })?;
            event.set_time(Some(time.with_timezone(&Utc)));
        }
        "dataschema" => {
            let url = url::Url::parse(&value).map_err(|e| {
                EventError::invalid(field, format!("`{value}` is not an absolute URI: {e}"))
            })?;
            event.set_dataschema(Some(url));
        }
        _ => {
            event.set_extension(attr, ExtensionValue::String(value));
        }
    }
    Ok(())
}

/// CloudEvents strings exclude the control characters U+0000–U+001F and U+007F–U+009F
/// (spec, "Type System"): they cannot travel in HTTP headers or message properties, where
/// targets put the attributes.
fn check_text(field: &str, value: &str) -> Result<(), EventError> {
    match value.chars().find(|c| c.is_control()) {
        None => Ok(()),
        Some(c) => Err(EventError::invalid(
            field,
            format!("contains the control character {c:?}, which CloudEvents strings may not"),
        )),
    }
}

/// `source` is a non-empty URI-reference (RFC 3986): no spaces or control characters.
fn check_uri_reference(field: &str, value: &str) -> Result<(), EventError> {
    if value.is_empty() {
        return Err(EventError::invalid(
            field,
            "must be a non-empty URI-reference",
        ));
    }
    if let Some(c) = value.chars().find(|c| {
        c.is_whitespace()
            || c.is_control()
            || matches!(c, '<' | '>' | '"' | '\\' | '^' | '`' | '{' | '|' | '}')
    }) {
        return Err(EventError::invalid(
            field,
            format!("`{value}` is not a URI-reference: character {c:?} must be percent-encoded"),
        ));
    }
    Ok(())
}

/// An RFC 2046 media type: `type/subtype` of token characters, then optional parameters.
fn check_media_type(field: &str, value: &str) -> Result<(), EventError> {
    let is_token = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
    };
    // The whole value travels as a Content-Type header and as a CloudEvents string: printable
    // ASCII and spaces only (a tab or non-ASCII parameter text would be accepted in one mode
    // and refused when delivered in the other).
    if let Some(c) = value.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(EventError::invalid(
            field,
            format!("`{value}` is not a media type: character {c:?} (printable ASCII only)"),
        ));
    }
    let essence = value.split(';').next().unwrap_or("").trim();
    let ok = essence
        .split_once('/')
        .is_some_and(|(t, s)| is_token(t) && is_token(s));
    if ok {
        Ok(())
    } else {
        Err(EventError::invalid(
            field,
            format!("`{value}` is not a media type (like application/json)"),
        ))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn traceparent_is_checked_as_the_w3c_format_says() {
        assert!(valid_traceparent(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        ));
        // A later version may add fields.
        assert!(valid_traceparent(
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x"
        ));
        for bad in [
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
            "garbage",
        ] {
            assert!(!valid_traceparent(bad), "{bad}");
        }
    }

    #[test]
    fn traceparent_fields_are_read_in_lower_case_hex_only() {
        let parsed = parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-09");
        assert_eq!(
            parsed,
            Some(TraceParent {
                trace_id: 0x0af7651916cd43dd8448eb211c80319c_u128.to_be_bytes(),
                parent_id: 0xb7ad6b7169203331_u64.to_be_bytes(),
                flags: 9,
            })
        );
        assert!(parsed.is_some_and(|p| p.sampled()));
        let unsampled =
            parse_traceparent("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00");
        assert!(unsampled.is_some_and(|p| !p.sampled()));
        for bad in [
            "",
            // Upper case anywhere: the specification's receivers ignore it.
            "00-0af7651916cd43dd8448eb211c80319C-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-B7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0A",
            "0A-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            // Not hex, or not two digits: version, flags.
            "zz-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-+1",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-011",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-",
            " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad}");
        }
    }

    use super::*;
    use crate::event::stored::{check_stored, decode, partition_key, ErrorKind};
    use cloudevents::AttributesReader;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    const MINIMAL: &[(&str, &str)] = &[
        ("ce-specversion", "1.0"),
        ("ce-id", "1"),
        ("ce-source", "/orders"),
        ("ce-type", "order.created"),
    ];

    /// Binary-mode JSON data is accepted exactly when the stored event decodes: the strict
    /// walk (no decode) agrees with decoding the whole event, at every edge we know of.
    #[test]
    fn binary_json_data_is_accepted_exactly_when_the_event_decodes() {
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "application/json"));
        let headers = headers(&pairs);
        let attributes = {
            let mut e = encode(&from_binary(&headers, b"").unwrap().event).unwrap();
            e.pop();
            e
        };
        let nested = |n: usize| "[".repeat(n) + &"]".repeat(n);
        let object_nested = |n: usize| r#"{"a":"#.repeat(n) + "1" + &"}".repeat(n);
        let mut cases: Vec<Vec<u8>> = [
            r#"{"a":"\ud800"}"#,
            r#""\udc00""#,
            r#"{"\ud800":1}"#,
            r#"["\ud800\u0041"]"#,
            r#"{"a":"\ud83d\ude00"}"#,
            "1e400",
            "-1e400",
            "100000000000000000000000000000",
            "1.5e300",
            "-0",
            r#"{"a":[1,2,{"b":null}]}"#,
            "true",
            "null",
            r#""plain""#,
            r#""\u0000""#,
            r#"{"a":1}  "#,
            r#"{"a":1} x"#,
            r#"{"a":1,"a":2}"#,
            "[1,]",
        ]
        .iter()
        .map(|s| s.as_bytes().to_vec())
        .collect();
        for n in [50, 98, 99, 100, 101, 125, 126, 127, 128, 129, 300] {
            cases.push(nested(n).into_bytes());
            cases.push(object_nested(n).into_bytes());
        }
        cases.push(b"\"\xff\"".to_vec());
        cases.push(b"{\"a\":\"\xc3\x28\"}".to_vec());
        for body in cases {
            // What the gateway accepts: parsed, then read back unless it vouches for it.
            let accepted = match from_binary(&headers, &body) {
                Ok(p) => p.reads_back || check_stored(&p.stored).is_ok(),
                Err(_) => false,
            };
            // What delivery can read: the body as the event's data, decoded.
            let mut naive = attributes.clone();
            naive.extend_from_slice(b",\"data\":");
            naive.extend_from_slice(body.trim_ascii());
            naive.push(b'}');
            let decodes = decode(&naive).is_ok();
            assert_eq!(
                accepted,
                decodes,
                "{}",
                String::from_utf8_lossy(&body[..body.len().min(80)])
            );
            if let Ok(p) = from_binary(&headers, &body) {
                if p.reads_back {
                    assert!(decode(&p.stored).is_ok(), "vouched for but does not decode");
                }
            }
        }
    }

    /// Found by fuzzing (`ce_binary`): the decoder's test for JSON data is case-sensitive
    /// and on the whole value, ours on the lower-cased essence; JSON data under
    /// `application/vnd.x+jsoN` was stored as JSON, vouched for, and could not be decoded
    /// for delivery (a 202 for an event that stalls its shard). It is stored as bytes now.
    #[test]
    fn json_data_under_a_content_type_the_decoder_does_not_read_as_json_reads_back() {
        for ct in [
            "application/vnd.x+jsoN",
            "Application/JSON",
            "application/x+json; charset=utf-8",
            "TEXT/plain",
        ] {
            let mut pairs = MINIMAL.to_vec();
            pairs.push(("content-type", ct));
            let body = br#"{"a": [1, 2]}"#;
            let parsed = from_binary(&headers(&pairs), body).unwrap();
            let e = decode(&parsed.stored).unwrap_or_else(|e| panic!("{ct}: {e}"));
            let data = match e.data() {
                Some(Data::Binary(b)) => b.clone(),
                Some(Data::String(s)) => s.clone().into_bytes(),
                other => panic!("{ct}: {other:?}"),
            };
            assert_eq!(data, body, "{ct}");
        }
    }

    /// Found by fuzzing (`ce_structured`, `ce_binary`): a content type with a tab (binary
    /// mode) or non-ASCII parameter text (structured mode) was accepted, and the event was
    /// refused when delivered in the other mode to a gateway.
    #[test]
    fn a_content_type_is_printable_ascii_in_every_mode() {
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "text/plain;\tcharset=utf-8"));
        let mut h = headers(&pairs);
        h.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_bytes(b"text/plain;\tcharset=utf-8").unwrap(),
        );
        assert_eq!(from_binary(&h, b"x").unwrap_err().field, "datacontenttype");
        let body = r#"{"specversion":"1.0","id":"a","source":"s","type":"t","datacontenttype":"text/plain; x=\u00fc"}"#;
        assert_eq!(
            from_structured(body.as_bytes()).unwrap_err().field,
            "datacontenttype"
        );
        let body = r#"{"specversion":"1.0","id":"a","source":"s","type":"t","datacontenttype":"text/plain; charset=utf-8"}"#;
        assert!(from_structured(body.as_bytes()).is_ok());
    }

    #[test]
    fn binary_minimal_and_json_data() {
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "application/json"));
        pairs.push(("ce-partitionkey", "cust-7"));
        let parsed = from_binary(&headers(&pairs), br#" {"a": 1} "#).unwrap();
        let e = decode(&parsed.stored).unwrap();
        assert_eq!(e.id(), "1");
        assert_eq!(e.ty(), "order.created");
        assert_eq!(e.data(), Some(&Data::Json(serde_json::json!({"a": 1}))));
        assert_eq!(partition_key(&e), "cust-7");
        assert_eq!(partition_key(&parsed.event), "cust-7");
        // The stored form decodes to the event the SDK builds from the same parts.
        let expected = EventBuilderV10::new()
            .id("1")
            .source("/orders")
            .ty("order.created")
            .extension("partitionkey", "cust-7")
            .data("application/json", serde_json::json!({"a": 1}))
            .build()
            .unwrap();
        assert_eq!(e, expected);
    }

    #[test]
    fn binary_data_kinds_round_trip() {
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "application/octet-stream"));
        let e = decode(&from_binary(&headers(&pairs), &[0, 1, 2]).unwrap().stored).unwrap();
        assert_eq!(e.data(), Some(&Data::Binary(vec![0, 1, 2])));
        let e = decode(&from_binary(&headers(MINIMAL), b"raw").unwrap().stored).unwrap();
        assert_eq!(e.data(), Some(&Data::Binary(b"raw".to_vec())));
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "application/json"));
        let parsed = from_binary(&headers(&pairs), b"{\n  \"a\": [1,\n 2]\n}\n").unwrap();
        assert!(!parsed.stored.contains(&b'\n'), "stored on one line");
        let e = decode(&parsed.stored).unwrap();
        assert_eq!(
            e.data(),
            Some(&Data::Json(serde_json::json!({"a": [1, 2]})))
        );
        let e = decode(&from_binary(&headers(&pairs), b"").unwrap().stored).unwrap();
        assert_eq!(e.data(), None);
        assert_eq!(e.datacontenttype(), Some("application/json"));
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "text/plain; charset=utf-8"));
        let e = decode(
            &from_binary(&headers(&pairs), "line \"1\"\nzwei ü".as_bytes())
                .unwrap()
                .stored,
        )
        .unwrap();
        assert_eq!(e.data(), Some(&Data::String("line \"1\"\nzwei ü".into())));
    }

    #[test]
    fn binary_missing_required_names_header() {
        for missing in ["ce-id", "ce-source", "ce-type", "ce-specversion"] {
            let pairs: Vec<_> = MINIMAL
                .iter()
                .copied()
                .filter(|(k, _)| *k != missing)
                .collect();
            let err = from_binary(&headers(&pairs), b"").unwrap_err();
            assert_eq!(err.field, missing);
        }
    }

    #[test]
    fn binary_rejects_bad_values() {
        let cases: &[(&str, &str, &str)] = &[
            ("ce-specversion", "0.3", "ce-specversion"),
            ("ce-time", "yesterday", "ce-time"),
            ("ce-dataschema", "not a uri", "ce-dataschema"),
            ("ce-source", "has space", "ce-source"),
            ("ce-id", "", "ce-id"),
        ];
        for (name, value, field) in cases {
            let mut pairs: Vec<_> = MINIMAL.iter().copied().filter(|(k, _)| k != name).collect();
            pairs.push((name, value));
            let err = from_binary(&headers(&pairs), b"").unwrap_err();
            assert_eq!(&err.field, field, "{err}");
        }
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("content-type", "application/json"));
        let err = from_binary(&headers(&pairs), b"{not json").unwrap_err();
        assert_eq!(err.field, "data");
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("ce-Bad_Name", "x"));
        let err = from_binary(&headers(&pairs), b"").unwrap_err();
        assert_eq!(err.field, "ce-bad_name");
    }

    #[test]
    fn binary_percent_decodes_and_keeps_extensions() {
        let mut pairs = MINIMAL.to_vec();
        pairs.push(("ce-subject", "caf%C3%A9"));
        pairs.push(("ce-traceparent", "00-abc"));
        pairs.push(("content-type", "text/plain"));
        let e = decode(&from_binary(&headers(&pairs), b"hello").unwrap().stored).unwrap();
        assert_eq!(e.subject(), Some("café"));
        assert_eq!(
            e.extension("traceparent"),
            Some(&ExtensionValue::String("00-abc".into()))
        );
        assert_eq!(e.data(), Some(&Data::String("hello".into())));
    }

    #[test]
    fn structured_validation() {
        let ok = br#"{"specversion":"1.0","id":"a","source":"s","type":"t","time":"2026-12-03T10:00:00+01:00","count":3,"flag":true,"data":{"x":[1,2]}}"#;
        let e = from_structured(ok).unwrap();
        assert_eq!(e.extension("count"), Some(&ExtensionValue::Integer(3)));
        assert_eq!(e.time().unwrap().to_rfc3339(), "2026-12-03T09:00:00+00:00");
        let cases: &[(&str, &str)] = &[
            (r#"{"id":"a","source":"s","type":"t"}"#, "specversion"),
            (r#"{"specversion":"1.0","source":"s","type":"t"}"#, "id"),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":7}"#,
                "type",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","Bad":1}"#,
                "Bad",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","ext":1.5}"#,
                "ext",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","ext":{"a":1}}"#,
                "ext",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","data":1,"data_base64":"AA=="}"#,
                "data_base64",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","data_base64":"!!"}"#,
                "data_base64",
            ),
            (
                r#"{"specversion":"1.0","id":"a","source":"s","type":"t","datacontenttype":"json"}"#,
                "datacontenttype",
            ),
            (r#"[1]"#, "body"),
            (r#"{"specversion":"1.0","#, "body"),
        ];
        for (body, field) in cases {
            let err = from_structured(body.as_bytes()).unwrap_err();
            assert_eq!(&err.field, field, "{body}: {err}");
        }
    }

    #[test]
    fn structured_text_and_binary_data() {
        let e = from_structured(br#"{"specversion":"1.0","id":"a","source":"s","type":"t","datacontenttype":"text/plain","data":"hi"}"#).unwrap();
        assert_eq!(e.data(), Some(&Data::String("hi".into())));
        let e = from_structured(
            br#"{"specversion":"1.0","id":"a","source":"s","type":"t","data_base64":"AAEC"}"#,
        )
        .unwrap();
        assert_eq!(e.data(), Some(&Data::Binary(vec![0, 1, 2])));
        assert_eq!(decode(&encode(&e).unwrap()).unwrap(), e);
    }

    #[test]
    fn batch_reports_each_entry() {
        let body = br#"[{"specversion":"1.0","id":"a","source":"s","type":"t"},{"specversion":"1.0","id":"b","source":"s"},7]"#;
        let results = from_batch(body, 10).unwrap();
        assert!(results[0].is_ok());
        assert_eq!(results[1].as_ref().unwrap_err().field, "type");
        assert_eq!(results[2].as_ref().unwrap_err().field, "entry");
        assert_eq!(from_batch(b"[]", 10).unwrap_err().field, "body");
        assert_eq!(from_batch(b"{}", 10).unwrap_err().field, "body");
        let err = from_batch(body, 2).unwrap_err();
        assert_eq!(err.kind, ErrorKind::TooLarge);
    }

    #[test]
    fn content_modes() {
        let h = headers(&[(
            "content-type",
            "application/cloudevents+json; charset=utf-8",
        )]);
        assert_eq!(content_mode(&h).unwrap(), ContentMode::Structured);
        let h = headers(&[("content-type", "application/cloudevents-batch+json")]);
        assert_eq!(content_mode(&h).unwrap(), ContentMode::Batch);
        let h = headers(MINIMAL);
        assert_eq!(content_mode(&h).unwrap(), ContentMode::Binary);
        let h = headers(&[("content-type", "application/cloudevents+avro")]);
        assert_eq!(content_mode(&h).unwrap_err().kind, ErrorKind::Unsupported);
        let h = headers(&[("content-type", "application/json")]);
        assert_eq!(content_mode(&h).unwrap_err().kind, ErrorKind::Unsupported);
        let h = headers(&[("ce-id", "1")]);
        assert_eq!(content_mode(&h).unwrap_err().field, "ce-specversion");
    }
}
