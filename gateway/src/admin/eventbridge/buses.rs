//! `EventBusController`: `/bus/createEventBus`, `getEventBus`, `deleteEventBus` and
//! `listEventBuses`, on the catalog's buses.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use serde_json::{json, Value};

use crate::admin::resources;
use crate::admin::state::AdminState;
use crate::catalog;

use crate::admin::eventbridge::dto::{answer, body_of, bus_name, string_field, EbError};
use crate::admin::eventbridge::paging::{page, paging};
use crate::admin::eventbridge::v1::{outcome, passed_on, require_bus, snapshot, Context};

pub(super) async fn create_bus(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(create_bus_inner(state, headers, body).await)
}

async fn create_bus_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    string_field(&request, "description")?;
    let mut headers = passed_on(&headers);
    // Creation only: an existing bus is the project's `EventBusAlreadyExist`.
    headers.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
    let resource = Bytes::from(json!({ "name": bus }).to_string());
    let response = resources::put_bus(State(state), Path(bus.clone()), headers, resource).await;
    outcome(
        response,
        Context {
            missing: EbError::bus_missing(&bus),
            exists: Some(EbError::new(
                "EventBusAlreadyExist",
                format!("The event bus [{bus}] already existed!"),
            )),
            conflict: "EventBusAlreadyExist",
            name_invalid: "EventBusNameInvalid",
            what: "the event bus",
        },
    )
    .await?;
    Ok(json!({ "eventBusName": bus }))
}

pub(super) async fn get_bus(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(get_bus_inner(state, body).await)
}

async fn get_bus_inner(state: Arc<AdminState>, body: Bytes) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let s = snapshot(&state).await?;
    require_bus(&s, &bus)?;
    Ok(json!({
        "eventBusName": bus,
        "description": null,
        "createTimestamp": null,
        "version": s.version_of(&catalog::bus_key(&bus)),
    }))
}

pub(super) async fn delete_bus(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(delete_bus_inner(state, headers, body).await)
}

async fn delete_bus_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let s = snapshot(&state).await?;
    require_bus(&s, &bus)?;
    if s.channels.rules.iter().any(|r| *r.bus.get_ref() == bus) {
        return Err(EbError::new(
            "EventBusRuleNotEmptyForDelete",
            format!(
                "The rules of eventbus [{bus}] exist, please delete them before delete event bus."
            ),
        ));
    }
    let response =
        resources::delete_bus(State(state), Path(bus.clone()), passed_on(&headers)).await;
    outcome(
        response,
        Context {
            missing: EbError::bus_missing(&bus),
            exists: None,
            conflict: "EventBusSourceNotEmptyForDelete",
            name_invalid: "EventBusNameInvalid",
            what: "the event bus",
        },
    )
    .await?;
    Ok(json!({}))
}

pub(super) async fn list_buses(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(list_buses_inner(state, body).await)
}

async fn list_buses_inner(state: Arc<AdminState>, body: Bytes) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let (token, max) = paging(&request)?;
    let s = snapshot(&state).await?;
    let buses: Vec<Value> = s
        .channels
        .buses
        .iter()
        .map(|b| json!({"eventBusName": b.name.get_ref(), "description": null}))
        .collect();
    let (items, next, total) = page(buses, token, max);
    Ok(json!({
        "eventBuses": items,
        "nextToken": next,
        "total": total,
        "maxResults": max,
    }))
}
