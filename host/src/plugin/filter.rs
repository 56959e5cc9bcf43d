//! A configured wasm filter: a plugin, its name, configuration, limits,
//! grants and isolation mode, and the instances it runs in.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;
use wasmtime::component::ResourceAny;

use async_trait::async_trait;
use tracing::Instrument;

use super::Grants;
use super::Plugin;
use super::admission::Checkout;
use super::host::{Identity, Scope};
use super::instance::{
    Description, Fault, FilterInstance, InstanceTemplate, TransformInput, WasmChain,
};
use super::stats::FilterStats;
use crate::engine::Engine;
use crate::onion::{Chat, Fctx, Filter, FilterScope, Hook, Next, TokenTransform, Tool, Turn};
use crate::sandbox::{self, Limits};
use crate::types::{
    Call, ChainError, ChatRequest, ChatResponse, ErrorKind, FinishReason, TokenBatch, ToolRequest,
    ToolResponse, TurnRequest, TurnResult,
};

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
    template: InstanceTemplate,
    description: Description,
    isolation: Isolation,
    engine: Engine,
    spares: Mutex<Spares>,
    /// Instances of this filter in use at once, at most `Limits::instances`.
    quota: Arc<Semaphore>,
    /// Orders filters for admission, so every invoke takes quotas in the
    /// same order.
    ordinal: u64,
}

/// The next filter's ordinal.
static ORDINAL: AtomicU64 = AtomicU64::new(0);

/// Instances not in use: idle `warm` ones or prepared fresh ones, and the
/// used ones of `invoke` filters waiting to be dropped.
#[derive(Default)]
struct Spares {
    ready: Vec<FilterInstance>,
    retired: Vec<FilterInstance>,
    refilling: bool,
}

/// At most this many used instances wait to be dropped in the background;
/// beyond it they are dropped on the spot.
const RETIRED_CAP: usize = 64;

