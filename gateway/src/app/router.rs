//! Where every route is mounted: the probes, CloudEvents ingress and webhook sources
//! behind the limits of `[limits]`, and the admin API with the console (here, or on
//! `admin.listen`). Each part sees only its own state.

use std::sync::Arc;
use std::time::Duration;

use axum::error_handling::HandleErrorLayer;
use axum::extract::{Request, State};
use axum::http::{Method, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use tower::ServiceBuilder;

use crate::admin::AdminState;
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
    router.layer(middleware::from_fn_with_state(state, close_when_draining))
}

/// While draining, every answer says `Connection: close`: clients open their next request
/// elsewhere instead of reusing a kept-alive connection that is about to close (which
/// would fail a request already on its way). HTTP/2 gets a GOAWAY at the close instead.
/// So does a `413`: the body it refused was not read to its end, so the connection cannot
/// carry another request, and a client that reused it would lose that request.
async fn close_when_draining(
    State(state): State<Arc<IngressState>>,
    request: Request,
    next: Next,
) -> Response {
    let mut response = next.run(request).await;
    if state.draining() || response.status() == http::StatusCode::PAYLOAD_TOO_LARGE {
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    response
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
        .layer(
            ServiceBuilder::new()
                .layer(HandleErrorLayer::new(|_: tower::BoxError| async {
                    Problem::overloaded()
                }))
                .load_shed()
                // `Router::layer` layers each route on its own: a plain concurrency limit
                // would be one limit per route. The global one shares one semaphore.
                .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
                    limits.max_concurrent_requests,
                ))
                .layer(middleware::from_fn_with_state(
                    limits.request_timeout,
                    request_timeout,
                )),
        )
}

async fn get_only(m: Method) -> Problem {
    Problem::method_not_allowed(m.as_str(), "GET, HEAD")
}

async fn request_timeout(State(limit): State<Duration>, request: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(request)).await {
        Ok(response) => response,
        Err(_) => Problem::request_timeout("limits.request_timeout").into_response(),
    }
}
