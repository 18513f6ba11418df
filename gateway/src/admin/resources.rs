//! Buses, rules and sources as resources of the catalog: read (`GET`, with the version as
//! `ETag`) and written (`PUT`, `DELETE`, with `If-Match`), every change checked by the
//! configuration's own checks and by admission before it is stored.

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::state::{json_object, snapshot_of, store_problem, AdminState};
use crate::catalog::{self, ChangeError, Snapshot};
use crate::config::{BusConfig, Channels, Kind, RuleConfig};
use crate::ingress::webhooks::config::WebhookConfig;
use crate::problem::Problem;
use crate::sources::SourceConfig;

// ---------------------------------------------------------------------------------------
// Resources

/// A resource as the API shows it: its fields and its version.
pub(super) fn view(resource: &impl serde::Serialize, version: u64) -> Value {
    let mut value = serde_json::to_value(resource).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut value {
        map.insert("version".to_string(), json!(version));
    }
    value
}

pub(super) fn etag(version: u64) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{version}\"")).unwrap_or(HeaderValue::from_static("\"0\""))
}

pub(super) fn found(value: Value, version: u64) -> Response {
    ([(header::ETAG, etag(version))], Json(value)).into_response()
}

pub(super) fn bus_view(snapshot: &Snapshot, bus: &BusConfig) -> Value {
    view(
        bus,
        snapshot.version_of(&catalog::bus_key(bus.name.get_ref())),
    )
}

pub(super) fn rule_view(snapshot: &Snapshot, rule: &RuleConfig) -> Value {
    view(
        rule,
        snapshot.version_of(&catalog::rule_key(rule.bus.get_ref(), rule.name.get_ref())),
    )
}

/// A catalog webhook source: its settings (secrets are `env:` references), version, the
/// URL providers call, and whether this replica can serve it.
pub(super) fn webhook_view(snapshot: &Snapshot, hook: &WebhookConfig) -> Value {
    let name = hook.name.get_ref();
    let mut value = view(hook, snapshot.version_of(&catalog::webhook_key(name)));
    if let Value::Object(map) = &mut value {
        map.insert("path".to_string(), json!(format!("/webhooks/{name}")));
        map.insert("origin".to_string(), json!("catalog"));
    }
    value
}

/// `webhook_view` with why this replica cannot serve it, if it cannot (`unavailable`).
pub(super) fn served_webhook_view(
    snapshot: &Snapshot,
    hook: &WebhookConfig,
    webhooks: &crate::ingress::webhooks::source::Webhooks,
) -> Value {
    let mut item = webhook_view(snapshot, hook);
    if let (Value::Object(map), Some(why)) =
        (&mut item, webhooks.unavailable().get(hook.name.get_ref()))
    {
        map.insert("unavailable".to_string(), json!(why));
    }
    item
}

pub(super) fn source_view(snapshot: &Snapshot, source: &SourceConfig) -> Value {
    view(
        source,
        snapshot.version_of(&catalog::source_key(source.name())),
    )
}

pub(super) async fn get_catalog(State(state): State<Arc<AdminState>>) -> Response {
    match snapshot_of(&state).await {
        Ok(s) => Json(json!({
            "version": s.version,
            "buses": s.channels.buses.iter().map(|b| bus_view(&s, b)).collect::<Vec<_>>(),
            "rules": s.channels.rules.iter().map(|r| rule_view(&s, r)).collect::<Vec<_>>(),
            "sources": s.channels.sources.iter().map(|r| source_view(&s, r)).collect::<Vec<_>>(),
            "webhooks": s.channels.webhooks.iter().map(|h| webhook_view(&s, h)).collect::<Vec<_>>(),
            "functions": s.channels.functions.iter().map(|f| function_view(&s, f)).collect::<Vec<_>>(),
        }))
        .into_response(),
        Err(p) => p.into_response(),
    }
}

pub(super) async fn list_buses(State(state): State<Arc<AdminState>>) -> Response {
    list(&state, |s| {
        s.channels.buses.iter().map(|b| bus_view(s, b)).collect()
    })
    .await
}

pub(super) async fn list_rules(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
) -> Response {
    match snapshot_of(&state).await {
        Ok(s) if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) => {
            let items: Vec<Value> = s
                .channels
                .rules
                .iter()
                .filter(|r| *r.bus.get_ref() == bus)
                .map(|r| rule_view(&s, r))
                .collect();
            Json(json!({"version": s.version, "items": items})).into_response()
        }
        Ok(_) => no_bus(&bus).into_response(),
        Err(p) => p.into_response(),
    }
}

