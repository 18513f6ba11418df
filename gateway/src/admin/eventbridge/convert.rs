//! The catalog's rules and targets as the project's DTOs (`EventRuleDTO`,
//! `EventTargetDTO`), and the project's requests as rule and target configuration: the
//! stand-in of a rule without targets, a rule's status from its paused connectors, the
//! target classes served.

use axum::body::Bytes;
use serde_json::{json, Map, Value};

use crate::config::RuleConfig;
use crate::targets::config::TargetConfig;

use crate::admin::eventbridge::dto::{field, kind_of, name_field, string_field, EbError};

/// The name of the stand-in target of a rule that has no targets yet.
pub const PENDING_TARGET: &str = "eventbridge-pending";
/// The `specversion` a rule without targets requires: no event has it.
pub const PENDING_SPECVERSION: &str = "sluice-eventbridge-rule-without-targets";

/// Whether a rule is the stand-in of a rule without targets.
pub(super) fn is_pending(rule: &RuleConfig) -> bool {
    rule.targets.len() == 1
        && rule.targets[0].name() == PENDING_TARGET
        && matches!(rule.targets[0], TargetConfig::Log(_))
}

/// The rule's pattern as the project shows it (`filterPattern`, a JSON string), without
/// the stand-in's condition.
pub(super) fn filter_pattern(rule: &RuleConfig) -> String {
    let mut pattern = rule
        .pattern
        .as_ref()
        .and_then(|p| serde_json::to_value(p.get_ref()).ok())
        .unwrap_or_else(|| json!({}));
    if is_pending(rule) {
        if let Value::Object(map) = &mut pattern {
            map.remove("specversion");
        }
    }
    match (&rule.filter, &pattern) {
        // A rule written through `/api/v1` with a CESQL filter: shown as it is.
        (Some(sql), Value::Object(m)) if m.is_empty() => {
            json!({ "cesql": sql.get_ref() }).to_string()
        }
        _ => pattern.to_string(),
    }
}

pub(super) fn connector_id(bus: &str, rule: &str, target: &str) -> String {
    format!("{bus}/{rule}/{target}")
}

/// `ENABLE`, or `DISABLE` when every target of the rule is paused.
pub(super) fn status(
    rule: &RuleConfig,
    paused: &std::collections::HashSet<String>,
) -> &'static str {
    let (bus, name) = (rule.bus.get_ref(), rule.name.get_ref());
    if !rule.targets.is_empty()
        && rule
            .targets
            .iter()
            .all(|t| paused.contains(&connector_id(bus, name, t.name())))
    {
        "DISABLE"
    } else {
        "ENABLE"
    }
}

pub(super) fn rule_dto(rule: &RuleConfig, status: &str, version: u64) -> Value {
    json!({
        "eventBusName": rule.bus.get_ref(),
        "eventRuleName": rule.name.get_ref(),
        "description": null,
        "filterPattern": filter_pattern(rule),
        "status": status,
        "gmtCreate": null,
        "gmtModify": null,
        "version": version,
    })
}

/// A `filterPattern` (a JSON string holding an EventBridge pattern) as a rule's `pattern`.
pub(super) fn parse_pattern(request: &Map<String, Value>) -> Result<Map<String, Value>, EbError> {
    let text = match field(request, "filterPattern") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        // Some clients send the pattern as JSON rather than as a string of JSON.
        Some(Value::Object(map)) => return Ok(map.clone()),
        Some(Value::String(_)) | None => {
            return Err(EbError::new(
                "EventRuleFilterPatternEmpty",
                "The filter pattern is empty! ",
            ))
        }
        Some(other) => {
            return Err(EbError::new(
                "EventRuleFilterPatternSchemaError",
                format!(
                    "The filter pattern is invalid! It must be a string of JSON, not {}.",
                    kind_of(other)
                ),
            ))
        }
    };
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(EbError::new(
            "EventRuleFilterPatternSchemaError",
            format!(
                "The filter pattern is invalid! It must be a JSON object, not {}.",
                kind_of(&other)
            ),
        )),
        Err(e) => Err(EbError::new(
            "EventRuleFilterPatternSchemaError",
            format!("The filter pattern is invalid! It is not JSON: {e}"),
        )),
    }
}

/// The `/api/v1` body of a rule: its pattern and targets (as configuration JSON). With no
/// targets, the stand-in target and the condition that matches nothing.
pub(super) fn rule_body(
    pattern: &Map<String, Value>,
    targets: Vec<Value>,
) -> Result<Bytes, EbError> {
    let mut pattern = pattern.clone();
    let targets = if targets.is_empty() {
        if pattern.contains_key("specversion") {
            return Err(EbError::new(
                "EventRuleFilterPatternSchemaError",
                "The filter pattern is invalid! A rule without targets cannot match on `specversion` here; create it with its targets, or leave `specversion` out",
            ));
        }
        pattern.insert("specversion".to_string(), json!([PENDING_SPECVERSION]));
        vec![json!({"type": "log", "name": PENDING_TARGET})]
    } else {
        targets
    };
    let mut rule = Map::new();
    if !pattern.is_empty() {
        rule.insert("pattern".to_string(), Value::Object(pattern));
    }
    rule.insert("targets".to_string(), Value::Array(targets));
    Ok(Bytes::from(Value::Object(rule).to_string()))
}

