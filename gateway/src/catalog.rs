//! The catalog: buses, rules, sources and webhook sources as versioned resources, the one source of truth
//! of what the gateway runs.
//!
//! It lives in the cluster store (Redis in distributed mode, `catalog.json` in the data
//! directory standalone). Every change is one compare-and-set on the catalog's version, so
//! two writers can never both win, and bumps that version; each resource also keeps the
//! version at which it last changed (its `ETag`). Every replica follows the catalog: a new
//! version is announced (Redis pub/sub, or the process's own notice standalone) and each
//! replica rebuilds its plan from it, restarting only what changed.
//!
//! The configuration file may declare resources too. They seed an empty catalog; after
//! that the catalog wins, so a replica started with an old file never rolls back what the
//! admin API changed (`sluice ctl apply -f` applies a file on purpose).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::{Channels, Invalid, Kind};
use crate::runtime::cluster::Cluster;
use crate::store::redis::RedisCluster;
use crate::store::StoreError;

/// The catalog as stored: its version, the TOML of its channels, each resource's version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stored {
    pub version: u64,
    #[serde(rename = "toml")]
    pub text: String,
    #[serde(default)]
    pub versions: BTreeMap<String, u64>,
}

/// Where the catalog is kept.
#[async_trait]
pub trait CatalogStore: Send + Sync {
    /// The stored catalog; `None` before anything was stored.
    async fn load(&self) -> Result<Option<Stored>, StoreError>;
    /// Stores a new catalog if the stored version is still `expected` (0: nothing stored):
    /// `Ok(new version)`, or `Err(stored version)` when another writer came first.
    async fn store(
        &self,
        expected: u64,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<u64, u64>, StoreError>;
    /// Moves whenever the catalog may have changed (and on other cluster notices).
    fn changes(&self) -> watch::Receiver<u64>;
}

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

    async fn store(
        &self,
        expected: u64,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<u64, u64>, StoreError> {
        let versions = serde_json::to_string(versions)
            .map_err(|e| StoreError::Unavailable(format!("catalog versions: {e}")))?;
        self.cluster.store_catalog(expected, text, &versions).await
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.cluster.notices()
    }
}

/// The catalog in the data directory (standalone): `catalog.json`, replaced atomically
/// (written aside, synced, renamed, directory synced).
pub struct FileCatalog {
    path: PathBuf,
    write: tokio::sync::Mutex<()>,
    changes: watch::Sender<u64>,
}

impl FileCatalog {
    pub fn new(data_dir: &std::path::Path) -> FileCatalog {
        FileCatalog {
            path: data_dir.join("catalog.json"),
            write: tokio::sync::Mutex::new(()),
            changes: watch::Sender::new(0),
        }
    }

    fn read(path: &std::path::Path) -> Result<Option<Stored>, StoreError> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| StoreError::Corrupt(format!("{}: {e}", path.display()))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io("cannot read catalog.json", &e)),
        }
    }

    fn write(path: &std::path::Path, stored: &Stored) -> Result<(), StoreError> {
        use std::io::Write as _;
        let io = |what: &str, e: std::io::Error| StoreError::io(what, &e);
        let bytes = serde_json::to_vec_pretty(stored)
            .map_err(|e| StoreError::Unavailable(format!("catalog: {e}")))?;
        let aside = path.with_extension("json.new");
        let mut file =
            std::fs::File::create(&aside).map_err(|e| io("cannot write catalog.json", e))?;
        file.write_all(&bytes)
            .and_then(|()| file.sync_all())
            .map_err(|e| io("cannot write catalog.json", e))?;
        std::fs::rename(&aside, path).map_err(|e| io("cannot replace catalog.json", e))?;
        if let Some(dir) = path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io("cannot sync the data directory", e))?;
        }
        Ok(())
    }
}

#[async_trait]
impl CatalogStore for FileCatalog {
    async fn load(&self) -> Result<Option<Stored>, StoreError> {
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || FileCatalog::read(&path))
            .await
            .map_err(|e| StoreError::Unavailable(format!("catalog: {e}")))?
    }

    async fn store(
        &self,
        expected: u64,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<u64, u64>, StoreError> {
        let _writer = self.write.lock().await;
        let current = self.load().await?.map_or(0, |s| s.version);
        if current != expected {
            return Ok(Err(current));
        }
        let stored = Stored {
            version: current + 1,
            text: text.to_string(),
            versions: versions.clone(),
        };
        let path = self.path.clone();
        let written = stored.clone();
        tokio::task::spawn_blocking(move || FileCatalog::write(&path, &written))
            .await
            .map_err(|e| StoreError::Unavailable(format!("catalog: {e}")))??;
        self.changes.send_modify(|n| *n += 1);
        Ok(Ok(stored.version))
    }

    fn changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }
}

