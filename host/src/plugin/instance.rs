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
use super::bindings::{Filter as FilterWorld, FilterPre};
use super::convert;
use super::host::{Continuation, Granted, HostState, Identity, Scope, internal};
use crate::escape::{self, TEXT_CAP};
use crate::onion::Invoke;
use crate::onion::{ChainKind, Chat, Fctx, Hook, Next, Tool, Turn};
use crate::sandbox::{self, Confinement, HostMemoryExceeded, Limits};
use crate::types::{Call, ChainError, ErrorKind};
use crate::types::{ChatRequest, FinishReason, TokenBatch, ToolRequest, TurnRequest, Weigh};

/// Everything needed to make a fresh instance of a configured filter.
pub(crate) struct Blueprint {
    pub pre: FilterPre<HostState>,
    pub identity: Arc<Identity>,
    pub limits: Limits,
    pub grants: Grants,
    /// What the grants give at run time (the opened trace sink).
    pub granted: Granted,
    /// The operator's configuration, JSON text.
    pub config: Arc<str>,
    /// Whether the component declares the errors it passes on.
    pub declares: bool,
}

/// What a token transformer is given: the next tokens, or the end of the
/// stream (why the model stopped) to flush at.
pub(crate) enum Feed {
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

impl FilterInstance {
    /// Instantiates the component in a fresh store and configures it.
    pub(crate) async fn create(blueprint: &Blueprint) -> Result<Self, ChainError> {
        let confinement = Confinement::new(&blueprint.limits, blueprint.grants.clock);
        let state = HostState::new(
            blueprint.identity.clone(),
            blueprint.limits,
            confinement,
            blueprint.declares,
            blueprint.granted.clone(),
        );
        let mut store = Store::new(blueprint.pre.engine(), state);
        sandbox::prepare_store(&mut store, &blueprint.limits);
        let meter = store.data().confinement.meter().clone();
        let made = sandbox::metered(meter, blueprint.pre.instantiate_async(&mut store)).await;
        let exports = match made {
            Ok(exports) => exports,
            Err(e) => {
                let origin = blueprint.identity.origin(Call::Instantiate);
                let state = store.data();
                return Err(sandbox::fault(e, &state.confinement, &state.limits, origin));
            }
        };
        let mut instance = FilterInstance {
            store,
            exports: Box::new(exports),
        };
        instance.begin(Call::Configure, None);
        let plugin = instance.exports.shallot_filter_plugin();
        let meter = instance.meter();
        let configured = plugin.call_configure(&mut instance.store, &blueprint.config);
        let configured = sandbox::metered(meter, configured).await;
        match instance.end(configured, Call::Configure)? {
            Ok(()) => Ok(instance),
            Err(message) => Err(ChainError::new(
                ErrorKind::InvalidRequest,
                format!(
                    "rejected its configuration: {}",
                    escape::printable(&message, TEXT_CAP)
                ),
            )
            .at(blueprint.identity.origin(Call::Configure))),
        }
    }

