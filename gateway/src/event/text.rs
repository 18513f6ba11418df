//! An event as targets send it: its attributes as text and its data as the bytes a
//! binary-mode body carries ([`EventText`]), read straight from the stored form where it
//! can be, without decoding the event.
//!
//! Decoding a stored event (the SDK's JSON event format) parses it into a JSON tree, then
//! the event, its data into another tree; a binary-mode target then writes the data back
//! out. For an HTTP target that was 40 % of the gateway's CPU per delivered event.
//! [`EventText::read`] walks the stored object's top-level members once instead: the data
//! stays the stored JSON text. It reads the events this gateway stores (CloudEvents 1.0 as
//! the SDK writes them) and says `None` for anything it does not vouch for, where the caller
//! decodes the event and takes [`EventText::of`]: the same attributes, and the same data but
//! for the layout of JSON data (re-serialised by the decoder, kept as stored here).

use std::borrow::Cow;

use base64::Engine as _;
use cloudevents::event::{AttributeValue, Data};
use cloudevents::Event;

use super::stored::decoder_reads_json;

/// An event's attributes as text and its data as bytes: what binary mode and message
/// properties carry.
#[derive(Debug, Clone, PartialEq)]
pub struct EventText<'a> {
    /// Every context attribute and extension but `datacontenttype`: the SDK's order for the
    /// context attributes (extensions after them), `time` in RFC 3339 as
    /// `DateTime::to_rfc3339` writes it, booleans and integers as JSON writes them.
    pub attributes: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    pub datacontenttype: Option<Cow<'a, str>>,
    pub data: DataText<'a>,
}

/// An event's data, as the decoder would read it.
#[derive(Debug, Clone, PartialEq)]
pub enum DataText<'a> {
    None,
    /// JSON (under a JSON content type, or none), as JSON text.
    Json(Cow<'a, [u8]>),
    /// Text under another content type.
    Text(Cow<'a, str>),
    /// Bytes (`data_base64`).
    Binary(Cow<'a, [u8]>),
}

impl<'a> EventText<'a> {
    /// The text of a decoded event.
    pub fn of(event: &Event) -> EventText<'static> {
        let attributes = event
            .iter()
            .filter(|(name, _)| *name != "datacontenttype")
            .map(|(name, value)| {
                let text = match value {
                    AttributeValue::Time(t) => t.to_rfc3339(),
                    other => other.to_string(),
                };
                (Cow::Owned(name.to_string()), Cow::Owned(text))
            })
            .collect();
        let data = match event.data() {
            Some(Data::Binary(b)) => DataText::Binary(Cow::Owned(b.clone())),
            Some(Data::String(s)) => DataText::Text(Cow::Owned(s.clone())),
            Some(Data::Json(v)) => {
                DataText::Json(Cow::Owned(serde_json::to_vec(v).unwrap_or_default()))
            }
            None => DataText::None,
        };
        EventText {
            attributes,
            datacontenttype: cloudevents::AttributesReader::datacontenttype(event)
                .map(|ct| Cow::Owned(ct.to_string())),
            data,
        }
    }

    /// The text of a stored event, read without decoding it; `None` where this reading
    /// does not vouch for giving what the decoder gives (then decode and take [`Self::of`]):
    /// not a CloudEvents 1.0 object as the SDK writes it, escapes in member names, a
    /// `time` that does not parse, an extension that is neither a string, a boolean nor an
    /// integer, `data_base64` the decoder might read as JSON, `null` data.
    pub fn read(stored: &'a [u8]) -> Option<EventText<'a>> {
        let text = std::str::from_utf8(stored).ok()?;
        let mut attributes = Vec::with_capacity(10);
        let mut datacontenttype = None;
        let mut data = None;
        let mut data_base64 = None;
        for (name, value) in members(text)? {
            match name {
                "data" => data = Some(value),
                "data_base64" => data_base64 = Some(value),
                _ if value == "null" => {
                    // The decoder takes a null attribute as absent; required ones it refuses.
                    if matches!(name, "specversion" | "id" | "source" | "type") {
                        return None;
                    }
                }
                "specversion" => {
                    if value != "\"1.0\"" {
                        return None;
                    }
                    attributes.push((Cow::Borrowed(name), Cow::Borrowed("1.0")));
                }
                "datacontenttype" => datacontenttype = Some(string(value)?),
                "time" => {
                    let time = chrono::DateTime::parse_from_rfc3339(&string(value)?).ok()?;
                    let time = time.with_timezone(&chrono::Utc).to_rfc3339();
                    attributes.push((Cow::Borrowed(name), Cow::Owned(time)));
                }
                "id" | "source" | "type" | "subject" | "dataschema" => {
                    attributes.push((Cow::Borrowed(name), string(value)?));
                }
                _ => attributes.push((Cow::Borrowed(name), extension(value)?)),
            }
        }
        let has = |required: &str| attributes.iter().any(|(name, _)| name == required);
        if !["specversion", "id", "source", "type"].into_iter().all(has) {
            return None;
        }
        // The SDK's order for the context attributes (`AttributesIter`), extensions after.
        attributes.sort_by_key(|(name, _)| attribute_rank(name));
        let json = decoder_reads_json(datacontenttype.as_deref().unwrap_or("application/json"));
        let data = match (data, data_base64) {
            (None, None) => DataText::None,
            (Some("null"), _) | (Some(_), Some(_)) => return None,
            (Some(value), None) if json => DataText::Json(Cow::Borrowed(value.as_bytes())),
            (Some(value), None) => DataText::Text(string(value)?),
            // Under a JSON content type (or none) the decoder reads base64 data as JSON when
            // it is JSON: left to it.
            (None, Some(_)) if json => return None,
            (None, Some(value)) => DataText::Binary(Cow::Owned(
                base64::engine::general_purpose::STANDARD
                    .decode(string(value)?.as_bytes())
                    .ok()?,
            )),
        };
        Some(EventText {
            attributes,
            datacontenttype,
            data,
        })
    }

    /// One attribute or extension as text (`datacontenttype` too), if the event has it.
    pub fn attribute(&self, name: &str) -> Option<&str> {
        if name == "datacontenttype" {
            return self.datacontenttype.as_deref();
        }
        self.attributes
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_ref())
    }

    /// The event's id.
    pub fn id(&self) -> &str {
        self.attribute("id").unwrap_or_default()
    }

    /// The content type a binary-mode body carries: `datacontenttype`, else what the data
    /// is (a receiver that reads JSON as JSON would refuse bytes sent as `application/json`).
    pub fn content_type(&self) -> &str {
        match (&self.datacontenttype, &self.data) {
            (Some(ct), _) => ct,
            (None, DataText::Binary(_)) => "application/octet-stream",
            (None, DataText::Text(_)) => "text/plain; charset=utf-8",
            (None, _) => "application/json",
        }
    }

    /// The data as a binary-mode body carries it.
    pub fn data_bytes(&self) -> &[u8] {
        match &self.data {
            DataText::None => &[],
            DataText::Json(b) | DataText::Binary(b) => b,
            DataText::Text(s) => s.as_bytes(),
        }
    }
}

/// The stored form as the structured JSON text a user function gets, when it is that text
/// already: valid UTF-8 with its data absent or JSON. `None` for data stored as a string
/// or as `data_base64` (a function gets a text or binary payload holding JSON as JSON, so
/// that event goes in through the decoder), and for anything this quick look at the
/// top-level members does not vouch for (an object or array besides `data`).
pub fn structured_text(stored: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(stored).ok()?;
    // Attributes and extensions are strings, numbers and booleans.
    let plain = members(text)?.iter().all(|(name, value)| match *name {
        "data" => !value.starts_with('"'),
        "data_base64" => false,
        _ => !value.starts_with(['{', '[']),
    });
    plain.then_some(text)
}

/// Where a context attribute comes in the SDK's iteration of an event; extensions last.
fn attribute_rank(name: &str) -> u8 {
    match name {
        "specversion" => 0,
        "id" => 1,
        "type" => 2,
        "source" => 3,
        "dataschema" => 5,
        "subject" => 6,
        "time" => 7,
        _ => 8,
    }
}

/// A JSON string member's value, unescaped.
fn string(value: &str) -> Option<Cow<'_, str>> {
    let inner = value.strip_prefix('"')?.strip_suffix('"')?;
    if inner.contains('\\') {
        serde_json::from_str::<String>(value).ok().map(Cow::Owned)
    } else {
        Some(Cow::Borrowed(inner))
    }
}

