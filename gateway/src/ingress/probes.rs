//! The probes (`/healthz`, `/readyz`) and `/metrics`: cheap, never waiting on the store, and
//! served outside the load shedder so the orchestrator hears a busy replica.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use crate::ingress::state::IngressState;
use crate::problem::Problem;

/// The buses whose log cannot take writes.
fn failed_buses(state: &IngressState) -> Vec<String> {
    let mut failed: Vec<String> = state
        .settings()
        .buses
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
pub(crate) async fn live(State(state): State<Arc<IngressState>>) -> Response {
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

pub(crate) async fn ready(State(state): State<Arc<IngressState>>) -> Response {
    if state.draining() {
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
        .settings()
        .buses
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

/// `GET /metrics`: the OpenMetrics text exposition (Prometheus scrapes it natively).
pub(crate) async fn metrics() -> Response {
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
