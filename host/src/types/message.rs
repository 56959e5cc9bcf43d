use serde::{Deserialize, Serialize};

/// Who a message is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Instructions to the model.
    System,
    /// The person (or the application) asking.
    User,
    /// The model.
    Assistant,
    /// A tool's result.
    Tool,
}

/// One part of a multimodal message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    /// A piece of text.
    Text {
        /// The text.
        text: String,
    },
    /// An image, by URL (or data URL).
    Image {
        /// Where it is.
        url: String,
        /// The detail level the provider should use, if any.
        detail: Option<String>,
    },
}

/// A message body: plain text, or a list of parts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Content {
    /// Plain text.
    Text(String),
    /// Text and image parts, in order.
    Parts(Vec<ContentPart>),
}

/// A call of a tool that the model asked for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Correlates the call with its result message.
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, a JSON object as text (as the model produced it).
    pub arguments: String,
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who it is from.
    pub role: Role,
    /// `None` for an assistant message that only calls tools.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<Content>,
    /// For an assistant message: the tools it calls.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// For a tool message: the id of the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

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

    /// The message's text: its text content, or its text parts joined.
    pub fn text(&self) -> String {
        match &self.content {
            None => String::new(),
            Some(Content::Text(text)) => text.clone(),
            Some(Content::Parts(parts)) => text_of(parts),
        }
    }

    /// Takes the message's text out, leaving it without content; `None`
    /// when it had none. No copy of a text content is made.
    pub fn take_text(&mut self) -> Option<String> {
        Some(match self.content.take()? {
            Content::Text(text) => text,
            Content::Parts(parts) => text_of(&parts),
        })
    }
}

/// The text parts of `parts`, joined.
fn text_of(parts: &[ContentPart]) -> String {
    parts
        .iter()
        .filter_map(|part| match part {
            ContentPart::Text { text } => Some(text.as_str()),
            ContentPart::Image { .. } => None,
        })
        .collect()
}
