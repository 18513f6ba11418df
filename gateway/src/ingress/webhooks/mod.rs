//! Webhook sources: `POST /webhooks/{name}` receives a provider's webhook, verifies its
//! signature (`verify`, `presets`), answers the provider's handshakes, drops replays of a
//! delivery id (`dedup`), and stores the request as one CloudEvent on the source's bus
//! through the same path as binary-mode ingress. Also the CloudEvents Web Hook
//! abuse-protection handshake (`OPTIONS`) for webhook sources and buses.

pub mod check;
pub mod config;
pub mod handler;
pub mod presets;
mod probe;
pub mod source;
pub mod verify;

pub use check::{check, check_catalog, check_catalog_policy, check_secrets_here};
pub use config::{WebhookConfig, DEFAULT_DEDUP_WINDOW, DEFAULT_TOLERANCE};
pub use handler::{bus_options, routes};
pub use source::{Origin, Webhook, Webhooks};
