//! The first admin endpoints, kept as aliases of `/api/v1` (see `api`): cluster view (members, connector and task status) and
//! pause / resume / restart of a connector or a task. Any replica answers for the whole
//! cluster, since the state lives in the cluster store.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

use crate::admin::state::AdminState;
use crate::problem::Problem;
use crate::store::cluster::task_id;

pub fn routes() -> Router<Arc<AdminState>> {
    Router::new()
        .route("/admin/cluster", get(cluster))
        .route(
            "/admin/connectors/{bus}/{rule}/{target}/{action}",
            post(connector_action),
        )
        .route(
            "/admin/tasks/{bus}/{rule}/{target}/{shard}/{action}",
            post(task_action),
        )
        .route("/admin/sources/{name}/{action}", post(source_action))
        .route(
            "/admin/sources/{name}/tasks/{index}/{action}",
            post(source_task_action),
        )
}

pub(super) async fn cluster(State(state): State<Arc<AdminState>>) -> Response {
    let members = state.cluster.members().await;
    let statuses = state.cluster.statuses().await;
    match (members, statuses) {
        (Ok(mut members), Ok(statuses)) => {
            members.sort();
            Json(json!({
                "worker": state.cluster.worker_id(),
                "members": members,
                "statuses": statuses,
            }))
            .into_response()
        }
        (Err(e), _) | (_, Err(e)) => Problem::unavailable(e.to_string(), 2).into_response(),
    }
}

pub(crate) async fn connector_action(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule, target, action)): Path<(String, String, String, String)>,
) -> Response {
    act(&state, &format!("{bus}/{rule}/{target}"), None, &action).await
}

pub(crate) async fn task_action(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule, target, shard, action)): Path<(String, String, String, u32, String)>,
) -> Response {
    act(
        &state,
        &format!("{bus}/{rule}/{target}"),
        Some(shard),
        &action,
    )
    .await
}

pub(crate) async fn source_action(
    State(state): State<Arc<AdminState>>,
    Path((name, action)): Path<(String, String)>,
) -> Response {
    act(&state, &format!("source/{name}"), None, &action).await
}

pub(crate) async fn source_task_action(
    State(state): State<Arc<AdminState>>,
    Path((name, index, action)): Path<(String, u32, String)>,
) -> Response {
    act(&state, &format!("source/{name}"), Some(index), &action).await
}

/// Pause, resume or restart a connector (`task` = `None`) or one of its tasks. Only the
/// running configuration's connectors and tasks are known: anything else is 404, so a
/// typo is not silently remembered as a control entry for nothing.
pub(crate) async fn act(
    state: &AdminState,
    connector: &str,
    task: Option<u32>,
    action: &str,
) -> Response {
    let Some(tasks) = state.connectors().get(connector).copied() else {
        return Problem::unknown(format!(
            "no connector `{connector}` in the running configuration"
        ))
        .into_response();
    };
    let id = match task {
        Some(index) if index >= tasks => {
            return Problem::unknown(format!(
                "connector `{connector}` has tasks 0 to {}; there is no task {index}",
                tasks.saturating_sub(1)
            ))
            .into_response()
        }
        Some(index) => task_id(connector, index),
        None => connector.to_string(),
    };
    let id = id.as_str();
    let result = match action {
        "pause" => state.cluster.set_paused(id, true).await,
        "resume" => state.cluster.set_paused(id, false).await,
        "restart" => state.cluster.request_restart(id).await,
        other => {
            return Problem::bad_request(
                "action",
                format!("unknown action `{other}` (pause, resume or restart)"),
            )
            .into_response()
        }
    };
    match result {
        Ok(()) => (
            StatusCode::ACCEPTED,
            Json(json!({"id": id, "action": action})),
        )
            .into_response(),
        Err(e) => Problem::unavailable(e.to_string(), 2).into_response(),
    }
}
