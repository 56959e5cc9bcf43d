//! One instance of a filter component in its own store, and the calls into
//! it. A call that ends in a fault (trap, CPU budget, memory cap, contract
//! violation) returns `Err`: the store is poisoned and the caller must
//! discard the instance.
//!
//! Every call is async (on a fiber of its own): a hook's `next` runs the
//! inner layers, and a store that links an async import must use async
//! calls throughout.

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::{Resource, ResourceAny};

use super::Grants;
use super::bindings::exports::shallot::filter::plugin::Hook as WitHook;
use super::bindings::shallot::filter::types::FilterError as WitError;
use super::bindings::{Filter as FilterWorld, FilterPre};
use super::convert;
use super::host::{Continuation, GrantedServices, HostState, Identity, Scope};
use super::making::instantiate;
use crate::escape::{self, TEXT_CAP};
use crate::onion::Invoke;
use crate::onion::{ChainKind, Chat, Fctx, Hook, Next, Tool, Turn};
use crate::sandbox::{self, HostMemoryExceeded, Limits};
use crate::types::{Call, ChainError, ErrorKind};
use crate::types::{ChatRequest, FinishReason, TokenBatch, ToolRequest, TurnRequest, Weigh};

/// Everything needed to make a fresh instance of a configured filter.
pub(crate) struct InstanceTemplate {
    pub pre: FilterPre<HostState>,
    pub identity: Arc<Identity>,
    pub limits: Limits,
    pub grants: Grants,
    /// What the grants give at run time (the opened trace sink).
    pub services: GrantedServices,
    /// The operator's configuration, JSON text.
    pub config: Arc<str>,
    /// Whether the component declares the errors it passes on.
    pub declares: bool,
}

/// What a token transformer is given: the next tokens, or the end of the
/// stream (why the model stopped) to flush at.
pub(crate) enum TransformInput {
    Step(TokenBatch),
    Flush(FinishReason),
}

/// A live, configured filter instance.
pub(crate) struct FilterInstance {
    store: Store<HostState>,
    // Boxed: the export table is large and instances move (pools, leases).
    exports: Box<FilterWorld>,
}

/// What `describe` reported, in host terms.
pub(crate) struct Description {
    pub name: String,
    pub version: String,
    pub init: Fctx,
    pub hooks: Vec<Hook>,
}

/// The longest name or version a filter may give itself.
const NAME_CAP: usize = 128;

/// A call into an instance that faulted (it trapped, ran out of a budget
/// or a cap, or broke the contract): its store is poisoned, and whoever
/// holds the instance must drop it. The filter's own errors are not
/// faults; they are in what the call returns.
pub(crate) struct Fault(pub ChainError);

impl From<Fault> for ChainError {
    fn from(fault: Fault) -> Self {
        fault.0
    }
}

/// Whether a call starts its quotas afresh: a token transformer's step or
/// flush keeps what its stream has used.
#[derive(Clone, Copy)]
enum Quotas {
    Fresh,
    Kept,
}