/// The key of a resource in the version map (and in `ctl` output).
pub fn bus_key(name: &str) -> String {
    format!("bus/{name}")
}

pub fn rule_key(bus: &str, name: &str) -> String {
    format!("rule/{bus}/{name}")
}

pub fn source_key(name: &str) -> String {
    format!("source/{name}")
}

pub fn webhook_key(name: &str) -> String {
    format!("webhook/{name}")
}

/// One version of the catalog, parsed.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub version: u64,
    pub channels: Channels,
    pub versions: BTreeMap<String, u64>,
}

impl Snapshot {
    fn parse(stored: Stored) -> Result<Snapshot, StoreError> {
        let channels = Channels::from_toml(&stored.text)
            .map_err(|e| StoreError::Corrupt(format!("stored catalog: {e}")))?;
        Ok(Snapshot {
            version: stored.version,
            channels,
            versions: stored.versions,
        })
    }

    /// The version at which a resource last changed.
    pub fn version_of(&self, key: &str) -> u64 {
        self.versions.get(key).copied().unwrap_or(self.version)
    }

    /// Every resource by key, as JSON (what tells a changed resource from an unchanged one).
    pub fn resources(channels: &Channels) -> BTreeMap<String, serde_json::Value> {
        let mut all = BTreeMap::new();
        let json = |v: &dyn erased::Json| v.json();
        for bus in &channels.buses {
            all.insert(bus_key(bus.name.get_ref()), json(bus));
        }
        for rule in &channels.rules {
            all.insert(
                rule_key(rule.bus.get_ref(), rule.name.get_ref()),
                json(rule),
            );
        }
        for source in &channels.sources {
            all.insert(source_key(source.name()), json(source));
        }
        for hook in &channels.webhooks {
            all.insert(webhook_key(hook.name.get_ref()), json(hook));
        }
        all
    }
}

mod erased {
    pub(super) trait Json {
        fn json(&self) -> serde_json::Value;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> serde_json::Value {
            serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
        }
    }
}

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError<E> {
    /// The change itself refused (not found, precondition failed, conflict...).
    #[error("{0}")]
    Rejected(E),
    /// The catalog it would make does not pass the configuration's checks.
    #[error("{0}")]
    Invalid(Invalid),
    #[error("{0}")]
    Store(#[from] StoreError),
    /// Other writers kept changing the catalog between our read and our write.
    #[error("the catalog kept changing under this request; try again")]
    Contention,
}

/// The outcome of a change: the catalog after it and what the change returned.
#[derive(Debug)]
pub struct Changed<T> {
    pub snapshot: Snapshot,
    pub value: T,
    /// False when the change left the catalog as it was (nothing was written).
    pub written: bool,
}

/// Reads and changes the catalog.
#[derive(Clone)]
pub struct Catalog {
    store: Arc<dyn CatalogStore>,
}

impl Catalog {
    pub fn new(store: Arc<dyn CatalogStore>) -> Catalog {
        Catalog { store }
    }

    /// The current catalog (empty, version 0, before anything was stored).
    pub async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        match self.store.load().await? {
            Some(stored) => Snapshot::parse(stored),
            None => Ok(Snapshot::default()),
        }
    }

    pub async fn version(&self) -> Result<u64, StoreError> {
        Ok(self.store.load().await?.map_or(0, |s| s.version))
    }

    pub fn changes(&self) -> watch::Receiver<u64> {
        self.store.changes()
    }

    /// Applies `change` to the current catalog and stores the result if it passes the
    /// checks, as one compare-and-set: when another writer came first, `change` runs again
    /// on the newer catalog (so its preconditions are checked against what is stored).
    /// `change` returns the new channels, or `None` to leave the catalog as it is.
    pub async fn change<T, E>(
        &self,
        mut change: impl FnMut(&Snapshot) -> Result<(Option<Channels>, T), E>,
    ) -> Result<Changed<T>, ChangeError<E>> {
        for _ in 0..16 {
            let current = self.snapshot().await?;
            let (next, value) = change(&current).map_err(ChangeError::Rejected)?;
            let Some(next) = next else {
                return Ok(Changed {
                    snapshot: current,
                    value,
                    written: false,
                });
            };
            check_change(&current.channels, &next).map_err(ChangeError::Invalid)?;
            let before = Snapshot::resources(&current.channels);
            let after = Snapshot::resources(&next);
            if before == after && current.version > 0 {
                return Ok(Changed {
                    snapshot: current,
                    value,
                    written: false,
                });
            }
            let version = current.version + 1;
            let versions: BTreeMap<String, u64> = after
                .iter()
                .map(|(key, json)| {
                    let v = if before.get(key) == Some(json) {
                        current.version_of(key)
                    } else {
                        version
                    };
                    (key.clone(), v)
                })
                .collect();
            let text = next
                .to_toml()
                .map_err(|e| ChangeError::Store(StoreError::Unavailable(e)))?;
            match self.store.store(current.version, &text, &versions).await? {
                Ok(stored) => {
                    return Ok(Changed {
                        snapshot: Snapshot {
                            version: stored,
                            channels: next,
                            versions,
                        },
                        value,
                        written: true,
                    })
                }
                Err(_) => continue,
            }
        }
        Err(ChangeError::Contention)
    }

    /// Stores the file's resources if the catalog is empty. Returns the catalog's version
    /// and whether the file's resources differ from what the catalog holds.
    pub async fn seed(
        &self,
        file: &Channels,
    ) -> Result<(u64, bool), ChangeError<std::convert::Infallible>> {
        let changed = self
            .change(|current| {
                if current.version > 0 {
                    let differs =
                        Snapshot::resources(&current.channels) != Snapshot::resources(file);
                    return Ok((None, differs));
                }
                Ok((Some(file.clone()), false))
            })
            .await?;
        Ok((changed.snapshot.version, changed.value))
    }
}

