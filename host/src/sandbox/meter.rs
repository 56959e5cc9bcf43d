//! The meter: a call's own CPU and wall time, stopped while the guest is
//! inside `next` (or a host service's wait), checked every epoch tick.
//!
//! Its CPU time is what the guest ran: the polling thread's own CPU clock
//! (`CLOCK_THREAD_CPUTIME_ID`) over each stretch the guest runs (a
//! stretch lies within one poll, so on one thread), not the time between
//! its ends, so a filter is not charged for the time the operating system
//! gave its core to other work, however busy the host. Its wall time also
//! stops while a request the guest sent is in flight ([`Meter::wait`]),
//! whatever the guest blocks on meanwhile.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::fault::{CpuExceeded, WallExceeded};
use super::limits::Limits;

/// How long a reading of a thread's CPU clock stands: a later reading
/// within this much wall time is the earlier one plus the wall time since
/// (the thread counted as running all of it). Reading the clock is a
/// system call (~0.2 µs), and a layer has four ends of stretches, most
/// within a microsecond of another; so the clock is read at most once in
/// this much of a thread's time, and a filter is charged at most this
/// much of another's time per reading (a preemption lasts longer: a
/// reading after one is fresh).
const FRESH: Duration = Duration::from_micros(20);

thread_local! {
    /// This thread's last reading of its CPU clock, and when it was taken.
    static READ: Cell<Option<(Instant, Duration)>> = const { Cell::new(None) };
}

/// The CPU time the calling thread has run, at `now`: read afresh, or
/// within [`FRESH`] of the last reading.
fn thread_cpu(now: Instant) -> Duration {
    READ.with(|read| {
        if let Some((at, cpu)) = read.get()
            && let Some(since) = now.checked_duration_since(at)
            && since < FRESH
        {
            return cpu + since;
        }
        let clock = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        let cpu = Duration::new(
            u64::try_from(clock.tv_sec).unwrap_or(0),
            u32::try_from(clock.tv_nsec).unwrap_or(0),
        );
        read.set(Some((now, cpu)));
        cpu
    })
}

/// The clocks of the call in progress.
#[derive(Debug)]
struct Clock {
    /// Own CPU time of the finished segments.
    cpu: Duration,
    /// Own wall time of the finished segments outside `next`.
    wall: Duration,
    /// The polling thread's CPU clock when the segment the guest is
    /// running now (polled, not in next) started.
    running: Option<Duration>,
    /// Start of the segment of own wall time; `None` while in `next` or
    /// while a wait is open.
    outside: Option<Instant>,
    /// Whether the guest is inside `next`.
    in_next: bool,
    /// Waits open in this call ([`Meter::wait`]).
    waits: u32,
    /// Which call this is, so that a wait opened in an earlier call and
    /// closed in this one changes nothing.
    call: u64,
    /// The call's future, suspended with no own wall time running: woken
    /// when the last wait closes, to set its alarm again.
    parked: Option<Waker>,
    /// When the host made the guest yield (every epoch tick, for
    /// fairness): time until it is polled again is not the filter's.
    yielded: Option<Instant>,
    cpu_budget: Duration,
    wall_budget: Duration,
}

impl Clock {
    /// Own CPU time so far; `now` is read on the thread running the
    /// segment, if one runs.
    fn cpu_at(&self, now: Instant) -> Duration {
        match self.running {
            Some(since) => self.cpu + thread_cpu(now).saturating_sub(since),
            None => self.cpu,
        }
    }

    fn wall_left(&self, now: Instant) -> Option<Duration> {
        let outside = self.outside?;
        Some(self.wall_budget.saturating_sub(self.wall + (now - outside)))
    }

    fn pause(&mut self, now: Instant) {
        if let Some(since) = self.running.take() {
            self.cpu += thread_cpu(now).saturating_sub(since);
        }
    }

    /// Ends the segment of own wall time, if one runs.
    fn stop_wall(&mut self, now: Instant) {
        if let Some(outside) = self.outside.take() {
            self.wall += now - outside;
        }
    }

    /// Starts a segment of own wall time, unless the guest is in `next`
    /// or waits.
    fn start_wall(&mut self, now: Instant) {
        if !self.in_next && self.waits == 0 {
            self.outside = Some(now);
        }
    }
}

/// An open wait of the guest's (a request in flight): while any is open
/// in a call, the call's wall time is not the guest's own. Closed when
/// dropped.
#[derive(Debug)]
pub(crate) struct Wait {
    meter: Meter,
    call: u64,
}

impl Drop for Wait {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut clock = self.meter.lock();
        if clock.call != self.call {
            return;
        }
        clock.waits -= 1;
        clock.start_wall(now);
        if clock.outside.is_some()
            && let Some(parked) = clock.parked.take()
        {
            parked.wake();
        }
    }
}

/// Times the calls into one instance. Shared by the store's epoch
/// callback, the [`Metered`] future of the call, and the host's `next`.
#[derive(Debug, Clone)]
pub(crate) struct Meter(Arc<Mutex<Clock>>);

impl Meter {
    pub(super) fn new() -> Self {
        Meter(Arc::new(Mutex::new(Clock {
            cpu: Duration::ZERO,
            wall: Duration::ZERO,
            running: None,
            outside: None,
            in_next: false,
            waits: 0,
            call: 0,
            parked: None,
            yielded: None,
            cpu_budget: Duration::ZERO,
            wall_budget: Duration::ZERO,
        })))
    }

    fn lock(&self) -> MutexGuard<'_, Clock> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Starts timing a new call under `limits`.
    pub(super) fn start(&self, limits: &Limits) {
        let mut clock = self.lock();
        let call = clock.call + 1;
        *clock = Clock {
            cpu: Duration::ZERO,
            wall: Duration::ZERO,
            running: None,
            outside: Some(Instant::now()),
            in_next: false,
            waits: 0,
            call,
            parked: None,
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
        clock.stop_wall(now);
        clock.in_next = true;
    }

    /// `next` returned to the guest, which runs on in the same poll.
    pub(crate) fn leave_next(&self) {
        let now = Instant::now();
        let mut clock = self.lock();
        clock.in_next = false;
        clock.start_wall(now);
        clock.running = Some(thread_cpu(now));
    }

    /// Opens a wait: the call's wall time stops until the [`Wait`] is
    /// dropped (its CPU time runs on whenever the guest does).
    pub(crate) fn wait(&self) -> Wait {
        let now = Instant::now();
        let mut clock = self.lock();
        clock.stop_wall(now);
        clock.waits += 1;
        Wait {
            meter: self.clone(),
            call: clock.call,
        }
    }

    /// The epoch callback's check, at every tick the guest runs through;
    /// the guest yields after it.
    pub(super) fn check(&self) -> wasmtime::Result<()> {
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
        if !clock.in_next {
            clock.running = Some(thread_cpu(now));
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
            let left = clock.wall_left(now);
            if left.is_none() && clock.waits > 0 && polled.is_pending() {
                clock.parked = Some(cx.waker().clone());
            }
            left
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

/// Times `call`, a call into the guest whose store `meter` belongs to.
/// Arm the store first.
pub(crate) fn metered<F>(meter: Meter, call: F) -> Metered<F> {
    Metered {
        call,
        meter,
        alarm: None,
    }
}
