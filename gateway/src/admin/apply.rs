//! `POST /api/v1/catalog/apply`: a whole file of resources applied as one change (`sluice
//! ctl apply -f`), merged into the catalog or replacing it (`prune`).

// Handlers return `Result<_, Problem>` and answer with the problem as is: one per admin
// request, off every hot path, so it is not boxed.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::admin::resources::*;
use crate::admin::state::{query_pairs, store_problem, AdminState};
use crate::catalog::{self, ChangeError, Snapshot};
use crate::config::{Channels, Kind};
use crate::problem::Problem;

/// `POST /api/v1/catalog/apply`: makes the catalog hold a file's resources, as one change.
/// `?prune=true` also deletes what the file does not have; `?dry_run=true` only reports.
pub(super) async fn apply(
    State(state): State<Arc<AdminState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    body: axum::body::Bytes,
) -> Response {
    let catalog = state.catalog.clone();
    let mut prune = false;
    let mut dry_run = false;
    for (key, value) in query_pairs(query.as_deref(), "true") {
        let flag = match value {
            "true" | "1" | "" => true,
            "false" | "0" => false,
            other => {
                return Problem::bad_request(
                    key,
                    format!("`{key}` must be true or false, not `{other}`"),
                )
                .into_response()
            }
        };
        match key {
            "prune" => prune = flag,
            "dry_run" => dry_run = flag,
            other => {
                return Problem::bad_request(
                    other,
                    format!("unknown parameter `{other}` (prune, dry_run)"),
                )
                .into_response()
            }
        }
    }
    // Knative Triggers (`"triggers"`) become rules on their brokers' buses.
    let body = match crate::ingress::compat::knative::apply_triggers(
        body,
        state.ingress.knative_brokers(),
    ) {
        Ok(body) => body,
        Err(p) => return p.into_response(),
    };
    let file: Channels = match parse_resource(&body, &[]) {
        Ok(c) => c,
        Err(p) => return p.into_response(),
    };
    // Functions name components already stored (`sluice ctl apply` uploads the files a
    // `path` names first, and sends their hashes).
    for (i, f) in file.functions.iter().enumerate() {
        let Some(sha) = &f.sha256 else {
            return Problem::invalid_resource(
                &format!("/functions/{i}/path"),
                format!(
                    "function `{}`: upload the component first (PUT /api/v1/functions/{}, or `sluice ctl apply`, which uploads `path`) and name it by `sha256`",
                    f.name, f.name
                ),
            )
            .into_response();
        };
        match state.catalog.store().has_component(sha).await {
            Ok(true) => {}
            // `sluice ctl apply --dry-run` names the files' components without uploading.
            Ok(false) if dry_run => {}
            Ok(false) => {
                return Problem::invalid_resource(
                    &format!("/functions/{i}/sha256"),
                    format!(
                        "function `{}`: no component with SHA-256 {sha} was uploaded",
                        f.name
                    ),
                )
                .into_response()
            }
            Err(e) => return store_problem(&e).into_response(),
        }
    }
    // The body's resources are the ones this replica must be able to build; its buses,
    // the ones whose logs the store may still hold with another shard count.
    let keys = crate::admission::keys_of(&file);
    let buses: Vec<(&str, u32)> = file
        .buses
        .iter()
        .map(|b| (b.name.get_ref().as_str(), b.shards))
        .collect();
    let stored = match state.admission.stored_shards(buses).await {
        Ok(stored) => stored,
        Err(e) => return store_problem(&e).into_response(),
    };
    let mut attempted = None;
    let result = catalog
        .change(|s| {
            let (next, report) = merge(&s.channels, &file, prune);
            if let Some(refusal) = admit(&state, &s.channels, &next, &keys, &stored) {
                return Err(refused(
                    applied_invalid(&next, &file, &refusal.invalid),
                    refusal.conflict,
                ));
            }
            attempted = Some(next.clone());
            Ok::<_, Problem>((if dry_run { None } else { Some(next) }, report))
        })
        .await;
    match result {
        Ok(done) => {
            if dry_run {
                // Checked like a real apply, without writing.
                if let Some(next) = &attempted {
                    if let Err(invalid) = catalog::check_change(&done.snapshot.channels, next) {
                        return applied_invalid(next, &file, &invalid).into_response();
                    }
                }
            }
            Json(json!({
                "version": done.snapshot.version,
                "dry_run": dry_run,
                "changed": done.written,
                "resources": done.value,
            }))
            .into_response()
        }
        Err(ChangeError::Invalid(invalid)) => match &attempted {
            Some(next) => applied_invalid(next, &file, &invalid).into_response(),
            None => Problem::invalid_resource("", invalid.message).into_response(),
        },
        Err(e) => change_problem(e, Kind::Bus, "", None).into_response(),
    }
}

