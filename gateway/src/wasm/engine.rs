//! The WebAssembly runtime: one wasmtime engine (Cranelift, component model, epoch
//! interruption) for the process, components compiled once per content hash (and kept
//! compiled on disk), and instances: a store and instance under the function's time and
//! memory limits, which serves one event or the events of one batch in turn.
//!
//! Nothing of the host is reachable from a function unless its configuration grants it:
//! every import a component declares (WASI interfaces included) is linked to a stub that
//! traps when called, so a function that reads a file, the clock, randomness or the
//! environment fails that event instead of reaching the gateway's process. The grants
//! (`Grants`) are the wall and monotonic clocks, randomness, and a set of environment
//! variables named in the function's configuration (never the gateway's own); files and
//! the network are never granted.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ComponentExportIndex, InstancePre, Linker, TypedFunc, Val};
use wasmtime::{Config, Engine, ResourceLimiter, Store, Trap};

use super::Limits;

/// How often the engine's epoch moves: the resolution of the time limit.
const TICK: Duration = Duration::from_millis(2);

/// Why a component cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
pub enum LoadError {
    #[error("the WebAssembly runtime cannot start: {0}")]
    Runtime(String),
    #[error("not a WebAssembly component of the `sluice:function/transform` world: {0}")]
    Invalid(String),
}

/// How a call ended, when it did not return events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The function returned `err(message)`.
    #[error("the function returned an error: {0}")]
    Returned(String),
    #[error("the function trapped: {0}")]
    Trap(String),
    #[error("the function ran past its time limit of {0:?}")]
    Timeout(Duration),
    #[error("the function went past its memory limit of {0} bytes")]
    Memory(u64),
    /// What it returned breaks the contract or the limits.
    #[error("the function returned {0}")]
    InvalidOutput(String),
}

impl CallError {
    /// The `outcome` label of `sluice_function_calls_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            CallError::Returned(_) => "error",
            CallError::Trap(_) => "trap",
            CallError::Timeout(_) => "timeout",
            CallError::Memory(_) => "memory",
            CallError::InvalidOutput(_) => "invalid_output",
        }
    }
}

/// The process's engine, made on first use (a gateway without functions starts no epoch
/// thread and compiles nothing).
pub(crate) fn engine() -> Result<&'static Engine, LoadError> {
    static ENGINE: OnceLock<Result<Engine, String>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let mut config = Config::new();
            config.wasm_component_model(true);
            config.epoch_interruption(true);
            // Instances come from a pool reserved once: a call neither maps nor unmaps
            // memory (an instance per event would otherwise cost two large mmaps), and
            // linear memory starts from the module's image copy-on-write.
            config.allocation_strategy(wasmtime::InstanceAllocationStrategy::Pooling(pool()));
            let engine = Engine::new(&config).map_err(|e| e.to_string())?;
            let ticking = engine.weak();
            std::thread::Builder::new()
                .name("sluice-wasm-epoch".into())
                .spawn(move || {
                    while let Some(engine) = ticking.upgrade() {
                        engine.increment_epoch();
                        drop(engine);
                        std::thread::sleep(TICK);
                    }
                })
                .map_err(|e| format!("cannot start the epoch thread: {e}"))?;
            Ok(engine)
        })
        .as_ref()
        .map_err(|e| LoadError::Runtime(e.clone()))
}

/// Instances alive at once: calls run one per core (see `wasm::running`), plus checks of
/// uploaded components and rule tests. Past it, an instantiation waits for none: it fails,
/// so the pool is sized well above what the semaphore lets run.
const POOL_INSTANCES: u32 = 64;

fn pool() -> wasmtime::PoolingAllocationConfig {
    let mut pool = wasmtime::PoolingAllocationConfig::default();
    pool.total_component_instances(POOL_INSTANCES)
        .total_core_instances(POOL_INSTANCES * 8)
        .total_memories(POOL_INSTANCES * 2)
        .total_tables(POOL_INSTANCES * 8)
        .max_core_instances_per_component(64)
        .max_memories_per_component(16)
        .max_tables_per_component(64)
        .max_tables_per_module(8)
        .table_elements(100_000)
        .max_core_instance_size(16 << 20)
        .max_component_instance_size(16 << 20)
        // The largest `max_memory_bytes` a function may be given; each function's own
        // limit is enforced by its store.
        .max_memory_size(4 << 30)
        // A slot's first pages are reset with `memset` instead of `madvise`: releasing
        // pages interrupts the other cores to flush their TLBs, once per call.
        .linear_memory_keep_resident(1 << 20)
        .table_keep_resident(1 << 16);
    pool
}

/// What a store holds: the function's limits, enforced on every growth.
struct Sandbox {
    memory: usize,
    breached: bool,
}

