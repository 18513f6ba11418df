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
//!
//! Continuity: beside its version, every write draws a random id, and a replica follows
//! whenever the stored (version, id) differs from what it runs, in either direction. A
//! store restored from an older backup holds a lower version (or the same version with
//! another id once written again): replicas notice, say so, and converge on what the store
//! holds instead of skipping versions they believe they have seen. Writes compare both
//! (a writer that read before the restore cannot win after it), and new versions are
//! numbered past every version this process has seen, so an `ETag` handed out before a
//! restore never names a different resource after it. A catalog that vanished from the
//! store (a flushed Redis) is not an empty catalog: replicas keep running what they run
//! and the admin API refuses changes until a replica started anew seeds it again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

pub use crate::config::{bus_key, function_key, rule_key, source_key, webhook_key};
use crate::config::{Channels, Invalid, Kind};
pub use crate::store::catalog::{CatalogStore, Drift, FileCatalog, Head, Stored};
pub use crate::store::redis::RedisCatalog;
use crate::store::StoreError;

/// One version of the catalog, parsed.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub version: u64,
    /// The id its write drew (see [`Head`]).
    pub id: u64,
    pub channels: Channels,
    pub versions: BTreeMap<String, u64>,
}

impl Snapshot {
    fn parse(stored: Stored) -> Result<Snapshot, StoreError> {
        let channels = Channels::from_toml(&stored.text)
            .map_err(|e| StoreError::Corrupt(format!("stored catalog: {e}")))?;
        Ok(Snapshot {
            version: stored.version,
            id: stored.id,
            channels,
            versions: stored.versions,
        })
    }

    pub fn head(&self) -> Head {
        Head {
            version: self.version,
            id: self.id,
        }
    }

    /// The version at which a resource last changed.
    pub fn version_of(&self, key: &str) -> u64 {
        self.versions.get(key).copied().unwrap_or(self.version)
    }

    /// Every resource by key, as JSON (what tells a changed resource from an unchanged one).
    pub fn resources(channels: &Channels) -> BTreeMap<String, serde_json::Value> {
        Snapshot::resources_where(channels, |_| true)
    }