pub(super) async fn list_sources(State(state): State<Arc<AdminState>>) -> Response {
    list(&state, |s| {
        s.channels
            .sources
            .iter()
            .map(|r| source_view(s, r))
            .collect()
    })
    .await
}

pub(super) async fn list(state: &AdminState, items: impl Fn(&Snapshot) -> Vec<Value>) -> Response {
    match snapshot_of(state).await {
        Ok(s) => Json(json!({"version": s.version, "items": items(&s)})).into_response(),
        Err(p) => p.into_response(),
    }
}

pub(super) fn no_bus(bus: &str) -> Problem {
    Problem::unknown(format!("no bus `{bus}`")).with_field("bus")
}

/// The precheck of a resource that belongs to a bus: the bus is in the catalog.
pub(super) fn bus_exists(bus: &str) -> impl Fn(&Snapshot) -> Result<(), Problem> + '_ {
    move |s| {
        if s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
            Ok(())
        } else {
            Err(no_bus(bus))
        }
    }
}

pub(super) async fn get_bus(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
) -> Response {
    get_one(&state, |s| {
        s.channels
            .buses
            .iter()
            .find(|b| *b.name.get_ref() == bus)
            .map(|b| (bus_view(s, b), s.version_of(&catalog::bus_key(&bus))))
            .ok_or_else(|| no_bus(&bus))
    })
    .await
}

pub(super) async fn get_rule(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule)): Path<(String, String)>,
) -> Response {
    get_one(&state, |s| {
        if !s.channels.buses.iter().any(|b| *b.name.get_ref() == bus) {
            return Err(no_bus(&bus));
        }
        s.channels
            .rules
            .iter()
            .find(|r| *r.bus.get_ref() == bus && *r.name.get_ref() == rule)
            .map(|r| {
                (
                    rule_view(s, r),
                    s.version_of(&catalog::rule_key(&bus, &rule)),
                )
            })
            .ok_or_else(|| {
                Problem::unknown(format!("no rule `{rule}` on bus `{bus}`")).with_field("rule")
            })
    })
    .await
}

pub(super) async fn get_source(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
) -> Response {
    get_one(&state, |s| {
        s.channels
            .sources
            .iter()
            .find(|r| r.name() == name)
            .map(|r| (source_view(s, r), s.version_of(&catalog::source_key(&name))))
            .ok_or_else(|| Problem::unknown(format!("no source `{name}`")).with_field("source"))
    })
    .await
}

pub(super) async fn get_one(
    state: &AdminState,
    find: impl Fn(&Snapshot) -> Result<(Value, u64), Problem>,
) -> Response {
    match snapshot_of(state).await.and_then(|s| find(&s)) {
        Ok((value, version)) => found(value, version),
        Err(p) => p.into_response(),
    }
}

/// The preconditions of a write: `If-Match` (a version, or `*`) and `If-None-Match: *`.
pub(super) struct Preconditions {
    if_match: Option<Vec<String>>,
    if_none_match: bool,
}

impl Preconditions {
    fn from(headers: &HeaderMap) -> Preconditions {
        let list = |name: header::HeaderName| {
            headers.get(name).and_then(|v| v.to_str().ok()).map(|v| {
                v.split(',')
                    .map(|t| {
                        t.trim()
                            .trim_start_matches("W/")
                            .trim_matches('"')
                            .to_string()
                    })
                    .collect::<Vec<_>>()
            })
        };
        Preconditions {
            if_match: list(header::IF_MATCH),
            if_none_match: list(header::IF_NONE_MATCH).is_some_and(|l| l.iter().any(|t| t == "*")),
        }
    }

    /// Checks them against the resource's current version (`None`: it does not exist).
    fn check(&self, current: Option<u64>, what: &str) -> Result<(), Problem> {
        if let Some(tags) = &self.if_match {
            let ok = match current {
                None => false,
                Some(v) => tags.iter().any(|t| t == "*" || *t == v.to_string()),
            };
            if !ok {
                return Err(Problem::precondition_failed(match current {
                    Some(v) => format!("{what} is at version {v}, not the one If-Match names; read it again and retry"),
                    None => format!("{what} does not exist, and If-Match names a version of it"),
                }));
            }
        }
        if self.if_none_match && current.is_some() {
            return Err(Problem::precondition_failed(format!(
                "{what} exists already (If-None-Match: *)"
            )));
        }
        Ok(())
    }
}