impl FilterInstance {
    /// Instantiates the component in a fresh store and configures it.
    pub(crate) async fn create(template: &InstanceTemplate) -> Result<Self, ChainError> {
        let (store, exports) = instantiate(template).await?;
        let mut instance = FilterInstance { store, exports };
        let config = &*template.config;
        let configured = instance
            .call(
                Call::Configure,
                None,
                Quotas::Fresh,
                async |store, exports| {
                    let plugin = exports.shallot_filter_plugin();
                    plugin.call_configure(store, config).await
                },
            )
            .await?;
        match configured {
            Ok(()) => Ok(instance),
            Err(message) => Err(ChainError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "rejected its configuration: {}",
                    escape::printable(&message, TEXT_CAP)
                ),
            )
            .at(template.identity.origin(Call::Configure))),
        }
    }

    /// The filter's own description of itself.
    pub(crate) async fn describe(&mut self) -> Result<Description, ChainError> {
        let d = self
            .call(
                Call::Describe,
                None,
                Quotas::Fresh,
                async |store, exports| exports.shallot_filter_plugin().call_describe(store).await,
            )
            .await?;
        let init = match self.store.data().parse_json(&d.init_fctx, "its init FCtx") {
            Ok(Ok(init)) => init,
            Ok(Err(message)) => {
                let origin = self.store.data().identity.origin(Call::Describe);
                return Err(ChainError::new(ErrorKind::PluginFault, message).at(origin));
            }
            Err(e) => return Err(self.fault(e, Call::Describe)),
        };
        // Each hook once, in the order first named: the list is read on
        // every invoke, and a guest could repeat a hook millions of times.
        let mut hooks = Vec::new();
        for hook in &d.hooks {
            let hook = match hook {
                WitHook::AroundChat => Hook::AroundChat,
                WitHook::AroundTool => Hook::AroundTool,
                WitHook::AroundTurn => Hook::AroundTurn,
                WitHook::TokenTransform => Hook::TokenTransform,
                WitHook::SystemPrompt => Hook::SystemPrompt,
            };
            if !hooks.contains(&hook) {
                hooks.push(hook);
            }
        }
        Ok(Description {
            name: escape::printable(&d.name, NAME_CAP),
            version: escape::printable(&d.version, NAME_CAP),
            init: Fctx::from(init.to_string()),
            hooks,
        })
    }

    /// Bytes of linear memory the instance has.
    pub(crate) fn memory(&self) -> usize {
        self.store.data().confinement.memory()
    }

    fn fault(&self, error: wasmtime::Error, call: Call) -> ChainError {
        let state = self.store.data();
        let origin = state.identity.origin(call);
        sandbox::fault(error, &state.confinement, &state.limits, origin)
    }

    /// One call into the instance, the only way in: starts `call` (its
    /// scope, clocks, captured stderr and quotas), runs `body` under the
    /// CPU meter, then ends it: drops the scope (it holds the invoke,
    /// which holds this instance's lease), undoes a faulted call's context
    /// writes, counts the call, and turns a wasmtime error into a fault.
    async fn call<T>(
        &mut self,
        call: Call,
        scope: Option<Scope>,
        quotas: Quotas,
        body: impl AsyncFnOnce(&mut Store<HostState>, &FilterWorld) -> wasmtime::Result<T>,
    ) -> Result<T, Fault> {
        self.store
            .data_mut()
            .enter(call, scope, matches!(quotas, Quotas::Fresh));
        let limits = self.store.data().limits;
        sandbox::arm(&mut self.store, &limits);
        let meter = self.store.data().confinement.meter().clone();
        let result = sandbox::metered(meter.clone(), body(&mut self.store, &self.exports)).await;
        self.store.data_mut().leave(result.is_err());
        let stats = &self.store.data().identity.stats;
        stats.called(call, meter.spent());
        result.map_err(|e| {
            let fault = self.fault(e, call);
            self.store.data().identity.stats.failed(call, fault.kind);
            Fault(fault)
        })
    }

    /// Runs the system-prompt hook for `invoke`, as filter `id`: the
    /// prompt it made, or its own error.
    pub(crate) async fn system_prompt(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        prompt: &str,
    ) -> Result<Result<String, ChainError>, Fault> {
        const CALL: Call = Call::SystemPrompt;
        let scope = Some(Scope::outside_chains(invoke, id));
        let shaped = self
            .call(CALL, scope, Quotas::Fresh, async |store, exports| {
                let api = exports.shallot_filter_system_prompt_filter();
                api.call_system_prompt(store, prompt).await
            })
            .await?;
        // The prompt goes into every model call of the invoke: no bigger
        // than what the filter may make the host hold.
        if shaped
            .as_ref()
            .is_ok_and(|p| p.len() > self.store.data().limits.host_bytes())
        {
            let fault = self.fault(wasmtime::Error::new(HostMemoryExceeded), CALL);
            return Err(Fault(fault));
        }
        Ok(shaped.map_err(|error| self.store.data().attribute(error, CALL)))
    }

    /// Creates a token transformer for one stream of `invoke`, as filter `id`.
    pub(crate) async fn transformer(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
    ) -> Result<ResourceAny, Fault> {
        let scope = Some(Scope::outside_chains(invoke, id));
        self.call(
            Call::TokenTransform,
            scope,
            Quotas::Fresh,
            async |store, exports| {
                let api = exports.shallot_filter_token_filter();
                api.token_transformer().call_constructor(store).await
            },
        )
        .await
    }

    /// Steps or flushes a token transformer: the tokens it gives, or its
    /// own error.
    pub(crate) async fn transform(
        &mut self,
        scope: Scope,
        transformer: ResourceAny,
        feed: TransformInput,
    ) -> Result<Result<TokenBatch, ChainError>, Fault> {
        let (call, taken) = match &feed {
            TransformInput::Step(tokens) => (Call::Step, tokens.len()),
            TransformInput::Flush(_) => (Call::Flush, 0),
        };
        let result = self
            .call(call, Some(scope), Quotas::Kept, async |store, exports| {
                let api = exports.shallot_filter_token_filter();
                let api = api.token_transformer();
                match feed {
                    TransformInput::Step(tokens) => {
                        let batch = convert::token_batch(tokens);
                        api.call_step(store, transformer, &batch).await
                    }
                    TransformInput::Flush(end) => {
                        store.data_mut().stream_end = Some(convert::finish_reason(end));
                        api.call_flush(store, transformer).await
                    }
                }
            })
            .await?;
        let batch = match result {
            Ok(batch) => TokenBatch::from(batch),
            Err(error) => return Ok(Err(self.store.data().attribute(error, call))),
        };
        let state = self.store.data();
        state.identity.stats.tokens(taken, batch.len());
        if batch.weight() > state.limits.host_bytes() {
            return Err(Fault(
                self.fault(wasmtime::Error::new(HostMemoryExceeded), call),
            ));
        }
        if let Err(problem) = batch.validate() {
            let message = format!("returned a malformed token batch: {problem}");
            let error = ChainError::new(ErrorKind::PluginFault, message);
            return Err(Fault(error.at(state.identity.origin(call))));
        }
        Ok(Ok(batch))
    }

    /// Drops a token transformer in the guest (its destructor runs).
    pub(crate) async fn drop_transformer(&mut self, transformer: ResourceAny) -> Result<(), Fault> {
        self.call(
            Call::TokenTransform,
            None,
            Quotas::Fresh,
            async |store, _| transformer.resource_drop_async(store).await,
        )
        .await
    }

    /// Runs one hook call of filter `id`, the chain continuing in `next`.
    pub(crate) async fn around<K: WasmChain>(
        &mut self,
        id: usize,
        request: K::Request,
        next: Next<K>,
    ) -> Result<K::Output, Fault> {
        let scope = Scope {
            invoke: next.invoke().clone(),
            id,
            branch: next.branch().cloned(),
            next: K::continuation(next),
        };
        self.call(
            K::HOOK.into(),
            Some(scope),
            Quotas::Fresh,
            async |store, exports| K::call(store, exports, request).await,
        )
        .await
    }
}

