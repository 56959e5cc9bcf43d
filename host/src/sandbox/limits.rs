//! The per-filter limits every call into it runs under.

use std::time::Duration;

use serde::{Deserialize, Serialize};

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
    /// CPU budget per call, in milliseconds: the CPU the filter's own code
    /// (and the host functions it calls) runs, not counting inner layers or
    /// time it is suspended. Counted on the running thread's own CPU clock,
    /// so time its core spends on other work (a busy host) is not the
    /// filter's. Checked every epoch tick (10 ms by default).
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
