//! HTTP ingress: `POST /buses/{bus}/events` in any CloudEvents HTTP mode, health probes,
//! and the layers that bound the work a client can cause (size, time, concurrency).

pub mod cloudevent;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::{Path, Request, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde_json::{json, Value};
use tower::ServiceBuilder;

use crate::config::Limits;
use crate::problem::Problem;
use crate::runtime::cluster::Cluster;
use crate::store::{BusLog, ShardAppend, StoreError};
use cloudevent::{ContentMode, ErrorKind, EventError};

pub struct IngressState {
    /// Swapped as a whole when the configuration changes.
    buses: RwLock<Arc<HashMap<String, Arc<dyn BusLog>>>>,
    pub limits: Limits,
    pub cluster: Arc<dyn Cluster>,
}

impl IngressState {
    pub fn new(
        buses: HashMap<String, Arc<dyn BusLog>>,
        limits: Limits,
        cluster: Arc<dyn Cluster>,
    ) -> IngressState {
        IngressState {
            buses: RwLock::new(Arc::new(buses)),
            limits,
            cluster,
        }
    }

    pub fn buses(&self) -> Arc<HashMap<String, Arc<dyn BusLog>>> {
        self.buses.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_buses(&self, buses: HashMap<String, Arc<dyn BusLog>>) {
        *self.buses.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(buses);
    }
}

/// The HTTP application. Tests drive it with `oneshot`, the server with a socket.
pub fn router(state: Arc<IngressState>) -> Router {
    let limits = state.limits.clone();
    Router::new()
        .route(
            "/buses/{bus}/events",
            post(post_events).fallback(|m: Method| async move {
                Problem::method_not_allowed(m.as_str(), "POST")
            }),
        )
        .route(
            "/healthz",
            get(|| async { Json(json!({"status": "ok"})) }).fallback(get_only),
        )
        .route("/readyz", get(ready).fallback(get_only))
        .merge(crate::admin::routes())
        .fallback(|uri: Uri| async move { Problem::not_found(uri.path()) })
        .with_state(state)
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|_: tower::BoxError| async {
                    Problem::overloaded()
                }))
                .load_shed()
                .concurrency_limit(limits.max_concurrent_requests)
                .layer(middleware::from_fn_with_state(
                    limits.request_timeout,
                    request_timeout,
                )),
        )
}

async fn get_only(m: Method) -> Problem {
    Problem::method_not_allowed(m.as_str(), "GET, HEAD")
}

async fn request_timeout(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => Problem::request_timeout("limits.request_timeout").into_response(),
    }
}

async fn ready(State(state): State<Arc<IngressState>>) -> Response {
    if !state.cluster.healthy() {
        return Problem::unavailable("the cluster store (Redis) is not reachable", 2)
            .into_response();
    }
    let buses = state.buses();
    let failed: Vec<&str> = buses
        .iter()
        .filter(|(_, log)| !log.healthy())
        .map(|(name, _)| name.as_str())
        .collect();
    if failed.is_empty() {
        Json(json!({"status": "ready"})).into_response()
    } else {
        Problem::unavailable(
            format!(
                "the store cannot take writes for bus(es): {}",
                failed.join(", ")
            ),
            5,
        )
        .into_response()
    }
}

/// One entry of a request: a parsed event or the reason it was refused.
type Entry = Result<(String, Bytes, u32), EventError>;

