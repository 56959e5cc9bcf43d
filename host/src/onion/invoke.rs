//! One invoke: a single call into the kernel (a chat, a tool call or a
//! turn) with its shared context, every filter's private context (FCtx),
//! and the filter instances it holds.
//!
//! FCtx lives here, in the host, keyed by filter: seeded from the filter's
//! init on first entry, handed to each hook call and taken back. Nothing a
//! filter keeps survives the invoke, so an instance never has to.
//!
//! The invoke also keeps each filter's account of host memory that lives
//! as long as the invoke: its FCtx and its writes to the shared context
//! (charged to the writer until another write replaces them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use http::Extensions;
use serde_json::Value;

mod batch;

pub(crate) use batch::Branch;

use super::{Cancel, Fctx, Next, Onion, TokenSink};
use crate::context::Context;
use crate::types::{Carried, ChainError};
use crate::types::{
    ChatRequest, ChatResponse, Decision, ModelOptions, Resumable, ToolRequest, ToolResponse,
    ToolSpec, Weigh,
};

/// What a caller gives an invoke besides its request. A [`Context`]
/// converts into one.
#[derive(Clone, Default)]
pub struct InvokeOptions {
    /// The shared context (conversation id, tenant, user, ...).
    pub context: Context,
    /// System prompts for the model: one system message each, first, in
    /// order; with filters that have the system-prompt hook, joined by
    /// blank lines and shaped by them into one. Applied innermost, just
    /// before the model: chat filters never see them and history never
    /// stores them.
    pub system_prompts: Vec<String>,
    /// Where the model's answers stream to, through the token transforms;
    /// `None` for a call that is not streamed (token transforms do not run).
    pub sink: Option<Arc<dyn TokenSink>>,
    /// Model options (`temperature`, `max_tokens`, ...) for every model
    /// call of the invoke, applied innermost like the system prompts: a
    /// request's own options win. A turn's tool loop makes its model calls
    /// itself; this is how a caller's options reach them.
    pub model_options: ModelOptions,
    /// What cancels the invoke's calls from outside, if anything.
    pub cancel: Option<Cancel>,
    /// Whether the answer is shown to its caller whole: set, the answer's
    /// text goes through the token transforms within the invoke (its
    /// filters' private contexts, its instances, its system prompts) once
    /// its chain is done. Without a sink, the text the call returns is
    /// the one shown; with one, it is streamed to the sink unless text
    /// already was (a filter that answers in the model's place streams
    /// none). See [`InvokeOptions::shown`].
    pub shown: bool,
}

impl InvokeOptions {
    /// Lets `cancel` end the invoke's model and tool calls (see [`Cancel`]).
    pub fn cancel_on(mut self, cancel: Cancel) -> Self {
        self.cancel = Some(cancel);
        self
    }

    /// Adds a system prompt.
    pub fn system_prompt(mut self, prompt: impl Into<String>) -> Self {
        self.system_prompts.push(prompt.into());
        self
    }

    /// Sets the model options of every model call (see
    /// [`model_options`](Self::model_options)).
    pub fn model_options(mut self, options: ModelOptions) -> Self {
        self.model_options = options;
        self
    }

    /// Streams the model's answers through the token transforms to `sink`.
    pub fn stream_to(mut self, sink: impl TokenSink + 'static) -> Self {
        self.sink = Some(Arc::new(sink));
        self
    }

    /// Shows the answer's text to the caller through the token transforms,
    /// within the invoke: a chat's, a turn's final answer's or a tool's
    /// result's text in the result is then what the caller may be shown
    /// (as [`Kernel::delivered_text`](crate::Kernel::delivered_text) would
    /// make it, without a second invoke); with a sink, an answer no model
    /// streamed (a filter answered) is streamed to it at the end.
    pub fn shown(mut self) -> Self {
        self.shown = true;
        self
    }
}

impl std::fmt::Debug for InvokeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InvokeOptions")
            .field("context", &self.context)
            .field("system_prompts", &self.system_prompts)
            .field("model_options", &self.model_options)
            .field("streamed", &self.sink.is_some())
            .field("cancellable", &self.cancel.is_some())
            .field("shown", &self.shown)
            .finish()
    }
}

impl From<Context> for InvokeOptions {
    fn from(context: Context) -> Self {
        InvokeOptions {
            context,
            ..InvokeOptions::default()
        }
    }
}

/// A call in progress. Terminals get it to reach the shared context and,
/// for the turn terminal, the chat and tool chains of the same invoke.
pub struct Invoke {
    onion: Arc<Onion>,
    context: Context,
    fctx: Mutex<Vec<Option<Fctx>>>,
    ledger: Mutex<Ledger>,
    /// What the parts of the host keep for the length of the invoke, one
    /// value per type (the wasm filters' admission: their reserved
    /// instances, released when it ends).
    extensions: Extensions,
    sink: Option<Arc<dyn TokenSink>>,
    system_prompts: OnceLock<Vec<String>>,
    model_options: ModelOptions,
    /// A paused turn this invoke resumes, with the caller's decision.
    resumed: Mutex<Option<(Resumable, Decision)>>,
}