/// An extension's value as text: a string, a boolean, or an integer the SDK holds (`i64`).
fn extension(value: &str) -> Option<Cow<'_, str>> {
    match value.as_bytes().first()? {
        b'"' => string(value),
        b't' | b'f' if value == "true" || value == "false" => Some(Cow::Borrowed(value)),
        // As the SDK writes it back (`-0` would come back as `0`).
        b'-' | b'0'..=b'9' => {
            (value.parse::<i64>().ok()?.to_string() == value).then_some(Cow::Borrowed(value))
        }
        _ => None,
    }
}

/// The top-level members of a JSON object, in order, each value as its JSON text: `None`
/// unless `text` is one object (whitespace around it) whose member names have no escapes.
/// It finds where values end and trusts the rest: it is for the stored form, which was
/// checked when it was written.
pub(crate) fn members(text: &str) -> Option<Vec<(&str, &str)>> {
    let b = text.as_bytes();
    let mut at = skip_ws(b, 0);
    if b.get(at) != Some(&b'{') {
        return None;
    }
    at += 1;
    let mut out = Vec::with_capacity(12);
    loop {
        at = skip_ws(b, at);
        match b.get(at)? {
            b'}' => break,
            b',' if !out.is_empty() => {
                at += 1;
                continue;
            }
            b'"' => {}
            _ => return None,
        }
        let key_end = string_end(b, at)?;
        let key = text.get(at + 1..key_end - 1)?;
        if key.contains('\\') {
            return None;
        }
        at = skip_ws(b, key_end);
        if b.get(at) != Some(&b':') {
            return None;
        }
        at = skip_ws(b, at + 1);
        let end = value_end(b, at)?;
        out.push((key, text.get(at..end)?));
        at = end;
    }
    (skip_ws(b, at + 1) == b.len()).then_some(out)
}

fn skip_ws(b: &[u8], mut at: usize) -> usize {
    while matches!(b.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// One past the string that starts (with its quote) at `at`.
fn string_end(b: &[u8], mut at: usize) -> Option<usize> {
    at += 1;
    loop {
        match b.get(at)? {
            b'"' => return Some(at + 1),
            b'\\' => at += 2,
            _ => at += 1,
        }
    }
}

/// One past the JSON value that starts at `at`.
fn value_end(b: &[u8], at: usize) -> Option<usize> {
    match b.get(at)? {
        b'"' => string_end(b, at),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = at;
            loop {
                match b.get(at)? {
                    b'"' => {
                        at = string_end(b, at)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        _ => {
            let len = b[at..]
                .iter()
                .position(|c| matches!(c, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))?;
            (len > 0).then_some(at + len)
        }
    }
}

#[cfg(test)]
mod tests;
