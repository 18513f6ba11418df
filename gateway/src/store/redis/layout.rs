//! The key layout in Redis, and the move from the first one. The first layout named keys
//! without hash tags (`{p}:bus:{bus}:{shard}`, `{p}:gpos:…`, `{p}:lease:{task}`, …), which
//! a Redis Cluster would scatter over slots and refuse in one script. The current one tags
//! every key a script touches with its shard or task (see `mod.rs`), on one server as on a
//! cluster. `{p}:layout` holds `2` once a deployment is on it.
//!
//! A gateway in distributed mode calls [`prepare`] before it does anything else. On one
//! server, a deployment still on the first layout is moved in one atomic script (streams,
//! counters, positions, leases, epochs, dedup indexes and the records they list), provided
//! no worker of the older version still heartbeats: a running older worker would keep
//! writing the old names, so the upgrade is refused with a message saying so (stop the
//! older replicas first; events and positions are kept). A cluster never held the first
//! layout (its scripts could not run there), so it is only marked.

use std::time::Duration;

use redis::Script;

use crate::store::redis::client::{redis_error, Redis};
use crate::store::StoreError;

const LAYOUT: &str = include_str!("lua/layout.lua");

/// What [`prepare`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The store was on the current layout (or empty, and is now marked).
    Current,
    /// The store was on the first layout: this many keys were moved.
    Migrated(u64),
    /// Workers of an older version are running against this store (this many): nothing
    /// was moved, and this process must not start.
    OlderWorkersRunning(u64),
}

/// Puts the store on the current layout (see the module's notes).
pub async fn prepare(redis: &Redis, member_ttl: Duration) -> Result<Layout, StoreError> {
    let mark = redis.key(&["layout"]);
    let mut conn = redis.conn();
    if redis.is_cluster() {
        redis::cmd("SET")
            .arg(&mark)
            .arg("2")
            .arg("NX")
            .query_async::<redis::Value>(&mut conn)
            .await
            .map_err(|e| redis_error("mark the key layout", &e))?;
        return Ok(Layout::Current);
    }
    let current: Option<String> = redis::cmd("GET")
        .arg(&mark)
        .query_async(&mut conn)
        .await
        .map_err(|e| redis_error("read the key layout", &e))?;
    if current.as_deref() == Some("2") {
        return Ok(Layout::Current);
    }
    let mut pipe = redis::pipe();
    for kind in ["bus", "gpos", "lease", "epoch", "pos", "dedup-index"] {
        pipe.cmd("KEYS").arg(redis.key(&[kind, "*"]));
    }
    let found: Vec<Vec<String>> = pipe
        .query_async(&mut conn)
        .await
        .map_err(|e| redis_error("list the first layout's keys", &e))?;
    let plan = plan(redis, &found);
    let script = Script::new(LAYOUT);
    let mut invocation = script.prepare_invoke();
    invocation
        .key(mark)
        .key(redis.key(&["members"]))
        .arg(u64::try_from(member_ttl.as_millis()).unwrap_or(u64::MAX))
        .arg(redis.key(&["dedup", ""]))
        .arg(plan.renames.len());
    for (old, new) in &plan.renames {
        invocation.arg(old).arg(new);
    }
    for (old, tag) in &plan.indexes {
        invocation.arg(old).arg(tag);
    }
    let (status, count): (i64, i64) = invocation
        .invoke_async(&mut conn)
        .await
        .map_err(|e| redis_error("move to the current key layout", &e))?;
    let count = count.unsigned_abs();
    Ok(match status {
        0 => Layout::Current,
        -1 => Layout::OlderWorkersRunning(count),
        _ => Layout::Migrated(count),
    })
}

/// What to rename: keys (old name, new name) and dedup indexes (old name, the tagged
/// prefix their records move under).
#[derive(Debug, Default, PartialEq, Eq)]
struct Plan {
    renames: Vec<(String, String)>,
    indexes: Vec<(String, String)>,
}