/// What a shared-context key was before a write: its value, and the
/// filter that wrote it with the bytes charged to it.
pub(crate) struct PriorValue {
    value: Option<Value>,
    writer: Option<(usize, usize)>,
}

impl PriorValue {
    /// Whether the key was absent (a removal of it changes nothing).
    pub(crate) fn absent(&self) -> bool {
        self.value.is_none()
    }
}

/// Host memory each filter holds for the length of the invoke.
struct Ledger {
    /// By filter: its FCtx and its context writes, in bytes.
    held: Vec<usize>,
    /// By filter: the weight of its FCtx.
    fctx: Vec<usize>,
    /// By context key: the filter that wrote it and the bytes charged.
    writers: HashMap<String, (usize, usize)>,
}

impl Invoke {
    pub(crate) fn new(
        onion: Arc<Onion>,
        context: Context,
        sink: Option<Arc<dyn TokenSink>>,
        model_options: ModelOptions,
        extensions: Extensions,
    ) -> Self {
        let filters = onion.filters.len();
        Invoke {
            onion,
            context,
            fctx: Mutex::new(vec![None; filters]),
            ledger: Mutex::new(Ledger {
                held: vec![0; filters],
                fctx: vec![0; filters],
                writers: HashMap::new(),
            }),
            extensions,
            sink,
            system_prompts: OnceLock::new(),
            model_options,
            resumed: Mutex::new(None),
        }
    }