impl WasmFilter {
    pub(crate) fn new(
        name: Arc<str>,
        plugin: Arc<Plugin>,
        template: InstanceTemplate,
        description: Description,
        isolation: Isolation,
        engine: Engine,
    ) -> Self {
        WasmFilter {
            name,
            plugin,
            quota: Arc::new(Semaphore::new(template.limits.instances as usize)),
            ordinal: ORDINAL.fetch_add(1, Ordering::Relaxed),
            template,
            description,
            isolation,
            engine,
            spares: Mutex::new(Spares::default()),
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

    /// The name the plugin gives itself: shown, never trusted (the
    /// filter's [`name`](Self::name) is the operator's or its file's).
    pub fn declared_name(&self) -> &str {
        &self.description.name
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
        &self.template.limits
    }

    /// The capabilities granted.
    pub fn grants(&self) -> &Grants {
        &self.template.grants
    }

    /// What it did so far: calls and its own CPU time by call, its own
    /// errors by kind, tokens through its transformers, its instances
    /// ready and in use now, and the metrics it declared. Starts from zero for each loaded
    /// filter (a reload makes new ones).
    pub fn stats(&self) -> FilterStats {
        let stats = &self.template.identity.stats;
        let (tokens_in, tokens_out) = stats.token_counts();
        let quota = self.template.limits.instances as usize;
        FilterStats {
            name: self.name.to_string(),
            calls: stats.calls(),
            tokens_in,
            tokens_out,
            instances_ready: self.spares().ready.len(),
            instances_in_use: quota.saturating_sub(self.quota.available_permits()),
            metrics: stats.metrics.snapshot(),
        }
    }

    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Linear memory of the instances it keeps ready (idle `warm` ones,
    /// prepared fresh ones), in bytes: what its guest code holds between
    /// invokes.
    pub fn guest_memory(&self) -> usize {
        self.spares().ready.iter().map(FilterInstance::memory).sum()
    }

    /// The semaphore of this filter's instance quota.
    pub(crate) fn quota(&self) -> &Arc<Semaphore> {
        &self.quota
    }

    pub(crate) fn ordinal(&self) -> u64 {
        self.ordinal
    }

    /// A ready instance. A `warm` filter reuses an idle one; an `invoke`
    /// filter takes a fresh one prepared ahead of demand, and starts making
    /// its replacement in the background, off the request path.
    pub(crate) async fn instantiate(self: &Arc<Self>) -> Result<FilterInstance, ChainError> {
        let spare = self.spares().ready.pop();
        if spare.is_some() {
            self.engine.release_idle(1);
        }
        if self.isolation == Isolation::Invoke {
            self.refill();
        }
        match spare {
            Some(instance) => Ok(instance),
            None => FilterInstance::create(&self.template).await,
        }
    }

    fn spares(&self) -> MutexGuard<'_, Spares> {
        self.spares.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes back an ended invoke's instances: a `warm` filter keeps them
    /// for reuse while the engine's idle budget allows, unless one has
    /// grown past half its memory cap (a runtime whose heap only grows,
    /// like componentize-js's, would otherwise reach the cap and crash: it
    /// is replaced by a fresh one instead); an `invoke` filter retires them
    /// (they saw request data) and drops them in the background.
    pub(crate) fn reclaim(self: &Arc<Self>, instances: Vec<FilterInstance>) {
        if instances.is_empty() {
            return;
        }
        if self.isolation == Isolation::Warm {
            let grown = (self.template.limits.memory_mib as usize) << 19;
            for instance in instances {
                if instance.memory() > grown || !self.engine.reserve_idle() {
                    continue;
                }
                self.spares().ready.push(instance);
            }
            return;
        }
        let mut spares = self.spares();
        let room = RETIRED_CAP.saturating_sub(spares.retired.len());
        spares.retired.extend(instances.into_iter().take(room));
        drop(spares);
        self.refill();
    }

    /// Starts the background task that drops retired instances and prepares
    /// fresh ones, unless it is running or there is no runtime to run it.
    fn refill(self: &Arc<Self>) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if std::mem::replace(&mut self.spares().refilling, true) {
            return;
        }
        let filter = self.clone();
        runtime.spawn(async move {
            loop {
                let (retired, wanted) = {
                    let mut spares = filter.spares();
                    let wanted = spares.ready.len() < filter.engine.prepared();
                    (std::mem::take(&mut spares.retired), wanted)
                };
                drop(retired);
                if wanted && filter.engine.reserve_idle() {
                    match FilterInstance::create(&filter.template).await {
                        Ok(instance) => filter.spares().ready.push(instance),
                        Err(_) => {
                            // The next request makes its own instance and
                            // reports the error; stop preparing meanwhile.
                            filter.engine.release_idle(1);
                            filter.spares().refilling = false;
                            return;
                        }
                    }
                    tokio::task::yield_now().await;
                    continue;
                }
                let mut spares = filter.spares();
                if spares.retired.is_empty() {
                    spares.refilling = false;
                    return;
                }
            }
        });
    }

    /// Runs this filter's hook for chain `K`, as the layer `next` is the
    /// rest of.
    async fn around<K: WasmChain>(&self, request: K::Request, next: Next<K>) -> K::Output {
        let id = next.layer().unwrap_or(usize::MAX);
        let invoke = next.invoke().clone();
        let mut checkout = match Checkout::take(&invoke, id, self).await {
            Ok(checkout) => checkout,
            Err(error) => return K::fail(error),
        };
        // The call's future is built in place in each branch: held in a
        // local and handed on, it would be stored twice in this future,
        // which every layer moves into its box.
        // A span per filter call (debug level: free unless a subscriber
        // wants it), inside the request's span.
        let call: Call = K::HOOK.into();
        let span = tracing::debug_span!("filter", name = &*self.name, call = call.as_str());
        let result = match self.template.limits.timeout() {
            None => checkout
                .instance()
                .around::<K>(id, request, next)
                .instrument(span)
                .await
                .map_err(ChainError::from),
            Some(timeout) => {
                let call = checkout.instance().around::<K>(id, request, next);
                self.bounded(
                    Box::pin(tokio::time::timeout(timeout, call).instrument(span)),
                    K::HOOK.into(),
                )
                .await
            }
        };
        match result {
            Ok(output) => {
                checkout.release();
                output
            }
            // `checkout` drops here: a faulted instance is never reused.
            Err(error) => K::fail(error),
        }
    }

    /// Waits for a hook call under its wall-clock bound, turning an
    /// elapsed bound into a timeout error.
    async fn bounded<T>(
        &self,
        call: impl Future<Output = Result<Result<T, Fault>, tokio::time::error::Elapsed>>,
        hook: Call,
    ) -> Result<T, ChainError> {
        let origin = || self.template.identity.origin(hook);
        match call.await {
            Ok(done) => done.map_err(ChainError::from),
            Err(_) => Err(sandbox::timed_out(&self.template.limits, origin())),
        }
    }
}

impl Drop for WasmFilter {
    /// Its ready instances go with it: their room in the engine's idle
    /// budget goes back (a set reloaded over and over must not use it up).
    fn drop(&mut self) {
        let ready = self.spares().ready.len();
        self.engine.release_idle(ready);
    }
}

#[async_trait]
impl Filter for WasmFilter {
    fn name(&self) -> &str {
        &self.name
    }

    fn hooks(&self) -> &[Hook] {
        &self.description.hooks
    }

    fn init_fctx(&self) -> Fctx {
        self.description.init.clone()
    }

    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        self.around(request, next).await
    }

    async fn around_tool(
        &self,
        request: ToolRequest,
        next: Next<Tool>,
    ) -> Result<ToolResponse, ChainError> {
        self.around(request, next).await
    }

    async fn around_turn(&self, request: TurnRequest, next: Next<Turn>) -> TurnResult {
        self.around(request, next).await
    }

    async fn system_prompt(
        &self,
        prompt: String,
        scope: &FilterScope,
    ) -> Result<String, ChainError> {
        let invoke = scope.invoke();
        let mut checkout = Checkout::take(invoke, scope.id(), self).await?;
        let instance = checkout.instance();
        let output = instance
            .system_prompt(invoke.clone(), scope.id(), &prompt)
            .await?;
        checkout.release();
        output
    }

    async fn token_transform(
        &self,
        scope: &FilterScope,
    ) -> Result<Option<Box<dyn TokenTransform>>, ChainError> {
        let (invoke, id) = (scope.invoke(), scope.id());
        let mut checkout = Checkout::take(invoke, id, self).await?;
        let resource = checkout.instance().transformer(invoke.clone(), id).await?;
        Ok(Some(Box::new(WasmTokenTransform {
            identity: self.template.identity.clone(),
            id,
            checkout,
            resource,
        })))
    }
}

/// A wasm filter's token transformer for one stream, holding its instance.
struct WasmTokenTransform {
    identity: Arc<Identity>,
    id: usize,
    checkout: Checkout,
    resource: ResourceAny,
}

impl WasmTokenTransform {
    /// A token step or the flush. A transform has no inner layers, so
    /// `timeout_ms` does not apply; its own budgets do.
    async fn call(&mut self, feed: TransformInput) -> Result<TokenBatch, ChainError> {
        if self.checkout.is_poisoned() {
            let error = ChainError::new(ErrorKind::PluginFault, "faulted earlier in this stream");
            return Err(error.at(self.identity.origin(Call::Step)));
        }
        let scope = Scope::outside_chains(self.checkout.invoke().clone(), self.id);
        match self
            .checkout
            .instance()
            .transform(scope, self.resource, feed)
            .await
        {
            Ok(output) => output,
            Err(fault) => {
                // The store is poisoned: make sure the instance is dropped,
                // not returned, whatever the caller does next.
                self.checkout.poison();
                Err(fault.into())
            }
        }
    }
}

#[async_trait]
impl TokenTransform for WasmTokenTransform {
    async fn step(&mut self, tokens: TokenBatch) -> Result<TokenBatch, ChainError> {
        self.call(TransformInput::Step(tokens)).await
    }

    async fn flush(&mut self, end: FinishReason) -> Result<TokenBatch, ChainError> {
        self.call(TransformInput::Flush(end)).await
    }

    /// Drops the transformer in the guest and returns the instance.
    async fn close(mut self: Box<Self>) {
        if self.checkout.is_poisoned() {
            return;
        }
        let dropped = self
            .checkout
            .instance()
            .drop_transformer(self.resource)
            .await;
        if dropped.is_ok() {
            self.checkout.release();
        }
    }
}
