//! Replays of a bus's stored events to a rule's targets: started, listed, cancelled.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::resources::*;
use crate::admin::state::{json_request, store_problem, AdminState};
use crate::problem::Problem;

// ---------------------------------------------------------------------------------------
// Replays

/// A time as RFC 3339 text or milliseconds since the Unix epoch.
pub(super) fn parse_time(value: &Value, pointer: &str) -> Result<u64, Problem> {
    match value {
        Value::Number(n) => n.as_u64().ok_or_else(|| {
            Problem::invalid_resource(
                pointer,
                "a time is milliseconds since the Unix epoch or RFC 3339 text",
            )
        }),
        Value::String(s) => chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.timestamp_millis().max(0) as u64)
            .map_err(|e| {
                Problem::invalid_resource(pointer, format!("`{s}` is not an RFC 3339 time: {e}"))
            }),
        _ => Err(Problem::invalid_resource(
            pointer,
            "a time is milliseconds since the Unix epoch or RFC 3339 text",
        )),
    }
}

/// `POST /api/v1/buses/{bus}/replays`: `{"rule", "target"?, "from"?, "to"?}` (acceptance
/// times) or `{"rule", "target"?, "positions": {"0": [from, to], ...}}`.
pub(super) async fn start_replay(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
    body: axum::body::Bytes,
) -> Response {
    match start_replay_inner(&state, &bus, &body).await {
        Ok(status) => {
            let location = format!("/api/v1/buses/{bus}/replays/{}", status.id);
            let mut response = (StatusCode::ACCEPTED, Json(json!(status))).into_response();
            if let Ok(v) = HeaderValue::from_str(&location) {
                response.headers_mut().insert(header::LOCATION, v);
            }
            response
        }
        Err(p) => p.into_response(),
    }
}

pub(super) async fn start_replay_inner(
    state: &AdminState,
    bus: &str,
    body: &[u8],
) -> Result<crate::replay::ReplayStatus, Problem> {
    let request = json_request(body, &["rule", "target", "from", "to", "positions"])?;
    let plan = state.plan();
    let Some(bus_plan) = plan.buses.get(bus) else {
        return Err(no_bus(bus));
    };
    let Some(rule) = request.get("rule").and_then(Value::as_str) else {
        return Err(Problem::invalid_resource(
            "/rule",
            "`rule` (the name of a rule of the bus) is required",
        ));
    };
    let target = match request.get("target") {
        None | Some(Value::Null) => None,
        Some(Value::String(t)) => Some(t.as_str()),
        Some(_) => {
            return Err(Problem::invalid_resource(
                "/target",
                "`target` is a target's name",
            ))
        }
    };
    let subscriptions = crate::replay::subscriptions(&plan, bus, rule, target);
    if subscriptions.is_empty() {
        return Err(Problem::invalid_resource(
            if target.is_some() { "/target" } else { "/rule" },
            match target {
                Some(t) => format!("rule `{rule}` of bus `{bus}` has no target `{t}` running"),
                None => format!("bus `{bus}` has no rule `{rule}` running"),
            },
        ));
    }
    let from_ms = request
        .get("from")
        .map(|v| parse_time(v, "/from"))
        .transpose()?;
    let to_ms = request
        .get("to")
        .map(|v| parse_time(v, "/to"))
        .transpose()?;
    if let (Some(f), Some(t)) = (from_ms, to_ms) {
        if t <= f {
            return Err(Problem::invalid_resource(
                "/to",
                "`to` must be after `from`",
            ));
        }
    }
    let positions = match request.get("positions") {
        None => None,
        Some(Value::Object(map)) => {
            if from_ms.is_some() || to_ms.is_some() {
                return Err(Problem::invalid_resource(
                    "/positions",
                    "give a time range (`from`, `to`) or `positions`, not both",
                ));
            }
            let mut out = BTreeMap::new();
            for (shard, range) in map {
                let at = format!("/positions/{shard}");
                let shard: u32 = shard
                    .parse()
                    .ok()
                    .filter(|s| *s < bus_plan.log.shards())
                    .ok_or_else(|| {
                        Problem::invalid_resource(
                            &at,
                            format!("bus `{bus}` has shards 0 to {}", bus_plan.log.shards() - 1),
                        )
                    })?;
                let pair = range.as_array().and_then(|a| match a.as_slice() {
                    [from, to] => Some((from.as_u64()?, to.as_u64()?)),
                    _ => None,
                });
                match pair {
                    Some((from, to)) if from <= to => {
                        out.insert(shard, (from, to));
                    }
                    _ => {
                        return Err(Problem::invalid_resource(
                            &at,
                            "a shard's range is `[from, to]`, positions with from <= to",
                        ))
                    }
                }
            }
            Some(out)
        }
        Some(_) => {
            return Err(Problem::invalid_resource(
                "/positions",
                "`positions` maps a shard to `[from, to]`",
            ))
        }
    };
    let admin = &state.auth;
    let store = state.replays.clone();
    crate::replay::start(
        crate::replay::ReplayRequest {
            bus: bus.to_string(),
            rule: rule.to_string(),
            subscriptions,
            log: bus_plan.log.clone(),
            from_ms,
            to_ms,
            positions,
        },
        store,
        state.cluster.worker_id(),
        admin.replay_batch,
        &state.replay_cancels,
    )
    .await
    .map_err(|e| store_problem(&e))
}

