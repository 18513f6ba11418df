//! `[limits]`: how much one request, one event and all requests at once may take, and how
//! long the server waits for them.

use std::time::Duration;

use serde::Deserialize;

use crate::values::duration;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Largest single event, in bytes of its structured JSON form (EventBridge: 256 KiB).
    pub max_event_bytes: usize,
    /// Most entries in one batch-mode request.
    pub max_batch_events: usize,
    /// Largest batch-mode request body.
    pub max_batch_bytes: usize,
    /// Largest request head (request line and headers).
    pub max_header_bytes: usize,
    /// Time to receive the whole request and answer it.
    #[serde(deserialize_with = "duration")]
    pub request_timeout: Duration,
    /// Time a kept-alive connection may sit without a new request.
    #[serde(deserialize_with = "duration")]
    pub idle_timeout: Duration,
    /// Requests served at once; more are shed with `503` at once rather than queued.
    pub max_concurrent_requests: usize,
    /// Memory that requests being read, parsed and stored may take at once, counted as
    /// twice the body (the body and the stored events) plus, for JSON bodies, 16 times the
    /// largest event's text (a JSON tree is up to that much larger than its text). A request
    /// that does not fit is shed with `503` and `Retry-After` rather than queued.
    pub max_inflight_bytes: usize,
    /// After SIGTERM: how long `/readyz` answers 503 (so load balancers stop sending) while
    /// requests are still accepted, before the listener closes and in-flight requests
    /// finish. 0 closes at once (Kubernetes: the `preStop` hook does the waiting).
    #[serde(deserialize_with = "duration")]
    pub shutdown_delay: Duration,
    /// Memory the deduplication records may take (webhook delivery ids, events of buses
    /// with a `dedup_window`): standalone in the process, distributed in Redis per
    /// deduplicating bus (split between its shards); past it the oldest records are
    /// dropped before their window ends (a late duplicate of one is stored again).
    pub max_dedup_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_event_bytes: 256 * 1024,
            max_batch_events: 100,
            max_batch_bytes: 1024 * 1024,
            max_header_bytes: 16 * 1024,
            request_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            max_concurrent_requests: 1024,
            max_inflight_bytes: 256 * 1024 * 1024,
            shutdown_delay: Duration::ZERO,
            max_dedup_bytes: crate::store::dedup::DEFAULT_MAX_BYTES,
        }
    }
}
