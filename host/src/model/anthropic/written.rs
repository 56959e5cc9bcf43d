//! A chat request as a Messages request's body: typed structs borrowed
//! from the request, serialized once (no JSON tree built between). Its
//! system messages become `system`, its tool results `tool_result` blocks
//! of a user message, its assistant's calls `tool_use` blocks, and the
//! options Anthropic takes go under its names (`stop` as
//! `stop_sequences`, `tool_choice`, `user` as `metadata.user_id`); the
//! others (OpenAI's own) are left out.

use serde::Serialize;
use serde_json::Value;
use serde_json::value::RawValue;

use crate::types::{ChatRequest, Content, ContentPart, Message, Role, ToolChoice};

#[derive(Serialize)]
pub(super) struct Outgoing<'a> {
    model: &'a str,
    max_tokens: u64,
    messages: Vec<Turn<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<OutTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_sequences: Option<&'a [String]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<OutChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metadata: Option<Metadata<'a>>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    stream: bool,
}

/// One turn: consecutive messages of one role are one (a batch's tool
/// results must come in one user message).
#[derive(Serialize)]
struct Turn<'a> {
    role: &'static str,
    content: Vec<Block<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Text {
        text: &'a str,
    },
    Image {
        source: Source<'a>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a RawValue,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: String,
    },
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Source<'a> {
    Base64 { media_type: &'a str, data: &'a str },
    Url { url: &'a str },
}

#[derive(Serialize)]
struct OutTool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
}

#[derive(Serialize)]
struct OutChoice<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    disable_parallel_tool_use: bool,
}

#[derive(Serialize)]
struct Metadata<'a> {
    user_id: &'a str,
}

/// The Messages request for `request`, to `model` unless its options name
/// another, at most `max_tokens` unless they say.
pub(super) fn outgoing<'a>(
    request: &'a ChatRequest,
    model: &'a str,
    max_tokens: u64,
    stream: bool,
) -> Outgoing<'a> {
    let options = &request.options;
    let (system, messages) = turns(request);
    let serial = options.parallel_tool_calls == Some(false) && !request.tools.is_empty();
    let tool_choice = match (&options.tool_choice, serial) {
        (None, false) => None,
        (choice, _) => Some(out_choice(choice.as_ref(), serial)),
    };
    Outgoing {
        model: options.model.as_deref().unwrap_or(model),
        max_tokens: options
            .max_tokens
            .or(options.max_completion_tokens)
            .unwrap_or(max_tokens),
        messages,
        system,
        tools: request
            .tools
            .iter()
            .map(|t| OutTool {
                name: &t.name,
                description: &t.description,
                input_schema: &t.parameters,
            })
            .collect(),
        temperature: options.temperature,
        top_p: options.top_p,
        top_k: options.top_k,
        stop_sequences: options.stop.as_ref().map(|stop| stop.texts()),
        tool_choice,
        metadata: options.user.as_deref().map(|user_id| Metadata { user_id }),
        stream,
    }
}

/// OpenAI's `tool_choice` as Anthropic's (`auto` where none was given but
/// calls must come one at a time).
fn out_choice(choice: Option<&ToolChoice>, serial: bool) -> OutChoice<'_> {
    let (kind, name) = match choice {
        None | Some(ToolChoice::Auto) => ("auto", None),
        Some(ToolChoice::Required) => ("any", None),
        Some(ToolChoice::None) => ("none", None),
        Some(ToolChoice::Tool(name)) => ("tool", Some(name.as_str())),
    };
    OutChoice {
        kind,
        name,
        disable_parallel_tool_use: serial,
    }
}

/// The request's system messages joined (if any), and its other messages
/// as turns.
fn turns(request: &ChatRequest) -> (Option<String>, Vec<Turn<'_>>) {
    let system: Vec<String> = request
        .messages
        .iter()
        .filter(|m| m.role == Role::System)
        .map(Message::text)
        .collect();
    let mut turns: Vec<Turn> = Vec::new();
    for message in request.messages.iter().filter(|m| m.role != Role::System) {
        let (role, blocks) = blocks(message);
        match turns.last_mut() {
            Some(last) if last.role == role => last.content.extend(blocks),
            _ => turns.push(Turn {
                role,
                content: blocks,
            }),
        }
    }
    let system = (!system.is_empty()).then(|| system.join("\n\n"));
    (system, turns)
}

/// A message's role on the wire and its content blocks.
fn blocks(message: &Message) -> (&'static str, Vec<Block<'_>>) {
    if message.role == Role::Tool {
        let block = Block::ToolResult {
            tool_use_id: message.tool_call_id.as_deref().unwrap_or_default(),
            content: message.text(),
        };
        return ("user", vec![block]);
    }
    let mut blocks = Vec::new();
    match &message.content {
        None => {}
        Some(Content::Text(text)) if text.is_empty() => {}
        Some(Content::Text(text)) => blocks.push(Block::Text { text }),
        Some(Content::Parts(parts)) => blocks.extend(parts.iter().map(part)),
    }
    for call in &message.tool_calls {
        blocks.push(Block::ToolUse {
            id: &call.id,
            name: &call.name,
            input: object(&call.arguments),
        });
    }
    let role = if message.role == Role::Assistant {
        "assistant"
    } else {
        "user"
    };
    (role, blocks)
}

/// A call's arguments as the object Anthropic's `input` must be, borrowed
/// as they are; arguments that are not an object are the empty one.
fn object(arguments: &str) -> &RawValue {
    const EMPTY: &str = "{}";
    match serde_json::from_str::<&RawValue>(arguments) {
        Ok(input) if input.get().starts_with('{') => input,
        _ => serde_json::from_str(EMPTY).expect("`{}` is JSON"),
    }
}

/// A content part as a block: an image by data URL becomes a `base64`
/// source, any other URL a `url` source.
fn part(part: &ContentPart) -> Block<'_> {
    match part {
        ContentPart::Text { text } => Block::Text { text },
        ContentPart::Image { url, .. } => {
            let source = url
                .strip_prefix("data:")
                .and_then(|rest| rest.split_once(";base64,"))
                .map_or(Source::Url { url }, |(media_type, data)| Source::Base64 {
                    media_type,
                    data,
                });
            Block::Image { source }
        }
    }
}
