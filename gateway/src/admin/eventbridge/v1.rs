//! How the controllers reach the catalog: reads of the snapshot and the paused connectors,
//! the caller's preconditions passed on to the `/api/v1` handlers, and their problem+json
//! refusals turned into the project's error codes.

use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::Value;

use crate::admin::state::{snapshot_of, AdminState};
use crate::catalog::Snapshot;
use crate::config::RuleConfig;

use crate::admin::eventbridge::dto::EbError;

/// What an `/api/v1` refusal means for the operation at hand.
pub(super) struct Context<'a> {
    /// 404: what is missing.
    pub(super) missing: EbError,
    /// 412 under `If-None-Match: *`: it exists already.
    pub(super) exists: Option<EbError>,
    /// 409: the code of a conflict (e.g. a bus still used by rules).
    pub(super) conflict: &'static str,
    /// The code of a `/name` refused by the checks.
    pub(super) name_invalid: &'static str,
    pub(super) what: &'a str,
}

/// `Ok` for a 2xx answer of a `/api/v1` handler, else its problem in the project's form.
pub(super) async fn outcome(response: Response, context: Context<'_>) -> Result<(), EbError> {
    let status = response.status();
    if status.is_success() {
        return Ok(());
    }
    let retry_after = response
        .headers()
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body = axum::body::to_bytes(response.into_body(), 1024 * 1024)
        .await
        .unwrap_or_default();
    let problem: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let detail = problem["detail"].as_str().unwrap_or("").to_string();
    let pointer = problem["pointer"]
        .as_str()
        .or_else(|| problem["field"].as_str())
        .unwrap_or("");
    let mut error = match status {
        StatusCode::NOT_FOUND => context.missing,
        StatusCode::PRECONDITION_FAILED => match context.exists {
            Some(exists) => exists,
            None => EbError::new("PreconditionFailed", detail).with_status(status),
        },
        StatusCode::CONFLICT => EbError::new(context.conflict, detail),
        StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => {
            if pointer == "/name" {
                EbError::new(context.name_invalid, detail)
            } else if pointer.starts_with("/pattern") {
                EbError::new(
                    "EventRuleFilterPatternSchemaError",
                    format!("The filter pattern is invalid! {detail}"),
                )
            } else if pointer.starts_with("/targets") {
                EbError::new(
                    "EventTargetIneffectiveAttribute",
                    format!("The target of {} is refused: {detail}", context.what),
                )
            } else {
                EbError::invalid(detail)
            }
        }
        StatusCode::PAYLOAD_TOO_LARGE => EbError::invalid(detail).with_status(status),
        _ => EbError::new("InternalError", detail).with_status(status),
    };
    error.retry_after = retry_after;
    Err(error)
}

pub(super) fn store_error(e: &crate::store::StoreError) -> EbError {
    EbError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        code: "InternalError",
        message: format!("the catalog cannot be read or written: {e}"),
        retry_after: Some(2),
    }
}

pub(super) async fn snapshot(state: &AdminState) -> Result<Snapshot, EbError> {
    snapshot_of(state).await.map_err(|p| EbError {
        status: p.status(),
        code: "InternalError",
        message: p.detail,
        retry_after: p.retry_after,
    })
}

pub(super) fn require_bus(s: &Snapshot, bus: &str) -> Result<(), EbError> {
    if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
        Ok(())
    } else {
        Err(EbError::bus_missing(bus))
    }
}

pub(super) fn find_rule<'a>(
    s: &'a Snapshot,
    bus: &str,
    rule: &str,
) -> Result<&'a RuleConfig, EbError> {
    require_bus(s, bus)?;
    s.channels
        .rules
        .iter()
        .find(|r| *r.bus.get_ref() == bus && *r.name.get_ref() == rule)
        .ok_or_else(|| EbError::rule_missing(bus, rule))
}

/// The caller's preconditions, passed on to `/api/v1` (else none).
pub(super) fn passed_on(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for name in [header::IF_MATCH, header::IF_NONE_MATCH] {
        if let Some(v) = headers.get(&name) {
            out.insert(name, v.clone());
        }
    }
    out
}

pub(super) async fn paused(
    state: &AdminState,
) -> Result<std::collections::HashSet<String>, EbError> {
    state
        .cluster
        .control()
        .await
        .map(|c| c.paused)
        .map_err(|e| store_error(&e))
}
