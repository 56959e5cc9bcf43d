use std::sync::Arc;

use super::{ChatResponse, Message, ToolCall};
use crate::error::ChainError;

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
    /// Where the tool loop stopped, for `resume`; opaque.
    pub(crate) paused: Option<Arc<crate::agent::Paused>>,
}

impl TurnInterrupt {
    /// An interrupt for `reason`, from a terminal that keeps its own state.
    pub fn new(reason: impl Into<String>, pending: Option<ToolCall>) -> Self {
        TurnInterrupt {
            reason: reason.into(),
            pending,
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
