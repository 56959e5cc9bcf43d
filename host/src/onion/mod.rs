//! The onion: an ordered list of filters composed around a terminal, one
//! chain for each kind of call (chat, tool, turn).
//!
//! Earlier in the list is outer: its "before" part runs first and its
//! "after" part last. A filter without a hook for a chain is not in that
//! chain at all. Each layer receives the request and [`Next`], the rest
//! of the chain; it may call `next` zero times (short-circuit), once, or
//! several times (retry). Through `Next` it also reaches its private
//! context (FCtx), kept by the invoke. Composition happens once per
//! kernel; a call only walks the list.
//!
//! This module owns what a filter is (`filter`), the chains (`chain`),
//! composition, and the life of a call through them: an [`Invoke`]
//! (`invoke`) and the token transforms of a stream (`token_transform`).
//! It knows nothing of wasm: a sandboxed filter is one more [`Filter`],
//! which `plugin::WasmFilter` implements.

mod approval;
mod cancel;
mod chain;
mod filter;
mod invoke;
mod shown;
mod side;
mod token_transform;

pub use approval::{ApprovalRequest, Approver};
pub use cancel::Cancel;
pub(crate) use chain::Chain;
pub use chain::{ChainKind, Chat, Next, Tool, Turn};
pub use filter::{Fctx, Filter, FilterScope, Hook, Terminal};
pub(crate) use invoke::{Branch, PriorValue};
pub use invoke::{Invoke, InvokeOptions};
pub(crate) use shown::{Shows, show, show_message};
pub use side::SideModel;
pub use token_transform::{TokenSink, TokenStream, TokenTransform};

use std::collections::HashMap;
use std::sync::Arc;

use chain::Layer;

use crate::context::Reducers;
use crate::types::{ChainError, ResponseLimits, ToolSpec};

/// A filter of a kernel, native or sandboxed.
pub(crate) struct KernelFilter {
    pub name: Arc<str>,
    pub hooks: Vec<Hook>,
    pub init: Fctx,
    pub filter: Arc<dyn Filter>,
}

/// The composed kernel, shared by every invoke.
pub(crate) struct Onion {
    pub filters: Vec<KernelFilter>,
    pub chat: Arc<Chain<Chat>>,
    pub tool: Arc<Chain<Tool>>,
    pub turn: Arc<Chain<Turn>>,
    /// Filters with a token transform, in order.
    pub token_layers: Vec<usize>,
    /// The registered tools' specs, by name, offered to the model by the
    /// tool loop.
    pub tools: Vec<Arc<ToolSpec>>,
    /// Who answers the `approval` import; `None` denies every question.
    pub approver: Option<Arc<dyn Approver>>,
    /// The models of the `model` import, by the names a grant gives.
    pub side_models: HashMap<String, Arc<dyn SideModel>>,
    /// Bounds on an answer of the chat chain, the model's or a filter's.
    pub response_limits: ResponseLimits,
    /// How the tools' writes to shared-context keys combine.
    pub reducers: Reducers,
}

impl Onion {
    /// Composes the onions of `filters` over their terminals.
    pub(crate) fn compose(
        filters: Vec<KernelFilter>,
        chat: Arc<dyn Terminal<Chat>>,
        tool: Arc<dyn Terminal<Tool>>,
        turn: Arc<dyn Terminal<Turn>>,
        tools: Vec<Arc<ToolSpec>>,
    ) -> Self {
        Onion {
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
            side_models: Default::default(),
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
        let shapes = |entry: &KernelFilter| entry.hooks.contains(&Hook::SystemPrompt);
        if !self.filters.iter().any(shapes) {
            return Ok(prompts.into_iter().filter(|p| !p.is_empty()).collect());
        }
        let mut prompt = prompts.join("\n\n");
        for (id, entry) in self.filters.iter().enumerate() {
            if !shapes(entry) {
                continue;
            }
            let scope = FilterScope::new(invoke.clone(), id);
            prompt = entry.filter.system_prompt(prompt, &scope).await?;
        }
        Ok(if prompt.is_empty() {
            Vec::new()
        } else {
            vec![prompt]
        })
    }
}

/// The layers of chain `K`: the filters with its hook, in order.
fn chain<K: ChainKind>(filters: &[KernelFilter], terminal: Arc<dyn Terminal<K>>) -> Arc<Chain<K>> {
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