/// The new names of the first layout's keys, as `KEYS` found them per kind (`bus`, `gpos`,
/// `lease`, `epoch`, `pos`, `dedup-index`). Names that do not parse are left alone.
fn plan(redis: &Redis, found: &[Vec<String>]) -> Plan {
    let mut plan = Plan::default();
    let rest = |key: &str, kind: &str| -> Option<String> {
        key.strip_prefix(&redis.key(&[kind, ""]))
            .map(str::to_string)
    };
    // `{bus}:{shard}`, bus names having no `:`.
    let shard = |text: &str| -> Option<(String, u32)> {
        let (bus, shard) = text.rsplit_once(':')?;
        Some((bus.to_string(), shard.parse().ok()?))
    };
    let kinds = ["bus", "gpos", "lease", "epoch", "pos", "dedup-index"];
    for (kind, keys) in kinds.iter().zip(found) {
        for key in keys {
            let Some(rest) = rest(key, kind) else {
                continue;
            };
            let new = match *kind {
                "bus" => match rest.strip_suffix(":next") {
                    Some(counter) => shard(counter).map(|(b, s)| redis.shard_key(&b, s, &["next"])),
                    None => shard(&rest).map(|(b, s)| redis.shard_key(&b, s, &["log"])),
                },
                "gpos" => shard(&rest).map(|(b, s)| redis.shard_key(&b, s, &["pos"])),
                "lease" | "epoch" => Some(redis.task_key(&rest, kind)),
                "pos" => Some(redis.source_key(&rest)),
                _ => {
                    let tag = if rest == "webhooks" {
                        Some(redis.tagged(crate::store::redis::dedup::WEBHOOKS_TAG, &[]))
                    } else {
                        shard(&rest).map(|(b, s)| redis.shard_key(&b, s, &[]))
                    };
                    if let Some(tag) = tag {
                        plan.indexes.push((key.clone(), tag));
                    }
                    None
                }
            };
            if let Some(new) = new {
                plan.renames.push((key.clone(), new));
            }
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Every kind of the first layout's keys gets the name the current code uses.
    #[tokio::test]
    async fn the_first_layouts_keys_get_their_tagged_names() {
        let redis = Redis::connect("redis://127.0.0.1:1/", "p", Duration::from_secs(1))
            .await
            .unwrap();
        let found = vec![
            vec![
                "p:bus:orders:3".to_string(),
                "p:bus:orders:3:next".to_string(),
                "p:bus:x".to_string(),
            ],
            vec!["p:gpos:orders:3".to_string()],
            vec![
                "p:lease:bus/orders#3".to_string(),
                "p:lease:source/mq#1".to_string(),
            ],
            vec!["p:epoch:bus/orders#3".to_string()],
            vec!["p:pos:source/mq@broker-a".to_string()],
            vec![
                "p:dedup-index:orders:3".to_string(),
                "p:dedup-index:webhooks".to_string(),
            ],
        ];
        let plan = plan(&redis, &found);
        let shard = |part: &str| redis.shard_key("orders", 3, &[part]);
        assert_eq!(
            plan.renames,
            vec![
                ("p:bus:orders:3".to_string(), shard("log")),
                ("p:bus:orders:3:next".to_string(), shard("next")),
                ("p:gpos:orders:3".to_string(), shard("pos")),
                ("p:lease:bus/orders#3".to_string(), shard("lease")),
                (
                    "p:lease:source/mq#1".to_string(),
                    "p:{source/mq}:lease:1".to_string()
                ),
                ("p:epoch:bus/orders#3".to_string(), shard("epoch")),
                (
                    "p:pos:source/mq@broker-a".to_string(),
                    "p:{source/mq}:pos:broker-a".to_string()
                ),
            ]
        );
        assert_eq!(
            plan.indexes,
            vec![
                (
                    "p:dedup-index:orders:3".to_string(),
                    redis.shard_key("orders", 3, &[])
                ),
                (
                    "p:dedup-index:webhooks".to_string(),
                    "p:{webhooks}".to_string()
                ),
            ]
        );
    }
}
