//! `timer.sleep` (`grants.sleep_ms`): a filter's backoff, in hooks, token
//! steps and flushes (never while the instance is made). At most the
//! granted milliseconds in all per hook call, each sleep counting at least
//! one, and at most [`SLEEPS_PER_CALL`] sleeps (a loop of `sleep(0)` costs
//! the host a wake-up each time). Asleep, the filter holds its instance
//! but not its own wall clock, as in `next`.

use std::time::Duration;

use super::HostState;
use super::service::{GrantedServices, HOOKS, Service, Spent, error};
use crate::plugin::bindings::shallot::filter::timer;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::types::Call;

/// Sleeps one call may make, each counting at least a millisecond of the
/// grant.
const SLEEPS_PER_CALL: u32 = 64;

/// The `timer` service: its grant is the milliseconds a hook call may
/// sleep in all.
pub(crate) struct Timer;

/// What a call slept: milliseconds, and sleeps.
#[derive(Default)]
pub(crate) struct Slept {
    ms: u32,
    sleeps: u32,
}

impl Service for Timer {
    const IMPORT: &'static str = "timer";
    const CALLED: &'static str = "timer.sleep";
    const CALLS: &'static [Call] = HOOKS;
    const GRANT: &'static str = "sleep_ms = 30000";
    type Granted = u32;
    type Spent = Slept;

    fn granted(services: &GrantedServices) -> Option<&u32> {
        services.timer.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut Slept {
        &mut spent.timer
    }
}

/// What `grants.sleep_ms` opens: nothing when it is 0.
pub(super) fn open(sleep_ms: u32) -> Option<u32> {
    (sleep_ms > 0).then_some(sleep_ms)
}

impl timer::Host for HostState {
    async fn sleep(&mut self, ms: u32) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let granted = match self.admit::<Timer>() {
            Ok(granted) => granted,
            Err(refused) => return Ok(Err(refused)),
        };
        let slept = self.spent::<Timer>();
        slept.sleeps += 1;
        if slept.sleeps > SLEEPS_PER_CALL {
            let message = format!("more than {SLEEPS_PER_CALL} sleeps in one call");
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let total = slept.ms.saturating_add(ms.max(1));
        if total > granted {
            let message = format!(
                "sleeping {ms} ms more would take this hook call to {total} ms, past its grant of {granted} ms"
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        slept.ms = total;
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        tokio::time::sleep(Duration::from_millis(ms.into())).await;
        meter.leave_next();
        Ok(Ok(()))
    }
}
