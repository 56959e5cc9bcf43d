//! A client's Messages request as it comes in: its messages, content
//! blocks, system prompt, tools and tool choice as typed structs read
//! straight from the body, then put in our terms. Which role may hold
//! which block is checked on the way.

use serde::Deserialize;
use serde_json::Value;

use crate::model::wire::{Arguments, TextOr};
use crate::types::{Content, ContentPart, Message, Role, ToolCall, ToolChoice, ToolSpec};

/// A message as a client sends it.
#[derive(Deserialize)]
pub(super) struct InMessage {
    role: InRole,
    content: TextOr<Block>,
}

#[derive(Deserialize, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum InRole {
    User,
    Assistant,
}

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Image {
        source: Source,
    },
    ToolResult {
        tool_use_id: String,
        #[serde(default)]
        content: Option<TextOr<ResultBlock>>,
        #[serde(default)]
        is_error: bool,
    },
    ToolUse {
        id: String,
        name: String,
        #[serde(default)]
        input: Arguments,
    },
    Thinking {},
    RedactedThinking {},
}

/// An image's source: its bytes in base64, or a URL.
#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Source {
    Base64 {
        #[serde(default)]
        media_type: Option<String>,
        data: String,
    },
    Url {
        url: String,
    },
}

/// A block of a tool's result: its text is what the model reads.
#[derive(Deserialize)]
struct ResultBlock {
    #[serde(default)]
    text: Option<String>,
}

impl Block {
    fn kind(&self) -> &'static str {
        match self {
            Block::Text { .. } => "text",
            Block::Image { .. } => "image",
            Block::ToolResult { .. } => "tool_result",
            Block::ToolUse { .. } => "tool_use",
            Block::Thinking {} => "thinking",
            Block::RedactedThinking {} => "redacted_thinking",
        }
    }
}

impl InMessage {
    /// The message in our terms, added to `messages`: a user message's
    /// `tool_result` blocks become tool messages (before its other
    /// blocks), an assistant's `tool_use` blocks its tool calls; thinking
    /// blocks are left out.
    pub(super) fn into_messages(self, messages: &mut Vec<Message>) -> Result<(), String> {
        let role = match self.role {
            InRole::User => Role::User,
            InRole::Assistant => Role::Assistant,
        };
        let blocks = match self.content {
            TextOr::Text(text) => {
                messages.push(Message::new(role, text));
                return Ok(());
            }
            TextOr::List(blocks) => blocks,
        };
        let mut parts = Vec::new();
        let mut calls = Vec::new();
        for block in blocks {
            let kind = block.kind();
            match (block, self.role) {
                (Block::Text { text }, _) => parts.push(ContentPart::Text { text }),
                (Block::Image { source }, InRole::User) => parts.push(source.into_part()),
                (
                    Block::ToolResult {
                        tool_use_id,
                        content,
                        is_error,
                    },
                    InRole::User,
                ) => messages.push(tool_result(tool_use_id, content, is_error)),
                (Block::ToolUse { id, name, input }, InRole::Assistant) => calls.push(ToolCall {
                    id,
                    name,
                    arguments: input.0,
                }),
                (Block::Thinking {} | Block::RedactedThinking {}, InRole::Assistant) => {}
                (_, role) => {
                    let role = if role == InRole::User {
                        "user"
                    } else {
                        "assistant"
                    };
                    return Err(format!("a {role} message cannot hold a '{kind}' block"));
                }
            }
        }
        if !parts.is_empty() || !calls.is_empty() {
            messages.push(Message {
                role,
                content: (!parts.is_empty()).then_some(Content::Parts(parts)),
                tool_calls: calls,
                tool_call_id: None,
            });
        }
        Ok(())
    }
}

impl Source {
    /// The image as a part (a data URL for base64).
    fn into_part(self) -> ContentPart {
        let url = match self {
            Source::Base64 { media_type, data } => format!(
                "data:{};base64,{data}",
                media_type.as_deref().unwrap_or("image/png")
            ),
            Source::Url { url } => url,
        };
        ContentPart::Image { url, detail: None }
    }
}

/// A `tool_result` block as a tool message; an error result says so.
fn tool_result(id: String, content: Option<TextOr<ResultBlock>>, is_error: bool) -> Message {
    let output = match content {
        None => String::new(),
        Some(TextOr::Text(text)) => text,
        Some(TextOr::List(blocks)) => blocks
            .into_iter()
            .filter_map(|block| block.text)
            .collect::<Vec<_>>()
            .join("\n"),
    };
    let output = if is_error {
        format!("Error: {output}")
    } else {
        output
    };
    Message::tool_result(id, output)
}

/// The system prompt: a string, or text blocks (joined by a blank line).
#[derive(Deserialize)]
pub(super) struct System(TextOr<SystemBlock>);

#[derive(Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum SystemBlock {
    Text { text: String },
}

impl System {
    pub(super) fn into_message(self) -> Message {
        match self.0 {
            TextOr::Text(text) => Message::system(text),
            TextOr::List(blocks) => {
                let texts: Vec<String> = blocks
                    .into_iter()
                    .map(|SystemBlock::Text { text }| text)
                    .collect();
                Message::system(texts.join("\n\n"))
            }
        }
    }
}

/// A client's tool (`name`, `description`, `input_schema`); Anthropic's
/// server tools (web search, ...) are not the gateway's to run.
#[derive(Deserialize)]
pub(super) struct InTool {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    name: String,
    #[serde(default)]
    description: Option<String>,
    #[serde(default)]
    input_schema: Option<Value>,
}

impl InTool {
    pub(super) fn into_tool(self) -> Result<ToolSpec, String> {
        if let Some(kind) = self.kind.filter(|kind| kind != "custom") {
            return Err(format!(
                "the server tool '{kind}' is not supported: only client tools (`name`, `input_schema`)"
            ));
        }
        let Some(schema) = self.input_schema else {
            return Err(format!("tool '{}' has no `input_schema`", self.name));
        };
        Ok(ToolSpec::new(
            self.name,
            self.description.unwrap_or_default(),
            schema,
        ))
    }
}

/// Anthropic's `tool_choice`.
#[derive(Deserialize)]
pub(super) struct InChoice {
    #[serde(rename = "type")]
    kind: ChoiceKind,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    disable_parallel_tool_use: bool,
}

#[derive(Deserialize)]
#[serde(rename_all = "lowercase")]
enum ChoiceKind {
    Auto,
    Any,
    Tool,
    None,
}

impl InChoice {
    /// The choice in our terms, and whether calls may run in parallel.
    pub(super) fn into_choice(self) -> Result<(ToolChoice, bool), String> {
        let choice = match self.kind {
            ChoiceKind::Auto => ToolChoice::Auto,
            ChoiceKind::Any => ToolChoice::Required,
            ChoiceKind::None => ToolChoice::None,
            ChoiceKind::Tool => ToolChoice::Tool(self.name.ok_or("`tool_choice` has no `name`")?),
        };
        Ok((choice, !self.disable_parallel_tool_use))
    }
}
