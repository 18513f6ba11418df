//! HTTP ingress: `POST /buses/{bus}/events` in any CloudEvents HTTP mode, the probes, and
//! the one path by which a request's events are stored (`accept`). What a request needs
//! of the running catalog is one `Settings` snapshot (`state`); the application mounts the
//! routes (`crate::app::router`) behind the limits that bound the work a client can cause.

pub mod accept;
pub mod auth;
pub mod compat;
pub mod events;
pub mod limits;
pub mod probes;
pub mod ratelimit;
pub mod schema;
pub mod state;
pub mod webhooks;

pub use state::{IngressState, Settings};
