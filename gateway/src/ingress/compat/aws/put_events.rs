//! The `PutEvents` handler: the request checked (operation, SigV4, size), each entry made
//! a CloudEvent and taken through the accept path, and the answer or the whole-request
//! error in the JSON 1.1 protocol's form.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use crate::event::http as cloudevent;
use crate::event::EventError;
use crate::ingress::accept::{discard_body, entry, read_body, store, Entry};
use crate::ingress::compat::aws::config::{AwsBus, DEFAULT_ACCOUNT, DEFAULT_REGION};
use crate::ingress::compat::sigv4;
use crate::ingress::state::{IngressState, Settings};
use crate::problem::Problem;
use crate::store::StoreError;

/// The bus `PutEvents` names when an entry has no `EventBusName`.
pub const DEFAULT_BUS: &str = "default";
/// At most this many entries per request, as AWS.
pub const MAX_ENTRIES: usize = 10;
/// At most this many bytes of entries per request, counted as AWS counts them.
pub const MAX_ENTRIES_BYTES: usize = 256 * 1024;
/// The body read at most (JSON escapes make the text larger than the entries it holds).
const MAX_BODY_BYTES: usize = 1024 * 1024;
const CONTENT_TYPE: &str = "application/x-amz-json-1.1";

/// A whole-request error in the JSON 1.1 protocol's form.
#[derive(Debug)]
struct AwsError {
    status: StatusCode,
    kind: &'static str,
    message: String,
}

impl AwsError {
    fn new(status: u16, kind: &'static str, message: impl Into<String>) -> AwsError {
        AwsError {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST),
            kind,
            message: message.into(),
        }
    }

    fn validation(message: impl Into<String>) -> AwsError {
        AwsError::new(400, "ValidationException", message)
    }

    fn serialization(message: impl Into<String>) -> AwsError {
        AwsError::new(400, "SerializationException", message)
    }

    fn from_problem(problem: &Problem) -> AwsError {
        match problem.status {
            413 => {
                AwsError::validation("Total size of the entries in the request is over the limit.")
            }
            429 => AwsError::new(400, "ThrottlingException", problem.detail.clone()),
            503 => AwsError::new(503, "ServiceUnavailableException", problem.detail.clone()),
            s if s >= 500 => AwsError::new(500, "InternalException", problem.detail.clone()),
            _ => AwsError::validation(problem.detail.clone()),
        }
    }
}

impl IntoResponse for AwsError {
    fn into_response(self) -> Response {
        let body = json!({"__type": self.kind, "message": self.message}).to_string();
        let mut response = (self.status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static(CONTENT_TYPE),
        );
        headers.insert("x-amzn-errortype", HeaderValue::from_static(self.kind));
        response
    }
}

/// Records the request's metrics (mode `aws`) around the handler.
pub(super) async fn put_events(
    State(state): State<Arc<IngressState>>,
    request: Request,
) -> Response {
    let started = std::time::Instant::now();
    let bytes = crate::ingress::accept::declared_length(request.headers());
    let request_id = new_uuid();
    let settings = state.settings();
    let mut label = "unknown".to_string();
    let span = tracing::info_span!("request", request_id = %request_id, mode = "aws");
    let result =
        tracing::Instrument::instrument(handle(&state, &settings, request, &mut label), span).await;
    let mut response = match result {
        Ok(response) => response,
        Err(e) => e.into_response(),
    };
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-amzn-requestid", value);
    }
    crate::metrics::get().ingress(
        label,
        "aws",
        response.status().as_u16(),
        bytes,
        started.elapsed(),
    );
    response
}

