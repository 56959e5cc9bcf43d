//! The [`Filter`] trait: one method per hook, each passing through by default.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::{
    ChatRequest, ChatResponse, FilterError, Hook, Next, PassThrough, TokenTransform, ToolRequest,
    ToolResponse, TurnRequest, TurnResult,
};

/// A shallot filter.
///
/// The implementing type is the filter's configuration: the host's JSON
/// config is deserialized into it (`null` or `{}` when the operator gives
/// none), then [`Filter::configure`] runs once per instance. Hooks take
/// `&self`: anything that must outlive one hook call belongs in the private
/// context ([`Next::fctx`]), never in the filter value, because the host may run
/// each invoke in a fresh instance.
///
/// Put `#[shallot_guest::filter]` on the impl block: it exports the
/// component, lists the hooks you wrote in the descriptor (the host skips
/// the others at no cost) and fills in `type State = ()` if you leave it out.
pub trait Filter: DeserializeOwned + Send + Sync + 'static {
    /// The private context (FCtx): one value per filter per invoke, the same
    /// in this filter's around-turn, around-chat and around-tool, kept across
    /// every round of the tool loop. Invisible to every other filter.
    type State: Serialize + DeserializeOwned + Default;

    /// Finishes the configuration once it is deserialized (compile patterns,
    /// check ranges). An error rejects the configuration when the plugin is
    /// loaded, with your message.
    fn configure(&mut self) -> Result<(), String> {
        Ok(())
    }

    /// Whether `hook`, which this filter implements, is live with this
    /// configuration. A hook that is not is skipped by the host at no cost;
    /// by default every implemented hook is live.
    fn wants(&self, hook: Hook) -> bool {
        let _ = hook;
        true
    }

    /// The FCtx seed, used the first time the filter is entered in an invoke.
    fn init(&self) -> Self::State {
        Self::State::default()
    }

    /// Around one model call. Call [`Next::chat`] zero times
    /// (short-circuit), once, or several times (retry).
    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<Self::State>,
    ) -> Result<ChatResponse, FilterError> {
        next.chat(request)
    }

    /// Around one tool execution.
    fn around_tool(
        &self,
        request: &ToolRequest,
        next: Next<Self::State>,
    ) -> Result<ToolResponse, FilterError> {
        next.tool(request)
    }

    /// Around a whole agent turn. Pass `Interrupt` and `Error` results
    /// through untouched; re-enter only on `Done`.
    fn around_turn(&self, request: &TurnRequest, next: Next<Self::State>) -> TurnResult {
        next.turn(request)
    }

    /// Shapes the system prompt, once per invoke, before any model call:
    /// takes the prompt so far (the caller's, changed by earlier filters)
    /// and returns it changed.
    fn system_prompt(&self, prompt: String) -> Result<String, FilterError> {
        Ok(prompt)
    }

    /// A fresh token transformer for one model stream. Written as
    /// `Box::new(PassThrough)`, it is the same as not written: the hook is
    /// left out of the descriptor and costs nothing (to pass tokens
    /// through only with some configurations, say so in [`Filter::wants`]).
    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(PassThrough)
    }
}
