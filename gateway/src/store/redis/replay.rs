//! Replay statuses in Redis: `{p}:replays`, a hash of replay id → status JSON. What a
//! status holds and when it may be written is `crate::replay`'s; here are only the two
//! conditional writes (one script each) and the read.

use redis::Script;

use crate::store::redis::client::Redis;
use crate::store::StoreError;

/// KEYS[1] the hash, ARGV: id, status JSON, worker. 1 recorded, 0 another worker's, 2 no
/// longer running.
const PUT: &str = include_str!("lua/replay_put.lua");

/// KEYS[1] the hash, ARGV: id, the status JSON expected, the new one.
const SWAP: &str = include_str!("lua/replay_swap.lua");

/// What became of a [`RedisReplayStatuses::put`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Put {
    /// Written: a new replay, or one the stored status says this worker runs.
    Kept,
    /// Not written: the stored status names another worker.
    Moved,
    /// Not written: the stored status is no longer `RUNNING`.
    Ended,
}

/// `{p}:replays`: a hash, replay id → status JSON.
pub struct RedisReplayStatuses {
    redis: Redis,
    put: Script,
    swap: Script,
}

impl RedisReplayStatuses {
    pub fn new(redis: Redis) -> RedisReplayStatuses {
        RedisReplayStatuses {
            redis,
            put: Script::new(PUT),
            swap: Script::new(SWAP),
        }
    }

    /// Writes `json` as the status of replay `id` run by `worker`, unless the stored one
    /// (a JSON object with `worker` and `state`) names another worker or is not `RUNNING`.
    pub async fn put(&self, id: &str, json: &str, worker: &str) -> Result<Put, StoreError> {
        let answer = self
            .run(&self.put, [id, json, worker], "write replay status")
            .await?;
        Ok(match answer {
            1 => Put::Kept,
            0 => Put::Moved,
            _ => Put::Ended,
        })
    }

    /// Every stored status, as stored.
    pub async fn list(&self) -> Result<Vec<String>, StoreError> {
        redis::cmd("HVALS")
            .arg(self.redis.key(&["replays"]))
            .query_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis read replay statuses: {e}")))
    }

    /// Replaces the status of replay `id` by `new` if it is still exactly `old`.
    pub async fn swap(&self, id: &str, old: &str, new: &str) -> Result<bool, StoreError> {
        let answer = self
            .run(&self.swap, [id, old, new], "swap replay status")
            .await?;
        Ok(answer == 1)
    }

    /// Runs one of the two scripts on the hash with its three arguments; its answer.
    async fn run(&self, script: &Script, args: [&str; 3], what: &str) -> Result<i64, StoreError> {
        let mut call = script.key(self.redis.key(&["replays"]));
        for arg in args {
            call.arg(arg);
        }
        call.invoke_async(&mut self.redis.connection())
            .await
            .map_err(|e| StoreError::Unavailable(format!("redis {what}: {e}")))
    }
}
