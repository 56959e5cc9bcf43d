//! Admission: how many filter instances an invoke may need, how it
//! reserves them before it starts, and how it takes them during its calls,
//! without deadlock, without starving other requests and without waiting
//! forever.
//!
//! A component instance must not be re-entered while it is on the stack,
//! and a filter's around-turn is on the stack while the tool loop runs that
//! same filter's around-chat. So an invoke holds one instance per nesting
//! level of each filter ([`need`]; the system-prompt hook runs before the
//! chains and needs one instance too). On admission it reserves them all:
//! first from each filter's own quota (`Limits::instances`), in one global
//! order of filters, then from the engine's slots, each in one step.
//! Holding everything it needs up front, an admitted invoke can always
//! finish, so invokes never wait for each other in a circle; a slow filter
//! can hold no more than its quota, so requests that do not use it still
//! find slots. Every wait is bounded by the engine's `queue_timeout`, after
//! which the invoke fails with an `overloaded` error.
//!
//! Beyond its reservation (concurrent tool calls through the same filter) a
//! lease borrows a spare slot if there is one, and otherwise waits for one
//! of its own instances to come back. An instance is taken for one call
//! and returned after it; a faulted or cancelled one is dropped and its
//! slot reused by the next take.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use super::{FilterInstance, WasmFilter};
use crate::onion::{ChainKind, Hook, Invoke};
use crate::types::{ChainError, ErrorKind, Origin};

/// Instances a filter with `hooks` may need at once in one invoke that
/// starts with chain `K`: one per level at which it can be on the stack.
/// An invoke that `shows` its answer runs the token transforms after its
/// chain, when the chain's instances are back.
pub(crate) fn need<K: ChainKind>(hooks: &[Hook], stream: bool, shows: bool) -> usize {
    let has = |hook| hooks.contains(&hook);
    let chains = K::depth(&has, stream).max((shows && has(Hook::TokenTransform)) as usize);
    // The system prompt is shaped before the chains run (for any but a
    // lone tool call), and its instance is back before they start.
    if K::HOOK == Hook::AroundTool {
        chains
    } else {
        chains.max(has(Hook::SystemPrompt) as usize)
    }
}

/// The error for a wait that outlived the engine's queue timeout.
fn overloaded(what: &str, timeout: Duration) -> ChainError {
    ChainError::new(
        ErrorKind::Overloaded,
        format!(
            "overloaded: {what} did not become free within {} ms",
            timeout.as_millis()
        ),
    )
    .at(Origin::terminal("engine"))
}

/// Waits for `count` permits of `semaphore`, at most `timeout`.
async fn acquire(
    semaphore: &Arc<Semaphore>,
    count: usize,
    timeout: Duration,
    what: impl FnOnce() -> String,
) -> Result<OwnedSemaphorePermit, ChainError> {
    let count = u32::try_from(count).unwrap_or(u32::MAX);
    match tokio::time::timeout(timeout, semaphore.clone().acquire_many_owned(count)).await {
        Ok(Ok(permit)) => Ok(permit),
        Ok(Err(closed)) => {
            Err(ChainError::new(ErrorKind::Internal, closed.to_string())
                .at(Origin::terminal("engine")))
        }
        Err(_) => Err(overloaded(&what(), timeout)),
    }
}

/// What an admitted invoke holds (its reservation, see `Invoke`): a lease
/// per filter, released when the invoke ends.
pub(crate) struct Admission {
    leases: Box<[Lease]>,
    _permits: Vec<OwnedSemaphorePermit>,
}

impl Admission {
    /// The admission of `invoke`, if `filter` is its filter `id`: a wasm
    /// filter's hook called by another filter, outside its own layer, has
    /// none.
    fn of(invoke: &Invoke, id: usize, filter: &WasmFilter) -> Option<Arc<Admission>> {
        let admission = invoke.extension::<Arc<Admission>>()?;
        let lease = admission.leases.get(id)?;
        let own = lease
            .filter
            .as_deref()
            .is_some_and(|f| std::ptr::eq(f, filter));
        own.then(|| admission.clone())
    }
}

