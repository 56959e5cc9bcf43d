//! The onion: an ordered list of filters composed around a terminal, one
//! chain for each kind of call (chat, tool, turn).
//!
//! Earlier in the list is outer: its "before" part runs first and its
//! "after" part last. A filter without a hook for a chain is not in that
//! chain at all. Each layer receives the request and [`Next`], the rest
//! of the chain; it may call `next` zero times
//! (short-circuit), once, or several times (retry). Through `Next` it also
//! reaches its private context (FCtx), kept by the invoke. Composition
//! happens once per kernel; a call only walks the list.
//!
//! This module owns composition and the life of a call through it: an
//! [`Invoke`] (`invoke`) and the token transforms of a stream
//! (`token_transform`). It knows nothing of wasm: a sandboxed layer is a [`Guest`], which
//! `plugin::WasmFilter` implements.

mod approval;
mod invoke;
mod token_transform;

pub use approval::{ApprovalRequest, Approver};
pub(crate) use invoke::{Before, Branch, tool_context};
pub use invoke::{Invoke, InvokeOptions};
pub use token_transform::{TokenSink, TokenStream, TokenTransform};

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use crate::context::{Context, Reducers};
use crate::types::{
    Call, ChainError, ChatRequest, ChatResponse, ErrorKind, FinishReason, Origin, ResponseLimits,
    TokenBatch, ToolRequest, ToolResponse, ToolSpec, TurnRequest, TurnResult,
};

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

    /// The failure in `output`, if it is one.
    #[doc(hidden)]
    fn failure(output: &mut Self::Output) -> Option<&mut ChainError>;

    #[doc(hidden)]
    fn around_native<'a>(
        filter: &'a dyn Filter,
        request: Self::Request,
        next: Next<Self>,
    ) -> BoxFuture<'a, Self::Output>;

    #[doc(hidden)]
    fn around_guest(
        filter: Arc<dyn Guest>,
        id: usize,
        request: Self::Request,
        next: Next<Self>,
    ) -> BoxFuture<'static, Self::Output>;
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

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        output.as_mut().err()
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: ChatRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_chat(r, n)
    }

    fn around_guest(
        f: Arc<dyn Guest>,
        id: usize,
        r: ChatRequest,
        n: Next<Self>,
    ) -> BoxFuture<'static, Self::Output> {
        f.around_chat(id, r, n)
    }
}

impl ChainKind for Tool {
    type Request = ToolRequest;
    type Output = Result<ToolResponse, ChainError>;
    const HOOK: Hook = Hook::AroundTool;

    fn fail(error: ChainError) -> Self::Output {
        Err(error)
    }

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        output.as_mut().err()
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: ToolRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_tool(r, n)
    }

    fn around_guest(
        f: Arc<dyn Guest>,
        id: usize,
        r: ToolRequest,
        n: Next<Self>,
    ) -> BoxFuture<'static, Self::Output> {
        f.around_tool(id, r, n)
    }
}

impl ChainKind for Turn {
    type Request = TurnRequest;
    type Output = TurnResult;
    const HOOK: Hook = Hook::AroundTurn;

    fn fail(error: ChainError) -> Self::Output {
        TurnResult::Error(error)
    }

    fn failure(output: &mut Self::Output) -> Option<&mut ChainError> {
        match output {
            TurnResult::Error(error) => Some(error),
            _ => None,
        }
    }

