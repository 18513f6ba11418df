//! HTTP ingress: `POST /buses/{bus}/events` in any CloudEvents HTTP mode, health probes,
//! and the layers that bound the work a client can cause (size, time, concurrency).

pub mod auth;
pub mod cloudevent;
pub mod ratelimit;
pub mod schema;

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
use crate::event::{check_stored, partition_key, shard_of, ErrorKind, EventError};
use crate::problem::Problem;
use crate::store::cluster::Cluster;
use crate::store::{BusLog, ShardAppend, StoreError, Unique};
use cloudevent::ContentMode;

pub struct IngressState {
    /// Swapped as a whole when the configuration changes.
    buses: RwLock<Arc<HashMap<String, Arc<dyn BusLog>>>>,
    /// The connectors of the running configuration and their number of tasks (the admin
    /// API refuses to act on anything else).
    connectors: RwLock<Arc<HashMap<String, u32>>>,
    /// The webhook sources (`POST /webhooks/{name}`) and their dedup store.
    webhooks: RwLock<Arc<crate::webhooks::Webhooks>>,
    /// The dedup window of each bus that opted in to CloudEvents deduplication.
    bus_dedup: RwLock<Arc<HashMap<String, Duration>>>,
    /// The accepted keys of each bus that requires one.
    bus_auth: RwLock<Arc<HashMap<String, Arc<auth::KeySet>>>>,
    /// The JSON Schemas of each bus that has some.
    schemas: RwLock<Arc<HashMap<String, Arc<schema::BusSchemas>>>>,
    /// The rate limit of each bus that has one.
    bus_rate: RwLock<Arc<HashMap<String, ratelimit::RateLimitConfig>>>,
    /// Where the rate-limit buckets live: this process, or Redis (distributed).
    limiter: RwLock<Arc<dyn ratelimit::Limiter>>,
    pub limits: Limits,
    pub cluster: Arc<dyn Cluster>,
    /// Set when shutdown starts: readiness fails from then on.
    draining: std::sync::atomic::AtomicBool,
    /// Read (never written) by the scaling signal.
    positions: RwLock<Option<Arc<dyn crate::store::PositionStore>>>,
    pub scaling: crate::scaling::History,
    /// The running plan (what the admin API reports on).
    plan: RwLock<Option<Arc<crate::runtime::Plan>>>,
    /// The catalog and the admin API's credentials.
    admin: RwLock<Option<(crate::catalog::Catalog, Arc<crate::api::AdminAuth>)>>,
    /// What the admin API checks before it accepts a change: that this replica can build it.
    admission: RwLock<Option<Arc<crate::admission::Admission>>>,
    /// Where replay statuses are kept, and the cancel switch of each replay running here.
    pub replays: RwLock<Arc<dyn crate::replay::ReplayStore>>,
    pub replay_cancels: crate::replay::Cancels,
    /// `limits.max_inflight_bytes`, in KiB: what requests being handled may hold.
    memory: Arc<tokio::sync::Semaphore>,
}

impl IngressState {
    pub fn new(
        buses: HashMap<String, Arc<dyn BusLog>>,
        limits: Limits,
        cluster: Arc<dyn Cluster>,
    ) -> IngressState {
        IngressState {
            buses: RwLock::new(Arc::new(buses)),
            connectors: RwLock::new(Arc::new(HashMap::new())),
            webhooks: RwLock::new(Arc::new(crate::webhooks::Webhooks::empty())),
            bus_dedup: RwLock::new(Arc::new(HashMap::new())),
            bus_auth: RwLock::new(Arc::new(HashMap::new())),
            bus_rate: RwLock::new(Arc::new(HashMap::new())),
            schemas: RwLock::new(Arc::new(HashMap::new())),
            limiter: RwLock::new(Arc::new(ratelimit::LocalLimiter::default())),
            cluster,
            draining: std::sync::atomic::AtomicBool::new(false),
            positions: RwLock::new(None),
            scaling: crate::scaling::History::default(),
            plan: RwLock::new(None),
            admin: RwLock::new(None),
            admission: RwLock::new(None),
            replays: RwLock::new(Arc::new(crate::replay::LocalReplays::default())),
            replay_cancels: std::sync::Mutex::new(HashMap::new()),
            memory: Arc::new(tokio::sync::Semaphore::new(
                limits.max_inflight_bytes.div_ceil(1024),
            )),
            limits,
        }
    }

