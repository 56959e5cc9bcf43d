//! The chat-completions wire format, both ways: how our messages and tools
//! go out and how a server's answers and stream chunks come back (the
//! client), and how a client's messages and tools come in and our answers
//! go out (the gateway).

use serde::Deserialize;
use serde_json::{Value, json};

pub(crate) use super::written::{WireMessage, WireTool, wire_message, wire_tool};
use crate::types::{
    ChatResponse, Content, ContentPart, FinishReason, Message, Role, ToolCall, ToolSpec, Usage,
};

/// A client's message, in our terms.
pub(crate) fn message_from_wire(wire: &Value) -> Result<Message, String> {
    let role = match wire["role"].as_str() {
        Some("system" | "developer") => Role::System,
        Some("user") => Role::User,
        Some("assistant") => Role::Assistant,
        Some("tool") => Role::Tool,
        Some(other) => return Err(format!("unknown role '{other}'")),
        None => return Err("a message has no `role`".to_owned()),
    };
    let content = match &wire["content"] {
        Value::Null => None,
        Value::String(text) => Some(Content::Text(text.clone())),
        Value::Array(parts) => Some(Content::Parts(
            parts.iter().map(part_from_wire).collect::<Result<_, _>>()?,
        )),
        _ => return Err("`content` must be a string, an array of parts or null".to_owned()),
    };
    let tool_calls = match &wire["tool_calls"] {
        Value::Null => Vec::new(),
        Value::Array(calls) => calls
            .iter()
            .map(|call| {
                let text = |v: &Value, what: &str| {
                    v.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| format!("a tool call has no `{what}`"))
                };
                let arguments = match &call["function"]["arguments"] {
                    Value::String(text) => text.clone(),
                    Value::Null => "{}".to_owned(),
                    Value::Object(_) => call["function"]["arguments"].to_string(),
                    _ => {
                        return Err(
                            "a tool call's `function.arguments` must be a string".to_owned()
                        );
                    }
                };
                Ok(ToolCall {
                    id: text(&call["id"], "id")?,
                    name: text(&call["function"]["name"], "function.name")?,
                    arguments,
                })
            })
            .collect::<Result<_, String>>()?,
        _ => return Err("`tool_calls` must be an array".to_owned()),
    };
    let tool_call_id = wire["tool_call_id"].as_str().map(str::to_owned);
    if role == Role::Tool && tool_call_id.is_none() {
        return Err("a tool message has no `tool_call_id`".to_owned());
    }
    Ok(Message {
        role,
        content,
        tool_calls,
        tool_call_id,
    })
}

fn part_from_wire(part: &Value) -> Result<ContentPart, String> {
    match part["type"].as_str() {
        Some("text") => Ok(ContentPart::Text {
            text: part["text"].as_str().unwrap_or_default().to_owned(),
        }),
        // An assistant's earlier refusal, sent back as history.
        Some("refusal") => Ok(ContentPart::Text {
            text: part["refusal"].as_str().unwrap_or_default().to_owned(),
        }),
        Some("image_url") => Ok(ContentPart::Image {
            url: part["image_url"]["url"]
                .as_str()
                .ok_or("an image part has no `image_url.url`")?
                .to_owned(),
            detail: part["image_url"]["detail"].as_str().map(str::to_owned),
        }),
        Some(other) => Err(format!("unsupported content part type '{other}'")),
        None => Err("a content part has no `type`".to_owned()),
    }
}

/// A client's tool, in our terms.
pub(crate) fn tool_from_wire(wire: &Value) -> Result<ToolSpec, String> {
    if wire["type"] != "function" {
        return Err("only `function` tools are supported".to_owned());
    }
    let function = &wire["function"];
    let name = function["name"]
        .as_str()
        .ok_or("a tool has no `function.name`")?;
    let parameters = match &function["parameters"] {
        Value::Null => json!({ "type": "object", "properties": {} }),
        schema => schema.clone(),
    };
    let description = function["description"].as_str().unwrap_or_default();
    let strict = match &function["strict"] {
        Value::Null => false,
        Value::Bool(strict) => *strict,
        _ => {
            return Err(format!(
                "tool '{name}': `function.strict` must be a boolean"
            ));
        }
    };
    Ok(ToolSpec {
        strict,
        ..ToolSpec::new(name, description, parameters)
    })
}

