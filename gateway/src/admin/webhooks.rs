//! Webhook sources as resources of the catalog, with what each replica serves of them.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::resources::*;
use crate::admin::state::{snapshot_of, AdminState};
use crate::catalog;
use crate::ingress::webhooks::config::WebhookConfig;
use crate::problem::Problem;

/// `GET /api/v1/webhooks`: the catalog's webhook sources (every replica serves them) and
/// this replica's own (from its file; shown without their settings, as their secrets may
/// be literal), with whether this replica can serve each.
pub(super) async fn list_webhooks(State(state): State<Arc<AdminState>>) -> Response {
    let snapshot = match snapshot_of(&state).await {
        Ok(s) => s,
        Err(p) => return p.into_response(),
    };
    let webhooks = state.webhooks();
    let mut items: Vec<Value> = Vec::new();
    for (name, bus, preset, origin) in webhooks.list() {
        if origin == crate::ingress::webhooks::source::Origin::File {
            items.push(json!({
                "path": format!("/webhooks/{name}"),
                "name": name,
                "bus": bus,
                "preset": preset,
                "origin": "file",
            }));
        }
    }
    for hook in &snapshot.channels.webhooks {
        let name = hook.name.get_ref();
        if webhooks.in_file(name) {
            continue;
        }
        items.push(served_webhook_view(&snapshot, hook, &webhooks));
    }
    items.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    Json(json!({"version": snapshot.version, "items": items})).into_response()
}

pub(super) async fn get_webhook(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
) -> Response {
    let webhooks = state.webhooks();
    get_one(&state, |s| {
        s.channels
            .webhooks
            .iter()
            .find(|h| *h.name.get_ref() == name)
            .map(|h| {
                (
                    served_webhook_view(s, h, &webhooks),
                    s.version_of(&catalog::webhook_key(&name)),
                )
            })
            .ok_or_else(|| no_webhook(&name))
    })
    .await
}

/// `PUT /api/v1/webhooks/{name}`: creates or replaces a webhook source of the catalog.
/// Refused when this replica's own file declares the name (it would serve the file's), or
/// when a secret's environment variable is not set on this replica (most likely a typo;
/// replicas without it answer that source's requests 503).
pub(super) async fn put_webhook(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: WebhookConfig = match parse_resource(&body, &[("name", &name)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    if state.webhooks().in_file(&name) {
        return Problem::conflict(format!(
            "this replica's configuration file declares webhook source `{name}`; rename one of them"
        ))
        .with_field("name")
        .into_response();
    }
    // The settings first (they name the field), then whether this replica reads the secrets.
    if let Err((pointer, message)) = crate::ingress::webhooks::check::check_catalog(&resource)
        .and_then(|()| {
            crate::ingress::webhooks::check::check_secrets_here(
                &resource,
                state.webhooks().secret_prefix(),
            )
        })
    {
        return Problem::invalid_resource(&pointer, format!("webhook `{name}`: {message}"))
            .into_response();
    }
    let is = |h: &WebhookConfig| *h.name.get_ref() == name;
    let bus = resource.bus.clone();
    put_resource(
        &state,
        &headers,
        webhook_addressed(&name),
        resource,
        is,
        bus_exists(&bus),
        HashMap::new(),
    )
    .await
}

pub(super) async fn delete_webhook(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let is = |h: &WebhookConfig| *h.name.get_ref() == name;
    delete_resource(&state, &headers, webhook_addressed(&name), is, |_| Ok(())).await
}
