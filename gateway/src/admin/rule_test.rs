//! `POST /api/v1/rules/test`: a rule run over sample events, showing what each target
//! would be sent.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::state::{event_field, json_request, snapshot_of, AdminState};
use crate::problem::Problem;

// ---------------------------------------------------------------------------------------
// Rule test

/// `POST /api/v1/rules/test`: `{"event": {...}, "pattern": {...} | "filter": "...",
/// "transform": step-or-chain}` or `{"event": {...}, "rule": "bus/rule", "target": "name"}`.
pub(super) async fn test_rule(
    State(state): State<Arc<AdminState>>,
    body: axum::body::Bytes,
) -> Response {
    const FIELDS: &[&str] = &["event", "pattern", "filter", "transform", "rule", "target"];
    let request = match json_request(&body, FIELDS) {
        Ok(map) => map,
        Err(p) => return p.into_response(),
    };
    let event = match event_field(&request) {
        Ok(e) => e,
        Err(p) => return p.into_response(),
    };
    let mut pattern = request.get("pattern").cloned();
    let mut filter = request
        .get("filter")
        .and_then(Value::as_str)
        .map(str::to_string);
    let mut transform = request.get("transform").cloned();
    if let Some(rule) = request.get("rule") {
        let Some((bus, name)) = rule.as_str().and_then(|r| r.split_once('/')) else {
            return Problem::invalid_resource("/rule", "`rule` is `bus/rule`").into_response();
        };
        let snapshot = match snapshot_of(&state).await {
            Ok(s) => s,
            Err(p) => return p.into_response(),
        };
        let Some(found) = snapshot
            .channels
            .rules
            .iter()
            .find(|r| *r.bus.get_ref() == bus && *r.name.get_ref() == name)
        else {
            return Problem::unknown(format!("no rule `{name}` on bus `{bus}`"))
                .with_field("/rule")
                .into_response();
        };
        pattern = found
            .pattern
            .as_ref()
            .map(|p| serde_json::to_value(p.get_ref()).unwrap_or(Value::Null));
        filter = found.filter.as_ref().map(|f| f.get_ref().clone());
        if let Some(target) = request.get("target").and_then(Value::as_str) {
            let Some(t) = found.targets.iter().find(|t| t.name() == target) else {
                return Problem::unknown(format!("rule `{bus}/{name}` has no target `{target}`"))
                    .with_field("/target")
                    .into_response();
            };
            transform = t
                .transform()
                .map(|v| serde_json::to_value(v).unwrap_or(Value::Null));
        }
    }
    let event_bytes = serde_json::to_vec(event).unwrap_or_default();
    let everything = json!({});
    let condition = match (&pattern, &filter) {
        (Some(_), Some(_)) => {
            return Problem::invalid_resource("/filter", "give a `pattern` or a `filter`, not both")
                .into_response()
        }
        (Some(p), None) => sluice_functions::Condition::Pattern(p),
        (None, Some(f)) => sluice_functions::Condition::Filter(f),
        (None, None) => sluice_functions::Condition::Pattern(&everything),
    };
    let matched = match sluice_functions::test_rule(&event_bytes, condition, None) {
        Ok(answer) => answer["matched"].as_bool().unwrap_or(false),
        Err(e) => return rule_test_problem(&e).into_response(),
    };
    let mut answer = json!({ "matched": matched });
    if let (true, Some(transform)) = (matched, &transform) {
        // Each step on its own, fed the previous step's event: what each one produced.
        let steps: Vec<Value> = match transform {
            Value::Array(steps) => steps.clone(),
            one => vec![one.clone()],
        };
        let chain = match sluice_functions::TransformChain::compile(transform) {
            Ok(chain) => chain,
            Err(e) => {
                return Problem::invalid_resource("/transform", e.to_string()).into_response()
            }
        };
        if chain.calls_functions() {
            return match with_functions(&state, chain, &event_bytes).await {
                Ok(more) => {
                    if let (Value::Object(a), Value::Object(more)) = (&mut answer, more) {
                        a.extend(more);
                    }
                    Json(answer).into_response()
                }
                Err(p) => p.into_response(),
            };
        }
        let mut current = event_bytes.clone();
        let mut outputs = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            let everything = json!({});
            match sluice_functions::test_rule(
                &current,
                sluice_functions::Condition::Pattern(&everything),
                Some(step),
            ) {
                Ok(out) => {
                    let output = out.get("output").cloned().unwrap_or(Value::Null);
                    current = serde_json::to_vec(&output).unwrap_or_default();
                    outputs.push(json!({"step": i, "output": output}));
                }
                Err(e) => {
                    outputs.push(json!({"step": i, "error": e.to_string()}));
                    break;
                }
            }
        }
        if let Some(last) = outputs.last().and_then(|o| o.get("output")).cloned() {
            answer["output"] = last;
        }
        answer["steps"] = Value::Array(outputs);
    }
    Json(answer).into_response()
}

