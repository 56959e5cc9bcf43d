use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::{ChainError, ErrorKind, JsonMap, Message, ModelOptions, Origin, ToolSpec};

/// A request to the model: what the chat chain carries inward.
#[derive(Debug, Clone, Default)]
pub struct ChatRequest {
    /// The conversation, oldest first.
    pub messages: Arc<Vec<Message>>,
    /// The tools offered to the model.
    pub tools: Arc<Vec<ToolSpec>>,
    /// What shapes the answer (`temperature`, `max_tokens`, ...).
    pub options: Arc<ModelOptions>,
}

impl ChatRequest {
    /// A request with `messages` and no tools or options.
    pub fn new(messages: Vec<Message>) -> Self {
        ChatRequest {
            messages: Arc::new(messages),
            ..Default::default()
        }
    }

    /// Offers `tools` to the model.
    pub fn with_tools(mut self, tools: Vec<ToolSpec>) -> Self {
        self.tools = Arc::new(tools);
        self
    }

    /// Asks the model with `options`.
    pub fn with_options(mut self, options: ModelOptions) -> Self {
        self.options = Arc::new(options);
        self
    }

    /// The options, to change (copied first only if another layer shares
    /// them).
    pub fn options_mut(&mut self) -> &mut ModelOptions {
        Arc::make_mut(&mut self.options)
    }

    /// The messages, to change (copied first only if another layer shares them).
    pub fn messages_mut(&mut self) -> &mut Vec<Message> {
        Arc::make_mut(&mut self.messages)
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FinishReason {
    /// A final answer.
    Complete,
    /// The model asks for tool calls.
    ToolUse,
    /// The token limit cut the answer short.
    LengthLimit,
    /// A filter or the provider blocked the content.
    ContentFiltered,
    /// A stop sequence ended the answer.
    StopSequence,
    /// The provider paused a long turn.
    PauseTurn,
    /// The model refused.
    Refusal,
    /// The answer ended in an error.
    Error,
    /// Not said.
    #[default]
    Unknown,
}

/// Token accounting of one model call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    /// Tokens of the request.
    pub input_tokens: u32,
    /// Tokens of the answer.
    pub output_tokens: u32,
    /// Both.
    pub total_tokens: u32,
}

/// The model's answer: what the chat chain carries outward.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatResponse {
    /// The assistant's message: text, tool calls or both.
    pub message: Message,
    /// Why the model stopped.
    pub finish_reason: FinishReason,
    /// Token accounting.
    pub usage: Usage,
    /// The model that answered; empty for a response a filter built.
    pub model: String,
    /// Free-form annotations (e.g. `{"safeguard": "blocked"}`).
    pub metadata: JsonMap,
}

impl ChatResponse {
    /// A response carrying `message`.
    pub fn new(message: Message, finish_reason: FinishReason) -> Self {
        ChatResponse {
            message,
            finish_reason,
            usage: Usage::default(),
            model: String::new(),
            metadata: JsonMap::new(),
        }
    }

    /// The answer's text.
    pub fn text(&self) -> String {
        self.message.text()
    }

    /// Whether the answer calls tools.
    pub fn has_tool_calls(&self) -> bool {
        !self.message.tool_calls.is_empty()
    }

    /// Whether the model finished its answer (`FinishReason::Complete`).
    pub fn is_complete(&self) -> bool {
        self.finish_reason == FinishReason::Complete
    }

    /// Whether the answer asks for tools to run: it stopped for them, or
    /// it calls some.
    pub fn needs_tool_call(&self) -> bool {
        self.finish_reason == FinishReason::ToolUse || self.has_tool_calls()
    }
}

/// An empty answer: an assistant message with no
/// content and no tool calls, an unknown finish reason, no usage, no model,
/// no metadata.
impl Default for ChatResponse {
    fn default() -> Self {
        let message = Message {
            content: None,
            ..Message::assistant("")
        };
        ChatResponse::new(message, FinishReason::Unknown)
    }
}

/// Bounds on one answer of the chat chain (the model's, or one a filter
/// made), so a broken or hostile model server or filter cannot grow the
/// host without limit. Past either, the call fails with a
/// `limit-exceeded` error whose origin is the `model` terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResponseLimits {
    /// Bytes of text, tool calls and metadata (16 MiB by default).
    pub max_bytes: usize,
    /// Tool calls (128 by default).
    pub max_tool_calls: usize,
}

impl Default for ResponseLimits {
    fn default() -> Self {
        ResponseLimits {
            max_bytes: 16 << 20,
            max_tool_calls: 128,
        }
    }
}

impl ResponseLimits {
    /// Checks the model's answer that has `tool_calls` calls and weighs
    /// `bytes`.
    pub(crate) fn check(&self, tool_calls: usize, bytes: usize) -> Result<(), ChainError> {
        self.check_as("model", tool_calls, bytes)
    }

    /// The same for the answer `terminal` got from the chat chain.
    pub(crate) fn check_as(
        &self,
        terminal: &str,
        tool_calls: usize,
        bytes: usize,
    ) -> Result<(), ChainError> {
        let message = if tool_calls > self.max_tool_calls {
            format!(
                "the answer has more than {} tool calls",
                self.max_tool_calls
            )
        } else if bytes > self.max_bytes {
            format!("the answer is larger than {} bytes", self.max_bytes)
        } else {
            return Ok(());
        };
        Err(ChainError::new(ErrorKind::LimitExceeded, message).at(Origin::terminal(terminal)))
    }
}