/// A refused apply: the pointer is into the request body (`/rules/2/targets/0/...`) when
/// the resource at fault is one of the body's, else empty; `resource` names it either way.
pub(super) fn applied_invalid(
    next: &Channels,
    body: &Channels,
    invalid: &crate::config::Invalid,
) -> Problem {
    let at = key_of(next, invalid.kind, invalid.index).unwrap_or_default();
    let (list, keys): (&str, Vec<String>) = match invalid.kind {
        Kind::Bus => (
            "buses",
            body.buses
                .iter()
                .map(|b| catalog::bus_key(b.name.get_ref()))
                .collect(),
        ),
        Kind::Rule => (
            "rules",
            body.rules
                .iter()
                .map(|r| catalog::rule_key(r.bus.get_ref(), r.name.get_ref()))
                .collect(),
        ),
        Kind::Source => (
            "sources",
            body.sources
                .iter()
                .map(|s| catalog::source_key(s.name()))
                .collect(),
        ),
        Kind::Webhook => (
            "webhooks",
            body.webhooks
                .iter()
                .map(|h| catalog::webhook_key(h.name.get_ref()))
                .collect(),
        ),
        Kind::Function => (
            "functions",
            body.functions
                .iter()
                .map(|f| catalog::function_key(&f.name))
                .collect(),
        ),
    };
    let pointer = match keys.iter().position(|k| *k == at) {
        Some(i) => format!("/{list}/{i}{}", invalid.pointer),
        None => String::new(),
    };
    Problem::invalid_resource(&pointer, format!("{at}: {}", invalid.message))
        .with_extra("resource", json!(at))
}

/// The catalog after applying `file` to `current`, and what happened to each resource.
pub(super) fn merge(current: &Channels, file: &Channels, prune: bool) -> (Channels, Vec<Value>) {
    let before = Snapshot::resources(current);
    let wanted = Snapshot::resources(file);
    let mut report = Vec::new();
    let mut next = if prune {
        Channels::default()
    } else {
        current.clone()
    };
    if prune {
        for key in before.keys().filter(|k| !wanted.contains_key(*k)) {
            report.push(json!({"resource": key, "result": "deleted"}));
        }
    }
    upsert(&mut next.buses, &file.buses, |a, b| {
        a.name.get_ref() == b.name.get_ref()
    });
    upsert(&mut next.rules, &file.rules, |a, b| {
        a.bus.get_ref() == b.bus.get_ref() && a.name.get_ref() == b.name.get_ref()
    });
    upsert(&mut next.sources, &file.sources, |a, b| {
        a.name() == b.name()
    });
    upsert(&mut next.webhooks, &file.webhooks, |a, b| {
        a.name.get_ref() == b.name.get_ref()
    });
    upsert(&mut next.functions, &file.functions, |a, b| {
        a.name == b.name
    });
    for (key, json) in &wanted {
        let result = match before.get(key) {
            None => "created",
            Some(old) if old == json => "unchanged",
            Some(_) => "updated",
        };
        report.push(json!({"resource": key, "result": result}));
    }
    (next, report)
}

/// Puts each of `wanted` into `list`: in place of the one it is `same` as, or at the end.
fn upsert<T: Clone>(list: &mut Vec<T>, wanted: &[T], same: impl Fn(&T, &T) -> bool) {
    for item in wanted {
        match list.iter().position(|old| same(old, item)) {
            Some(i) => list[i] = item.clone(),
            None => list.push(item.clone()),
        }
    }
}