/// A rule's current targets as configuration JSON (none for the stand-in).
pub(super) fn targets_json(rule: &RuleConfig) -> Vec<Value> {
    if is_pending(rule) {
        return Vec::new();
    }
    rule.targets
        .iter()
        .filter_map(|t| serde_json::to_value(t).ok())
        .collect()
}

/// A rule's current pattern as JSON (without the stand-in's condition).
pub(super) fn pattern_json(rule: &RuleConfig) -> Result<Map<String, Value>, EbError> {
    if rule.filter.is_some() {
        return Err(EbError::invalid(format!(
            "rule `{}` uses a CESQL `filter` (written through /api/v1); change it there",
            rule.name.get_ref()
        )));
    }
    let mut pattern = match rule
        .pattern
        .as_ref()
        .and_then(|p| serde_json::to_value(p.get_ref()).ok())
    {
        Some(Value::Object(map)) => map,
        _ => Map::new(),
    };
    if is_pending(rule) {
        pattern.remove("specversion");
    }
    Ok(pattern)
}

/// The project's `EventTargetDTO` of a Sluice target: http targets as class `http`
/// (`config.url`), file targets as class `file` (`config.fileName`), others as
/// `sluice.{type}` with their configuration.
pub(super) fn target_dto(target: &TargetConfig) -> Value {
    let (class, config) = match target {
        TargetConfig::Http(http) => ("http".to_string(), json!({ "url": http.url })),
        TargetConfig::File(file) => ("file".to_string(), json!({ "fileName": file.path })),
        other => {
            let mut config = serde_json::to_value(other).unwrap_or(Value::Null);
            let kind = config["type"].as_str().unwrap_or("target").to_string();
            if let Value::Object(map) = &mut config {
                map.remove("type");
                map.remove("name");
            }
            (format!("sluice.{kind}"), config)
        }
    };
    let (retry, _) = target.delivery();
    json!({
        "eventTargetName": target.name(),
        "className": class,
        "config": config,
        "runOptions": {
            "retryStrategy": {
                "pushRetryStrategy": "BACKOFF_RETRY",
                "maximumRetryAttempts": retry.max_attempts.saturating_sub(1),
                "maximumEventAgeInSeconds": retry.max_event_age.as_secs(),
            }
        },
    })
}

pub(super) fn target_dtos(rule: &RuleConfig) -> Vec<Value> {
    if is_pending(rule) {
        return Vec::new();
    }
    rule.targets.iter().map(target_dto).collect()
}

/// The classes served, and what they become.
const CLASSES: &str = "http, acs.api.destination (Sluice http target), file (Sluice file target)";

/// A string in a target's `config`, by any of `names` (the project's and Alibaba Cloud's
/// spellings).
pub(super) fn config_string(
    config: &Map<String, Value>,
    names: &[&str],
) -> Result<Option<String>, EbError> {
    for name in names {
        match config.get(*name) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => return Ok(Some(s.clone())),
            Some(other) => {
                return Err(EbError::new(
                    "EventTargetIneffectiveAttribute",
                    format!(
                        "The attribute [{name}] is ineffective: a string is expected, not {}.",
                        kind_of(other)
                    ),
                ))
            }
        }
    }
    Ok(None)
}

/// A project `EventTargetDTO` as a Sluice target (configuration JSON).
pub(super) fn target_config(dto: &Value) -> Result<(String, Value), EbError> {
    let Value::Object(dto) = dto else {
        return Err(EbError::invalid(format!(
            "each of `eventTargets` must be an object, not {}",
            kind_of(dto)
        )));
    };
    let name = name_field(
        dto,
        "eventTargetName",
        "RequestParameterInvalid",
        "event target",
    )?;
    let class = string_field(dto, "className")?.unwrap_or_default();
    let config = match field(dto, "config") {
        None => Map::new(),
        Some(Value::Object(map)) => map.clone(),
        Some(other) => {
            return Err(EbError::invalid(format!(
                "`config` of target `{name}` must be an object, not {}",
                kind_of(other)
            )))
        }
    };
    let mut target = match class.as_str() {
        "http" | "acs.api.destination" | "acs.http" => {
            let url = config_string(&config, &["url", "endpoint", "Url", "Endpoint"])?
                .ok_or_else(|| {
                    EbError::new(
                        "EventTargetMissingAttribute",
                        format!("Missing the attribute [url:the endpoint the events are POSTed to] of target [{name}] "),
                    )
                })?;
            json!({"type": "http", "name": name, "url": url})
        }
        "file" => {
            let path = config_string(&config, &["fileName", "FileName"])?.ok_or_else(|| {
                EbError::new(
                    "EventTargetMissingAttribute",
                    format!("Missing the attribute [fileName:the output file name] of target [{name}] "),
                )
            })?;
            json!({"type": "file", "name": name, "path": path})
        }
        "" => {
            return Err(EbError::new(
                "EventTargetClassNotExist",
                format!("The event target class [] not existed! `className` of target [{name}] is required ({CLASSES})"),
            ))
        }
        other => {
            let shown: String = other.chars().take(128).collect();
            return Err(EbError::new(
                "EventTargetClassNotExist",
                format!("The event target class [{shown}] not existed! Sluice has no equivalent of it; the classes served are {CLASSES}"),
            ));
        }
    };
    if let Some(retry) = retry_of(dto, &name)? {
        if target["type"] == "http" {
            target["retry"] = retry;
        }
    }
    Ok((name, target))
}

