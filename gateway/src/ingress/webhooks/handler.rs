//! `POST /webhooks/{name}`: a provider's request verified, mapped to a CloudEvent and
//! stored through ingress's one path; the providers' handshakes and CORS preflights.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::ingress::state::IngressState;
use crate::ingress::webhooks::probe::{self};
use crate::ingress::webhooks::source::{Inputs, Webhook};
use crate::ingress::webhooks::verify::{self, Algorithm, Signed};
use crate::problem::Problem;

// ---------------------------------------------------------------------------------------
// HTTP

pub fn routes() -> Router<Arc<IngressState>> {
    Router::new().route(
        "/webhooks/{name}",
        post(receive)
            .options(webhook_options)
            .fallback(|m: Method| async move {
                Problem::method_not_allowed(m.as_str(), "POST, OPTIONS")
            }),
    )
}

pub(super) const REQUEST_ORIGIN: &str = "webhook-request-origin";

/// The CloudEvents Web Hook abuse-protection handshake (CloudEvents HTTP Web Hook §4):
/// `OPTIONS` with `WebHook-Request-Origin` is answered with `WebHook-Allowed-Origin` (and
/// `WebHook-Allowed-Rate` when configured) if the origin is allowed.
pub(super) fn handshake(headers: &HeaderMap, allowed: &[String], rate: Option<u32>) -> Response {
    let mut response = StatusCode::OK.into_response();
    response
        .headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("POST, OPTIONS"));
    let Some(origin) = headers.get(REQUEST_ORIGIN) else {
        return response;
    };
    let permitted = allowed.is_empty()
        || origin
            .to_str()
            .is_ok_and(|o| allowed.iter().any(|a| a == o || a == "*"));
    if !permitted {
        return Problem::forbidden(
            REQUEST_ORIGIN,
            "this origin may not deliver to this endpoint",
        )
        .into_response();
    }
    let h = response.headers_mut();
    h.insert("webhook-allowed-origin", origin.clone());
    if let Some(rate) = rate {
        h.insert("webhook-allowed-rate", HeaderValue::from(rate));
    }
    response
}

/// `OPTIONS /buses/{bus}/events`: any origin, no announced rate.
pub async fn bus_options(
    State(state): State<Arc<IngressState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
) -> Response {
    if !state.settings().buses.contains_key(&bus) {
        return Problem::unknown_bus(&bus).into_response();
    }
    handshake(&headers, &[], None)
}

pub(super) async fn webhook_options(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let settings = state.settings();
    let webhooks = &settings.webhooks;
    let Some((hook, _)) = webhooks.by_name.get(&name) else {
        return unknown_webhook(&name).into_response();
    };
    handshake(&headers, &hook.allowed_origins, hook.allowed_rate)
}

pub(super) fn unknown_webhook(name: &str) -> Problem {
    Problem::unknown(format!("no webhook source named `{name}` is configured")).with_field("name")
}

/// Text that may go in a `ce-*` header: everything outside printable ASCII (and `%`,
/// `"`) percent-encoded, as binary mode expects.
pub(super) fn ce_value(text: &str) -> Option<HeaderValue> {
    HeaderValue::from_str(&crate::event::header_text(text)).ok()
}

pub(super) fn generated_id() -> String {
    format!("{:016x}{:016x}", fastrand::u64(..), fastrand::u64(..))
}

