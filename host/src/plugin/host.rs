//! What the host gives a filter instance: its store data, the resources
//! behind request and response handles, and the `next`, `context` and
//! `log` imports.
//!
//! Requests and responses live in the instance's resource table as the
//! host's own values. `next` takes the request the guest holds (a cheap
//! clone: its big parts are shared), runs the inner layers, and hands the
//! response back as a new handle; a pass-through layer never copies a
//! message.
//!
//! Everything a filter makes the host hold is charged to it: each value it
//! creates or changes in its table (and each response `next` hands it) by
//! its weight until it is dropped, its FCtx and its writes to the shared
//! context until the invoke ends. Past `Limits::host_mib` the call faults.
//! Its calls through `next` are counted per hook call, its log lines per
//! call, and what it logs is made printable.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{HasSelf, Linker, Resource, ResourceTable};
use wasmtime_wasi::{WasiCtxView, WasiView};

use super::bindings::Filter as FilterWorld;
use super::bindings::shallot::filter::{context, fctx, log, next, types as wit};
use super::convert;
use super::instance::WasmChain;
use crate::error::{Call, ChainError, ErrorKind, Origin};
use crate::invoke::{Branch, Invoke};
use crate::onion::{Chat, Next, Tool, Turn};
use crate::sandbox::{self, Confinement, HostMemoryExceeded, Limits, Sandboxed, TEXT_CAP};
use crate::types::{
    ChatRequest, ChatResponse, Content, FinishReason, ToolRequest, ToolResponse, TurnDone,
    TurnInterrupt, TurnRequest, TurnResult, Weigh,
};

/// Log lines one call may write; later ones are dropped.
const LOG_LINES_PER_CALL: u32 = 256;

/// Which filter an instance belongs to, for logs and error attribution.
#[derive(Debug)]
pub(crate) struct Identity {
    pub name: Arc<str>,
    pub plugin: Arc<Path>,
}

impl Identity {
    pub(crate) fn origin(&self, call: Call) -> Origin {
        Origin {
            filter: self.name.clone(),
            plugin: Some(self.plugin.clone()),
            call,
        }
    }
}

/// The inner part of the chain that the current hook may call.
pub(crate) enum Continuation {
    None,
    Chat(Next<Chat>),
    Tool(Next<Tool>),
    Turn(Next<Turn>),
}

/// What a call into the instance runs within: its invoke, the filter's
/// position in it (which keys its FCtx), and the rest of the chain.
pub(crate) struct Scope {
    pub invoke: Arc<Invoke>,
    pub id: usize,
    /// The batch branch of a concurrent tool call, if it is one.
    pub branch: Option<Arc<Branch>>,
    pub next: Continuation,
}

impl Scope {
    /// A scope for a call outside the chains (system prompt, tokens).
    pub(crate) fn outside_chains(invoke: Arc<Invoke>, id: usize) -> Self {
        Scope {
            invoke,
            id,
            branch: None,
            next: Continuation::None,
        }
    }
}

/// The data of a filter instance's store.
pub struct HostState {
    pub(crate) table: ResourceTable,
    pub(crate) confinement: Confinement,
    pub(crate) identity: Arc<Identity>,
    pub(crate) limits: Limits,
    pub(crate) scope: Option<Scope>,
    /// The last failure `next` handed to the guest, so that a filter which
    /// passes it on does not get the blame for it.
    pub(crate) inner_error: Option<ChainError>,
    /// The weight charged for each value in the table, by handle.
    charges: HashMap<u32, usize>,
    /// Their sum.
    held: usize,
    /// Calls through `next` in the current hook call.
    next_calls: u32,
    /// Log lines written in the current call.
    log_lines: u32,
    /// Shared-context keys the current call wrote, with the values they had
    /// before, to undo if the call faults.
    journal: Vec<(String, Option<serde_json::Value>)>,
}

impl Sandboxed for HostState {
    fn confinement(&mut self) -> &mut Confinement {
        &mut self.confinement
    }
}

impl HostState {
    pub(crate) fn new(identity: Arc<Identity>, limits: Limits, confinement: Confinement) -> Self {
        let mut table = ResourceTable::new();
        table.set_max_capacity(sandbox::HANDLES);
        HostState {
            table,
            confinement,
            identity,
            limits,
            scope: None,
            inner_error: None,
            charges: HashMap::new(),
            held: 0,
            next_calls: 0,
            log_lines: 0,
            journal: Vec::new(),
        }
    }

