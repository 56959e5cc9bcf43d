//! The tool loop: the turn chain's terminal.
//!
//! The turn request carries the turn's new messages; with `load_history`
//! the loop puts the conversation's stored history before them. Each round
//! calls the chat chain, runs the tool calls the model asked for through the
//! tool chain (a batch concurrently, results in call order), appends the
//! assistant and tool messages, and goes again until the model answers
//! without tool calls. The done result carries the final response, the tool
//! calls made, the number of model rounds and the run's whole message
//! sequence, so a turn filter can re-enter with `messages = run messages +
//! feedback, load_history = false`.

use std::sync::Arc;

use async_trait::async_trait;

use super::history::{History, MemoryHistory};
use crate::error::{ChainError, ErrorKind, Origin};
use crate::invoke::Invoke;
use crate::onion::{Terminal, Turn};
use crate::tool::ToolRegistry;
use crate::types::{
    ChatRequest, ChatResponse, FinishReason, Message, ToolCall, ToolCallRecord, ToolRequest,
    TurnDone, TurnInterrupt, TurnRequest, TurnResult,
};

/// Limits and behaviour of the tool loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopConfig {
    /// Model rounds before the turn stops with a `limit-exceeded` error.
    pub max_iterations: u32,
    /// Tool calls before the turn stops with a `limit-exceeded` error
    /// (256 by default; `None` for no limit); checked before each round, so
    /// the last batch can go past it by at most one answer's calls (see
    /// [`crate::ResponseLimits`]).
    pub max_tool_calls: Option<u32>,
    /// Run a batch of tool calls concurrently, unless a tool in it is
    /// `serial`.
    pub parallel_tools: bool,
    /// Pause the turn before running a `sensitive` tool: the turn ends with
    /// an interrupt naming the call, and `Kernel::resume` continues it with
    /// an approval or a denial (which the model gets as the tool result).
    pub pause_sensitive: bool,
}

impl Default for LoopConfig {
    fn default() -> Self {
        LoopConfig {
            max_iterations: 10,
            max_tool_calls: Some(256),
            parallel_tools: true,
            pause_sensitive: false,
        }
    }
}

/// The tool loop, with the history it keeps conversations in.
pub struct ToolLoop {
    config: LoopConfig,
    history: Arc<dyn History>,
}

impl Default for ToolLoop {
    fn default() -> Self {
        Self::new(LoopConfig::default(), MemoryHistory::default())
    }
}

impl ToolLoop {
    /// A loop with `config`, keeping conversations in `history`.
    pub fn new(config: LoopConfig, history: impl History) -> Self {
        ToolLoop {
            config,
            history: Arc::new(history),
        }
    }
}

/// The context key that names the conversation a turn belongs to.
pub const CONVERSATION_ID: &str = "conversation_id";

/// The conversation an invoke belongs to, from its context.
fn conversation(invoke: &Invoke) -> Option<String> {
    invoke.context().get(CONVERSATION_ID).map(|id| match id {
        serde_json::Value::String(id) => id,
        other => other.to_string(),
    })
}

/// Where a paused turn stopped: its messages and calls so far, its model
/// rounds, and the calls waiting for a decision.
#[derive(Debug, PartialEq)]
pub struct Paused {
    messages: Vec<Message>,
    calls: Vec<ToolCallRecord>,
    rounds: u32,
    pending: Vec<ToolCall>,
    last: ChatResponse,
}

/// What to do with the tool calls a paused turn waits on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run them.
    Approve,
    /// Do not run them; the model gets this reason as their result.
    Deny(String),
}

/// One run of the loop: the messages so far and what was done.
struct Run<'a> {
    history: &'a dyn History,
    conversation: Option<String>,
    messages: Vec<Message>,
    calls: Vec<ToolCallRecord>,
    rounds: u32,
    last: Option<ChatResponse>,
}

impl<'a> Run<'a> {
    fn start(history: &'a dyn History, invoke: &Invoke, request: &TurnRequest) -> Self {
        let conversation = conversation(invoke);
        let stored = conversation
            .as_deref()
            .map(|c| history.load(c))
            .unwrap_or_default();
        let mut messages = if request.load_history {
            stored.clone()
        } else {
            Vec::new()
        };
        messages.extend(request.messages.iter().cloned());
        let run = Run {
            history,
            conversation,
            messages,
            calls: Vec::new(),
            rounds: 0,
            last: None,
        };
        // A re-entry sends the history it already has: store only what
        // follows it, so nothing is stored twice.
        let fresh = match request.messages.starts_with(&stored) {
            true => &request.messages[stored.len()..],
            false => &request.messages[..],
        };
        run.store(fresh);
        run
    }

