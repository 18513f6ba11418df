//! The handle on the cluster's Redis: the connection, the key prefix and the errors every
//! other file of `store::redis` builds on (this file imports none of them).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::store::StoreError;

pub(super) fn redis_error(context: &str, e: &redis::RedisError) -> StoreError {
    StoreError::Unavailable(format!("redis {context}: {e}"))
}

/// A connection to the cluster's Redis and its key prefix.
#[derive(Clone)]
pub struct Redis {
    conn: ConnectionManager,
    client: redis::Client,
    prefix: String,
    timeout: Duration,
    /// `limits.max_dedup_bytes`: every dedup index of this process takes its share of it.
    dedup_bytes: usize,
}

impl Redis {
    /// `url` is `redis://` or, for TLS, `rediss://` (certificates checked against the
    /// platform's roots). Errors show the URL without its password.
    pub async fn connect(url: &str, prefix: &str, timeout: Duration) -> Result<Redis, StoreError> {
        let client = redis::Client::open(url).map_err(|e| {
            StoreError::Unavailable(format!(
                "redis url `{}`: {e}",
                crate::values::redact_url(url)
            ))
        })?;
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(timeout))
            .set_connection_timeout(Some(timeout))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_millis(500));
        // Lazy: a gateway may start while Redis is down and serve 503s until it is back.
        let conn = ConnectionManager::new_lazy_with_config(client.clone(), config)
            .map_err(|e| redis_error("connect", &e))?;
        Ok(Redis {
            conn,
            client,
            prefix: prefix.to_string(),
            timeout,
            dedup_bytes: crate::store::dedup::DEFAULT_MAX_BYTES,
        })
    }

    /// Bounds the dedup records this handle's logs and dedup store keep in Redis
    /// (`limits.max_dedup_bytes`; the default is [`crate::store::dedup::DEFAULT_MAX_BYTES`]).
    /// Carried by the handle because every bus log is opened from it.
    #[must_use]
    pub fn with_dedup_bytes(mut self, bytes: usize) -> Redis {
        self.dedup_bytes = bytes;
        self
    }

    pub fn dedup_bytes(&self) -> usize {
        self.dedup_bytes
    }

    /// A connection of its own for blocking reads (`XREAD BLOCK`), which would hold up
    /// every other call on the shared multiplexed connection.
    pub(super) async fn blocking_connection(
        &self,
        block: Duration,
    ) -> Result<redis::aio::MultiplexedConnection, StoreError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(block + self.timeout))
            .set_connection_timeout(Some(self.timeout));
        self.client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(|e| redis_error("connect", &e))
    }

    pub fn key(&self, parts: &[&str]) -> String {
        let mut key = self.prefix.clone();
        for part in parts {
            key.push(':');
            key.push_str(part);
        }
        key
    }

    /// The shared multiplexed connection.
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    pub(super) fn conn(&self) -> ConnectionManager {
        self.conn.clone()
    }

    pub async fn ping(&self) -> Result<(), StoreError> {
        redis::cmd("PING")
            .query_async::<String>(&mut self.conn())
            .await
            .map(|_| ())
            .map_err(|e| redis_error("ping", &e))
    }

    /// The client the handle was made from (pub/sub subscriptions take their own
    /// connection from it).
    pub(super) fn client(&self) -> &redis::Client {
        &self.client
    }
}
