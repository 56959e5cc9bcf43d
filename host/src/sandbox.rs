//! The sandbox around one filter instance: its limits, its grants, the
//! meter that times every call into it, and how a fault inside it becomes a
//! typed error.
//!
//! Every instance gets its own `Store`, so a trap, a blown budget or a cap
//! poisons that store only; the caller discards the instance and the next
//! call gets a fresh one. Nothing is granted by default: no filesystem,
//! network, environment variables, or clock (a frozen clock reads zero),
//! only the `shallot:filter` imports and a random source.
//!
//! The sandbox works on any store data that gives it its `Confinement`
//! (the `Sandboxed` trait); it knows nothing of the filter contract.
//!
//! How a call is timed: `Metered` wraps the future of every call into a
//! guest. While that future is being polled and the guest is not inside
//! `next` (the inner layers), the guest's own CPU clock runs; the host
//! brackets every `next` with `Meter::enter_next` and
//! `Meter::leave_next`. The epoch callback checks the clock every tick,
//! so the CPU budget holds to within one tick however a filter interleaves
//! its own work with `next`, and time the host spends in calls the filter
//! makes counts as the filter's. The wall clock runs whenever the guest is
//! outside `next`, suspended or not (except while it waits to run again
//! after the host made it yield), so a filter that sleeps or waits on a
//! WASI pollable is bounded too.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wasmtime::{ResourceLimiter, Store, UpdateDeadline};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxBuilder};

use crate::escape::{TEXT_CAP, printable};
use crate::types::{ChainError, ErrorKind, Origin};

/// Resource limits of one filter. Every call into it is bounded by all of
/// them; docs/SECURITY.md says what each counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Linear memory cap per instance (all its memories together), in MiB.
    /// Growing past it faults.
    pub memory_mib: u32,
    /// Host memory a filter may hold per invoke, in MiB: the requests,
    /// responses and messages it creates or changes, the responses `next`
    /// hands it, its FCtx and its writes to the shared context. Going past
    /// it faults.
    pub host_mib: u32,
    /// CPU budget per call, in milliseconds: the time the filter's own code
    /// (and the host functions it calls) runs, not counting inner layers or
    /// time it is suspended. Checked every epoch tick (10 ms by default).
    pub cpu_ms: u32,
    /// Wall-clock bound per call, in milliseconds, on the filter's own
    /// time: everything outside `next`, including time it sleeps or waits.
    /// Always on.
    pub wall_ms: u32,
    /// Wall-clock bound per hook call in milliseconds, inner layers
    /// included; 0 (the default) means none. A policy knob, e.g. a latency
    /// budget for everything inside a layer.
    pub timeout_ms: u64,
    /// Calls through `next` one hook call may make (retries need a few).
    /// One more returns a `limit-exceeded` error to the filter.
    pub next_calls: u32,
    /// Instances of this filter in use at once across all invokes, so one
    /// slow filter cannot take every instance slot of the engine.
    pub instances: u32,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mib: 64,
            host_mib: 64,
            cpu_ms: 100,
            wall_ms: 1000,
            timeout_ms: 0,
            next_calls: 16,
            instances: 256,
        }
    }
}

impl Limits {
    /// The wall-clock bound with inner layers, if any.
    pub fn timeout(&self) -> Option<Duration> {
        (self.timeout_ms > 0).then(|| Duration::from_millis(self.timeout_ms))
    }

    /// Host memory a filter may hold per invoke, in bytes.
    pub(crate) fn host_bytes(&self) -> usize {
        (self.host_mib as usize) << 20
    }

    /// Checks every limit is usable; the message names the bad one.
    pub(crate) fn check(&self, max_memory_mib: u32) -> Result<(), String> {
        if self.memory_mib == 0 || self.memory_mib > max_memory_mib {
            return Err(format!("memory_mib must be 1..={max_memory_mib}"));
        }
        if self.host_mib == 0 || self.host_mib > max_memory_mib {
            return Err(format!("host_mib must be 1..={max_memory_mib}"));
        }
        for (name, value) in [
            ("cpu_ms", self.cpu_ms),
            ("wall_ms", self.wall_ms),
            ("next_calls", self.next_calls),
            ("instances", self.instances),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1"));
            }
        }
        Ok(())
    }
}