/// A new UUID v4 (RFC 9562 layout).
fn new_uuid() -> String {
    let mut n = fastrand::u128(..);
    n = (n & !(0xf << 76)) | (0x4 << 76);
    n = (n & !(0x3 << 62)) | (0x2 << 62);
    let h = format!("{n:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The bus an `EventBusName` names: a name, or an ARN `arn:aws:events:<region>:<account>:event-bus/<name>`.
fn bus_name(value: Option<&Value>) -> Result<String, AwsError> {
    let text = match value {
        None | Some(Value::Null) => return Ok(DEFAULT_BUS.to_string()),
        Some(Value::String(s)) => s,
        Some(_) => return Err(AwsError::serialization("EventBusName must be a string")),
    };
    if let Some(rest) = text.strip_prefix("arn:") {
        let parts: Vec<&str> = rest.splitn(5, ':').collect();
        return match parts.as_slice() {
            [_, "events", _, _, resource] => match resource.strip_prefix("event-bus/") {
                Some(name) if !name.is_empty() => Ok(name.to_string()),
                _ => Err(AwsError::validation(format!(
                    "EventBusName `{text}` is not an event bus ARN (arn:aws:events:<region>:<account>:event-bus/<name>)"
                ))),
            },
            _ => Err(AwsError::validation(format!(
                "EventBusName `{text}` is not an event bus ARN (arn:aws:events:<region>:<account>:event-bus/<name>)"
            ))),
        };
    }
    if text.is_empty() || text.len() > 256 {
        return Err(AwsError::validation(
            "EventBusName must be 1 to 256 characters long",
        ));
    }
    Ok(text.clone())
}

/// Checks the request is PutEvents in the JSON 1.1 protocol.
fn check_operation(headers: &http::HeaderMap) -> Result<(), AwsError> {
    let target = headers
        .get("x-amz-target")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if target != "AWSEvents.PutEvents" {
        let shown: String = target.chars().take(64).collect();
        return Err(AwsError::new(
            400,
            "UnknownOperationException",
            if shown.is_empty() {
                "X-Amz-Target is missing: only AWSEvents.PutEvents is served here".to_string()
            } else {
                format!("operation `{shown}` is not served here: only AWSEvents.PutEvents is")
            },
        ));
    }
    let content_type = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(cloudevent::essence)
        .unwrap_or_default();
    if !matches!(
        content_type.as_str(),
        "application/x-amz-json-1.1" | "application/x-amz-json-1.0" | "application/json"
    ) {
        return Err(AwsError::serialization(
            "Content-Type must be application/x-amz-json-1.1",
        ));
    }
    Ok(())
}

/// Whether the signer may put events on `bus`; the producer's access key id (or "").
fn authorize(
    settings: &Settings,
    bus: &str,
    signed: &sigv4::Request<'_>,
) -> Result<String, AwsError> {
    if let Some(aws) = settings.aws.get(bus) {
        if let Some(why) = &aws.unavailable {
            return Err(AwsError::new(
                503,
                "ServiceUnavailableException",
                format!("the AWS access keys of bus `{bus}` are unavailable on this replica ({why}); it takes no PutEvents here until they are"),
            ));
        }
        if !aws.keys.is_empty() {
            let now = chrono::Utc::now().timestamp();
            let secret_of = |id: &str| {
                aws.keys
                    .iter()
                    .find(|(k, _)| k == id)
                    .map(|(_, s)| s.clone())
            };
            return sigv4::verify(signed, "events", now, &secret_of).map_err(|e| match e {
                sigv4::SigError::Missing(m) => {
                    AwsError::new(403, "MissingAuthenticationTokenException", m)
                }
                sigv4::SigError::Incomplete(m) => {
                    AwsError::new(400, "IncompleteSignatureException", m)
                }
                sigv4::SigError::Sigv4a => {
                    AwsError::new(400, "InvalidSignatureException", e.to_string())
                }
                sigv4::SigError::UnknownKey => {
                    AwsError::new(400, "UnrecognizedClientException", e.to_string())
                }
                sigv4::SigError::Invalid(m) => AwsError::new(400, "InvalidSignatureException", m),
            });
        }
    }
    if settings.auth.contains_key(bus) {
        return Err(AwsError::new(
            400,
            "AccessDeniedException",
            format!("bus `{bus}` requires API keys (auth.keys), which PutEvents cannot send: configure SigV4 access keys for it in `aws.access_keys` to accept PutEvents"),
        ));
    }
    Ok(String::new())
}

/// A per-entry failure: `(ErrorCode, ErrorMessage)`.
type EntryError = (&'static str, String);

fn invalid(parameter: &str, reason: &str) -> EntryError {
    (
        "InvalidArgument",
        format!("Parameter {parameter} is not valid. Reason: {reason}"),
    )
}

/// One entry as a structured CloudEvent, or why not.
fn to_cloudevent(
    item: &Map<String, Value>,
    aws: Option<&AwsBus>,
    id: &str,
) -> Result<Map<String, Value>, EntryError> {
    let text = |name: &str| -> Result<Option<&str>, EntryError> {
        match item.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(invalid(name, &format!("{name} must be a string."))),
        }
    };
    let required = |name: &str| -> Result<&str, EntryError> {
        match text(name)? {
            Some(s) if !s.is_empty() => Ok(s),
            _ => Err(invalid(name, &format!("{name} is a required argument."))),
        }
    };
    let source = required("Source")?;
    let detail_type = required("DetailType")?;
    let detail = required("Detail")?;
    if source.starts_with("aws.") {
        return Err((
            "NotAuthorizedForSourceException",
            "Not authorized for the source.".to_string(),
        ));
    }
    let data = match serde_json::from_str::<Value>(detail) {
        Ok(Value::Object(map)) => Value::Object(map),
        _ => return Err(("MalformedDetail", "Detail is malformed.".to_string())),
    };
    let time = match item.get("Time") {
        None | Some(Value::Null) => chrono::Utc::now(),
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|s| s.is_finite() && s.abs() < 1e11)
            .and_then(|s| {
                let secs = s.floor();
                let nanos = ((s - secs) * 1e9) as u32;
                chrono::DateTime::from_timestamp(secs as i64, nanos)
            })
            .ok_or_else(|| invalid("Time", "Time must be a timestamp in seconds."))?,
        Some(Value::String(s)) => chrono::DateTime::parse_from_rfc3339(s)
            .map(|t| t.with_timezone(&chrono::Utc))
            .or_else(|_| {
                s.parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && s.abs() < 1e11)
                    .and_then(|s| chrono::DateTime::from_timestamp(s as i64, 0))
                    .ok_or(())
            })
            .map_err(|()| invalid("Time", "Time must be RFC 3339 or seconds since the epoch."))?,
        Some(_) => return Err(invalid("Time", "Time must be a timestamp.")),
    };
    let resources: Vec<Value> = match item.get("Resources") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(list)) => {
            if list.iter().any(|r| !r.is_string()) {
                return Err(invalid("Resources", "each resource must be a string."));
            }
            list.clone()
        }
        Some(_) => return Err(invalid("Resources", "Resources must be a list of strings.")),
    };
    let mut event = Map::new();
    event.insert("specversion".into(), json!("1.0"));
    event.insert("id".into(), json!(id));
    event.insert("source".into(), json!(source));
    event.insert("type".into(), json!(detail_type));
    event.insert(
        "time".into(),
        json!(time.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true)),
    );
    event.insert("datacontenttype".into(), json!("application/json"));
    event.insert("data".into(), data);
    event.insert(
        "account".into(),
        json!(aws.map_or(DEFAULT_ACCOUNT, AwsBus::account)),
    );
    event.insert(
        "region".into(),
        json!(aws.map_or(DEFAULT_REGION, AwsBus::region)),
    );
    // Left out when empty: a pattern sees no element either way (`{"exists": false}`
    // holds for both), and the stored event stays smaller.
    if !resources.is_empty() {
        event.insert(
            "resources".into(),
            json!(Value::Array(resources).to_string()),
        );
    }
    if let Some(trace) = text("TraceHeader")? {
        if trace.len() > 500 {
            return Err(invalid(
                "TraceHeader",
                "TraceHeader is longer than 500 characters.",
            ));
        }
        if cloudevent::valid_traceparent(trace) {
            event.insert("traceparent".into(), json!(trace));
        } else if !trace.is_empty() {
            event.insert("awstraceheader".into(), json!(trace));
        }
    }
    Ok(event)
}

