//! `EventTargetController`: `/target/createEventTargets`, `updateEventTargets`,
//! `deleteEventTargets` and `listEventTargets`, each a read-modify-write of the rule's
//! targets.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{json, Value};

use crate::admin::state::AdminState;

use crate::admin::eventbridge::convert::{
    connector_id, status, target_dtos, targets_of, PENDING_TARGET,
};
use crate::admin::eventbridge::dto::{
    answer, body_of, bus_name, field, kind_of, rule_name, EbError,
};
use crate::admin::eventbridge::rules::modify_rule;
use crate::admin::eventbridge::v1::{find_rule, paused, snapshot, store_error};

fn target_name(target: &Value) -> &str {
    target["name"].as_str().unwrap_or("")
}

fn target_missing(target: &str, rule: &str, bus: &str) -> EbError {
    EbError::new(
        "EventTargetNotExist",
        format!("The event target [{target}] of event rule [{rule}] on eventbus [{bus}] is not existed!"),
    )
}

pub(super) async fn create_targets(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(write_targets(state, headers, body, Write::Create).await)
}

pub(super) async fn update_targets(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(write_targets(state, headers, body, Write::Update).await)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Write {
    Create,
    Update,
}

async fn write_targets(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
    write: Write,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let rule = rule_name(&request)?;
    let new = targets_of(&request)?;
    // New targets of a disabled rule start paused, before they exist: they never deliver
    // until the rule is enabled.
    let s = snapshot(&state).await?;
    let current = find_rule(&s, &bus, &rule)?;
    if write == Write::Create && status(current, &paused(&state).await?) == "DISABLE" {
        for (name, _) in &new {
            state
                .cluster
                .set_paused(&connector_id(&bus, &rule, name), true)
                .await
                .map_err(|e| store_error(&e))?;
        }
    }
    modify_rule(&state, &headers, &bus, &rule, |pattern, mut targets| {
        for (name, target) in &new {
            let at = targets.iter().position(|t| target_name(t) == name);
            match (write, at) {
                (Write::Create, Some(_)) => {
                    return Err(EbError::new(
                        "EventTargetAlreadyExist",
                        format!("The event target [{name}] of event rule [{rule}] on eventbus [{bus}] already existed!"),
                    ))
                }
                (Write::Create, None) => targets.push(target.clone()),
                (Write::Update, Some(i)) => {
                    // What the project's DTO cannot say (headers, auth, transform...) is
                    // kept from the target as it was.
                    let mut merged = targets[i].clone();
                    if merged["type"] != target["type"] {
                        merged = target.clone();
                    } else if let (Value::Object(m), Value::Object(t)) = (&mut merged, target) {
                        m.extend(t.clone());
                    }
                    targets[i] = merged;
                }
                (Write::Update, None) => return Err(target_missing(name, &rule, &bus)),
            }
        }
        Ok((pattern, targets))
    })
    .await?;
    Ok(json!({}))
}

pub(super) async fn delete_targets(
    State(state): State<Arc<AdminState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    answer(delete_targets_inner(state, headers, body).await)
}

async fn delete_targets_inner(
    state: Arc<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let rule = rule_name(&request)?;
    let names: Vec<String> = match field(&request, "eventTargetNames") {
        Some(Value::Array(list)) if !list.is_empty() && list.len() <= 64 => list
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    EbError::invalid("`eventTargetNames` must be an array of strings")
                })
            })
            .collect::<Result<_, _>>()?,
        Some(Value::Array(list)) if !list.is_empty() => {
            return Err(EbError::invalid(
                "`eventTargetNames` lists more than 64 names",
            ))
        }
        Some(Value::Array(_)) | None => {
            return Err(EbError::invalid(
                "`eventTargetNames` must name at least one target",
            ))
        }
        Some(other) => {
            return Err(EbError::invalid(format!(
                "`eventTargetNames` must be an array, not {}",
                kind_of(other)
            )))
        }
    };
    // When the last target goes, the stand-in of a rule without targets takes its place; a
    // disabled rule stays disabled.
    let s = snapshot(&state).await?;
    let disabled = status(find_rule(&s, &bus, &rule)?, &paused(&state).await?) == "DISABLE";
    let emptied = std::sync::atomic::AtomicBool::new(false);
    modify_rule(&state, &headers, &bus, &rule, |pattern, mut targets| {
        for name in &names {
            let Some(i) = targets.iter().position(|t| target_name(t) == name) else {
                return Err(target_missing(name, &rule, &bus));
            };
            targets.remove(i);
        }
        emptied.store(targets.is_empty(), std::sync::atomic::Ordering::Relaxed);
        Ok((pattern, targets))
    })
    .await?;
    if disabled && emptied.load(std::sync::atomic::Ordering::Relaxed) {
        state
            .cluster
            .set_paused(&connector_id(&bus, &rule, PENDING_TARGET), true)
            .await
            .map_err(|e| store_error(&e))?;
    }
    Ok(json!({}))
}

pub(super) async fn list_targets(State(state): State<Arc<AdminState>>, body: Bytes) -> Response {
    answer(list_targets_inner(state, body).await)
}

async fn list_targets_inner(state: Arc<AdminState>, body: Bytes) -> Result<Value, EbError> {
    let request = body_of(&body)?;
    let bus = bus_name(&request)?;
    let name = rule_name(&request)?;
    let s = snapshot(&state).await?;
    let rule = find_rule(&s, &bus, &name)?;
    Ok(json!({
        "eventBusName": bus,
        "eventRuleName": name,
        "eventTargets": target_dtos(rule),
    }))
}