async fn post_events(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    request: Request,
) -> Response {
    let Some(log) = state.buses().get(&bus).cloned() else {
        return Problem::unknown_bus(&bus).into_response();
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
    let body = match read_body(&parts.headers, body, limit, limit_name).await {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let shards = log.shards();
    let encode = |parsed: Result<cloudevent::Parsed, EventError>| -> Entry {
        let cloudevent::Parsed {
            event,
            stored: bytes,
        } = parsed?;
        if bytes.len() > limits.max_event_bytes {
            return Err(EventError::too_large(
                "limits.max_event_bytes",
                format!(
                    "the event is {} bytes; at most {} are accepted",
                    bytes.len(),
                    limits.max_event_bytes
                ),
            ));
        }
        let shard = shard_of(&cloudevent::partition_key(&event), shards);
        Ok((
            cloudevents::AttributesReader::id(&event).to_string(),
            Bytes::from(bytes),
            shard,
        ))
    };
    let entries: Vec<Entry> = match mode {
        ContentMode::Binary => vec![encode(cloudevent::from_binary(&parts.headers, &body))],
        ContentMode::Structured => vec![encode(
            cloudevent::from_structured(&body).and_then(cloudevent::Parsed::encode),
        )],
        ContentMode::Batch => match cloudevent::from_batch(&body, limits.max_batch_events) {
            Ok(events) => events
                .into_iter()
                .map(|e| encode(e.and_then(cloudevent::Parsed::encode)))
                .collect(),
            Err(e) => return event_problem(e).into_response(),
        },
    };
    if mode != ContentMode::Batch {
        if let Some(Err(e)) = entries.first() {
            return event_problem(e.clone()).into_response();
        }
    }
    let stored = store(log.as_ref(), &entries).await;
    respond(mode, entries, stored)
}

async fn read_body(
    headers: &http::HeaderMap,
    body: Body,
    limit: usize,
    limit_name: &str,
) -> Result<Bytes, Problem> {
    let too_large = |size: String| {
        Problem::too_large(
            limit_name,
            format!("the request body is {size}; at most {limit} bytes are accepted here"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared.filter(|len| *len > limit as u64) {
        return Err(too_large(format!("{len} bytes")));
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large("larger".to_string()))
        }
        Err(e) => Err(Problem::bad_request(
            "body",
            format!("the request body could not be read to its end: {e}"),
        )),
    }
}

/// Appends the valid entries, grouped by shard so each shard gets one append per request.
/// Returns, per entry, whether it was stored (`None` for entries that were invalid).
async fn store(log: &dyn BusLog, entries: &[Entry]) -> Vec<Option<Result<(), StoreError>>> {
    let mut by_shard: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, entry) in entries.iter().enumerate() {
        if let Ok((_, _, shard)) = entry {
            by_shard.entry(*shard).or_default().push(i);
        }
    }
    let groups: Vec<(u32, Vec<usize>)> = by_shard.into_iter().collect();
    let appends = groups
        .iter()
        .map(|(shard, indexes)| ShardAppend {
            shard: *shard,
            records: indexes
                .iter()
                .filter_map(|i| entries[*i].as_ref().ok().map(|(_, bytes, _)| bytes.clone()))
                .collect(),
        })
        .collect();
    let results = log.append(appends).await;
    let mut stored = vec![None; entries.len()];
    for ((_, indexes), result) in groups.iter().zip(results) {
        for i in indexes {
            stored[*i] = Some(result.as_ref().map(|_| ()).map_err(Clone::clone));
        }
    }
    stored
}

fn respond(
    mode: ContentMode,
    entries: Vec<Entry>,
    stored: Vec<Option<Result<(), StoreError>>>,
) -> Response {
    let mut failed = 0;
    let mut store_failures = 0;
    let results: Vec<Value> = entries
        .iter()
        .zip(&stored)
        .enumerate()
        .map(|(index, (entry, stored))| match (entry, stored) {
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

fn event_problem(e: EventError) -> Problem {
    match e.kind {
        ErrorKind::Invalid => Problem::invalid_event(e.field, e.message),
        ErrorKind::TooLarge => Problem::too_large(&e.field, e.message),
        ErrorKind::Unsupported => Problem::unsupported_media_type(e.message),
    }
}

fn store_problem(e: &StoreError) -> Problem {
    match e {
        StoreError::Busy(m) => Problem::unavailable(m.clone(), 1),
        StoreError::Unavailable(m) | StoreError::Corrupt(m) => Problem::unavailable(
            format!("the event could not be stored ({m}); nothing was kept"),
            5,
        ),
    }
}

/// The shard of a partition key: FNV-1a 64, stable across processes, versions and machines
/// (every replica must agree on it).
pub fn shard_of(key: &str, shards: u32) -> u32 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in key.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (hash % u64::from(shards.max(1))) as u32
}
