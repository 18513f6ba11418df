//! The admin API, `/api/v1`: buses, rules and sources as resources of the catalog
//! (create, read, replace, delete, with optimistic concurrency), connectors and tasks
//! (status, lag, positions, pause, resume, restart), the cluster (workers, assignment,
//! strategy), rule tests, and the OpenAPI description of all of it.
//!
//! Resources use the configuration file's field names, as JSON. Each has a `version` (the
//! catalog version at which it last changed) and answers with it as its `ETag`; a write
//! with `If-Match` naming an older version is refused with 412, so of two concurrent
//! writers exactly one wins. Every change is checked by the configuration loader's own
//! checks; a refusal is problem+json naming the field by JSON pointer.
//!
//! Credentials: a bearer token whose SHA-256 is in `admin.tokens` (or the token in
//! `SLUICE_ADMIN_TOKEN`). With none configured the gateway generates one (kept in
//! `{data_dir}/admin-token`, printed at start-up), unless `admin.allow_local_without_token`
//! lets loopback clients in without one (never through a proxy). Before the credentials,
//! `guard` refuses what a browser could send cross-site: a foreign `Host` (DNS
//! rebinding), and for state-changing requests a foreign `Origin` or `Sec-Fetch-Site` and a
//! body that is not JSON. `/api/v1/openapi.json` and `/api/v1/scaling` (read by
//! autoscalers) are open, like `/metrics`.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

pub mod actions;
pub mod apply;
pub mod auth;
pub mod connectors;
pub mod console;
pub mod eventbridge;
pub mod events;
pub mod functions;
pub mod guard;
pub mod replays;
pub mod resources;
pub mod rule_test;
pub mod state;
pub mod webhooks;

use std::sync::Arc;

use axum::http::header;
use axum::middleware::{self};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::admin::actions::{connector_action, source_action, source_task_action, task_action};
use crate::admin::apply::apply;
use crate::admin::connectors::{cluster, get_connector, list_connectors};
use crate::admin::events::{recent_events, redeliver};
use crate::admin::guard::{authorize, guard, problem_rejections};
use crate::admin::replays::{cancel_replay, get_replay, list_replays, start_replay};
use crate::admin::resources::{
    delete_bus, delete_rule, delete_source, get_bus, get_catalog, get_rule, get_source, list_buses,
    list_rules, list_sources, put_bus, put_rule, put_source,
};
use crate::admin::rule_test::test_rule;
use crate::admin::webhooks::{delete_webhook, get_webhook, list_webhooks, put_webhook};
use crate::problem::Problem;

pub use auth::{hash_token, parse_hash, AdminAuth, LocalAddr, TOKEN_FILE};
pub use state::AdminState;

/// The OpenAPI description of `/api/v1`, kept in `schemas/` and checked against the
/// routes by the tests.
pub const OPENAPI: &str = include_str!("../../../schemas/openapi.json");

/// The largest admin request body.
const MAX_BODY: usize = 1024 * 1024;

/// The routes of `/api/v1` (and the older `/admin/*` aliases), with their credentials.
pub fn routes(state: Arc<AdminState>) -> Router {
    let open = Router::new()
        .route("/api/v1/openapi.json", get(openapi))
        .merge(crate::scaling::within_limits(
            Router::new()
                .route(
                    "/api/v1/scaling",
                    get(crate::scaling::handler::<AdminState>),
                )
                .with_state(state.clone()),
            &state.ingress.limits,
        ))
        // The console's files need no token (it asks for one when the API does), but they
        // are answered only under a `Host` of this gateway, like the API.
        .merge(console::routes().layer(middleware::from_fn_with_state(state.clone(), guard)));
    let guarded = Router::new()
        .route("/api/v1/catalog", get(get_catalog))
        .route("/api/v1/catalog/apply", post(apply))
        .route("/api/v1/buses", get(list_buses))
        .route(
            "/api/v1/buses/{bus}",
            get(get_bus).put(put_bus).delete(delete_bus),
        )
        .route("/api/v1/buses/{bus}/rules", get(list_rules))
        .route(
            "/api/v1/buses/{bus}/rules/{rule}",
            get(get_rule).put(put_rule).delete(delete_rule),
        )
        .route("/api/v1/sources", get(list_sources))
        .route(
            "/api/v1/sources/{source}",
            get(get_source).put(put_source).delete(delete_source),
        )
        .route("/api/v1/sources/{source}/{action}", post(source_action))
        .route(
            "/api/v1/sources/{source}/tasks/{index}/{action}",
            post(source_task_action),
        )
        .route("/api/v1/connectors", get(list_connectors))
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}",
            get(get_connector),
        )
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}/{action}",
            post(connector_action),
        )
        .route(
            "/api/v1/connectors/{bus}/{rule}/{target}/tasks/{shard}/{action}",
            post(task_action),
        )
        .route("/api/v1/cluster", get(cluster))
        .route("/api/v1/webhooks", get(list_webhooks))
        .route(
            "/api/v1/webhooks/{name}",
            get(get_webhook).put(put_webhook).delete(delete_webhook),
        )
        .route(
            "/api/v1/buses/{bus}/replays",
            get(list_replays).post(start_replay),
        )
        .route(
            "/api/v1/buses/{bus}/replays/{replay}",
            get(get_replay).delete(cancel_replay),
        )
        .route("/api/v1/buses/{bus}/events", get(recent_events))
        .route(
            "/api/v1/buses/{bus}/rules/{rule}/redeliver",
            post(redeliver),
        )
        .route("/api/v1/rules/test", post(test_rule))
        .route("/api/v1/functions", get(functions::list_functions))
        .route(
            "/api/v1/functions/{name}",
            get(functions::get_function)
                .put(functions::put_function)
                .delete(functions::delete_function)
                .layer(axum::extract::DefaultBodyLimit::max(
                    crate::wasm::MAX_COMPONENT_BYTES,
                )),
        )
        .route(
            "/api/v1/functions/{name}/component",
            get(functions::get_component),
        )
        .merge(actions::routes())
        .merge(eventbridge::routes())
        .with_state(state.clone())
        .layer(middleware::from_fn_with_state(state.clone(), authorize))
        // Before the credentials: what a browser sends cross-site is refused whoever it is.
        .layer(middleware::from_fn_with_state(state, guard))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .layer(middleware::from_fn(problem_rejections));
    open.merge(guarded)
}

/// The admin API alone, for `admin.listen`.
pub fn admin_router(state: Arc<AdminState>) -> Router {
    routes(state).fallback(|uri: axum::http::Uri| async move { Problem::not_found(uri.path()) })
}

async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

#[cfg(test)]
mod auth_tests;