/// A resource from a request body: JSON with the configuration file's field names, read by
/// the configuration loader itself (the same TOML deserializer, defaults and checks).
pub(super) fn parse_resource<T: serde::de::DeserializeOwned>(
    body: &[u8],
    path_fields: &[(&str, &str)],
) -> Result<T, Problem> {
    let mut map = json_object(body)?;
    map.remove("version");
    for (field, from_path) in path_fields {
        match map.get(*field) {
            None | Some(Value::Null) => {
                map.insert((*field).to_string(), Value::String((*from_path).to_string()));
            }
            Some(Value::String(s)) if s == from_path => {}
            Some(other) => {
                return Err(Problem::invalid_resource(
                    &format!("/{field}"),
                    format!("`{field}` is {other} in the body and `{from_path}` in the URL; they must agree"),
                ))
            }
        }
    }
    crate::config::from_json(&Value::Object(map))
        .map_err(|(pointer, message)| Problem::invalid_resource(&pointer, message))
}

/// A refused change as problem+json: the field at fault, by JSON pointer, inside the
/// resource the request is about; a problem elsewhere in the catalog (the change breaks
/// another resource) is a conflict naming that one.
pub(super) fn change_problem(
    e: ChangeError<Problem>,
    kind: Kind,
    key: &str,
    after: Option<&Channels>,
) -> Problem {
    match e {
        ChangeError::Rejected(p) => p,
        ChangeError::Store(e) => store_problem(&e),
        ChangeError::Contention => {
            Problem::conflict("the catalog kept changing under this request; try again")
        }
        ChangeError::Invalid(invalid) => {
            let at = after.and_then(|c| key_of(c, invalid.kind, invalid.index));
            if invalid.kind == kind && at.as_deref() == Some(key) {
                Problem::invalid_resource(&invalid.pointer, invalid.message)
            } else {
                Problem::conflict(format!(
                    "the change would break {}: {}",
                    at.unwrap_or_else(|| "another resource".to_string()),
                    invalid.message
                ))
            }
        }
    }
}

/// A change this replica refuses to accept because it could not run it (see
/// `admission`), as problem+json: `400` naming the field when the resource the request is
/// about cannot be built here, `409` naming `/shards` when its bus's log in the store has
/// another shard count.
pub(super) fn admission_problem(
    refusal: crate::admission::Refusal,
    kind: Kind,
    key: &str,
    after: &Channels,
) -> Problem {
    let invalid = refusal.invalid;
    let at = key_of(after, invalid.kind, invalid.index);
    if invalid.kind != kind || at.as_deref() != Some(key) {
        return Problem::conflict(format!(
            "the change would break {}: {}",
            at.unwrap_or_else(|| "another resource".to_string()),
            invalid.message
        ));
    }
    refused(
        Problem::invalid_resource(&invalid.pointer, invalid.message),
        refusal.conflict,
    )
}

/// A refusal's problem, made `409 Conflict` when the store's state refused it (a bus log
/// with another shard count) rather than the resource itself; field and pointer kept.
pub(super) fn refused(mut problem: Problem, conflict: bool) -> Problem {
    if conflict {
        problem.status = StatusCode::CONFLICT.as_u16();
        problem.title = "Conflict";
        problem.kind = Problem::conflict("").kind;
    }
    problem
}

/// Runs this replica's admission checks on a change (`keys`: the resources the request
/// names); `Some(problem)` when it refuses. What the configuration's own checks refuse
/// is left to them (`Catalog::change` says it, with the same pointer as ever).
pub(super) fn admit(
    state: &AdminState,
    before: &Channels,
    after: &Channels,
    keys: &std::collections::HashSet<String>,
    stored: &HashMap<String, u32>,
) -> Option<crate::admission::Refusal> {
    let admission = &state.admission;
    let refusal = admission.check(before, after, keys, stored).err()?;
    catalog::check_change(before, after)
        .is_ok()
        .then_some(refusal)
}

