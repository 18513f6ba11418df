//! A subscription's transform chain applied to stored events: the built-in steps on the
//! shard's reader as each record is handed out (`prepare`), user functions on a blocking
//! thread for a whole batch (`run_functions`, `through_functions`), for live delivery and
//! for replays alike.

use std::sync::Arc;

use bytes::Bytes;
use cloudevents::{AttributesReader, Event};
use sluice_functions::{Output, TextOutput, TransformChain};
use tokio::sync::watch;

use crate::event;
use crate::runtime::plan::Subscription;
use crate::store::Seq;
use crate::targets::{Body, Envelope};

/// The envelope a subscription delivers for one record: the record as stored, or the
/// transform chain's result. `None` when the transform fails on this event (reported; it
/// cannot succeed on a retry).
pub(crate) fn prepare(
    sub: &Subscription,
    shard: u32,
    seq: Seq,
    payload: &Bytes,
    accepted_ms: u64,
    event: Option<&Event>,
) -> Option<Envelope> {
    let Some(chain) = &sub.transform else {
        return Some(Envelope {
            raw: payload.clone(),
            accepted_ms,
            event: event.cloned(),
            body: None,
        });
    };
    if chain.calls_functions() {
        // User functions run on the lane's task, on a blocking thread (`run_functions`),
        // never here on the shard's reader. A chain of functions alone reads the stored
        // text, not the event; one that does not decode is dead-lettered there.
        return Some(Envelope {
            raw: payload.clone(),
            accepted_ms,
            event: event.filter(|_| !chain.calls_only_functions()).cloned(),
            body: None,
        });
    }
    let Some(event) = event else {
        tracing::error!(subscription = %sub.id, shard, seq, "the event does not decode, so it cannot be transformed; skipping it");
        return None;
    };
    let output = chain.apply(event).map_err(|e| e.to_string());
    match output.and_then(|o| output_envelope(o, payload, accepted_ms, Some(event))) {
        Ok(envelope) => Some(envelope),
        Err(e) => {
            tracing::error!(subscription = %sub.id, shard, seq, error = %e, "the transform failed on this event; skipping it");
            None
        }
    }
}

/// What a subscription delivers for one output of its chain.
fn output_envelope(
    output: Output,
    payload: &Bytes,
    accepted_ms: u64,
    event: Option<&Event>,
) -> Result<Envelope, String> {
    match output {
        Output::Event(transformed) => match event::encode(&transformed) {
            Ok(raw) => Ok(Envelope {
                raw: raw.into(),
                accepted_ms,
                event: Some(transformed),
                body: None,
            }),
            Err(e) => Err(format!("cannot encode a transformed event: {e}")),
        },
        Output::Body {
            content_type,
            bytes,
        } => Ok(Envelope {
            raw: payload.clone(),
            accepted_ms,
            event: event.cloned(),
            body: Some(Body {
                content_type,
                bytes: bytes.into(),
            }),
        }),
    }
}

/// What a batch made through a chain that calls functions: the envelopes to deliver, and
/// the events the chain refused with why.
pub(crate) type Ran = (Vec<Envelope>, Vec<(Envelope, String)>);

/// A chain that calls user functions, applied to envelopes holding the stored events (see
/// `prepare`): the envelopes to deliver (none for an event a function dropped, several
/// for one it fanned out, in order) and the events the chain refused, with why. Blocks for
/// as long as the functions run: call it on a blocking thread. `None` when `stop` moved
/// before the batch was done (its events stay pending: a stopping gateway does not wait
/// for a batch of slow calls).
pub(crate) fn run_functions(
    chain: &TransformChain,
    envelopes: Vec<Envelope>,
    stop: &watch::Receiver<bool>,
) -> Option<Ran> {
    let host = crate::wasm::Host::default();
    let text_path = chain.calls_only_functions();
    let mut ready = Vec::with_capacity(envelopes.len());
    let mut refused = Vec::new();
    for envelope in envelopes {
        if *stop.borrow() {
            return None;
        }
        let text = if text_path {
            event::structured_text(&envelope.raw)
        } else {
            None
        };
        let made = match text {
            Some(text) => run_on_text(chain, text, &envelope, &host),
            None => run_on_event(chain, &envelope, &host),
        };
        match made {
            Ok(made) => ready.extend(made),
            Err(why) => refused.push((envelope, why)),
        }
    }
    Some((ready, refused))
}

/// A chain of functions alone on the stored text (when it is the text a function gets):
/// an event every function returned unchanged is delivered as stored, unread.
fn run_on_text(
    chain: &TransformChain,
    text: &str,
    envelope: &Envelope,
    host: &crate::wasm::Host,
) -> Result<Vec<Envelope>, String> {
    let event_id =
        || event::decode(&envelope.raw).map_or_else(|_| "?".into(), |e| e.id().to_string());
    let outputs = chain
        .apply_text(text, &event_id, host)
        .map_err(|e| e.to_string())?;
    outputs
        .into_iter()
        .map(|o| match o {
            TextOutput::Unchanged => Ok(Envelope {
                raw: envelope.raw.clone(),
                accepted_ms: envelope.accepted_ms,
                event: envelope.event.clone(),
                body: None,
            }),
            TextOutput::Changed(o) => output_envelope(
                o,
                &envelope.raw,
                envelope.accepted_ms,
                envelope.event.as_ref(),
            ),
        })
        .collect()
}

/// A chain on the decoded event (decoded here when the reader did not).
fn run_on_event(
    chain: &TransformChain,
    envelope: &Envelope,
    host: &crate::wasm::Host,
) -> Result<Vec<Envelope>, String> {
    let decoded;
    let event = match envelope.event.as_ref() {
        Some(event) => event,
        None => {
            decoded = event::decode(&envelope.raw)
                .map_err(|e| format!("the stored event does not decode: {e}"))?;
            &decoded
        }
    };
    chain
        .apply_all(event, host)
        .map_err(|e| e.to_string())?
        .into_iter()
        .map(|o| output_envelope(o, &envelope.raw, envelope.accepted_ms, Some(event)))
        .collect()
}

/// Runs a chain that calls user functions on a batch, once every function it calls is
/// loaded on this replica: on a blocking thread (a function may take its whole time limit;
/// the caller's other work goes on), at most `wasm::running()` batches at once. `Ok(None)`
/// when `stop` moved first; an error when a function cannot be loaded.
pub(crate) async fn through_functions(
    chain: &Arc<TransformChain>,
    envelopes: Vec<Envelope>,
    stop: watch::Receiver<bool>,
) -> Result<Option<Ran>, String> {
    let names: Vec<&str> = chain.functions().collect();
    if !crate::wasm::registry().ready(&names, stop.clone()).await? {
        return Ok(None);
    }
    let Ok(_running) = crate::wasm::running().acquire().await else {
        return Ok(None);
    };
    let run = chain.clone();
    tokio::task::spawn_blocking(move || run_functions(&run, envelopes, &stop))
        .await
        .map_err(|e| format!("running the functions failed: {e}"))
}
