//! User functions in WebAssembly: components of the `sluice:function/transform` world
//! (`schemas/wit/function.wit`) that a target's transform chain calls
//! (`transform = [{ wasm = "name" }]`) on each matched event.
//!
//! A function is a catalog resource (`[[functions]]`): its name, the SHA-256 of its
//! component (its version) and its limits. The component's bytes are kept beside the
//! catalog, by hash (Redis, or the data directory standalone). Every replica follows the
//! catalog: a new version is fetched and compiled in the background while the old one
//! keeps running, then swapped in; each call takes the version current when it starts, so
//! every event is handled by exactly one version.

pub mod engine;

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Duration;

use cloudevents::Event;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::Digest;
use tokio::sync::watch;

pub use engine::{CallError, Compiled, Grants, Instance, LoadError};

use crate::store::catalog::CatalogStore;
use crate::values::{duration, ser_duration};

/// The largest component accepted (`PUT /api/v1/functions/{name}`, `path` in the file).
pub const MAX_COMPONENT_BYTES: usize = 16 * 1024 * 1024;

/// The longest time limit a function may be given.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(10);

/// A function as the catalog holds it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FunctionConfig {
    pub name: String,
    /// The component file (the server's configuration file only, relative to it): read
    /// at start, stored by hash, and replaced by `sha256`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<PathBuf>,
    /// The SHA-256 of the component (hex): its version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
    /// The component's size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// Time per call (the instance is interrupted past it).
    #[serde(
        default = "default_timeout",
        deserialize_with = "duration",
        serialize_with = "ser_duration"
    )]
    pub timeout: Duration,
    /// Linear memory of the instance, in bytes.
    #[serde(default = "default_memory")]
    pub max_memory_bytes: u64,
    /// Events one call may return.
    #[serde(default = "default_events")]
    pub max_events: u32,
    /// Bytes one call may return, all events together.
    #[serde(default = "default_output")]
    pub max_output_bytes: u64,
    /// How long an instance lives: the events of a batch in turn (`batch`, the default),
    /// or one event (`event`).
    #[serde(default, skip_serializing_if = "Isolation::is_batch")]
    pub isolation: Isolation,
    /// What of the host the function may reach (nothing by default): `clocks`, `random`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<Grant>,
    /// The environment variables the function sees (`wasi:cli/environment`); none by
    /// default, and never the gateway's own. Shown by the catalog: not for secrets.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
}

/// How long an instance of a function lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// One instance serves the events of a delivery batch one after another (what a
    /// function keeps in its globals lives until the batch ends or a call fails).
    #[default]
    Batch,
    /// A fresh instance for every event.
    Event,
}

impl Isolation {
    fn is_batch(&self) -> bool {
        *self == Isolation::Batch
    }
}

/// A capability of the host a function may be granted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Grant {
    /// The wall and monotonic clocks (`wasi:clocks`).
    Clocks,
    /// Random bytes (`wasi:random`).
    Random,
}

impl std::str::FromStr for Grant {
    type Err = String;
    fn from_str(s: &str) -> Result<Grant, String> {
        match s {
            "clocks" => Ok(Grant::Clocks),
            "random" => Ok(Grant::Random),
            other => Err(format!(
                "unknown grant `{other}`: a function may be granted `clocks` and `random` (files and the network are never granted; `env` sets its environment)"
            )),
        }
    }
}

/// The largest environment a function may be given, names and values together.
const MAX_ENV_BYTES: usize = 64 * 1024;

/// What one call may use.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    pub timeout: Duration,
    pub max_memory_bytes: u64,
    pub max_events: u32,
    pub max_output_bytes: u64,
}

fn default_timeout() -> Duration {
    Duration::from_millis(50)
}
fn default_memory() -> u64 {
    64 * 1024 * 1024
}
fn default_events() -> u32 {
    100
}
fn default_output() -> u64 {
    1024 * 1024
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            timeout: default_timeout(),
            max_memory_bytes: default_memory(),
            max_events: default_events(),
            max_output_bytes: default_output(),
        }
    }
}

