//! The WebAssembly runtime: one wasmtime engine (Cranelift, component model, epoch
//! interruption) for the process, components compiled once per content hash (and kept
//! compiled on disk), and one call: a fresh store and instance per event, under the
//! function's time and memory limits.
//!
//! Nothing of the host is reachable from a function: every import a component declares
//! (WASI interfaces included) is linked to a stub that traps when called, so a function
//! that reads a file, the clock, randomness or the environment fails that event instead
//! of reaching the gateway's process.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use wasmtime::component::{Component, ComponentExportIndex, InstancePre, Linker};
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

/// A compiled function, ready to be instantiated for each call.
pub struct Compiled {
    pre: InstancePre<Sandbox>,
    handle: ComponentExportIndex,
    pub(crate) sha256: String,
}

type Handle = (Result<Vec<String>, String>,);

impl Compiled {
    /// Compiles `bytes` (a component), or loads what an earlier compile of the same bytes
    /// left in `cache` (a directory only the gateway writes).
    pub fn load(bytes: &[u8], sha256: &str, cache: Option<&Path>) -> Result<Compiled, LoadError> {
        let engine = engine()?;
        let component = match cache {
            Some(dir) => cached(engine, bytes, sha256, dir)?,
            None => Component::new(engine, bytes).map_err(|e| invalid(&e))?,
        };
        let mut linker: Linker<Sandbox> = Linker::new(engine);
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
        // Proves the export has the contract's type (and that the component instantiates
        // within the default limits).
        let mut store = compiled.store(&Limits::default());
        let instance = compiled
            .pre
            .instantiate(&mut store)
            .map_err(|e| invalid(&e))?;
        instance
            .get_typed_func::<(&str,), Handle>(&mut store, &compiled.handle)
            .map_err(|e| {
                LoadError::Invalid(format!(
                    "`handle` must be `func(event: string) -> result<list<string>, string>`: {e}"
                ))
            })?;
        Ok(compiled)
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
        let ticks = limits.timeout.as_micros() / TICK.as_micros().max(1) + 1;
        store.set_epoch_deadline(u64::try_from(ticks).unwrap_or(u64::MAX));
        store.epoch_deadline_trap();
        store
    }

    /// Runs the function on one event (its structured JSON) in a fresh instance. Blocks
    /// for up to the time limit: call it from a blocking thread.
    pub fn call(&self, event: &str, limits: &Limits) -> Result<Vec<String>, CallError> {
        let mut store = self.store(limits);
        let started = Instant::now();
        let result = self
            .pre
            .instantiate(&mut store)
            .and_then(|instance| {
                instance.get_typed_func::<(&str,), Handle>(&mut store, &self.handle)
            })
            .and_then(|f| f.call(&mut store, (event,)));
        match result {
            Ok((Ok(events),)) => check_output(events, limits),
            Ok((Err(message),)) => Err(CallError::Returned(clip(message))),
            Err(e) => Err(if store.data().breached {
                CallError::Memory(limits.max_memory_bytes)
            } else if matches!(e.downcast_ref::<Trap>(), Some(Trap::Interrupt)) {
                CallError::Timeout(limits.timeout)
            } else if started.elapsed() > limits.timeout + TICK * 4 {
                // A trap raised late (say inside an import stub) still counts as the
                // timeout it ran into.
                CallError::Timeout(limits.timeout)
            } else {
                CallError::Trap(clip(format!("{e:#}")))
            }),
        }
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
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
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