impl ResourceLimiter for Sandbox {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory {
            self.breached = true;
            wasmtime::bail!("memory limit reached");
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }

    fn instances(&self) -> usize {
        100
    }

    fn tables(&self) -> usize {
        100
    }

    fn memories(&self) -> usize {
        100
    }
}

/// What a function may reach of the host, beyond its event (nothing by default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grants {
    /// `wasi:clocks/wall-clock` and `wasi:clocks/monotonic-clock` (`now`, `resolution`).
    pub clocks: bool,
    /// `wasi:random/random`, `wasi:random/insecure` and `wasi:random/insecure-seed`.
    pub random: bool,
    /// What `wasi:cli/environment` answers: these variables only (none: not granted).
    pub env: Vec<(String, String)>,
}

/// The largest `get-random-bytes` request answered (a function asking more traps).
const MAX_RANDOM_BYTES: u64 = 64 * 1024;

/// The clocks a function is granted tick in microseconds: finer timers would serve timing
/// attacks on the process more than any event's logic.
const CLOCK_NANOS: u32 = 1_000;

/// Defines, at the exact names the component imports them (any `0.2.x` version), the
/// WASI functions `grants` allows. Everything else stays a trapping stub.
fn grant(
    linker: &mut Linker<Sandbox>,
    component: &Component,
    grants: &Grants,
) -> wasmtime::Result<()> {
    let engine = linker.engine().clone();
    let imports: Vec<String> = component
        .component_type()
        .imports(&engine)
        .map(|(name, _)| name.to_string())
        .collect();
    for name in imports {
        let Some((interface, version)) = name.split_once('@') else {
            continue;
        };
        let granted = version.starts_with("0.2.")
            && match interface {
                "wasi:clocks/wall-clock" | "wasi:clocks/monotonic-clock" => grants.clocks,
                "wasi:random/random" | "wasi:random/insecure" | "wasi:random/insecure-seed" => {
                    grants.random
                }
                "wasi:cli/environment" => !grants.env.is_empty(),
                _ => false,
            };
        if !granted {
            continue;
        }
        let mut at = linker.instance(&name)?;
        match interface {
            "wasi:clocks/wall-clock" => {
                at.func_new("now", |_, _, _, results| {
                    let since = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .unwrap_or_default();
                    let nanos = since.subsec_nanos() / CLOCK_NANOS * CLOCK_NANOS;
                    results[0] = datetime(since.as_secs(), nanos);
                    Ok(())
                })?;
                at.func_new("resolution", |_, _, _, results| {
                    results[0] = datetime(0, CLOCK_NANOS);
                    Ok(())
                })?;
            }
            "wasi:clocks/monotonic-clock" => {
                at.func_wrap("now", |_, (): ()| {
                    let nanos = process_start().elapsed().as_nanos();
                    let nanos = nanos / u128::from(CLOCK_NANOS) * u128::from(CLOCK_NANOS);
                    Ok((u64::try_from(nanos).unwrap_or(u64::MAX),))
                })?;
                at.func_wrap("resolution", |_, (): ()| Ok((u64::from(CLOCK_NANOS),)))?;
            }
            "wasi:random/random" | "wasi:random/insecure" => {
                let (bytes, number) = if interface == "wasi:random/random" {
                    ("get-random-bytes", "get-random-u64")
                } else {
                    ("get-insecure-random-bytes", "get-insecure-random-u64")
                };
                // Typed: the bytes are copied into the instance as they are (a list of
                // dynamic values would take 32 bytes of the host's memory per byte).
                at.func_wrap(bytes, |_, (len,): (u64,)| {
                    if len > MAX_RANDOM_BYTES {
                        wasmtime::bail!("more than {MAX_RANDOM_BYTES} random bytes asked at once");
                    }
                    let mut buf = vec![0u8; usize::try_from(len)?];
                    getrandom::fill(&mut buf).map_err(|e| wasmtime::format_err!("{e}"))?;
                    Ok((buf,))
                })?;
                at.func_wrap(number, |_, (): ()| Ok((random_u64()?,)))?;
            }
            "wasi:random/insecure-seed" => {
                at.func_new("insecure-seed", |_, _, _, results| {
                    results[0] = Val::Tuple(vec![Val::U64(random_u64()?), Val::U64(random_u64()?)]);
                    Ok(())
                })?;
            }
            "wasi:cli/environment" => {
                let env: Vec<Val> = grants
                    .env
                    .iter()
                    .map(|(k, v)| Val::Tuple(vec![Val::String(k.clone()), Val::String(v.clone())]))
                    .collect();
                at.func_new("get-environment", move |_, _, _, results| {
                    results[0] = Val::List(env.clone());
                    Ok(())
                })?;
                at.func_new("get-arguments", |_, _, _, results| {
                    results[0] = Val::List(Vec::new());
                    Ok(())
                })?;
                at.func_new("initial-cwd", |_, _, _, results| {
                    results[0] = Val::Option(None);
                    Ok(())
                })?;
            }
            // Not reached: `granted` above lets only these interfaces through.
            _ => {}
        }
    }
    Ok(())
}