impl Limits {
    /// The field at fault (a JSON pointer) and why, when a limit is out of range.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(("/timeout", "timeout must be between 1ms and 10s".into()));
        }
        if !(1 << 20..=4 << 30).contains(&self.max_memory_bytes) {
            return Err((
                "/max_memory_bytes",
                "max_memory_bytes must be between 1 MiB (1048576) and 4 GiB".into(),
            ));
        }
        if !(1..=10_000).contains(&self.max_events) {
            return Err((
                "/max_events",
                "max_events must be between 1 and 10000".into(),
            ));
        }
        if !(1..=64 << 20).contains(&self.max_output_bytes) {
            return Err((
                "/max_output_bytes",
                "max_output_bytes must be between 1 and 64 MiB".into(),
            ));
        }
        Ok(())
    }
}

impl FunctionConfig {
    /// A function of the catalog with the default limits.
    pub fn new(name: &str, sha256: &str, size: u64) -> FunctionConfig {
        let l = Limits::default();
        FunctionConfig {
            name: name.to_string(),
            path: None,
            sha256: Some(sha256.to_string()),
            size: Some(size),
            timeout: l.timeout,
            max_memory_bytes: l.max_memory_bytes,
            max_events: l.max_events,
            max_output_bytes: l.max_output_bytes,
            isolation: Isolation::Batch,
            grants: Vec::new(),
            env: BTreeMap::new(),
        }
    }

    /// What the function may reach of the host.
    pub fn granted(&self) -> Grants {
        Grants {
            clocks: self.grants.contains(&Grant::Clocks),
            random: self.grants.contains(&Grant::Random),
            env: self
                .env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        }
    }

    pub fn limits(&self) -> Limits {
        Limits {
            timeout: self.timeout,
            max_memory_bytes: self.max_memory_bytes,
            max_events: self.max_events,
            max_output_bytes: self.max_output_bytes,
        }
    }

    /// The field at fault (a JSON pointer) and why, when the resource is not valid.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        crate::values::check_name(&self.name)
            .map_err(|m| ("/name", format!("function name: {m}")))?;
        match (&self.path, &self.sha256) {
            (Some(_), Some(_)) => {
                return Err(("/path", "give `path` or `sha256`, not both".into()))
            }
            (None, None) => {
                return Err((
                    "/path",
                    "a function needs `path` (a .wasm component file) or, in the catalog, `sha256`"
                        .into(),
                ))
            }
            (None, Some(sha)) if !is_sha256(sha) => {
                return Err((
                    "/sha256",
                    "sha256 must be 64 lowercase hexadecimal digits".into(),
                ))
            }
            _ => {}
        }
        let mut bytes = 0;
        for (name, value) in &self.env {
            if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
                return Err((
                    "/env",
                    format!("environment variable `{name}`: a name is not empty and holds no `=` or NUL; a value holds no NUL"),
                ));
            }
            bytes += name.len() + value.len();
        }
        if bytes > MAX_ENV_BYTES {
            return Err((
                "/env",
                format!("the environment is {bytes} bytes, more than {MAX_ENV_BYTES}"),
            ));
        }
        self.limits().check()
    }
}

/// The SHA-256 of `bytes`, in lowercase hexadecimal.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = sha2::Sha256::digest(bytes);
    let mut out = String::with_capacity(64);
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

fn is_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// Why a file function could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The file is missing, unreadable or too large.
    #[error("{0}")]
    File(String),
    /// The store did not take it (Redis down, say): worth trying again.
    #[error("function `{0}`: cannot store the component: {1}")]
    Store(String, crate::store::StoreError),
}