    /// The resources whose key `wanted` accepts, as JSON; the others are not serialized
    /// (a change names one resource among thousands).
    pub fn resources_where(
        channels: &Channels,
        wanted: impl Fn(&str) -> bool,
    ) -> BTreeMap<String, serde_json::Value> {
        let mut all = BTreeMap::new();
        let mut add = |key: String, v: &dyn erased::Json| {
            if wanted(&key) {
                all.insert(key, v.json());
            }
        };
        for bus in &channels.buses {
            add(bus_key(bus.name.get_ref()), bus);
        }
        for rule in &channels.rules {
            add(rule_key(rule.bus.get_ref(), rule.name.get_ref()), rule);
        }
        for source in &channels.sources {
            add(source_key(source.name()), source);
        }
        for hook in &channels.webhooks {
            add(webhook_key(hook.name.get_ref()), hook);
        }
        for function in &channels.functions {
            add(function_key(&function.name), function);
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
    /// The highest version this process has read or written: new versions are numbered
    /// past it, and a store found empty after it is a lost catalog, not a new one.
    seen: Arc<AtomicU64>,
}

impl Catalog {
    pub fn new(store: Arc<dyn CatalogStore>) -> Catalog {
        Catalog {
            store,
            seen: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Where the catalog (and the functions' components) is kept.
    pub fn store(&self) -> Arc<dyn CatalogStore> {
        self.store.clone()
    }

    fn saw(&self, version: u64) {
        self.seen.fetch_max(version, Ordering::Relaxed);
    }

    /// The current catalog (empty, version 0, before anything was stored).
    pub async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        match self.store.load().await? {
            Some(stored) => {
                self.saw(stored.version);
                Snapshot::parse(stored)
            }
            None => Ok(Snapshot::default()),
        }
    }

    /// The version and id of the stored catalog (`None`: nothing is stored), cheaply.
    pub async fn head(&self) -> Result<Option<Head>, StoreError> {
        let head = self.store.head().await?;
        if let Some(head) = head {
            self.saw(head.version);
        }
        Ok(head)
    }

    pub async fn version(&self) -> Result<u64, StoreError> {
        Ok(self.head().await?.map_or(0, |h| h.version))
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
            if current.version == 0 && self.seen.load(Ordering::Relaxed) > 0 {
                // Written now, the change would be the whole catalog and every replica
                // would follow it, dropping everything else.
                return Err(ChangeError::Store(StoreError::Unavailable(
                    "the catalog is missing from the cluster store (flushed, or restored without it); \
                     replicas keep running their last catalog. Restart one replica to seed it from \
                     its configuration file, then make the change again"
                        .to_string(),
                )));
            }
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
            // Past every version this process has seen, not only the stored one: after a
            // restore from a backup, a version (an `ETag`) handed out before it is not
            // handed out again for something else.
            let version = current
                .version
                .max(self.seen.load(Ordering::Relaxed))
                .saturating_add(1);
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
            let stored = Stored {
                version,
                id: fastrand::u64(1..),
                text,
                versions,
            };
            match self.store.store(current.head(), &stored).await? {
                Ok(()) => {
                    self.saw(version);
                    return Ok(Changed {
                        snapshot: Snapshot {
                            version,
                            id: stored.id,
                            channels: next,
                            versions: stored.versions,
                        },
                        value,
                        written: true,
                    });
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

/// What only the store can tell about a change: a bus the catalog does not hold (new, or
/// deleted and made again) whose log and positions are still in the store with another
/// shard count (`stored`: bus → that count, as the backend reports it). Its events were
/// placed by that count and its positions are per shard, so the name comes back only with
/// it (or once its data is deleted).
pub fn check_stored_shards(
    before: &Channels,
    after: &Channels,
    stored: &std::collections::HashMap<String, u32>,
) -> Result<(), Invalid> {
    for (index, bus) in after.buses.iter().enumerate() {
        let name = bus.name.get_ref();
        if before.buses.iter().any(|b| b.name.get_ref() == name) {
            continue;
        }
        if let Some(&shards) = stored.get(name).filter(|s| **s != bus.shards) {
            return Err(Invalid {
                kind: Kind::Bus,
                index,
                pointer: "/shards".to_string(),
                message: format!(
                    "bus `{name}` cannot have {} shards: a log of bus `{name}` with {shards} shards is still in the store (its events and positions are kept after the bus is deleted, placed by that count). Create it with shards = {shards}, choose another name, or delete its data first (standalone: {{data_dir}}/buses/{name}; distributed: the Redis keys {{prefix}}:{{bus/{name}#N.*}}:* of each shard N and {{prefix}}:bus-shards:{name})",
                    bus.shards
                ),
            });
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

    /// Makes the catalog hold the channels of `text`.
    async fn put(
        catalog: &Catalog,
        text: &str,
    ) -> Result<Changed<()>, ChangeError<std::convert::Infallible>> {
        catalog.change(|_| Ok((Some(channels(text)), ()))).await
    }

    /// A catalog write of this version (and id), without resource versions.
    fn written(version: u64, text: &str) -> Stored {
        Stored {
            version,
            id: version,
            text: text.to_string(),
            versions: BTreeMap::new(),
        }
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
        let changed = put(&catalog, &two).await.unwrap();
        assert_eq!(changed.snapshot.version, 2);
        assert_eq!(changed.snapshot.version_of("bus/a"), 1);
        assert_eq!(changed.snapshot.version_of("rule/a/r"), 1);
        assert_eq!(changed.snapshot.version_of("bus/b"), 2);

        // The same catalog again: nothing written.
        let same = put(&catalog, &two).await.unwrap();
        assert!(!same.written);
        assert_eq!(catalog.version().await.unwrap(), 2);

        // A store that is not at the expected version refuses.
        let store = FileCatalog::new(dir.path());
        let stored = catalog.snapshot().await.unwrap().head();
        let stale = Head {
            version: 1,
            id: stored.id,
        };
        let next = written(9, "");
        assert_eq!(store.store(stale, &next).await.unwrap(), Err(stored));
    }

    #[test]
    fn a_replica_follows_any_other_write_and_tells_a_catalog_that_went_back() {
        let running = Head { version: 7, id: 70 };
        assert_eq!(running.drift_from(running), Drift::Same);
        assert_eq!(Head { version: 8, id: 1 }.drift_from(running), Drift::Ahead);
        assert_eq!(
            Head { version: 5, id: 50 }.drift_from(running),
            Drift::Behind
        );
        assert_eq!(
            Head { version: 7, id: 71 }.drift_from(running),
            Drift::Replaced
        );
        // A catalog written before ids existed (id 0) is a write like any other.
        assert_eq!(
            Head { version: 7, id: 0 }.drift_from(running),
            Drift::Replaced
        );
    }

    /// `catalog.json` restored from an older copy under a running process: the head says
    /// it went back, a writer holding the newer head loses even where the version matches
    /// again, and the next write is numbered past every version seen (no `ETag` reused).
    #[tokio::test]
    async fn a_catalog_restored_from_a_backup_is_followed_and_stale_writers_lose() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(FileCatalog::new(dir.path()));
        let catalog = Catalog::new(store.clone());
        catalog.seed(&channels(ONE)).await.unwrap();
        let path = dir.path().join("catalog.json");
        let backup = std::fs::read(&path).unwrap();
        let backup_head = catalog.head().await.unwrap().unwrap();
        let mut text = String::from(ONE);
        for name in ["b", "c"] {
            text.push_str(&format!("\n[[buses]]\nname = \"{name}\"\n"));
            put(&catalog, &text).await.unwrap();
        }
        let running = catalog.head().await.unwrap().unwrap();
        assert_eq!(running.version, 3);

        std::fs::write(&path, &backup).unwrap();
        let stored = catalog.head().await.unwrap().unwrap();
        assert_eq!(stored, backup_head);
        assert_eq!(stored.drift_from(running), Drift::Behind);

        // A writer that read before the restore: refused.
        let late = written(4, ONE);
        assert_eq!(store.store(running, &late).await.unwrap(), Err(stored));
        // Written again up to version 3 by another process (which saw only the backup):
        // same version, another id; the old head still loses.
        let other = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        for name in ["x", "y"] {
            let text = format!("{ONE}\n[[buses]]\nname = \"{name}\"\n");
            put(&other, &text).await.unwrap();
        }
        let replaced = catalog.head().await.unwrap().unwrap();
        assert_eq!(replaced.version, 3);
        assert_eq!(replaced.drift_from(running), Drift::Replaced);
        assert_eq!(store.store(running, &late).await.unwrap(), Err(replaced));
        // This process's next write goes past the highest version it has seen.
        let changed = put(&catalog, ONE).await.unwrap();
        assert_eq!(changed.snapshot.version, 4);
        assert_eq!(changed.snapshot.version_of("bus/a"), 1);
    }

    /// A catalog that vanished from the store is not an empty one: a process that has
    /// seen one refuses to write a catalog of one change over it.
    #[tokio::test]
    async fn a_vanished_catalog_is_not_overwritten_by_one_change() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        catalog.seed(&channels(ONE)).await.unwrap();
        std::fs::remove_file(dir.path().join("catalog.json")).unwrap();
        assert_eq!(catalog.head().await.unwrap(), None);
        let err = put(&catalog, ONE).await.unwrap_err();
        assert!(
            matches!(err, ChangeError::Store(StoreError::Unavailable(_))),
            "{err}"
        );
        // A process started anew seeds it.
        let fresh = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        assert_eq!(fresh.seed(&channels(ONE)).await.unwrap(), (1, false));
    }

    #[test]
    fn a_bus_cannot_come_back_with_another_shard_count_while_its_log_exists() {
        let stored = std::collections::HashMap::from([("a".to_string(), 4)]);
        let none = Channels::default();
        let eight = channels("[[buses]]\nname = \"a\"\nshards = 8\n");
        let invalid = check_stored_shards(&none, &eight, &stored).unwrap_err();
        assert_eq!(
            (invalid.kind, invalid.pointer.as_str()),
            (Kind::Bus, "/shards")
        );
        assert!(
            invalid.message.contains("with 4 shards"),
            "{}",
            invalid.message
        );
        let four = channels("[[buses]]\nname = \"a\"\nshards = 4\n");
        assert!(check_stored_shards(&none, &four, &stored).is_ok());
        assert!(check_stored_shards(&none, &eight, &Default::default()).is_ok());
        // A bus the catalog holds already is `check_change`'s to judge.
        assert!(check_stored_shards(&four, &four, &stored).is_ok());
    }

    #[tokio::test]
    async fn invalid_catalogs_and_shard_changes_are_refused_with_a_pointer() {
        let dir = tempfile::tempdir().unwrap();
        let catalog = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        catalog.seed(&channels(ONE)).await.unwrap();
        let reshard = "[[buses]]\nname = \"a\"\nshards = 8\n";
        let err = put(&catalog, reshard).await.unwrap_err();
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
        let err = put(&catalog, &bad).await.unwrap_err();
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
