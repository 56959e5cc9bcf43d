//! The onion: an ordered list of filters composed around a terminal, one
//! chain for each kind of call (chat, tool, turn).
//!
//! Earlier in the list is outer: its "before" part runs first and its
//! "after" part last. A filter without a hook for a chain is not in that
//! chain at all. Each layer receives the request, its private context
//! [`Next`], the rest of the chain; it may call `next` zero times
//! (short-circuit), once, or several times (retry). Through `Next` it also
//! reaches its private context (FCtx), kept by the invoke. Composition
//! happens once per kernel; a call only walks the list.
//!
//! This module owns composition. It knows nothing of wasm: wasm layers are
//! dispatched to `plugin::WasmFilter`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::context::Context;
use crate::error::{Call, ChainError, ErrorKind};
use crate::invoke::{Branch, Invoke};
use crate::plugin::WasmFilter;
use crate::token_transform::TokenTransform;
use crate::types::{ChatRequest, ChatResponse, ToolRequest, ToolResponse, TurnRequest, TurnResult};

/// A filter hook: what a filter may implement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Hook {
    /// Around one model call.
    AroundChat,
    /// Around one tool execution.
    AroundTool,
    /// Around one agent turn.
    AroundTurn,
    /// A streaming transform of the model's tokens.
    TokenTransform,
    /// Shapes the system prompt, once per invoke.
    SystemPrompt,
}

impl Hook {
    /// Every hook, in contract order.
    pub const ALL: [Hook; 5] = [
        Hook::AroundChat,
        Hook::AroundTool,
        Hook::AroundTurn,
        Hook::TokenTransform,
        Hook::SystemPrompt,
    ];

    /// The kebab-case name used in the WIT contract.
    pub fn as_str(self) -> &'static str {
        match self {
            Hook::AroundChat => "around-chat",
            Hook::AroundTool => "around-tool",
            Hook::AroundTurn => "around-turn",
            Hook::TokenTransform => "token-transform",
            Hook::SystemPrompt => "system-prompt",
        }
    }
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<Hook> for Call {
    fn from(hook: Hook) -> Self {
        match hook {
            Hook::AroundChat => Call::AroundChat,
            Hook::AroundTool => Call::AroundTool,
            Hook::AroundTurn => Call::AroundTurn,
            Hook::TokenTransform => Call::TokenTransform,
            Hook::SystemPrompt => Call::SystemPrompt,
        }
    }
}

/// A filter's private context for one invoke, as JSON text.
pub type Fctx = Arc<str>;

/// One of the three onions: what its requests and outputs are.
pub trait ChainKind: Send + Sync + Sized + 'static {
    /// What goes in: a chat, tool or turn request.
    type Request: Clone + Send + Sync + 'static;
    /// What the chain returns: a `Result` for chat and tool, the
    /// [`TurnResult`] variant (which has its own error case) for turn.
    type Output: Send + 'static;
    /// The hook filters implement to join this chain.
    const HOOK: Hook;

    /// The output for a failure.
    fn fail(error: ChainError) -> Self::Output;

    #[doc(hidden)]
    fn around_native<'a>(
        filter: &'a dyn Filter,
        request: Self::Request,
        next: Next<Self>,
    ) -> BoxFuture<'a, Self::Output>;

    #[doc(hidden)]
    fn around_wasm(
        filter: Arc<WasmFilter>,
        id: usize,
        request: Self::Request,
        next: Next<Self>,
    ) -> impl Future<Output = Self::Output> + Send + 'static;
}

/// The chat chain: around one model call.
pub enum Chat {}
/// The tool chain: around one tool execution.
pub enum Tool {}
/// The turn chain: around one whole agent turn (the tool loop).
pub enum Turn {}

impl ChainKind for Chat {
    type Request = ChatRequest;
    type Output = Result<ChatResponse, ChainError>;
    const HOOK: Hook = Hook::AroundChat;

