//! `POST /v1/messages`: Anthropic's Messages API, so that Claude-based
//! tools and the `anthropic` SDKs (pointed at the gateway with
//! `ANTHROPIC_BASE_URL`) get the filters. A request is one chat (or, on an
//! agent route, one turn) like any other; its answer is a `message`, or
//! the stream of `message_start`, `content_block_*`, `message_delta` and
//! `message_stop` events, with `tool_use` blocks for the model's calls and
//! Anthropic's error objects (an `error` event once a stream started).
//! Clients may present their key as `x-api-key` (Anthropic's header) or
//! `Authorization: Bearer`.

mod answer;

use serde::Deserialize;
use serde_json::{Value, json};

use self::answer::Messages;
pub(super) use self::answer::refused;
use super::Route;
use super::handlers::{ChatApi, Prepared};
use super::wire::{ApiError, unique_id};
use crate::types::{
    ChatRequest, Content, ContentPart, Message, ModelOptions, Role, Stop, ToolCall, ToolChoice,
    ToolSpec,
};

/// A `POST /v1/messages` body. Fields the gateway does not read
/// (`thinking`, `service_tier`, ...) are ignored.
#[derive(Deserialize)]
pub(super) struct MessagesRequest {
    model: String,
    max_tokens: u64,
    messages: Vec<Value>,
    #[serde(default)]
    system: Option<Value>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    tool_choice: Option<Value>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<u64>,
    #[serde(default)]
    metadata: Option<Metadata>,
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

impl ChatApi for MessagesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::invalid(format!("the request body is not a Messages request: {e}"))
        })
    }

    fn model(&self) -> &str {
        &self.model
    }

    fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    fn user(&self) -> Option<&str> {
        self.metadata.as_ref()?.user_id.as_deref()
    }

    async fn prepare(self, route: &Route, _: Option<&str>) -> Result<Prepared, ApiError> {
        let chat = self.chat_request().map_err(ApiError::invalid)?;
        let id = unique_id("msg_");
        let dialect = Messages::new(id.clone(), route.model.clone());
        Ok(Prepared {
            chat,
            id,
            dialect: Box::new(dialect),
            keep: None,
        })
    }
}