/// `runOptions.retryStrategy` as a Sluice retry policy: attempts are the retries plus the
/// first one.
pub(super) fn retry_of(dto: &Map<String, Value>, name: &str) -> Result<Option<Value>, EbError> {
    let Some(options) = field(dto, "runOptions") else {
        return Ok(None);
    };
    let Value::Object(options) = options else {
        return Err(EbError::invalid(format!(
            "`runOptions` of target `{name}` must be an object"
        )));
    };
    let Some(strategy) = field(options, "retryStrategy") else {
        return Ok(None);
    };
    let Value::Object(strategy) = strategy else {
        return Err(EbError::invalid(format!(
            "`runOptions.retryStrategy` of target `{name}` must be an object"
        )));
    };
    let number = |key: &str| -> Result<Option<u64>, EbError> {
        match field(strategy, key) {
            None => Ok(None),
            Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
                EbError::invalid(format!(
                    "`runOptions.retryStrategy.{key}` of target `{name}` must be a whole number from 0"
                ))
            }),
            Some(other) => Err(EbError::invalid(format!(
                "`runOptions.retryStrategy.{key}` of target `{name}` must be a number, not {}",
                kind_of(other)
            ))),
        }
    };
    let mut retry = Map::new();
    if let Some(n) = number("maximumRetryAttempts")? {
        let attempts = u32::try_from(n.saturating_add(1)).unwrap_or(u32::MAX);
        retry.insert("max_attempts".to_string(), json!(attempts));
    }
    if let Some(secs) = number("maximumEventAgeInSeconds")? {
        if secs > 0 {
            retry.insert("max_event_age".to_string(), json!(format!("{secs}s")));
        }
    }
    Ok((!retry.is_empty()).then_some(Value::Object(retry)))
}

/// `eventTargets` of a request, converted, with their names unique.
pub(super) fn targets_of(request: &Map<String, Value>) -> Result<Vec<(String, Value)>, EbError> {
    let list = match field(request, "eventTargets") {
        Some(Value::Array(list)) if !list.is_empty() => list,
        Some(Value::Array(_)) | None => {
            return Err(EbError::invalid(
                "`eventTargets` must list at least one target",
            ))
        }
        Some(other) => {
            return Err(EbError::invalid(format!(
                "`eventTargets` must be an array, not {}",
                kind_of(other)
            )))
        }
    };
    if list.len() > 64 {
        return Err(EbError::invalid(format!(
            "`eventTargets` lists {} targets; at most 64 are taken in one request",
            list.len()
        )));
    }
    let mut out: Vec<(String, Value)> = Vec::with_capacity(list.len());
    for dto in list {
        let (name, target) = target_config(dto)?;
        if out.iter().any(|(n, _)| *n == name) {
            return Err(EbError::invalid(format!(
                "target `{name}` is listed twice in `eventTargets`"
            )));
        }
        out.push((name, target));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_classes_map_or_are_named() {
        let (_, http) = target_config(&json!({
            "eventTargetName": "t", "className": "acs.api.destination",
            "config": {"url": "http://127.0.0.1:1/x"},
            "runOptions": {"retryStrategy": {"maximumRetryAttempts": 3, "maximumEventAgeInSeconds": 60}}
        }))
        .expect("http");
        assert_eq!(http["type"], "http");
        assert_eq!(http["retry"]["max_attempts"], 4);
        assert_eq!(http["retry"]["max_event_age"], "60s");
        let e = target_config(&json!({"eventTargetName": "t", "className": "acs.dingtalk"}))
            .expect_err("no equivalent");
        assert_eq!(e.code, "EventTargetClassNotExist");
        assert!(e.message.contains("[acs.dingtalk]"), "{}", e.message);
        let e = target_config(&json!({"eventTargetName": "t", "className": "http", "config": {}}))
            .expect_err("no url");
        assert_eq!(e.code, "EventTargetMissingAttribute");
        let e = target_config(&json!({"eventTargetName": 7, "className": "http"}))
            .expect_err("wrong type");
        assert_eq!(e.code, "RequestParameterInvalid");
    }
}
