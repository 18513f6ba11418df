//! The distributed store: every shared fact of a cluster in Redis (one server or a Redis
//! Cluster), under one key prefix, so several clusters can share one Redis. Every key that
//! one command or script touches carries the same hash tag (`{…}`), so on a Redis Cluster
//! they live in one slot; the same names are used on one server. The key layout (also in
//! docs/operations.md), with `S` = `bus/{bus}#{shard}.{k}` (a bus shard's tag: see
//! `client::shard_tag`) and `R` = `source/{name}`:
//!
//! ```text
//! {p}:{S}:log                  stream; entry id 0-{seq+1}, field `e` = the stored event
//! {p}:{S}:next                 next sequence number of the shard
//! {p}:{S}:pos                  hash: positions of the bus shard's subscriptions: `~shared`,
//!                              `~known` (the subscriptions, one per line) and one field per
//!                              subscription that is not at `~shared`
//! {p}:{S}:lease, {p}:{S}:epoch the shard task's lease ("{worker}|{epoch}", expiring after the
//!                              lease TTL) and fencing epoch counter
//! {p}:{S}:dedup:{hash}         a dedup record of an event stored on the shard (see
//!                              `store::dedup`), expiring with its window
//! {p}:{S}:dedup-index          sorted set: the shard's dedup records, scored by expiry (ms),
//!                              held to a share of `max_dedup_bytes`
//! {p}:{R}:pos:{broker}         hash: queue id -> next offset to read (source connectors)
//! {p}:{R}:lease:{i}, {p}:{R}:epoch:{i}  the lease and epoch of the source's task i
//! {p}:{webhooks}:dedup:{hash}  a webhook delivery id's dedup record (`RedisDedup`)
//! {p}:{webhooks}:dedup-index   the same index for them
//! {p}:bus-shards:{bus}         the shard count the bus's log was first used with (kept
//!                              after the bus is deleted, like its streams and positions)
//! {p}:members                  sorted set: worker id -> last heartbeat (Redis time, ms)
//! {p}:config                   hash: version, digest, toml (buses, rules and sources), versions (JSON: each resource's version)
//! {p}:paused                   set of paused connector and task ids
//! {p}:restarts                 hash: connector or task id -> restart generation
//! {p}:status                   hash: connector or task id -> status JSON
//! {p}:replays                  hash: replay id -> replay status JSON (see `replay`)
//! {p}:rate:{scope}             hash: a rate-limit token bucket (see `ingress::ratelimit`)
//! {p}:layout                   `2`: the layout above (see `layout` for the move from the first)
//! {p}:notices                  pub/sub channel: join, leave, config and control notices
//! ```
//!
//! Every multi-step change is one Lua script (in `lua/`, loaded with `include_str!`) whose
//! keys all come through `KEYS`, so it is atomic and runs on a cluster; every call has a
//! timeout and the connection is multiplexed (on a cluster, one per node, with `MOVED` and
//! `ASK` redirects followed by the client).
//!
//! The files, each importing only those before it: `client` (the [`Redis`] handle, its
//! connection, keys and errors), `dedup` (the dedup bound and [`RedisDedup`]), `layout`
//! (the move from the first key layout), `log` ([`RedisLog`]), `positions`
//! ([`RedisPositions`]), `cluster` ([`RedisCluster`]), `catalog` ([`RedisCatalog`]),
//! `replay` and `ratelimit` (the Redis side of replay statuses and rate limits). This file
//! only declares them and names what they offer.

mod catalog;
mod client;
mod cluster;
mod dedup;
mod layout;
mod log;
mod positions;
mod ratelimit;
mod replay;

pub use catalog::RedisCatalog;
pub use client::{shard_tag, slot_of, Conn, Redis, Replication, Target};
pub use cluster::{ClusterOptions, RedisCluster};
pub use dedup::RedisDedup;
pub use layout::{prepare as prepare_layout, Layout};
pub use log::RedisLog;
pub use positions::RedisPositions;
pub use ratelimit::RedisBuckets;
pub use replay::{Put as ReplayPut, RedisReplayStatuses};
