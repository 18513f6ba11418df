//! The Knative broker ingress, `POST /{namespace}/{broker}`, and Knative Triggers as rules.
//!
//! Ingress: one CloudEvent per request, binary or structured, into the bus the broker maps
//! to (`[knative] brokers = { "ns/broker" = "bus" }`, else the bus named `{broker}`), through
//! the one accept path (`crate::ingress::accept`) with the bus's keys, rate limit, schemas
//! and dedup window, as `POST /buses/{bus}/events` takes it. It answers as Knative's
//! `pkg/broker/ingress/ingress_handler.go` does: `202` with an empty body once stored,
//! `400` for what is not a CloudEvent (batches included: Knative takes one event), `404`
//! for an unknown broker, `405` for other methods, `200` to `OPTIONS` (the CloudEvents
//! webhook handshake). Errors carry a problem+json body; Knative's clients read the status.
//!
//! Triggers: a `Trigger` resource (`eventing.knative.dev/v1`) becomes a rule named after it,
//! on its broker's bus, with its `filter`/`filters` translated to CESQL
//! (`sluice_functions::knative`) and one http target (binary mode) to `subscriber.uri`
//! (`sluice ctl apply -f trigger.yaml`, or `"triggers"` in the body of
//! `POST /api/v1/catalog/apply`).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sluice_functions::knative::{translate, AttributesFilter, SubscriptionsFilter};

use crate::event::http::{self as cloudevent, ContentMode};
use crate::event::EventError;
use crate::ingress::accept::{
    discard_body, entry, event_problem, read_body, store, store_problem, store_unique,
};
use crate::ingress::state::{IngressState, Settings};
use crate::problem::Problem;

/// `[knative]`: which bus each Knative broker feeds.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(try_from = "RawKnativeConfig")]
pub struct KnativeConfig {
    /// `"namespace/broker" = "bus"`; a broker not listed feeds the bus named like it.
    pub brokers: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawKnativeConfig {
    #[serde(default)]
    brokers: BTreeMap<String, String>,
}

impl TryFrom<RawKnativeConfig> for KnativeConfig {
    type Error = String;

