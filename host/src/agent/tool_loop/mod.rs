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
//!
//! `run` is one turn's state as it goes (messages, calls, rounds, how it
//! ends); this file is the loop around it.

mod run;

use self::run::Run;

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;

use super::history::{History, MemoryHistory};
use crate::onion::Invoke;
use crate::onion::{Terminal, Turn};
use crate::types::{ChainError, ErrorKind, Weigh};
use crate::types::{
    ChatRequest, ChatResponse, Decision, Message, ToolCall, ToolCallRecord, ToolRequest, ToolSpec,
    TurnRequest, TurnResult,
};

/// Limits and behaviour of the tool loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopConfig {
    /// Model rounds before the turn stops with a `limit-exceeded` error.
    pub max_iterations: u32,
    /// Tool calls before the turn stops with a `limit-exceeded` error
    /// (`None`, no limit, by default, as in the seed: the turn is bounded
    /// by `max_iterations` rounds of at most one answer's calls each, see
    /// [`crate::ResponseLimits`]); checked before each round, so the last
    /// batch can go past it by at most one answer's calls.
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
            max_tool_calls: None,
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
/// The spec of the registered tool `name`.
fn spec_of<'a>(tools: &'a [Arc<ToolSpec>], name: &str) -> Option<&'a Arc<ToolSpec>> {
    tools.iter().find(|tool| tool.name == name)
}

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

#[async_trait]
impl Terminal<Turn> for ToolLoop {
    async fn call(&self, request: TurnRequest, invoke: &Arc<Invoke>) -> TurnResult {
        let tools = invoke.core().tools.as_slice();
        let offered: Arc<Vec<ToolSpec>> = Arc::new(tools.iter().map(|t| (**t).clone()).collect());
        let history = self.history.as_ref();
        // Only the first run of a resumed invoke continues the paused turn;
        // a turn filter's re-entry after it runs a fresh loop.
        // An interrupt from another terminal holds something else: a turn
        // of ours starts afresh then.
        let resumed = if request.resume {
            invoke.take_resumed().and_then(|(paused, decision)| {
                let paused = paused.state.downcast::<Paused>().ok()?;
                Some((paused, decision))
            })
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
            // A filter may answer in the model's place: its answer is
            // bounded as the model's is before its calls run.
            let calls = response.message.tool_calls.len();
            let limits = invoke.core().response_limits;
            if let Err(error) = limits.check_as("tool-loop", calls, response.weight()) {
                return TurnResult::Error(error);
            }
            run.rounds = round;
            run.push(response.message.clone());
            let calls = response.message.tool_calls.clone();
            run.last = Some(response.clone());
            if calls.is_empty() {
                return run.done(response);
            }
            let (held, free): (Vec<ToolCall>, Vec<ToolCall>) = calls.into_iter().partition(|c| {
                self.config.pause_sensitive && spec_of(tools, &c.name).is_some_and(|t| t.sensitive)
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
    /// call order. A tool that is not registered but was offered to the
    /// model (a chat filter added it, as `tool-search` adds its search
    /// tool) goes through the tool chain for a filter to serve, the
    /// registry answering `not-found` if none does; a call of a tool
    /// neither registered nor offered fails without running filters.
    async fn run_tools(
        &self,
        invoke: &Arc<Invoke>,
        tools: &[Arc<ToolSpec>],
        calls: &[ToolCall],
    ) -> Vec<Result<String, ChainError>> {
        // Each name is looked up once a batch: an offered spec is copied
        // out of the request, and a batch may call one tool many times.
        let mut specs: HashMap<&str, Option<Arc<ToolSpec>>> = HashMap::new();
        let requests: Vec<Result<ToolRequest, ChainError>> = calls
            .iter()
            .map(|call| {
                let spec = specs.entry(call.name.as_str()).or_insert_with(|| {
                    spec_of(tools, &call.name)
                        .cloned()
                        .or_else(|| invoke.offered(&call.name))
                });
                match spec.clone() {
                    Some(tool) => Ok(ToolRequest {
                        tool,
                        call_id: Arc::from(call.id.as_str()),
                        arguments: Arc::from(call.arguments.as_str()),
                    }),
                    None => Err(ChainError::new(
                        ErrorKind::NotFound,
                        format!("tool '{}' is not registered", call.name),
                    )),
                }
            })
            .collect();
        let serial = !self.config.parallel_tools
            || requests.iter().flatten().any(|request| request.tool.serial);
        let runnable: Vec<ToolRequest> = requests.iter().flatten().cloned().collect();
        let mut outputs = if serial || runnable.len() < 2 {
            invoke.tool_series(runnable).await
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