/// Reads a file function (`path`), stores its component by hash and names it by hash.
pub async fn resolve_path(
    function: &mut FunctionConfig,
    base_dir: &Path,
    store: &dyn CatalogStore,
) -> Result<(), ResolveError> {
    let Some(path) = function.path.clone() else {
        return Ok(());
    };
    let full = base_dir.join(&path);
    let bytes = tokio::fs::read(&full).await.map_err(|e| {
        ResolveError::File(format!(
            "function `{}`: cannot read {}: {e}",
            function.name,
            full.display()
        ))
    })?;
    if bytes.len() > MAX_COMPONENT_BYTES {
        return Err(ResolveError::File(format!(
            "function `{}`: {} is {} bytes, more than the limit of {MAX_COMPONENT_BYTES}",
            function.name,
            full.display(),
            bytes.len()
        )));
    }
    let sha = sha256_hex(&bytes);
    store
        .put_component(&sha, &bytes)
        .await
        .map_err(|e| ResolveError::Store(function.name.clone(), e))?;
    function.path = None;
    function.sha256 = Some(sha);
    function.size = Some(bytes.len() as u64);
    Ok(())
}

/// One function as this replica runs it.
struct Entry {
    limits: Limits,
    isolation: Isolation,
    /// The version the catalog names.
    wanted: String,
    /// What it may reach of the host (a change links the component again).
    grants: Grants,
    /// The version calls use (older than `wanted` while the new one compiles).
    current: Option<Arc<Compiled>>,
    /// Why `wanted` cannot be loaded here.
    error: Option<String>,
}

impl Entry {
    /// Whether the catalog still asks for this version with these grants.
    fn wants(&self, sha: &str, grants: &Grants) -> bool {
        self.wanted == sha && self.grants == *grants
    }
}

/// The functions of the process: what calls use, and their loading.
pub struct Registry {
    cache: RwLock<Option<PathBuf>>,
    entries: RwLock<HashMap<String, Entry>>,
    changed: watch::Sender<u64>,
    max_event_bytes: std::sync::atomic::AtomicUsize,
}

/// Removes the compiled components (`{sha}-{engine}.cwasm`) of versions no function of
/// the catalog names any more (and that were not written in the last ten minutes). Only
/// compiled files: the components themselves (`.wasm`,
/// kept by the catalog's store) stay.
fn prune_cache(dir: &Path, keep: &HashSet<String>) {
    let Ok(files) = std::fs::read_dir(dir) else {
        return;
    };
    for file in files.flatten() {
        let name = file.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(stem) = name.strip_suffix(".cwasm") else {
            continue;
        };
        let sha = stem.split('-').next().unwrap_or_default();
        // A version compiled in the last minutes may be one an upload just checked and
        // the catalog is about to name.
        let recent = file
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_none_or(|age| age < Duration::from_secs(600));
        if is_sha256(sha) && !keep.contains(sha) && !recent {
            match std::fs::remove_file(file.path()) {
                Ok(()) => {
                    tracing::info!(file = %name, "removed the compiled form of a function version no longer in the catalog")
                }
                Err(e) => {
                    tracing::warn!(file = %name, error = %e, "cannot remove an unused compiled function")
                }
            }
        }
    }
}

/// How many batches run functions at once: one per core. Calls are CPU work; more threads
/// than cores would only take turns (and memory: an instance each).
pub fn running() -> &'static tokio::sync::Semaphore {
    static RUNNING: OnceLock<tokio::sync::Semaphore> = OnceLock::new();
    RUNNING.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        tokio::sync::Semaphore::new(cores)
    })
}

/// The process's function registry.
pub fn registry() -> &'static Registry {
    static REGISTRY: OnceLock<Registry> = OnceLock::new();
    REGISTRY.get_or_init(|| Registry {
        cache: RwLock::new(None),
        entries: RwLock::new(HashMap::new()),
        changed: watch::channel(0).0,
        max_event_bytes: std::sync::atomic::AtomicUsize::new(1024 * 1024),
    })
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}
fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|p| p.into_inner())
}