fn datetime(seconds: u64, nanoseconds: u32) -> Val {
    Val::Record(vec![
        ("seconds".into(), Val::U64(seconds)),
        ("nanoseconds".into(), Val::U32(nanoseconds)),
    ])
}

fn random_u64() -> wasmtime::Result<u64> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| wasmtime::format_err!("{e}"))?;
    Ok(u64::from_le_bytes(b))
}

fn process_start() -> Instant {
    static START: OnceLock<Instant> = OnceLock::new();
    *START.get_or_init(Instant::now)
}

/// A compiled function, ready to be instantiated.
pub struct Compiled {
    pre: InstancePre<Sandbox>,
    handle: ComponentExportIndex,
    pub(crate) sha256: String,
}

type Handle = (Result<Vec<String>, String>,);

impl Compiled {
    /// Compiles `bytes` (a component), or loads what an earlier compile of the same bytes
    /// left in `cache` (a directory only the gateway writes), links what `grants` allows,
    /// and proves it instantiates within `limits` with the contract's `handle`.
    pub fn load(
        bytes: &[u8],
        sha256: &str,
        cache: Option<&Path>,
        limits: &Limits,
        grants: &Grants,
    ) -> Result<Compiled, LoadError> {
        let engine = engine()?;
        let component = match cache {
            Some(dir) => cached(engine, bytes, sha256, dir)?,
            None => Component::new(engine, bytes).map_err(|e| invalid(&e))?,
        };
        let mut linker: Linker<Sandbox> = Linker::new(engine);
        grant(&mut linker, &component, grants).map_err(|e| invalid(&e))?;
        linker
            .define_unknown_imports_as_traps(&component)
            .map_err(|e| invalid(&e))?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| invalid(&e))?;
        let handle = component
            .get_export_index(None, "handle")
            .ok_or_else(|| LoadError::Invalid("it does not export `handle`".into()))?;
        let compiled = Compiled {
            pre,
            handle,
            sha256: sha256.to_string(),
        };
        // Proves the export has the contract's type and that the component starts within
        // the function's own limits.
        match compiled.instantiate(limits) {
            Ok(_) => Ok(compiled),
            Err(CallError::InvalidOutput(why)) => Err(LoadError::Invalid(why)),
            Err(e) => Err(LoadError::Invalid(format!("it does not start: {e}"))),
        }
    }

    fn store(&self, limits: &Limits) -> Store<Sandbox> {
        let mut store = Store::new(
            self.pre.engine(),
            Sandbox {
                memory: usize::try_from(limits.max_memory_bytes).unwrap_or(usize::MAX),
                breached: false,
            },
        );
        store.limiter(|s| s as &mut dyn ResourceLimiter);
        store.set_epoch_deadline(deadline(limits));
        store.epoch_deadline_trap();
        store
    }

    /// A new instance under `limits` (its start-up counts against the time limit).
    pub fn instantiate(&self, limits: &Limits) -> Result<Instance, CallError> {
        let mut store = self.store(limits);
        let started = Instant::now();
        let made = self
            .pre
            .instantiate(&mut store)
            .map_err(|e| failure(&e, &store, limits, started))?;
        let handle = made
            .get_typed_func::<(String,), Handle>(&mut store, &self.handle)
            .map_err(|e| {
                CallError::InvalidOutput(format!(
                    "`handle` must be `func(event: string) -> result<list<string>, string>`: {e}"
                ))
            })?;
        Ok(Instance {
            store,
            handle,
            limits: limits.clone(),
        })
    }
}

/// A live instance of a function. Calls run one after another on it, each under the
/// function's time limit; after a call that trapped, ran out of time or memory, or broke
/// a limit, it must not be used again (`call` says so with `reusable`).
pub struct Instance {
    store: Store<Sandbox>,
    handle: TypedFunc<(String,), Handle>,
    pub(crate) limits: Limits,
}

impl Instance {
    /// Runs the function on one event (its structured JSON). Blocks for up to the time
    /// limit: call it from a blocking thread.
    pub fn call(&mut self, event: String) -> Result<Vec<String>, CallError> {
        self.store.set_epoch_deadline(deadline(&self.limits));
        let started = Instant::now();
        match self.handle.call(&mut self.store, (event,)) {
            Ok((Ok(events),)) => check_output(events, &self.limits),
            Ok((Err(message),)) => Err(CallError::Returned(clip(message))),
            Err(e) => Err(failure(&e, &self.store, &self.limits, started)),
        }
    }
}