    /// Starts a call within `scope` (none for configure and describe).
    pub(crate) fn enter(&mut self, scope: Option<Scope>) {
        self.scope = scope;
        self.inner_error = None;
        self.next_calls = 0;
        self.log_lines = 0;
        self.journal.clear();
    }

    /// Ends a call. A call that faulted loses its writes to the shared
    /// context: each key it wrote gets back the value it had before.
    pub(crate) fn leave(&mut self, faulted: bool) {
        if faulted && let Some(scope) = &self.scope {
            for (key, value) in self.journal.drain(..).rev() {
                scope.invoke.restore_context(&key, value);
            }
        }
        self.journal.clear();
        self.scope = None;
    }

    /// Host memory this filter holds: its table, and in the current invoke
    /// its FCtx and context writes.
    fn holding(&self) -> usize {
        self.held
            + self
                .scope
                .as_ref()
                .map_or(0, |scope| scope.invoke.held(scope.id))
    }

    /// Fails (a fault) if `more` bytes would take the filter past its cap.
    fn afford(&self, more: usize) -> wasmtime::Result<()> {
        if self.holding() + more > self.limits.host_bytes() {
            return Err(wasmtime::Error::new(HostMemoryExceeded));
        }
        Ok(())
    }

    /// Puts a value the filter caused into its table, charged to it.
    fn keep<T: Weigh + Send + 'static>(&mut self, value: T) -> wasmtime::Result<Resource<T>> {
        let weight = value.weight();
        self.afford(weight)?;
        let handle = self.table.push(value)?;
        self.charges.insert(handle.rep(), weight);
        self.held += weight;
        Ok(handle)
    }

    /// Takes a value out of the table, crediting its charge.
    pub(crate) fn take<T: 'static>(&mut self, handle: Resource<T>) -> wasmtime::Result<T> {
        let rep = handle.rep();
        let value = self.table.delete(handle)?;
        if let Some(weight) = self.charges.remove(&rep) {
            self.held -= weight;
        }
        Ok(value)
    }

    /// Charges a value the filter changed in place at its new weight.
    fn recharge<T: Weigh + 'static>(&mut self, handle: &Resource<T>) -> wasmtime::Result<()> {
        let weight = self.table.get(handle)?.weight();
        let old = self.charges.get(&handle.rep()).copied().unwrap_or(0);
        if weight > old {
            self.afford(weight - old)?;
        }
        self.charges.insert(handle.rep(), weight);
        self.held = self.held + weight - old;
        Ok(())
    }

    /// Attributes an error the guest returned: the inner failure it passed
    /// on keeps its origin; anything else is this filter's own.
    pub(crate) fn attribute(&self, error: wit::FilterError, call: Call) -> ChainError {
        if let Some(inner) = &self.inner_error {
            let seen = convert::filter_error(inner);
            if seen.kind == error.kind && seen.message == error.message {
                return inner.clone();
            }
        }
        let message = sandbox::printable(&error.message, TEXT_CAP);
        ChainError::new(error.kind.into(), message).at(self.identity.origin(call))
    }

    fn inner_failed(&mut self, error: ChainError) -> wit::FilterError {
        let seen = convert::filter_error(&error);
        self.inner_error = Some(error);
        seen
    }

    fn misuse(&self, what: &str) -> wit::FilterError {
        wit::FilterError {
            kind: wit::ErrorKind::InvalidRequest,
            message: format!("next.{what} called outside an around-{what} hook"),
        }
    }

    /// Runs the inner layers for a `next.*` call, with the request the
    /// guest lent; `None` when the current hook is not of chain `K`.
    async fn run_next<K: WasmChain>(
        &mut self,
        request: &Resource<K::Request>,
        within: Option<u32>,
    ) -> wasmtime::Result<Option<K::Output>> {
        let Some(next) = self
            .scope
            .as_ref()
            .and_then(|scope| K::resume(&scope.next))
            .cloned()
        else {
            return Ok(None);
        };
        let request = self.table.get(request)?.clone();
        self.next_calls += 1;
        if self.next_calls > self.limits.next_calls {
            let message = format!(
                "called next more than {} times in one hook call",
                self.limits.next_calls
            );
            let error = ChainError::new(ErrorKind::LimitExceeded, message)
                .at(self.identity.origin(K::HOOK.into()));
            return Ok(Some(K::fail(error)));
        }
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let output = match within {
            Some(ms) => {
                next.call_within(request, Duration::from_millis(ms.into()))
                    .await
            }
            None => next.call(request).await,
        };
        meter.leave_next();
        Ok(Some(output))
    }

    async fn chat_inner(
        &mut self,
        request: Resource<ChatRequest>,
        within: Option<u32>,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        Ok(match self.run_next::<Chat>(&request, within).await? {
            None => Err(self.misuse("chat")),
            Some(Ok(response)) => Ok(self.keep(response)?),
            Some(Err(error)) => Err(self.inner_failed(error)),
        })
    }

    async fn tool_inner(
        &mut self,
        request: Resource<ToolRequest>,
        within: Option<u32>,
    ) -> wasmtime::Result<Result<Resource<ToolResponse>, wit::FilterError>> {
        Ok(match self.run_next::<Tool>(&request, within).await? {
            None => Err(self.misuse("tool")),
            Some(Ok(response)) => Ok(self.keep(response)?),
            Some(Err(error)) => Err(self.inner_failed(error)),
        })
    }

    async fn turn_inner(
        &mut self,
        request: Resource<TurnRequest>,
        within: Option<u32>,
    ) -> wasmtime::Result<wit::TurnResult> {
        Ok(match self.run_next::<Turn>(&request, within).await? {
            None => wit::TurnResult::Error(self.misuse("turn")),
            Some(TurnResult::Done(done)) => wit::TurnResult::Done(self.keep(done)?),
            Some(TurnResult::Interrupt(interrupt)) => {
                wit::TurnResult::Interrupt(self.keep(interrupt)?)
            }
            Some(TurnResult::Error(error)) => wit::TurnResult::Error(self.inner_failed(error)),
        })
    }

    /// Moves a turn result the guest returned out of its table.
    pub(crate) fn take_turn_result(
        &mut self,
        result: wit::TurnResult,
        call: Call,
    ) -> wasmtime::Result<TurnResult> {
        Ok(match result {
            wit::TurnResult::Done(done) => TurnResult::Done(self.take(done)?),
            wit::TurnResult::Interrupt(interrupt) => TurnResult::Interrupt(self.take(interrupt)?),
            wit::TurnResult::Error(error) => TurnResult::Error(self.attribute(error, call)),
        })
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.confinement.wasi,
            table: &mut self.table,
        }
    }
}

