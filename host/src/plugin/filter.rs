//! A configured wasm filter: a plugin, its name, configuration, limits,
//! grants and isolation mode, and the instances it runs in.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};

use serde::{Deserialize, Serialize};
use wasmtime::component::ResourceAny;

use super::Plugin;
use super::instance::{Blueprint, Description, FilterInstance, WasmChain};
use super::pool::Leased;
use crate::engine::Engine;
use crate::error::{ChainError, Hook};
use crate::invoke::Invoke;
use crate::kernel::CallKind;
use crate::onion::{Fctx, Next};
use crate::sandbox::{self, Grants, Limits};
use crate::types::TokenBatch;

/// How a filter's instances are shared.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Isolation {
    /// A fresh instance for every invoke, dropped when it ends: nothing a
    /// filter saw can reach another invoke or tenant. The default, and the
    /// right choice for third-party plugins.
    #[default]
    Invoke,
    /// Instances are reused across invokes. Cheaper, for trusted plugins
    /// that keep request state only in FCtx, as the SDKs do.
    Warm,
}

impl Isolation {
    /// The name used in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            Isolation::Invoke => "invoke",
            Isolation::Warm => "warm",
        }
    }
}

/// A filter loaded from a plugin and configured, ready to join a kernel.
pub struct WasmFilter {
    name: Arc<str>,
    plugin: Arc<Plugin>,
    blueprint: Blueprint,
    description: Description,
    isolation: Isolation,
    engine: Engine,
    warm: Mutex<Vec<FilterInstance>>,
}

impl WasmFilter {
    pub(crate) fn new(
        name: Arc<str>,
        plugin: Arc<Plugin>,
        blueprint: Blueprint,
        description: Description,
        isolation: Isolation,
        engine: Engine,
    ) -> Self {
        WasmFilter {
            name,
            plugin,
            blueprint,
            description,
            isolation,
            engine,
            warm: Mutex::new(Vec::new()),
        }
    }

    /// The filter's name: its identity in errors and the key of its FCtx.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The plugin it runs.
    pub fn plugin(&self) -> &Plugin {
        &self.plugin
    }

    /// The hooks it implements.
    pub fn hooks(&self) -> &[Hook] {
        &self.description.hooks
    }

    /// The plugin's own version.
    pub fn version(&self) -> &str {
        &self.description.version
    }

    /// The FCtx seed.
    pub fn init_fctx(&self) -> &Fctx {
        &self.description.init
    }

    /// The isolation mode.
    pub fn isolation(&self) -> Isolation {
        self.isolation
    }

    /// The resource limits.
    pub fn limits(&self) -> &Limits {
        &self.blueprint.limits
    }