impl Drop for Admission {
    /// Warm filters get their idle instances back; the rest are dropped.
    fn drop(&mut self) {
        for lease in &mut self.leases {
            if let Some(filter) = lease.filter.take() {
                filter.reclaim(lease.drain());
            }
        }
    }
}

/// Reserves what an invoke that starts with chain `K` through `filters`
/// (by position, `None` for a native filter) may need, waiting at most the
/// engine's queue timeout for each quota and for the engine's slots.
pub(crate) async fn admit<K: ChainKind>(
    filters: &[Option<Arc<WasmFilter>>],
    stream: bool,
    shows: bool,
) -> Result<Admission, ChainError> {
    let need = |filter: &WasmFilter| need::<K>(filter.hooks(), stream, shows);
    let needs: Vec<usize> = filters
        .iter()
        .map(|filter| filter.as_deref().map_or(0, need))
        .collect();
    let mut order: Vec<(&Arc<WasmFilter>, usize)> = filters
        .iter()
        .zip(&needs)
        .filter_map(|(filter, &n)| filter.as_ref().map(|filter| (filter, n)))
        .filter(|&(_, n)| n > 0)
        .collect();
    let mut permits = Vec::with_capacity(order.len() + 1);
    if let Some((first, _)) = order.first() {
        let engine = first.engine().clone();
        let timeout = engine.queue_timeout();
        order.sort_by_key(|(filter, _)| filter.ordinal());
        for (filter, n) in &order {
            let what = || format!("an instance of filter '{}'", filter.name());
            permits.push(acquire(filter.quota(), *n, timeout, what).await?);
        }
        let total = order.iter().map(|(_, n)| n).sum();
        let what = || "an instance slot of the engine".to_owned();
        permits.push(acquire(engine.slots(), total, timeout, what).await?);
    }
    Ok(Admission {
        leases: filters
            .iter()
            .zip(needs)
            .map(|(filter, reserved)| Lease::new(filter.clone(), reserved))
            .collect(),
        _permits: permits,
    })
}