/// The linker of filter instances: WASI 0.2 (with nothing granted unless
/// the filter's grants say so) and the `shallot:filter` imports.
pub(crate) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    FilterWorld::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |state| state)?;
    Ok(linker)
}

/// Parses JSON text that must be an object.
fn json_object(
    text: &str,
    what: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(map)) => Ok(map),
        Ok(_) => Err(format!("{what} must be a JSON object")),
        Err(e) => Err(format!("{what} is not JSON: {e}")),
    }
}

/// Checks that `text` is JSON.
fn json_text(text: &str, what: &str) -> Result<(), String> {
    serde_json::from_str::<serde::de::IgnoredAny>(text)
        .map(|_| ())
        .map_err(|e| format!("{what} is not JSON: {e}"))
}

impl wit::Host for HostState {}

impl wit::HostChatRequest for HostState {
    fn new(&mut self, messages: Vec<wit::Message>) -> wasmtime::Result<Resource<ChatRequest>> {
        self.keep(ChatRequest::new(convert::from_messages(messages)))
    }

    fn messages(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<Vec<wit::Message>> {
        Ok(convert::messages(&self.table.get(&this)?.messages))
    }

    fn message_count(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.messages.len() as u32)
    }

    fn message(
        &mut self,
        this: Resource<ChatRequest>,
        index: u32,
    ) -> wasmtime::Result<Option<wit::Message>> {
        Ok(self
            .table
            .get(&this)?
            .messages
            .get(index as usize)
            .map(convert::message))
    }

    fn set_messages(
        &mut self,
        this: Resource<ChatRequest>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.messages = Arc::new(convert::from_messages(messages));
        self.recharge(&this)?;
        Ok(())
    }