/// A function's state on this replica, for the admin API.
#[derive(Debug, Clone, Serialize)]
pub struct Loaded {
    /// The version calls use now (`null` until one is compiled).
    pub running: Option<String>,
    /// Why the catalog's version cannot be loaded here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Registry {
    /// Where compiled components are kept (`functions/` in the data directory), and the
    /// largest event a function may return.
    pub fn configure(&self, data_dir: &Path, max_event_bytes: usize) {
        *write(&self.cache) = Some(data_dir.join("functions"));
        self.max_event_bytes
            .store(max_event_bytes, std::sync::atomic::Ordering::Relaxed);
    }

    fn cache_dir(&self) -> Option<PathBuf> {
        read(&self.cache).clone()
    }

    /// Follows the catalog's functions: new versions are fetched and compiled in the
    /// background (the old version runs meanwhile); removed functions go.
    pub fn sync(&'static self, functions: &[FunctionConfig], store: Arc<dyn CatalogStore>) {
        let mut entries = write(&self.entries);
        let names: HashSet<&str> = functions.iter().map(|f| f.name.as_str()).collect();
        entries.retain(|name, _| names.contains(name.as_str()));
        for f in functions {
            let Some(sha) = f.sha256.clone() else {
                continue;
            };
            let entry = entries.entry(f.name.clone()).or_insert_with(|| Entry {
                limits: f.limits(),
                isolation: f.isolation,
                wanted: String::new(),
                grants: Grants::default(),
                current: None,
                error: None,
            });
            entry.limits = f.limits();
            entry.isolation = f.isolation;
            let grants = f.granted();
            if entry.wants(&sha, &grants) {
                continue;
            }
            entry.wanted = sha.clone();
            entry.grants = grants.clone();
            entry.error = None;
            tokio::spawn(self.load(f.name.clone(), sha, grants, store.clone()));
        }
        let keep: HashSet<String> = entries.values().map(|e| e.wanted.clone()).collect();
        drop(entries);
        self.changed.send_modify(|v| *v += 1);
        if let Some(dir) = self.cache_dir() {
            tokio::task::spawn_blocking(move || prune_cache(&dir, &keep));
        }
    }

