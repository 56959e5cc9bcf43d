//! The sandbox around one filter instance: its limits, its grants, the
//! store it runs in, and how a fault inside it becomes a typed error.
//!
//! Every instance gets its own `Store`, so a trap, a blown CPU budget or a
//! memory cap poisons that store only; the caller discards the instance and
//! the next call gets a fresh one. Nothing is granted by default: no
//! filesystem, network, environment variables, or clock (a frozen clock
//! reads zero), only the `shallot:filter` imports and a random source.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use wasmtime::{ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder};

use crate::error::{ChainError, ErrorKind, Origin};
use crate::plugin::host::HostState;

/// Resource limits of one filter. Every hook call is bounded by all three.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Linear memory cap per instance, in MiB. Growing past it traps.
    pub memory_mib: u32,
    /// CPU budget per hook call, in milliseconds: time the filter's own code
    /// runs, not counting inner layers. Counted in epoch ticks, so it is
    /// exact to one tick (10 ms by default).
    pub cpu_ms: u32,
    /// Wall-clock bound per hook call, in milliseconds, inner layers
    /// included; 0 (the default) means none. The filter's own code is
    /// already bounded by `cpu_ms` and inner layers bound themselves (model
    /// and tool timeouts), so this is a policy knob, e.g. a latency budget
    /// for everything inside a layer. It arms a timer on every call.
    pub timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mib: 64,
            cpu_ms: 100,
            timeout_ms: 0,
        }
    }
}

impl Limits {
    /// The wall-clock bound, if any.
    pub fn timeout(&self) -> Option<Duration> {
        (self.timeout_ms > 0).then(|| Duration::from_millis(self.timeout_ms))
    }
}

/// Capabilities an operator grants a filter beyond the default nothing.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Grants {
    /// Real wall and monotonic clocks (otherwise both read zero).
    pub clock: bool,
}

/// How many bytes of a faulting guest's stderr (a panic message) are kept.
const STDERR_CAPACITY: usize = 4096;

/// A store's own accounting of the CPU its current call used.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    /// Ticks seen while the guest was running.
    ticks: u32,
    /// Ticks allowed per call.
    budget: u32,
    /// The guest just came back from `next`: the tick that fires first
    /// measured time spent in inner layers, not here.
    resumed: bool,
}

impl Meter {
    pub(crate) fn start(&mut self, budget: u32) {
        *self = Meter {
            ticks: 0,
            budget,
            resumed: false,
        };
    }

    pub(crate) fn resumed_from_next(&mut self) {
        self.resumed = true;
    }
}

/// The CPU budget ran out; carried through wasmtime as the trap's cause.
#[derive(Debug)]
pub(crate) struct CpuExceeded;

impl std::fmt::Display for CpuExceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CPU budget exceeded")
    }
}

impl std::error::Error for CpuExceeded {}

/// The parts of a store's data that belong to the sandbox.
pub(crate) struct Confinement {
    pub wasi: WasiCtx,
    pub limits: StoreLimits,
    pub meter: Meter,
    pub stderr: MemoryOutputPipe,
}

impl Confinement {
    pub(crate) fn new(limits: &Limits, grants: &Grants) -> Self {
        let stderr = MemoryOutputPipe::new(STDERR_CAPACITY);
        let mut wasi = WasiCtxBuilder::new();
        wasi.stderr(stderr.clone());
        if !grants.clock {
            wasi.wall_clock(FrozenClock).monotonic_clock(FrozenClock);
        }
        Confinement {
            wasi: wasi.build(),
            limits: StoreLimitsBuilder::new()
                .memory_size(limits.memory_mib as usize * 1024 * 1024)
                .trap_on_grow_failure(true)
                .build(),
            meter: Meter::default(),
            stderr,
        }
    }

    /// What the guest wrote to stderr, trimmed, for an error message.
    fn stderr_text(&self) -> Option<String> {
        let bytes = self.stderr.contents();
        let text = String::from_utf8_lossy(&bytes).trim().to_owned();
        (!text.is_empty()).then_some(text)
    }
}

/// A clock that always reads zero: the default for filters without the
/// `clock` grant, so they cannot time or fingerprint anything.
struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// Sets up a fresh store: memory cap and CPU metering. The epoch deadline
/// is armed here, before instantiation, because a zero deadline would trap
/// the instantiation itself.
pub(crate) fn prepare_store(store: &mut Store<HostState>, budget_ticks: u32) {
    store.limiter(|state| &mut state.confinement.limits as &mut dyn ResourceLimiter);
    store.epoch_deadline_callback(|mut cx| {
        let meter = &mut cx.data_mut().confinement.meter;
        if std::mem::take(&mut meter.resumed) {
            return Ok(UpdateDeadline::Yield(1));
        }
        meter.ticks += 1;
        if meter.ticks > meter.budget {
            return Err(wasmtime::Error::new(CpuExceeded));
        }
        // Yield every tick so a busy filter never holds an executor thread
        // that other requests need.
        Ok(UpdateDeadline::Yield(1))
    });
    arm(store, budget_ticks);
}

/// Starts metering a new call.
pub(crate) fn arm(store: &mut Store<HostState>, budget_ticks: u32) {
    store.data_mut().confinement.meter.start(budget_ticks);
    store.set_epoch_deadline(1);
}

/// The CPU budget in epoch ticks: rounded up, plus one for the tick that
/// was already under way when the call started.
pub(crate) fn budget_ticks(limits: &Limits, tick: Duration) -> u32 {
    let tick_ms = tick.as_millis().max(1) as u32;
    limits.cpu_ms.div_ceil(tick_ms) + 1
}

/// Turns a wasmtime error from a call into the guest into a typed error:
/// a trap, the CPU budget, the memory cap, or a contract violation.
pub(crate) fn fault(
    error: wasmtime::Error,
    state: &HostState,
    limits: &Limits,
    origin: Origin,
) -> ChainError {
    let message = if error.downcast_ref::<CpuExceeded>().is_some() {
        format!("exceeded its CPU budget of {} ms", limits.cpu_ms)
    } else if format!("{error:#}").contains("forcing trap when growing memory") {
        format!("exceeded its memory cap of {} MiB", limits.memory_mib)
    } else if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
        format!("trapped: {trap}")
    } else {
        format!("failed: {error:#}")
    };
    let message = match state.confinement.stderr_text() {
        Some(said) => format!("{message}; it wrote: {said}"),
        None => message,
    };
    ChainError::new(ErrorKind::PluginFault, message).at(origin)
}

/// The error for a hook call that outlived its wall-clock bound.
pub(crate) fn timed_out(limits: &Limits, origin: Origin) -> ChainError {
    ChainError::new(
        ErrorKind::Timeout,
        format!("did not finish within {} ms", limits.timeout_ms),
    )
    .at(origin)
}