/// The size AWS counts for an entry: `Time` 14 bytes, and the UTF-8 bytes of `Source`,
/// `DetailType`, `Detail` and each resource.
fn entry_size(item: &Value) -> usize {
    let len = |name: &str| item.get(name).and_then(Value::as_str).map_or(0, str::len);
    let time = if item.get("Time").is_some_and(|t| !t.is_null()) {
        14
    } else {
        0
    };
    let resources = item
        .get("Resources")
        .and_then(Value::as_array)
        .map_or(0, |l| {
            l.iter().filter_map(Value::as_str).map(str::len).sum()
        });
    time + len("Source") + len("DetailType") + len("Detail") + resources
}

async fn handle(
    state: &IngressState,
    settings: &Settings,
    request: Request,
    label: &mut String,
) -> Result<Response, AwsError> {
    check_operation(request.headers())?;
    let (parts, body) = request.into_parts();
    let Some(_memory) = state.reserve_memory(&parts.headers, MAX_BODY_BYTES, true) else {
        discard_body(body, MAX_BODY_BYTES).await;
        return Err(AwsError::new(
            503,
            "ServiceUnavailableException",
            "the gateway holds too many request bodies right now; retry shortly",
        ));
    };
    let declared = parts
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
        // Read (bounded) and dropped, so an SDK still sending reads the answer instead of
        // losing the connection under it.
        discard_body(body, 4 * MAX_BODY_BYTES).await;
        return Err(AwsError::validation(
            "Total size of the entries in the request is over the limit.",
        ));
    }
    let body = read_body(&parts.headers, body, MAX_BODY_BYTES, "aws.max_body_bytes")
        .await
        .map_err(|p| AwsError::from_problem(&p))?;
    let request: Value = serde_json::from_slice(&body)
        .map_err(|e| AwsError::serialization(format!("the body is not JSON: {e}")))?;
    let Value::Object(request) = request else {
        return Err(AwsError::serialization("the body must be a JSON object"));
    };
    if request.get("EndpointId").is_some_and(|v| !v.is_null()) {
        return Err(AwsError::validation(
            "EndpointId (global endpoints, signed with SigV4a) is not supported here: put events without EndpointId, naming the bus in each entry's EventBusName",
        ));
    }
    let items = match request.get("Entries") {
        None | Some(Value::Null) => {
            return Err(AwsError::validation(
                "1 validation error detected: Value null at 'entries' failed to satisfy constraint: Member must not be null",
            ))
        }
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(AwsError::serialization(
                "Entries must be a list of entries",
            ))
        }
    };
    if items.is_empty() {
        return Err(AwsError::validation(
            "1 validation error detected: Value '[]' at 'entries' failed to satisfy constraint: Member must have length greater than or equal to 1",
        ));
    }
    if items.len() > MAX_ENTRIES {
        return Err(AwsError::validation(format!(
            "1 validation error detected: Value at 'entries' failed to satisfy constraint: Member must have length less than or equal to {MAX_ENTRIES}"
        )));
    }
    let mut entries: Vec<(&Map<String, Value>, String)> = Vec::with_capacity(items.len());
    for item in items {
        let Value::Object(map) = item else {
            return Err(AwsError::serialization("each entry must be a JSON object"));
        };
        entries.push((map, bus_name(map.get("EventBusName"))?));
    }
    if items.iter().map(entry_size).sum::<usize>() > MAX_ENTRIES_BYTES {
        return Err(AwsError::validation(
            "Total size of the entries in the request is over the limit.",
        ));
    }
    // The buses of the request, each checked once: it exists, the signer may use it, its
    // rate limit allows the request.
    let mut buses: Vec<&str> = Vec::new();
    for (_, bus) in &entries {
        if !buses.contains(&bus.as_str()) {
            buses.push(bus);
        }
    }
    let signed = sigv4::Request {
        method: parts.method.as_str(),
        path: parts.uri.path(),
        query: parts.uri.query().unwrap_or(""),
        authority: parts.uri.authority().map(|a| a.as_str()),
        headers: &parts.headers,
        body: &body,
    };
    for bus in &buses {
        if !settings.buses.contains_key(*bus) {
            return Err(AwsError::new(
                400,
                "ResourceNotFoundException",
                format!("Event bus {bus} does not exist."),
            ));
        }
    }
    if let Some(first) = buses.first() {
        label.clone_from(&first.to_string());
    }
    for bus in &buses {
        authorize(settings, bus, &signed)?;
        state
            .bus_rate_limit(settings, bus)
            .await
            .map_err(|p| AwsError::from_problem(&p))?;
    }
    // Each entry as a stored event, or its error.
    let limits = &state.limits;
    let mut ids: Vec<String> = Vec::with_capacity(entries.len());
    let mut results: Vec<Result<Entry, EntryError>> = Vec::with_capacity(entries.len());
    for (item, bus) in &entries {
        let id = new_uuid();
        let result =
            to_cloudevent(item, settings.aws.get(bus).map(Arc::as_ref), &id).and_then(|event| {
                let parsed =
                    cloudevent::from_json_object(event).and_then(cloudevent::Parsed::encode);
                let parsed = match settings.schemas.get(bus) {
                    Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
                    None => parsed,
                };
                let shards = settings.buses.get(bus).map_or(1, |l| l.shards());
                match entry(parsed, shards, limits) {
                    Ok(e) => Ok(Ok(e)),
                    Err(e) => Err(entry_error(&e)),
                }
            });
        ids.push(id);
        results.push(result);
    }
    // Stored bus by bus, each bus's entries in one call (one append per shard).
    let mut stored: Vec<Option<Result<(), StoreError>>> = vec![None; entries.len()];
    for bus in &buses {
        let Some(log) = settings.buses.get(*bus) else {
            continue;
        };
        let mine: Vec<usize> = (0..entries.len())
            .filter(|i| entries.get(*i).is_some_and(|(_, b)| b == bus))
            .collect();
        let batch: Vec<Entry> = mine
            .iter()
            .map(|i| match results.get(*i) {
                Some(Ok(e)) => e.clone(),
                _ => Err(EventError::invalid("entry", "not stored")),
            })
            .collect();
        for (i, result) in mine.iter().zip(store(log.as_ref(), &batch).await) {
            if let Some(slot) = stored.get_mut(*i) {
                *slot = result;
            }
        }
    }
    let mut failed = 0;
    let answers: Vec<Value> = results
        .iter()
        .zip(&stored)
        .zip(&ids)
        .map(|((result, stored), id)| {
            let error = match (result, stored) {
                (Err((code, message)), _) => Some((*code, message.clone())),
                (Ok(_), Some(Ok(()))) => None,
                (Ok(_), Some(Err(StoreError::Busy(m)))) => Some(("ThrottlingException", m.clone())),
                (Ok(_), Some(Err(e))) => Some(("InternalFailure", e.to_string())),
                (Ok(_), None) => Some((
                    "InternalFailure",
                    "the event was not handed to the store".to_string(),
                )),
            };
            match error {
                None => json!({"EventId": id}),
                Some((code, message)) => {
                    failed += 1;
                    json!({"ErrorCode": code, "ErrorMessage": message})
                }
            }
        })
        .collect();
    let body = json!({"FailedEntryCount": failed, "Entries": answers}).to_string();
    let mut response = (StatusCode::OK, body).into_response();
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static(CONTENT_TYPE),
    );
    Ok(response)
}