    fn push_message(
        &mut self,
        this: Resource<ChatRequest>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        self.table
            .get_mut(&this)?
            .messages_mut()
            .push(message.into());
        self.recharge(&this)?;
        Ok(())
    }

    fn insert_message(
        &mut self,
        this: Resource<ChatRequest>,
        index: u32,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        let messages = self.table.get_mut(&this)?.messages_mut();
        let index = (index as usize).min(messages.len());
        messages.insert(index, message.into());
        self.recharge(&this)?;
        Ok(())
    }

    fn tools(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<Vec<wit::ToolSpec>> {
        Ok(self
            .table
            .get(&this)?
            .tools
            .iter()
            .map(convert::tool_spec)
            .collect())
    }

    fn set_tools(
        &mut self,
        this: Resource<ChatRequest>,
        tools: Vec<wit::ToolSpec>,
    ) -> wasmtime::Result<Result<(), String>> {
        let tools = match tools
            .into_iter()
            .map(convert::from_tool_spec)
            .collect::<Result<Vec<_>, _>>()
        {
            Ok(tools) => tools,
            Err(e) => return Ok(Err(e)),
        };
        self.table.get_mut(&this)?.tools = Arc::new(tools);
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn options(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<String> {
        Ok(serde_json::Value::Object((*self.table.get(&this)?.options).clone()).to_string())
    }

    fn set_options(
        &mut self,
        this: Resource<ChatRequest>,
        options: String,
    ) -> wasmtime::Result<Result<(), String>> {
        match json_object(&options, "options") {
            Ok(map) => {
                self.table.get_mut(&this)?.options = Arc::new(map);
                self.recharge(&this)?;
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn drop(&mut self, this: Resource<ChatRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostChatResponse for HostState {
    fn new(
        &mut self,
        message: wit::Message,
        finish_reason: wit::FinishReason,
    ) -> wasmtime::Result<Resource<ChatResponse>> {
        self.keep(ChatResponse::new(message.into(), finish_reason.into()))
    }

    fn message(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<wit::Message> {
        Ok(convert::message(&self.table.get(&this)?.message))
    }

    fn set_message(
        &mut self,
        this: Resource<ChatResponse>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.message = message.into();
        self.recharge(&this)?;
        Ok(())
    }

    fn text(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.text())
    }

    fn set_text(&mut self, this: Resource<ChatResponse>, text: String) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.message.content = Some(Content::Text(text));
        self.recharge(&this)?;
        Ok(())
    }

    fn finish_reason(
        &mut self,
        this: Resource<ChatResponse>,
    ) -> wasmtime::Result<wit::FinishReason> {
        Ok(convert::finish_reason(self.table.get(&this)?.finish_reason))
    }

    fn set_finish_reason(
        &mut self,
        this: Resource<ChatResponse>,
        reason: wit::FinishReason,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.finish_reason = FinishReason::from(reason);
        Ok(())
    }

    fn usage(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<wit::Usage> {
        Ok(convert::usage(self.table.get(&this)?.usage))
    }

    fn set_usage(
        &mut self,
        this: Resource<ChatResponse>,
        usage: wit::Usage,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.usage = usage.into();
        Ok(())
    }

    fn model(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.model.clone())
    }

    fn metadata(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<String> {
        Ok(serde_json::Value::Object(self.table.get(&this)?.metadata.clone()).to_string())
    }

    fn set_metadata(
        &mut self,
        this: Resource<ChatResponse>,
        metadata: String,
    ) -> wasmtime::Result<Result<(), String>> {
        match json_object(&metadata, "metadata") {
            Ok(map) => {
                self.table.get_mut(&this)?.metadata = map;
                self.recharge(&this)?;
                Ok(Ok(()))
            }
            Err(e) => Ok(Err(e)),
        }
    }

    fn drop(&mut self, this: Resource<ChatResponse>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostToolRequest for HostState {
    fn tool(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<wit::ToolSpec> {
        Ok(convert::tool_spec(&self.table.get(&this)?.tool))
    }

    fn name(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.tool.name.clone())
    }

    fn call_id(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.call_id.to_string())
    }

    fn arguments(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.arguments.to_string())
    }

    fn set_arguments(
        &mut self,
        this: Resource<ToolRequest>,
        arguments: String,
    ) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = json_object(&arguments, "arguments") {
            return Ok(Err(e));
        }
        self.table.get_mut(&this)?.arguments = Arc::from(arguments);
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn drop(&mut self, this: Resource<ToolRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostToolResponse for HostState {
    fn new(&mut self, output: String) -> wasmtime::Result<Resource<ToolResponse>> {
        json_text(&output, "tool-response output").map_err(wasmtime::Error::msg)?;
        self.keep(ToolResponse { output })
    }

    fn output(&mut self, this: Resource<ToolResponse>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.output.clone())
    }

    fn set_output(
        &mut self,
        this: Resource<ToolResponse>,
        output: String,
    ) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = json_text(&output, "output") {
            return Ok(Err(e));
        }
        self.table.get_mut(&this)?.output = output;
        self.recharge(&this)?;
        Ok(Ok(()))
    }

    fn drop(&mut self, this: Resource<ToolResponse>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnRequest for HostState {
    fn new(&mut self, messages: Vec<wit::Message>) -> wasmtime::Result<Resource<TurnRequest>> {
        self.keep(TurnRequest::new(convert::from_messages(messages)))
    }

    fn messages(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<Vec<wit::Message>> {
        Ok(convert::messages(&self.table.get(&this)?.messages))
    }

    fn message_count(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.messages.len() as u32)
    }

    fn set_messages(
        &mut self,
        this: Resource<TurnRequest>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.messages = Arc::new(convert::from_messages(messages));
        self.recharge(&this)?;
        Ok(())
    }

    fn push_message(
        &mut self,
        this: Resource<TurnRequest>,
        message: wit::Message,
    ) -> wasmtime::Result<()> {
        Arc::make_mut(&mut self.table.get_mut(&this)?.messages).push(message.into());
        self.recharge(&this)?;
        Ok(())
    }

    fn resume(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&this)?.resume)
    }

    fn set_resume(&mut self, this: Resource<TurnRequest>, resume: bool) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.resume = resume;
        Ok(())
    }

    fn load_history(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<bool> {
        Ok(self.table.get(&this)?.load_history)
    }

    fn set_load_history(
        &mut self,
        this: Resource<TurnRequest>,
        load_history: bool,
    ) -> wasmtime::Result<()> {
        self.table.get_mut(&this)?.load_history = load_history;
        Ok(())
    }

    fn drop(&mut self, this: Resource<TurnRequest>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnDone for HostState {
    fn new(
        &mut self,
        response: Resource<ChatResponse>,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<Resource<TurnDone>> {
        let response = self.take(response)?;
        let done = TurnDone {
            response,
            tool_calls: Vec::new(),
            iterations: 0,
            messages: Arc::new(convert::from_messages(messages)),
        };
        self.keep(done)
    }

    fn response(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<Resource<ChatResponse>> {
        let response = self.table.get(&this)?.response.clone();
        self.keep(response)
    }

    fn tool_calls(
        &mut self,
        this: Resource<TurnDone>,
    ) -> wasmtime::Result<Vec<wit::ToolCallRecord>> {
        Ok(self
            .table
            .get(&this)?
            .tool_calls
            .iter()
            .map(convert::tool_call_record)
            .collect())
    }

    fn iterations(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.iterations)
    }

    fn messages(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<Vec<wit::Message>> {
        Ok(convert::messages(&self.table.get(&this)?.messages))
    }

    fn message_count(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<u32> {
        Ok(self.table.get(&this)?.messages.len() as u32)
    }

    fn drop(&mut self, this: Resource<TurnDone>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl wit::HostTurnInterrupt for HostState {
    fn reason(&mut self, this: Resource<TurnInterrupt>) -> wasmtime::Result<String> {
        Ok(self.table.get(&this)?.reason.clone())
    }

    fn pending(
        &mut self,
        this: Resource<TurnInterrupt>,
    ) -> wasmtime::Result<Option<wit::ToolCall>> {
        Ok(self
            .table
            .get(&this)?
            .pending
            .as_ref()
            .map(convert::tool_call))
    }

    fn drop(&mut self, this: Resource<TurnInterrupt>) -> wasmtime::Result<()> {
        self.take(this)?;
        Ok(())
    }
}

impl next::Host for HostState {
    async fn chat(
        &mut self,
        request: Resource<ChatRequest>,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        self.chat_inner(request, None).await
    }

    async fn tool(
        &mut self,
        request: Resource<ToolRequest>,
    ) -> wasmtime::Result<Result<Resource<ToolResponse>, wit::FilterError>> {
        self.tool_inner(request, None).await
    }

    async fn turn(&mut self, request: Resource<TurnRequest>) -> wasmtime::Result<wit::TurnResult> {
        self.turn_inner(request, None).await
    }

    async fn chat_within(
        &mut self,
        request: Resource<ChatRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        self.chat_inner(request, Some(timeout_ms)).await
    }

    async fn tool_within(
        &mut self,
        request: Resource<ToolRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Resource<ToolResponse>, wit::FilterError>> {
        self.tool_inner(request, Some(timeout_ms)).await
    }

    async fn turn_within(
        &mut self,
        request: Resource<TurnRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<wit::TurnResult> {
        self.turn_inner(request, Some(timeout_ms)).await
    }
}

impl fctx::Host for HostState {
    fn get(&mut self) -> wasmtime::Result<String> {
        match &self.scope {
            Some(scope) => Ok(scope
                .invoke
                .fctx(scope.branch.as_deref(), scope.id)
                .to_string()),
            None => Err(wasmtime::Error::msg("fctx.get called outside a hook")),
        }
    }

    fn set(&mut self, state: String) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = json_text(&state, "the FCtx state") {
            return Ok(Err(e));
        }
        let Some(scope) = &self.scope else {
            return Err(wasmtime::Error::msg("fctx.set called outside a hook"));
        };
        let room = self.limits.host_bytes().saturating_sub(self.held);
        if !scope
            .invoke
            .set_fctx_within(scope.branch.as_deref(), scope.id, state.into(), room)
        {
            return Err(wasmtime::Error::new(HostMemoryExceeded));
        }
        Ok(Ok(()))
    }
}

impl context::Host for HostState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Ok(self
            .scope
            .as_ref()
            .and_then(|scope| scope.invoke.context().get_json(&key)))
    }

    fn set(&mut self, key: String, value: String) -> wasmtime::Result<Result<(), String>> {
        let value: serde_json::Value = match serde_json::from_str(&value) {
            Ok(value) => value,
            Err(e) => return Ok(Err(format!("context value is not JSON: {e}"))),
        };
        let Some(scope) = &self.scope else {
            return Ok(Err("no invoke is in progress".to_owned()));
        };
        let room = self.limits.host_bytes().saturating_sub(self.held);
        match scope
            .invoke
            .write_context(scope.id, &key, Some(value), room)
        {
            Some(before) => {
                self.journal.push((key, before));
                Ok(Ok(()))
            }
            None => Err(wasmtime::Error::new(HostMemoryExceeded)),
        }
    }

    fn remove(&mut self, key: String) -> wasmtime::Result<()> {
        if let Some(scope) = &self.scope
            && let Some(before) = scope.invoke.write_context(scope.id, &key, None, usize::MAX)
        {
            self.journal.push((key, before));
        }
        Ok(())
    }

    fn keys(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self
            .scope
            .as_ref()
            .map(|scope| scope.invoke.context().keys())
            .unwrap_or_default())
    }
}

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        self.log_lines += 1;
        let filter = &*self.identity.name;
        if self.log_lines > LOG_LINES_PER_CALL {
            if self.log_lines == LOG_LINES_PER_CALL + 1 {
                tracing::warn!(
                    target: "shallot::filter",
                    filter,
                    "more than {LOG_LINES_PER_CALL} log lines in one call; the rest of this call's are dropped"
                );
            }
            return Ok(());
        }
        let message = sandbox::printable(&message, TEXT_CAP);
        match level {
            log::Level::Trace => tracing::trace!(target: "shallot::filter", filter, "{message}"),
            log::Level::Debug => tracing::debug!(target: "shallot::filter", filter, "{message}"),
            log::Level::Info => tracing::info!(target: "shallot::filter", filter, "{message}"),
            log::Level::Warn => tracing::warn!(target: "shallot::filter", filter, "{message}"),
            log::Level::Error => tracing::error!(target: "shallot::filter", filter, "{message}"),
        }
        Ok(())
    }
}

/// An error for a call that could not even start (e.g. a full table).
pub(crate) fn internal(error: impl std::fmt::Display) -> ChainError {
    ChainError::new(ErrorKind::Internal, error.to_string())
}