/// Replays of `bus`, newest first. A replay still `RUNNING` on a worker that left the
/// cluster says so in `reason` until another replica takes it over.
pub(super) async fn replays_of(state: &AdminState, bus: &str) -> Result<Vec<Value>, Problem> {
    let store = state.replays.clone();
    let mut all = store.list().await.map_err(|e| store_problem(&e))?;
    let members = state.cluster.members().await.unwrap_or_default();
    all.retain(|r| r.bus == bus);
    all.sort_by_key(|r| std::cmp::Reverse(r.created_ms));
    Ok(all
        .into_iter()
        .map(|mut r| {
            if r.state == "RUNNING" && !members.contains(&r.worker) {
                r.reason = Some(format!(
                    "worker `{}`, which ran it, left the cluster; another replica takes it over",
                    r.worker
                ));
            }
            json!(r)
        })
        .collect())
}

pub(super) async fn list_replays(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
) -> Response {
    match replays_of(&state, &bus).await {
        Ok(items) => Json(json!({"items": items})).into_response(),
        Err(p) => p.into_response(),
    }
}

pub(super) async fn get_replay(
    State(state): State<Arc<AdminState>>,
    Path((bus, id)): Path<(String, String)>,
) -> Response {
    match replays_of(&state, &bus).await {
        Ok(items) => match items.into_iter().find(|r| r["id"] == id.as_str()) {
            Some(r) => Json(r).into_response(),
            None => Problem::unknown(format!("no replay `{id}` of bus `{bus}`"))
                .with_field("replay")
                .into_response(),
        },
        Err(p) => p.into_response(),
    }
}

pub(super) async fn cancel_replay(
    State(state): State<Arc<AdminState>>,
    Path((bus, id)): Path<(String, String)>,
) -> Response {
    let items = match replays_of(&state, &bus).await {
        Ok(items) => items,
        Err(p) => return p.into_response(),
    };
    let Some(replay) = items.into_iter().find(|r| r["id"] == id.as_str()) else {
        return Problem::unknown(format!("no replay `{id}` of bus `{bus}`"))
            .with_field("replay")
            .into_response();
    };
    if replay["state"] != "RUNNING" {
        return StatusCode::NO_CONTENT.into_response();
    }
    // Kept in the map (it marks the replay as this process's, not an orphan).
    let cancelled_here = state
        .replay_cancels
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(&id)
        .is_some_and(|cancel| cancel.send(true).is_ok());
    if cancelled_here {
        return StatusCode::NO_CONTENT.into_response();
    }
    // Running on another worker (or its run here already ended): mark it in the store;
    // the worker running it stops at its next progress record.
    let store = state.replays.clone();
    match crate::replay::cancel_anywhere(store.as_ref(), &id, state.cluster.worker_id()).await {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}
