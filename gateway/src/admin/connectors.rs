//! Connectors, tasks and the cluster: status, lag and positions of every connector and
//! task, and the workers with their assignment.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::state::AdminState;
use crate::problem::Problem;
use crate::store::cluster::task_id;

// ---------------------------------------------------------------------------------------
// Connectors, tasks, cluster

pub(super) async fn connector_view(
    state: &AdminState,
    id: &str,
    statuses: &HashMap<String, Value>,
    rates: &HashMap<String, crate::scaling::Rate>,
) -> Value {
    let plan = state.plan();
    let tasks = state.connectors().get(id).copied().unwrap_or(0);
    let mut task_views = Vec::new();
    let parts: Vec<&str> = id.splitn(3, '/').collect();
    let log = match parts.as_slice() {
        [bus, _, _] => plan.logs.get(*bus).cloned(),
        _ => None,
    };
    let positions = &state.positions;
    for index in 0..tasks {
        let task = task_id(id, index);
        let mut view = statuses
            .get(&task)
            .cloned()
            .unwrap_or_else(|| json!({"id": task, "state": "UNASSIGNED"}));
        if let (Some(log), [bus, rule, target]) = (&log, parts.as_slice()) {
            let end = log.end(index).await.ok();
            let at = positions
                .peek_group(bus, index)
                .await
                .ok()
                .and_then(|g| g.of(&format!("{rule}/{target}")));
            let rate = rates
                .get(id)
                .and_then(|r| r.shards.get(index as usize))
                .map(|r| (r * 100.0).round() / 100.0);
            if let Value::Object(map) = &mut view {
                map.insert("shard".to_string(), json!(index));
                map.insert("rate".to_string(), json!(rate));
                map.insert("position".to_string(), json!(at));
                map.insert("end".to_string(), json!(end));
                // No position yet: the subscription starts where the shard ends.
                map.insert(
                    "lag".to_string(),
                    json!(end.map(|e| e.saturating_sub(at.unwrap_or(e).min(e)))),
                );
            }
        } else if let Value::Object(map) = &mut view {
            map.insert("index".to_string(), json!(index));
        }
        task_views.push(view);
    }
    let lag: u64 = task_views.iter().filter_map(|t| t["lag"].as_u64()).sum();
    let rate = rates.get(id).map(|r| r.total);
    let mut view = statuses
        .get(id)
        .cloned()
        .unwrap_or_else(|| json!({"id": id, "state": "RUNNING"}));
    if let Value::Object(map) = &mut view {
        map.insert(
            "kind".to_string(),
            json!(if id.starts_with("source/") {
                "source"
            } else {
                "subscription"
            }),
        );
        map.insert("lag".to_string(), json!(lag));
        // Delivered events per second over the last minute, cluster-wide (sampled every
        // 5 s once asked for; null until there are two samples).
        map.insert(
            "rate".to_string(),
            json!(rate.map(|r| (r * 100.0).round() / 100.0)),
        );
        map.insert("tasks".to_string(), Value::Array(task_views));
    }
    view
}

pub(super) async fn statuses_by_id(state: &AdminState) -> Result<HashMap<String, Value>, Problem> {
    let statuses = state
        .cluster
        .statuses()
        .await
        .map_err(|e| Problem::unavailable(e.to_string(), 2))?;
    Ok(statuses
        .into_iter()
        .map(|s| {
            (
                s.id.clone(),
                serde_json::to_value(&s).unwrap_or(Value::Null),
            )
        })
        .collect())
}

pub(super) async fn list_connectors(State(state): State<Arc<AdminState>>) -> Response {
    let statuses = match statuses_by_id(&state).await {
        Ok(s) => s,
        Err(p) => return p.into_response(),
    };
    let rates = state.scaling.rates();
    let mut ids: Vec<String> = state.connectors().keys().cloned().collect();
    ids.sort();
    let mut items = Vec::new();
    for id in ids {
        items.push(connector_view(&state, &id, &statuses, &rates).await);
    }
    Json(json!({"items": items})).into_response()
}

pub(super) async fn get_connector(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule, target)): Path<(String, String, String)>,
) -> Response {
    let id = format!("{bus}/{rule}/{target}");
    if !state.connectors().contains_key(&id) {
        return Problem::unknown(format!("no connector `{id}` in the running catalog"))
            .into_response();
    }
    let rates = state.scaling.rates();
    match statuses_by_id(&state).await {
        Ok(statuses) => Json(connector_view(&state, &id, &statuses, &rates).await).into_response(),
        Err(p) => p.into_response(),
    }
}

pub(super) async fn cluster(State(state): State<Arc<AdminState>>) -> Response {
    let auth = &state.auth;
    let members = match state.cluster.members().await {
        Ok(mut m) => {
            m.sort();
            m
        }
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    let statuses = match state.cluster.statuses().await {
        Ok(s) => s,
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    let mut assignment: BTreeMap<String, Vec<String>> =
        members.iter().map(|m| (m.clone(), Vec::new())).collect();
    for status in &statuses {
        if status.state == crate::store::cluster::State::Running && status.id.contains('#') {
            if let Some(worker) = &status.worker {
                assignment
                    .entry(worker.clone())
                    .or_default()
                    .push(status.id.clone());
            }
        }
    }
    for tasks in assignment.values_mut() {
        tasks.sort();
    }
    let workers: Vec<Value> = match state.cluster.heartbeats().await {
        Ok(mut beats) => {
            beats.sort();
            beats
                .into_iter()
                .map(|(id, age)| json!({"id": id, "heartbeat_age_ms": age}))
                .collect()
        }
        Err(e) => return Problem::unavailable(e.to_string(), 2).into_response(),
    };
    Json(json!({
        "worker": state.cluster.worker_id(),
        "strategy": auth.strategy,
        "members": members,
        "workers": workers,
        "assignment": assignment,
        "statuses": statuses,
    }))
    .into_response()
}
