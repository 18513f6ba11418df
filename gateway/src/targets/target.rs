//! What every target is: the `Target` trait, the events it is handed (`Envelope`), how a
//! delivery fails (`TargetError`), and the event helpers targets share (the event as text,
//! JSON lines, appending an event to a bus).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use cloudevents::Event;

use crate::event;
use crate::store::BusLog;

/// A failed delivery. `retryable` says whether trying the same events again may succeed;
/// `status` is the peer's answer when it gave one (an HTTP status), for dead letters and logs;
/// `retry_after` is how long the peer asked us to wait (`Retry-After`).
#[derive(Debug, Clone, Default, thiserror::Error)]
#[error("{message}")]
pub struct TargetError {
    pub message: String,
    pub retryable: bool,
    pub status: Option<u16>,
    pub retry_after: Option<Duration>,
}

impl TargetError {
    pub fn retryable(message: impl Into<String>) -> Self {
        TargetError {
            message: message.into(),
            retryable: true,
            ..TargetError::default()
        }
    }

    /// An error that the same request will hit again (bad configuration, a refused event).
    pub fn fatal(message: impl Into<String>) -> Self {
        TargetError {
            message: message.into(),
            retryable: false,
            ..TargetError::default()
        }
    }
}

/// An event on its way to a target: its structured JSON form and, when something needed to
/// look inside it, the decoded event. A transform may have turned it into a raw `body`,
/// which then replaces the event for targets that send bodies.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub raw: Bytes,
    /// When the event was accepted (ms since the Unix epoch; 0: not known).
    pub accepted_ms: u64,
    pub event: Option<Event>,
    pub body: Option<Body>,
}

/// A raw body produced by a transform.
#[derive(Debug, Clone)]
pub struct Body {
    pub content_type: String,
    pub bytes: Bytes,
}

impl Envelope {
    /// The decoded event (decoding the stored form if no one has yet). A stored event that
    /// does not decode can never be delivered: the error is not retryable.
    pub fn decoded(&self) -> Result<std::borrow::Cow<'_, Event>, TargetError> {
        match &self.event {
            Some(e) => Ok(std::borrow::Cow::Borrowed(e)),
            None => event::decode(&self.raw)
                .map(std::borrow::Cow::Owned)
                .map_err(|e| TargetError::fatal(format!("stored event does not decode: {e}"))),
        }
    }

    /// The event's attributes and data as text: read from the stored form without decoding
    /// it where it can be (see [`event::EventText`]), else from the decoded event.
    pub fn text(&self) -> Result<event::EventText<'_>, TargetError> {
        if let Some(e) = &self.event {
            return Ok(event::EventText::of(e));
        }
        match event::EventText::read(&self.raw) {
            Some(text) => Ok(text),
            None => Ok(event::EventText::of(self.decoded()?.as_ref())),
        }
    }
}

#[async_trait]
pub trait Target: Send + Sync + 'static {
    /// Delivers a batch, in order. `Ok` means every event of it is delivered (and, for
    /// targets that can say so, durable), so the position may move past the batch.
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError>;

    /// Short description for logs and status.
    fn describe(&self) -> String;
}

/// What targets may need besides their own configuration: the buses (bus target, function
/// replies, dead letters append to them).
#[derive(Clone)]
pub struct Resources {
    pub buses: HashMap<String, Arc<dyn BusLog>>,
}

/// Stands in for a target this replica could not build: its subscription keeps its place
/// and its positions, and holds its events (its lanes never deliver: see `runtime::shard`).
pub struct Unavailable {
    pub reason: String,
}

#[async_trait]
impl Target for Unavailable {
    async fn deliver(&self, _events: &[Envelope]) -> Result<(), TargetError> {
        Err(TargetError::retryable(format!(
            "the target cannot be built on this replica: {}",
            self.reason
        )))
    }

    fn describe(&self) -> String {
        format!("unavailable ({})", self.reason)
    }
}

/// One JSON line per event, in CloudEvents structured form (the stored form as it is). A
/// transformed body goes on its line as compact JSON, or as a JSON string if it is not JSON.
pub fn json_lines(events: &[Envelope]) -> Vec<u8> {
    let mut out = Vec::with_capacity(events.iter().map(|e| e.raw.len() + 1).sum());
    for event in events {
        match &event.body {
            None => out.extend_from_slice(&event.raw),
            Some(body) => {
                let written = match serde_json::from_slice::<serde_json::Value>(&body.bytes) {
                    Ok(json) => serde_json::to_writer(&mut out, &json),
                    Err(_) => {
                        serde_json::to_writer(&mut out, &String::from_utf8_lossy(&body.bytes))
                    }
                };
                if written.is_err() {
                    out.extend_from_slice(b"null");
                }
            }
        }
        out.push(b'\n');
    }
    out
}

/// The stored form of an event the gateway made itself (a function reply, a dead letter),
/// with the shard it belongs to on a bus of `shards` shards.
pub fn stored(event: &Event, shards: u32) -> Result<(u32, Bytes), TargetError> {
    let raw = crate::event::encode(event)
        .map_err(|e| TargetError::fatal(format!("cannot encode event: {e}")))?;
    // A function's reply or a dead letter goes onto a bus: held to what the store takes and
    // delivery reads back, or it would stall that bus's subscriptions.
    crate::store::append::prepare(
        event,
        raw,
        false,
        shards,
        crate::store::MAX_RECORD_BYTES,
        "the store's record limit",
    )
    .map_err(|e| TargetError::fatal(e.to_string()))
}

/// Appends events to a bus, each to its shard, in order; Ok once all are durable.
pub async fn append_to_bus(
    log: &dyn BusLog,
    bus: &str,
    records: Vec<(u32, Bytes)>,
) -> Result<(), TargetError> {
    let records: Vec<_> = records.into_iter().map(Some).collect();
    for result in crate::store::append::append(log, &records)
        .await
        .into_iter()
        .flatten()
    {
        match result {
            Err(e @ crate::store::StoreError::TooLarge(_)) => {
                return Err(TargetError::fatal(format!(
                    "appending to bus `{bus}` failed: {e}"
                )))
            }
            Err(e) => {
                return Err(TargetError::retryable(format!(
                    "appending to bus `{bus}` failed: {e}"
                )))
            }
            Ok(()) => {}
        }
    }
    Ok(())
}