    async fn load(
        &'static self,
        name: String,
        sha: String,
        grants: Grants,
        store: Arc<dyn CatalogStore>,
    ) {
        let wanted = || {
            read(&self.entries)
                .get(&name)
                .is_some_and(|e| e.wants(&sha, &grants))
        };
        let mut wait = Duration::from_millis(200);
        let bytes = loop {
            if !wanted() {
                return;
            }
            match store.component(&sha).await {
                Ok(Some(bytes)) if sha256_hex(&bytes) == sha => break bytes,
                Ok(Some(_)) => {
                    self.failed(
                        &name,
                        &sha,
                        &grants,
                        "the stored component does not match its SHA-256".into(),
                    );
                    return;
                }
                Ok(None) => {
                    self.failed(
                        &name,
                        &sha,
                        &grants,
                        "the component is not in the store".into(),
                    );
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
                Err(e) => {
                    tracing::warn!(function = %name, error = %e, "cannot read a function's component; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
            }
        };
        let cache = self.cache_dir();
        let started = std::time::Instant::now();
        let id = sha.clone();
        let limits = read(&self.entries)
            .get(&name)
            .map(|e| e.limits.clone())
            .unwrap_or_default();
        let linked = grants.clone();
        let compiled = tokio::task::spawn_blocking(move || {
            Compiled::load(&bytes, &id, cache.as_deref(), &limits, &linked)
        })
        .await;
        match compiled {
            Ok(Ok(compiled)) => {
                let mut entries = write(&self.entries);
                if let Some(entry) = entries.get_mut(&name).filter(|e| e.wants(&sha, &grants)) {
                    entry.current = Some(Arc::new(compiled));
                    entry.error = None;
                    tracing::info!(function = %name, sha256 = %sha, took_ms = started.elapsed().as_millis() as u64, "function loaded");
                }
                drop(entries);
                self.changed.send_modify(|v| *v += 1);
            }
            Ok(Err(e)) => self.failed(&name, &sha, &grants, e.to_string()),
            Err(e) => self.failed(&name, &sha, &grants, format!("compiling panicked: {e}")),
        }
    }

    fn failed(&self, name: &str, sha: &str, grants: &Grants, why: String) {
        tracing::error!(function = %name, sha256 = %sha, error = %why, "function cannot be loaded; the previous version (if any) keeps running");
        if let Some(entry) = write(&self.entries)
            .get_mut(name)
            .filter(|e| e.wants(sha, grants))
        {
            entry.error = Some(why);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    /// What this replica runs of each function.
    pub fn loaded(&self) -> HashMap<String, Loaded> {
        read(&self.entries)
            .iter()
            .map(|(name, e)| {
                (
                    name.clone(),
                    Loaded {
                        running: e.current.as_ref().map(|c| c.sha256.clone()),
                        error: e.error.clone(),
                    },
                )
            })
            .collect()
    }

    /// The version a call starts with now, its limits and how long its instances live.
    pub fn get(&self, name: &str) -> Option<(Arc<Compiled>, Limits, Isolation)> {
        let entries = read(&self.entries);
        let e = entries.get(name)?;
        Some((e.current.clone()?, e.limits.clone(), e.isolation))
    }

    /// Waits until each named function has a version to run (or `stop` moves): a chain
    /// never runs before its functions are loaded. `Err` names one that cannot be.
    pub async fn ready(
        &self,
        names: &[&str],
        mut stop: watch::Receiver<bool>,
    ) -> Result<bool, String> {
        let mut changed = self.changed.subscribe();
        loop {
            {
                let entries = read(&self.entries);
                let mut all = true;
                for &name in names {
                    match entries.get(name) {
                        Some(e) if e.current.is_some() => {}
                        Some(Entry {
                            error: Some(why), ..
                        }) => return Err(format!("function `{name}` cannot be loaded: {why}")),
                        _ => all = false,
                    }
                }
                if all {
                    return Ok(true);
                }
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return Ok(false) },
                _ = stop.changed() => return Ok(false),
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }

    /// Checks a component before it goes into the catalog: it compiles, exports `handle`
    /// with the contract's type and starts within the function's limits and grants.
    /// Blocking (compiling takes a while).
    pub fn validate(&self, bytes: &[u8], function: &FunctionConfig) -> Result<(), LoadError> {
        let sha = function.sha256.clone().unwrap_or_else(|| sha256_hex(bytes));
        Compiled::load(
            bytes,
            &sha,
            self.cache_dir().as_deref(),
            &function.limits(),
            &function.granted(),
        )
        .map(|_| ())
    }

    fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Runs a chain's functions from the process's registry, counting each call. One host
/// serves one batch: a function whose isolation is `batch` keeps its instance for the
/// batch's next events (a fresh one after a call that failed, or a new version).
#[derive(Default)]
pub struct Host {
    /// Every call's input and output, for the rule test.
    pub trace: Option<std::sync::Mutex<Vec<Value>>>,
    live: RefCell<HashMap<String, (Arc<Compiled>, Instance)>>,
    /// Call counters by function and outcome, looked up once per batch.
    counters: RefCell<
        Vec<(
            String,
            &'static str,
            prometheus_client::metrics::counter::Counter,
        )>,
    >,
}

impl Host {
    pub fn tracing() -> Host {
        Host {
            trace: Some(std::sync::Mutex::new(Vec::new())),
            live: RefCell::default(),
            counters: RefCell::default(),
        }
    }

    /// One call of `name` on `text`, in the batch's instance when it may serve it.
    fn run(
        &self,
        name: &str,
        compiled: &Arc<Compiled>,
        limits: &Limits,
        isolation: Isolation,
        text: String,
    ) -> Result<Vec<String>, CallError> {
        if isolation == Isolation::Event {
            return compiled.instantiate(limits)?.call(text);
        }
        let mut live = self.live.borrow_mut();
        let kept = live
            .remove(name)
            .filter(|(c, i)| Arc::ptr_eq(c, compiled) && i.limits == *limits);
        let mut instance = match kept {
            Some((_, instance)) => instance,
            None => compiled.instantiate(limits)?,
        };
        let result = instance.call(text);
        if result.as_ref().err().is_none_or(CallError::reusable) {
            live.insert(name.to_string(), (compiled.clone(), instance));
        }
        result
    }

    /// Calls `name` on an event's structured JSON `text`: the returned events checked as
    /// CloudEvents, `None` for one that is `input` unchanged (when given: it need not be
    /// read again).
    fn call_checked(
        &self,
        name: &str,
        text: String,
        input: Option<&str>,
    ) -> Result<Vec<Option<Event>>, String> {
        let registry = registry();
        let (compiled, limits, isolation) = registry
            .get(name)
            .ok_or_else(|| format!("function `{name}` is not loaded on this replica"))?;
        let result = self
            .run(name, &compiled, &limits, isolation, text)
            .and_then(|out| {
                check_returned(&out, input, registry.max_event_bytes()).map(|events| (out, events))
            });
        self.count(
            name,
            match &result {
                Ok(_) => "ok",
                Err(e) => e.outcome(),
            },
        );
        if let Some(trace) = &self.trace {
            let mut trace = trace.lock().unwrap_or_else(|p| p.into_inner());
            trace.push(match &result {
                Ok((out, _)) => serde_json::json!({
                    "function": name,
                    "version": compiled.sha256,
                    "returned": out.iter().map(|s| serde_json::from_str::<Value>(s).unwrap_or(Value::Null)).collect::<Vec<_>>(),
                }),
                Err(e) => serde_json::json!({
                    "function": name,
                    "version": compiled.sha256,
                    "error": e.to_string(),
                    "outcome": e.outcome(),
                }),
            });
        }
        result.map(|(_, events)| events).map_err(|e| e.to_string())
    }

    /// Counts a call in `sluice_function_calls_total`, through a handle looked up once per
    /// batch for each function and outcome.
    fn count(&self, name: &str, outcome: &'static str) {
        let mut counters = self.counters.borrow_mut();
        if let Some((_, _, counter)) = counters.iter().find(|(n, o, _)| n == name && *o == outcome)
        {
            counter.inc();
            return;
        }
        let counter = crate::metrics::get().function_calls(name, outcome);
        counter.inc();
        counters.push((name.to_string(), outcome, counter));
    }
}

impl sluice_functions::FunctionHost for Host {
    fn call(&self, name: &str, event: &Event) -> Result<Vec<Event>, String> {
        // The structured form: written straight from the event when its data is JSON
        // already (or absent); a text or binary payload holding JSON goes in as JSON.
        let text = match event.data() {
            Some(cloudevents::Data::String(_) | cloudevents::Data::Binary(_)) => {
                serde_json::to_string(&sluice_functions::transform::structured(event)?)
            }
            _ => serde_json::to_string(event),
        }
        .map_err(|e| format!("cannot serialize the event: {e}"))?;
        Ok(self
            .call_checked(name, text, None)?
            .into_iter()
            .flatten()
            .collect())
    }

    fn call_text(&self, name: &str, text: &str) -> Result<Vec<Option<Event>>, String> {
        self.call_checked(name, text.to_string(), Some(text))
    }
}

const REQUIRED: [&str; 4] = ["specversion", "id", "source", "type"];

/// The events a function returned, checked as CloudEvents (JSON format); `None` for one
/// that is `input` unchanged (an event known to be good).
fn check_returned(
    out: &[String],
    input: Option<&str>,
    max_event_bytes: usize,
) -> Result<Vec<Option<Event>>, CallError> {
    let many = out.len() > 1;
    out.iter()
        .enumerate()
        .map(|(i, text)| {
            if input == Some(text.as_str()) {
                return Ok(None);
            }
            let which = if many {
                format!("event {} of {}", i + 1, out.len())
            } else {
                "event".to_string()
            };
            parse_one(text, max_event_bytes)
                .map(Some)
                .map_err(|why| CallError::InvalidOutput(format!("an invalid {which}: {why}")))
        })
        .collect()
}

fn parse_one(text: &str, max_event_bytes: usize) -> Result<Event, String> {
    if text.len() > max_event_bytes {
        return Err(format!(
            "{} bytes, more than limits.max_event_bytes ({max_event_bytes})",
            text.len()
        ));
    }
    // One parse straight into the event when it is a good one; the text is read again
    // only to say what is wrong with a bad one.
    match serde_json::from_str::<Event>(text) {
        Ok(event) if event_is_complete(&event) => Ok(event),
        Ok(_) => Err(explain(text).unwrap_or_else(|| "not a CloudEvent".into())),
        Err(e) => Err(explain(text).unwrap_or_else(|| format!("not a CloudEvent: {e}"))),
    }
}

fn event_is_complete(event: &Event) -> bool {
    use cloudevents::AttributesReader;
    event.specversion() == cloudevents::event::SpecVersion::V10
        && !event.id().is_empty()
        && !event.ty().is_empty()
        && !event.source().is_empty()
}

/// What makes `text` a bad event, when it is one of the contract's named faults.
fn explain(text: &str) -> Option<String> {
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Some(format!("not JSON ({e})")),
    };
    let Value::Object(map) = &value else {
        return Some("not a JSON object".into());
    };
    for attr in REQUIRED {
        match map.get(attr) {
            Some(Value::String(s)) if !s.is_empty() => {}
            Some(_) => return Some(format!("`{attr}` must be a non-empty string")),
            None => return Some(format!("the required attribute `{attr}` is missing")),
        }
    }
    if map.get("specversion").and_then(Value::as_str) != Some("1.0") {
        return Some("`specversion` must be \"1.0\"".into());
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returned_events_are_checked_and_named() {
        let ok = r#"{"specversion":"1.0","id":"1","source":"s","type":"t","data":{"a":1}}"#;
        assert!(parse_one(ok, 1 << 20).is_ok());
        let no_source = r#"{"specversion":"1.0","id":"1","type":"t"}"#;
        let e = parse_one(no_source, 1 << 20).unwrap_err();
        assert!(e.contains("`source`"), "{e}");
        assert!(parse_one("nope", 1 << 20).unwrap_err().contains("not JSON"));
        assert!(parse_one(ok, 10).unwrap_err().contains("max_event_bytes"));
        let old = r#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#;
        assert!(parse_one(old, 1 << 20).unwrap_err().contains("specversion"));
        let empty_id = r#"{"specversion":"1.0","id":"","source":"s","type":"t"}"#;
        assert!(parse_one(empty_id, 1 << 20).unwrap_err().contains("`id`"));
        assert!(parse_one("[1]", 1 << 20)
            .unwrap_err()
            .contains("not a JSON object"));
        let e =
            check_returned(&[ok.to_string(), no_source.to_string()], None, 1 << 20).unwrap_err();
        assert!(e.to_string().contains("event 2 of 2"), "{e}");
        // The input returned unchanged is not read again; anything else is.
        let both =
            check_returned(&[ok.to_string(), ok.to_string() + " "], Some(ok), 1 << 20).unwrap();
        assert!(both[0].is_none() && both[1].is_some());
    }

    #[test]
    fn limits_are_checked() {
        let mut l = Limits::default();
        assert!(l.check().is_ok());
        l.timeout = Duration::from_secs(11);
        assert_eq!(l.check().unwrap_err().0, "/timeout");
        let f = FunctionConfig::new("f", "abc", 1);
        assert_eq!(f.check().unwrap_err().0, "/sha256");
        let mut f = FunctionConfig::new("f", &sha256_hex(b"x"), 1);
        assert!(f.check().is_ok());
        f.env.insert("A=B".into(), "v".into());
        assert_eq!(f.check().unwrap_err().0, "/env");
        assert!("network"
            .parse::<Grant>()
            .unwrap_err()
            .contains("never granted"));
        assert_eq!(sha256_hex(b"").len(), 64);
    }
}
