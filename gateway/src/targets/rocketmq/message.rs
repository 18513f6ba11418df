//! How an event becomes a RocketMQ message, following the CloudEvents RocketMQ binding: in
//! binary content mode the data is the body and every attribute a user property
//! `CE_<attribute>`; tag and keys come from attributes. Whatever ingress accepted must become
//! a message the broker takes, so what the remoting format cannot carry is handled here:
//! separators in property text are percent-encoded (properties travel as
//! `name\u{1}value\u{2}` with no escaping, so a value holding them would forge properties
//! such as `_SYS_MSG_PRIORITY_`, which moves a message to another queue), an event without
//! data gets the binding's one-NUL body (RocketMQ refuses empty bodies), and an event whose
//! attributes exceed what properties can hold goes in structured content mode (the event's
//! JSON as the body).

use std::borrow::Cow;

use bytes::Bytes;
use rocketmq_model::common::message::message_batch::MessageBatch;
use rocketmq_model::common::message::message_client_id_setter::MessageClientIDSetter;
use rocketmq_model::common::message::message_single::Message;
use rocketmq_model::common::message::MessageTrait;

use crate::targets::config::RocketMqConfig;
use crate::targets::target::{Envelope, TargetError};

/// Most bytes of properties one message carries. The batch format stores their length in a
/// signed 16-bit field and the broker refuses more than 32 KiB; the rest is left for what
/// the client and the broker add (unique id, cluster, offsets).
pub(super) const MAX_PROPERTIES: usize = 30 * 1024;

/// Largest body the client sends (its default `max_message_size`).
pub(super) const MAX_BODY: usize = 4 * 1024 * 1024;

/// The body of an event without data (the CloudEvents SDK's RocketMQ binding does the same).
const EMPTY_DATA: &[u8] = b"\0";

/// Framing of one message inside a batch body (sizes, magic code, CRC, flag) and the
/// properties every message gets from the client (unique id, wait-for-store flag).
const OVERHEAD: usize = 22 + 64;

/// The property naming the content type of a structured-mode body, as the binding names it.
pub(super) const STRUCTURED_CONTENT_TYPE_PROPERTY: &str = "CE_contenttype";
pub(super) const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// One event as a message, with the key that chooses its queue and its size in a batch.
pub(crate) struct Encoded {
    pub message: Message,
    pub key: String,
    pub size: usize,
}

/// Properties of a message, already encoded, and the bytes they take on the wire.
#[derive(Default)]
struct Properties {
    tag: Option<String>,
    keys: Option<String>,
    user: Vec<(String, String)>,
    bytes: usize,
}

impl Properties {
    fn cost(name: &str, value: &str) -> usize {
        name.len() + value.len() + 2
    }

    fn tag(&mut self, value: &str) {
        let value = property_text(value).into_owned();
        self.bytes += Self::cost("TAGS", &value);
        self.tag = Some(value);
    }

    fn keys(&mut self, value: &str) {
        let value = property_text(value).into_owned();
        self.bytes += Self::cost("KEYS", &value);
        self.keys = Some(value);
    }

    fn user(&mut self, name: &str, value: &str) {
        let name = property_text(name).into_owned();
        let value = property_text(value).into_owned();
        self.bytes += Self::cost(&name, &value);
        self.user.push((name, value));
    }
}

