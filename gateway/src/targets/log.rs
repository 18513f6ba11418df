//! The `log` target: one JSON line per event on standard output.

use std::io::Write;

use async_trait::async_trait;

use crate::targets::target::{json_lines, Envelope, Target, TargetError};

pub struct LogTarget;

impl LogTarget {
    pub fn new() -> Self {
        LogTarget
    }
}

impl Default for LogTarget {
    fn default() -> Self {
        LogTarget::new()
    }
}

#[async_trait]
impl Target for LogTarget {
    async fn deliver(&self, events: &[Envelope]) -> Result<(), TargetError> {
        let lines = json_lines(events);
        tokio::task::spawn_blocking(move || {
            let mut out = std::io::stdout().lock();
            out.write_all(&lines).and_then(|_| out.flush())
        })
        .await
        .map_err(|e| TargetError::retryable(format!("stdout task failed: {e}")))?
        .map_err(|e| TargetError::retryable(format!("cannot write to stdout: {e}")))
    }

    fn describe(&self) -> String {
        "log (stdout)".to_string()
    }
}