    /// The filter's own description of itself.
    pub(crate) async fn describe(&mut self) -> Result<Description, ChainError> {
        self.begin(Call::Describe, None);
        let plugin = self.exports.shallot_filter_plugin();
        let meter = self.meter();
        let described = plugin.call_describe(&mut self.store);
        let described = sandbox::metered(meter, described).await;
        let d = self.end(described, Call::Describe)?;
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

    fn meter(&self) -> sandbox::Meter {
        self.store.data().confinement.meter().clone()
    }

    fn fault(&self, error: wasmtime::Error, call: Call) -> ChainError {
        let state = self.store.data();
        let origin = state.identity.origin(call);
        sandbox::fault(error, &state.confinement, &state.limits, origin)
    }

    /// Starts `call`: its scope, its clocks, its captured stderr, its
    /// quotas.
    fn begin(&mut self, call: Call, scope: Option<Scope>) {
        self.begin_with(call, scope, true);
    }

    /// Starts `call`; a token transformer's step or flush keeps the
    /// quotas its stream has used (`fresh_quotas` false).
    fn begin_with(&mut self, call: Call, scope: Option<Scope>, fresh_quotas: bool) {
        self.store.data_mut().enter(call, scope, fresh_quotas);
        let limits = self.store.data().limits;
        sandbox::arm(&mut self.store, &limits);
    }

    /// Ends a call: drops the scope (it holds the invoke, which holds this
    /// instance's lease), undoes a faulted call's context writes, and turns
    /// a wasmtime error into a fault.
    fn end<T>(&mut self, result: wasmtime::Result<T>, call: Call) -> Result<T, ChainError> {
        self.store.data_mut().leave(result.is_err());
        let stats = &self.store.data().identity.stats;
        stats.called(call, self.meter().spent());
        result.map_err(|e| {
            let fault = self.fault(e, call);
            self.store.data().identity.stats.failed(call, fault.kind);
            fault
        })
    }

    /// Runs the system-prompt hook for `invoke`, as filter `id`.
    /// `Ok(Err(_))` is the filter's own error; `Err(_)` a fault.
    pub(crate) async fn system_prompt(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        prompt: &str,
    ) -> Result<Result<String, ChainError>, ChainError> {
        const CALL: Call = Call::SystemPrompt;
        self.begin(CALL, Some(Scope::outside_chains(invoke, id)));
        let api = self.exports.shallot_filter_system_prompt_filter();
        let meter = self.meter();
        let shaped = api.call_system_prompt(&mut self.store, prompt);
        let shaped = sandbox::metered(meter, shaped).await;
        let shaped = self.end(shaped, CALL)?;
        // The prompt goes into every model call of the invoke: no bigger
        // than what the filter may make the host hold.
        if shaped
            .as_ref()
            .is_ok_and(|p| p.len() > self.store.data().limits.host_bytes())
        {
            return Err(self.fault(wasmtime::Error::new(HostMemoryExceeded), CALL));
        }
        Ok(shaped.map_err(|error| self.store.data().attribute(error, CALL)))
    }

    /// Creates a token transformer for one stream of `invoke`, as filter `id`.
    pub(crate) async fn transformer(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
    ) -> Result<ResourceAny, ChainError> {
        self.begin(
            Call::TokenTransform,
            Some(Scope::outside_chains(invoke, id)),
        );
        let api = self.exports.shallot_filter_token_filter();
        let meter = self.meter();
        let api = api.token_transformer();
        let made = api.call_constructor(&mut self.store);
        let made = sandbox::metered(meter, made).await;
        self.end(made, Call::TokenTransform)
    }

    /// Steps or flushes a token transformer. `Ok(Err(_))` is the filter's
    /// own error; `Err(_)` a fault.
    pub(crate) async fn transform(
        &mut self,
        scope: Scope,
        transformer: ResourceAny,
        feed: Feed,
    ) -> Result<Result<TokenBatch, ChainError>, ChainError> {
        let call = match &feed {
            Feed::Step(_) => Call::Step,
            Feed::Flush(_) => Call::Flush,
        };
        self.begin_with(call, Some(scope), false);
        let meter = self.meter();
        let api = self.exports.shallot_filter_token_filter();
        let api = api.token_transformer();
        let taken = match &feed {
            Feed::Step(tokens) => tokens.len(),
            Feed::Flush(_) => 0,
        };
        let result = match feed {
            Feed::Step(tokens) => {
                let batch = convert::token_batch(tokens);
                let stepped = api.call_step(&mut self.store, transformer, &batch);
                sandbox::metered(meter, stepped).await
            }
            Feed::Flush(end) => {
                self.store.data_mut().stream_end = Some(convert::finish_reason(end));
                let flushed = api.call_flush(&mut self.store, transformer);
                sandbox::metered(meter, flushed).await
            }
        };
        match self.end(result, call)? {
            Ok(batch) => {
                let batch = TokenBatch::from(batch);
                let stats = &self.store.data().identity.stats;
                stats.tokens(taken, batch.len());
                if batch.weight() > self.store.data().limits.host_bytes() {
                    return Err(self.fault(wasmtime::Error::new(HostMemoryExceeded), call));
                }
                batch.validate().map_err(|problem| {
                    let message = format!("returned a malformed token batch: {problem}");
                    ChainError::new(ErrorKind::PluginFault, message).at(self
                        .store
                        .data()
                        .identity
                        .origin(call))
                })?;
                Ok(Ok(batch))
            }
            Err(error) => Ok(Err(self.store.data().attribute(error, call))),
        }
    }

    /// Drops a token transformer in the guest (its destructor runs).
    pub(crate) async fn drop_transformer(
        &mut self,
        transformer: ResourceAny,
    ) -> Result<(), ChainError> {
        self.begin(Call::TokenTransform, None);
        let meter = self.meter();
        let dropped = transformer.resource_drop_async(&mut self.store);
        let dropped = sandbox::metered(meter, dropped).await;
        self.end(dropped, Call::TokenTransform)
    }

    /// Runs one hook call of filter `id`, the chain continuing in `next`.
    pub(crate) async fn around<K: WasmChain>(
        &mut self,
        id: usize,
        request: K::Request,
        next: Next<K>,
    ) -> Result<K::Output, ChainError> {
        let invoke = next.invoke().clone();
        let branch = next.branch().cloned();
        let scope = Scope {
            invoke,
            id,
            branch,
            next: K::continuation(next),
        };
        self.begin(K::HOOK.into(), Some(scope));
        K::call(self, request).await
    }

    /// Puts a request into the table for the length of a call; the guest
    /// gets a borrow of it. A table the guest has filled is its fault.
    fn lend<T: Send + 'static>(
        &mut self,
        request: T,
        call: Call,
    ) -> Result<(Resource<T>, Resource<T>), ChainError> {
        let pushed = self.store.data_mut().table.push(request);
        let handle = pushed.map_err(|e| self.fault(e.into(), call))?;
        let borrowed = Resource::new_borrow(handle.rep());
        Ok((handle, borrowed))
    }