    /// Reserves what a request with this body may take while it is read, parsed and
    /// stored (see `limits.max_inflight_bytes`): twice the body, plus 16 times the largest
    /// event's text when the body is parsed into a JSON tree. A body of unknown length is
    /// counted at its limit. `None` when it does not fit: the request is to be shed
    /// ([`Problem::memory_full`]).
    pub(crate) fn reserve_memory(
        &self,
        headers: &http::HeaderMap,
        limit: usize,
        json_tree: bool,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let body = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(limit, |len| len.min(limit));
        let tree = if json_tree {
            body.min(self.limits.max_event_bytes).saturating_mul(16)
        } else {
            0
        };
        let total = self.limits.max_inflight_bytes.div_ceil(1024);
        // One request alone always fits, whatever the limits.
        let kib = (body.saturating_mul(2).saturating_add(tree))
            .div_ceil(1024)
            .clamp(1, total.max(1));
        let kib = u32::try_from(kib).unwrap_or(u32::MAX);
        self.memory.clone().try_acquire_many_owned(kib).ok()
    }

    /// Takes a new plan: its buses, connectors and the buses' ingress settings.
    pub fn set_plan(&self, plan: &Arc<crate::runtime::Plan>) {
        self.set_buses(plan.logs.clone());
        self.set_connectors(plan.connectors());
        self.set_bus_dedup(plan.dedup.clone());
        self.set_bus_auth(plan.auth.clone());
        self.set_bus_rate_limits(plan.rate_limits.clone());
        // The catalog's webhook sources, rebuilt only when they changed.
        let same = |a: &[crate::webhooks::WebhookConfig], b: &[crate::webhooks::WebhookConfig]| {
            serde_json::to_value(a).ok() == serde_json::to_value(b).ok()
        };
        if !self
            .plan()
            .is_some_and(|p| same(&p.webhooks, &plan.webhooks))
        {
            self.set_webhooks(self.webhooks().with_catalog(&plan.webhooks));
        }
        *self.plan.write().unwrap_or_else(|p| p.into_inner()) = Some(plan.clone());
    }

