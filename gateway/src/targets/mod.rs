//! Targets: where matched events go. One module per target behind one small trait; each
//! target's config is turned into the running thing by `build`.

mod file;
mod log;

use std::sync::Arc;

use async_trait::async_trait;
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

#[async_trait]
pub trait Target: Send + Sync + 'static {
    /// Delivers a batch, in order. `Ok` means every event of it is delivered (and, for
    /// targets that can say so, durable), so the position may move past the batch.
    async fn deliver(&self, events: &[Event]) -> Result<(), TargetError>;

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

/// One JSON line per event, in CloudEvents structured form.
pub fn json_lines(events: &[Event]) -> Result<Vec<u8>, TargetError> {
    let mut out = Vec::with_capacity(events.len() * 512);
    for event in events {
        serde_json::to_writer(&mut out, event).map_err(|e| TargetError {
            message: format!("cannot encode event: {e}"),
            retryable: false,
        })?;
        out.push(b'\n');
    }
    Ok(out)
}