    fn fail(error: ChainError) -> Self::Output {
        Err(error)
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: ChatRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_chat(r, n)
    }

    async fn around_wasm(
        f: Arc<WasmFilter>,
        id: usize,
        r: ChatRequest,
        n: Next<Self>,
    ) -> Self::Output {
        f.around::<Self>(id, r, n).await
    }
}

impl ChainKind for Tool {
    type Request = ToolRequest;
    type Output = Result<ToolResponse, ChainError>;
    const HOOK: Hook = Hook::AroundTool;

    fn fail(error: ChainError) -> Self::Output {
        Err(error)
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: ToolRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_tool(r, n)
    }

    async fn around_wasm(
        f: Arc<WasmFilter>,
        id: usize,
        r: ToolRequest,
        n: Next<Self>,
    ) -> Self::Output {
        f.around::<Self>(id, r, n).await
    }
}

impl ChainKind for Turn {
    type Request = TurnRequest;
    type Output = TurnResult;
    const HOOK: Hook = Hook::AroundTurn;

    fn fail(error: ChainError) -> Self::Output {
        TurnResult::Error(error)
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: TurnRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_turn(r, n)
    }

    async fn around_wasm(
        f: Arc<WasmFilter>,
        id: usize,
        r: TurnRequest,
        n: Next<Self>,
    ) -> Self::Output {
        f.around::<Self>(id, r, n).await
    }
}

/// A filter written in Rust and run natively in the host: the same onion
/// semantics as a wasm filter, without the sandbox. For embedders, and the
/// baseline wasm filters are measured against. Each hook gets the rest of
/// the chain as [`Next`], which also holds the filter's FCtx.
#[async_trait]
pub trait Filter: Send + Sync + 'static {
    /// The filter's name: its identity in errors and the key of its FCtx.
    fn name(&self) -> &str;

    /// The chains it joins. By default all of them: a hook it does not
    /// implement passes through, so no override is ever dropped for a
    /// missing entry. Override it only to leave chains out (each skipped
    /// layer saves a fraction of a microsecond), and then list every hook
    /// you implement.
    fn hooks(&self) -> &[Hook] {
        &Hook::ALL
    }

    /// The FCtx seed (JSON), used the first time the filter is entered in
    /// an invoke.
    fn init_fctx(&self) -> Fctx {
        Fctx::from("null")
    }

    /// Around one model call. `next` calls the inner layers and gives this
    /// filter's FCtx ([`Next::fctx`]) and the shared context.
    async fn around_chat(
        &self,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> Result<ChatResponse, ChainError> {
        next.call(request).await
    }

    /// Around one tool execution.
    async fn around_tool(
        &self,
        request: ToolRequest,
        next: Next<Tool>,
    ) -> Result<ToolResponse, ChainError> {
        next.call(request).await
    }

    /// Around one agent turn.
    async fn around_turn(&self, request: TurnRequest, next: Next<Turn>) -> TurnResult {
        next.call(request).await
    }

    /// Shapes the system prompt, once per invoke (see the WIT
    /// `system-prompt-filter`).
    async fn system_prompt(&self, prompt: String) -> Result<String, ChainError> {
        Ok(prompt)
    }

    /// A fresh token transform for one model stream.
    fn token_transform(&self) -> Option<Box<dyn TokenTransform>> {
        None
    }
}

/// The innermost part of a chain: the model, the tool registry, the loop.
#[async_trait]
pub trait Terminal<K: ChainKind>: Send + Sync + 'static {
    /// Runs the request. `invoke` gives the shared context and, for the
    /// turn terminal, the chat and tool chains of the same invoke.
    async fn call(&self, request: K::Request, invoke: &Arc<Invoke>) -> K::Output;
}

/// A filter in a chain.
#[derive(Clone)]
pub(crate) enum LayerFilter {
    Native(Arc<dyn Filter>),
    Wasm(Arc<WasmFilter>),
}

