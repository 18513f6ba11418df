//! Apache RocketMQ EventBridge's data plane, `POST /putEvents` (`EventDataController` of
//! `apache/rocketmq-eventbridge`): CloudEvents in binary, structured or batch mode, the bus
//! named by the `aliyuneventbusname` (or the open-source default `eventbusname`)
//! extension of the events, or by a header of that name (`ce-` prefixed or not). The
//! events take the one accept path (`ingress::accept`): the bus's keys, rate limits,
//! schemas, dedup and metrics (mode label `eventbridge`) apply as to
//! `POST /buses/{bus}/events`.
//!
//! The answer is the project's `PutEventsResponse`, as its SDK reads it (`sdk/main.dara`,
//! `PutEventsResponseBody`): `{requestId, code, message, failedEntryCount, entryList:
//! [{eventId, errorCode, errorMessage}]}`, `errorCode` `Success` for a stored event. A
//! whole request refused is its `BaseResponse` with the `EventBridgeErrorCode` name
//! (`EventBusNotExist`, `EventBusEmpty`, `PutEventsRequestMoreThanOneEventBus`: 409, as the
//! project) or, for the gateway's own limits, the status they always have (401, 413, 429,
//! 503 with `Retry-After`).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::event::http::{self as cloudevent, ContentMode};
use crate::event::{ErrorKind, EventError};
use crate::ingress::accept::{discard_body, entry, read_body, store, store_unique, Entry};
use crate::ingress::state::{IngressState, Settings};
use crate::problem::Problem;
use crate::store::StoreError;

/// The extensions (and headers) that name the bus: Alibaba Cloud's and the open-source
/// default (`AppConfigAPIImpl`: `eventbusname`).
const BUS_NAMES: [&str; 2] = ["aliyuneventbusname", "eventbusname"];

pub(crate) fn routes() -> Router<Arc<IngressState>> {
    Router::new().route("/putEvents", post(put_events))
}

/// A refusal of the whole request in the project's form.
struct Refusal {
    status: StatusCode,
    code: &'static str,
    message: String,
    retry_after: Option<u64>,
}

impl Refusal {
    /// An `EventBridgeErrorCode` / `EventErrorCode`: HTTP 409 in the project.
    fn new(code: &'static str, message: impl Into<String>) -> Refusal {
        Refusal {
            status: StatusCode::CONFLICT,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    fn respond(self, request_id: &str) -> Response {
        let mut response = (
            self.status,
            Json(json!({"requestId": request_id, "code": self.code, "message": self.message})),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(http::header::RETRY_AFTER, v);
            }
        }
        response
    }
}

/// A problem of the gateway (keys, limits, store) with its own status, in the project's form.
impl From<Problem> for Refusal {
    fn from(p: Problem) -> Refusal {
        let code = match p.status {
            400 => "EventInvalid",
            401 => "Unauthorized",
            403 => "Forbidden",
            413 => "EventSizeExceed",
            415 => "EventHTTPProtocolBindingInvalid",
            429 => "Throttling",
            _ => "InternalError",
        };
        Refusal {
            status: p.status(),
            code,
            message: p.detail,
            retry_after: p.retry_after,
        }
    }
}

/// An event refused: the project's `EventErrorCode` for it.
fn event_refusal(e: &EventError) -> Refusal {
    match e.kind {
        ErrorKind::TooLarge => Refusal {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: "EventSizeExceed",
            message: format!("{} ({})", e.message, e.field),
            retry_after: None,
        },
        ErrorKind::Unsupported => Refusal::new(
            "EventHTTPProtocolBindingInvalid",
            format!(
                "The event with http protocol binding is invalid: {}",
                e.message
            ),
        ),
        ErrorKind::Invalid => Refusal::new("EventInvalid", entry_message(e)),
    }
}

fn entry_message(e: &EventError) -> String {
    format!("The event is invalid: `{}`: {}", e.field, e.message)
}

async fn put_events(State(state): State<Arc<IngressState>>, request: Request) -> Response {
    let started = std::time::Instant::now();
    let bytes = crate::ingress::accept::declared_length(request.headers());
    let settings = state.settings();
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(new_request_id, str::to_string);
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        mode = "eventbridge",
        bus = tracing::field::Empty
    );
    let (bus, mut response) = tracing::Instrument::instrument(
        handle(state, settings.clone(), request, request_id.clone()),
        span,
    )
    .await;
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    // Labels stay bounded: a bus that is not served is `unknown`.
    let label = bus
        .filter(|b| settings.buses.contains_key(b))
        .unwrap_or_else(|| "unknown".to_string());
    crate::metrics::get().ingress(
        label,
        "eventbridge",
        response.status().as_u16(),
        bytes,
        started.elapsed(),
    );
    response
}