    /// Picks up a paused turn where it stopped.
    fn resume(history: &'a dyn History, invoke: &Invoke, paused: &Paused) -> Self {
        Run {
            history,
            conversation: conversation(invoke),
            messages: paused.messages.clone(),
            calls: paused.calls.clone(),
            rounds: paused.rounds,
            last: Some(paused.last.clone()),
        }
    }

    fn store(&self, messages: &[Message]) {
        if let Some(conversation) = self.conversation.as_deref()
            && !messages.is_empty()
        {
            self.history.append(conversation, messages);
        }
    }

    fn push(&mut self, message: Message) {
        self.store(std::slice::from_ref(&message));
        self.messages.push(message);
    }

    fn summary(&self, response: ChatResponse) -> TurnDone {
        TurnDone {
            response,
            tool_calls: self.calls.clone(),
            iterations: self.rounds,
            messages: Arc::new(self.messages.clone()),
        }
    }

    /// Records a batch's outcomes: the tool messages and call records.
    fn record(&mut self, calls: Vec<ToolCall>, outcomes: Vec<Result<String, ChainError>>) {
        for (call, outcome) in calls.into_iter().zip(outcomes) {
            let (content, output, error) = match outcome {
                Ok(output) => (model_text(&output), Some(output), None),
                Err(error) => (error_text(&error), None, Some(error)),
            };
            self.push(Message::tool_result(call.id.clone(), content));
            self.calls.push(ToolCallRecord {
                call,
                output,
                error,
            });
        }
    }

    /// Records a batch and, when every call was to a `return_direct` tool
    /// and none failed, ends the turn with their outputs as the answer.
    fn settle(
        &mut self,
        tools: &ToolRegistry,
        calls: Vec<ToolCall>,
        outcomes: Vec<Result<String, ChainError>>,
    ) -> Option<TurnResult> {
        let direct = !calls.is_empty()
            && outcomes.iter().all(Result::is_ok)
            && calls
                .iter()
                .all(|c| tools.spec(&c.name).is_some_and(|t| t.return_direct));
        let answers: Vec<String> = outcomes
            .iter()
            .flatten()
            .map(|output| model_text(output))
            .collect();
        self.record(calls, outcomes);
        if !direct {
            return None;
        }
        let mut answer = ChatResponse::new(
            Message::assistant(answers.join("\n")),
            FinishReason::Complete,
        );
        answer.metadata.insert("return_direct".into(), true.into());
        self.push(answer.message.clone());
        Some(TurnResult::Done(self.summary(answer)))
    }

    /// Pauses the turn: `held` wait for a decision.
    fn pause(self, held: Vec<ToolCall>) -> TurnResult {
        let reason = format!("tool '{}' needs approval", held[0].name);
        let pending = Some(held[0].clone());
        let last = self
            .last
            .clone()
            .unwrap_or_else(|| ChatResponse::new(Message::assistant(""), FinishReason::Unknown));
        let paused = Paused {
            messages: self.messages,
            calls: self.calls,
            rounds: self.rounds,
            pending: held,
            last,
        };
        TurnResult::Interrupt(TurnInterrupt {
            reason,
            pending,
            paused: Some(Arc::new(paused)),
        })
    }

    fn done(self, response: ChatResponse) -> TurnResult {
        TurnResult::Done(self.summary(response))
    }

    /// Stops at a limit, keeping what ran.
    fn stop(self, message: String) -> TurnResult {
        let last = self
            .last
            .clone()
            .unwrap_or_else(|| ChatResponse::new(Message::assistant(""), FinishReason::Unknown));
        let mut error =
            ChainError::new(ErrorKind::LimitExceeded, message).at(Origin::terminal("tool-loop"));
        error.ran = Some(Arc::new(self.summary(last)));
        TurnResult::Error(error)
    }
}

/// What a tool result looks like to the model: a JSON string as its text,
/// any other JSON as JSON.
fn model_text(output: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(output) {
        Ok(serde_json::Value::String(text)) => text,
        _ => output.to_owned(),
    }
}

/// A failed call as the model sees it: a JSON error object.
fn error_text(error: &ChainError) -> String {
    serde_json::json!({ "error": { "type": error.kind.as_str(), "message": error.message } })
        .to_string()
}

