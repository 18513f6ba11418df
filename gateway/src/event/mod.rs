//! An event as every layer sees it, at the bottom of the module tree: its stored form
//! (`stored`: the bytes the logs keep, the shard it belongs to) and its HTTP binding
//! (`http`: CloudEvents 1.0 binary, structured and batch mode, parsed with errors that name
//! the attribute). Ingress parses requests with `http` and writes `stored`; the runtime,
//! targets, sources and replays read `stored` back, and targets and sources use `http` for
//! the CloudEvents their peers send; targets read an event's attributes and data as text
//! (`text`), from the stored form where it can be read without decoding. None of them
//! imports anything else of the gateway.

pub mod http;
mod scan;
pub mod stored;
mod text;

pub use stored::*;
pub use text::{structured_text, DataText, EventText};
