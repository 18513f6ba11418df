//! The distributed store: every shared fact of a cluster in Redis, under one key prefix, so
//! several clusters can share one Redis. The key layout (also in docs/operations.md):
//!
//! ```text
//! {p}:bus:{bus}:{shard}        stream; entry id 0-{seq+1}, field `e` = the stored event
//! {p}:bus:{bus}:{shard}:next   next sequence number of the shard
//! {p}:bus-shards:{bus}         the shard count the bus's log was first used with (kept
//!                              after the bus is deleted, like its streams and positions)
//! {p}:gpos:{bus}:{shard}       hash: positions of the bus shard's subscriptions: `~shared`,
//!                              `~known` (the subscriptions, one per line) and one field per
//!                              subscription that is not at `~shared`
//! {p}:pos:source/{name}@{broker} hash: queue id -> next offset to read (source connectors)
//! {p}:lease:{task}             "{worker}|{epoch}", expires after the lease TTL
//! {p}:epoch:{task}             fencing epoch counter of the task
//! {p}:members                  sorted set: worker id -> last heartbeat (Redis time, ms)
//! {p}:config                   hash: version, digest, toml (buses, rules and sources), versions (JSON: each resource's version)
//! {p}:paused                   set of paused connector and task ids
//! {p}:restarts                 hash: connector or task id -> restart generation
//! {p}:status                   hash: connector or task id -> status JSON
//! {p}:replays                  hash: replay id -> replay status JSON (see `replay`)
//! {p}:notices                  pub/sub channel: join, leave, config and control notices
//! {p}:dedup:{hash}             a dedup record (see `store::dedup`), expiring with its window
//! {p}:dedup-index:{bus}:{shard} sorted set: the dedup keys recorded with the shard's events,
//!                              scored by expiry (ms), held to a share of `max_dedup_bytes`
//! {p}:dedup-index:webhooks     the same for keys of the reserve/confirm path (`RedisDedup`)
//! {p}:rate:{scope}             hash: a rate-limit token bucket (see `ingress::ratelimit`)
//! ```
//!
//! Every multi-step change is one Lua script (in `lua/`, loaded with `include_str!`), so it
//! is atomic; every call has a timeout (the connection manager's response timeout) and the
//! connection is multiplexed.
//!
//! The files, each importing only those below it: `client` (the [`Redis`] handle, keys,
//! errors), `dedup` (the dedup bound and [`RedisDedup`]), `log` ([`RedisLog`]),
//! `positions` ([`RedisPositions`]), `cluster` ([`RedisCluster`]), `catalog`
//! ([`RedisCatalog`]), `replay` and `ratelimit` (the Redis side of replay statuses and
//! rate limits). This file only declares them and names what they offer.

mod catalog;
mod client;
mod cluster;
mod dedup;
mod log;
mod positions;
mod ratelimit;
mod replay;

pub use catalog::RedisCatalog;
pub use client::Redis;
pub use cluster::{ClusterOptions, RedisCluster};
pub use dedup::RedisDedup;
pub use log::RedisLog;
pub use positions::RedisPositions;
pub use ratelimit::RedisBuckets;
pub use replay::{Put as ReplayPut, RedisReplayStatuses};
