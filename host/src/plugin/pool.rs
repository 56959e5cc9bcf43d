//! Instance leases: which filter instances an invoke holds, and how it gets
//! more without ever failing for lack of one or entering one twice.
//!
//! A component instance must not be re-entered while it is on the stack,
//! and a filter's around-turn is on the stack while the tool loop runs that
//! same filter's around-chat. So an invoke holds one instance per nesting
//! level of each filter. On admission it reserves, from the engine's slot
//! semaphore and in one step, as many slots as its filters can nest
//! (`WasmFilter::need`); holding everything it needs up front, it can always
//! finish, so no set of invokes can deadlock waiting for each other.
//! Beyond that (concurrent tool calls through the same filter) a lease
//! borrows a spare slot if the pool has one, and otherwise waits for one of
//! its own instances to come back.
//!
//! An instance is taken for one hook call and returned after it; a faulted
//! or cancelled one is dropped and its slot reused by the next take.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::WasmFilter;
use super::instance::FilterInstance;
use crate::error::ChainError;
use crate::invoke::Invoke;

/// One invoke's instances of one filter.
#[derive(Default)]
pub(crate) struct Lease {
    /// Instances this invoke may create under its admission reservation.
    reserved: usize,
    state: Mutex<LeaseState>,
    returned: Notify,
}

#[derive(Default)]
struct LeaseState {
    idle: Vec<FilterInstance>,
    /// Instances in existence: idle or in a call.
    live: usize,
    /// Spare slots borrowed beyond the reservation.
    extra: Vec<OwnedSemaphorePermit>,
}

impl Lease {
    pub(crate) fn new(reserved: usize) -> Self {
        Lease {
            reserved,
            ..Default::default()
        }
    }

    fn lock(&self) -> MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The idle instances, for the filter to reclaim when the invoke ends.
    pub(crate) fn drain(&mut self) -> Vec<FilterInstance> {
        std::mem::take(&mut self.lock().idle)
    }

    async fn take(
        &self,
        filter: &Arc<WasmFilter>,
        slots: &Arc<Semaphore>,
    ) -> Result<FilterInstance, ChainError> {
        loop {
            let returned = self.returned.notified();
            match self.try_take(slots) {
                Take::Idle(instance) => return Ok(instance),
                Take::Create => break,
                Take::Wait => returned.await,
                Take::Queue => {
                    // Nothing reserved for this filter and nothing of ours
                    // will come back: wait for the pool like a new invoke.
                    let permit = slots
                        .clone()
                        .acquire_owned()
                        .await
                        .map_err(super::host::internal)?;
                    let mut state = self.lock();
                    state.extra.push(permit);
                    state.live += 1;
                    break;
                }
            }
        }
        // Boxed: instantiation is the cold path and its future is large;
        // inline, it would be moved through every hook call's future.
        Box::pin(filter.instantiate())
            .await
            .inspect_err(|_| self.lost())
    }

    fn try_take(&self, slots: &Arc<Semaphore>) -> Take {
        let mut state = self.lock();
        if let Some(instance) = state.idle.pop() {
            return Take::Idle(instance);
        }
        if state.live < self.reserved + state.extra.len() {
            state.live += 1;
            return Take::Create;
        }
        if let Ok(permit) = slots.clone().try_acquire_owned() {
            state.extra.push(permit);
            state.live += 1;
            return Take::Create;
        }
        if state.live == 0 {
            Take::Queue
        } else {
            Take::Wait
        }
    }

    fn give_back(&self, instance: FilterInstance) {
        self.lock().idle.push(instance);
        self.returned.notify_one();
    }

    fn lost(&self) {
        self.lock().live -= 1;
        self.returned.notify_one();
    }
}

enum Take {
    Idle(FilterInstance),
    Create,
    Wait,
    Queue,
}

/// An instance taken from an invoke's lease for one call. Dropped without
/// `release` (a fault, or the call was cancelled mid-way), the instance is
/// discarded rather than returned.
pub(crate) struct Leased {
    invoke: Arc<Invoke>,
    id: usize,
    instance: Option<FilterInstance>,
}

impl Leased {
    /// Takes an instance of filter `id` for `invoke`.
    pub(crate) async fn take(
        invoke: &Arc<Invoke>,
        id: usize,
        filter: &Arc<WasmFilter>,
    ) -> Result<Self, ChainError> {
        let instance = invoke.leases[id]
            .take(filter, &filter.engine().inner.slots)
            .await?;
        Ok(Leased {
            invoke: invoke.clone(),
            id,
            instance: Some(instance),
        })
    }

    pub(crate) fn invoke(&self) -> &Arc<Invoke> {
        &self.invoke
    }

    pub(crate) fn instance(&mut self) -> &mut FilterInstance {
        self.instance
            .as_mut()
            .expect("a Leased holds its instance until it is released")
    }

    /// The instance faulted: drop it now.
    pub(crate) fn poison(&mut self) {
        if self.instance.take().is_some() {
            self.invoke.leases[self.id].lost();
        }
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.instance.is_none()
    }

    /// The call went well: the instance goes back for reuse.
    pub(crate) fn release(mut self) {
        if let Some(instance) = self.instance.take() {
            self.invoke.leases[self.id].give_back(instance);
        }
    }
}

impl Drop for Leased {
    fn drop(&mut self) {
        if self.instance.take().is_some() {
            self.invoke.leases[self.id].lost();
        }
    }
}
