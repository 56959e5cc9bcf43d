//! The kernel: an ordered filter list composed, once, into the chat, tool
//! and turn onions over their terminals, and the entry points that run an
//! invoke through them.
//!
//! Data flows one way: configuration -> plugin set -> kernel (onions) ->
//! terminals. Every invoke is admitted first (`plugin::admission`): it
//! reserves the instances its wasm filters may need, waiting its turn when
//! the engine is busy, for a bounded time.

use std::sync::Arc;

mod builder;

pub use builder::{BuildError, KernelBuilder};

use crate::context::Context;
use crate::mcp::McpServer;
use crate::model::{ChatModel, UpstreamHealth};
use crate::onion::{
    ChainKind, Chat, Hook, Invoke, InvokeOptions, Next, Onion, Shows, TokenSink, TokenStream, Tool,
    Turn, show, show_message,
};
use crate::plugin::{self, WasmFilter};
use crate::tool::ToolRegistry;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, Decision, EmbeddingRequest, EmbeddingResponse,
    ErrorKind, FinishReason, Origin, Resumable, ToolKind, ToolRequest, ToolResponse, ToolSpec,
    TurnInterrupt, TurnRequest, TurnResult,
};

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

/// A turn's result as its caller gets it: a paused turn with its state
/// ([`paused_with_state`]), a finished one's answer shown if the invoke
/// shows it.
async fn ended(result: TurnResult, invoke: &Arc<Invoke>) -> TurnResult {
    match paused_with_state(result, invoke) {
        TurnResult::Done(mut done) => {
            let response = &mut done.response;
            let end = response.finish_reason;
            match show_message(invoke, &mut response.message, end).await {
                Ok(()) => TurnResult::Done(done),
                Err(error) => TurnResult::Error(error),
            }
        }
        other => other,
    }
}

/// Filters composed around a model, tools and a tool loop. Cheap to clone;
/// every call is an independent invoke with its own shared context and
/// private contexts.
#[derive(Clone)]
pub struct Kernel {
    onion: Arc<Onion>,
    /// By filter position: the wasm filter, whose instances an invoke
    /// reserves on admission.
    wasm: Arc<[Option<Arc<WasmFilter>>]>,
    tools: Arc<ToolRegistry>,
    /// The model at the core of the chat chain.
    model: Arc<dyn ChatModel>,
    /// The MCP servers whose tools, prompts and resources it runs.
    servers: Arc<[Arc<McpServer>]>,
}

impl Kernel {
    /// A builder with no filters, the embedded model and no tools.
    pub fn builder() -> KernelBuilder {
        KernelBuilder::default()
    }

    /// Embeds the inputs of `request` with the kernel's model, directly:
    /// embeddings go through no filter.
    pub async fn embed(
        &self,
        request: &EmbeddingRequest,
        context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        self.model.embed(request, context).await
    }

    /// How the upstreams behind the kernel's model are doing, when it
    /// balances several ([`UpstreamPool`](crate::UpstreamPool)); empty
    /// otherwise.
    pub fn upstreams(&self) -> Vec<UpstreamHealth> {
        self.model.upstreams()
    }