#[async_trait]
impl Terminal<Turn> for ToolLoop {
    async fn call(&self, request: TurnRequest, invoke: &Arc<Invoke>) -> TurnResult {
        let tools = invoke.core().tools();
        let offered = Arc::new(tools.specs());
        let history = self.history.as_ref();
        // Only the first run of a resumed invoke continues the paused turn;
        // a turn filter's re-entry after it runs a fresh loop.
        let resumed = if request.resume {
            invoke.take_resumed()
        } else {
            None
        };
        let mut run = match &resumed {
            Some((paused, _)) => Run::resume(history, invoke, paused),
            None => Run::start(history, invoke, &request),
        };
        if let Some((paused, decision)) = resumed {
            let outcomes = match decision {
                Decision::Approve => self.run_tools(invoke, tools, &paused.pending).await,
                Decision::Deny(reason) => paused
                    .pending
                    .iter()
                    .map(|_| Err(denied(&reason)))
                    .collect(),
            };
            if let Some(done) = run.settle(tools, paused.pending.clone(), outcomes) {
                return done;
            }
        }
        for round in run.rounds + 1..=self.config.max_iterations {
            if let Some(max) = self.config.max_tool_calls
                && run.calls.len() >= max as usize
            {
                let made = run.calls.len();
                return run.stop(format!(
                    "the turn made {made} tool calls; the limit is {max}"
                ));
            }
            let chat = ChatRequest {
                messages: Arc::new(run.messages.clone()),
                tools: offered.clone(),
                ..Default::default()
            };
            let response = match invoke.chat(chat).await {
                Ok(response) => response,
                Err(error) => return TurnResult::Error(error),
            };
            run.rounds = round;
            run.push(response.message.clone());
            let calls = response.message.tool_calls.clone();
            run.last = Some(response.clone());
            if calls.is_empty() {
                return run.done(response);
            }
            let (held, free): (Vec<ToolCall>, Vec<ToolCall>) = calls.into_iter().partition(|c| {
                self.config.pause_sensitive && tools.spec(&c.name).is_some_and(|t| t.sensitive)
            });
            let outcomes = self.run_tools(invoke, tools, &free).await;
            if held.is_empty() {
                if let Some(done) = run.settle(tools, free, outcomes) {
                    return done;
                }
                continue;
            }
            run.record(free, outcomes);
            return run.pause(held);
        }
        let max = self.config.max_iterations;
        run.stop(format!(
            "the turn reached {max} model rounds without a final answer"
        ))
    }
}

/// A tool call a human (or policy) refused, as the model sees it.
fn denied(reason: &str) -> ChainError {
    ChainError::new(
        ErrorKind::InvalidRequest,
        format!("the call was denied: {reason}"),
    )
}

impl ToolLoop {
    /// Runs a batch of tool calls through the tool chain: concurrently
    /// unless configured otherwise or a tool in it is `serial`. Outputs in
    /// call order; a call of an unknown tool fails without running filters.
    async fn run_tools(
        &self,
        invoke: &Arc<Invoke>,
        tools: &ToolRegistry,
        calls: &[ToolCall],
    ) -> Vec<Result<String, ChainError>> {
        let requests: Vec<Result<ToolRequest, ChainError>> = calls
            .iter()
            .map(|call| match tools.spec(&call.name) {
                Some(tool) => Ok(ToolRequest {
                    tool,
                    call_id: Arc::from(call.id.as_str()),
                    arguments: Arc::from(call.arguments.as_str()),
                }),
                None => Err(ChainError::new(
                    ErrorKind::NotFound,
                    format!("tool '{}' is not registered", call.name),
                )),
            })
            .collect();
        let serial = !self.config.parallel_tools
            || requests.iter().flatten().any(|request| request.tool.serial);
        let runnable: Vec<ToolRequest> = requests.iter().flatten().cloned().collect();
        let mut outputs = if serial || runnable.len() < 2 {
            let mut outputs = Vec::with_capacity(runnable.len());
            for request in runnable {
                outputs.push(invoke.tool(request).await);
            }
            outputs
        } else {
            invoke.tool_batch(runnable).await
        }
        .into_iter();
        requests
            .into_iter()
            .map(|request| match request {
                Ok(_) => outputs
                    .next()
                    .expect("one output per runnable call")
                    .map(|r| r.output),
                Err(error) => Err(error),
            })
            .collect()
    }
}
