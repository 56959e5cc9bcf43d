//! The kernel: an ordered filter list composed, once, into the chat, tool
//! and turn onions over their terminals, and the entry points that run an
//! invoke through them.
//!
//! Data flows one way: configuration -> plugin set -> kernel (onions) ->
//! terminals. Every invoke is admitted first (`plugin::admission`): it
//! reserves the instances its wasm filters may need, waiting its turn when
//! the engine is busy, for a bounded time.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use crate::agent::ToolLoop;
use crate::context::{Context, Reducers};
use crate::engine::Engine;
use crate::model::{ChatModel, EmbeddedModel, ModelTerminal, ResponseLimits};
use crate::onion::{
    Approver, Core, Entry, Filter, Hook, Invoke, InvokeOptions, Next, Terminal, TokenSink,
    TokenStream, Turn,
};
use crate::plugin::{self, CallKind, PluginSet, WasmFilter};
use crate::tool::ToolRegistry;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, Decision, ErrorKind, FinishReason, Origin, Resumable,
    Token, TokenBatch, ToolRequest, ToolResponse, ToolSpec, TurnInterrupt, TurnRequest, TurnResult,
};

/// Why a kernel could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// Two filters have the same name (it keys their private state).
    #[error("two filters are named '{0}'; filter names key private state and must be unique")]
    DuplicateName(String),
    /// The wasm filters were loaded with different engines.
    #[error("the wasm filters come from different engines; load every plugin with one `Engine`")]
    MixedEngines,
    /// One invoke could need more instances than the engine has slots.
    #[error(
        "one invoke can need {need} instance slots but the engine has {have}; raise `EngineConfig::instance_slots`"
    )]
    TooFewSlots {
        /// Instances one invoke can need.
        need: usize,
        /// The engine's slots.
        have: u32,
    },
    /// One invoke could need more instances of a filter than its quota.
    #[error(
        "one invoke can need {need} instances of filter '{filter}' but its limits allow {have}; raise its `instances` limit"
    )]
    TooFewInstances {
        /// The filter.
        filter: String,
        /// Its instances one invoke can need.
        need: usize,
        /// Its `instances` limit.
        have: u32,
    },
    /// A tool's parameters are not a valid JSON Schema.
    #[error("tool '{tool}': its parameters are not a valid JSON Schema: {message}")]
    ToolSchema {
        /// The tool.
        tool: String,
        /// The schema compiler's words.
        message: String,
    },
}

/// Builds a [`Kernel`].
#[derive(Default)]
pub struct KernelBuilder {
    filters: Vec<Entry>,
    /// By position in `filters`: the wasm filter, `None` for a native one.
    wasm: Vec<Option<Arc<WasmFilter>>>,
    model: Option<Arc<dyn ChatModel>>,
    response_limits: ResponseLimits,
    tools: ToolRegistry,
    turn: Option<Arc<dyn Terminal<Turn>>>,
    approver: Option<Arc<dyn Approver>>,
    reducers: Reducers,
}

impl KernelBuilder {
    /// Appends the filters of `plugins`, in order.
    pub fn plugins(mut self, plugins: &PluginSet) -> Self {
        for filter in plugins.filters() {
            self = self.wasm(filter.clone());
        }
        self
    }

    /// Appends one wasm filter.
    pub fn wasm(mut self, filter: Arc<WasmFilter>) -> Self {
        self.filters.push(Entry {
            name: filter.name().into(),
            hooks: filter.hooks().to_vec(),
            init: filter.init_fctx().clone(),
            filter: filter.clone(),
        });
        self.wasm.push(Some(filter));
        self
    }

    /// Appends a native (Rust) filter.
    pub fn filter(mut self, filter: impl Filter) -> Self {
        let filter: Arc<dyn Filter> = Arc::new(filter);
        self.filters.push(Entry {
            name: filter.name().into(),
            hooks: filter.hooks().to_vec(),
            init: filter.init_fctx(),
            filter,
        });
        self.wasm.push(None);
        self
    }

    /// The model at the core of the chat chain (default: [`EmbeddedModel`]).
    pub fn model(mut self, model: impl ChatModel) -> Self {
        self.model = Some(Arc::new(model));
        self
    }

    /// Bounds on each model answer (default: [`ResponseLimits::default`]).
    pub fn response_limits(mut self, limits: ResponseLimits) -> Self {
        self.response_limits = limits;
        self
    }

    /// Registers a native tool.
    pub fn tool<F, Fut>(mut self, spec: ToolSpec, handler: F) -> Self
    where
        F: Fn(serde_json::Value, Context) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<serde_json::Value, ChainError>> + Send + 'static,
    {
        self.tools.register(spec, handler);
        self
    }