impl MessagesRequest {
    /// The request in our terms, or what is wrong with it.
    fn chat_request(&self) -> Result<ChatRequest, String> {
        if self.messages.is_empty() {
            return Err("`messages` must not be empty".to_owned());
        }
        let mut messages = Vec::new();
        match &self.system {
            None | Some(Value::Null) => {}
            Some(Value::String(text)) => messages.push(Message::system(text.as_str())),
            Some(Value::Array(blocks)) => {
                let text = blocks
                    .iter()
                    .map(|block| match block["type"].as_str() {
                        Some("text") => Ok(block["text"].as_str().unwrap_or_default()),
                        _ => Err("`system` blocks must be text blocks".to_owned()),
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                messages.push(Message::system(text.join("\n\n")));
            }
            Some(_) => return Err("`system` must be a string or text blocks".to_owned()),
        }
        for (i, message) in self.messages.iter().enumerate() {
            from_wire(message, &mut messages).map_err(|e| format!("messages[{i}]: {e}"))?;
        }
        let tools = self
            .tools
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, tool)| tool_from_wire(tool).map_err(|e| format!("tools[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let (tool_choice, parallel) = match &self.tool_choice {
            Some(choice) => tool_choice(choice).map(|(c, p)| (Some(c), p))?,
            None => (None, true),
        };
        let options = ModelOptions {
            max_tokens: Some(self.max_tokens),
            tool_choice,
            parallel_tool_calls: (!parallel).then_some(false),
            stop: self.stop_sequences.clone().map(Stop::Any),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            user: self.user().map(str::to_owned),
            ..ModelOptions::default()
        };
        let request = ChatRequest::new(messages)
            .with_tools(tools)
            .with_options(options);
        Ok(request)
    }
}

/// One of the client's messages, in our terms: a user message's
/// `tool_result` blocks become tool messages (before its other blocks), an
/// assistant's `tool_use` blocks its tool calls; thinking blocks are left
/// out.
fn from_wire(wire: &Value, messages: &mut Vec<Message>) -> Result<(), String> {
    let role = match wire["role"].as_str() {
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some(other) => return Err(format!("unknown role '{other}' (user or assistant)")),
        None => return Err("a message has no `role`".to_owned()),
    };
    let blocks = match &wire["content"] {
        Value::String(text) => {
            messages.push(Message::new(role, text.as_str()));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => return Err("`content` must be a string or an array of blocks".to_owned()),
    };
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    for block in blocks {
        match (block["type"].as_str(), role) {
            (Some("text"), _) => parts.push(ContentPart::Text {
                text: block["text"].as_str().unwrap_or_default().to_owned(),
            }),
            (Some("image"), Role::User) => parts.push(image(&block["source"])?),
            (Some("tool_result"), Role::User) => messages.push(tool_result(block)?),
            (Some("tool_use"), Role::Assistant) => calls.push(ToolCall {
                id: text(block, "id")?,
                name: text(block, "name")?,
                arguments: match &block["input"] {
                    Value::Null => "{}".to_owned(),
                    input => input.to_string(),
                },
            }),
            (Some("thinking" | "redacted_thinking"), Role::Assistant) => {}
            (Some(other), _) => {
                return Err(format!(
                    "a {} message cannot hold a '{other}' block",
                    role_name(role)
                ));
            }
            (None, _) => return Err("a content block has no `type`".to_owned()),
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

fn role_name(role: Role) -> &'static str {
    match role {
        Role::User => "user",
        _ => "assistant",
    }
}

fn text(block: &Value, field: &str) -> Result<String, String> {
    block[field]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| format!("a '{}' block has no `{field}`", block["type"]))
}

/// An image block's source as an image part (a data URL for base64).
fn image(source: &Value) -> Result<ContentPart, String> {
    let url = match source["type"].as_str() {
        Some("base64") => format!(
            "data:{};base64,{}",
            source["media_type"].as_str().unwrap_or("image/png"),
            source["data"]
                .as_str()
                .ok_or("an image source has no `data`")?
        ),
        Some("url") => source["url"]
            .as_str()
            .ok_or("an image source has no `url`")?
            .to_owned(),
        _ => return Err("an image's source must be `base64` or `url`".to_owned()),
    };
    Ok(ContentPart::Image { url, detail: None })
}

/// A `tool_result` block as a tool message; an error result says so.
fn tool_result(block: &Value) -> Result<Message, String> {
    let id = text(block, "tool_use_id")?;
    let output = match &block["content"] {
        Value::Null => String::new(),
        Value::String(text) => text.clone(),
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => return Err("a tool result's `content` must be a string or blocks".to_owned()),
    };
    let output = if block["is_error"] == json!(true) {
        format!("Error: {output}")
    } else {
        output
    };
    Ok(Message::tool_result(id, output))
}

/// A client's tool (`name`, `description`, `input_schema`), in our terms;
/// Anthropic's server tools (web search, ...) are not the gateway's to run.
fn tool_from_wire(wire: &Value) -> Result<ToolSpec, String> {
    if !matches!(wire["type"].as_str(), None | Some("custom")) {
        return Err(format!(
            "the server tool '{}' is not supported: only client tools (`name`, `input_schema`)",
            wire["type"].as_str().unwrap_or_default()
        ));
    }
    let name = wire["name"].as_str().ok_or("a tool has no `name`")?;
    let schema = match &wire["input_schema"] {
        Value::Null => return Err(format!("tool '{name}' has no `input_schema`")),
        schema => schema.clone(),
    };
    let description = wire["description"].as_str().unwrap_or_default();
    Ok(ToolSpec::new(name, description, schema))
}

/// Anthropic's `tool_choice` as OpenAI's, and whether calls may run in
/// parallel.
fn tool_choice(choice: &Value) -> Result<(ToolChoice, bool), String> {
    let parallel = choice["disable_parallel_tool_use"] != json!(true);
    let choice = match choice["type"].as_str() {
        Some("auto") => ToolChoice::Auto,
        Some("any") => ToolChoice::Required,
        Some("none") => ToolChoice::None,
        Some("tool") => {
            let name = choice["name"]
                .as_str()
                .ok_or("`tool_choice` has no `name`")?;
            ToolChoice::Tool(name.to_owned())
        }
        _ => return Err("`tool_choice.type` must be auto, any, tool or none".to_owned()),
    };
    Ok((choice, parallel))
}