    fn around_native<'a>(
        f: &'a dyn Filter,
        r: TurnRequest,
        n: Next<Self>,
    ) -> BoxFuture<'a, Self::Output> {
        f.around_turn(r, n)
    }

    fn around_guest(
        f: Arc<dyn Guest>,
        id: usize,
        r: TurnRequest,
        n: Next<Self>,
    ) -> BoxFuture<'static, Self::Output> {
        f.around_turn(id, r, n)
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
    /// an invoke: an empty object unless overridden.
    fn init_fctx(&self) -> Fctx {
        Fctx::from("{}")
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

/// A filter run in a sandbox rather than as the host's own code (a wasm
/// filter). The onion and the token chain call it through this; how it
/// runs, and what it holds per invoke, is its own business.
pub trait Guest: Send + Sync + 'static {
    /// Its around-chat hook, as filter `id` of the invoke `next` belongs to.
    fn around_chat(
        self: Arc<Self>,
        id: usize,
        request: ChatRequest,
        next: Next<Chat>,
    ) -> BoxFuture<'static, Result<ChatResponse, ChainError>>;

    /// Its around-tool hook.
    fn around_tool(
        self: Arc<Self>,
        id: usize,
        request: ToolRequest,
        next: Next<Tool>,
    ) -> BoxFuture<'static, Result<ToolResponse, ChainError>>;

    /// Its around-turn hook.
    fn around_turn(
        self: Arc<Self>,
        id: usize,
        request: TurnRequest,
        next: Next<Turn>,
    ) -> BoxFuture<'static, TurnResult>;

    /// Its system-prompt hook, as filter `id` of `invoke`.
    fn system_prompt<'a>(
        &'a self,
        id: usize,
        invoke: &'a Arc<Invoke>,
        prompt: String,
    ) -> BoxFuture<'a, Result<String, ChainError>>;

    /// A fresh token transformer for one stream of `invoke`.
    fn transformer<'a>(
        self: Arc<Self>,
        id: usize,
        invoke: &'a Arc<Invoke>,
    ) -> BoxFuture<'a, Result<Box<dyn GuestTransform>, ChainError>>;
}

/// A [`Guest`]'s token transformer for one stream.
pub trait GuestTransform: Send {
    /// Takes the next tokens and returns 0..N tokens for each.
    fn step(&mut self, tokens: TokenBatch) -> BoxFuture<'_, Result<TokenBatch, ChainError>>;
    /// The stream ended normally, the model having stopped for `end`:
    /// what is still buffered.
    fn flush(&mut self, end: FinishReason) -> BoxFuture<'_, Result<TokenBatch, ChainError>>;
    /// The stream is over: releases what the transformer holds.
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// A filter in a chain.
#[derive(Clone)]
pub(crate) enum LayerFilter {
    Native(Arc<dyn Filter>),
    Guest(Arc<dyn Guest>),
}

/// A filter of a kernel, native or sandboxed.
pub(crate) struct Entry {
    pub name: Arc<str>,
    pub hooks: Vec<Hook>,
    pub init: Fctx,
    pub filter: LayerFilter,
}

/// The composed kernel, shared by every invoke.
pub(crate) struct Core {
    pub filters: Vec<Entry>,
    pub chat: Arc<Chain<Chat>>,
    pub tool: Arc<Chain<Tool>>,
    pub turn: Arc<Chain<Turn>>,
    /// Filters with a token transform, in order.
    pub token_layers: Vec<usize>,
    /// The registered tools' specs, offered to the model by the tool loop.
    pub tools: Vec<Arc<ToolSpec>>,
    /// Who answers the `approval` import; `None` denies every question.
    pub approver: Option<Arc<dyn Approver>>,
    /// Bounds on an answer of the chat chain, the model's or a filter's.
    pub response_limits: ResponseLimits,
    /// How the tools' writes to shared-context keys combine.
    pub reducers: Reducers,
}

impl Core {
    /// Composes the onions of `filters` over their terminals.
    pub(crate) fn compose(
        filters: Vec<Entry>,
        chat: Arc<dyn Terminal<Chat>>,
        tool: Arc<dyn Terminal<Tool>>,
        turn: Arc<dyn Terminal<Turn>>,
        tools: Vec<Arc<ToolSpec>>,
    ) -> Self {
        Core {
            chat: chain(&filters, chat),
            tool: chain(&filters, tool),
            turn: chain(&filters, turn),
            token_layers: filters
                .iter()
                .enumerate()
                .filter(|(_, entry)| entry.hooks.contains(&Hook::TokenTransform))
                .map(|(id, _)| id)
                .collect(),
            filters,
            tools,
            approver: None,
            response_limits: ResponseLimits::default(),
            reducers: Reducers::default(),
        }
    }