    /// Registers an interrupt tool: a
    /// question the model may put to a human, such as `ask_human`. Calling
    /// it pauses the turn in the tool loop
    /// ([`InterruptKind::ToolRequest`](crate::types::InterruptKind), the
    /// call's arguments being the question), and `Kernel::resume` with
    /// [`Decision::Reply`](crate::types::Decision) gives the model the
    /// reply as its result. It has no code: approved, or called outside
    /// the tool loop, it fails.
    pub fn interrupt_tool(mut self, spec: ToolSpec) -> Self {
        let message = format!(
            "tool '{}' is a question for a human: the tool loop pauses the turn for it, and a reply (Decision::Reply) answers it",
            spec.name
        );
        self.tools.register(spec.interrupt(), move |_, _| {
            let error = ChainError::new(ErrorKind::InvalidRequest, message.clone());
            async move { Err(error) }
        });
        self
    }

    /// Declares a reducer for the shared-context key `key`: the writes the tool calls of one batch make to it are
    /// folded into its value in call order, `reduce(value, write)`, from
    /// `init` when it is absent, instead of the last writer by call index
    /// winning. A reducer that prepends keeps every call's note, one that
    /// adds keeps a running total.
    pub fn reducer(
        mut self,
        key: impl Into<String>,
        init: serde_json::Value,
        reduce: impl Fn(serde_json::Value, serde_json::Value) -> serde_json::Value
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.reducers = std::mem::take(&mut self.reducers).with(key, init, reduce);
        self
    }

    /// Registers the built-in demo tools (calculator, clock, echo).
    pub fn builtin_tools(mut self) -> Self {
        crate::tool::builtin::register(&mut self.tools);
        self
    }

    /// The terminal of the turn chain (default: a [`ToolLoop`] with its
    /// default limits and in-memory history).
    pub fn turn_terminal(mut self, terminal: impl Terminal<Turn>) -> Self {
        self.turn = Some(Arc::new(terminal));
        self
    }

    /// Who answers filters granted the `approval` import (such as the
    /// built-in `approval` filter's `ask` rules). Without one, every
    /// question is answered no.
    pub fn approver(mut self, approver: impl Approver) -> Self {
        self.approver = Some(Arc::new(approver));
        self
    }

    /// Composes the onions.
    pub fn build(self) -> Result<Kernel, BuildError> {
        let mut names = HashSet::new();
        for entry in &self.filters {
            if !names.insert(entry.name.clone()) {
                return Err(BuildError::DuplicateName(entry.name.to_string()));
            }
        }
        let mut engine: Option<Engine> = None;
        for filter in self.wasm.iter().flatten() {
            match &engine {
                None => engine = Some(filter.engine().clone()),
                Some(ours) if !Arc::ptr_eq(&ours.inner, &filter.engine().inner) => {
                    return Err(BuildError::MixedEngines);
                }
                Some(_) => {}
            }
        }
        if let Some(engine) = &engine {
            let mut total = 0;
            for call in CallKind::ALL {
                let mut sum = 0;
                for filter in self.wasm.iter().flatten() {
                    let need = plugin::need(filter.hooks(), call, true);
                    let have = filter.limits().instances;
                    if need > have as usize {
                        return Err(BuildError::TooFewInstances {
                            filter: filter.name().to_owned(),
                            need,
                            have,
                        });
                    }
                    sum += need;
                }
                total = total.max(sum);
            }
            if total > engine.inner.slot_count as usize {
                return Err(BuildError::TooFewSlots {
                    need: total,
                    have: engine.inner.slot_count,
                });
            }
        }
        if let Some((tool, message)) = self.tools.schema_error() {
            return Err(BuildError::ToolSchema { tool, message });
        }
        let model = self.model.unwrap_or_else(|| Arc::new(EmbeddedModel::new()));
        let tools = Arc::new(self.tools);
        let turn = self.turn.unwrap_or_else(|| Arc::new(ToolLoop::default()));
        let chat = Arc::new(ModelTerminal {
            model,
            limits: self.response_limits,
        });
        let mut core = Core::compose(
            self.filters,
            chat,
            tools.clone(),
            turn,
            tools.shared_specs(),
        );
        core.approver = self.approver;
        core.response_limits = self.response_limits;
        core.reducers = self.reducers;
        Ok(Kernel {
            core: Arc::new(core),
            wasm: self.wasm.into(),
            tools,
        })
    }
}