    /// The running plan.
    pub fn plan(&self) -> Option<Arc<crate::runtime::Plan>> {
        self.plan.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_admin(&self, catalog: crate::catalog::Catalog, auth: crate::api::AdminAuth) {
        *self.admin.write().unwrap_or_else(|p| p.into_inner()) = Some((catalog, Arc::new(auth)));
    }

    /// The catalog and the admin credentials (set once the gateway runs).
    pub fn admin(&self) -> Option<(crate::catalog::Catalog, Arc<crate::api::AdminAuth>)> {
        self.admin.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_admission(&self, admission: crate::admission::Admission) {
        *self.admission.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(admission));
    }

    /// The checks of catalog changes on this replica (set once the gateway runs).
    pub fn admission(&self) -> Option<Arc<crate::admission::Admission>> {
        self.admission
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Shutdown started: `/readyz` answers 503 from now on.
    pub fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn set_positions(&self, positions: Arc<dyn crate::store::PositionStore>) {
        *self.positions.write().unwrap_or_else(|p| p.into_inner()) = Some(positions);
    }

    pub fn positions(&self) -> Option<Arc<dyn crate::store::PositionStore>> {
        self.positions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The connectors of the running configuration, with their number of tasks.
    pub fn connectors(&self) -> Arc<HashMap<String, u32>> {
        self.connectors
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set_connectors(&self, connectors: HashMap<String, u32>) {
        *self.connectors.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(connectors);
    }

    pub fn webhooks(&self) -> Arc<crate::webhooks::Webhooks> {
        self.webhooks
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn set_webhooks(&self, webhooks: crate::webhooks::Webhooks) {
        *self.webhooks.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(webhooks);
    }

    pub fn set_bus_dedup(&self, windows: HashMap<String, Duration>) {
        *self.bus_dedup.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(windows);
    }

    /// The JSON Schemas of a bus, if it has some.
    pub fn bus_schemas(&self, bus: &str) -> Option<Arc<schema::BusSchemas>> {
        self.schemas
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(bus)
            .cloned()
    }

    pub fn set_schemas(&self, schemas: HashMap<String, Arc<schema::BusSchemas>>) {
        *self.schemas.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(schemas);
    }

    pub fn set_bus_rate_limits(&self, limits: HashMap<String, ratelimit::RateLimitConfig>) {
        *self.bus_rate.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(limits);
    }

    /// Rate-limit buckets shared by the cluster (distributed mode).
    pub fn set_limiter(&self, limiter: Arc<dyn ratelimit::Limiter>) {
        *self.limiter.write().unwrap_or_else(|p| p.into_inner()) = limiter;
    }

    /// Takes a token from the bucket `scope`; the problem to answer when refused.
    pub async fn rate_limit(
        &self,
        scope: &str,
        field: &str,
        limit: &ratelimit::RateLimitConfig,
    ) -> Result<(), Problem> {
        let limiter = self
            .limiter
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        match limiter.take(scope, limit).await {
            Ok(None) => Ok(()),
            Ok(Some(wait)) => Err(Problem::rate_limited(field, wait)),
            Err(e) => Err(Problem::unavailable(e.to_string(), 2)),
        }
    }

    pub fn set_bus_auth(&self, keys: HashMap<String, Arc<auth::KeySet>>) {
        *self.bus_auth.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(keys);
    }

    fn bus_auth(&self, bus: &str) -> Option<Arc<auth::KeySet>> {
        self.bus_auth
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(bus)
            .cloned()
    }

    fn bus_dedup(&self, bus: &str) -> Option<Duration> {
        self.bus_dedup
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(bus)
            .copied()
    }

    pub fn buses(&self) -> Arc<HashMap<String, Arc<dyn BusLog>>> {
        self.buses.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_buses(&self, buses: HashMap<String, Arc<dyn BusLog>>) {
        *self.buses.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(buses);
    }
}

/// The HTTP application. Tests drive it with `oneshot`, the server with a socket.
///
/// The probes sit outside the load shedder and the concurrency limit: under load the
/// orchestrator must still hear that the process is alive (and ready), or it kills healthy
/// replicas exactly when they are busiest. They are cheap and never wait on the store.
///
/// `with_admin`: the admin API is served here too (it is not when `admin.listen` gives it
/// an address of its own).
pub fn router(state: Arc<IngressState>, with_admin: bool) -> Router {
    let probes = Router::new()
        .route("/healthz", get(live).fallback(get_only))
        .route("/readyz", get(ready).fallback(get_only))
        .route("/metrics", get(metrics).fallback(get_only))
        .with_state(state.clone());
    let router = probes.merge(limited(state.clone()));
    let router = if with_admin {
        router.merge(crate::api::routes(state.clone()))
    } else {
        router
    };
    router.layer(middleware::from_fn_with_state(state, close_when_draining))
}

/// While draining, every answer says `Connection: close`: clients open their next request
/// elsewhere instead of reusing a kept-alive connection that is about to close (which
/// would fail a request already on its way). HTTP/2 gets a GOAWAY at the close instead.
async fn close_when_draining(
    State(state): State<Arc<IngressState>>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    if state.draining.load(std::sync::atomic::Ordering::SeqCst) {
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    response
}

/// Everything but the probes, behind the limits of `[limits]`.
fn limited(state: Arc<IngressState>) -> Router {
    let limits = state.limits.clone();
    Router::new()
        .route(
            "/buses/{bus}/events",
            post(post_events)
                .options(crate::webhooks::bus_options)
                .fallback(|m: Method| async move {
                    Problem::method_not_allowed(m.as_str(), "POST, OPTIONS")
                }),
        )
        .merge(crate::webhooks::routes())
        .fallback(|uri: Uri| async move { Problem::not_found(uri.path()) })
        .with_state(state)
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|_: tower::BoxError| async {
                    Problem::overloaded()
                }))
                .load_shed()
                // `Router::layer` layers each route on its own: a plain concurrency limit
                // would be one limit per route. The global one shares one semaphore.
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    limits.max_concurrent_requests,
                ))
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

/// The buses whose log cannot take writes.
fn failed_buses(state: &IngressState) -> Vec<String> {
    let mut failed: Vec<String> = state
        .buses()
        .iter()
        .filter(|(_, log)| !log.healthy())
        .map(|(name, _)| name.clone())
        .collect();
    failed.sort();
    failed
}

/// Liveness: fails when a bus log has stopped taking writes for good (the embedded log
/// does so after a failed flush, until a restart recovers it), so the orchestrator
/// restarts the process. An unreachable Redis is not a reason: a restart does not fix it,
/// and readiness already takes the replica out of service.
async fn live(State(state): State<Arc<IngressState>>) -> Response {
    let failed = failed_buses(&state);
    if failed.is_empty() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        Problem::unavailable(
            format!(
                "the store stopped taking writes for bus(es): {}; a restart recovers it",
                failed.join(", ")
            ),
            5,
        )
        .into_response()
    }
}

async fn ready(State(state): State<Arc<IngressState>>) -> Response {
    if state.draining.load(std::sync::atomic::Ordering::SeqCst) {
        return Problem::unavailable("shutting down: finishing the requests in flight", 5)
            .into_response();
    }
    if !state.cluster.healthy() {
        return Problem::unavailable("the cluster store (Redis) is not reachable", 2)
            .into_response();
    }
    let failed = failed_buses(&state);
    if !failed.is_empty() {
        return Problem::unavailable(
            format!(
                "the store cannot take writes for bus(es): {}",
                failed.join(", ")
            ),
            5,
        )
        .into_response();
    }
    let mut problems: Vec<String> = state
        .buses()
        .iter()
        .filter_map(|(name, log)| log.write_problem().map(|p| format!("bus `{name}`: {p}")))
        .collect();
    if !problems.is_empty() {
        problems.sort();
        return Problem::unavailable(
            format!("the store's writes are failing: {}", problems.join("; ")),
            5,
        )
        .into_response();
    }
    Json(json!({"status": "ready"})).into_response()
}

/// One entry of a request: a parsed event or the reason it was refused.
pub(crate) type Entry = Result<(String, Bytes, u32), EventError>;

/// `GET /metrics`: the OpenMetrics text exposition (Prometheus scrapes it natively).
async fn metrics() -> Response {
    match crate::metrics::get().encode() {
        Ok(text) => (
            [(
                http::header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        Err(_) => Problem::internal("the metrics could not be encoded").into_response(),
    }
}

/// Records the request's metrics around the handler. Labels stay bounded: an unknown bus
/// is `bus="unknown"`, and the mode comes from a fixed set.
async fn post_events(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    request: Request,
) -> Response {
    let started = std::time::Instant::now();
    let bytes = request
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let mode = match cloudevent::content_mode(request.headers()) {
        Ok(ContentMode::Binary) => "binary",
        Ok(ContentMode::Structured) => "structured",
        Ok(ContentMode::Batch) => "batch",
        Err(_) => "other",
    };
    let label = if state.buses().contains_key(&bus) {
        bus.clone()
    } else {
        "unknown".to_string()
    };
    // The request id: the caller's `X-Request-Id` when it is a sane token, else a new one;
    // every log line of the request carries it (span field), and the answer echoes it.
    let request_id = request
        .headers()
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= 128 && v.bytes().all(|b| b.is_ascii_graphic()))
        .map_or_else(|| format!("{:032x}", fastrand::u128(..)), str::to_string);
    let span = tracing::info_span!(
        "request",
        request_id = %request_id,
        bus = %label,
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
            .filter(|v| crate::ingress::cloudevent::valid_traceparent(v))
        {
            span.record("traceparent", parent);
        }
    }
    let mut response =
        tracing::Instrument::instrument(handle_events(state, bus, request), span).await;
    if let Ok(value) = http::HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    crate::metrics::get().ingress(
        label,
        mode,
        response.status().as_u16(),
        bytes,
        started.elapsed(),
    );
    response
}

async fn handle_events(state: Arc<IngressState>, bus: String, request: Request) -> Response {
    let Some(log) = state.buses().get(&bus).cloned() else {
        return Problem::unknown_bus(&bus).into_response();
    };
    // Which of the bus's API keys sent the request (part of its digest, never the key):
    // dedup records are kept per producer, so one cannot make another's event a duplicate.
    let mut producer = String::new();
    if let Some(keys) = state.bus_auth(&bus) {
        match keys.check(request.headers()) {
            Ok(key) => {
                producer.clone_from(&key.0);
                if let Some(limit) = &keys.per_key {
                    if let Err(problem) = state
                        .rate_limit(&format!("key/{bus}/{}", key.0), "auth.rate_limit", limit)
                        .await
                    {
                        return problem.into_response();
                    }
                }
            }
            Err(refused) => return refused.problem().into_response(),
        }
    }
    let limit = state
        .bus_rate
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .get(&bus)
        .copied();
    if let Some(limit) = limit {
        if let Err(problem) = state
            .rate_limit(&format!("bus/{bus}"), "rate_limit", &limit)
            .await
        {
            return problem.into_response();
        }
    }
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
    let window = state.bus_dedup(&bus);
    // The dedup key of each entry, when the bus opted in: a fixed-size hash of (bus,
    // producer key, `source`, `id`).
    let mut keys: Vec<Option<String>> = Vec::new();
    let schemas = state.bus_schemas(&bus);
    let mut encode = |parsed: Result<cloudevent::Parsed, EventError>| {
        let parsed = match &schemas {
            Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
            None => parsed,
        };
        keys.push(window.and(parsed.as_ref().ok()).map(|p| {
            let source = cloudevents::AttributesReader::source(&p.event).to_string();
            let id = cloudevents::AttributesReader::id(&p.event);
            crate::webhooks::dedup::key(&["bus", &bus, &producer, &source, id])
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
    let dedup = state.webhooks().dedup();
    match store_unique(log.as_ref(), dedup.as_ref(), &entries, &keys, window).await {
        Ok((stored, duplicates)) => respond(mode, entries, stored, &duplicates),
        Err(e) => store_problem(&e).into_response(),
    }
}

/// The store result of each entry (`None`: not stored, it is an error or a duplicate).
pub(crate) type Stored = Vec<Option<Result<(), StoreError>>>;

/// Stores the entries of a request to a deduplicating bus or webhook source: an entry with
/// a key is stored at most once per key within `window` (`true` in the second vector when
/// it was a duplicate, answered as accepted but not stored again), and its key is recorded
/// only once it is stored, so that a failed store never turns the producer's retry into a
/// "duplicate". Where the log can record keys with its records in one atomic step (Redis:
/// one round trip per shard) it does; otherwise each key is reserved through `dedup`,
/// the event stored, and the key confirmed (or released when the store failed). A key
/// held by another request still deciding is answered as busy (retry shortly). `Err` when
/// the dedup store could not be asked (nothing was stored).
pub(crate) async fn store_unique(
    log: &dyn BusLog,
    dedup: &dyn crate::webhooks::dedup::Dedup,
    entries: &[Entry],
    keys: &[Option<String>],
    window: Duration,
) -> Result<(Stored, Vec<bool>), StoreError> {
    let mut duplicates = vec![false; entries.len()];
    let mut seen = std::collections::HashSet::new();
    // The entries stored under a key, per shard, in request order; the others plainly.
    let mut unique: Vec<(u32, Vec<usize>)> = Vec::new();
    let mut plain: Vec<Entry> = vec![Err(EventError::invalid("id", "not stored")); entries.len()];
    for (i, entry) in entries.iter().enumerate() {
        let Ok((_, _, shard)) = entry else { continue };
        match keys.get(i).and_then(Option::as_deref) {
            // The same event twice in one request: the first is stored, the others are
            // duplicates.
            Some(key) if !seen.insert(key) => duplicates[i] = true,
            Some(_) => match unique.iter_mut().find(|(s, _)| s == shard) {
                Some((_, list)) => list.push(i),
                None => unique.push((*shard, vec![i])),
            },
            None => plain[i] = entry.clone(),
        }
    }
    let mut stored: Stored = vec![None; entries.len()];
    let mut atomic = true;
    for (shard, list) in &unique {
        let records: Vec<(Bytes, &str)> = list
            .iter()
            .filter_map(|i| {
                let (_, bytes, _) = entries[*i].as_ref().ok()?;
                Some((bytes.clone(), keys[*i].as_deref()?))
            })
            .collect();
        match log.append_unique(*shard, &records, window).await {
            None => {
                atomic = false;
                break;
            }
            Some(Ok(results)) => {
                for (i, result) in list.iter().zip(results) {
                    match result {
                        Unique::Stored(_) => stored[*i] = Some(Ok(())),
                        Unique::Duplicate => duplicates[*i] = true,
                        Unique::Busy => stored[*i] = Some(Err(busy_key())),
                    }
                }
            }
            Some(Err(e)) => {
                for i in list {
                    stored[*i] = Some(Err(e.clone()));
                }
            }
        }
    }
    if !atomic {
        for (_, list) in &unique {
            for i in list {
                plain[*i] = entries[*i].clone();
            }
        }
        return reserve_and_store(log, dedup, &plain, keys, window, duplicates).await;
    }
    for (i, result) in store(log, &plain).await.into_iter().enumerate() {
        if result.is_some() {
            stored[i] = result;
        }
    }
    Ok((stored, duplicates))
}

fn busy_key() -> StoreError {
    StoreError::Busy(
        "an event with this id is being stored by another request; retry shortly".to_string(),
    )
}

/// `store_unique` for a log without atomic dedup: reserve each key, store what is not a
/// duplicate, then keep (or drop) the records.
async fn reserve_and_store(
    log: &dyn BusLog,
    dedup: &dyn crate::webhooks::dedup::Dedup,
    entries: &[Entry],
    keys: &[Option<String>],
    window: Duration,
    mut duplicates: Vec<bool>,
) -> Result<(Stored, Vec<bool>), StoreError> {
    use crate::webhooks::dedup::Reserve;
    // Held by another request still undecided: not stored now, retried by the producer.
    let mut busy = vec![false; entries.len()];
    let mut tokens: Vec<Option<(&str, String)>> = vec![None; entries.len()];
    for (i, entry) in entries.iter().enumerate() {
        let (Some(key), Ok(_)) = (keys.get(i).and_then(Option::as_deref), entry) else {
            continue;
        };
        match crate::webhooks::reserve(dedup, key).await {
            Ok(Reserve::Taken(token)) => tokens[i] = Some((key, token)),
            Ok(Reserve::Duplicate) => duplicates[i] = true,
            Ok(Reserve::InFlight) => busy[i] = true,
            Err(e) => {
                for (key, token) in tokens.iter().flatten() {
                    let _ = dedup.release(key, token).await;
                }
                return Err(e);
            }
        }
    }
    let to_store: Vec<Entry> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| match e {
            Ok(_) if duplicates[i] || busy[i] => Err(EventError::invalid("id", "not stored")),
            _ => e.clone(),
        })
        .collect();
    let mut stored = store(log, &to_store).await;
    for (i, held) in busy.iter().enumerate() {
        if *held {
            stored[i] = Some(Err(busy_key()));
        }
    }
    for (i, token) in tokens.iter().enumerate() {
        let Some((key, token)) = token else { continue };
        let result = if matches!(stored[i], Some(Ok(()))) {
            dedup.confirm(key, token, window).await
        } else {
            dedup.release(key, token).await
        };
        if let Err(e) = result {
            tracing::warn!(key = %key, error = %e, "cannot record a dedup key");
        }
    }
    Ok((stored, duplicates))
}

/// A parsed event made ready for the store: size and read-back checked, its shard chosen.
/// Webhook sources store through this too.
pub(crate) fn entry(
    parsed: Result<cloudevent::Parsed, EventError>,
    shards: u32,
    limits: &Limits,
) -> Entry {
    let cloudevent::Parsed {
        event,
        stored: bytes,
        reads_back,
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
    // Accept exactly what delivery can read: anything else would stall its shard. (Binary
    // mode's data was read as the decoder reads it already; the rest is decoded once.)
    if !reads_back {
        check_stored(&bytes)?;
    }
    let shard = shard_of(&partition_key(&event), shards);
    // The store's tail cache keeps these bytes and counts their length: no spare
    // capacity from the encoder's growth may ride along.
    let mut bytes = bytes;
    bytes.shrink_to_fit();
    Ok((
        cloudevents::AttributesReader::id(&event).to_string(),
        Bytes::from(bytes),
        shard,
    ))
}

/// Reads a request's body to its end (up to `limit`) and drops it chunk by chunk, holding
/// nothing: a client still sending its body then reads the answer instead of losing the
/// connection under it.
pub(crate) async fn discard_body(body: Body, limit: usize) {
    let mut body = Limited::new(body, limit);
    while let Some(Ok(_)) = body.frame().await {}
}

pub(crate) async fn read_body(
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
pub(crate) async fn store(
    log: &dyn BusLog,
    entries: &[Entry],
) -> Vec<Option<Result<(), StoreError>>> {
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
    duplicates: &[bool],
) -> Response {
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

pub(crate) fn event_problem(e: EventError) -> Problem {
    match e.kind {
        ErrorKind::Invalid => Problem::invalid_event(e.field, e.message),
        ErrorKind::TooLarge => Problem::too_large(&e.field, e.message),
        ErrorKind::Unsupported => Problem::unsupported_media_type(e.message),
    }
}

pub(crate) fn store_problem(e: &StoreError) -> Problem {
    match e {
        StoreError::Busy(m) => Problem::unavailable(m.clone(), 1),
        StoreError::TooLarge(m) => Problem::too_large("limits.max_event_bytes", m.clone()),
        StoreError::Unavailable(m) | StoreError::Corrupt(m) => Problem::unavailable(
            format!("the event could not be stored ({m}); nothing was kept"),
            5,
        ),
    }
}

#[cfg(test)]
mod tests {
    //! The router driven with `oneshot` over a real embedded log: hostile inputs either get
    //! a 4xx problem naming the field or are stored in a form delivery decodes.
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::collections::HashMap;
    use std::sync::Arc;

    use axum::body::Body;
    use http::Request;
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::{router, IngressState};
    use crate::config::{Durability, Limits};
    use crate::store::cluster::LocalCluster;
    use crate::store::embedded::{DataDir, EmbeddedLog, LogOptions};
    use crate::store::BusLog;

    struct Fixture {
        _dir: tempfile::TempDir,
        _data: DataDir,
        log: Arc<EmbeddedLog>,
        state: Arc<IngressState>,
    }

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let data = DataDir::open(dir.path()).unwrap();
        let options = LogOptions {
            durability: Durability::Os,
            segment_bytes: 1 << 20,
            cache_bytes: 1 << 20,
        };
        let log = Arc::new(data.open_bus("b", 1, &options).unwrap());
        let buses: HashMap<String, Arc<dyn BusLog>> =
            HashMap::from([("b".to_string(), log.clone() as Arc<dyn BusLog>)]);
        let state = Arc::new(IngressState::new(
            buses,
            Limits::default(),
            Arc::new(LocalCluster::new("w")),
        ));
        Fixture {
            _dir: dir,
            _data: data,
            log,
            state,
        }
    }

    async fn send(state: &Arc<IngressState>, request: Request<Body>) -> (u16, serde_json::Value) {
        let response = router(state.clone(), true).oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        let problem = response
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v == crate::problem::PROBLEM_JSON);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null);
        assert!(
            status < 400 || problem,
            "{status} without a problem body: {json}"
        );
        (status, json)
    }

    fn binary(id: &str, content_type: &str, body: &[u8]) -> Request<Body> {
        Request::post("/buses/b/events")
            .header("ce-specversion", "1.0")
            .header("ce-id", id)
            .header("ce-source", "/t")
            .header("ce-type", "t")
            .header("content-type", content_type)
            .body(Body::from(body.to_vec()))
            .unwrap()
    }

    fn structured(json: &str) -> Request<Body> {
        Request::post("/buses/b/events")
            .header("content-type", "application/cloudevents+json")
            .body(Body::from(json.to_string()))
            .unwrap()
    }

    fn batch(json: &str) -> Request<Body> {
        Request::post("/buses/b/events")
            .header("content-type", "application/cloudevents-batch+json")
            .body(Body::from(json.to_string()))
            .unwrap()
    }

    fn depth(n: usize) -> Vec<u8> {
        format!("{}{}", "[".repeat(n), "]".repeat(n)).into_bytes()
    }

    #[tokio::test]
    async fn hostile_inputs_are_refused_or_stored_decodable() {
        let f = fixture();
        let json = "application/json";
        // (what, request, the field a refusal must name; None = may be accepted)
        let cases: Vec<(&str, Request<Body>, Option<&str>)> = vec![
            (
                "lone surrogate",
                binary("1", json, br#""\ud800""#),
                Some("data"),
            ),
            (
                "lone trailing surrogate",
                binary("2", json, br#"["\udc00"]"#),
                Some("data"),
            ),
            (
                "surrogate pair",
                binary("3", json, br#""\ud83d\ude00""#),
                None,
            ),
            (
                "invalid UTF-8 in a string",
                binary("4", json, b"\"\xff\""),
                Some("data"),
            ),
            (
                "invalid UTF-8 bare",
                binary("5", json, b"\xff"),
                Some("data"),
            ),
            (
                "number out of range",
                binary("6", json, b"1e400"),
                Some("data"),
            ),
            (
                "huge integer",
                binary("7", json, b"123456789012345678901234567890"),
                None,
            ),
            // serde_json's limit counts the event object around the data too.
            ("depth 125", binary("8", json, &depth(125)), None),
            ("depth 126", binary("9", json, &depth(126)), None),
            ("depth 127", binary("9b", json, &depth(127)), Some("data")),
            ("depth 128", binary("10", json, &depth(128)), Some("data")),
            ("depth 129", binary("11", json, &depth(129)), Some("data")),
            ("depth 5000", binary("12", json, &depth(5000)), Some("data")),
            (
                "text body not UTF-8",
                binary("13", "text/plain", b"\xff\xfe"),
                None,
            ),
            (
                "octets",
                binary("14", "application/octet-stream", b"\0\x01"),
                None,
            ),
            ("newline in id", binary("a%0Ab", json, b"{}"), Some("ce-id")),
            (
                "NUL in an extension",
                {
                    let mut r = binary("15", json, b"{}");
                    r.headers_mut()
                        .insert("ce-tenant", "a%00b".parse().unwrap());
                    r
                },
                Some("ce-tenant"),
            ),
            (
                "C1 control in subject",
                {
                    let mut r = binary("16", json, b"{}");
                    r.headers_mut()
                        .insert("ce-subject", "a%C2%85b".parse().unwrap());
                    r
                },
                Some("ce-subject"),
            ),
            (
                "non-ASCII id",
                binary("caf%C3%A9 %22x%22", json, b"{}"),
                None,
            ),
            (
                "structured: object data with a text type",
                structured(
                    r#"{"specversion":"1.0","id":"s1","source":"/t","type":"t","datacontenttype":"text/plain","data":{"a":1}}"#,
                ),
                Some("data"),
            ),
            (
                "structured: number data with an XML type",
                structured(
                    r#"{"specversion":"1.0","id":"s2","source":"/t","type":"t","datacontenttype":"application/xml","data":5}"#,
                ),
                Some("data"),
            ),
            (
                "structured: control character in type",
                structured(
                    r#"{"specversion":"1.0","id":"s3","source":"/t","type":"t\u0007","data":1}"#,
                ),
                Some("type"),
            ),
            (
                "structured: control character in an extension",
                structured(
                    r#"{"specversion":"1.0","id":"s4","source":"/t","type":"t","ext":"\u007f"}"#,
                ),
                Some("ext"),
            ),
            (
                "structured: deep data",
                structured(&format!(
                    r#"{{"specversion":"1.0","id":"s5","source":"/t","type":"t","data":{}}}"#,
                    String::from_utf8(depth(126)).unwrap()
                )),
                None,
            ),
            (
                "structured: lone surrogate in data",
                structured(
                    r#"{"specversion":"1.0","id":"s6","source":"/t","type":"t","data":"\ud800"}"#,
                ),
                Some("body"),
            ),
            (
                "structured: JSON data_base64",
                structured(
                    r#"{"specversion":"1.0","id":"s7","source":"/t","type":"t","datacontenttype":"application/json","data_base64":"eyJhIjoxfQ=="}"#,
                ),
                None,
            ),
            (
                "batch: text type with object data",
                batch(
                    r#"[{"specversion":"1.0","id":"b1","source":"/t","type":"t","datacontenttype":"text/plain","data":[1]}]"#,
                ),
                Some("entries"),
            ),
        ];
        let mut accepted = 0;
        for (what, request, refused_field) in cases {
            let (status, body) = send(&f.state, request).await;
            match refused_field {
                Some(field) => {
                    assert!((400..500).contains(&status), "{what}: {status} {body}");
                    assert_eq!(body["field"], field, "{what}: {body}");
                }
                None => {
                    assert_eq!(status, 202, "{what}: {body}");
                    accepted += 1;
                }
            }
        }
        // Every stored record reads back as a CloudEvent, as delivery reads it.
        let mut reader = f.log.reader(0, 0).await.unwrap();
        let records = reader.read(1000).await.unwrap();
        assert_eq!(records.len(), accepted);
        for record in records {
            crate::event::decode(&record.payload)
                .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&record.payload)));
        }
    }

    #[tokio::test]
    async fn a_batch_keeps_its_good_entries_and_refuses_the_undecodable() {
        let f = fixture();
        let (status, body) = send(
            &f.state,
            batch(r#"[{"specversion":"1.0","id":"ok","source":"/t","type":"t"},{"specversion":"1.0","id":"bad","source":"/t","type":"t","datacontenttype":"text/plain","data":{"a":1}}]"#),
        )
        .await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["failedEntryCount"], 1);
        assert_eq!(body["entries"][1]["error"]["field"], "data", "{body}");
    }

    #[tokio::test]
    async fn liveness_fails_once_the_store_stops_taking_writes() {
        let f = fixture();
        let get = |path: &str| Request::get(path).body(Body::empty()).unwrap();
        assert_eq!(send(&f.state, get("/healthz")).await.0, 200);
        // Closing the log is what a fatal error (a failed flush) does too: no more writes
        // until a restart recovers the log.
        f.log.close().await;
        let (status, body) = send(&f.state, get("/healthz")).await;
        assert_eq!(status, 503, "{body}");
        assert!(body["detail"].as_str().unwrap().contains('b'), "{body}");
        assert_eq!(send(&f.state, get("/readyz")).await.0, 503);
    }
}