/// A request id shaped like the project's (`UUID.randomUUID()`): a random UUID.
pub(crate) fn new_request_id() -> String {
    let n = fastrand::u128(..);
    let n = (n & !(0xf << 76) | (0x4 << 76)) & !(0x3 << 62) | (0x2 << 62);
    let hex = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

/// The bus a header names, if one does.
fn header_bus(headers: &HeaderMap) -> Result<Option<String>, Refusal> {
    for name in BUS_NAMES {
        for header in [name.to_string(), format!("ce-{name}")] {
            if let Some(value) = headers.get(header.as_str()) {
                let bus = value
                    .to_str()
                    .ok()
                    .and_then(|v| percent_encoding::percent_decode_str(v).decode_utf8().ok())
                    .map(|v| v.trim().to_string())
                    .ok_or_else(|| {
                        Refusal::new(
                            "EventBusNameInvalid",
                            format!("The event bus name in header `{header}` is not UTF-8"),
                        )
                    })?;
                return Ok(Some(bus));
            }
        }
    }
    Ok(None)
}

/// The bus an event names in its extension, if it does.
fn event_bus(event: &cloudevents::Event) -> Option<String> {
    BUS_NAMES.iter().find_map(|name| {
        cloudevents::event::ExtensionValue::to_string(event.extension(name)?)
            .trim()
            .to_string()
            .into()
    })
}

/// The content mode; `application/json` without `ce-*` headers is read by its body's
/// shape (an object: structured, an array: batch), as the project's clients send it.
fn mode_of(headers: &HeaderMap) -> Result<Option<ContentMode>, EventError> {
    match cloudevent::content_mode(headers) {
        Ok(mode) => Ok(Some(mode)),
        Err(e) if e.kind == ErrorKind::Unsupported => {
            let json = headers
                .get(http::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(cloudevent::essence)
                .is_some_and(|ct| ct == "application/json" || ct.ends_with("+json"));
            if json {
                Ok(None)
            } else {
                Err(e)
            }
        }
        Err(e) => Err(e),
    }
}

async fn handle(
    state: Arc<IngressState>,
    settings: Arc<Settings>,
    request: Request,
    request_id: String,
) -> (Option<String>, Response) {
    let (parts, body) = request.into_parts();
    let named = match header_bus(&parts.headers) {
        Ok(named) => named,
        Err(refusal) => return (None, refusal.respond(&request_id)),
    };
    let mode = match mode_of(&parts.headers) {
        Ok(mode) => mode,
        Err(e) => return (named, event_refusal(&e).respond(&request_id)),
    };
    let limits = &state.limits;
    let (limit, limit_name) = match mode {
        Some(ContentMode::Binary) | Some(ContentMode::Structured) => {
            (limits.max_event_bytes, "limits.max_event_bytes")
        }
        _ => (limits.max_batch_bytes, "limits.max_batch_bytes"),
    };
    let Some(_memory) =
        state.reserve_memory(&parts.headers, limit, mode != Some(ContentMode::Binary))
    else {
        discard_body(body, limit).await;
        return (
            named,
            Refusal::from(Problem::memory_full()).respond(&request_id),
        );
    };
    let body = match read_body(&parts.headers, body, limit, limit_name).await {
        Ok(body) => body,
        Err(problem) => return (named, Refusal::from(problem).respond(&request_id)),
    };
    let mode = mode.unwrap_or_else(|| match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => ContentMode::Batch,
        _ => ContentMode::Structured,
    });
    // Every event parsed and encoded first: the bus may be named inside them.
    let parsed: Vec<Result<cloudevent::Parsed, EventError>> = match mode {
        ContentMode::Binary => vec![cloudevent::from_binary(&parts.headers, &body)],
        ContentMode::Structured => vec![cloudevent::from_structured(&body)
            .map(|mut e| {
                cloudevent::inherit_trace_context(&mut e, &parts.headers);
                e
            })
            .and_then(cloudevent::Parsed::encode)],
        ContentMode::Batch => {
            let mut events = Vec::new();
            let result = cloudevent::for_each_in_batch(&body, limits.max_batch_events, |e| {
                events.push(
                    e.map(|mut e| {
                        cloudevent::inherit_trace_context(&mut e, &parts.headers);
                        e
                    })
                    .and_then(cloudevent::Parsed::encode),
                )
            });
            if let Err(e) = result {
                return (named, event_refusal(&e).respond(&request_id));
            }
            events
        }
    };
    if mode != ContentMode::Batch {
        if let Some(Err(e)) = parsed.first() {
            return (named, event_refusal(e).respond(&request_id));
        }
    }
    // One bus per request (`PutEventsRequestMoreThanOneEventBus`), named by the header or
    // by the events; an event that names none goes to the request's bus.
    let mut bus = named.clone();
    for p in parsed.iter().flatten() {
        let Some(own) = event_bus(&p.event) else {
            continue;
        };
        match &bus {
            Some(b) if *b != own => {
                let shown: String = format!("{b}, {own}").chars().take(300).collect();
                return (
                    Some(b.clone()),
                    Refusal::new(
                        "PutEventsRequestMoreThanOneEventBus",
                        format!("The put events request has more than one  event bus [{shown}] "),
                    )
                    .respond(&request_id),
                );
            }
            Some(_) => {}
            None => bus = Some(own),
        }
    }
    let Some(bus) = bus.filter(|b| !b.is_empty()) else {
        return (
            None,
            Refusal::new(
                "EventBusEmpty",
                "The event bus is empty. Name it with the `aliyuneventbusname` extension or header.",
            )
            .respond(&request_id),
        );
    };
    tracing::Span::current().record("bus", bus.as_str());
    let response = accept(
        &state,
        &settings,
        &bus,
        &parts.headers,
        parsed,
        mode,
        &request_id,
    )
    .await
    .unwrap_or_else(|refusal| refusal.respond(&request_id));
    (Some(bus), response)
}

/// Checks the request against the bus's keys and rate limits, then stores its events.
async fn accept(
    state: &IngressState,
    settings: &Settings,
    bus: &str,
    headers: &HeaderMap,
    parsed: Vec<Result<cloudevent::Parsed, EventError>>,
    mode: ContentMode,
    request_id: &str,
) -> Result<Response, Refusal> {
    let Some(log) = settings.buses.get(bus).cloned() else {
        let shown: String = bus.chars().take(128).collect();
        return Err(Refusal::new(
            "EventBusNotExist",
            format!("The event bus [{shown}] not existed!"),
        ));
    };
    let producer = state.admit(settings, bus, headers).await?;
    let limits = &state.limits;
    let shards = log.shards();
    let window = settings.dedup.get(bus).copied();
    let schemas = settings.schemas.get(bus);
    let mut keys: Vec<Option<String>> = Vec::with_capacity(parsed.len());
    let entries: Vec<Entry> = parsed
        .into_iter()
        .map(|p| {
            let p = match &schemas {
                Some(schemas) => p.and_then(|p| schemas.check(&p).map(|()| p)),
                None => p,
            };
            keys.push(window.and(p.as_ref().ok()).map(|p| {
                let source = cloudevents::AttributesReader::source(&p.event).to_string();
                let id = cloudevents::AttributesReader::id(&p.event);
                crate::store::dedup::key(&["bus", bus, &producer, &source, id])
            }));
            entry(p, shards, limits)
        })
        .collect();
    if mode != ContentMode::Batch {
        if let Some(Err(e)) = entries.first() {
            return Err(event_refusal(e));
        }
    }
    let (stored, duplicates) = match window {
        None => (store(log.as_ref(), &entries).await, Vec::new()),
        Some(window) => {
            let dedup = state.dedup();
            store_unique(log.as_ref(), dedup.as_ref(), &entries, &keys, window)
                .await
                .map_err(|e| Refusal::from(crate::ingress::accept::store_problem(&e)))?
        }
    };
    respond(&entries, &stored, &duplicates, request_id)
}

/// The project's `PutEventsResponse`, in request order.
fn respond(
    entries: &[Entry],
    stored: &[Option<Result<(), StoreError>>],
    duplicates: &[bool],
    request_id: &str,
) -> Result<Response, Refusal> {
    let mut failed = 0;
    let mut store_failure: Option<&StoreError> = None;
    let list: Vec<Value> = entries
        .iter()
        .enumerate()
        .map(|(i, entry)| match (entry, stored.get(i).and_then(Option::as_ref)) {
            (Ok((id, _, _)), _) if duplicates.get(i).copied().unwrap_or(false) => json!({
                "eventId": id,
                "errorCode": "Success",
                "errorMessage": "duplicate: this event was stored already within the bus's dedup window",
            }),
            (Ok((id, _, _)), Some(Ok(()))) => {
                json!({"eventId": id, "errorCode": "Success", "errorMessage": null})
            }
            (Ok((id, _, _)), Some(Err(e))) => {
                failed += 1;
                store_failure.get_or_insert(e);
                json!({"eventId": id, "errorCode": "InternalError", "errorMessage": e.to_string()})
            }
            (Ok((id, _, _)), None) => {
                failed += 1;
                json!({"eventId": id, "errorCode": "InternalError", "errorMessage": "the event was not handed to the store"})
            }
            (Err(e), _) => {
                failed += 1;
                let refusal = event_refusal(e);
                json!({"eventId": null, "errorCode": refusal.code, "errorMessage": refusal.message})
            }
        })
        .collect();
    // Nothing kept because the store failed: the whole request, retryable.
    if failed == entries.len() {
        if let Some(e) = store_failure {
            return Err(crate::ingress::accept::store_problem(e).into());
        }
    }
    Ok((
        StatusCode::OK,
        Json(json!({
            "requestId": request_id,
            "code": "Success",
            "message": "success",
            "failedEntryCount": failed,
            "entryList": list,
        })),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bus_is_read_from_either_header_spelling() {
        let mut headers = HeaderMap::new();
        assert!(matches!(header_bus(&headers), Ok(None)));
        headers.insert("ce-eventbusname", HeaderValue::from_static("demo-bus"));
        assert_eq!(
            header_bus(&headers).ok().flatten().as_deref(),
            Some("demo-bus")
        );
        headers.insert("aliyuneventbusname", HeaderValue::from_static("orders"));
        assert_eq!(
            header_bus(&headers).ok().flatten().as_deref(),
            Some("orders")
        );
    }

    #[test]
    fn plain_json_is_read_by_its_shape() {
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json; charset=UTF-8"),
        );
        assert!(matches!(mode_of(&headers), Ok(None)));
        headers.insert("ce-specversion", HeaderValue::from_static("1.0"));
        assert!(matches!(mode_of(&headers), Ok(Some(ContentMode::Binary))));
        let mut text = HeaderMap::new();
        text.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain"),
        );
        assert!(mode_of(&text).is_err());
    }
}
