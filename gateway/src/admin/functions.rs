//! WebAssembly functions as resources of the catalog: the component's bytes go up with
//! `PUT /api/v1/functions/{name}` (`application/wasm`, limits, isolation, grants and
//! environment as query parameters), are
//! checked (a component of the `sluice:function/transform` world), kept by their SHA-256,
//! and the catalog names them by it.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};

use crate::admin::resources::*;
use crate::admin::state::{store_problem, AdminState};
use crate::catalog::{self, Snapshot};
use crate::problem::Problem;
use crate::wasm::{FunctionConfig, Grant, Isolation, MAX_COMPONENT_BYTES};

pub(super) async fn list_functions(State(state): State<Arc<AdminState>>) -> Response {
    list(&state, |s| {
        s.channels
            .functions
            .iter()
            .map(|f| function_view(s, f))
            .collect()
    })
    .await
}

pub(super) async fn get_function(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
) -> Response {
    get_one(&state, |s| {
        s.channels
            .functions
            .iter()
            .find(|f| f.name == name)
            .map(|f| {
                (
                    function_view(s, f),
                    s.version_of(&catalog::function_key(&name)),
                )
            })
            .ok_or_else(|| no_function(&name))
    })
    .await
}

/// `GET /api/v1/functions/{name}/component`: the component's bytes.
pub(super) async fn get_component(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
) -> Response {
    let snapshot = match crate::admin::state::snapshot_of(&state).await {
        Ok(s) => s,
        Err(p) => return p.into_response(),
    };
    let Some(sha) = snapshot
        .channels
        .functions
        .iter()
        .find(|f| f.name == name)
        .and_then(|f| f.sha256.clone())
    else {
        return no_function(&name).into_response();
    };
    match state.catalog.store().component(&sha).await {
        Ok(Some(bytes)) => (
            [
                (header::CONTENT_TYPE, "application/wasm".to_string()),
                (header::ETAG, format!("\"{sha}\"")),
            ],
            bytes,
        )
            .into_response(),
        Ok(None) => Problem::unknown(format!(
            "the component of function `{name}` ({sha}) is missing from the store"
        ))
        .into_response(),
        Err(e) => store_problem(&e).into_response(),
    }
}

/// The settings a `PUT` gives as query parameters (the defaults for those it leaves out):
/// `timeout`, `max_memory_bytes`, `max_events`, `max_output_bytes`, `isolation`, `grant`
/// (repeated, or comma-separated) and `env` (repeated, `NAME=value`).
fn with_settings(
    mut f: FunctionConfig,
    query: &[(String, String)],
) -> Result<FunctionConfig, Problem> {
    for (key, value) in query {
        let bad = |why: String| Problem::bad_request(key.clone(), format!("`{key}`: {why}"));
        match key.as_str() {
            "timeout" => f.timeout = crate::values::parse_duration(value).map_err(bad)?,
            "max_memory_bytes" => {
                f.max_memory_bytes = value.parse().map_err(|_| bad("must be a number of bytes".into()))?
            }
            "max_events" => f.max_events = value.parse().map_err(|_| bad("must be a number".into()))?,
            "max_output_bytes" => {
                f.max_output_bytes = value.parse().map_err(|_| bad("must be a number of bytes".into()))?
            }
            "isolation" => {
                f.isolation = match value.as_str() {
                    "batch" => Isolation::Batch,
                    "event" => Isolation::Event,
                    _ => return Err(bad("must be `batch` or `event`".into())),
                }
            }
            "grant" | "grants" => {
                for g in value.split(',').map(str::trim).filter(|g| !g.is_empty()) {
                    let g: Grant = g.parse().map_err(bad)?;
                    if !f.grants.contains(&g) {
                        f.grants.push(g);
                    }
                }
            }
            "env" => {
                let Some((name, v)) = value.split_once('=') else {
                    return Err(bad("must be `NAME=value`".into()));
                };
                f.env.insert(name.to_string(), v.to_string());
            }
            other => {
                return Err(Problem::bad_request(
                    other.to_string(),
                    format!("unknown query parameter `{other}` (timeout, max_memory_bytes, max_events, max_output_bytes, isolation, grant, env)"),
                ))
            }
        }
    }
    f.grants.sort();
    f.check()
        .map_err(|(pointer, m)| Problem::bad_request(pointer.trim_start_matches('/'), m))?;
    Ok(f)
}

/// `PUT /api/v1/functions/{name}`: creates or replaces a function from its component.
pub(super) async fn put_function(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    Query(query): Query<Vec<(String, String)>>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    if let Err(m) = crate::values::check_name(&name) {
        return Problem::bad_request("name", format!("function name: {m}")).into_response();
    }
    let wasm = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(crate::admin::guard::is_wasm_type);
    if !wasm {
        return Problem::unsupported_media_type(
            "a function's body is its WebAssembly component, sent as `Content-Type: application/wasm`",
        )
        .into_response();
    }
    if body.is_empty() {
        return Problem::bad_request("component", "the body is empty: send the component's bytes")
            .into_response();
    }
    if body.len() > MAX_COMPONENT_BYTES {
        return Problem::too_large(
            "component",
            format!("a component may be at most {MAX_COMPONENT_BYTES} bytes"),
        )
        .into_response();
    }
    let sha = crate::wasm::sha256_hex(&body);
    let resource = match with_settings(FunctionConfig::new(&name, &sha, body.len() as u64), &query)
    {
        Ok(f) => f,
        Err(p) => return p.into_response(),
    };
    // Compiled here first: a component that cannot run never reaches the catalog (and
    // its compiled form is then in this replica's cache).
    let check = {
        let (bytes, function) = (body.clone(), resource.clone());
        tokio::task::spawn_blocking(move || crate::wasm::registry().validate(&bytes, &function))
            .await
    };
    match check {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            return Problem::invalid_resource("/component", e.to_string()).into_response()
        }
        Err(e) => {
            return Problem::invalid_resource(
                "/component",
                format!("checking the component failed: {e}"),
            )
            .into_response()
        }
    }
    if let Err(e) = state.catalog.store().put_component(&sha, &body).await {
        return store_problem(&e).into_response();
    }
    put_resource(
        &state,
        &headers,
        function_addressed(&name),
        resource,
        |f: &FunctionConfig| f.name == name,
        |_| Ok(()),
        HashMap::new(),
    )
    .await
}

/// The rules' targets whose transform calls function `name`.
pub(crate) fn users_of(channels: &crate::config::Channels, name: &str) -> Vec<String> {
    let mut users = Vec::new();
    for rule in &channels.rules {
        for target in &rule.targets {
            let calls = target
                .transform()
                .and_then(|t| crate::rules::compile_transform(t).ok())
                .is_some_and(|chain| chain.functions().any(|f| f == name));
            if calls {
                users.push(format!(
                    "rule `{}` on bus `{}` (target `{}`)",
                    rule.name.get_ref(),
                    rule.bus.get_ref(),
                    target.name()
                ));
            }
        }
    }
    users
}

pub(super) async fn delete_function(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let unused = |s: &Snapshot| {
        let users = users_of(&s.channels, &name);
        if users.is_empty() {
            Ok(())
        } else {
            Err(Problem::conflict(format!(
                "function `{name}` is used by {}; change or delete those first",
                users.join(", ")
            )))
        }
    };
    delete_resource(
        &state,
        &headers,
        function_addressed(&name),
        |f: &FunctionConfig| f.name == name,
        unused,
    )
    .await
}