/// A turn that paused carries its filters' private contexts and the
/// shared context, so that the resumed turn goes on from them (a `memory`
/// filter's count of what it stored, a retry count, a tool's writes), as
/// one turn would.
fn paused_with_state(mut result: TurnResult, invoke: &Invoke) -> TurnResult {
    if let TurnResult::Interrupt(interrupt) = &mut result
        && let Some(paused) = &mut interrupt.paused
    {
        paused.fctx = Arc::new(invoke.fctx_states());
        paused.context = Arc::new(invoke.context().snapshot());
    }
    result
}

/// Filters composed around a model, tools and a tool loop. Cheap to clone;
/// every call is an independent invoke with its own shared context and
/// private contexts.
#[derive(Clone)]
pub struct Kernel {
    core: Arc<Core>,
    /// By filter position: the wasm filter, whose instances an invoke
    /// reserves on admission.
    wasm: Arc<[Option<Arc<WasmFilter>>]>,
    tools: Arc<ToolRegistry>,
}

impl Kernel {
    /// A builder with no filters, the embedded model and no tools.
    pub fn builder() -> KernelBuilder {
        KernelBuilder::default()
    }

    /// The filters, outermost first, with their hooks.
    pub fn filters(&self) -> impl Iterator<Item = (&str, &[Hook])> {
        self.core
            .filters
            .iter()
            .map(|entry| (&*entry.name, entry.hooks.as_slice()))
    }

    /// Its wasm filters, outermost first (for their
    /// [`stats`](WasmFilter::stats)).
    pub fn wasm_filters(&self) -> impl Iterator<Item = &Arc<WasmFilter>> {
        self.wasm.iter().flatten()
    }

    /// The specs of the registered tools.
    pub fn tools(&self) -> Vec<ToolSpec> {
        self.tools.specs()
    }

    /// Runs `request` through the chat chain. With a sink in `options`
    /// ([`InvokeOptions::stream_to`]) the answer streams through the token
    /// transforms to it; without, token transforms do not run. Returns the
    /// model's original response either way.
    pub async fn chat(
        &self,
        request: ChatRequest,
        options: impl Into<InvokeOptions>,
    ) -> Result<ChatResponse, ChainError> {
        let invoke = self.admit(CallKind::Chat, options.into(), None).await?;
        invoke.chat(request).await
    }

    /// [`Kernel::chat`], streaming the answer to `sink`.
    pub async fn chat_stream(
        &self,
        request: ChatRequest,
        options: impl Into<InvokeOptions>,
        sink: impl TokenSink + 'static,
    ) -> Result<ChatResponse, ChainError> {
        self.chat(request, options.into().stream_to(sink)).await
    }

    /// Calls the tool `name` with `arguments` through the tool chain. An
    /// unknown tool fails with `not-found` before any filter runs.
    pub async fn tool(
        &self,
        name: &str,
        arguments: serde_json::Value,
        options: impl Into<InvokeOptions>,
    ) -> Result<ToolResponse, ChainError> {
        let tool = self.tools.spec(name).ok_or_else(|| {
            ChainError::new(
                ErrorKind::NotFound,
                format!("tool '{name}' is not registered"),
            )
            .at(Origin::terminal("tools"))
        })?;
        let invoke = self.admit(CallKind::Tool, options.into(), None).await?;
        invoke
            .tool(ToolRequest::new(tool, arguments.to_string()))
            .await
    }

    /// Runs one agent turn through the turn chain; with a sink in
    /// `options`, every model round streams to it.
    pub async fn turn(
        &self,
        request: TurnRequest,
        options: impl Into<InvokeOptions>,
    ) -> TurnResult {
        match self.admit(CallKind::Turn, options.into(), None).await {
            Ok(invoke) => {
                let result = Next::start(self.core.turn.clone(), invoke.clone())
                    .call(request)
                    .await;
                paused_with_state(result, &invoke)
            }
            Err(error) => TurnResult::Error(error),
        }
    }

    /// [`Kernel::turn`], streaming every model round to `sink`.
    pub async fn turn_stream(
        &self,
        request: TurnRequest,
        options: impl Into<InvokeOptions>,
        sink: impl TokenSink + 'static,
    ) -> TurnResult {
        self.turn(request, options.into().stream_to(sink)).await
    }

    /// The token transform chain alone, for an embedder that streams from
    /// its own model: push batches, then `finish` (or `abandon` on error).
    pub async fn token_stream(
        &self,
        context: Context,
        sink: impl TokenSink + 'static,
    ) -> Result<TokenStream, ChainError> {
        let options = InvokeOptions::from(context).stream_to(sink);
        let sink = options.sink.clone().expect("just set");
        let invoke = self.admit(CallKind::Chat, options, None).await?;
        TokenStream::open(&invoke, sink).await
    }

