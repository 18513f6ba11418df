//! `EventRuleController`: `/rule/createEventRule`, `getEventRule`, `updateEventRule`,
//! `deleteEventRule`, `listEventRules`, `enableEventRule` and `disableEventRule` (and the
//! shorter names), each write through `PUT`/`DELETE /api/v1/buses/{bus}/rules/{rule}`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use serde_json::{json, Map, Value};

use crate::admin::resources;
use crate::admin::state::AdminState;
use crate::catalog;

use crate::admin::eventbridge::convert::{
    connector_id, parse_pattern, pattern_json, rule_body, rule_dto, status, target_dtos,
    targets_json,
};
use crate::admin::eventbridge::dto::{answer, body_of, bus_name, rule_name, string_field, EbError};
use crate::admin::eventbridge::paging::{page, paging};
use crate::admin::eventbridge::v1::{
    find_rule, outcome, passed_on, paused, require_bus, snapshot, store_error, Context,
};

/// How often a read-modify-write is tried again when another writer came first.
const ATTEMPTS: usize = 4;

fn rule_context<'a>(bus: &str, rule: &str, what: &'a str) -> Context<'a> {
    Context {
        missing: EbError::rule_missing(bus, rule),
        exists: Some(EbError::new(
            "EventRuleAlreadyExist",
            format!("The event rule [{rule}] of event bus [{bus}] already existed!"),
        )),
        conflict: "RequestParameterInvalid",
        name_invalid: "EventRuleNameInvalid",
        what,
    }
}

/// Writes the rule through `PUT /api/v1/buses/{bus}/rules/{rule}` with `headers`.
async fn put_rule(
    state: &Arc<AdminState>,
    bus: &str,
    rule: &str,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(), EbError> {
    let response = resources::put_rule(
        State(state.clone()),
        Path((bus.to_string(), rule.to_string())),
        headers,
        body,
    )
    .await;
    outcome(response, rule_context(bus, rule, "the event rule")).await
}

pub(super) async fn create_rule(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(create_rule_inner(state, headers, body).await)
}

async fn create_rule_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let rule = rule_name(&request)?;
    string_field(&request, "description")?;
    let pattern = parse_pattern(&request)?;
    let s = snapshot(&state).await?;
    require_bus(&s, &bus)?;
    let mut headers = passed_on(&headers);
    headers.insert(header::IF_NONE_MATCH, HeaderValue::from_static("*"));
    put_rule(
        &state,
        &bus,
        &rule,
        headers,
        rule_body(&pattern, Vec::new())?,
    )
    .await?;
    Ok(json!({ "eventRuleName": rule }))
}

pub(super) async fn get_rule(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(get_rule_inner(state, body).await)
}

async fn get_rule_inner(state: Arc<AdminState>, body: Bytes) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let name = rule_name(&request)?;
    let s = snapshot(&state).await?;
    let rule = find_rule(&s, &bus, &name)?;
    let paused = paused(&state).await?;
    let mut dto = rule_dto(
        rule,
        status(rule, &paused),
        s.version_of(&catalog::rule_key(&bus, &name)),
    );
    dto["eventTargets"] = Value::Array(target_dtos(rule));
    Ok(dto)
}

pub(super) async fn update_rule(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(update_rule_inner(state, headers, body).await)
}

async fn update_rule_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let name = rule_name(&request)?;
    string_field(&request, "description")?;
    let pattern = parse_pattern(&request)?;
    modify_rule(&state, &headers, &bus, &name, |_, targets| {
        Ok((pattern.clone(), targets))
    })
    .await?;
    Ok(json!({}))
}

/// Reads the rule, changes its pattern and targets with `change`, and writes it back
/// under `If-Match` of the version read (the caller's own `If-Match` when it sent one).
/// Another writer in between: read again and retry, a few times.
pub(super) async fn modify_rule(
    state: &Arc<AdminState>,
    headers: &HeaderMap,
    bus: &str,
    name: &str,
    change: impl Fn(Map<String, Value>, Vec<Value>) -> Result<(Map<String, Value>, Vec<Value>), EbError>,
) -> Result<(), EbError> {
    let caller = passed_on(headers);
    let mut last = None;
    for _ in 0..ATTEMPTS {
        let s = snapshot(state).await?;
        let rule = find_rule(&s, bus, name)?;
        let (pattern, targets) = change(pattern_json(rule)?, targets_json(rule))?;
        let mut headers = caller.clone();
        if !headers.contains_key(header::IF_MATCH) {
            let version = s.version_of(&catalog::rule_key(bus, name));
            if let Ok(v) = HeaderValue::from_str(&format!("\"{version}\"")) {
                headers.insert(header::IF_MATCH, v);
            }
        }
        match put_rule(state, bus, name, headers, rule_body(&pattern, targets)?).await {
            Err(e) if e.code == "PreconditionFailed" && !caller.contains_key(header::IF_MATCH) => {
                last = Some(e);
            }
            other => return other,
        }
    }
    Err(last.unwrap_or_else(|| {
        EbError::new(
            "InternalError",
            "the catalog kept changing under this request; try again",
        )
    }))
}

pub(super) async fn delete_rule(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(delete_rule_inner(state, headers, body).await)
}

async fn delete_rule_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let name = rule_name(&request)?;
    let s = snapshot(&state).await?;
    find_rule(&s, &bus, &name)?;
    let response = resources::delete_rule(
        State(state.clone()),
        Path((bus.clone(), name.clone())),
        passed_on(&headers),
    )
    .await;
    outcome(response, rule_context(&bus, &name, "the event rule")).await?;
    Ok(json!({}))
}

pub(super) async fn list_rules(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(list_rules_inner(state, body).await)
}

async fn list_rules_inner(state: Arc<AdminState>, body: Bytes) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let (token, max) = paging(&request)?;
    let s = snapshot(&state).await?;
    require_bus(&s, &bus)?;
    let paused = paused(&state).await?;
    let rules: Vec<Value> = s
        .channels
        .rules
        .iter()
        .filter(|r| *r.bus.get_ref() == bus)
        .map(|r| {
            rule_dto(
                r,
                status(r, &paused),
                s.version_of(&catalog::rule_key(&bus, r.name.get_ref())),
            )
        })
        .collect();
    let (items, next, total) = page(rules, token, max);
    Ok(json!({
        "eventRules": items,
        "nextToken": next,
        "total": total,
        "maxResults": max,
    }))
}

pub(super) async fn enable_rule(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(set_enabled(state, body, true).await)
}

pub(super) async fn disable_rule(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(set_enabled(state, body, false).await)
}

/// Resumes (enable) or pauses (disable) every target's connector of the rule.
async fn set_enabled(state: Arc<AdminState>, body: Bytes, enable: bool) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let name = rule_name(&request)?;
    let s = snapshot(&state).await?;
    let rule = find_rule(&s, &bus, &name)?;
    for target in &rule.targets {
        state
            .cluster
            .set_paused(&connector_id(&bus, &name, target.name()), !enable)
            .await
            .map_err(|e| store_error(&e))?;
    }
    Ok(json!({}))
}
