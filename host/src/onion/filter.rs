//! What a filter is to the onion: its hooks, its private context (FCtx),
//! and the one trait every filter implements, native or sandboxed.

use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{ChainKind, Chat, Invoke, Next, TokenTransform, Tool, Turn};
use crate::context::Context;
use crate::types::{
    Call, ChainError, ChatRequest, ChatResponse, ToolRequest, ToolResponse, TurnRequest, TurnResult,
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
/// A filter: one layer of each chain whose hook it has, plus a token
/// transform and a system-prompt shaper. Native filters (Rust code run in
/// the host, for embedders and as the baseline wasm filters are measured
/// against) and wasm filters ([`WasmFilter`](crate::WasmFilter), each run
/// in its sandbox) implement it alike, with the same onion semantics. Each
/// around hook gets the rest of the chain as [`Next`], which also holds
/// the filter's FCtx; the other hooks get the same through a
/// [`FilterScope`].
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

    /// Shapes the system prompt, once per invoke, before any model call
    /// (see the WIT `system-prompt-filter`): takes the prompt so far and
    /// returns it changed.
    async fn system_prompt(
        &self,
        prompt: String,
        scope: &FilterScope,
    ) -> Result<String, ChainError> {
        let _ = scope;
        Ok(prompt)
    }

    /// A fresh token transform for one model stream of the invoke `scope`
    /// belongs to; `None` to leave the stream as it is.
    async fn token_transform(
        &self,
        scope: &FilterScope,
    ) -> Result<Option<Box<dyn TokenTransform>>, ChainError> {
        let _ = scope;
        Ok(None)
    }
}

/// A filter's place in one invoke outside the chains (its system-prompt
/// and token-transform hooks): its private context and the shared context.
pub struct FilterScope {
    invoke: Arc<Invoke>,
    id: usize,
}

impl FilterScope {
    pub(crate) fn new(invoke: Arc<Invoke>, id: usize) -> Self {
        FilterScope { invoke, id }
    }

    /// The invoke's shared context.
    pub fn context(&self) -> &Context {
        self.invoke.context()
    }

    /// The filter's private context: its latest state in this invoke, or
    /// its init.
    pub fn fctx(&self) -> Fctx {
        self.invoke.fctx(None, self.id)
    }

    /// Replaces the filter's private context.
    pub fn set_fctx(&self, fctx: impl Into<Fctx>) {
        self.invoke
            .set_fctx_within(None, self.id, fctx.into(), usize::MAX);
    }

    pub(crate) fn invoke(&self) -> &Arc<Invoke> {
        &self.invoke
    }

    /// The filter's position in the invoke's filter list.
    pub(crate) fn id(&self) -> usize {
        self.id
    }
}

/// The innermost part of a chain: the model, the tool registry, the loop.
#[async_trait]
pub trait Terminal<K: ChainKind>: Send + Sync + 'static {
    /// Runs the request. `invoke` gives, for the turn terminal, the chat
    /// and tool chains of the same invoke. `context` is the shared context
    /// this call reads and writes: the invoke's, or, for a call in a batch
    /// of tool calls, the call's own view of it, folded into the invoke's
    /// when the batch ends.
    async fn call(&self, request: K::Request, invoke: &Arc<Invoke>, context: &Context)
    -> K::Output;
}