pub(super) fn key_of(channels: &Channels, kind: Kind, index: usize) -> Option<String> {
    match kind {
        Kind::Bus => channels
            .buses
            .get(index)
            .map(|b| catalog::bus_key(b.name.get_ref())),
        Kind::Rule => channels
            .rules
            .get(index)
            .map(|r| catalog::rule_key(r.bus.get_ref(), r.name.get_ref())),
        Kind::Source => channels
            .sources
            .get(index)
            .map(|s| catalog::source_key(s.name())),
        Kind::Webhook => channels
            .webhooks
            .get(index)
            .map(|h| catalog::webhook_key(h.name.get_ref())),
        Kind::Function => channels
            .functions
            .get(index)
            .map(|f| catalog::function_key(&f.name)),
    }
}

/// 201 with `Location` when created, 200 when replaced.
pub(super) fn written(created: bool, location: String, value: Value, version: u64) -> Response {
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    let mut response = (status, [(header::ETAG, etag(version))], Json(value)).into_response();
    if created {
        if let Ok(v) = HeaderValue::from_str(&location) {
            response.headers_mut().insert(header::LOCATION, v);
        }
    }
    response
}

/// One resource of the catalog as the write handlers address it.
pub(super) struct Addressed<T> {
    kind: Kind,
    /// Its key in the version map.
    key: String,
    /// How messages name it (`rule \`r\` on bus \`b\``).
    what: String,
    /// Its URL (`Location` of a created one).
    location: String,
    /// The 404 when it is not there.
    missing: Problem,
    list: fn(&Channels) -> &Vec<T>,
    list_mut: fn(&mut Channels) -> &mut Vec<T>,
    view: fn(&Snapshot, &T) -> Value,
}

pub(super) fn buses_of(c: &Channels) -> &Vec<BusConfig> {
    &c.buses
}
pub(super) fn buses_mut(c: &mut Channels) -> &mut Vec<BusConfig> {
    &mut c.buses
}
pub(super) fn rules_of(c: &Channels) -> &Vec<RuleConfig> {
    &c.rules
}
pub(super) fn rules_mut(c: &mut Channels) -> &mut Vec<RuleConfig> {
    &mut c.rules
}
pub(super) fn sources_of(c: &Channels) -> &Vec<SourceConfig> {
    &c.sources
}
pub(super) fn sources_mut(c: &mut Channels) -> &mut Vec<SourceConfig> {
    &mut c.sources
}

pub(super) fn bus_addressed(bus: &str) -> Addressed<BusConfig> {
    Addressed {
        kind: Kind::Bus,
        key: catalog::bus_key(bus),
        what: format!("bus `{bus}`"),
        location: format!("/api/v1/buses/{bus}"),
        missing: no_bus(bus),
        list: buses_of,
        list_mut: buses_mut,
        view: bus_view,
    }
}

pub(super) fn rule_addressed(bus: &str, rule: &str) -> Addressed<RuleConfig> {
    Addressed {
        kind: Kind::Rule,
        key: catalog::rule_key(bus, rule),
        what: format!("rule `{rule}` on bus `{bus}`"),
        location: format!("/api/v1/buses/{bus}/rules/{rule}"),
        missing: Problem::unknown(format!("no rule `{rule}` on bus `{bus}`")).with_field("rule"),
        list: rules_of,
        list_mut: rules_mut,
        view: rule_view,
    }
}

pub(super) fn source_addressed(name: &str) -> Addressed<SourceConfig> {
    Addressed {
        kind: Kind::Source,
        key: catalog::source_key(name),
        what: format!("source `{name}`"),
        location: format!("/api/v1/sources/{name}"),
        missing: Problem::unknown(format!("no source `{name}`")).with_field("source"),
        list: sources_of,
        list_mut: sources_mut,
        view: source_view,
    }
}

pub(super) fn webhooks_of(c: &Channels) -> &Vec<WebhookConfig> {
    &c.webhooks
}
pub(super) fn webhooks_mut(c: &mut Channels) -> &mut Vec<WebhookConfig> {
    &mut c.webhooks
}

pub(super) fn no_webhook(name: &str) -> Problem {
    Problem::unknown(format!("no webhook source `{name}` in the catalog")).with_field("name")
}