/// One layer of a chain; `id` is the filter's position in the kernel's
/// filter list, which keys its FCtx and its instance lease.
#[derive(Clone)]
pub(crate) struct Layer {
    pub id: usize,
    pub filter: LayerFilter,
}

/// A composed chain: its layers, outermost first, over a terminal.
pub(crate) struct Chain<K: ChainKind> {
    pub layers: Vec<Layer>,
    pub terminal: Arc<dyn Terminal<K>>,
}

/// The rest of the chain, as seen from inside a layer; also the layer's
/// access to its private context and the invoke's shared context.
pub struct Next<K: ChainKind> {
    chain: Arc<Chain<K>>,
    index: usize,
    /// The filter whose hook holds this `Next`; `None` outside any layer.
    layer: Option<usize>,
    invoke: Arc<Invoke>,
    /// The batch branch private contexts are read and written in, for a
    /// call of a concurrent tool batch.
    branch: Option<Arc<Branch>>,
}

impl<K: ChainKind> Clone for Next<K> {
    fn clone(&self) -> Self {
        Next {
            chain: self.chain.clone(),
            index: self.index,
            layer: self.layer,
            invoke: self.invoke.clone(),
            branch: self.branch.clone(),
        }
    }
}

impl<K: ChainKind> Next<K> {
    /// The whole chain, from its outermost layer.
    pub(crate) fn start(chain: Arc<Chain<K>>, invoke: Arc<Invoke>) -> Self {
        Next {
            chain,
            index: 0,
            layer: None,
            invoke,
            branch: None,
        }
    }

    /// The same, reading and writing private contexts in `branch`.
    pub(crate) fn in_branch(mut self, branch: Arc<Branch>) -> Self {
        self.branch = Some(branch);
        self
    }

    /// The batch branch this call runs in, if any.
    pub(crate) fn branch(&self) -> Option<&Arc<Branch>> {
        self.branch.as_ref()
    }

    /// Calls the inner layers and the terminal.
    pub fn call(&self, request: K::Request) -> BoxFuture<'static, K::Output> {
        let this = self.clone();
        Box::pin(async move { this.run(request).await })
    }

    /// Calls the inner layers, giving up with a `timeout` error after
    /// `timeout`; the inner call is cancelled.
    pub async fn call_within(&self, request: K::Request, timeout: Duration) -> K::Output {
        match tokio::time::timeout(timeout, self.call(request)).await {
            Ok(output) => output,
            Err(_) => K::fail(ChainError::new(
                ErrorKind::Timeout,
                format!(
                    "the inner call did not finish within {} ms",
                    timeout.as_millis()
                ),
            )),
        }
    }

    /// The invoke's shared context.
    pub fn context(&self) -> &Context {
        self.invoke.context()
    }

    /// The calling filter's private context: its latest state in this
    /// invoke, or its init. `None` outside a filter.
    pub fn fctx(&self) -> Option<Fctx> {
        self.layer
            .map(|id| self.invoke.fctx(self.branch.as_deref(), id))
    }

    /// Replaces the calling filter's private context.
    pub fn set_fctx(&self, fctx: impl Into<Fctx>) {
        if let Some(id) = self.layer {
            self.invoke
                .set_fctx(self.branch.as_deref(), id, fctx.into());
        }
    }

    /// The invoke this call belongs to.
    pub fn invoke(&self) -> &Arc<Invoke> {
        &self.invoke
    }

    async fn run(self, request: K::Request) -> K::Output {
        let Some(layer) = self.chain.layers.get(self.index) else {
            return self.chain.terminal.call(request, &self.invoke).await;
        };
        let next = Next {
            index: self.index + 1,
            layer: Some(layer.id),
            ..self.clone()
        };
        match &layer.filter {
            LayerFilter::Native(filter) => K::around_native(filter.as_ref(), request, next).await,
            LayerFilter::Wasm(filter) => {
                K::around_wasm(filter.clone(), layer.id, request, next).await
            }
        }
    }
}
