//! One instance of a filter component in its own store, and the calls into
//! it. A call that ends in a fault (trap, CPU budget, memory cap, contract
//! violation) returns `Err`: the store is poisoned and the caller must
//! discard the instance.

use std::sync::Arc;

use wasmtime::Store;
use wasmtime::component::{Resource, ResourceAny};

use super::bindings::exports::shallot::filter::plugin::{Descriptor, Hook as WitHook};
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
    exports: FilterWorld,
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
        let state = HostState::new(
            blueprint.identity.clone(),
            Confinement::new(&blueprint.limits, &blueprint.grants),
        );
        let mut store = Store::new(blueprint.pre.engine(), state);
        sandbox::prepare_store(&mut store, blueprint.budget);
        let exports = match blueprint.pre.instantiate_async(&mut store).await {
            Ok(exports) => exports,
            Err(e) => {
                return Err(sandbox::fault(
                    e,
                    store.data(),
                    &blueprint.limits,
                    blueprint.identity.origin("instantiate"),
                ));
            }
        };
        let mut instance = FilterInstance { store, exports };
        sandbox::arm(&mut instance.store, blueprint.budget);
        let configured = instance
            .exports
            .shallot_filter_plugin()
            .call_configure(&mut instance.store, &blueprint.config)
            .await;
        match configured {
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
        let described = self
            .exports
            .shallot_filter_plugin()
            .call_describe(&mut self.store)
            .await;
        let d: Descriptor = described.map_err(|e| self.fault(e, limits, "describe"))?;
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

    /// Creates a token transformer for one stream of `invoke`, as filter `id`.
    pub(crate) async fn transformer(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        limits: &Limits,
        budget: u32,
    ) -> Result<ResourceAny, ChainError> {
        self.enter(
            Scope {
                invoke,
                id,
                next: Continuation::None,
            },
            budget,
        );
        let made = self
            .exports
            .shallot_filter_token_filter()
            .token_transformer()
            .call_constructor(&mut self.store)
            .await;
        self.leave(made, limits, "token-transform")
    }

    /// Steps (or, with `tokens == None`, flushes) a token transformer.
    /// `Ok(Err(_))` is the filter's own error; `Err(_)` a fault.
    pub(crate) async fn transform(
        &mut self,
        invoke: Arc<Invoke>,
        id: usize,
        transformer: ResourceAny,
        tokens: Option<TokenBatch>,
        limits: &Limits,
        budget: u32,
    ) -> Result<Result<TokenBatch, ChainError>, ChainError> {
        self.enter(
            Scope {
                invoke,
                id,
                next: Continuation::None,
            },
            budget,
        );
        let api = self.exports.shallot_filter_token_filter();
        let (call, result) = match tokens {
            Some(tokens) => (
                "step",
                api.token_transformer()
                    .call_step(&mut self.store, transformer, &convert::token_batch(tokens))
                    .await,
            ),
            None => (
                "flush",
                api.token_transformer()
                    .call_flush(&mut self.store, transformer)
                    .await,
            ),
        };
        match self.leave(result, limits, call)? {
            Ok(batch) => {
                let batch = TokenBatch::from(batch);
                batch.validate().map_err(|problem| {
                    ChainError::new(
                        ErrorKind::PluginFault,
                        format!("returned a malformed token batch: {problem}"),
                    )
                    .at(self.store.data().identity.origin(call))
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
}

/// How a chain calls its hook on an instance.
pub(crate) trait WasmChain: ChainKind {
    fn continuation(next: Next<Self>) -> Continuation;

    fn call(
        instance: &mut FilterInstance,
        request: Self::Request,
        limits: &Limits,
    ) -> impl Future<Output = Result<Self::Output, ChainError>> + Send;
}

impl FilterInstance {
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
        self.enter(
            Scope {
                invoke,
                id,
                next: K::continuation(next),
            },
            budget,
        );
        K::call(self, request, limits).await
    }
}

impl WasmChain for Chat {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Chat(next)
    }

    async fn call(
        instance: &mut FilterInstance,
        request: ChatRequest,
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        const CALL: &str = "around-chat";
        let handle = instance
            .store
            .data_mut()
            .table
            .push(request)
            .map_err(internal)?;
        let borrowed = Resource::new_borrow(handle.rep());
        let result = instance
            .exports
            .shallot_filter_chat_filter()
            .call_around_chat(&mut instance.store, borrowed)
            .await;
        let _ = instance.store.data_mut().table.delete(handle);
        Ok(match instance.leave(result, limits, CALL)? {
            Ok(response) => Ok(instance
                .store
                .data_mut()
                .table
                .delete(response)
                .map_err(internal)?),
            Err(error) => Err(instance.store.data().attribute(error, CALL)),
        })
    }
}

impl WasmChain for Tool {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Tool(next)
    }

    async fn call(
        instance: &mut FilterInstance,
        request: ToolRequest,
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        const CALL: &str = "around-tool";
        let handle = instance
            .store
            .data_mut()
            .table
            .push(request)
            .map_err(internal)?;
        let borrowed = Resource::new_borrow(handle.rep());
        let result = instance
            .exports
            .shallot_filter_tool_filter()
            .call_around_tool(&mut instance.store, borrowed)
            .await;
        let _ = instance.store.data_mut().table.delete(handle);
        Ok(match instance.leave(result, limits, CALL)? {
            Ok(response) => Ok(instance
                .store
                .data_mut()
                .table
                .delete(response)
                .map_err(internal)?),
            Err(error) => Err(instance.store.data().attribute(error, CALL)),
        })
    }
}

impl WasmChain for Turn {
    fn continuation(next: Next<Self>) -> Continuation {
        Continuation::Turn(next)
    }

    async fn call(
        instance: &mut FilterInstance,
        request: TurnRequest,
        limits: &Limits,
    ) -> Result<Self::Output, ChainError> {
        const CALL: &str = "around-turn";
        let handle = instance
            .store
            .data_mut()
            .table
            .push(request)
            .map_err(internal)?;
        let borrowed = Resource::new_borrow(handle.rep());
        let result = instance
            .exports
            .shallot_filter_turn_filter()
            .call_around_turn(&mut instance.store, borrowed)
            .await;
        let _ = instance.store.data_mut().table.delete(handle);
        let result = instance.leave(result, limits, CALL)?;
        instance
            .store
            .data_mut()
            .take_turn_result(result, CALL)
            .map_err(internal)
    }
}