/// The checks of a whole catalog, plus what only a change can break: the shard count of a
/// bus is fixed (events are placed by it).
pub fn check_change(before: &Channels, after: &Channels) -> Result<(), Invalid> {
    after.check()?;
    for (index, bus) in after.buses.iter().enumerate() {
        if let Some(old) = before
            .buses
            .iter()
            .find(|b| b.name.get_ref() == bus.name.get_ref())
        {
            if old.shards != bus.shards {
                return Err(Invalid {
                    kind: Kind::Bus,
                    index,
                    pointer: "/shards".to_string(),
                    message: format!(
                        "bus `{}` has {} shards; the shard count of a bus cannot change (events are placed by it)",
                        bus.name.get_ref(),
                        old.shards
                    ),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn channels(text: &str) -> Channels {
        Channels::from_toml(text).unwrap()
    }

    const ONE: &str = "[[buses]]\nname = \"a\"\n\n[[rules]]\nname = \"r\"\nbus = \"a\"\n[[rules.targets]]\ntype = \"log\"\nname = \"l\"\n";

    #[tokio::test]
    async fn versions_move_only_for_what_changed_and_stale_writers_lose() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        let (v, differs) = catalog.seed(&channels(ONE)).await.unwrap();
        assert_eq!((v, differs), (1, false));
        let (v, differs) = catalog.seed(&Channels::default()).await.unwrap();
        assert_eq!((v, differs), (1, true), "a seeded catalog is not replaced");

        let two = format!("{ONE}\n[[buses]]\nname = \"b\"\n");
        let changed = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(&two)), ())))
            .await
            .unwrap();
        assert_eq!(changed.snapshot.version, 2);
        assert_eq!(changed.snapshot.version_of("bus/a"), 1);
        assert_eq!(changed.snapshot.version_of("rule/a/r"), 1);
        assert_eq!(changed.snapshot.version_of("bus/b"), 2);

        // The same catalog again: nothing written.
        let same = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(&two)), ())))
            .await
            .unwrap();
        assert!(!same.written);
        assert_eq!(catalog.version().await.unwrap(), 2);

        // A store that is not at the expected version refuses.
        let store = FileCatalog::new(dir.path());
        assert_eq!(store.store(1, "", &BTreeMap::new()).await.unwrap(), Err(2));
    }

    #[tokio::test]
    async fn invalid_catalogs_and_shard_changes_are_refused_with_a_pointer() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        catalog.seed(&channels(ONE)).await.unwrap();
        let reshard = "[[buses]]\nname = \"a\"\nshards = 8\n";
        let err = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(reshard)), ())))
            .await
            .unwrap_err();
        let ChangeError::Invalid(invalid) = err else {
            panic!("{err}")
        };
        assert_eq!(
            (invalid.kind, invalid.pointer.as_str()),
            (Kind::Bus, "/shards")
        );

        let bad = ONE.replace(
            "[[rules.targets]]",
            "pattern = { type = [{ nope = 1 }] }\n[[rules.targets]]",
        );
        let err = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(&bad)), ())))
            .await
            .unwrap_err();
        let ChangeError::Invalid(invalid) = err else {
            panic!("{err}")
        };
        assert_eq!(invalid.kind, Kind::Rule);
        assert!(
            invalid.pointer.starts_with("/pattern/type"),
            "{}",
            invalid.pointer
        );
    }
}
