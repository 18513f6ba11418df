//! `POST /buses/{bus}/events`: CloudEvents in binary, structured or batch mode, checked
//! against the bus's keys, rate limits, schemas and dedup window, then stored.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::event::http::{self as cloudevent, ContentMode};
use crate::event::EventError;
use crate::ingress::accept::{
    discard_body, entry, event_problem, read_body, store, store_problem, store_unique, Entry,
};
use crate::ingress::state::{IngressState, Settings};
use crate::problem::Problem;
use crate::store::StoreError;

/// Records the request's metrics around the handler. Labels stay bounded: an unknown bus
/// is `bus="unknown"`, and the mode comes from a fixed set.
///
/// The request id is the caller's `X-Request-Id` when it is a sane token, else a new one;
/// the answer echoes it. The request's span (`request`, with the id, bus and mode) exists
/// only when something reads it: span export (`[tracing]`) or a log filter at `debug` for
/// the gateway, where every log line of the request carries its id. At `info` a request
/// that succeeds writes no log line, so the span would only cost.
pub(crate) async fn post_events(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    request: Request,
) -> Response {
    let started = std::time::Instant::now();
    let bytes = crate::ingress::accept::declared_length(request.headers());
    let mode = match cloudevent::content_mode(request.headers()) {
        Ok(ContentMode::Binary) => "binary",
        Ok(ContentMode::Structured) => "structured",
        Ok(ContentMode::Batch) => "batch",
        Err(_) => "other",
    };
    // Everything the request needs of the running catalog, read once.
    let settings = state.settings();
    let series = settings.series(&bus);
    let request_id = request_id(request.headers());
    let mut response = if wants_span() {
        let span = tracing::info_span!(
            "request",
            request_id = %request_id,
            bus = %if settings.buses.contains_key(&bus) { bus.as_str() } else { "unknown" },
            mode,
            traceparent = tracing::field::Empty
        );
        // The caller's trace, for the exported span to continue (read only when exporting).
        #[cfg(feature = "otlp")]
        if crate::otlp::enabled() {
            if let Some(parent) = request
                .headers()
                .get("traceparent")
                .and_then(|v| v.to_str().ok())
                .filter(|v| crate::event::http::valid_traceparent(v))
            {
                span.record("traceparent", parent);
            }
        }
        tracing::Instrument::instrument(handle_events(state, settings, bus, request), span).await
    } else {
        handle_events(state, settings, bus, request).await
    };
    if let Ok(value) = http::HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    series
        .mode(mode)
        .record(response.status().as_u16(), bytes, started.elapsed());
    response
}

/// The caller's `X-Request-Id` when it is a sane token (1 to 128 visible ASCII
/// characters), else a new random one.
pub(crate) fn request_id(headers: &http::HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("{:032x}", fastrand::u128(..)), str::to_string)
}

/// Whether a request's span is read by anyone: span export, or logs at `debug` for the
/// ingress (the callsite's interest is cached by `tracing`: a load and a compare).
pub(crate) fn wants_span() -> bool {
    #[cfg(feature = "otlp")]
    if crate::otlp::enabled() {
        return true;
    }
    tracing::enabled!(tracing::Level::DEBUG)
}

