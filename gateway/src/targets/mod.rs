//! Targets: where matched events go. One module per target behind one small trait; each
//! target's config is turned into the running thing by `build`.

mod file;
mod log;

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use cloudevents::Event;

use crate::config::{Config, TargetConfig};

pub use file::FileTarget;
pub use log::LogTarget;

/// A failed delivery. `retryable` says whether trying the same events again may succeed.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct TargetError {
    pub message: String,
    pub retryable: bool,
}

impl TargetError {
    pub fn retryable(message: impl Into<String>) -> Self {
        TargetError {
            message: message.into(),
            retryable: true,
        }
    }
}

/// An event on its way to a target: its structured JSON form and, when something needed to
/// look inside it, the decoded event. A transform may have turned it into a raw `body`,
/// which then replaces the event for targets that send bodies.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub raw: Bytes,
    pub event: Option<Event>,
    pub body: Option<Body>,
}

/// A raw body produced by a transform.
#[derive(Debug, Clone)]
pub struct Body {
    pub content_type: String,
    pub bytes: Bytes,
}

#[async_trait]
pub trait Target: Send + Sync + 'static {
    /// Delivers a batch, in order. `Ok` means every event of it is delivered (and, for
    /// targets that can say so, durable), so the position may move past the batch.
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError>;

    /// Short description for logs and status.
    fn describe(&self) -> String;
}

/// Builds the running target for a configured one.
pub fn build(config: &Config, target: &TargetConfig) -> Result<Arc<dyn Target>, TargetError> {
    Ok(match target {
        TargetConfig::Log(_) => Arc::new(LogTarget::new()),
        TargetConfig::File(file) => Arc::new(FileTarget::open(
            &config.expand_path(&file.path),
            config.durability,
        )?),
    })
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