fn entry_error(e: &EventError) -> EntryError {
    match e.kind {
        crate::event::ErrorKind::TooLarge => (
            "InvalidArgument",
            format!("The entry is too large: {}", e.message),
        ),
        _ if e.field == "data" => (
            "MalformedDetail",
            format!("Detail is not accepted: {}", e.message),
        ),
        _ => (
            "InvalidArgument",
            format!(
                "Parameter {} is not valid. Reason: {}",
                aws_field(&e.field),
                e.message
            ),
        ),
    }
}

/// The AWS parameter behind a CloudEvents attribute.
fn aws_field(attribute: &str) -> &str {
    match attribute {
        "source" => "Source",
        "type" => "DetailType",
        "time" => "Time",
        "traceparent" => "TraceHeader",
        "resources" => "Resources",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn bus_names_and_arns() {
        assert_eq!(bus_name(None).unwrap(), "default");
        assert_eq!(bus_name(Some(&json!("orders"))).unwrap(), "orders");
        assert_eq!(
            bus_name(Some(&json!(
                "arn:aws:events:eu-west-1:123456789012:event-bus/orders"
            )))
            .unwrap(),
            "orders"
        );
        assert!(bus_name(Some(&json!("arn:aws:sqs:eu-west-1:1:queue"))).is_err());
        assert!(bus_name(Some(&json!(3))).is_err());
        assert!(bus_name(Some(&json!(""))).is_err());
    }

    #[test]
    fn uuids_are_v4() {
        let id = new_uuid();
        assert_eq!(id.len(), 36);
        assert_eq!(&id[14..15], "4");
        assert!(matches!(&id[19..20], "8" | "9" | "a" | "b"), "{id}");
    }

    #[test]
    fn entries_map_to_cloudevents() {
        let item = json!({
            "Source": "shop", "DetailType": "OrderPlaced", "Detail": "{\"total\": 12}",
            "Resources": ["arn:x"], "Time": 1700000000,
            "TraceHeader": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        });
        let event = to_cloudevent(item.as_object().unwrap(), None, "id-1").unwrap();
        assert_eq!(event["type"], "OrderPlaced");
        assert_eq!(event["data"], json!({"total": 12}));
        assert_eq!(event["time"], "2023-11-14T22:13:20Z");
        assert_eq!(event["resources"], "[\"arn:x\"]");
        assert_eq!(event["account"], DEFAULT_ACCOUNT);
        assert!(event.contains_key("traceparent"));
        assert!(cloudevent::from_json_object(event).is_ok());
        let bad = |v: Value| {
            to_cloudevent(v.as_object().unwrap(), None, "x")
                .unwrap_err()
                .0
        };
        assert_eq!(
            bad(json!({"DetailType": "t", "Detail": "{}"})),
            "InvalidArgument"
        );
        assert_eq!(
            bad(json!({"Source": "s", "DetailType": "t", "Detail": "[1]"})),
            "MalformedDetail"
        );
        assert_eq!(
            bad(json!({"Source": "s", "DetailType": "t", "Detail": "nope"})),
            "MalformedDetail"
        );
        assert_eq!(
            bad(json!({"Source": "aws.ec2", "DetailType": "t", "Detail": "{}"})),
            "NotAuthorizedForSourceException"
        );
        let xray = json!({"Source": "s", "DetailType": "t", "Detail": "{}",
            "TraceHeader": "Root=1-5759e988-bd862e3fe1be46a994272793", "Time": "2024-01-02T03:04:05+01:00"});
        let event = to_cloudevent(xray.as_object().unwrap(), None, "x").unwrap();
        assert_eq!(
            event["awstraceheader"],
            "Root=1-5759e988-bd862e3fe1be46a994272793"
        );
        assert_eq!(event["time"], "2024-01-02T02:04:05Z");
    }
}