/// Our finish reason, as the wire says it.
pub(crate) fn wire_finish(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::ToolUse => "tool_calls",
        FinishReason::LengthLimit => "length",
        FinishReason::ContentFiltered | FinishReason::Refusal => "content_filter",
        _ => "stop",
    }
}

/// Token accounting as the wire says it.
pub(crate) fn wire_usage(usage: &Usage) -> Value {
    json!({
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    })
}

/// The finish reason a provider reported, in our terms.
pub(super) fn finish(reason: Option<&str>, calls: bool) -> FinishReason {
    match reason {
        Some("stop") => FinishReason::Complete,
        Some("tool_calls" | "function_call") => FinishReason::ToolUse,
        Some("length") => FinishReason::LengthLimit,
        Some("content_filter") => FinishReason::ContentFiltered,
        _ if calls => FinishReason::ToolUse,
        _ => FinishReason::Unknown,
    }
}

/// `reason`, or a refusal if the model refused and did not say otherwise.
pub(super) fn refused(reason: FinishReason, refused: bool) -> FinishReason {
    match reason {
        FinishReason::Complete | FinishReason::Unknown if refused => FinishReason::Refusal,
        reason => reason,
    }
}

#[derive(Deserialize, Default)]
pub(super) struct WireUsage {
    #[serde(default, deserialize_with = "nullable")]
    pub(super) prompt_tokens: u32,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) completion_tokens: u32,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) total_tokens: u32,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage {
            input_tokens: u.prompt_tokens,
            output_tokens: u.completion_tokens,
            total_tokens: u.total_tokens,
        }
    }
}

#[derive(Deserialize)]
pub(super) struct Completion {
    #[serde(default, deserialize_with = "nullable")]
    pub(super) model: String,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) choices: Vec<Choice>,
    pub(super) usage: Option<WireUsage>,
    /// An error some servers send with a `200` instead of an answer.
    pub(super) error: Option<Value>,
}

#[derive(Deserialize)]
pub(super) struct Choice {
    pub(super) message: WireAnswer,
    pub(super) finish_reason: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct WireAnswer {
    pub(super) content: Option<String>,
    /// The model's refusal, in place of content.
    pub(super) refusal: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) tool_calls: Vec<WireCall>,
}

#[derive(Deserialize)]
pub(super) struct WireCall {
    pub(super) id: String,
    pub(super) function: WireFunction,
}

#[derive(Deserialize)]
pub(super) struct WireFunction {
    pub(super) name: String,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) arguments: String,
}

#[derive(Deserialize)]
pub(super) struct Chunk {
    #[serde(default, deserialize_with = "nullable")]
    pub(super) model: String,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) choices: Vec<ChunkChoice>,
    pub(super) usage: Option<WireUsage>,
    /// An error the server reports in the stream instead of a chunk.
    pub(super) error: Option<Value>,
}

#[derive(Deserialize)]
pub(super) struct ChunkChoice {
    /// Which of `n` answers (only the first is read).
    #[serde(default, deserialize_with = "nullable")]
    pub(super) index: usize,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) delta: Delta,
    pub(super) finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
pub(super) struct Delta {
    pub(super) content: Option<String>,
    pub(super) refusal: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub(super) tool_calls: Vec<DeltaCall>,
}

#[derive(Deserialize)]
pub(super) struct DeltaCall {
    /// Which call the piece belongs to; some servers leave it out.
    pub(super) index: Option<usize>,
    pub(super) id: Option<String>,
    pub(super) function: Option<DeltaFunction>,
}