    /// Takes back what was lent, and what the guest returned.
    fn settle<T: 'static, R: Send + 'static>(
        &mut self,
        lent: Resource<T>,
        result: wasmtime::Result<
            Result<Resource<R>, super::bindings::shallot::filter::types::FilterError>,
        >,
        call: Call,
    ) -> Result<Result<R, ChainError>, ChainError> {
        let _ = self.store.data_mut().take(lent);
        Ok(match self.end(result, call)? {
            Ok(response) => Ok(self.store.data_mut().take(response).map_err(internal)?),
            Err(error) => Err(self.store.data().attribute(error, call)),
        })
    }
}

/// How a chain calls its hook on an instance.
pub(crate) trait WasmChain: ChainKind {
    fn continuation(next: Next<Self>) -> Continuation;

    /// The rest of this chain, if `continuation` is of it.
    fn resume(continuation: &Continuation) -> Option<&Next<Self>>;

    fn call(
        instance: &mut FilterInstance,
        request: Self::Request,
    ) -> impl Future<Output = Result<Self::Output, ChainError>> + Send;
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
        instance: &mut FilterInstance,
        request: ChatRequest,
    ) -> Result<Self::Output, ChainError> {
        let (lent, borrowed) = instance.lend(request, Call::AroundChat)?;
        let api = instance.exports.shallot_filter_chat_filter();
        let meter = instance.meter();
        let result = api.call_around_chat(&mut instance.store, borrowed);
        let result = sandbox::metered(meter, result).await;
        instance.settle(lent, result, Call::AroundChat)
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
        instance: &mut FilterInstance,
        request: ToolRequest,
    ) -> Result<Self::Output, ChainError> {
        let (lent, borrowed) = instance.lend(request, Call::AroundTool)?;
        let api = instance.exports.shallot_filter_tool_filter();
        let meter = instance.meter();
        let result = api.call_around_tool(&mut instance.store, borrowed);
        let result = sandbox::metered(meter, result).await;
        instance.settle(lent, result, Call::AroundTool)
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
        instance: &mut FilterInstance,
        request: TurnRequest,
    ) -> Result<Self::Output, ChainError> {
        const CALL: Call = Call::AroundTurn;
        let (lent, borrowed) = instance.lend(request, CALL)?;
        let api = instance.exports.shallot_filter_turn_filter();
        let meter = instance.meter();
        let result = api.call_around_turn(&mut instance.store, borrowed);
        let result = sandbox::metered(meter, result).await;
        let _ = instance.store.data_mut().take(lent);
        let result = instance.end(result, CALL)?;
        let state = instance.store.data_mut();
        state.take_turn_result(result, CALL).map_err(internal)
    }
}