    /// The filters, outermost first, with their hooks.
    pub fn filters(&self) -> impl Iterator<Item = (&str, &[Hook])> {
        self.onion
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

    /// The MCP servers it was built over, in order: their prompts and
    /// resources are what [`Kernel::prompt`] and
    /// [`Kernel::read_resource`] get.
    pub fn mcp_servers(&self) -> &[Arc<McpServer>] {
        &self.servers
    }

    /// Runs `request` through the chat chain. With a sink in `options`
    /// ([`InvokeOptions::stream_to`]) the answer streams through the token
    /// transforms to it; without, token transforms do not run. Returns the
    /// model's original response either way, unless `options` show it
    /// ([`InvokeOptions::shown`]): then its text is the one shown.
    pub async fn chat(
        &self,
        request: ChatRequest,
        options: impl Into<InvokeOptions>,
    ) -> Result<ChatResponse, ChainError> {
        let invoke = self.admit::<Chat>(options.into(), None).await?;
        let mut response = invoke.chat(request).await?;
        let end = response.finish_reason;
        show_message(&invoke, &mut response.message, end).await?;
        Ok(response)
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
    /// unknown tool fails with `not-found` before any filter runs. With
    /// [`InvokeOptions::shown`], its output is the one shown its caller.
    pub async fn tool(
        &self,
        name: &str,
        arguments: serde_json::Value,
        options: impl Into<InvokeOptions>,
    ) -> Result<ToolResponse, ChainError> {
        let tool = self.tools.spec(name);
        self.through_tools(ToolKind::Call, name, tool, arguments, options.into())
            .await
    }

    /// Gets an MCP server's prompt `name` (as the kernel names it, with
    /// its server's prefix) with `arguments`, through the tool chain as a
    /// request of kind [`ToolKind::Prompt`]: its output is the server's
    /// `GetPromptResult` as JSON. An unknown prompt fails with `not-found`
    /// before any filter runs; with [`InvokeOptions::shown`], the output
    /// is the one shown its caller.
    pub async fn prompt(
        &self,
        name: &str,
        arguments: serde_json::Value,
        options: impl Into<InvokeOptions>,
    ) -> Result<ToolResponse, ChainError> {
        let prompt = self.tools.prompt_spec(name);
        self.through_tools(ToolKind::Prompt, name, prompt, arguments, options.into())
            .await
    }

    /// Reads the MCP resource `uri` (of the first server that lists it or
    /// whose template names it) through the tool chain as a request of
    /// kind [`ToolKind::Resource`], its arguments `{"uri": ...}`: its
    /// output is the server's `ReadResourceResult` as JSON. A URI no
    /// server owns fails with `not-found` before any filter runs.
    pub async fn read_resource(
        &self,
        uri: &str,
        options: impl Into<InvokeOptions>,
    ) -> Result<ToolResponse, ChainError> {
        let resource = self.tools.resource_spec(uri);
        let arguments = serde_json::json!({ "uri": uri });
        self.through_tools(ToolKind::Resource, uri, resource, arguments, options.into())
            .await
    }

    /// A call of `kind` to `spec` (`None`: nothing of that name) through
    /// the tool chain, its output shown as `options` say.
    async fn through_tools(
        &self,
        kind: ToolKind,
        name: &str,
        spec: Option<Arc<ToolSpec>>,
        arguments: serde_json::Value,
        options: InvokeOptions,
    ) -> Result<ToolResponse, ChainError> {
        let spec = spec.ok_or_else(|| {
            let what = match kind {
                ToolKind::Call => "tool",
                ToolKind::Prompt => "prompt",
                ToolKind::Resource => "resource",
            };
            ChainError::new(
                ErrorKind::NotFound,
                format!("{what} '{name}' is not registered"),
            )
            .at(Origin::terminal("tools"))
        })?;
        let invoke = self.admit::<Tool>(options, None).await?;
        let request = ToolRequest::new(spec, arguments.to_string()).of_kind(kind);
        let mut response = invoke.tool(request).await?;
        let output = std::mem::take(&mut response.output);
        response.output = show(&invoke, output, FinishReason::Complete).await?;
        Ok(response)
    }

    /// Runs one agent turn through the turn chain; with a sink in
    /// `options`, every model round streams to it. With
    /// [`InvokeOptions::shown`], the final answer's text is the one shown.
    pub async fn turn(
        &self,
        request: TurnRequest,
        options: impl Into<InvokeOptions>,
    ) -> TurnResult {
        match self.admit::<Turn>(options.into(), None).await {
            Ok(invoke) => {
                let result = Next::start(self.onion.turn.clone(), invoke.clone())
                    .call(request)
                    .await;
                ended(result, &invoke).await
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
        let invoke = self.admit::<Chat>(options, None).await?;
        TokenStream::open(&invoke, sink).await
    }

    /// What a streaming caller is shown of `text`: the text through the
    /// token transforms as one stream, their output joined. The results of
    /// [`Kernel::chat`] and [`Kernel::turn`] (and history) keep the model's
    /// original text; show a person or a client this instead, and a
    /// redaction filter holds whether you stream or not. Given the text
    /// (a `String`), it is shown without a copy where no filter transforms
    /// tokens, and becomes the stream's one token where one does.
    /// An answer the kernel made is shown without this, and without a
    /// second invoke, by calling with [`InvokeOptions::shown`].
    pub async fn delivered_text(
        &self,
        text: impl Into<String>,
        context: Context,
    ) -> Result<String, ChainError> {
        let text = text.into();
        if self.onion.token_layers.is_empty() {
            return Ok(text);
        }
        let invoke = self
            .admit::<Chat>(InvokeOptions::from(context).shown(), None)
            .await?;
        show(&invoke, text, FinishReason::Complete).await
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
        let invoke = match self.admit::<Turn>(options.into(), Some(&paused)).await {
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
        let result = Next::start(self.onion.turn.clone(), invoke.clone())
            .call(request)
            .await;
        ended(result, &invoke).await
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
    async fn admit<K: ChainKind>(
        &self,
        mut options: InvokeOptions,
        paused: Option<&Resumable>,
    ) -> Result<Arc<Invoke>, ChainError> {
        let streamed = options.sink.is_some();
        let admission = plugin::admit::<K>(&self.wasm, streamed, options.shown).await?;
        let mut extensions = http::Extensions::new();
        extensions.insert(Arc::new(admission));
        if let Some(cancel) = options.cancel.take() {
            extensions.insert(cancel);
        }
        if let Some(shows) = Shows::watch(&mut options) {
            extensions.insert(shows);
        }
        let invoke = Arc::new(Invoke::new(
            self.onion.clone(),
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
        if K::HOOK != Tool::HOOK {
            let prompts = self
                .onion
                .system_prompts(&invoke, options.system_prompts)
                .await?;
            invoke.set_system_prompts(prompts);
        }
        Ok(invoke)
    }
}