impl CallError {
    /// Whether the instance that answered so may serve the next event: only after the
    /// function itself returned an error (a trap leaves it unusable; a limit breach makes
    /// a fresh start the safe course).
    pub fn reusable(&self) -> bool {
        matches!(self, CallError::Returned(_))
    }
}

/// The epoch deadline of one call, in ticks from now.
fn deadline(limits: &Limits) -> u64 {
    let ticks = limits.timeout.as_micros() / TICK.as_micros().max(1) + 1;
    u64::try_from(ticks).unwrap_or(u64::MAX)
}

/// Why a call (or an instantiation) failed, from wasmtime's error.
fn failure(
    e: &wasmtime::Error,
    store: &Store<Sandbox>,
    limits: &Limits,
    started: Instant,
) -> CallError {
    if store.data().breached {
        CallError::Memory(limits.max_memory_bytes)
    } else if matches!(e.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
        CallError::Timeout(limits.timeout)
    } else if started.elapsed() > limits.timeout + TICK * 4 {
        // A trap raised late (say inside an import stub) still counts as the timeout it
        // ran into.
        CallError::Timeout(limits.timeout)
    } else {
        // The cause first (a JavaScript engine's backtrace alone can pass the length a
        // reason is clipped to), then where it happened.
        let cause = e.root_cause().to_string();
        let mut message = cause.clone();
        if cause.contains("unknown import:") {
            // The stub of an import nothing granted.
            message.push_str(
                " (not granted: a function reaches the clocks, randomness or an environment only through its `grants` and `env`)",
            );
        }
        let full = format!("{e:#}");
        if full != cause {
            message.push_str("; ");
            message.push_str(&full);
        }
        CallError::Trap(clip(message))
    }
}

fn check_output(events: Vec<String>, limits: &Limits) -> Result<Vec<String>, CallError> {
    if events.len() > limits.max_events as usize {
        return Err(CallError::InvalidOutput(format!(
            "{} events, more than its limit of {} (max_events)",
            events.len(),
            limits.max_events
        )));
    }
    let bytes: usize = events.iter().map(String::len).sum();
    if bytes as u64 > limits.max_output_bytes {
        return Err(CallError::InvalidOutput(format!(
            "{bytes} bytes, more than its limit of {} (max_output_bytes)",
            limits.max_output_bytes
        )));
    }
    Ok(events)
}

/// Messages from a function are kept short: they go into logs and dead letters.
fn clip(mut message: String) -> String {
    const MAX: usize = 1024;
    if message.len() > MAX {
        let mut end = MAX;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push('…');
    }
    message
}

fn invalid(e: &wasmtime::Error) -> LoadError {
    LoadError::Invalid(clip(format!("{e:#}")))
}

/// The component from the cache directory when an earlier compile of the same bytes by a
/// compatible engine left it there; compiled (and left there) otherwise.
fn cached(engine: &Engine, bytes: &[u8], sha256: &str, dir: &Path) -> Result<Component, LoadError> {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let path: PathBuf = dir.join(format!("{sha256}-{:016x}.cwasm", hasher.finish()));
    if path.exists() {
        match deserialize(engine, &path) {
            Ok(component) => return Ok(component),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "a compiled function in the cache cannot be used; compiling it again");
            }
        }
    }
    let component = Component::new(engine, bytes).map_err(|e| invalid(&e))?;
    match component.serialize() {
        Ok(artifact) => {
            // A name of its own per write: two functions of the same bytes compile at
            // once, and a file both wrote into could hold a mix of the two.
            static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
            let written = std::fs::create_dir_all(dir)
                .and_then(|()| std::fs::write(&tmp, &artifact))
                .and_then(|()| std::fs::rename(&tmp, &path));
            if let Err(e) = written {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!(path = %path.display(), error = %e, "cannot keep a compiled function on disk; it is compiled again at the next start");
            }
        }
        Err(e) => tracing::warn!(error = %e, "cannot serialize a compiled function"),
    }
    Ok(component)
}

/// Loads a compiled component the gateway itself wrote.
#[allow(unsafe_code)]
fn deserialize(engine: &Engine, path: &Path) -> wasmtime::Result<Component> {
    // SAFETY: wasmtime runs deserialized native code as is, so the file must be one it
    // wrote. Only the gateway writes this directory (`functions/` in its data directory,
    // written aside and renamed in), the name carries the source's SHA-256 and the
    // engine's compatibility hash, and wasmtime checks the header (version, target,
    // settings) before using it. The data directory is the gateway's own, like its logs.
    unsafe { Component::deserialize_file(engine, path) }
}