    /// What a streaming caller is shown of `text`: the text through the
    /// token transforms as one stream, their output joined. The results of
    /// [`Kernel::chat`] and [`Kernel::turn`] (and history) keep the model's
    /// original text; show a person or a client this instead, and a
    /// redaction filter holds whether you stream or not.
    pub async fn delivered_text(&self, text: &str, context: Context) -> Result<String, ChainError> {
        if self.core.token_layers.is_empty() {
            return Ok(text.to_owned());
        }
        let shown = Arc::new(Mutex::new(String::new()));
        let sink = {
            let shown = shown.clone();
            move |token: Token<'_>| {
                shown
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push_str(token.text)
            }
        };
        let mut stream = self.token_stream(context, sink).await?;
        let mut tokens = TokenBatch::default();
        tokens.push(text, None);
        stream.push(tokens).await?;
        stream.finish(FinishReason::Complete).await?;
        let shown = shown.lock().unwrap_or_else(PoisonError::into_inner).clone();
        Ok(shown)
    }

    /// Continues a turn the tool loop paused (a `sensitive` tool waiting
    /// for approval): its pending calls run, or are denied, and the loop goes
    /// on. The turn chain runs again with `resume = true`; only its first
    /// call of the terminal continues the paused turn, its filters' private
    /// contexts as they were when it paused, and the keys of the shared
    /// context then that `options`' context lacks. A pause continues once: resuming it again (a clone of `interrupt`) is an
    /// `invalid-request` error. With a sink in `options`, every model round
    /// streams to it.
    pub async fn resume(
        &self,
        interrupt: TurnInterrupt,
        decision: Decision,
        options: impl Into<InvokeOptions>,
    ) -> TurnResult {
        let Some(paused) = interrupt.paused else {
            let message =
                "this interrupt has nothing to resume (it did not come from the tool loop)";
            let error = ChainError::new(ErrorKind::InvalidRequest, message);
            return TurnResult::Error(error.at(Origin::terminal("kernel")));
        };
        let invoke = match self
            .admit(CallKind::Turn, options.into(), Some(&paused))
            .await
        {
            Ok(invoke) => invoke,
            Err(error) => return TurnResult::Error(error),
        };
        // Claimed once admitted: a resume refused for load can be retried.
        if !paused.claim() {
            let message = "this interrupt was already resumed (a pause continues once)";
            let error = ChainError::new(ErrorKind::InvalidRequest, message);
            return TurnResult::Error(error.at(Origin::terminal("kernel")));
        }
        invoke.set_resumed(paused, decision);
        let request = TurnRequest {
            resume: true,
            ..TurnRequest::new(Vec::new())
        };
        let result = Next::start(self.core.turn.clone(), invoke.clone())
            .call(request)
            .await;
        paused_with_state(result, &invoke)
    }

    /// [`Kernel::resume`], streaming every model round to `sink`.
    pub async fn resume_stream(
        &self,
        interrupt: TurnInterrupt,
        decision: Decision,
        options: impl Into<InvokeOptions>,
        sink: impl TokenSink + 'static,
    ) -> TurnResult {
        self.resume(interrupt, decision, options.into().stream_to(sink))
            .await
    }

    /// Starts an invoke: reserves its instances (waiting, for a bounded
    /// time, while they are taken) and sets up its state, going on from
    /// `paused`'s (a paused turn's) when given.
    async fn admit(
        &self,
        call: CallKind,
        options: InvokeOptions,
        paused: Option<&Resumable>,
    ) -> Result<Arc<Invoke>, ChainError> {
        let streamed = options.sink.is_some();
        let admission = plugin::admit(&self.wasm, call, streamed).await?;
        let mut extensions = http::Extensions::new();
        extensions.insert(Arc::new(admission));
        let invoke = Arc::new(Invoke::new(
            self.core.clone(),
            options.context,
            options.sink,
            options.model_options,
            extensions,
        ));
        if let Some(paused) = paused {
            invoke.carry_fctx(&paused.fctx);
            let context = invoke.context();
            for (key, value) in paused.context.iter() {
                if context.get(key).is_none() {
                    context.set(key, value.clone());
                }
            }
        }
        if call != CallKind::Tool {
            let prompts = self
                .core
                .system_prompts(&invoke, options.system_prompts)
                .await?;
            invoke.set_system_prompts(prompts);
        }
        Ok(invoke)
    }
}
