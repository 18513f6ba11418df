//! A bus's recent events (`GET /api/v1/buses/{bus}/events`) and their redelivery to a
//! rule's targets.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::admin::resources::*;
use crate::admin::state::{event_field, json_request, query_pairs, store_problem, AdminState};
use crate::problem::Problem;

// ---------------------------------------------------------------------------------------
// Recent events, redelivery

/// `GET /api/v1/buses/{bus}/events?limit=N`: the newest stored events of the bus (still in
/// its log), each with its delivery state per subscription that takes it. On buses with
/// many shards, approximately the newest (each shard gives a bounded share).
pub(super) async fn recent_events(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let mut limit = 20usize;
    for (key, value) in query_pairs(query.as_deref(), "") {
        match (key, value.parse::<usize>()) {
            ("limit", Ok(n)) if (1..=200).contains(&n) => limit = n,
            ("limit", _) => {
                return Problem::bad_request("limit", "`limit` is a number from 1 to 200")
                    .into_response()
            }
            (other, _) => {
                return Problem::bad_request(other, format!("unknown parameter `{other}` (limit)"))
                    .into_response()
            }
        }
    }
    let plan = state.plan();
    let Some(bus_plan) = plan.buses.get(&bus) else {
        return no_bus(&bus).into_response();
    };
    let positions = &state.positions;
    let log = bus_plan.log.clone();
    let mut items = Vec::new();
    // The newest `limit` of each shard would be exact; on a bus with many shards that is
    // too much to read for one request, so each shard gives a fair share (four times its
    // even part, at least eight).
    let shards = log.shards().max(1) as usize;
    let per_shard = limit.min((4 * limit / shards + 1).max(8));
    for shard in 0..log.shards() {
        let end = match log.end(shard).await {
            Ok(end) => end,
            Err(e) => return store_problem(&e).into_response(),
        };
        let from = end.saturating_sub(per_shard as u64);
        let records = match log.reader(shard, from).await {
            Ok(mut reader) => reader.read(per_shard).await.unwrap_or_default(),
            Err(e) => return store_problem(&e).into_response(),
        };
        let group = positions.peek_group(&bus, shard).await.ok();
        for record in records {
            let Ok(event) = crate::event::decode(&record.payload) else {
                continue;
            };
            let mut subscriptions = Map::new();
            for sub in &bus_plan.subscriptions {
                if !sub.filter.matches(&event) {
                    continue;
                }
                let at = group.as_ref().and_then(|g| g.of(&sub.name));
                let delivered = at.is_some_and(|p| p > record.seq);
                subscriptions.insert(
                    sub.name.clone(),
                    json!(if delivered { "delivered" } else { "pending" }),
                );
            }
            items.push((
                record.accepted_ms,
                record.seq,
                json!({
                    "shard": shard,
                    "seq": record.seq,
                    "accepted_ms": record.accepted_ms,
                    "event": serde_json::to_value(&event).unwrap_or(Value::Null),
                    "subscriptions": subscriptions,
                }),
            ));
        }
    }
    items.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    let items: Vec<Value> = items.into_iter().take(limit).map(|(_, _, v)| v).collect();
    Json(json!({"items": items})).into_response()
}

/// How long a redelivery waits for the functions its chains call to be loaded.
const FUNCTIONS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// `POST /api/v1/buses/{bus}/rules/{rule}/redeliver`: `{"event", "target"?}` delivers one
/// event (a dead letter, say) to that rule's targets only, through their transform chains,
/// retry policies and dead-letter destinations, marked with `sluicereplay`. The
/// `deadletter*` extensions of a dead letter are removed first.
pub(super) async fn redeliver(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule)): Path<(String, String)>,
    body: axum::body::Bytes,
) -> Response {
    let request = match json_request(&body, &["event", "target"]) {
        Ok(map) => map,
        Err(p) => return p.into_response(),
    };
    let plan = state.plan();
    if !plan.buses.contains_key(&bus) {
        return no_bus(&bus).into_response();
    }
    let target = request.get("target").and_then(Value::as_str);
    let subscriptions = crate::replay::subscriptions(&plan, &bus, &rule, target);
    if subscriptions.is_empty() {
        return Problem::unknown(match target {
            Some(t) => format!("rule `{rule}` of bus `{bus}` has no target `{t}` running"),
            None => format!("bus `{bus}` has no rule `{rule}` running"),
        })
        .with_field(if target.is_some() { "/target" } else { "/rule" })
        .into_response();
    }
    let event = match event_field(&request) {
        Ok(e) => e,
        Err(p) => return p.into_response(),
    };
    let mut event: cloudevents::Event = match serde_json::from_value(event.clone()) {
        Ok(e) => e,
        Err(e) => {
            return Problem::invalid_resource("/event", format!("not a CloudEvent: {e}"))
                .into_response()
        }
    };
    let dead: Vec<String> = event
        .iter_extensions()
        .map(|(k, _)| k.to_string())
        .filter(|k| k.starts_with("deadletter"))
        .collect();
    for key in dead {
        event.remove_extension(&key);
    }
    let id = format!(
        "redeliver-{}-{:04x}",
        crate::store::now_ms(),
        fastrand::u16(..)
    );
    let mut targets = Vec::new();
    let mut deliveries = Vec::with_capacity(subscriptions.len());
    for sub in subscriptions {
        // Every chain runs (user functions too) before anything is sent: an event one of
        // them refuses is a 400, not a partial redelivery.
        let marked = crate::replay::marked(&sub, vec![event.clone()], &id);
        let why = match tokio::time::timeout(FUNCTIONS_WAIT, marked).await {
            Ok(Ok((envelopes, refused))) => match refused.into_iter().next() {
                None => {
                    deliveries.push((sub, envelopes));
                    continue;
                }
                Some((_, why)) => why,
            },
            Ok(Err(why)) => why,
            Err(_) => {
                format!("its functions were not loaded on this replica within {FUNCTIONS_WAIT:?}")
            }
        };
        return Problem::invalid_resource(
            "/event",
            format!(
                "the transform chain of `{}` fails on this event: {why}",
                sub.name
            ),
        )
        .into_response();
    }
    for (sub, envelopes) in deliveries {
        targets.push(
            sub.name
                .split_once('/')
                .map_or(sub.name.clone(), |(_, t)| t.to_string()),
        );
        let replay = id.clone();
        tokio::spawn(async move {
            if !envelopes.is_empty() {
                sub.delivery.deliver(&envelopes).await;
            }
            tracing::info!(replay = %replay, subscription = %sub.id, "redelivered");
        });
    }
    (
        StatusCode::ACCEPTED,
        Json(json!({"id": id, "targets": targets})),
    )
        .into_response()
}
