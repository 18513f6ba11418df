//! Where every route is mounted: the probes, CloudEvents ingress and webhook sources
//! behind the limits of `[limits]`, and the admin API with the console (here, or on
//! `admin.listen`). Each part sees only its own state.

use std::sync::Arc;

use axum::http::{Method, Uri};
use axum::routing::{get, post};
use axum::Router;

use crate::admin::AdminState;
use crate::app::limits::{CloseConnections, RequestLimits};
use crate::ingress::events::post_events;
use crate::ingress::probes::{live, metrics, ready};
use crate::ingress::state::IngressState;
use crate::problem::Problem;

/// The HTTP application. Tests drive it with `oneshot`, the server with a socket.
///
/// The probes sit outside the load shedder and the concurrency limit: under load the
/// orchestrator must still hear that the process is alive (and ready), or it kills healthy
/// replicas exactly when they are busiest. They are cheap and never wait on the store.
///
/// `admin`: the admin API is served here too (it is not when `admin.listen` gives it an
/// address of its own).
pub fn router(state: Arc<IngressState>, admin: Option<Arc<AdminState>>) -> Router {
    let probes = Router::new()
        .route("/healthz", get(live).fallback(get_only))
        .route("/readyz", get(ready).fallback(get_only))
        .route("/metrics", get(metrics).fallback(get_only))
        .with_state(state.clone());
    let router = probes.merge(limited(state.clone()));
    let router = match admin {
        Some(admin) => router.merge(crate::admin::routes(admin)),
        None => router,
    };
    router.layer(CloseConnections::new(state))
}

/// Everything but the probes, behind the limits of `[limits]`.
fn limited(state: Arc<IngressState>) -> Router {
    let limits = state.limits.clone();
    Router::new()
        .route(
            "/buses/{bus}/events",
            post(post_events)
                .options(crate::ingress::webhooks::handler::bus_options)
                .fallback(|m: Method| async move {
                    Problem::method_not_allowed(m.as_str(), "POST, OPTIONS")
                }),
        )
        .merge(crate::ingress::webhooks::handler::routes())
        .merge(crate::ingress::compat::routes())
        .fallback(|uri: Uri| async move { Problem::not_found(uri.path()) })
        .with_state(state)
        .layer(RequestLimits::new(
            limits.max_concurrent_requests,
            limits.request_timeout,
        ))
}

async fn get_only(m: Method) -> Problem {
    Problem::method_not_allowed(m.as_str(), "GET, HEAD")
}
