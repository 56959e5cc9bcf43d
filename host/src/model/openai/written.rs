//! Our messages and tools as chat completions write them: typed structs
//! borrowed from ours, serialized once into a request's (or an answer's)
//! body, with no JSON tree built between.

use serde::Serialize;
use serde_json::Value;

use crate::types::{Content, ContentPart, Message, Role, ToolSpec};

/// A message as chat completions write it, borrowed from ours.
#[derive(Serialize)]
pub(crate) struct WireMessage<'a> {
    role: &'static str,
    content: Option<WireContent<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<OutCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum WireContent<'a> {
    Text(&'a str),
    Parts(Vec<WirePart<'a>>),
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WirePart<'a> {
    Text { text: &'a str },
    ImageUrl { image_url: WireImage<'a> },
}

#[derive(Serialize)]
struct WireImage<'a> {
    url: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<&'a str>,
}

#[derive(Serialize)]
struct OutCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: OutFunction<'a>,
}

#[derive(Serialize)]
struct OutFunction<'a> {
    name: &'a str,
    arguments: &'a str,
}

/// A message in the wire format.
pub(crate) fn wire_message(m: &Message) -> WireMessage<'_> {
    let role = match m.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let content = m.content.as_ref().map(|content| match content {
        Content::Text(text) => WireContent::Text(text),
        Content::Parts(parts) => WireContent::Parts(
            parts
                .iter()
                .map(|part| match part {
                    ContentPart::Text { text } => WirePart::Text { text },
                    ContentPart::Image { url, detail } => WirePart::ImageUrl {
                        image_url: WireImage {
                            url,
                            detail: detail.as_deref(),
                        },
                    },
                })
                .collect(),
        ),
    });
    let tool_calls = m
        .tool_calls
        .iter()
        .map(|call| OutCall {
            id: &call.id,
            kind: "function",
            function: OutFunction {
                name: &call.name,
                arguments: &call.arguments,
            },
        })
        .collect();
    WireMessage {
        role,
        content,
        tool_calls,
        tool_call_id: m.tool_call_id.as_deref(),
    }
}

/// A tool as chat completions write it, borrowed from ours.
#[derive(Serialize)]
pub(crate) struct WireTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireSpec<'a>,
}

#[derive(Serialize)]
struct WireSpec<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    strict: bool,
}

/// A tool in the wire format.
pub(crate) fn wire_tool(t: &ToolSpec) -> WireTool<'_> {
    WireTool {
        kind: "function",
        function: WireSpec {
            name: &t.name,
            description: &t.description,
            parameters: &t.parameters,
            strict: t.strict,
        },
    }
}
