//! Where the catalog is kept: a compare-and-set on its (version, id) head, in Redis
//! (distributed, `store::redis::catalog`) or `catalog.json` (standalone, here). What the
//! catalog holds and how it changes is `crate::catalog`, above; this is only its storage.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

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
    async fn store(&self, expected: Head, next: &Stored) -> Result<Result<(), Head>, StoreError>;
    /// Moves whenever the catalog may have changed (and on other cluster notices).
    fn changes(&self) -> watch::Receiver<u64>;
    /// Keeps a function's component by its SHA-256 (hex), before a catalog version names
    /// it. Content-addressed: storing the same bytes again changes nothing.
    async fn put_component(&self, sha256: &str, bytes: &[u8]) -> Result<(), StoreError>;
    /// A function's component by its SHA-256.
    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Whether a component is stored, without reading it.
    async fn has_component(&self, sha256: &str) -> Result<bool, StoreError>;
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

impl FileCatalog {
    /// Where components are kept: `functions/{sha256}.wasm` beside `catalog.json`.
    fn component_path(&self, sha256: &str) -> Option<PathBuf> {
        let dir = self.path.parent()?.join("functions");
        Some(dir.join(format!("{sha256}.wasm")))
    }
}

#[async_trait]
impl CatalogStore for FileCatalog {
    async fn put_component(&self, sha256: &str, bytes: &[u8]) -> Result<(), StoreError> {
        let path = self
            .component_path(sha256)
            .ok_or_else(|| StoreError::Unavailable("the catalog has no directory".into()))?;
        if tokio::fs::try_exists(&path).await.unwrap_or(false) {
            return Ok(());
        }
        let bytes = bytes.to_vec();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let tmp = path.with_extension("wasm.tmp");
            {
                use std::io::Write as _;
                let mut f = std::fs::File::create(&tmp)?;
                f.write_all(&bytes)?;
                f.sync_all()?;
            }
            std::fs::rename(&tmp, &path)
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("component: {e}")))?
        .map_err(|e| StoreError::io("cannot store a function's component", &e))
    }

    async fn component(&self, sha256: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let Some(path) = self.component_path(sha256) else {
            return Ok(None);
        };
        match tokio::fs::read(&path).await {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StoreError::io("cannot read a function's component", &e)),
        }
    }

    async fn has_component(&self, sha256: &str) -> Result<bool, StoreError> {
        let Some(path) = self.component_path(sha256) else {
            return Ok(false);
        };
        match tokio::fs::metadata(&path).await {
            Ok(meta) => Ok(meta.is_file()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(StoreError::io("cannot read a function's component", &e)),
        }
    }

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

    async fn store(&self, expected: Head, next: &Stored) -> Result<Result<(), Head>, StoreError> {
        let _writer = self.write.lock().await;
        let current = self.load().await?.map_or(Head::default(), |s| s.head());
        if current != expected {
            return Ok(Err(current));
        }
        let stored = next.clone();
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
