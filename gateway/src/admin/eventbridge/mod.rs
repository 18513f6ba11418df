//! The control plane of Apache RocketMQ EventBridge (`adapter/api` of
//! `apache/rocketmq-eventbridge`: `EventBusController`, `EventRuleController`,
//! `EventTargetController` and their DTOs), served on the catalog: `POST /bus/*`,
//! `/rule/*` and `/target/*` with the project's camelCase bodies, answered with its
//! `BaseResponse` (`requestId`, `code`, `message`) and, on failure, its
//! `EventBridgeErrorCode` names and HTTP status (409 for every refusal, as the project).
//!
//! Every write goes through the handlers of `/api/v1` (`resources::put_bus`, `put_rule`,
//! `delete_bus`, `delete_rule`): the same checks, admission, versions and `If-Match`; their
//! problem+json refusals are translated here. A read-modify-write (targets, pattern) sends
//! the version it read as `If-Match`, so a concurrent writer is never overwritten.
//!
//! Two things the catalog has no field for are mapped onto real mechanisms:
//! - a rule without targets (RocketMQ EventBridge creates the rule first, its targets
//!   after): stored with one `log` target named [`PENDING_TARGET`] and the pattern's
//!   `specversion` held to a value no event has ([`PENDING_SPECVERSION`]), so it matches
//!   nothing until its first target comes;
//! - a disabled rule: each of its targets' connectors (`{bus}/{rule}/{target}`) is paused,
//!   as `POST /api/v1/connectors/{bus}/{rule}/{target}/pause` does. Paused connectors keep
//!   their position: events that arrive while the rule is disabled are delivered once it is
//!   enabled again (within the bus's `max_backlog_age`).
//!
//! `description` and `createTimestamp` are not stored (the catalog has no such fields).

use std::sync::Arc;

use axum::routing::post;
use axum::Router;

use crate::admin::state::AdminState;

mod buses;
mod convert;
mod dto;
mod paging;
mod rules;
mod targets;
mod v1;

pub use convert::{PENDING_SPECVERSION, PENDING_TARGET};

use buses::{create_bus, delete_bus, get_bus, list_buses};
use rules::{
    create_rule, delete_rule, disable_rule, enable_rule, get_rule, list_rules, update_rule,
};
use targets::{create_targets, delete_targets, list_targets, update_targets};

pub(crate) fn routes() -> Router<Arc<AdminState>> {
    // The controllers' own paths, and the shorter names some clients use.
    Router::new()
        .route("/bus/createEventBus", post(create_bus))
        .route("/bus/getEventBus", post(get_bus))
        .route("/bus/deleteEventBus", post(delete_bus))
        .route("/bus/listEventBuses", post(list_buses))
        .route("/rule/createEventRule", post(create_rule))
        .route("/rule/getEventRule", post(get_rule))
        .route("/rule/getRule", post(get_rule))
        .route("/rule/updateEventRule", post(update_rule))
        .route("/rule/updateRule", post(update_rule))
        .route("/rule/deleteEventRule", post(delete_rule))
        .route("/rule/deleteRule", post(delete_rule))
        .route("/rule/listEventRules", post(list_rules))
        .route("/rule/listRules", post(list_rules))
        .route("/rule/enableEventRule", post(enable_rule))
        .route("/rule/enableRule", post(enable_rule))
        .route("/rule/disableEventRule", post(disable_rule))
        .route("/rule/disableRule", post(disable_rule))
        .route("/target/createEventTargets", post(create_targets))
        .route("/target/updateEventTargets", post(update_targets))
        .route("/target/deleteEventTargets", post(delete_targets))
        .route("/target/listEventTargets", post(list_targets))
}
