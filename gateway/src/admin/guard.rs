//! The admin API's middleware: `guard` refuses before the credentials what a browser could
//! send cross-site (a foreign `Host`, `Origin` or `Sec-Fetch-Site`, a body that is not JSON),
//! `authorize` checks the credentials, and `problem_rejections` makes axum's own refusals
//! problem+json like every other error of the API.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::admin::auth::{json_type, request_host, LocalAddr, PROXY_HEADERS};
use crate::admin::state::AdminState;
use crate::problem::Problem;

/// What a browser could send from another site, refused before anything else: a `Host`
/// this gateway does not answer to (DNS rebinding), and for state-changing methods a
/// foreign `Origin` or `Sec-Fetch-Site`, and a body that is not JSON (a "simple" request
/// needs no preflight only with `text/plain`, forms or no type). No answer of the admin API
/// carries CORS permissions.
pub(super) async fn guard(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Response {
    let auth = &state.auth;
    let host = request_host(&request);
    let local = request.extensions().get::<LocalAddr>().map(|l| l.0);
    if !auth.host_allowed(host.as_deref(), local) {
        return Problem::forbidden(
            "host",
            format!(
                "the admin API does not answer to the host `{}`: add it to admin.allowed_hosts",
                host.as_deref().unwrap_or("")
            ),
        )
        .into_response();
    }
    let method = request.method();
    let safe = method == axum::http::Method::GET
        || method == axum::http::Method::HEAD
        || method == axum::http::Method::OPTIONS;
    if !safe {
        let headers = request.headers();
        let origin = headers
            .get(header::ORIGIN)
            .map(|v| v.to_str().unwrap_or("null"));
        if let Some(origin) = origin {
            if !auth.origin_allowed(origin, host.as_deref()) {
                return Problem::forbidden(
                    "origin",
                    format!("the admin API does not take changes from the origin `{origin}` (its own origin and admin.allowed_origins only)"),
                )
                .into_response();
            }
        }
        let fetch_site = headers
            .get("sec-fetch-site")
            .map(|v| v.to_str().unwrap_or("").to_ascii_lowercase());
        if let Some(site) = fetch_site {
            let listed = origin.is_some_and(|o| auth.origin_listed(o));
            if site != "same-origin" && site != "none" && !listed {
                return Problem::forbidden(
                    "sec-fetch-site",
                    format!("the admin API does not take changes sent {site} by a browser"),
                )
                .into_response();
            }
        }
        // A function's component goes up as `application/wasm`: not a type a browser
        // sends cross-site without a preflight (which no answer here permits).
        let component = method == axum::http::Method::PUT
            && request.uri().path().starts_with("/api/v1/functions/");
        match headers.get(header::CONTENT_TYPE).map(|v| v.to_str()) {
            Some(Ok(t)) if json_type(t) => {}
            Some(Ok(t)) if component && is_wasm_type(t) => {}
            Some(t) => {
                return Problem::unsupported_media_type(format!(
                    "the admin API reads JSON bodies (`Content-Type: application/json`), not `{}`",
                    t.unwrap_or("?")
                ))
                .into_response()
            }
            None if has_body(&request) => {
                return Problem::unsupported_media_type(
                    "a request body needs `Content-Type: application/json`",
                )
                .into_response()
            }
            None => {}
        }
    }
    let mut response = next.run(request).await;
    let cors: Vec<_> = response
        .headers()
        .keys()
        .filter(|k| k.as_str().starts_with("access-control-allow-"))
        .cloned()
        .collect();
    for name in cors {
        response.headers_mut().remove(name);
    }
    response
}

/// `application/wasm`, parameters aside.
pub(super) fn is_wasm_type(t: &str) -> bool {
    t.split(';')
        .next()
        .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/wasm"))
}

/// Whether a request carries a body (a length above zero, chunked, or an HTTP/2 stream
/// that has not ended).
pub(super) fn has_body(request: &Request) -> bool {
    use axum::body::HttpBody as _;
    let length = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match length {
        Some(n) => n > 0,
        None => {
            request.headers().contains_key(header::TRANSFER_ENCODING)
                || !request.body().is_end_stream()
        }
    }
}

/// Lets a request through with an accepted token, or from loopback when the operator
/// opted in to no token (never through a proxy); else 401 with a `Bearer` challenge or 403.
pub(super) async fn authorize(
    State(state): State<Arc<AdminState>>,
    request: Request,
    next: Next,
) -> Response {
    let auth = &state.auth;
    let token = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    if auth.hashes.is_empty() && auth.allow_local {
        if let Some(name) = PROXY_HEADERS
            .iter()
            .find(|h| request.headers().contains_key(**h))
        {
            return Problem::forbidden(
                *name,
                "the request came through a proxy, so its peer address does not tell whether its client is local; the admin API answers it only with a token (admin.tokens or SLUICE_ADMIN_TOKEN)",
            )
            .into_response();
        }
        let peer = request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0);
        // `::ffff:127.0.0.1` on a `[::]` listener is loopback too.
        if peer.is_some_and(|p| p.ip().to_canonical().is_loopback()) {
            return next.run(request).await;
        }
        return Problem::forbidden(
            "admin.allow_local_without_token",
            "the admin API has no token configured (admin.tokens or SLUICE_ADMIN_TOKEN) and answers only clients on loopback",
        )
        .into_response();
    }
    match token {
        Some(token) if auth.accepts(token) => next.run(request).await,
        Some(_) => with_challenge(Problem::unauthorized(
            "authorization",
            "the bearer token is not one the admin API accepts",
        )),
        None => with_challenge(Problem::unauthorized(
            "authorization",
            "the admin API needs `Authorization: Bearer <token>`",
        )),
    }
}

pub(super) fn with_challenge(problem: Problem) -> Response {
    let mut response = problem.into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sluice-admin\""),
    );
    response
}

/// Marks a refusal already in the form of the API it answers for (RocketMQ EventBridge's
/// `BaseResponse`, `admin/eventbridge/`): `problem_rejections` leaves it as it is.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OwnForm;

/// Axum's own refusals (a body over the limit, a path parameter that is not a number) are
/// plain text: made problem+json like every other error of the API.
pub(super) async fn problem_rejections(request: Request, next: Next) -> Response {
    let response = next.run(request).await;
    let status = response.status();
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/problem+json"));
    let own_form = response.extensions().get::<OwnForm>().is_some();
    if !status.is_client_error() || is_problem || own_form {
        return response;
    }
    let bytes = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    Problem::client_error(status, String::from_utf8_lossy(&bytes).trim().to_string())
        .into_response()
}
