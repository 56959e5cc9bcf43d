//! Conveniences on the contract's types.

use crate::{
    ChatRequest, ChatResponse, Content, ContentPart, ErrorKind, FinishReason, Message, Role,
    ToolResponse, Usage,
};

impl Message {
    /// A message with text content.
    pub fn new(role: Role, text: impl Into<String>) -> Self {
        Message {
            role,
            content: Some(Content::Text(text.into())),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }

    /// A system message.
    pub fn system(text: impl Into<String>) -> Self {
        Self::new(Role::System, text)
    }

    /// A user message.
    pub fn user(text: impl Into<String>) -> Self {
        Self::new(Role::User, text)
    }

    /// An assistant message.
    pub fn assistant(text: impl Into<String>) -> Self {
        Self::new(Role::Assistant, text)
    }

    /// A tool-result message answering the call `call_id`.
    pub fn tool_result(call_id: impl Into<String>, output: impl Into<String>) -> Self {
        Message {
            tool_call_id: Some(call_id.into()),
            ..Self::new(Role::Tool, output)
        }
    }

    /// The text of the message: its text content, or its text parts joined.
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => parts
                .iter()
                .filter_map(|part| match part {
                    ContentPart::Text(text) => Some(text.as_str()),
                    ContentPart::Image(_) => None,
                })
                .collect(),
        }
    }
}

impl ChatRequest {
    /// The model this request asks for (its `model` option), empty where
    /// it names none.
    pub fn model(&self) -> String {
        let options: serde_json::Value = serde_json::from_str(&self.options()).unwrap_or_default();
        options["model"].as_str().unwrap_or_default().to_owned()
    }

    /// A rough count of what this request may use, for a limit that holds
    /// it before the model answers: its messages' text at four bytes a
    /// token (rounded up) in, and its `max_completion_tokens` or
    /// `max_tokens` out (or, where it sets neither, `output`).
    pub fn estimated_usage(&self, output: u32) -> Usage {
        let bytes: usize = self.messages().iter().map(|m| m.text().len()).sum();
        let input_tokens = u32::try_from(bytes.div_ceil(4)).unwrap_or(u32::MAX);
        let options: serde_json::Value = serde_json::from_str(&self.options()).unwrap_or_default();
        let output_tokens = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|name| options.get(name).and_then(serde_json::Value::as_u64))
            .map_or(output, |n| u32::try_from(n).unwrap_or(u32::MAX));
        Usage {
            input_tokens,
            output_tokens,
            total_tokens: input_tokens.saturating_add(output_tokens),
        }
    }
}

impl ChatResponse {
    /// An assistant answer with `text`, for a filter that answers itself.
    pub fn from_text(text: impl Into<String>, reason: FinishReason) -> Self {
        ChatResponse::new(&Message::assistant(text), reason)
    }
}

impl ToolResponse {
    /// A tool result from any serializable value.
    pub fn from_value<T: serde::Serialize + ?Sized>(value: &T) -> Self {
        let json = serde_json::to_string(value)
            .unwrap_or_else(|e| panic!("tool output does not serialize: {e}"));
        ToolResponse::new(&json)
    }
}

impl FinishReason {
    /// The contract's name for the reason (`complete`, `tool-use`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Complete => "complete",
            FinishReason::ToolUse => "tool-use",
            FinishReason::LengthLimit => "length-limit",
            FinishReason::ContentFiltered => "content-filtered",
            FinishReason::StopSequence => "stop-sequence",
            FinishReason::PauseTurn => "pause-turn",
            FinishReason::Refusal => "refusal",
            FinishReason::Error => "error",
            FinishReason::Unknown => "unknown",
        }
    }
}

impl ErrorKind {
    /// The contract's name for the kind (`transient`, `not-found`, ...).
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Timeout => "timeout",
            ErrorKind::ContentFiltered => "content-filtered",
            ErrorKind::InvalidRequest => "invalid-request",
            ErrorKind::Auth => "auth",
            ErrorKind::NotFound => "not-found",
            ErrorKind::LimitExceeded => "limit-exceeded",
            ErrorKind::PluginFault => "plugin-fault",
            ErrorKind::Internal => "internal",
        }
    }
}
