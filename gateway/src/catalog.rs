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
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::config::{Channels, Invalid, Kind};
use crate::store::cluster::Cluster;
use crate::store::redis::RedisCluster;
use crate::store::StoreError;

/// The catalog as stored: its version and id, the TOML of its channels, each resource's
/// version.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stored {
    pub version: u64,
    /// Drawn at random by every write (0 in catalogs written before ids existed).
    #[serde(default)]
    pub id: u64,
    #[serde(rename = "toml")]
    pub text: String,
    #[serde(default)]
    pub versions: BTreeMap<String, u64>,
}

/// Which write of the catalog: its version and the id that write drew. Versions alone do
/// not tell: a store restored from a backup numbers its next writes again from an older
/// version.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Head {
    pub version: u64,
    pub id: u64,
}

/// How the stored catalog stands to the one a replica runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drift {
    /// The same write: nothing to do.
    Same,
    /// A newer version.
    Ahead,
    /// An older version: the store came back from a backup (or lost its latest writes).
    Behind,
    /// The same version, another write: written again after such a restore.
    Replaced,
}

impl Head {
    /// How `self` (stored) stands to `running`. Anything but `Same` is followed.
    pub fn drift_from(self, running: Head) -> Drift {
        if self == running {
            Drift::Same
        } else if self.version > running.version {
            Drift::Ahead
        } else if self.version < running.version {
            Drift::Behind
        } else {
            Drift::Replaced
        }
    }
}

impl Stored {
    pub fn head(&self) -> Head {
        Head {
            version: self.version,
            id: self.id,
        }
    }
}