/// Text as a property name or value can carry it: control characters (CloudEvents allows
/// none in attribute values; two of them are the format's separators) become `%XX`.
pub(crate) fn property_text(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if c.is_control() {
            let mut buf = [0u8; 4];
            for byte in c.encode_utf8(&mut buf).bytes() {
                out.push_str(&format!("%{byte:02X}"));
            }
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// The message for one event. Errors are about the event itself (it does not decode, or it
/// is larger than a message can be), so they are not retryable.
pub(crate) fn encode(config: &RocketMqConfig, envelope: &Envelope) -> Result<Encoded, TargetError> {
    let event = envelope.text()?;
    let attribute = |name: &str| event.attribute(name).map(str::to_string);
    let key = attribute(&config.partition_key_attribute).unwrap_or_else(|| event.id().to_string());
    let tag = match (&config.tag, &config.tag_attribute) {
        (Some(tag), _) => Some(tag.clone()),
        (None, Some(attr)) => attribute(attr),
        (None, None) => None,
    }
    .filter(|t| !t.is_empty());
    let keys = attribute(&config.keys_attribute).filter(|k| !k.is_empty());

    let mut binary = Properties::default();
    if let Some(tag) = &tag {
        binary.tag(tag);
    }
    if let Some(keys) = &keys {
        binary.keys(keys);
    }
    if let Some(ct) = &event.datacontenttype {
        binary.user("CE_datacontenttype", ct);
    }
    for (name, value) in &event.attributes {
        binary.user(&format!("CE_{name}"), value);
    }

    let (body, properties) = if binary.bytes <= MAX_PROPERTIES {
        let body = match &envelope.body {
            Some(transformed) => transformed.bytes.clone(),
            None => Bytes::copy_from_slice(event.data_bytes()),
        };
        (body, binary)
    } else if envelope.body.is_some() {
        // The transform chose the body, so the event cannot travel as JSON instead.
        return Err(TargetError::fatal(format!(
            "the attributes of event `{}` take {} bytes, more than the {MAX_PROPERTIES} RocketMQ properties can hold, and the transform's body leaves no room for structured mode",
            event.id(),
            binary.bytes
        )));
    } else {
        // Structured mode: the stored form is the event's JSON, attributes and data.
        let mut structured = Properties::default();
        structured.user(STRUCTURED_CONTENT_TYPE_PROPERTY, STRUCTURED_CONTENT_TYPE);
        for (name, value) in [("TAGS", &tag), ("KEYS", &keys)] {
            if let Some(value) = value {
                if structured.bytes + Properties::cost(name, value) <= MAX_PROPERTIES {
                    match name {
                        "TAGS" => structured.tag(value),
                        _ => structured.keys(value),
                    }
                }
            }
        }
        (envelope.raw.clone(), structured)
    };
    let body = if body.is_empty() {
        Bytes::from_static(EMPTY_DATA)
    } else {
        body
    };
    if body.len() > MAX_BODY {
        return Err(TargetError::fatal(format!(
            "event `{}` makes a message body of {} bytes; RocketMQ takes at most {MAX_BODY}",
            event.id(),
            body.len()
        )));
    }
    let size = OVERHEAD + body.len() + properties.bytes;
    let mut builder = Message::builder().topic(config.topic.as_str()).body(body);
    if let Some(tag) = properties.tag {
        builder = builder.tags(tag);
    }
    if let Some(keys) = properties.keys {
        builder = builder.key(keys);
    }
    for (name, value) in properties.user {
        builder = builder
            .raw_property(name.as_str(), value)
            .map_err(|e| TargetError::fatal(format!("property {name}: {e}")))?;
    }
    let message = builder
        .build()
        .map_err(|e| TargetError::fatal(format!("cannot build the message: {e}")))?;
    Ok(Encoded { message, key, size })
}

/// Messages of one queue as one batch request, encoded as the client's own batch send does
/// (each message gets its unique id; the batch body is the messages in the batch format).
pub(super) fn batch(messages: Vec<Message>) -> Result<MessageBatch, TargetError> {
    let mut batch = MessageBatch::generate_from_messages(messages)
        .map_err(|e| TargetError::fatal(format!("cannot batch the messages: {e}")))?;
    for message in &mut batch.messages {
        MessageClientIDSetter::set_uniq_id(message);
    }
    MessageClientIDSetter::set_uniq_id(&mut batch.final_message);
    let body =
        rocketmq_protocol::common::message::message_decoder::encode_messages(&batch.messages);
    batch.set_body(body);
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::targets::Body;

    fn config() -> RocketMqConfig {
        toml::from_str(
            r#"
name = "mq"
name_server = "127.0.0.1:9876"
topic = "T"
tag_attribute = "type"
"#,
        )
        .unwrap()
    }

    fn envelope(json: serde_json::Value) -> Envelope {
        Envelope {
            raw: Bytes::from(json.to_string()),
            accepted_ms: 0,
            event: None,
            body: None,
        }
    }

    /// The properties as the broker reads them back from the wire form.
    fn wire_properties(message: &Message) -> HashMap<String, String> {
        let text =
            rocketmq_model::codec::message_properties_to_string(message.properties().as_map());
        rocketmq_model::codec::string_to_message_properties(Some(&text))
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn property_text_encodes_control_characters_only() {
        assert_eq!(property_text("order-1 Zürich 100%"), "order-1 Zürich 100%");
        assert_eq!(property_text("a\u{1}b\u{2}c"), "a%01b%02c");
        assert_eq!(
            property_text("line\nbreak\u{7f}\u{85}"),
            "line%0Abreak%7F%C2%85"
        );
    }

    #[test]
    fn separators_in_attributes_cannot_forge_properties() {
        let forged = "x\u{2}_SYS_MSG_PRIORITY_\u{1}3\u{2}__SHARDINGKEY\u{1}k";
        let encoded = encode(
            &config(),
            &envelope(serde_json::json!({
                "specversion": "1.0", "id": forged, "source": "/s", "type": forged,
                "partitionkey": "k1", "evil": forged, "data": {"n": 1}
            })),
        )
        .unwrap();
        let props = wire_properties(&encoded.message);
        assert!(!props.contains_key("_SYS_MSG_PRIORITY_"), "{props:?}");
        assert!(!props.contains_key("__SHARDINGKEY"), "{props:?}");
        let escaped = "x%02_SYS_MSG_PRIORITY_%013%02__SHARDINGKEY%01k";
        assert_eq!(props.get("CE_evil").map(String::as_str), Some(escaped));
        assert_eq!(props.get("CE_id").map(String::as_str), Some(escaped));
        assert_eq!(props.get("KEYS").map(String::as_str), Some(escaped));
        assert_eq!(props.get("TAGS").map(String::as_str), Some(escaped));
        assert_eq!(encoded.key, "k1");
    }

    #[test]
    fn an_event_without_data_gets_a_one_nul_body() {
        let encoded = encode(
            &config(),
            &envelope(
                serde_json::json!({"specversion": "1.0", "id": "e", "source": "/s", "type": "t"}),
            ),
        )
        .unwrap();
        assert_eq!(encoded.message.body().unwrap().as_ref(), b"\0");
        assert_eq!(encoded.key, "e", "no partition key: the id spreads events");
    }

    #[test]
    fn attributes_too_large_for_properties_go_in_structured_mode() {
        let json = serde_json::json!({
            "specversion": "1.0", "id": "big", "source": "/s", "type": "t",
            "huge": "h".repeat(MAX_PROPERTIES), "data": {"n": 1}
        });
        let envelope = envelope(json);
        let encoded = encode(&config(), &envelope).unwrap();
        assert_eq!(encoded.message.body().unwrap(), envelope.raw);
        let props = wire_properties(&encoded.message);
        assert_eq!(
            props
                .get(STRUCTURED_CONTENT_TYPE_PROPERTY)
                .map(String::as_str),
            Some(STRUCTURED_CONTENT_TYPE)
        );
        assert!(!props.contains_key("CE_huge"));
        assert_eq!(props.get("KEYS").map(String::as_str), Some("big"));
        let text = rocketmq_model::codec::message_properties_to_string(
            encoded.message.properties().as_map(),
        );
        assert!(text.len() < MAX_PROPERTIES);

        let mut transformed = envelope.clone();
        transformed.body = Some(Body {
            content_type: "text/plain".into(),
            bytes: Bytes::from_static(b"body"),
        });
        let err = encode(&config(), &transformed).err().unwrap();
        assert!(
            !err.retryable && err.message.contains("structured mode"),
            "{err}"
        );
    }

    #[test]
    fn properties_just_under_the_limit_stay_in_binary_mode() {
        let json = serde_json::json!({
            "specversion": "1.0", "id": "edge", "source": "/s", "type": "t",
            "big": "b".repeat(MAX_PROPERTIES - 200), "data": "x"
        });
        let encoded = encode(&config(), &envelope(json)).unwrap();
        let props = wire_properties(&encoded.message);
        assert_eq!(props["CE_big"].len(), MAX_PROPERTIES - 200);
        assert!(
            encoded.size > MAX_PROPERTIES - 200,
            "the size counts the properties"
        );
    }

    #[test]
    fn a_batch_body_holds_every_message_with_its_own_id() {
        let messages: Vec<Message> = (0..3)
            .map(|i| {
                encode(
                    &config(),
                    &envelope(serde_json::json!({
                        "specversion": "1.0", "id": format!("b{i}"), "source": "/s", "type": "t", "data": i
                    })),
                )
                .unwrap()
                .message
            })
            .collect();
        let batch = batch(messages).unwrap();
        let ids: std::collections::HashSet<String> = batch
            .messages
            .iter()
            .map(|m| wire_properties(m)["UNIQ_KEY"].clone())
            .collect();
        assert_eq!(ids.len(), 3);
        assert!(batch.get_body().is_some_and(|b| !b.is_empty()));
    }
}
