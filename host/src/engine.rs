//! The one wasmtime engine every plugin runs on, with its epoch ticker, its
//! instance slots and its compile cache. It knows nothing of what a plugin
//! imports: the linker is built where plugins are loaded.
//!
//! Configuration choices, each measured (docs/PERFORMANCE.md):
//! - the pooling allocator, so a fresh instance costs microseconds, not a
//!   hundred; its slots bound how many instances live at once, and a
//!   semaphore in front of it makes a request wait for a slot (for a
//!   bounded time, see `admission`) rather than fail for lack of one;
//! - epoch interruption, for CPU budgets that cost almost nothing per call;
//! - `concurrency_support` off: the component-model-async machinery makes
//!   every layer about three times dearer and we do not use it. With it off
//!   wasmtime does not detect re-entry into an instance, so the host never
//!   enters an instance that is already on the stack (see `plugin::admission`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use wasmtime::{Enabled, InstanceAllocationStrategy, PoolingAllocationConfig};

use crate::cache::Cache;
use crate::compile::CompileError;
use wasmtime::component::Component;

/// Settings of the engine. The defaults suit a server handling thousands of
/// concurrent streams on a small machine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Filter instances that may be in use at once, across all invokes.
    /// An invoke reserves the instances its filters need before it starts
    /// and waits while the slots are taken, at most `queue_timeout`.
    pub instance_slots: u32,
    /// Idle instances kept ready across all filters: used ones of `warm`
    /// filters, and fresh ones prepared ahead of demand for `invoke` filters.
    pub idle_instances: u32,
    /// Fresh instances each `invoke` filter keeps prepared, so a request
    /// does not wait for instantiation (made in the background).
    pub prepared_instances: u32,
    /// Where compiled plugins are cached; `None` compiles every time.
    pub cache_dir: Option<PathBuf>,
    /// The epoch tick: how often a running filter's budgets are checked
    /// and how often a busy filter yields to other requests.
    pub tick: Duration,
    /// How long an invoke may wait for the instances it needs (a filter's
    /// quota, the engine's slots) before it fails as `overloaded`.
    pub queue_timeout: Duration,
    /// Address space a plugin's compile may use, in MiB: compiles run in a
    /// child process under this cap (Linux).
    pub compile_memory_mib: u32,
    /// How long a plugin's compile may take before it is killed.
    pub compile_timeout: Duration,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            instance_slots: 1000,
            idle_instances: 256,
            prepared_instances: 4,
            cache_dir: Cache::default_dir(),
            tick: Duration::from_millis(10),
            queue_timeout: Duration::from_secs(10),
            compile_memory_mib: 4096,
            compile_timeout: Duration::from_secs(120),
        }
    }
}

/// Why an engine could not be built.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// wasmtime refused the configuration (e.g. the pool does not fit the
    /// machine's address space).
    #[error("the wasmtime engine could not be built: {0}")]
    Wasmtime(String),
    /// The epoch ticker thread could not be started.
    #[error("the epoch ticker thread could not start: {0}")]
    Ticker(std::io::Error),
}

/// Pool slots beyond the in-use and idle budgets: for load-time instances
/// and used ones waiting to be dropped in the background.
const SPARE_SLOTS: u32 = 96;
/// Core instances, memories and tables a single filter component may hold.
/// A Rust guest has 4 core instances, 2 memories and 2 tables; Python and
/// JavaScript guests more.
const CORE_INSTANCES_PER_COMPONENT: u32 = 24;
const MEMORIES_PER_COMPONENT: u32 = 4;
const TABLES_PER_COMPONENT: u32 = 8;
/// Bytes of each freed memory, table and stack slot reset in place rather
/// than returned to the kernel.
const KEEP_RESIDENT: usize = 2 << 20;
/// The largest memory cap a filter may be given.
pub const MAX_MEMORY_MIB: u32 = 4096;

/// The shared wasmtime engine. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    inner: Arc<EngineInner>,
}

struct EngineInner {
    wasmtime: wasmtime::Engine,
    cache: Option<Cache>,
    slots: Arc<Semaphore>,
    slot_count: u32,
    /// Instances kept ready in all (idle warm ones, prepared fresh ones).
    idle: AtomicUsize,
    idle_cap: usize,
    prepared: usize,
    queue_timeout: Duration,
    compile_memory_mib: u32,
    compile_timeout: Duration,
    stop_ticker: Arc<AtomicBool>,
}

