//! The sandbox around one filter instance: its limits, the meter that
//! times every call into it, and how a fault inside it becomes a typed
//! error.
//!
//! Every instance gets its own `Store`, so a trap, a blown budget or a cap
//! poisons that store only; the caller discards the instance and the next
//! call gets a fresh one. Nothing is granted by default: no filesystem,
//! network, environment variables, or clock (a frozen clock reads zero),
//! only the `shallot:filter` imports and a random source.
//!
//! The sandbox works on any store data that gives it its `Confinement`
//! (the `Sandboxed` trait); it knows nothing of the filter contract (what
//! a filter is granted is the plugin layer's `Grants`).
//!
//! One file per part: `limits` (what a filter may use), `meter` (its own
//! CPU and wall time per call), `limiter` (linear memory and tables),
//! `stderr` (captured per call), `clock` (the frozen clocks), `fault`
//! (the typed signals, and the errors made of them).
//!
//! How a call is timed: `Metered` wraps the future of every call into a
//! guest. While that future is being polled and the guest is not inside
//! `next` (the inner layers), the guest's own CPU clock runs: the CPU the
//! polling thread runs, not the time that passes (a busy host's cores
//! taken by other work are not the filter's time); the host brackets
//! every `next` with `Meter::enter_next` and `Meter::leave_next`. The epoch callback checks the clock every tick,
//! so the CPU budget holds to within one tick however a filter interleaves
//! its own work with `next`, and time the host spends in calls the filter
//! makes counts as the filter's. The wall clock runs whenever the guest is
//! outside `next`, suspended or not (except while it waits to run again
//! after the host made it yield), so a filter that sleeps or waits on a
//! WASI pollable is bounded too.

mod clock;
mod fault;
mod limiter;
mod limits;
mod meter;
mod stderr;

use wasmtime::{ResourceLimiter, Store, UpdateDeadline};
use wasmtime_wasi::{WasiCtx, WasiCtxBuilder};

use clock::FrozenClock;
use limiter::GrowthCaps;
use stderr::Stderr;

pub(crate) use fault::{HostMemoryExceeded, fault, timed_out};
pub use limits::Limits;
pub(crate) use meter::{Meter, Wait, metered};

/// Handles (host resources, WASI streams and pollables) an instance may
/// hold at once.
pub(crate) const HANDLES: usize = 1 << 16;

/// Store data the sandbox can confine.
pub(crate) trait Sandboxed: Send + 'static {
    fn confinement(&mut self) -> &mut Confinement;
}

/// The parts of a store's data that belong to the sandbox.
pub(crate) struct Confinement {
    pub wasi: WasiCtx,
    limiter: GrowthCaps,
    meter: Meter,
    stderr: Stderr,
}

impl Confinement {
    /// A confinement under `limits`, with the real clocks only when
    /// `real_clocks` (the operator's `clock` grant).
    pub(crate) fn new(limits: &Limits, real_clocks: bool) -> Self {
        let stderr = Stderr::default();
        let mut wasi = WasiCtxBuilder::new();
        wasi.stderr(stderr.clone());
        if !real_clocks {
            wasi.wall_clock(FrozenClock).monotonic_clock(FrozenClock);
        }
        Confinement {
            wasi: wasi.build(),
            limiter: GrowthCaps::new(limits.memory_mib),
            meter: Meter::new(),
            stderr,
        }
    }

    /// The meter of the instance's calls.
    pub(crate) fn meter(&self) -> &Meter {
        &self.meter
    }

    /// Bytes of linear memory the instance has.
    pub(crate) fn memory(&self) -> usize {
        self.limiter.memory
    }
}

/// Sets up a fresh store: memory and table caps, and the epoch callback
/// that checks the call's clocks every tick and yields, so a busy filter
/// never holds an executor thread that other requests need.
pub(crate) fn prepare_store<T: Sandboxed>(store: &mut Store<T>, limits: &Limits) {
    store.limiter(|state| &mut state.confinement().limiter as &mut dyn ResourceLimiter);
    store.epoch_deadline_callback(|mut cx| {
        cx.data_mut().confinement().meter.check()?;
        Ok(UpdateDeadline::Yield(1))
    });
    arm(store, limits);
}

/// Starts a new call: its clocks, its deadline and its stderr.
pub(crate) fn arm<T: Sandboxed>(store: &mut Store<T>, limits: &Limits) {
    let confinement = store.data_mut().confinement();
    confinement.meter.start(limits);
    confinement.stderr.clear();
    confinement.limiter.denied = false;
    store.set_epoch_deadline(1);
}