#[derive(Deserialize)]
pub(super) struct DeltaFunction {
    pub(super) name: Option<String>,
    pub(super) arguments: Option<String>,
}

/// A field a server may send as `null` where it means "none": its
/// default, as if it were absent (servers built on the OpenAI SDK's models
/// write `"tool_calls": null`).
fn nullable<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Default + Deserialize<'de>,
{
    Option::<T>::deserialize(deserializer).map(Option::unwrap_or_default)
}

pub(crate) fn answer(
    text: Option<String>,
    calls: Vec<ToolCall>,
    reason: FinishReason,
    usage: Usage,
    model: String,
) -> ChatResponse {
    let content = text.filter(|t| !t.is_empty()).map(Content::Text);
    // A call the server sent without arguments (some do, for a tool that
    // takes none) has the empty object: whoever runs or relays it parses
    // them as JSON.
    let calls = calls
        .into_iter()
        .map(|call| match call.arguments.trim() {
            "" => ToolCall {
                arguments: "{}".to_owned(),
                ..call
            },
            _ => call,
        })
        .collect();
    let message = Message {
        role: Role::Assistant,
        content,
        tool_calls: calls,
        tool_call_id: None,
    };
    let mut response = ChatResponse::new(message, reason);
    response.usage = usage;
    response.model = model;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_map_to_ours() {
        assert_eq!(finish(Some("stop"), false), FinishReason::Complete);
        assert_eq!(finish(Some("tool_calls"), true), FinishReason::ToolUse);
        assert_eq!(finish(Some("length"), false), FinishReason::LengthLimit);
        assert_eq!(
            finish(Some("content_filter"), false),
            FinishReason::ContentFiltered
        );
        assert_eq!(finish(None, true), FinishReason::ToolUse);
        assert_eq!(finish(Some("weird"), false), FinishReason::Unknown);
    }

    #[test]
    fn a_clients_messages_and_tools_come_in_in_our_terms() {
        let asked = json!({ "role": "assistant", "content": [{ "type": "refusal", "refusal": "no" }],
            "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "add", "arguments": { "a": 1 } } }] });
        let message = message_from_wire(&asked).unwrap();
        assert_eq!(message.text(), "no", "a refusal part is text");
        assert_eq!(
            message.tool_calls[0].arguments, r#"{"a":1}"#,
            "object arguments as JSON text"
        );
        let bad = json!({ "role": "assistant", "tool_calls": [{ "id": "c1", "function": { "name": "add", "arguments": 7 } }] });
        assert!(
            message_from_wire(&bad)
                .unwrap_err()
                .contains("must be a string")
        );
        assert!(
            message_from_wire(&json!({ "role": "tool", "content": "2" }))
                .unwrap_err()
                .contains("tool_call_id")
        );
        assert!(
            message_from_wire(&json!({ "content": "hi" }))
                .unwrap_err()
                .contains("role")
        );
        let tool =
            tool_from_wire(&json!({ "type": "function", "function": { "name": "add" } })).unwrap();
        assert_eq!(
            tool.parameters["type"], "object",
            "no parameters: an empty object schema"
        );
        assert!(tool_from_wire(&json!({ "type": "code_interpreter" })).is_err());
        assert_eq!(wire_finish(FinishReason::ContentFiltered), "content_filter");
        assert_eq!(wire_finish(FinishReason::ToolUse), "tool_calls");
    }

    #[test]
    fn messages_go_out_in_the_wire_format() {
        let call = ToolCall {
            id: "c1".into(),
            name: "add".into(),
            arguments: r#"{"a":1}"#.into(),
        };
        let asked = Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![call],
            tool_call_id: None,
        };
        let wire = |m| serde_json::to_value(wire_message(m)).unwrap();
        assert_eq!(
            wire(&asked),
            json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "add", "arguments": "{\"a\":1}" } }] })
        );
        assert_eq!(
            wire(&Message::tool_result("c1", "2")),
            json!({ "role": "tool", "content": "2", "tool_call_id": "c1" })
        );
    }
}
