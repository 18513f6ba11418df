//! Sluice: a CloudEvents HTTP gateway. Producers POST events; each accepted event is stored
//! durably in its bus's log before the `202`; rules match events and deliver them to targets.
//!
//! The modules follow the data flow: `ingress` → `store` (bus logs, positions) → `runtime`
//! (tasks that read, filter and deliver) → `targets`. Beneath them all, `event` is the
//! stored form of an event that each of them reads or writes.

// The RocketMQ client's futures are deep: the async bodies that hold them need a higher limit.
#![recursion_limit = "512"]

pub mod admin;
pub mod admission;
pub mod app;
pub mod bucket;
pub mod catalog;
pub mod config;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
pub mod ingress;
pub mod metrics;
#[cfg(feature = "otlp")]
pub mod otlp;
pub mod problem;
pub mod replay;
pub mod rules;
pub mod runtime;
pub mod scaling;
pub mod secrets;
pub mod server;
pub mod sources;
pub mod store;
pub mod targets;
pub mod values;
pub mod wasm;