/// Capabilities an operator grants a filter beyond the default nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Grants {
    /// Real wall and monotonic clocks (otherwise both read zero).
    pub clock: bool,
    /// Milliseconds one hook call may sleep through the `timer` import, in
    /// all (0, the default: none).
    pub sleep_ms: u32,
    /// Whether the filter may ask the host's approval handler (the
    /// `approval` import).
    pub approval: bool,
    /// Where the filter's `trace` events go: `"stderr"`, or a file that
    /// is appended to (created if missing). `None`: no tracing.
    pub trace: Option<String>,
    /// The conversation store of the `memory` import: a SQLite file's
    /// path, a `redis://` URL, or `:memory:` (this process only;
    /// `:memory:<name>` for another one). `None`: no store.
    pub memory: Option<String>,
}

/// How many bytes of a guest's stderr one call keeps (for a panic message).
const STDERR_CAPACITY: usize = 4096;
/// Elements all tables of an instance may hold together.
const TABLE_ELEMENTS: usize = 1 << 20;
/// Handles (host resources, WASI streams and pollables) an instance may
/// hold at once.
pub(crate) const HANDLES: usize = 1 << 16;

/// Store data the sandbox can confine.
pub(crate) trait Sandboxed: Send + 'static {
    fn confinement(&mut self) -> &mut Confinement;
}

/// The filter's own CPU budget for one call ran out.
#[derive(Debug)]
pub(crate) struct CpuExceeded;

/// The filter's own wall-clock bound for one call ran out.
#[derive(Debug)]
pub(crate) struct WallExceeded;

/// The filter's tables grew past their cap.
#[derive(Debug)]
pub(crate) struct TablesExceeded;

/// The filter made the host hold more than its host memory cap.
#[derive(Debug)]
pub(crate) struct HostMemoryExceeded;

macro_rules! signals {
    ($($ty:ident => $text:literal),* $(,)?) => {$(
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($text)
            }
        }
        impl std::error::Error for $ty {}
    )*};
}

signals! {
    CpuExceeded => "CPU budget exceeded",
    WallExceeded => "wall-clock bound exceeded",
    TablesExceeded => "table cap exceeded",
    HostMemoryExceeded => "host memory cap exceeded",
}

/// The clocks of the call in progress.
#[derive(Debug)]
struct Clock {
    /// Own running time of the finished segments.
    cpu: Duration,
    /// Own wall time of the finished segments outside `next`.
    wall: Duration,
    /// Start of the segment the guest is running now (polled, not in next).
    running: Option<Instant>,
    /// Start of the segment outside `next`; `None` while in `next`.
    outside: Option<Instant>,
    /// When the host made the guest yield (every epoch tick, for
    /// fairness): time until it is polled again is not the filter's.
    yielded: Option<Instant>,
    cpu_budget: Duration,
    wall_budget: Duration,
}

impl Clock {
    fn cpu_at(&self, now: Instant) -> Duration {
        self.cpu + self.running.map_or(Duration::ZERO, |since| now - since)
    }

    fn wall_left(&self, now: Instant) -> Option<Duration> {
        let outside = self.outside?;
        Some(self.wall_budget.saturating_sub(self.wall + (now - outside)))
    }

    fn pause(&mut self, now: Instant) {
        if let Some(since) = self.running.take() {
            self.cpu += now - since;
        }
    }
}

/// Times the calls into one instance. Shared by the store's epoch
/// callback, the [`Metered`] future of the call, and the host's `next`.
#[derive(Debug, Clone)]
pub(crate) struct Meter(Arc<Mutex<Clock>>);