/// One invoke's instances of one filter.
struct Lease {
    /// The filter, `None` for a native one.
    filter: Option<Arc<WasmFilter>>,
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
    /// Spare slots (a quota permit and an engine slot) borrowed beyond the
    /// reservation.
    extra: Vec<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

enum NextInstance {
    Idle(FilterInstance),
    Create,
    Wait,
    Queue,
}

impl Lease {
    fn new(filter: Option<Arc<WasmFilter>>, reserved: usize) -> Self {
        Lease {
            filter,
            reserved,
            state: Mutex::default(),
            returned: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, LeaseState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The idle instances, for the filter to reclaim when the invoke ends.
    fn drain(&mut self) -> Vec<FilterInstance> {
        std::mem::take(&mut self.lock().idle)
    }

    async fn take(&self) -> Result<FilterInstance, ChainError> {
        let filter = self
            .filter
            .as_ref()
            .expect("only a wasm filter takes instances");
        loop {
            let returned = self.returned.notified();
            match self.try_take(filter) {
                NextInstance::Idle(instance) => return Ok(instance),
                NextInstance::Create => break,
                NextInstance::Wait => returned.await,
                NextInstance::Queue => {
                    // Nothing reserved and nothing of ours will come back
                    // (a call the reservation did not foresee): wait, as a
                    // new invoke would, for a bounded time.
                    let timeout = filter.engine().queue_timeout();
                    let what = || format!("an instance of filter '{}'", filter.name());
                    let quota = acquire(filter.quota(), 1, timeout, what).await?;
                    let what = || "an instance slot of the engine".to_owned();
                    let slot = acquire(filter.engine().slots(), 1, timeout, what).await?;
                    let mut state = self.lock();
                    state.extra.push((quota, slot));
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

    fn try_take(&self, filter: &Arc<WasmFilter>) -> NextInstance {
        let mut state = self.lock();
        if let Some(instance) = state.idle.pop() {
            return NextInstance::Idle(instance);
        }
        if state.live < self.reserved + state.extra.len() {
            state.live += 1;
            return NextInstance::Create;
        }
        if let Ok(quota) = filter.quota().clone().try_acquire_owned()
            && let Ok(slot) = filter.engine().slots().clone().try_acquire_owned()
        {
            state.extra.push((quota, slot));
            state.live += 1;
            return NextInstance::Create;
        }
        if state.live == 0 {
            NextInstance::Queue
        } else {
            NextInstance::Wait
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

/// An instance taken from an invoke's lease for one call. Dropped without
/// `release` (a fault, or the call was cancelled mid-way), the instance is
/// discarded rather than returned.
pub(crate) struct Checkout {
    invoke: Arc<Invoke>,
    admission: Arc<Admission>,
    id: usize,
    instance: Option<FilterInstance>,
}

impl Checkout {
    /// Takes an instance of `filter`, filter `id` of `invoke`.
    pub(crate) async fn take(
        invoke: &Arc<Invoke>,
        id: usize,
        filter: &WasmFilter,
    ) -> Result<Self, ChainError> {
        let Some(admission) = Admission::of(invoke, id, filter) else {
            let message = "a wasm filter's hook runs only in its own layer of a kernel's chains";
            return Err(
                ChainError::new(ErrorKind::InvalidRequest, message).at(Origin::terminal("engine"))
            );
        };
        let instance = admission.leases[id].take().await?;
        Ok(Checkout {
            invoke: invoke.clone(),
            admission,
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
            .expect("a Checkout holds its instance until it is released")
    }

    /// The instance faulted: drop it now.
    pub(crate) fn poison(&mut self) {
        if self.instance.take().is_some() {
            self.admission.leases[self.id].lost();
        }
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.instance.is_none()
    }

    /// The call went well: the instance goes back for reuse.
    pub(crate) fn release(mut self) {
        if let Some(instance) = self.instance.take() {
            self.admission.leases[self.id].give_back(instance);
        }
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if self.instance.take().is_some() {
            self.admission.leases[self.id].lost();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::need;
    use crate::onion::{Chat, Hook, Tool, Turn};

    #[test]
    fn a_system_prompt_hook_needs_an_instance_in_chats_and_turns() {
        let hooks = [Hook::SystemPrompt];
        assert_eq!(need::<Chat>(&hooks, false, false), 1);
        assert_eq!(need::<Turn>(&hooks, true, false), 1);
        assert_eq!(need::<Tool>(&hooks, false, false), 0);
    }

    #[test]
    fn a_filter_needs_one_instance_per_level_it_can_be_on_the_stack() {
        let all = Hook::ALL;
        assert_eq!(need::<Turn>(&all, true, false), 3);
        assert_eq!(need::<Turn>(&all, false, false), 2);
        assert_eq!(need::<Chat>(&all, true, false), 2);
        assert_eq!(need::<Turn>(&[Hook::AroundTool], false, false), 1);
        assert_eq!(need::<Chat>(&[Hook::TokenTransform], false, false), 0);
    }

    #[test]
    fn an_answer_shown_whole_needs_a_token_transforms_instance_once_its_chain_is_done() {
        let transform = [Hook::TokenTransform];
        assert_eq!(need::<Chat>(&transform, false, true), 1);
        assert_eq!(need::<Tool>(&transform, false, true), 1);
        let both = [Hook::AroundChat, Hook::TokenTransform];
        assert_eq!(need::<Chat>(&both, false, true), 1);
        assert_eq!(need::<Chat>(&both, true, true), 2);
    }
}