pub(super) async fn receive(
    State(state): State<Arc<IngressState>>,
    Path(name): Path<String>,
    request: Request,
) -> Response {
    // Everything the request needs of the running catalog, read once.
    let settings = state.settings();
    let webhooks = &settings.webhooks;
    let Some(hook) = webhooks.by_name.get(&name).map(|(h, _)| h.clone()) else {
        if let Some(why) = webhooks.unavailable.get(&name) {
            return Problem::unavailable(
                format!("webhook source `{name}` cannot verify requests on this replica: {why}"),
                30,
            )
            .with_field("verify")
            .into_response();
        }
        return unknown_webhook(&name).into_response();
    };
    let Some(log) = settings.buses.get(&hook.bus).cloned() else {
        return Problem::unknown_bus(&hook.bus).into_response();
    };
    let (parts, body) = request.into_parts();
    // Webhook bodies are read for a few fields without a JSON tree.
    let Some(_memory) = state.reserve_memory(&parts.headers, state.limits.max_event_bytes, false)
    else {
        crate::ingress::accept::discard_body(body, state.limits.max_event_bytes).await;
        return Problem::memory_full().into_response();
    };
    let body = match crate::ingress::accept::read_body(
        &parts.headers,
        body,
        state.limits.max_event_bytes,
        "limits.max_event_bytes",
    )
    .await
    {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let called = match &hook.url {
        Some(url) => url.clone(),
        None => format!(
            "http://{}{}",
            parts
                .headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .unwrap_or("localhost"),
            parts.uri.path_and_query().map_or("/", |p| p.as_str())
        ),
    };
    // A configured URL is the base: the provider's query string (Twilio's bodySHA256) is
    // what it signed.
    let called = match (&hook.url, parts.uri.query()) {
        (Some(_), Some(q)) if !called.contains('?') => format!("{called}?{q}"),
        _ => called,
    };
    let now = chrono::Utc::now().timestamp();
    let signed = Signed {
        method: parts.method.as_str(),
        url: &called,
        headers: &parts.headers,
        body: &body,
        now,
    };
    if let Err(e) = hook.scheme.verify(&signed, &hook.secrets, hook.tolerance) {
        tracing::debug!(webhook = %hook.name, field = %e.field, "webhook refused: {}", e.message);
        return Problem::unauthorized(e.field, e.message).into_response();
    }
    // Counted after verification: unsigned floods do not eat the provider's budget.
    if let Some(limit) = &hook.rate_limit {
        if let Err(problem) = state
            .rate_limit(&format!("webhook/{}", hook.name), "rate_limit", limit)
            .await
        {
            return problem.into_response();
        }
    }
    let content_type = parts
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let json = content_type
        .as_deref()
        .map(crate::event::http::essence)
        .is_none_or(|e| crate::event::is_json(&e));
    // Only the fields this source reads, without building the document.
    let fields = if json {
        hook.paths.read(&body)
    } else {
        hook.paths.nothing()
    };
    if let Some(answer) = provider_handshake(&hook, &signed, &fields) {
        return answer;
    }
    let inputs = Inputs {
        headers: &parts.headers,
        json: &fields,
    };
    let (provider_id, kind, time) = hook.attributes(&inputs);
    let id = provider_id.clone().unwrap_or_else(generated_id);
    let mut ce = HeaderMap::new();
    let mut attributes = vec![
        ("ce-specversion", "specversion", "1.0".to_string()),
        ("ce-id", "id", id.clone()),
        ("ce-source", "source", hook.source.clone()),
        ("ce-type", "type", kind),
    ];
    if let Some(t) = time {
        attributes.push(("ce-time", "time", t));
    }
    for (name, field, value) in attributes {
        match ce_value(&value) {
            Some(v) => {
                ce.insert(HeaderName::from_static(name), v);
            }
            None => {
                return Problem::bad_request(field, "the value cannot be carried").into_response()
            }
        }
    }
    for (ext, from) in &hook.extensions {
        if let Some(value) = inputs.header(from) {
            let Ok(name) = HeaderName::from_bytes(format!("ce-{ext}").as_bytes()) else {
                continue;
            };
            match ce_value(&value) {
                Some(v) => {
                    ce.insert(name, v);
                }
                None => return Problem::bad_request(from.clone(), "not carried").into_response(),
            }
        }
    }
    if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
        ce.insert(header::CONTENT_TYPE, ct.clone());
    }
    let parsed = crate::event::http::from_binary(&ce, &body);
    let parsed = match settings.schemas.get(&hook.bus) {
        Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
        None => parsed,
    };
    let entry = crate::ingress::accept::entry(parsed, log.shards(), &state.limits);
    if let Err(e) = &entry {
        return crate::ingress::accept::event_problem(e.clone()).into_response();
    }
    // Deduplicate only on the provider's own id: a generated one never repeats.
    let key = provider_id
        .filter(|_| !hook.dedup_window.is_zero())
        .map(|id| crate::store::dedup::key(&["webhook", &hook.name, &id]));
    let entries = [entry];
    let (stored, duplicate) = match key {
        None => (
            crate::ingress::accept::store(log.as_ref(), &entries).await,
            false,
        ),
        Some(key) => match crate::ingress::accept::store_unique(
            log.as_ref(),
            webhooks.dedup.as_ref(),
            &entries,
            &[Some(key)],
            hook.dedup_window,
        )
        .await
        {
            Ok((stored, duplicates)) => (stored, duplicates.first() == Some(&true)),
            Err(e) => return crate::ingress::accept::store_problem(&e).into_response(),
        },
    };
    if duplicate {
        return (
            StatusCode::OK,
            Json(json!({"id": id, "status": "duplicate"})),
        )
            .into_response();
    }
    match stored.into_iter().next().flatten() {
        Some(Ok(())) => (
            StatusCode::ACCEPTED,
            Json(json!({"id": id, "status": "accepted"})),
        )
            .into_response(),
        // The same delivery is being stored by another request: its retry gets the answer.
        Some(Err(e @ crate::store::StoreError::Busy(_))) => {
            crate::ingress::accept::store_problem(&e)
                .with_field("id")
                .into_response()
        }
        Some(Err(e)) => crate::ingress::accept::store_problem(&e).into_response(),
        None => Problem::internal("the event was not stored").into_response(),
    }
}

/// The providers' own endpoint checks, answered once the request's signature is verified
/// (Zoom's answer is an HMAC of a token the caller picks: unverified, it would sign
/// anything).
pub(super) fn provider_handshake(
    hook: &Webhook,
    request: &Signed<'_>,
    json: &probe::Fields<'_>,
) -> Option<Response> {
    let headers = request.headers;
    let text = |path: &str| json.get_dotted(path).and_then(Value::as_str);
    match hook.preset.as_str() {
        "slack" if text("type") == Some("url_verification") => {
            let challenge = text("challenge")?;
            Some((StatusCode::OK, Json(json!({"challenge": challenge}))).into_response())
        }
        "zoom" if text("event") == Some("endpoint.url_validation") => {
            let plain = text("payload.plainToken")?;
            // The secret that signed this request (with several configured, in rotation).
            let secret = hook.secrets.iter().find(|s| {
                hook.scheme
                    .verify(request, std::slice::from_ref(s), hook.tolerance)
                    .is_ok()
            })?;
            let encrypted = verify::hex(&verify::hmac(
                Algorithm::Sha256,
                secret.bytes(),
                &[plain.as_bytes()],
            ));
            Some(
                (
                    StatusCode::OK,
                    Json(json!({"plainToken": plain, "encryptedToken": encrypted})),
                )
                    .into_response(),
            )
        }
        "twitch"
            if headers
                .get("twitch-eventsub-message-type")
                .is_some_and(|v| v == "webhook_callback_verification") =>
        {
            let challenge = text("challenge")?;
            let mut r = (StatusCode::OK, challenge.to_string()).into_response();
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            Some(r)
        }
        _ => None,
    }
}
