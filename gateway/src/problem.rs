//! RFC 9457 problem details: every error the HTTP API returns is `application/problem+json`
//! and names what failed (an attribute, a header, a limit) so a producer can fix its request.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::Value;

pub const PROBLEM_JSON: &str = "application/problem+json";

/// Problem type URIs are relative references into the documentation.
const TYPE_BASE: &str = "https://sluice.dev/problems/";

#[derive(Debug, Clone, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: &'static str,
    pub status: u16,
    pub detail: String,
    /// The attribute, header, field or limit the problem is about.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Extension members (for example the per-entry results of a batch).
    #[serde(flatten, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, Value>,
    #[serde(skip)]
    pub retry_after: Option<u64>,
    #[serde(skip)]
    pub allow: Option<&'static str>,
}

impl Problem {
    fn new(status: StatusCode, slug: &str, title: &'static str, detail: impl Into<String>) -> Self {
        Problem {
            kind: format!("{TYPE_BASE}{slug}"),
            title,
            status: status.as_u16(),
            detail: detail.into(),
            field: None,
            extra: serde_json::Map::new(),
            retry_after: None,
            allow: None,
        }
    }

    pub fn invalid_event(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-event",
            "Invalid CloudEvent",
            detail,
        )
        .with_field(field)
    }

    pub fn bad_request(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            detail,
        )
        .with_field(field)
    }

    pub fn unknown_bus(bus: &str) -> Self {
        Problem::new(
            StatusCode::NOT_FOUND,
            "unknown-bus",
            "Unknown bus",
            format!("no bus named `{bus}` is configured"),
        )
        .with_field("bus")
    }

    pub fn not_found(path: &str) -> Self {
        Problem::new(
            StatusCode::NOT_FOUND,
            "not-found",
            "Not found",
            format!("nothing is served at `{path}`"),
        )
    }

    /// A resource (connector, task, ...) that does not exist.
    pub fn unknown(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    /// A webhook whose signature, token or timestamp does not verify; nothing was stored.
    pub fn unauthorized(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            detail,
        )
        .with_field(field)
    }

    pub fn forbidden(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::FORBIDDEN, "forbidden", "Forbidden", detail).with_field(field)
    }

    pub fn method_not_allowed(method: &str, allow: &'static str) -> Self {
        let mut p = Problem::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method-not-allowed",
            "Method not allowed",
            format!("{method} is not allowed here; use {allow}"),
        )
        .with_field("method");
        p.allow = Some(allow);
        p
    }

    pub fn too_large(limit: &str, detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too-large",
            "Content too large",
            detail,
        )
        .with_field(limit)
    }

    pub fn unsupported_media_type(detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported-media-type",
            "Unsupported media type",
            detail,
        )
        .with_field("content-type")
    }

    pub fn request_timeout(limit: &str) -> Self {
        Problem::new(
            StatusCode::REQUEST_TIMEOUT,
            "request-timeout",
            "Request timeout",
            "the request was not received and answered within the request timeout",
        )
        .with_field(limit)
    }

    /// The store cannot take the write now; nothing of the request was stored.
    pub fn unavailable(detail: impl Into<String>, retry_after: u64) -> Self {
        let mut p = Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            detail,
        );
        p.retry_after = Some(retry_after);
        p
    }

    /// `429` with `Retry-After` (whole seconds, at least 1).
    pub fn rate_limited(field: impl Into<String>, retry_after: std::time::Duration) -> Self {
        let secs = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
        let mut p = Problem::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate-limited",
            "Too many requests",
            format!("over the rate limit; retry in {} s", secs.max(1)),
        )
        .with_field(field);
        p.retry_after = Some(secs.max(1));
        p
    }

    pub fn overloaded() -> Self {
        Problem::unavailable("too many requests in flight; retry shortly".to_string(), 1)
            .with_field("limits.max_concurrent_requests")
    }

    /// The requests in flight hold `limits.max_inflight_bytes`: shed at once.
    pub fn memory_full() -> Self {
        Problem::unavailable(
            "the requests in flight hold as much memory as the gateway may give them (limits.max_inflight_bytes); retry shortly",
            1,
        )
        .with_field("limits.max_inflight_bytes")
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            detail,
        )
    }

    /// A resource of the admin API that does not pass the checks: `pointer` is the field at
    /// fault inside it, as a JSON pointer (RFC 6901; empty for the whole body).
    pub fn invalid_resource(pointer: &str, detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            "invalid-resource",
            "Invalid resource",
            detail,
        )
        .with_field(pointer)
        .with_extra("pointer", Value::String(pointer.to_string()))
    }

    /// Any client error, for refusals that come with a status and a text only.
    pub fn client_error(status: StatusCode, detail: impl Into<String>) -> Self {
        Problem::new(
            status,
            "bad-request",
            status.canonical_reason().unwrap_or("Client Error"),
            detail,
        )
    }

    pub fn conflict(detail: impl Into<String>) -> Self {
        Problem::new(StatusCode::CONFLICT, "conflict", "Conflict", detail)
    }

    pub fn precondition_failed(detail: impl Into<String>) -> Self {
        Problem::new(
            StatusCode::PRECONDITION_FAILED,
            "precondition-failed",
            "Precondition Failed",
            detail,
        )
        .with_field("if-match")
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    pub fn with_extra(mut self, key: &str, value: Value) -> Self {
        self.extra.insert(key.to_string(), value);
        self
    }

    pub fn status(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let body = serde_json::to_vec(&self).unwrap_or_else(|_| b"{}".to_vec());
        let mut response = (self.status(), body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(seconds) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if let Some(allow) = self.allow {
            headers.insert(header::ALLOW, HeaderValue::from_static(allow));
        }
        response
    }
}
