use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{ChatResponse, Message, ToolCall};
use crate::types::ChainError;

/// One agent turn: what the turn chain carries inward.
#[derive(Debug, Clone)]
pub struct TurnRequest {
    /// The turn's NEW messages (a delta, not the history).
    pub messages: Arc<Vec<Message>>,
    /// Whether this run continues an interrupted turn.
    pub resume: bool,
    /// Whether the loop prepends the conversation's stored history.
    pub load_history: bool,
}

impl TurnRequest {
    /// A new turn with `messages`, loading history.
    pub fn new(messages: Vec<Message>) -> Self {
        TurnRequest {
            messages: Arc::new(messages),
            resume: false,
            load_history: true,
        }
    }
}

/// A tool call made during a turn, with how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallRecord {
    /// The call the model asked for.
    pub call: ToolCall,
    /// The result given back to the model, `None` if the call failed.
    pub output: Option<String>,
    /// Why the call failed, if it did.
    pub error: Option<ChainError>,
}

/// A turn that reached a final answer.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnDone {
    /// The final answer.
    pub response: ChatResponse,
    /// The tool calls made, in order.
    pub tool_calls: Vec<ToolCallRecord>,
    /// The number of model rounds.
    pub iterations: u32,
    /// The run's whole message sequence (history if loaded, the new
    /// messages, every assistant and tool message up to the final answer).
    pub messages: Arc<Vec<Message>>,
}

/// A turn paused for a human or an outside event. Hand it back to
/// `Kernel::resume` with a decision to continue the same turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnInterrupt {
    /// Why the turn paused.
    pub reason: String,
    /// The tool call waiting for a decision, if any.
    pub pending: Option<ToolCall>,
    /// What paused it.
    pub kind: InterruptKind,
    /// Where the terminal stopped, for `resume`; opaque here (the tool
    /// loop knows what it holds).
    pub(crate) paused: Option<Resumable>,
}

/// The filters' private contexts a paused turn carries: each filter's
/// name and state, in the kernel's order.
pub(crate) type Carried = Vec<(Arc<str>, Option<Arc<str>>)>;

/// A paused terminal's own state, carried opaquely by the interrupt, and
/// whether it was resumed: a pause continues once, however often its
/// interrupt is cloned (a second approval would run its calls again).
#[derive(Clone)]
pub(crate) struct Resumable {
    pub(crate) state: Arc<dyn Any + Send + Sync>,
    resumed: Arc<AtomicBool>,
    /// The filters' private contexts when the turn paused, by filter
    /// (name, state): the resumed turn goes on from them.
    pub(crate) fctx: Arc<Carried>,
    /// The shared context when the turn paused: what the resumed turn's
    /// context lacks of it is put back.
    pub(crate) context: Arc<BTreeMap<String, serde_json::Value>>,
}

impl Resumable {
    pub(crate) fn new(state: Arc<dyn Any + Send + Sync>) -> Self {
        Resumable {
            state,
            resumed: Arc::new(AtomicBool::new(false)),
            fctx: Arc::default(),
            context: Arc::default(),
        }
    }

    /// Marks it resumed; `false` when it already was.
    pub(crate) fn claim(&self) -> bool {
        !self.resumed.swap(true, Ordering::AcqRel)
    }
}

impl std::fmt::Debug for Resumable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Resumable(..)")
    }
}

impl PartialEq for Resumable {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }
}

/// What paused a turn: an approval, a question for a human, a policy, or
/// a failure of the environment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InterruptKind {
    /// A `sensitive` tool waits for approval (`LoopConfig::pause_sensitive`).
    #[default]
    Approval,
    /// The model called an interrupt tool ([`super::ToolSpec::interrupt`]): a
    /// question for a human, answered with [`Decision::Reply`].
    ToolRequest,
    /// The tool loop's `on_tool_call` policy held the call.
    Callback,
    /// The call failed for its environment (an `auth` error: credentials,
    /// permissions) and the loop pauses on those (`LoopConfig::on_env_error`):
    /// fix it, then [`Decision::Approve`] runs the call again.
    EnvRetry,
}

impl InterruptKind {
    /// Its name in traces and errors: `approval`, `tool_request`,
    /// `callback` or `env_retry`.
    pub fn as_str(self) -> &'static str {
        match self {
            InterruptKind::Approval => "approval",
            InterruptKind::ToolRequest => "tool_request",
            InterruptKind::Callback => "callback",
            InterruptKind::EnvRetry => "env_retry",
        }
    }
}

/// What to do with the tool calls a paused turn waits on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Run them (for an [`InterruptKind::EnvRetry`] pause: again).
    Approve,
    /// Do not run them; the model gets this reason as their error.
    Deny(String),
    /// Do not run them; each gets this text as its result, as if the tool
    /// had answered it: a human's reply to an interrupt tool.
    Reply(String),
}

impl TurnInterrupt {
    /// An interrupt for `reason`, from a terminal that keeps its own state.
    pub fn new(reason: impl Into<String>, pending: Option<ToolCall>) -> Self {
        TurnInterrupt {
            reason: reason.into(),
            pending,
            kind: InterruptKind::default(),
            paused: None,
        }
    }
}

/// How a turn ended: what the turn chain carries outward.
#[derive(Debug, Clone, PartialEq)]
pub enum TurnResult {
    /// A final answer.
    Done(TurnDone),
    /// Paused, waiting for a decision.
    Interrupt(TurnInterrupt),
    /// Failed.
    Error(ChainError),
}