/// Where the catalog is kept.
#[async_trait]
pub trait CatalogStore: Send + Sync {
    /// The stored catalog; `None` before anything was stored.
    async fn load(&self) -> Result<Option<Stored>, StoreError>;
    /// Only the version and id of the stored catalog: what replicas check on every tick,
    /// without reading thousands of rules.
    async fn head(&self) -> Result<Option<Head>, StoreError>;
    /// Stores `next` if the stored catalog is still `expected`, version and id
    /// (`Head::default()`: nothing stored): `Ok(())`, or `Err(the stored head)` when
    /// another writer (or a restore) came first.
    async fn store(
        &self,
        expected: Head,
        next: Head,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<(), Head>, StoreError>;
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

    async fn head(&self) -> Result<Option<Head>, StoreError> {
        self.cluster.catalog_head().await
    }

    async fn store(
        &self,
        expected: Head,
        next: Head,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<(), Head>, StoreError> {
        let versions = serde_json::to_string(versions)
            .map_err(|e| StoreError::Unavailable(format!("catalog versions: {e}")))?;
        self.cluster
            .store_catalog(expected, next, text, &versions)
            .await
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
    /// The head of the file as last read, by the file's inode, length and modification
    /// time: `head` stats the file and reads it again only when one of them moved (every
    /// write renames a new file in, so a write always moves the inode).
    heads: Arc<HeadCache>,
}

type HeadCache = std::sync::Mutex<Option<(FileStamp, Option<Head>)>>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    inode: u64,
    len: u64,
    modified: Option<std::time::SystemTime>,
}

/// What `head` needs of `catalog.json` (the rest of the file is skipped, not kept).
#[derive(Deserialize)]
struct StoredHead {
    version: u64,
    #[serde(default)]
    id: u64,
}

impl FileCatalog {
    pub fn new(data_dir: &std::path::Path) -> FileCatalog {
        FileCatalog {
            path: data_dir.join("catalog.json"),
            write: tokio::sync::Mutex::new(()),
            changes: watch::Sender::new(0),
            heads: Arc::new(std::sync::Mutex::new(None)),
        }
    }

    fn read_head(path: &std::path::Path, heads: &HeadCache) -> Result<Option<Head>, StoreError> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = match std::fs::metadata(path) {
            Ok(meta) => meta,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(StoreError::io("cannot read catalog.json", &e)),
        };
        let stamp = FileStamp {
            inode: meta.ino(),
            len: meta.len(),
            modified: meta.modified().ok(),
        };
        let mut cached = heads.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((at, head)) = *cached {
            if at == stamp {
                return Ok(head);
            }
        }
        let head = match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice::<StoredHead>(&bytes)
                .map(|h| {
                    Some(Head {
                        version: h.version,
                        id: h.id,
                    })
                })
                .map_err(|e| StoreError::Corrupt(format!("{}: {e}", path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(StoreError::io("cannot read catalog.json", &e)),
        };
        *cached = Some((stamp, head));
        Ok(head)
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
        // Owner only: the catalog says where events go and which variables hold secrets.
        let mut file = crate::store::embedded::create_private(&aside)
            .map_err(|e| io("cannot write catalog.json", e))?;
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

    async fn head(&self) -> Result<Option<Head>, StoreError> {
        let path = self.path.clone();
        let heads = self.heads.clone();
        tokio::task::spawn_blocking(move || FileCatalog::read_head(&path, &heads))
            .await
            .map_err(|e| StoreError::Unavailable(format!("catalog: {e}")))?
    }

    async fn store(
        &self,
        expected: Head,
        next: Head,
        text: &str,
        versions: &BTreeMap<String, u64>,
    ) -> Result<Result<(), Head>, StoreError> {
        let _writer = self.write.lock().await;
        let current = self.load().await?.map_or(Head::default(), |s| s.head());
        if current != expected {
            return Ok(Err(current));
        }
        let stored = Stored {
            version: next.version,
            id: next.id,
            text: text.to_string(),
            versions: versions.clone(),
        };
        let path = self.path.clone();
        tokio::task::spawn_blocking(move || FileCatalog::write(&path, &stored))
            .await
            .map_err(|e| StoreError::Unavailable(format!("catalog: {e}")))??;
        // Not left to the stamp alone: a freed inode may come back with the next write.
        *self.heads.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.changes.send_modify(|n| *n += 1);
        Ok(Ok(()))
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
            let head = Head {
                version,
                id: fastrand::u64(1..),
            };
            match self
                .store
                .store(current.head(), head, &text, &versions)
                .await?
            {
                Ok(()) => {
                    self.saw(version);
                    return Ok(Changed {
                        snapshot: Snapshot {
                            version,
                            id: head.id,
                            channels: next,
                            versions,
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
                    "bus `{name}` cannot have {} shards: a log of bus `{name}` with {shards} shards is still in the store (its events and positions are kept after the bus is deleted, placed by that count). Create it with shards = {shards}, choose another name, or delete its data first (standalone: {{data_dir}}/buses/{name}; distributed: the Redis keys {{prefix}}:bus:{name}:*, {{prefix}}:gpos:{name}:* and {{prefix}}:bus-shards:{name})",
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
        let stored = catalog.snapshot().await.unwrap().head();
        let next = Head { version: 9, id: 9 };
        let stale = Head {
            version: 1,
            id: stored.id,
        };
        assert_eq!(
            store
                .store(stale, next, "", &BTreeMap::new())
                .await
                .unwrap(),
            Err(stored)
        );
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
            let text = text.clone();
            catalog
                .change(move |_| Ok::<_, std::convert::Infallible>((Some(channels(&text)), ())))
                .await
                .unwrap();
        }
        let running = catalog.head().await.unwrap().unwrap();
        assert_eq!(running.version, 3);

        std::fs::write(&path, &backup).unwrap();
        let stored = catalog.head().await.unwrap().unwrap();
        assert_eq!(stored, backup_head);
        assert_eq!(stored.drift_from(running), Drift::Behind);

        // A writer that read before the restore: refused.
        assert_eq!(
            store
                .store(running, Head { version: 4, id: 4 }, ONE, &BTreeMap::new())
                .await
                .unwrap(),
            Err(stored)
        );
        // Written again up to version 3 by another process (which saw only the backup):
        // same version, another id; the old head still loses.
        let other = Catalog::new(Arc::new(FileCatalog::new(dir.path())));
        for name in ["x", "y"] {
            let text = format!("{ONE}\n[[buses]]\nname = \"{name}\"\n");
            other
                .change(move |_| Ok::<_, std::convert::Infallible>((Some(channels(&text)), ())))
                .await
                .unwrap();
        }
        let replaced = catalog.head().await.unwrap().unwrap();
        assert_eq!(replaced.version, 3);
        assert_eq!(replaced.drift_from(running), Drift::Replaced);
        assert_eq!(
            store
                .store(running, Head { version: 4, id: 4 }, ONE, &BTreeMap::new())
                .await
                .unwrap(),
            Err(replaced)
        );
        // This process's next write goes past the highest version it has seen.
        let changed = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(ONE)), ())))
            .await
            .unwrap();
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
        let err = catalog
            .change(|_| Ok::<_, std::convert::Infallible>((Some(channels(ONE)), ())))
            .await
            .unwrap_err();
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
