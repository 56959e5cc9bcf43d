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

use super::bindings::exports::shallot::filter::plugin::Hook as WitHook;
use super::bindings::{Filter as FilterWorld, FilterPre};
use super::convert;
use super::host::{Continuation, HostState, Identity, Scope, internal};
use crate::error::{ChainError, ErrorKind, Hook};
use crate::invoke::Invoke;
use crate::onion::{ChainKind, Chat, Fctx, Next, Tool, Turn};
use crate::sandbox::{self, Confinement, Grants, Limits};
use crate::types::{ChatRequest, TokenBatch, ToolRequest, TurnRequest};

/// Everything needed to make a fresh instance of a configured filter.
pub(crate) struct Blueprint {
    pub pre: FilterPre<HostState>,
    pub identity: Arc<Identity>,
    pub limits: Limits,
    pub grants: Grants,
    /// The operator's configuration, JSON text.
    pub config: Arc<str>,
    /// The CPU budget in epoch ticks.
    pub budget: u32,
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

impl FilterInstance {
    /// Instantiates the component in a fresh store and configures it.
    pub(crate) async fn create(blueprint: &Blueprint) -> Result<Self, ChainError> {
        let confinement = Confinement::new(&blueprint.limits, &blueprint.grants);
        let state = HostState::new(blueprint.identity.clone(), confinement);
        let mut store = Store::new(blueprint.pre.engine(), state);
        sandbox::prepare_store(&mut store, blueprint.budget);
        let exports = match blueprint.pre.instantiate_async(&mut store).await {
            Ok(exports) => exports,
            Err(e) => {
                let origin = blueprint.identity.origin("instantiate");
                return Err(sandbox::fault(e, store.data(), &blueprint.limits, origin));
            }
        };
        let mut instance = FilterInstance {
            store,
            exports: Box::new(exports),
        };
        sandbox::arm(&mut instance.store, blueprint.budget);
        let plugin = instance.exports.shallot_filter_plugin();
        match plugin
            .call_configure(&mut instance.store, &blueprint.config)
            .await
        {
            Ok(Ok(())) => Ok(instance),
            Ok(Err(message)) => Err(ChainError::new(
                ErrorKind::InvalidRequest,
                format!("rejected its configuration: {message}"),
            )
            .at(blueprint.identity.origin("configure"))),
            Err(e) => Err(instance.fault(e, &blueprint.limits, "configure")),
        }
    }

    /// The filter's own description of itself.
    pub(crate) async fn describe(
        &mut self,
        limits: &Limits,
        budget: u32,
    ) -> Result<Description, ChainError> {
        sandbox::arm(&mut self.store, budget);
        let plugin = self.exports.shallot_filter_plugin();
        let d = plugin
            .call_describe(&mut self.store)
            .await
            .map_err(|e| self.fault(e, limits, "describe"))?;
        let init: serde_json::Value = serde_json::from_str(&d.init_fctx).map_err(|e| {
            ChainError::new(
                ErrorKind::PluginFault,
                format!("its init FCtx is not JSON: {e}"),
            )
            .at(self.store.data().identity.origin("describe"))
        })?;
        let hooks = d
            .hooks
            .iter()
            .map(|h| match h {
                WitHook::AroundChat => Hook::AroundChat,
                WitHook::AroundTool => Hook::AroundTool,
                WitHook::AroundTurn => Hook::AroundTurn,
                WitHook::TokenTransform => Hook::TokenTransform,
                WitHook::SystemPrompt => Hook::SystemPrompt,
            })
            .collect();
        Ok(Description {
            name: d.name,
            version: d.version,
            init: Fctx::from(init.to_string()),
            hooks,
        })
    }

    fn fault(&self, error: wasmtime::Error, limits: &Limits, call: &'static str) -> ChainError {
        let state = self.store.data();
        sandbox::fault(error, state, limits, state.identity.origin(call))
    }

    fn enter(&mut self, scope: Scope, budget: u32) {
        let state = self.store.data_mut();
        state.scope = Some(scope);
        state.inner_error = None;
        sandbox::arm(&mut self.store, budget);
    }

    /// Ends a call: drops the scope (it holds the invoke, which holds this
    /// instance's lease) and turns a wasmtime error into a fault.
    fn leave<T>(
        &mut self,
        result: wasmtime::Result<T>,
        limits: &Limits,
        call: &'static str,
    ) -> Result<T, ChainError> {
        self.store.data_mut().scope = None;
        result.map_err(|e| self.fault(e, limits, call))
    }