    /// The invoke's `T`, if a part of the host keeps one.
    pub(crate) fn extension<T: Clone + Send + Sync + 'static>(&self) -> Option<&T> {
        self.extensions.get()
    }

    fn ledger(&self) -> MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Host memory filter `id` holds for this invoke.
    pub(crate) fn held(&self, id: usize) -> usize {
        self.ledger().held[id]
    }

    /// Sets filter `id`'s FCtx if what it then holds for this invoke stays
    /// within `room` bytes; `false` if it would not.
    pub(crate) fn set_fctx_within(
        &self,
        branch: Option<&Branch>,
        id: usize,
        fctx: Fctx,
        room: usize,
    ) -> bool {
        let mut ledger = self.ledger();
        // A call of a concurrent batch holds its own write until the batch
        // ends, besides the invoke's: each is charged.
        let replaced = match branch {
            Some(branch) => branch.written(id),
            None => ledger.fctx[id],
        };
        let held = ledger.held[id] - replaced + fctx.len();
        if held > room {
            return false;
        }
        ledger.held[id] = held;
        if branch.is_none() {
            ledger.fctx[id] = fctx.len();
        }
        self.set_fctx(branch, id, fctx);
        true
    }

    /// Filter `id` sets (or with `None` removes) a shared-context key, the
    /// value charged to it while it stays. Returns what the key was before
    /// (its value and who paid for it), or `None` if the write would take
    /// the filter past `room` bytes.
    pub(crate) fn write_context(
        &self,
        id: usize,
        key: &str,
        value: Option<Value>,
        room: usize,
    ) -> Option<PriorValue> {
        let mut ledger = self.ledger();
        let bytes = value.as_ref().map_or(0, |v| key.len() + v.weight());
        let previous = ledger.writers.get(key).copied();
        let mine = match previous {
            Some((writer, charged)) if writer == id => ledger.held[id] - charged,
            _ => ledger.held[id],
        };
        if value.is_some() && mine + bytes > room {
            return None;
        }
        if let Some((writer, charged)) = previous {
            ledger.held[writer] -= charged;
        }
        let value = match value {
            Some(value) => {
                ledger.writers.insert(key.to_owned(), (id, bytes));
                ledger.held[id] += bytes;
                self.context.replace(key, value)
            }
            None => {
                ledger.writers.remove(key);
                self.context.take(key)
            }
        };
        Some(PriorValue {
            value,
            writer: previous,
        })
    }

    /// Puts a key back as it was before a faulted call of filter `id`
    /// wrote it: its value, charged again to the filter that had written
    /// it. A key another filter has written since (a sibling call of a
    /// concurrent batch) keeps that write.
    pub(crate) fn restore_context(&self, id: usize, key: &str, before: PriorValue) {
        let mut ledger = self.ledger();
        if ledger
            .writers
            .get(key)
            .is_some_and(|(writer, _)| *writer != id)
        {
            return;
        }
        if let Some((writer, charged)) = ledger.writers.remove(key) {
            ledger.held[writer] -= charged;
        }
        if let Some((writer, charged)) = before.writer {
            ledger.held[writer] += charged;
            ledger.writers.insert(key.to_owned(), (writer, charged));
        }
        match before.value {
            Some(value) => self.context.replace(key, value),
            None => self.context.take(key),
        };
    }

    /// The shared context.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// Runs the chat chain within this invoke (a turn terminal's model call).
    /// Tokens stream to the invoke's sink, if it has one.
    pub async fn chat(self: &Arc<Self>, request: ChatRequest) -> Result<ChatResponse, ChainError> {
        Next::start(self.onion.chat.clone(), self.clone())
            .call(request)
            .await
    }

    /// The same, and the request as it reached the model (the tools the
    /// model was offered, as the chat filters left them); `None` if a
    /// filter answered in the model's place.
    pub(crate) async fn chat_reaching(
        self: &Arc<Self>,
        request: ChatRequest,
    ) -> (Result<ChatResponse, ChainError>, Option<ChatRequest>) {
        Next::start(self.onion.chat.clone(), self.clone())
            .call_reaching(request)
            .await
    }

    /// Runs the tool chain within this invoke.
    pub async fn tool(self: &Arc<Self>, request: ToolRequest) -> Result<ToolResponse, ChainError> {
        Next::start(self.onion.tool.clone(), self.clone())
            .call(request)
            .await
    }

    /// Of `tools`, the names of those registered with the kernel as tools
    /// its loop runs (an interrupt tool is a question, not one of them).
    pub(crate) fn registered(&self, tools: &[ToolSpec]) -> Vec<String> {
        let registry = &self.onion.tools;
        let registered = |name: &str| {
            let at = registry.binary_search_by(|spec| spec.name.as_str().cmp(name));
            at.is_ok_and(|at| !registry[at].interrupt)
        };
        let names = tools.iter().map(|tool| &tool.name);
        names.filter(|name| registered(name)).cloned().collect()
    }

    pub(crate) fn onion(&self) -> &Arc<Onion> {
        &self.onion
    }

    pub(crate) fn sink(&self) -> Option<&Arc<dyn TokenSink>> {
        self.sink.as_ref()
    }

    /// The system messages the model gets, first, after the filters'
    /// hooks: one per prompt of the invoke's options, or the one text
    /// system-prompt filters made of them; empty for none.
    pub fn system_prompts(&self) -> &[String] {
        self.system_prompts.get().map_or(&[], Vec::as_slice)
    }

    /// The model options every model call of the invoke gets, under its
    /// own.
    pub fn model_options(&self) -> &ModelOptions {
        &self.model_options
    }

    /// Takes the paused turn this invoke resumes, once.
    pub(crate) fn take_resumed(&self) -> Option<(Resumable, Decision)> {
        self.resumed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    pub(crate) fn set_resumed(&self, paused: Resumable, decision: Decision) {
        *self.resumed.lock().unwrap_or_else(PoisonError::into_inner) = Some((paused, decision));
    }

    pub(crate) fn set_system_prompts(&self, prompts: Vec<String>) {
        let _ = self.system_prompts.set(prompts);
    }

    fn states(&self) -> MutexGuard<'_, Vec<Option<Fctx>>> {
        self.fctx.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Filter `id`'s private context as a call in `branch` (or outside any
    /// batch) sees it: its latest state, or its init.
    pub(crate) fn fctx(&self, branch: Option<&Branch>, id: usize) -> Fctx {
        let state = match branch {
            Some(branch) => branch.get(id),
            None => self.states()[id].clone(),
        };
        state.unwrap_or_else(|| self.onion.filters[id].init.clone())
    }

    /// Every filter's private context as it is now, by filter name.
    pub(crate) fn fctx_states(&self) -> Carried {
        let names = self.onion.filters.iter().map(|entry| entry.name.clone());
        names.zip(self.states().iter().cloned()).collect()
    }

    /// Starts from `carried`, the private contexts of a paused turn this
    /// invoke resumes (charged to their filters). States from a kernel
    /// with other filters, or the same in another order, are ignored: a
    /// filter never gets another's.
    pub(crate) fn carry_fctx(&self, carried: &Carried) {
        let filters = &self.onion.filters;
        if carried.len() != filters.len()
            || !carried
                .iter()
                .zip(filters)
                .all(|((name, _), entry)| *name == entry.name)
        {
            return;
        }
        let mut ledger = self.ledger();
        let mut states = self.states();
        for (id, (_, state)) in carried.iter().enumerate() {
            let weight = state.as_ref().map_or(0, |fctx| fctx.len());
            ledger.held[id] = ledger.held[id] - ledger.fctx[id] + weight;
            ledger.fctx[id] = weight;
            states[id] = state.clone();
        }
    }

    fn set_fctx(&self, branch: Option<&Branch>, id: usize, fctx: Fctx) {
        match branch {
            Some(branch) => branch.set(id, fctx),
            None => self.states()[id] = Some(fctx),
        }
    }
}
