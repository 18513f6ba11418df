//! AWS EventBridge `PutEvents` (JSON 1.1 protocol) on `POST /` and `POST /aws`, so the AWS
//! SDKs (boto3, `@aws-sdk/client-eventbridge`, ...) pointed at this gateway with their
//! `endpoint_url` put events on its buses unchanged.
//!
//! Each entry becomes a CloudEvent (`id` a new UUID returned as `EventId`, `source` ←
//! `Source`, `type` ← `DetailType`, `time` ← `Time` or now, `data` ← `Detail`, extensions
//! `account`, `region`, `resources` (when there are any), and `traceparent` or
//! `awstraceheader` from `TraceHeader`) and takes the one accept path (`crate::ingress::accept`) into the bus
//! named by `EventBusName` (absent: `default`; a name or an event-bus ARN). A bus with
//! `aws.access_keys` takes only requests SigV4-signed by one of them (`sigv4.rs`); a bus
//! with neither those nor `auth.keys` takes any request, whatever signs it (SDKs always
//! sign); a bus with `auth.keys` only refuses PutEvents (its keys are not SigV4 keys).
//! Answers are AWS's: `{"FailedEntryCount","Entries"}` in request order, or a whole-request
//! error `{"__type","message"}` with `X-Amzn-ErrorType`.

use std::sync::Arc;

use axum::http::Method;
use axum::routing::post;
use axum::Router;

use crate::ingress::state::IngressState;
use crate::problem::Problem;

pub mod config;
mod put_events;

pub use config::{resolve_all, AccessKey, AwsBus, AwsConfig, DEFAULT_ACCOUNT, DEFAULT_REGION};
pub use put_events::{DEFAULT_BUS, MAX_ENTRIES, MAX_ENTRIES_BYTES};

use put_events::put_events;

pub(crate) fn routes() -> Router<Arc<IngressState>> {
    let method = || {
        post(put_events)
            .fallback(|m: Method| async move { Problem::method_not_allowed(m.as_str(), "POST") })
    };
    Router::new().route("/", method()).route("/aws", method())
}