    /// Runs the system-prompt pipeline of `invoke`: the system messages
    /// the model gets. Without filters with the hook, one per prompt of
    /// `prompts`, as given; with them, `prompts` joined by blank lines go
    /// through each in order, and the text they return is one message.
    pub(crate) async fn system_prompts(
        &self,
        invoke: &Arc<Invoke>,
        prompts: Vec<String>,
    ) -> Result<Vec<String>, ChainError> {
        let shapes = |entry: &Entry| entry.hooks.contains(&Hook::SystemPrompt);
        if !self.filters.iter().any(shapes) {
            return Ok(prompts.into_iter().filter(|p| !p.is_empty()).collect());
        }
        let mut prompt = prompts.join("\n\n");
        for (id, entry) in self.filters.iter().enumerate() {
            if !shapes(entry) {
                continue;
            }
            prompt = match &entry.filter {
                LayerFilter::Native(filter) => filter.system_prompt(prompt).await?,
                LayerFilter::Guest(filter) => filter.system_prompt(id, invoke, prompt).await?,
            };
        }
        Ok(if prompt.is_empty() {
            Vec::new()
        } else {
            vec![prompt]
        })
    }
}

/// The layers of chain `K`: the filters with its hook, in order.
fn chain<K: ChainKind>(filters: &[Entry], terminal: Arc<dyn Terminal<K>>) -> Arc<Chain<K>> {
    let layers = filters
        .iter()
        .enumerate()
        .filter(|(_, entry)| entry.hooks.contains(&K::HOOK))
        .map(|(id, entry)| Layer {
            id,
            filter: entry.filter.clone(),
        })
        .collect();
    Arc::new(Chain { layers, terminal })
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
            Err(_) => {
                let error = ChainError::new(
                    ErrorKind::Timeout,
                    format!(
                        "the inner call did not finish within {} ms",
                        timeout.as_millis()
                    ),
                );
                // The deadline is the calling filter's.
                K::fail(match self.caller() {
                    Some(filter) => error.at(Origin {
                        filter: filter.into(),
                        plugin: None,
                        call: K::HOOK.into(),
                    }),
                    None => error,
                })
            }
        }
    }

    /// The name of the native filter this is the rest of the chain of.
    fn caller(&self) -> Option<&str> {
        match &self.chain.layers.get(self.index.checked_sub(1)?)?.filter {
            LayerFilter::Native(filter) => Some(filter.name()),
            LayerFilter::Guest(_) => None,
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
            // Charged like a guest's write (a native filter has no cap), so
            // a batch's fold gives back what each of its calls held.
            self.invoke
                .set_fctx_within(self.branch.as_deref(), id, fctx.into(), usize::MAX);
        }
    }

    /// The invoke this call belongs to.
    pub fn invoke(&self) -> &Arc<Invoke> {
        &self.invoke
    }

    async fn run(self, request: K::Request) -> K::Output {
        let Some(layer) = self.chain.layers.get(self.index) else {
            // A terminal's panic (a custom one, or a host bug) is its own
            // error, not blamed on the native filter around it.
            let call = self.chain.terminal.call(request, &self.invoke);
            let terminal = match K::HOOK {
                Hook::AroundChat => "model",
                Hook::AroundTool => "tools",
                _ => "turn",
            };
            let mut output = match AssertUnwindSafe(call).catch_unwind().await {
                Ok(output) => output,
                Err(panic) => {
                    let error = panicked(terminal, Call::Terminal, &*panic);
                    K::fail(ChainError {
                        kind: ErrorKind::Internal,
                        ..error
                    })
                }
            };
            // Every error names where it came from: a terminal's own,
            // unless it says which part of it failed.
            if let Some(error) = K::failure(&mut output)
                && error.origin.is_none()
            {
                error.origin = Some(Origin::terminal(terminal));
            }
            return output;
        };
        let next = Next {
            index: self.index + 1,
            layer: Some(layer.id),
            ..self.clone()
        };
        match &layer.filter {
            // A native filter is the embedder's code: its panic fails this
            // call with an error naming it, as a guest's trap does, and
            // the layers around it see an error like any other.
            LayerFilter::Native(filter) => {
                let call = K::around_native(filter.as_ref(), request, next);
                match AssertUnwindSafe(call).catch_unwind().await {
                    Ok(output) => output,
                    Err(panic) => K::fail(panicked(filter.name(), K::HOOK.into(), &*panic)),
                }
            }
            LayerFilter::Guest(filter) => {
                K::around_guest(filter.clone(), layer.id, request, next).await
            }
        }
    }
}

/// The error a native filter's (or a terminal's) panic in `call` becomes.
fn panicked(filter: &str, call: Call, panic: &(dyn std::any::Any + Send)) -> ChainError {
    let said = panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic");
    let origin = Origin {
        filter: filter.into(),
        plugin: None,
        call,
    };
    ChainError::new(ErrorKind::PluginFault, format!("panicked: {said}")).at(origin)
}