pub(super) fn webhook_addressed(name: &str) -> Addressed<WebhookConfig> {
    Addressed {
        kind: Kind::Webhook,
        key: catalog::webhook_key(name),
        what: format!("webhook source `{name}`"),
        location: format!("/api/v1/webhooks/{name}"),
        missing: no_webhook(name),
        list: webhooks_of,
        list_mut: webhooks_mut,
        view: webhook_view,
    }
}

pub(super) fn functions_of(c: &Channels) -> &Vec<crate::wasm::FunctionConfig> {
    &c.functions
}
pub(super) fn functions_mut(c: &mut Channels) -> &mut Vec<crate::wasm::FunctionConfig> {
    &mut c.functions
}

pub(super) fn no_function(name: &str) -> Problem {
    Problem::unknown(format!("no function `{name}`")).with_field("name")
}

/// A function as the API shows it: its settings, version, and what this replica runs of
/// it (`running`: the SHA-256 of the version calls use; `error`: why the catalog's
/// version cannot be loaded here).
pub(super) fn function_view(snapshot: &Snapshot, f: &crate::wasm::FunctionConfig) -> Value {
    let mut value = view(f, snapshot.version_of(&catalog::function_key(&f.name)));
    if let Value::Object(map) = &mut value {
        let loaded = crate::wasm::registry().loaded();
        map.insert(
            "loaded".to_string(),
            serde_json::to_value(loaded.get(&f.name)).unwrap_or(Value::Null),
        );
        map.insert(
            "component".to_string(),
            json!(format!("/api/v1/functions/{}/component", f.name)),
        );
    }
    value
}

pub(super) fn function_addressed(name: &str) -> Addressed<crate::wasm::FunctionConfig> {
    Addressed {
        kind: Kind::Function,
        key: catalog::function_key(name),
        what: format!("function `{name}`"),
        location: format!("/api/v1/functions/{name}"),
        missing: no_function(name),
        list: functions_of,
        list_mut: functions_mut,
        view: function_view,
    }
}

/// `PUT` of a resource: creates (201) or replaces (200) it under the request's
/// preconditions, after `precheck` (which may refuse, e.g. a rule of a missing bus).
///
/// The change is accepted only if this replica can build the resource (see `admission`);
/// `stored` holds the shard count of its bus's log in the store, for a bus.
pub(super) async fn put_resource<T: Clone>(
    state: &AdminState,
    headers: &HeaderMap,
    at: Addressed<T>,
    resource: T,
    is: impl Fn(&T) -> bool,
    precheck: impl Fn(&Snapshot) -> Result<(), Problem>,
    stored: HashMap<String, u32>,
) -> Response {
    let catalog = state.catalog.clone();
    let pre = Preconditions::from(headers);
    let mut attempted = None;
    let keys = std::collections::HashSet::from([at.key.clone()]);
    let result = catalog
        .change(|s| {
            precheck(s)?;
            let found = (at.list)(&s.channels).iter().position(&is);
            pre.check(found.map(|_| s.version_of(&at.key)), &at.what)?;
            let mut next = s.channels.clone();
            match found {
                Some(i) => (at.list_mut)(&mut next)[i] = resource.clone(),
                None => (at.list_mut)(&mut next).push(resource.clone()),
            }
            if let Some(refusal) = admit(state, &s.channels, &next, &keys, &stored) {
                return Err(admission_problem(refusal, at.kind, &at.key, &next));
            }
            attempted = Some(next.clone());
            Ok((Some(next), found.is_none()))
        })
        .await;
    match result {
        Ok(done) => {
            let s = &done.snapshot;
            let Some(stored) = (at.list)(&s.channels).iter().find(|r| is(r)) else {
                return Problem::internal(format!(
                    "{} is not in the catalog after writing it",
                    at.what
                ))
                .into_response();
            };
            written(
                done.value,
                at.location.clone(),
                (at.view)(s, stored),
                s.version_of(&at.key),
            )
        }
        Err(e) => change_problem(e, at.kind, &at.key, attempted.as_ref()).into_response(),
    }
}