async fn handle_events(
    state: Arc<IngressState>,
    settings: Arc<Settings>,
    bus: String,
    request: Request,
) -> Response {
    let Some(log) = settings.buses.get(&bus).cloned() else {
        return Problem::unknown_bus(&bus).into_response();
    };
    let producer = match state.admit(&settings, &bus, request.headers()).await {
        Ok(producer) => producer,
        Err(problem) => return problem.into_response(),
    };
    let (parts, body) = request.into_parts();
    let mode = match cloudevent::content_mode(&parts.headers) {
        Ok(mode) => mode,
        Err(e) => return event_problem(e).into_response(),
    };
    let limits = &state.limits;
    let (limit, limit_name) = match mode {
        ContentMode::Batch => (limits.max_batch_bytes, "limits.max_batch_bytes"),
        _ => (limits.max_event_bytes, "limits.max_event_bytes"),
    };
    let Some(_memory) = state.reserve_memory(&parts.headers, limit, mode != ContentMode::Binary)
    else {
        discard_body(body, limit).await;
        return Problem::memory_full().into_response();
    };
    let body = match read_body(&parts.headers, body, limit, limit_name).await {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let shards = log.shards();
    let window = settings.dedup.get(&bus).copied();
    // The dedup key of each entry, when the bus opted in: a fixed-size hash of (bus,
    // producer key, `source`, `id`).
    let mut keys: Vec<Option<String>> = Vec::new();
    let schemas = settings.schemas.get(&bus);
    let mut encode = |parsed: Result<cloudevent::Parsed, EventError>| {
        let parsed = match &schemas {
            Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
            None => parsed,
        };
        keys.push(window.and(parsed.as_ref().ok()).map(|p| {
            let source = cloudevents::AttributesReader::source(&p.event).to_string();
            let id = cloudevents::AttributesReader::id(&p.event);
            crate::store::dedup::key(&["bus", &bus, &producer, &source, id])
        }));
        entry(parsed, shards, limits)
    };
    let entries: Vec<Entry> = match mode {
        ContentMode::Binary => vec![encode(cloudevent::from_binary(&parts.headers, &body))],
        ContentMode::Structured => vec![encode(
            cloudevent::from_structured(&body)
                .map(|mut e| {
                    cloudevent::inherit_trace_context(&mut e, &parts.headers);
                    e
                })
                .and_then(cloudevent::Parsed::encode),
        )],
        ContentMode::Batch => {
            // Entry by entry: one entry's JSON tree in memory at a time.
            let mut entries = Vec::new();
            let parsed = cloudevent::for_each_in_batch(&body, limits.max_batch_events, |e| {
                entries.push(encode(
                    e.map(|mut e| {
                        cloudevent::inherit_trace_context(&mut e, &parts.headers);
                        e
                    })
                    .and_then(cloudevent::Parsed::encode),
                ))
            });
            if let Err(e) = parsed {
                return event_problem(e).into_response();
            }
            entries
        }
    };
    if mode != ContentMode::Batch {
        if let Some(Err(e)) = entries.first() {
            return event_problem(e.clone()).into_response();
        }
    }
    let Some(window) = window else {
        let stored = store(log.as_ref(), &entries).await;
        return respond(mode, entries, stored, &[]);
    };
    let dedup = state.dedup();
    match store_unique(log.as_ref(), dedup.as_ref(), &entries, &keys, window).await {
        Ok((stored, duplicates)) => respond(mode, entries, stored, &duplicates),
        Err(e) => store_problem(&e).into_response(),
    }
}

fn respond(
    mode: ContentMode,
    entries: Vec<Entry>,
    stored: Vec<Option<Result<(), StoreError>>>,
    duplicates: &[bool],
) -> Response {
    // The common answer, everything accepted, written straight to bytes.
    let all_stored = entries.len() == stored.len()
        && stored.iter().all(|s| matches!(s, Some(Ok(()))))
        && !duplicates.iter().any(|d| *d);
    if all_stored {
        let ids = entries
            .iter()
            .filter_map(|e| e.as_ref().ok().map(|(id, _, _)| id.as_str()));
        return accepted(ids);
    }
    let mut failed = 0;
    let mut store_failures = 0;
    let results: Vec<Value> = entries
        .iter()
        .zip(&stored)
        .enumerate()
        .map(|(index, (entry, stored))| match (entry, stored) {
            (Ok((id, _, _)), _) if duplicates.get(index).copied().unwrap_or(false) => {
                json!({"id": id, "status": "duplicate"})
            }
            (Ok((id, _, _)), Some(Ok(()))) => json!({"id": id, "status": "accepted"}),
            (Ok((id, _, _)), Some(Err(e))) => {
                failed += 1;
                store_failures += 1;
                json!({"index": index, "id": id, "status": "failed", "error": store_problem(e)})
            }
            (Ok((id, _, _)), None) => {
                failed += 1;
                let problem = Problem::internal("the event was not handed to the store");
                json!({"index": index, "id": id, "status": "failed", "error": problem})
            }
            (Err(e), _) => {
                failed += 1;
                json!({"index": index, "status": "failed", "error": event_problem(e.clone())})
            }
        })
        .collect();
    let body = json!({"failedEntryCount": failed, "entries": results});
    if failed < entries.len() {
        return (StatusCode::ACCEPTED, Json(body)).into_response();
    }
    // Nothing was accepted: answer with the reason, and for a batch the per-entry results.
    let mut problem = if store_failures > 0 {
        let first = stored.iter().flatten().find_map(|r| r.as_ref().err());
        first.map_or_else(|| Problem::internal("nothing was stored"), store_problem)
    } else if mode == ContentMode::Batch {
        Problem::bad_request("entries", "no entry of the batch is a valid CloudEvent")
    } else {
        Problem::internal("the event was neither stored nor refused")
    };
    if mode == ContentMode::Batch {
        problem = problem.with_extra("failedEntryCount", json!(failed));
        problem = problem.with_extra("entries", body["entries"].clone());
    }
    problem.into_response()
}

/// `202` with every entry accepted: the body `respond` would build as a JSON tree,
/// written directly (`{"entries":[{"id":…,"status":"accepted"},…],"failedEntryCount":0}`).
fn accepted<'a>(ids: impl Iterator<Item = &'a str>) -> Response {
    let mut body = Vec::with_capacity(96);
    body.extend_from_slice(b"{\"entries\":[");
    for (i, id) in ids.enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(b"{\"id\":");
        // A string always serialises.
        let _ = serde_json::to_writer(&mut body, id);
        body.extend_from_slice(b",\"status\":\"accepted\"}");
    }
    body.extend_from_slice(b"],\"failedEntryCount\":0}");
    (
        StatusCode::ACCEPTED,
        [(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}
