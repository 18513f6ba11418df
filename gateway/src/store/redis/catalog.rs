//! The catalog in Redis: the hash `{p}:config` (version, id, digest, toml, versions),
//! written by one compare-and-set script and announced on the cluster's notice channel.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use redis::{AsyncCommands as _, Script};
use tokio::sync::watch;

use crate::store::catalog::{CatalogStore, Head, Stored};
use crate::store::cluster::Cluster as _;
use crate::store::redis::client::redis_error;
use crate::store::redis::cluster::RedisCluster;
use crate::store::StoreError;

/// The catalog in Redis (distributed mode), announced on the cluster's notice channel.
pub struct RedisCatalog {
    cluster: Arc<RedisCluster>,
}

impl RedisCatalog {
    pub fn new(cluster: Arc<RedisCluster>) -> RedisCatalog {
        RedisCatalog { cluster }
    }
}

#[async_trait]
impl CatalogStore for RedisCatalog {
    async fn load(&self) -> Result<Option<Stored>, StoreError> {
        self.cluster.load_catalog().await
    }

    async fn head(&self) -> Result<Option<Head>, StoreError> {
        self.cluster.catalog_head().await
    }

    async fn store(&self, expected: Head, next: &Stored) -> Result<Result<(), Head>, StoreError> {
        let versions = serde_json::to_string(&next.versions)
            .map_err(|e| StoreError::Unavailable(format!("catalog versions: {e}")))?;
        self.cluster
            .store_catalog(expected, next.head(), &next.text, &versions)
            .await
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.cluster.notices()
    }

    async fn put_component(&self, sha256: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let key = self.cluster.redis().key(&["component", sha256]);
        let _: bool = self
            .cluster
            .redis()
            .conn()
            .set_nx(key, bytes)
            .await
            .map_err(|e| redis_error("store a function's component", &e))?;
        Ok(())
    }

    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let key = self.cluster.redis().key(&["component", sha256]);
        self.cluster
            .redis()
            .conn()
            .get(key)
            .await
            .map_err(|e| redis_error("read a function's component", &e))
    }

    async fn has_component(&self, sha256: &str) -> Result<bool, StoreError> {
        let key = self.cluster.redis().key(&["component", sha256]);
        self.cluster
            .redis()
            .conn()
            .exists(key)
            .await
            .map_err(|e| redis_error("look for a function's component", &e))
    }
}

impl RedisCluster {
    /// The stored catalog: its version and id, the TOML of its buses, rules and sources,
    /// and the version of each resource (JSON). `None` when nothing is stored yet.
    pub async fn load_catalog(&self) -> Result<Option<Stored>, StoreError> {
        let map: HashMap<String, String> = self
            .redis()
            .conn()
            .hgetall(self.redis().key(&["config"]))
            .await
            .map_err(|e| redis_error("read config", &e))?;
        let (Some(version), Some(text)) = (
            map.get("version").and_then(|v| v.parse().ok()),
            map.get("toml"),
        ) else {
            return Ok(None);
        };
        let versions = map
            .get("versions")
            .and_then(|v| serde_json::from_str(v).ok())
            .unwrap_or_default();
        Ok(Some(Stored {
            version,
            id: map.get("id").and_then(|v| v.parse().ok()).unwrap_or(0),
            text: text.clone(),
            versions,
        }))
    }

    /// The version and id of the stored catalog (two fields, whatever its size).
    pub async fn catalog_head(&self) -> Result<Option<Head>, StoreError> {
        let (version, id): (Option<String>, Option<String>) = redis::cmd("HMGET")
            .arg(self.redis().key(&["config"]))
            .arg("version")
            .arg("id")
            .query_async(&mut self.redis().conn())
            .await
            .map_err(|e| redis_error("read config version", &e))?;
        Ok(version.and_then(|v| v.parse().ok()).map(|version| Head {
            version,
            id: id.and_then(|v| v.parse().ok()).unwrap_or(0),
        }))
    }

    pub async fn config_version(&self) -> Result<u64, StoreError> {
        self.redis()
            .conn()
            .hget::<_, _, Option<u64>>(self.redis().key(&["config"]), "version")
            .await
            .map(|v| v.unwrap_or(0))
            .map_err(|e| redis_error("read config version", &e))
    }

    /// Stores `next` if the stored catalog is still `expected`, version and id (a version
    /// alone would let a writer that read before a restore from a backup win after it):
    /// `Ok(())`, or `Err(the stored head)` when another writer came first. Every change is
    /// announced to all workers.
    pub async fn store_catalog(
        &self,
        expected: Head,
        next: Head,
        text: &str,
        versions: &str,
    ) -> Result<Result<(), Head>, StoreError> {
        // Ids are compared as text (Lua numbers are doubles); a catalog written before ids
        // existed has none, which `expected` spells as an empty id.
        const STORE: &str = include_str!("lua/store_catalog.lua");
        let id_text = |id: u64| {
            if id == 0 {
                String::new()
            } else {
                id.to_string()
            }
        };
        let digest = format!("{:016x}", crate::values::stable_hash(text.as_bytes()));
        let answer = Script::new(STORE)
            .key(self.redis().key(&["config"]))
            .arg(expected.version)
            .arg(id_text(expected.id))
            .arg(next.version)
            .arg(id_text(next.id))
            .arg(digest)
            .arg(text)
            .arg(versions)
            .arg(self.channel())
            .invoke_async::<Vec<String>>(&mut self.redis().conn())
            .await
            .map_err(|e| redis_error("store config", &e))?;
        Ok(match answer.as_slice() {
            [done] if done == "1" => Ok(()),
            [_, version, id] => Err(Head {
                version: version.parse().unwrap_or(0),
                id: id.parse().unwrap_or(0),
            }),
            _ => {
                return Err(StoreError::Corrupt(format!(
                    "redis answered {answer:?} to a catalog write"
                )))
            }
        })
    }
}