/// `DELETE` of a resource (204) under the request's preconditions, unless `in_use` refuses.
pub(super) async fn delete_resource<T>(
    state: &AdminState,
    headers: &HeaderMap,
    at: Addressed<T>,
    is: impl Fn(&T) -> bool,
    in_use: impl Fn(&Snapshot) -> Result<(), Problem>,
) -> Response {
    let catalog = state.catalog.clone();
    let pre = Preconditions::from(headers);
    let result = catalog
        .change(|s| {
            let Some(found) = (at.list)(&s.channels).iter().position(&is) else {
                return Err(at.missing.clone());
            };
            pre.check(Some(s.version_of(&at.key)), &at.what)?;
            in_use(s)?;
            let mut next = s.channels.clone();
            (at.list_mut)(&mut next).remove(found);
            Ok((Some(next), ()))
        })
        .await;
    match result {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => change_problem(e, at.kind, &at.key, None).into_response(),
    }
}

pub(super) async fn put_bus(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: BusConfig = match parse_resource(&body, &[("name", &bus)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |b: &BusConfig| *b.name.get_ref() == bus;
    // Whether the store still holds a log of this bus (deleted and made again), and with
    // how many shards: asked before the change, which is made without waiting.
    let stored = match state
        .admission
        .stored_shards([(bus.as_str(), resource.shards)])
        .await
    {
        Ok(stored) => stored,
        Err(e) => return store_problem(&e).into_response(),
    };
    put_resource(
        &state,
        &headers,
        bus_addressed(&bus),
        resource,
        is,
        |_| Ok(()),
        stored,
    )
    .await
}

pub(super) async fn put_rule(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule)): Path<(String, String)>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: RuleConfig = match parse_resource(&body, &[("name", &rule), ("bus", &bus)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |r: &RuleConfig| *r.bus.get_ref() == bus && *r.name.get_ref() == rule;
    put_resource(
        &state,
        &headers,
        rule_addressed(&bus, &rule),
        resource,
        is,
        bus_exists(&bus),
        HashMap::new(),
    )
    .await
}

pub(super) async fn put_source(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let resource: SourceConfig = match parse_resource(&body, &[("name", &name)]) {
        Ok(r) => r,
        Err(p) => return p.into_response(),
    };
    let is = |r: &SourceConfig| r.name() == name;
    put_resource(
        &state,
        &headers,
        source_addressed(&name),
        resource,
        is,
        |_| Ok(()),
        HashMap::new(),
    )
    .await
}

pub(super) async fn delete_bus(
    State(state): State<Arc<AdminState>>,
    Path(bus): Path<String>,
    headers: HeaderMap,
) -> Response {
    // What this replica's own file ties to the bus (webhook sources, schemas).
    let webhooks = state.webhooks();
    let local: Vec<String> = webhooks
        .file_buses()
        .filter(|(_, b)| *b == bus)
        .map(|(name, _)| format!("webhook `{name}` (this replica's file)"))
        .chain(
            state
                .ingress
                .settings()
                .schemas
                .get(&bus)
                .map(|_| "its JSON Schemas".to_string()),
        )
        .collect();
    let unused = |s: &Snapshot| {
        let mut users: Vec<String> = s
            .channels
            .rules
            .iter()
            .filter(|r| *r.bus.get_ref() == bus)
            .map(|r| format!("rule `{}`", r.name.get_ref()))
            .chain(
                s.channels
                    .sources
                    .iter()
                    .filter(|r| r.bus() == bus)
                    .map(|r| format!("source `{}`", r.name())),
            )
            .chain(
                s.channels
                    .webhooks
                    .iter()
                    .filter(|h| h.bus == bus)
                    .map(|h| format!("webhook `{}`", h.name.get_ref())),
            )
            .collect();
        users.extend(local.iter().cloned());
        if users.is_empty() {
            Ok(())
        } else {
            Err(Problem::conflict(format!(
                "bus `{bus}` is used by {}; delete those first",
                users.join(", ")
            )))
        }
    };
    let is = |b: &BusConfig| *b.name.get_ref() == bus;
    delete_resource(&state, &headers, bus_addressed(&bus), is, unused).await
}

pub(super) async fn delete_rule(
    State(state): State<Arc<AdminState>>,
    Path((bus, rule)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let is = |r: &RuleConfig| *r.bus.get_ref() == bus && *r.name.get_ref() == rule;
    delete_resource(
        &state,
        &headers,
        rule_addressed(&bus, &rule),
        is,
        |_| Ok(()),
    )
    .await
}

pub(super) async fn delete_source(
    State(state): State<Arc<AdminState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    let is = |r: &SourceConfig| r.name() == name;
    delete_resource(&state, &headers, source_addressed(&name), is, |_| Ok(())).await
}