/// Puts a request into the table for the length of a call; the guest
/// gets a borrow of it. A table the guest has filled is its fault.
fn lend<T: Send + 'static>(
    store: &mut Store<HostState>,
    request: T,
) -> wasmtime::Result<(Resource<T>, Resource<T>)> {
    let handle = store.data_mut().table.push(request)?;
    let borrowed = Resource::new_borrow(handle.rep());
    Ok((handle, borrowed))
}

/// Takes back what was lent, and what the guest returned: the response,
/// or its error attributed.
fn settle<T: 'static, R: 'static>(
    state: &mut HostState,
    lent: Resource<T>,
    returned: Result<Resource<R>, WitError>,
    call: Call,
) -> wasmtime::Result<Result<R, ChainError>> {
    let _ = state.take(lent);
    Ok(match returned {
        Ok(response) => Ok(state.take(response)?),
        Err(error) => Err(state.attribute(error, call)),
    })
}

/// How a chain calls its hook on an instance: what the chain kind adds
/// in the plugin layer (its WIT call, and where a guest's `next` finds
/// the rest of the chain).
pub(crate) trait WasmChain: ChainKind {
    fn continuation(next: Next<Self>) -> Continuation;

    /// The rest of this chain, if `continuation` is of it.
    fn resume(continuation: &Continuation) -> Option<&Next<Self>>;

    /// Lends `request` to the guest, calls its hook, and takes back what
    /// it returned.
    fn call(
        store: &mut Store<HostState>,
        exports: &FilterWorld,
        request: Self::Request,
    ) -> impl Future<Output = wasmtime::Result<Self::Output>> + Send;
}

impl WasmChain for Chat {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Chat(next)
    }

    fn resume(continuation: &Continuation) -> Option<&Next<Self>> {
        match continuation {
            Continuation::Chat(next) => Some(next),
            _ => None,
        }
    }

    async fn call(
        store: &mut Store<HostState>,
        exports: &FilterWorld,
        request: ChatRequest,
    ) -> wasmtime::Result<Self::Output> {
        let (lent, borrowed) = lend(store, request)?;
        let api = exports.shallot_filter_chat_filter();
        let returned = api.call_around_chat(&mut *store, borrowed).await?;
        settle(store.data_mut(), lent, returned, Call::AroundChat)
    }
}

impl WasmChain for Tool {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Tool(next)
    }

    fn resume(continuation: &Continuation) -> Option<&Next<Self>> {
        match continuation {
            Continuation::Tool(next) => Some(next),
            _ => None,
        }
    }

    async fn call(
        store: &mut Store<HostState>,
        exports: &FilterWorld,
        request: ToolRequest,
    ) -> wasmtime::Result<Self::Output> {
        let (lent, borrowed) = lend(store, request)?;
        let api = exports.shallot_filter_tool_filter();
        let returned = api.call_around_tool(&mut *store, borrowed).await?;
        settle(store.data_mut(), lent, returned, Call::AroundTool)
    }
}

impl WasmChain for Turn {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Turn(next)
    }

    fn resume(continuation: &Continuation) -> Option<&Next<Self>> {
        match continuation {
            Continuation::Turn(next) => Some(next),
            _ => None,
        }
    }

    async fn call(
        store: &mut Store<HostState>,
        exports: &FilterWorld,
        request: TurnRequest,
    ) -> wasmtime::Result<Self::Output> {
        let (lent, borrowed) = lend(store, request)?;
        let api = exports.shallot_filter_turn_filter();
        let returned = api.call_around_turn(&mut *store, borrowed).await?;
        let state = store.data_mut();
        let _ = state.take(lent);
        state.take_turn_result(returned, Call::AroundTurn)
    }
}