impl Meter {
    fn new() -> Self {
        Meter(Arc::new(Mutex::new(Clock {
            cpu: Duration::ZERO,
            wall: Duration::ZERO,
            running: None,
            outside: None,
            yielded: None,
            cpu_budget: Duration::ZERO,
            wall_budget: Duration::ZERO,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Clock> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts timing a new call under `limits`.
    fn start(&self, limits: &Limits) {
        *self.lock() = Clock {
            cpu: Duration::ZERO,
            wall: Duration::ZERO,
            running: None,
            outside: Some(Instant::now()),
            yielded: None,
            cpu_budget: Duration::from_millis(limits.cpu_ms.into()),
            wall_budget: Duration::from_millis(limits.wall_ms.into()),
        };
    }

    /// The guest's own CPU time in the call so far.
    pub(crate) fn spent(&self) -> Duration {
        self.lock().cpu_at(Instant::now())
    }

    /// The guest calls `next`: its clocks stop while inner layers run.
    pub(crate) fn enter_next(&self) {
        let now = Instant::now();
        let mut clock = self.lock();
        clock.pause(now);
        if let Some(outside) = clock.outside.take() {
            clock.wall += now - outside;
        }
    }

    /// `next` returned to the guest, which runs on in the same poll.
    pub(crate) fn leave_next(&self) {
        let now = Instant::now();
        let mut clock = self.lock();
        clock.outside = Some(now);
        clock.running = Some(now);
    }

    /// The epoch callback's check, at every tick the guest runs through;
    /// the guest yields after it.
    fn check(&self) -> wasmtime::Result<()> {
        let now = Instant::now();
        let mut clock = self.lock();
        if clock.cpu_at(now) > clock.cpu_budget {
            return Err(wasmtime::Error::new(CpuExceeded));
        }
        if clock.wall_left(now) == Some(Duration::ZERO) {
            return Err(wasmtime::Error::new(WallExceeded));
        }
        clock.yielded = Some(now);
        Ok(())
    }

    /// A poll of the call starts: the guest's clocks run again, and the
    /// time it waited to be polled after a forced yield is not its own.
    fn resume(&self) {
        let now = Instant::now();
        let mut clock = self.lock();
        if let Some(yielded) = clock.yielded.take()
            && let Some(outside) = clock.outside
        {
            clock.outside = Some(outside + (now - yielded));
        }
        if clock.outside.is_some() {
            clock.running = Some(now);
        }
    }
}

pin_project_lite::pin_project! {
    /// A call into a guest, timed by its instance's [`Meter`]: its own CPU
    /// time while polled outside `next`, and its own wall time, which ends
    /// the call with [`WallExceeded`] when it runs out (the guest is
    /// suspended then, e.g. sleeping, so no epoch tick would catch it).
    pub(crate) struct Metered<F> {
        #[pin]
        call: F,
        meter: Meter,
        alarm: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<F, T> Future for Metered<F>
where
    F: Future<Output = wasmtime::Result<T>>,
{
    type Output = wasmtime::Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        this.meter.resume();
        let polled = this.call.poll(cx);
        let now = Instant::now();
        let left = {
            let mut clock = this.meter.lock();
            clock.pause(now);
            clock.wall_left(now)
        };
        if polled.is_ready() {
            return polled;
        }
        // Suspended outside `next`: wake up when the own wall time ends.
        match left {
            None => Poll::Pending,
            Some(left) if left.is_zero() => Poll::Ready(Err(wasmtime::Error::new(WallExceeded))),
            Some(left) => {
                let deadline = tokio::time::Instant::from_std(now + left);
                let alarm = this
                    .alarm
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                alarm.as_mut().reset(deadline);
                match alarm.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(wasmtime::Error::new(WallExceeded))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

/// Linear memory and table caps of one instance. Growing memory past the
/// cap fails the way wasm says it may (`memory.grow` returns -1), so a
/// runtime with a garbage collector (JavaScript's) collects and goes on;
/// a guest that cannot go on traps, and `denied` makes that trap a
/// memory-cap fault.
struct Limiter {
    memory_cap: usize,
    memory: usize,
    table_elements: usize,
    /// A growth was refused during the current call.
    denied: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.memory - current.min(self.memory) + desired;
        if total > self.memory_cap {
            self.denied = true;
            return Ok(false);
        }
        self.memory = total;
        Ok(true)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let total = self.table_elements - current.min(self.table_elements) + desired;
        if total > TABLE_ELEMENTS {
            return Err(wasmtime::Error::new(TablesExceeded));
        }
        self.table_elements = total;
        Ok(true)
    }
}

/// A guest's stderr, captured per call: cleared when a call starts, read
/// when it faults, never more than [`STDERR_CAPACITY`] bytes (the rest is
/// dropped, so writing can never fail or block).
#[derive(Clone, Default)]
pub(crate) struct Stderr(Arc<Mutex<Vec<u8>>>);

impl Stderr {
    fn lock(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, bytes: &[u8]) {
        let mut buffer = self.lock();
        let room = STDERR_CAPACITY.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn clear(&self) {
        self.lock().clear();
    }

    /// What the guest wrote in this call, trimmed and made printable.
    fn text(&self) -> Option<String> {
        let bytes = self.lock();
        let text = String::from_utf8_lossy(&bytes);
        let text = text.trim();
        (!text.is_empty()).then(|| printable(text, TEXT_CAP))
    }
}

impl IsTerminal for Stderr {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Stderr {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl OutputStream for Stderr {
    fn write(&mut self, bytes: bytes::Bytes) -> StreamResult<()> {
        self.append(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(STDERR_CAPACITY)
    }
}

#[async_trait::async_trait]
impl Pollable for Stderr {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Stderr {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.append(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The parts of a store's data that belong to the sandbox.
pub(crate) struct Confinement {
    pub wasi: WasiCtx,
    limiter: Limiter,
    meter: Meter,
    stderr: Stderr,
}

impl Confinement {
    pub(crate) fn new(limits: &Limits, grants: &Grants) -> Self {
        let stderr = Stderr::default();
        let mut wasi = WasiCtxBuilder::new();
        wasi.stderr(stderr.clone());
        if !grants.clock {
            wasi.wall_clock(FrozenClock).monotonic_clock(FrozenClock);
        }
        Confinement {
            wasi: wasi.build(),
            limiter: Limiter {
                memory_cap: (limits.memory_mib as usize) << 20,
                memory: 0,
                table_elements: 0,
                denied: false,
            },
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

/// Times `call`, a call into the guest whose store `meter` belongs to.
/// Arm the store first.
pub(crate) fn metered<F>(meter: Meter, call: F) -> Metered<F> {
    Metered {
        call,
        meter,
        alarm: None,
    }
}

/// Turns a wasmtime error from a call into the guest into a typed error:
/// a budget or a cap (by its typed signal), a trap, or a contract
/// violation. What the guest wrote to stderr in this call is appended.
pub(crate) fn fault(
    error: wasmtime::Error,
    confinement: &Confinement,
    limits: &Limits,
    origin: Origin,
) -> ChainError {
    let (kind, message) = if error.is::<CpuExceeded>() {
        let message = format!("exceeded its CPU budget of {} ms", limits.cpu_ms);
        (ErrorKind::PluginFault, message)
    } else if error.is::<WallExceeded>() {
        let message = format!(
            "did not finish within its own wall-clock bound of {} ms (it slept or waited)",
            limits.wall_ms
        );
        (ErrorKind::Timeout, message)
    } else if confinement.limiter.denied {
        let message = format!("exceeded its memory cap of {} MiB", limits.memory_mib);
        (ErrorKind::PluginFault, message)
    } else if error.is::<HostMemoryExceeded>() {
        let message = format!("exceeded its host memory cap of {} MiB", limits.host_mib);
        (ErrorKind::PluginFault, message)
    } else if error.is::<TablesExceeded>() {
        let message = format!("grew its tables past {TABLE_ELEMENTS} elements");
        (ErrorKind::PluginFault, message)
    } else if matches!(
        error.downcast_ref::<wasmtime::component::ResourceTableError>(),
        Some(wasmtime::component::ResourceTableError::Full)
    ) {
        let message = format!("held more than {HANDLES} handles at once");
        (ErrorKind::PluginFault, message)
    } else if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
        (ErrorKind::PluginFault, format!("trapped: {trap}"))
    } else {
        let message = format!(
            "failed: {}",
            printable(&error.root_cause().to_string(), TEXT_CAP)
        );
        (ErrorKind::PluginFault, message)
    };
    // What the guest wrote is the operator's to read, not a client's or
    // another filter's; where it trapped, only the log's.
    if let Some(trace) = error.downcast_ref::<wasmtime::WasmBacktrace>() {
        tracing::debug!(filter = &*origin.filter, "{message}: {trace}");
    }
    let detail = confinement
        .stderr
        .text()
        .map(|said| format!("it wrote: {said}"));
    ChainError {
        detail,
        ..ChainError::new(kind, message).at(origin)
    }
}

/// The error for a hook call that outlived its `timeout_ms`.
pub(crate) fn timed_out(limits: &Limits, origin: Origin) -> ChainError {
    ChainError::new(
        ErrorKind::Timeout,
        format!("did not finish within {} ms", limits.timeout_ms),
    )
    .at(origin)
}
