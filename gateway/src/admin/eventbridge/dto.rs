//! The project's request and answer shapes: `BaseResponse` (`requestId`, `code`,
//! `message`), its `EventBridgeErrorCode` refusals ([`EbError`]), and the readers of request
//! fields (camelCase, or the PascalCase of the DTOs' `@SerializedName`).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

// ---------------------------------------------------------------------------------------
// Answers

/// A refusal in the project's form: `{requestId, code, message}` with the code's status.
#[derive(Debug, Clone)]
pub(crate) struct EbError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub retry_after: Option<u64>,
}

impl EbError {
    /// An `EventBridgeErrorCode`: every one of them is HTTP 409 in the project.
    pub(crate) fn new(code: &'static str, message: impl Into<String>) -> EbError {
        EbError {
            status: StatusCode::CONFLICT,
            code,
            message: message.into(),
            retry_after: None,
        }
    }

    pub(super) fn with_status(mut self, status: StatusCode) -> EbError {
        self.status = status;
        self
    }

    pub(super) fn bus_missing(bus: &str) -> EbError {
        EbError::new(
            "EventBusNotExist",
            format!("The event bus [{bus}] not existed!"),
        )
    }

    pub(super) fn rule_missing(bus: &str, rule: &str) -> EbError {
        EbError::new(
            "EventRuleNotExist",
            format!("The event rule [{rule}] of event bus [{bus}] not existed!"),
        )
    }

    pub(super) fn invalid(message: impl Into<String>) -> EbError {
        EbError::new(
            "RequestParameterInvalid",
            format!("Request parameter Invalid! {}", message.into()),
        )
    }
}

impl IntoResponse for EbError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(json!({
                "requestId": request_id(),
                "code": self.code,
                "message": self.message,
            })),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        // The project's form, not problem+json: the admin API's rewriting leaves it.
        response
            .extensions_mut()
            .insert(crate::admin::guard::OwnForm);
        response
    }
}

/// A new request id, shaped like the project's (`UUID.randomUUID()`).
pub(crate) fn request_id() -> String {
    crate::ingress::compat::eventbridge::new_request_id()
}

/// A successful answer: `BaseResponse` (`code` "Success") with the operation's fields.
pub(super) fn success(fields: Value) -> Response {
    let mut body = json!({
        "requestId": request_id(),
        "code": "Success",
        "message": "success",
    });
    if let (Value::Object(body), Value::Object(fields)) = (&mut body, fields) {
        body.extend(fields);
    }
    (StatusCode::OK, Json(body)).into_response()
}

pub(super) fn answer(result: Result<Value, EbError>) -> Response {
    match result {
        Ok(fields) => success(fields),
        Err(e) => e.into_response(),
    }
}

// ---------------------------------------------------------------------------------------
// Requests

/// A request body: a JSON object (the project ignores fields it does not know).
pub(super) fn body_of(body: &[u8]) -> Result<Map<String, Value>, EbError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(EbError::invalid("the body must be a JSON object")),
        Err(e) => Err(EbError::invalid(format!("the body is not JSON: {e}"))),
    }
}

/// A field by its camelCase name, or the PascalCase of the DTO's `@SerializedName`.
pub(super) fn field<'a>(map: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    map.get(name)
        .or_else(|| {
            let mut pascal = name[..1].to_ascii_uppercase();
            pascal.push_str(&name[1..]);
            map.get(&pascal)
        })
        .filter(|v| !v.is_null())
}

pub(super) fn string_field(
    map: &Map<String, Value>,
    name: &str,
) -> Result<Option<String>, EbError> {
    match field(map, name) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(EbError::invalid(format!(
            "`{name}` must be a string, not {}",
            kind_of(other)
        ))),
    }
}

pub(super) fn kind_of(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A required name (`eventBusName`, `eventRuleName`), checked as the catalog checks names;
/// `code` is the project's "name invalid" code for it.
pub(super) fn name_field(
    map: &Map<String, Value>,
    name: &str,
    code: &'static str,
    what: &str,
) -> Result<String, EbError> {
    let value = string_field(map, name)?.unwrap_or_default();
    if let Err(why) = crate::values::check_name(&value) {
        let shown: String = value.chars().take(128).collect();
        return Err(EbError::new(
            code,
            format!("The {what} name [{shown}] is invalid! (`{name}`: {why})"),
        ));
    }
    Ok(value)
}

pub(super) fn bus_name(map: &Map<String, Value>) -> Result<String, EbError> {
    name_field(map, "eventBusName", "EventBusNameInvalid", "event bus")
}

pub(super) fn rule_name(map: &Map<String, Value>) -> Result<String, EbError> {
    name_field(map, "eventRuleName", "EventRuleNameInvalid", "event rule")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_random_uuids() {
        let id = request_id();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(id, request_id());
    }
}