/// A chain that calls functions, run whole as a target's lane runs it (on a blocking
/// thread, with the functions this replica has loaded): every event it makes
/// (`outputs`), and each function call with the events it returned or its error
/// (`functions`).
async fn with_functions(
    state: &AdminState,
    chain: sluice_functions::TransformChain,
    event_bytes: &[u8],
) -> Result<Value, Problem> {
    let snapshot = snapshot_of(state).await?;
    if let Some(missing) = chain
        .functions()
        .find(|f| !snapshot.channels.functions.iter().any(|d| d.name == *f))
    {
        return Err(Problem::invalid_resource(
            "/transform",
            format!("function `{missing}` is not defined"),
        ));
    }
    let stop = tokio::sync::watch::channel(false).1;
    let names: Vec<&str> = chain.functions().collect();
    let ready = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        crate::wasm::registry().ready(&names, stop),
    )
    .await;
    drop(names);
    match ready {
        Ok(Ok(true)) => {}
        Ok(Err(why)) => return Err(Problem::unavailable(why, 5)),
        _ => {
            return Err(Problem::unavailable(
                "the functions of this transform are still loading on this replica; try again",
                5,
            ))
        }
    }
    let event: cloudevents::Event = serde_json::from_slice(event_bytes)
        .map_err(|e| Problem::invalid_resource("/event", format!("not a CloudEvent: {e}")))?;
    let run = tokio::task::spawn_blocking(move || {
        let host = crate::wasm::Host::tracing();
        let result = chain.apply_all(&event, &host);
        let calls = host
            .trace
            .map(|t| t.into_inner().unwrap_or_else(|p| p.into_inner()))
            .unwrap_or_default();
        (result, calls)
    })
    .await
    .map_err(|e| Problem::unavailable(format!("running the functions failed: {e}"), 1))?;
    let (result, calls) = run;
    let mut answer = json!({ "functions": calls });
    match result {
        Ok(outputs) => {
            let outputs: Vec<Value> = outputs
                .into_iter()
                .map(|o| match o {
                    sluice_functions::Output::Event(e) => {
                        sluice_functions::transform::structured(&e).unwrap_or(Value::Null)
                    }
                    sluice_functions::Output::Body { bytes, .. } => serde_json::from_slice(&bytes)
                        .unwrap_or_else(|_| {
                            Value::String(String::from_utf8_lossy(&bytes).into_owned())
                        }),
                })
                .collect();
            if let Some(first) = outputs.first() {
                answer["output"] = first.clone();
            }
            answer["outputs"] = Value::Array(outputs);
        }
        Err(e) => answer["error"] = json!(e.to_string()),
    }
    Ok(answer)
}

pub(super) fn rule_test_problem(e: &sluice_functions::RuleTestError) -> Problem {
    let text = e.to_string();
    let at = match e {
        sluice_functions::RuleTestError::Event(_) => "/event",
        sluice_functions::RuleTestError::Pattern(p) => {
            return Problem::invalid_resource(&format!("/pattern{}", p.pointer), text)
        }
        sluice_functions::RuleTestError::Filter(_) => "/filter",
        _ => "/transform",
    };
    Problem::invalid_resource(at, text)
}