    /// The capabilities granted.
    pub fn grants(&self) -> &Grants {
        &self.blueprint.grants
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    fn has(&self, hook: Hook) -> usize {
        self.description.hooks.contains(&hook) as usize
    }

    /// Instances one invoke of `call` may need at once: one per level at
    /// which this filter can be on the stack.
    pub(crate) fn need(&self, call: CallKind, stream: bool) -> usize {
        let token = if stream {
            self.has(Hook::TokenTransform)
        } else {
            0
        };
        let chat = self.has(Hook::AroundChat) + token;
        match call {
            CallKind::Chat => chat,
            CallKind::Tool => self.has(Hook::AroundTool),
            CallKind::Turn => self.has(Hook::AroundTurn) + chat.max(self.has(Hook::AroundTool)),
        }
    }

    /// A ready instance: a warm one if this filter keeps them, else fresh.
    pub(crate) async fn instantiate(&self) -> Result<FilterInstance, ChainError> {
        if self.isolation == Isolation::Warm {
            let idle = self
                .warm
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop();
            if let Some(instance) = idle {
                self.engine.inner.warm_idle.fetch_sub(1, Ordering::Relaxed);
                return Ok(instance);
            }
        }
        FilterInstance::create(&self.blueprint).await
    }

    /// Takes back an ended invoke's idle instances: kept if warm and the
    /// engine's warm budget allows, else dropped.
    pub(crate) fn reclaim(&self, instances: Vec<FilterInstance>) {
        if self.isolation != Isolation::Warm {
            return;
        }
        let engine = &self.engine.inner;
        let mut warm = self.warm.lock().unwrap_or_else(PoisonError::into_inner);
        for instance in instances {
            let kept = engine
                .warm_idle
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                    (n < engine.warm_cap).then_some(n + 1)
                })
                .is_ok();
            if !kept {
                break;
            }
            warm.push(instance);
        }
    }

    /// Runs this filter's hook for chain `K` as layer `id` of an invoke.
    pub(crate) async fn around<K: WasmChain>(
        &self,
        id: usize,
        request: K::Request,
        next: Next<K>,
    ) -> K::Output {
        let invoke = next.invoke().clone();
        let mut leased = match Leased::take(&invoke, id, self).await {
            Ok(leased) => leased,
            Err(error) => return K::fail(error),
        };
        let limits = self.blueprint.limits;
        let call = leased
            .instance()
            .around::<K>(id, request, next, &limits, self.blueprint.budget);
        let result = match limits.timeout() {
            Some(timeout) => tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| {
                    Err(sandbox::timed_out(
                        &limits,
                        self.blueprint.identity.origin(K::HOOK.as_str()),
                    ))
                }),
            None => call.await,
        };
        match result {
            Ok(output) => {
                leased.release();
                output
            }
            // `leased` drops here: a faulted instance is never reused.
            Err(error) => K::fail(error),
        }
    }

    /// A fresh token transformer for one stream of `invoke`.
    pub(crate) async fn transformer(
        self: &Arc<Self>,
        id: usize,
        invoke: &Arc<Invoke>,
    ) -> Result<WasmTransformer, ChainError> {
        let mut leased = Leased::take(invoke, id, self).await?;
        let resource = leased
            .instance()
            .transformer(
                invoke.clone(),
                id,
                &self.blueprint.limits,
                self.blueprint.budget,
            )
            .await?;
        Ok(WasmTransformer {
            filter: self.clone(),
            id,
            leased,
            resource,
        })
    }
}

/// A wasm filter's token transformer for one stream, holding its instance.
pub(crate) struct WasmTransformer {
    filter: Arc<WasmFilter>,
    id: usize,
    leased: Leased,
    resource: ResourceAny,
}

impl WasmTransformer {
    async fn call(&mut self, tokens: Option<TokenBatch>) -> Result<TokenBatch, ChainError> {
        let blueprint = &self.filter.blueprint;
        if self.leased.is_poisoned() {
            return Err(ChainError::new(
                crate::error::ErrorKind::PluginFault,
                "faulted earlier in this stream",
            )
            .at(blueprint.identity.origin("step")));
        }
        let invoke = self.leased.invoke().clone();
        let call = self.leased.instance().transform(
            invoke,
            self.id,
            self.resource,
            tokens,
            &blueprint.limits,
            blueprint.budget,
        );
        let result = match blueprint.limits.timeout() {
            Some(timeout) => tokio::time::timeout(timeout, call)
                .await
                .unwrap_or_else(|_| {
                    Err(sandbox::timed_out(
                        &blueprint.limits,
                        blueprint.identity.origin("step"),
                    ))
                }),
            None => call.await,
        };
        match result {
            Ok(output) => output,
            Err(fault) => {
                // The store is poisoned: make sure the instance is dropped,
                // not returned, whatever the caller does next.
                self.leased.poison();
                Err(fault)
            }
        }
    }

    pub(crate) async fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError> {
        self.call(Some(tokens)).await
    }

    pub(crate) async fn flush(&mut self) -> Result<TokenBatch, ChainError> {
        self.call(None).await
    }

    /// Drops the transformer in the guest and returns the instance.
    pub(crate) async fn close(mut self) {
        if self.leased.is_poisoned() {
            return;
        }
        let blueprint = &self.filter.blueprint;
        let dropped = self
            .leased
            .instance()
            .drop_transformer(self.resource, &blueprint.limits, blueprint.budget)
            .await;
        if dropped.is_ok() {
            self.leased.release();
        }
    }
}