    /// Runs the system-prompt hook for `invoke`, as filter `id`.
    /// `Ok(Err(_))` is the filter's own error; `Err(_)` a fault.
    pub(crate) async fn system_prompt(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        prompt: &str,
        limits: &Limits,
        budget: u32,
    ) -> Result<Result<String, ChainError>, ChainError> {
        const CALL: &str = "system-prompt";
        let scope = Scope {
            invoke,
            id,
            branch: None,
            next: Continuation::None,
        };
        self.enter(scope, budget);
        let api = self.exports.shallot_filter_system_prompt_filter();
        let result = api.call_system_prompt(&mut self.store, prompt).await;
        Ok(self
            .leave(result, limits, CALL)?
            .map_err(|error| self.store.data().attribute(error, CALL)))
    }

    /// Creates a token transformer for one stream of `invoke`, as filter `id`.
    pub(crate) async fn transformer(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        limits: &Limits,
        budget: u32,
    ) -> Result<ResourceAny, ChainError> {
        let scope = Scope {
            invoke,
            id,
            branch: None,
            next: Continuation::None,
        };
        self.enter(scope, budget);
        let api = self.exports.shallot_filter_token_filter();
        let made = api
            .token_transformer()
            .call_constructor(&mut self.store)
            .await;
        self.leave(made, limits, "token-transform")
    }

    /// Steps (or, with `tokens == None`, flushes) a token transformer.
    /// `Ok(Err(_))` is the filter's own error; `Err(_)` a fault.
    pub(crate) async fn transform(
        &mut self,
        scope: Scope,
        transformer: ResourceAny,
        tokens: Option<TokenBatch>,
        limits: &Limits,
        budget: u32,
    ) -> Result<Result<TokenBatch, ChainError>, ChainError> {
        self.enter(scope, budget);
        let api = self.exports.shallot_filter_token_filter();
        let api = api.token_transformer();
        let (call, result) = match tokens {
            Some(tokens) => {
                let batch = convert::token_batch(tokens);
                (
                    "step",
                    api.call_step(&mut self.store, transformer, &batch).await,
                )
            }
            None => ("flush", api.call_flush(&mut self.store, transformer).await),
        };
        match self.leave(result, limits, call)? {
            Ok(batch) => {
                let batch = TokenBatch::from(batch);
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

    /// Drops a token transformer in the guest.
    pub(crate) async fn drop_transformer(
        &mut self,
        transformer: ResourceAny,
        limits: &Limits,
        budget: u32,
    ) -> Result<(), ChainError> {
        sandbox::arm(&mut self.store, budget);
        let dropped = transformer.resource_drop_async(&mut self.store).await;
        self.leave(dropped, limits, "token-transform")
    }

    /// Runs one hook call of filter `id`, the chain continuing in `next`.
    pub(crate) async fn around<K: WasmChain>(
        &mut self,
        id: usize,
        request: K::Request,
        next: Next<K>,
        limits: &Limits,
        budget: u32,
    ) -> Result<K::Output, ChainError> {
        let invoke = next.invoke().clone();
        let branch = next.branch().cloned();
        let scope = Scope {
            invoke,
            id,
            branch,
            next: K::continuation(next),
        };
        self.enter(scope, budget);
        K::call(self, request, limits).await
    }

    /// Puts a request into the table for the length of a call; the guest
    /// gets a borrow of it.
    fn lend<T: Send + 'static>(
        &mut self,
        request: T,
    ) -> Result<(Resource<T>, Resource<T>), ChainError> {
        let handle = self
            .store
            .data_mut()
            .table
            .push(request)
            .map_err(internal)?;
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
        limits: &Limits,
        call: &'static str,
    ) -> Result<Result<R, ChainError>, ChainError> {
        let _ = self.store.data_mut().table.delete(lent);
        Ok(match self.leave(result, limits, call)? {
            Ok(response) => Ok(self
                .store
                .data_mut()
                .table
                .delete(response)
                .map_err(internal)?),
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
        limits: &Limits,
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
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        let (lent, borrowed) = instance.lend(request)?;
        let api = instance.exports.shallot_filter_chat_filter();
        let result = api.call_around_chat(&mut instance.store, borrowed).await;
        instance.settle(lent, result, limits, "around-chat")
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
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        let (lent, borrowed) = instance.lend(request)?;
        let api = instance.exports.shallot_filter_tool_filter();
        let result = api.call_around_tool(&mut instance.store, borrowed).await;
        instance.settle(lent, result, limits, "around-tool")
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
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        const CALL: &str = "around-turn";
        let (lent, borrowed) = instance.lend(request)?;
        let api = instance.exports.shallot_filter_turn_filter();
        let result = api.call_around_turn(&mut instance.store, borrowed).await;
        let _ = instance.store.data_mut().table.delete(lent);
        let result = instance.leave(result, limits, CALL)?;
        let state = instance.store.data_mut();
        state.take_turn_result(result, CALL).map_err(internal)
    }
}