impl Drop for EngineInner {
    fn drop(&mut self) {
        self.stop_ticker.store(true, Ordering::Relaxed);
    }
}

impl Engine {
    /// Builds the engine and starts its epoch ticker thread.
    pub fn new(config: EngineConfig) -> Result<Self, EngineError> {
        let components = config.instance_slots + config.idle_instances + SPARE_SLOTS;
        let mut pool = PoolingAllocationConfig::new();
        pool.total_component_instances(components)
            .total_core_instances(components * 4)
            .max_core_instances_per_component(CORE_INSTANCES_PER_COMPONENT)
            .total_memories(components * 2)
            .max_memories_per_component(MEMORIES_PER_COMPONENT)
            .total_tables(components * 2)
            .max_tables_per_component(TABLES_PER_COMPONENT)
            .total_stacks(components)
            .max_memory_size((MAX_MEMORY_MIB as usize) << 20)
            // Reset a freed slot by rewriting only its dirty pages (the
            // PAGEMAP_SCAN ioctl, Linux 6.7+) instead of unmapping it, so
            // the next instance in the slot takes no page faults: a fresh
            // instance's first call drops from ~25 to ~4 µs.
            .pagemap_scan(Enabled::Auto)
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT)
            .async_stack_keep_resident(KEEP_RESIDENT);

        let mut wasm = crate::compile::config();
        wasm.allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
        let wasmtime =
            wasmtime::Engine::new(&wasm).map_err(|e| EngineError::Wasmtime(format!("{e:#}")))?;

        let stop_ticker = Arc::new(AtomicBool::new(false));
        spawn_ticker(wasmtime.clone(), config.tick, stop_ticker.clone())?;

        Ok(Engine {
            inner: Arc::new(EngineInner {
                cache: config.cache_dir.map(Cache::new),
                slots: Arc::new(Semaphore::new(config.instance_slots as usize)),
                slot_count: config.instance_slots,
                idle: AtomicUsize::new(0),
                idle_cap: config.idle_instances as usize,
                prepared: config.prepared_instances as usize,
                queue_timeout: config.queue_timeout,
                compile_memory_mib: config.compile_memory_mib,
                compile_timeout: config.compile_timeout,
                wasmtime,
                stop_ticker,
            }),
        })
    }

    /// The underlying wasmtime engine.
    pub fn wasmtime(&self) -> &wasmtime::Engine {
        &self.inner.wasmtime
    }

    /// The compile cache, if enabled.
    pub fn cache(&self) -> Option<&Cache> {
        self.inner.cache.as_ref()
    }

    /// The instance slots invokes reserve from.
    pub(crate) fn slots(&self) -> &Arc<Semaphore> {
        &self.inner.slots
    }

    /// Compiles a component in a child process under the engine's compile
    /// limits.
    pub(crate) fn compile(&self, bytes: &[u8]) -> Result<Component, CompileError> {
        let inner = &self.inner;
        crate::compile::compile(
            &inner.wasmtime,
            bytes,
            inner.compile_memory_mib,
            inner.compile_timeout,
        )
    }

    /// How long an invoke may wait for instances.
    pub(crate) fn queue_timeout(&self) -> Duration {
        self.inner.queue_timeout
    }

    /// The instance slots in all.
    pub(crate) fn slot_count(&self) -> u32 {
        self.inner.slot_count
    }

    /// Fresh instances each `invoke` filter keeps prepared.
    pub(crate) fn prepared(&self) -> usize {
        self.inner.prepared
    }

    /// Takes room for one more ready instance in the idle budget; `false`
    /// when it is full.
    pub(crate) fn reserve_idle(&self) -> bool {
        let inner = &self.inner;
        inner
            .idle
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < inner.idle_cap).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives back the room of `count` ready instances (taken for a call, or
    /// dropped).
    pub(crate) fn release_idle(&self, count: usize) {
        self.inner.idle.fetch_sub(count, Ordering::Relaxed);
    }

    /// Whether `other` is this same engine (not a copy of its config).
    pub(crate) fn same(&self, other: &Engine) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Advances the engine's epoch every `tick` until the engine is dropped.
fn spawn_ticker(
    engine: wasmtime::Engine,
    tick: Duration,
    stop: Arc<AtomicBool>,
) -> Result<(), EngineError> {
    std::thread::Builder::new()
        .name("shallot-epoch".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                std::thread::sleep(tick);
                engine.increment_epoch();
            }
        })
        .map_err(EngineError::Ticker)?;
    Ok(())
}