    fn try_from(raw: RawKnativeConfig) -> Result<Self, String> {
        for (key, bus) in &raw.brokers {
            let valid = key
                .split_once('/')
                .is_some_and(|(ns, broker)| segment(ns) && segment(broker));
            if !valid {
                return Err(format!(
                    "knative.brokers: `{key}` must be `namespace/broker` (each a non-empty path segment)"
                ));
            }
            crate::values::check_name(bus)
                .map_err(|e| format!("knative.brokers.\"{key}\": the bus name {e}"))?;
        }
        Ok(KnativeConfig {
            brokers: raw.brokers,
        })
    }
}

fn segment(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && !s.contains(['/', '?', '#', '%']) && s.is_ascii()
}

/// The bus a broker feeds: its mapping, else the bus named like the broker.
pub fn bus_of(brokers: &BTreeMap<String, String>, namespace: &str, broker: &str) -> String {
    brokers
        .get(&format!("{namespace}/{broker}"))
        .cloned()
        .unwrap_or_else(|| broker.to_string())
}

/// `/{namespace}/{broker}` (a trailing slash is ignored, as Knative does). Static routes
/// (`/webhooks/{name}`, `/bus/...`, `/rule/...`, `/target/...`) win over it.
pub(crate) fn routes() -> Router<Arc<IngressState>> {
    let method = || post(post_broker).options(options).fallback(other_method);
    Router::new()
        .route("/{namespace}/{broker}", method())
        .route("/{namespace}/{broker}/", method())
}

/// Another method: `405` on a broker that exists, else `404` as any unknown path (every
/// two-segment path reaches this route, and `GET /typo/here` must not claim a resource).
async fn other_method(
    State(state): State<Arc<IngressState>>,
    Path((namespace, broker)): Path<(String, String)>,
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> Problem {
    let bus = bus_of(state.knative_brokers(), &namespace, &broker);
    if state.settings().buses.contains_key(&bus) {
        Problem::method_not_allowed(method.as_str(), "POST, OPTIONS")
    } else {
        Problem::not_found(uri.path())
    }
}

/// The CloudEvents webhook handshake, answered as Knative's ingress answers it.
async fn options() -> Response {
    (
        StatusCode::OK,
        [
            ("allow", "POST, OPTIONS"),
            ("webhook-allowed-origin", "*"),
            ("webhook-allowed-rate", "*"),
        ],
    )
        .into_response()
}

/// Records the request's metrics (mode `knative`; an unknown bus is `bus="unknown"`).
async fn post_broker(
    State(state): State<Arc<IngressState>>,
    Path((namespace, broker)): Path<(String, String)>,
    request: Request,
) -> Response {
    let started = std::time::Instant::now();
    let bytes = crate::ingress::accept::declared_length(request.headers());
    let settings = state.settings();
    let bus = bus_of(state.knative_brokers(), &namespace, &broker);
    let label = if settings.buses.contains_key(&bus) {
        bus.clone()
    } else {
        "unknown".to_string()
    };
    // The path's names as Debug (quoted, escaped): they come from the client, and a
    // percent-encoded line break must not start a forged log line.
    let span = tracing::info_span!("request", bus = %label, mode = "knative", namespace = ?namespace, broker = ?broker);
    let response =
        tracing::Instrument::instrument(handle(state, settings, bus, request), span).await;
    crate::metrics::get().ingress(
        label,
        "knative",
        response.status().as_u16(),
        bytes,
        started.elapsed(),
    );
    response
}

/// Knative answers 400 to whatever its CloudEvents binding cannot read (an unknown
/// content type too, where `POST /buses/{bus}/events` says 415).
fn not_a_cloudevent(e: EventError) -> Problem {
    let problem = event_problem(e);
    if problem.status() == StatusCode::UNSUPPORTED_MEDIA_TYPE {
        return Problem::invalid_event("content-type", problem.detail);
    }
    problem
}

async fn handle(
    state: Arc<IngressState>,
    settings: Arc<Settings>,
    bus: String,
    request: Request,
) -> Response {
    // Knative reads the event before it looks the broker up: what is not a CloudEvent by
    // its headers is a 400 even to an unknown broker.
    let mode =
        match cloudevent::content_mode(request.headers()) {
            Ok(ContentMode::Batch) => return Problem::invalid_event(
                "content-type",
                "a Knative broker takes one event per request; send batches to /buses/{bus}/events",
            )
            .into_response(),
            Ok(mode) => mode,
            Err(e) => return not_a_cloudevent(e).into_response(),
        };
    let Some(log) = settings.buses.get(&bus).cloned() else {
        // Knative's 404; the problem names the bus the broker maps to.
        return Problem::unknown_bus(&bus)
            .with_field("broker")
            .into_response();
    };
    let producer = match state.admit(&settings, &bus, request.headers()).await {
        Ok(producer) => producer,
        Err(problem) => return problem.into_response(),
    };
    let (parts, body) = request.into_parts();
    let limits = &state.limits;
    let limit = limits.max_event_bytes;
    let Some(_memory) = state.reserve_memory(&parts.headers, limit, mode != ContentMode::Binary)
    else {
        discard_body(body, limit).await;
        return Problem::memory_full().into_response();
    };
    let body = match read_body(&parts.headers, body, limit, "limits.max_event_bytes").await {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let parsed = match mode {
        ContentMode::Structured => cloudevent::from_structured(&body)
            .map(|mut e| {
                cloudevent::inherit_trace_context(&mut e, &parts.headers);
                e
            })
            .and_then(cloudevent::Parsed::encode),
        _ => cloudevent::from_binary(&parts.headers, &body),
    };
    let parsed = match settings.schemas.get(&bus) {
        Some(schemas) => parsed.and_then(|p| schemas.check(&p).map(|()| p)),
        None => parsed,
    };
    let window = settings.dedup.get(&bus).copied();
    let key = window.and(parsed.as_ref().ok()).map(|p| {
        let source = cloudevents::AttributesReader::source(&p.event).to_string();
        let id = cloudevents::AttributesReader::id(&p.event);
        crate::store::dedup::key(&["bus", &bus, &producer, &source, id])
    });
    let entries = vec![entry(parsed, log.shards(), limits)];
    if let Some(Err(e)) = entries.first() {
        return not_a_cloudevent(e.clone()).into_response();
    }
    let stored = match window {
        None => store(log.as_ref(), &entries).await,
        Some(window) => {
            let dedup = state.dedup();
            match store_unique(log.as_ref(), dedup.as_ref(), &entries, &[key], window).await {
                // A duplicate is accepted (and not stored again).
                Ok((_, duplicates)) if duplicates.first().copied().unwrap_or(false) => {
                    return StatusCode::ACCEPTED.into_response()
                }
                Ok((stored, _)) => stored,
                Err(e) => return store_problem(&e).into_response(),
            }
        }
    };
    match stored.into_iter().next().flatten() {
        Some(Ok(())) => StatusCode::ACCEPTED.into_response(),
        Some(Err(e)) => store_problem(&e).into_response(),
        None => Problem::internal("the event was not handed to the store").into_response(),
    }
}

/// A Knative Trigger, as `kubectl` would apply it (only what Sluice reads is typed).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Trigger {
    api_version: String,
    kind: String,
    metadata: Metadata,
    spec: TriggerSpec,
    /// What `kubectl get -o yaml` prints; ignored.
    #[serde(default)]
    #[allow(dead_code)]
    status: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Metadata {
    name: String,
    #[serde(default)]
    namespace: Option<String>,
    // labels, annotations, uid, resourceVersion...: ignored (not denied, so that what
    // `kubectl get -o yaml` prints applies as it is).
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct TriggerSpec {
    #[serde(default)]
    broker: Option<String>,
    #[serde(default)]
    broker_ref: Option<Value>,
    #[serde(default)]
    filter: Option<AttributesFilter>,
    #[serde(default)]
    filters: Vec<SubscriptionsFilter>,
    subscriber: Subscriber,
    #[serde(default)]
    delivery: Option<Value>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Subscriber {
    #[serde(default)]
    uri: Option<String>,
    #[serde(default, rename = "ref")]
    reference: Option<Value>,
    #[serde(default, rename = "CACerts")]
    ca_certs: Option<String>,
    #[serde(default)]
    audience: Option<String>,
}

/// A catalog apply body with `"triggers"`: each becomes a rule appended to `"rules"`.
/// Any other body is returned as it is. The problem points into the body
/// (`/triggers/0/spec/...`).
// One problem per admin request, off every hot path (as in `admin/apply.rs`): not boxed.
#[allow(clippy::result_large_err)]
pub fn apply_triggers(
    body: bytes::Bytes,
    brokers: &BTreeMap<String, String>,
) -> Result<bytes::Bytes, Problem> {
    let Ok(Value::Object(mut doc)) = serde_json::from_slice::<Value>(&body) else {
        return Ok(body);
    };
    let Some(triggers) = doc.remove("triggers") else {
        return Ok(body);
    };
    let Value::Array(triggers) = triggers else {
        return Err(Problem::invalid_resource(
            "/triggers",
            "`triggers` must be a list of Knative Trigger resources",
        ));
    };
    let mut rules = Vec::with_capacity(triggers.len());
    for (i, trigger) in triggers.into_iter().enumerate() {
        rules.push(rule_of(trigger, brokers).map_err(|(at, detail)| {
            Problem::invalid_resource(&format!("/triggers/{i}{at}"), detail)
        })?);
    }
    match doc.entry("rules").or_insert_with(|| json!([])) {
        Value::Array(list) => list.extend(rules),
        _ => {
            return Err(Problem::invalid_resource(
                "/rules",
                "`rules` must be a list",
            ))
        }
    }
    serde_json::to_vec(&Value::Object(doc))
        .map(bytes::Bytes::from)
        .map_err(|e| Problem::internal(format!("cannot write the rules of the triggers: {e}")))
}

/// One Trigger as a rule (its JSON form in an apply body); the error is (pointer, detail).
fn rule_of(trigger: Value, brokers: &BTreeMap<String, String>) -> Result<Value, (String, String)> {
    let fail = |at: &str, detail: String| (at.to_string(), detail);
    let t: Trigger = serde_json::from_value(trigger)
        .map_err(|e| fail("", format!("not a Knative Trigger: {e}")))?;
    if t.kind != "Trigger" {
        return Err(fail(
            "/kind",
            format!("`{}`: only `Trigger` is applied here", t.kind),
        ));
    }
    if t.api_version != "eventing.knative.dev/v1" {
        return Err(fail(
            "/apiVersion",
            format!(
                "`{}`: only eventing.knative.dev/v1 is supported",
                t.api_version
            ),
        ));
    }
    crate::values::check_name(&t.metadata.name)
        .map_err(|e| fail("/metadata/name", format!("the trigger's name {e}")))?;
    let spec = &t.spec;
    if spec.broker_ref.is_some() {
        return Err(fail(
            "/spec/brokerRef",
            "brokerRef is not supported; name the broker with `broker`".to_string(),
        ));
    }
    let Some(broker) = spec.broker.as_deref().filter(|b| !b.is_empty()) else {
        return Err(fail("/spec/broker", "missing field broker".to_string()));
    };
    if spec.delivery.is_some() {
        return Err(fail(
            "/spec/delivery",
            "delivery options are not supported: Sluice retries with the target's `retry` policy \
             and dead-letters with its `dead_letter` (write the rule in Sluice's form for those)"
                .to_string(),
        ));
    }
    let sub = &spec.subscriber;
    if sub.reference.is_some() {
        return Err(fail(
            "/spec/subscriber/ref",
            "subscriber.ref (a Kubernetes object) cannot be resolved here; give subscriber.uri"
                .to_string(),
        ));
    }
    if sub.ca_certs.is_some() || sub.audience.is_some() {
        return Err(fail(
            "/spec/subscriber",
            "subscriber.CACerts and subscriber.audience are not supported (an http target takes `ca_file` and `auth`)"
                .to_string(),
        ));
    }
    let Some(uri) = sub.uri.as_deref().filter(|u| !u.is_empty()) else {
        return Err(fail(
            "/spec/subscriber/uri",
            "missing field uri".to_string(),
        ));
    };
    let namespace = t.metadata.namespace.as_deref().unwrap_or("default");
    let filter = translate(spec.filter.as_ref(), &spec.filters).map_err(|e| {
        let pointer = format!(
            "/spec/{}",
            e.at.replace('[', "/").replace(']', "").replace('.', "/")
        );
        (pointer, e.to_string())
    })?;
    let mut rule = json!({
        "name": t.metadata.name,
        "bus": bus_of(brokers, namespace, broker),
        "targets": [{"type": "http", "name": "subscriber", "url": uri, "mode": "binary"}],
    });
    if let (Some(filter), Some(map)) = (filter, rule.as_object_mut()) {
        map.insert("filter".to_string(), Value::String(filter));
    }
    Ok(rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trigger(spec: Value) -> Value {
        json!({
            "apiVersion": "eventing.knative.dev/v1",
            "kind": "Trigger",
            "metadata": {"name": "t1", "namespace": "shop", "labels": {"a": "b"}},
            "spec": spec,
        })
    }

    #[test]
    fn a_trigger_becomes_a_rule_on_its_brokers_bus() {
        let brokers = BTreeMap::from([("shop/default".to_string(), "orders".to_string())]);
        let rule = rule_of(
            trigger(json!({
                "broker": "default",
                "filters": [{"exact": {"type": "order.created"}}],
                "subscriber": {"uri": "http://127.0.0.1:9/x"},
            })),
            &brokers,
        )
        .expect("a rule");
        assert_eq!(rule["bus"], "orders");
        assert_eq!(rule["name"], "t1");
        assert_eq!(rule["filter"], "EXISTS type AND type = 'order.created'");
        assert_eq!(rule["targets"][0]["url"], "http://127.0.0.1:9/x");
        // Unmapped: the bus named like the broker; no filter: no `filter`.
        let rule = rule_of(
            trigger(json!({"broker": "b2", "subscriber": {"uri": "http://127.0.0.1:9/"}})),
            &brokers,
        )
        .expect("a rule");
        assert_eq!(rule["bus"], "b2");
        assert!(rule.get("filter").is_none());
    }

    #[test]
    fn what_cannot_be_served_is_refused_naming_the_field() {
        let brokers = BTreeMap::new();
        let cases = [
            (json!({"subscriber": {"uri": "http://x/"}}), "/spec/broker"),
            (
                json!({"broker": "b", "subscriber": {"ref": {"kind": "Service", "name": "s"}}}),
                "/spec/subscriber/ref",
            ),
            (
                json!({"broker": "b", "subscriber": {}}),
                "/spec/subscriber/uri",
            ),
            (
                json!({"broker": "b", "subscriber": {"uri": "http://x/"}, "delivery": {"retry": 3}}),
                "/spec/delivery",
            ),
            (
                json!({"broker": "b", "subscriber": {"uri": "http://x/"}, "filters": [{"exact": {"Type": "x"}}]}),
                "/spec/filters/0/exact/Type",
            ),
            (
                json!({"broker": "b", "subscriber": {"uri": "http://x/"}, "surprise": 1}),
                "",
            ),
        ];
        for (spec, at) in cases {
            let (got, detail) = rule_of(trigger(spec.clone()), &brokers).expect_err("refused");
            assert_eq!(got, at, "{spec}: {detail}");
        }
        let mut t = trigger(json!({"broker": "b", "subscriber": {"uri": "http://x/"}}));
        t["kind"] = json!("Broker");
        assert_eq!(rule_of(t, &brokers).expect_err("refused").0, "/kind");
    }

    #[test]
    fn an_apply_body_with_triggers_gains_their_rules() {
        let body = json!({
            "rules": [{"name": "r", "bus": "b", "targets": []}],
            "triggers": [trigger(json!({"broker": "b", "subscriber": {"uri": "http://x/"}}))],
        });
        let out = apply_triggers(bytes::Bytes::from(body.to_string()), &BTreeMap::new())
            .expect("converted");
        let out: Value = serde_json::from_slice(&out).expect("json");
        assert!(out.get("triggers").is_none());
        assert_eq!(out["rules"].as_array().map(Vec::len), Some(2));
        // Bodies without triggers are untouched.
        let plain = bytes::Bytes::from_static(b"{\"buses\": []}");
        assert_eq!(
            apply_triggers(plain.clone(), &BTreeMap::new()).ok(),
            Some(plain)
        );
        let bad = bytes::Bytes::from_static(b"{\"triggers\": {}}");
        assert!(apply_triggers(bad, &BTreeMap::new()).is_err());
    }

    #[test]
    fn broker_mappings_are_checked() {
        let parse = |text: &str| toml::from_str::<KnativeConfig>(text);
        assert!(parse("brokers = { \"default/orders\" = \"orders-bus\" }").is_ok());
        assert!(parse("brokers = { \"orders\" = \"orders-bus\" }").is_err());
        assert!(parse("brokers = { \"a/b/c\" = \"x\" }").is_err());
        assert!(parse("brokers = { \"a/b\" = \"bad name\" }").is_err());
        assert!(parse("other = 1").is_err());
    }
}
