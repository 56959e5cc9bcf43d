//! The clocks a filter sees without the `clock` grant.

use std::time::Duration;

use wasmtime_wasi::{HostMonotonicClock, HostWallClock};

/// A clock that always reads zero: the default for filters without the
/// `clock` grant, so they cannot time or fingerprint anything.
pub(super) struct FrozenClock;

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
