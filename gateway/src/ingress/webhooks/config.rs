//! How a webhook source is configured (`[[webhooks]]`, and webhook resources of the
//! catalog): its bus, verification, and how a request maps to a CloudEvent.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use toml::Spanned;

use crate::values::optional_duration;

/// The default replay window of a delivery id.
pub const DEFAULT_DEDUP_WINDOW: Duration = Duration::from_secs(24 * 3600);
/// The default tolerance of a signed timestamp.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------
// Configuration

/// `[[webhooks]]`: one webhook source.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub name: Spanned<String>,
    pub bus: String,
    pub verify: VerifyConfig,
    /// Where the event's `type` comes from (default: the preset's event name).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<TypeConfig>,
    /// Where the delivery id comes from (default: the preset's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<ValueConfig>,
    /// The event's `source` (default `/webhooks/{name}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Extension name → request header kept as that extension.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub extensions: BTreeMap<String, String>,
    /// How long a delivery id is remembered (`0s`: no deduplication).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "crate::values::ser_optional_duration"
    )]
    pub dedup_window: Option<Duration>,
    /// The public URL providers call (signed by twilio, square, hubspot).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Origins the `OPTIONS` handshake allows (empty: any).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_origins: Vec<String>,
    /// Requests per minute announced in `WebHook-Allowed-Rate`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_rate: Option<u32>,
    /// Verified requests per second this source takes (token bucket, shared by the
    /// cluster); more are answered `429` with `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<crate::ingress::ratelimit::RateLimitConfig>,
}

/// `verify = { preset = "...", secret = "..." }`.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct VerifyConfig {
    pub preset: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub secrets: Vec<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "optional_duration",
        serialize_with = "crate::values::ser_optional_duration"
    )]
    pub tolerance: Option<Duration>,
    // `hmac` and `api-key`:
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub algorithm: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signed: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_format: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TypeConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonpath: Option<String>,
    /// A fixed type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ValueConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jsonpath: Option<String>,
}
