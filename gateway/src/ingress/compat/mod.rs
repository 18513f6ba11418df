//! The APIs producers already call, served by the same buses: AWS EventBridge `PutEvents`
//! (`aws.rs`), Apache RocketMQ EventBridge's `/putEvents` (`eventbridge.rs`) and the
//! Knative broker ingress (`knative.rs`). Each maps its requests onto CloudEvents and takes
//! the one accept path (`crate::ingress::accept`), so keys, rate limits, dedup, schemas and
//! metrics apply as they do to `POST /buses/{bus}/events`.

use std::sync::Arc;

use axum::Router;

use crate::ingress::state::IngressState;

pub mod aws;
pub mod eventbridge;
pub mod knative;
pub mod sigv4;

/// The routes of the three APIs, mounted behind the limits of `[limits]`.
pub fn routes() -> Router<Arc<IngressState>> {
    Router::new()
        .merge(aws::routes())
        .merge(eventbridge::routes())
        .merge(knative::routes())
}
