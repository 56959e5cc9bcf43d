//! The chat-completions wire format, both ways: how our messages and tools
//! go out and how a server's answers and stream chunks come back (the
//! client), and how a client's messages and tools come in and our answers
//! go out (the gateway).

use serde::Deserialize;
use serde_json::{Value, json};

pub(crate) use super::read::{Arguments, InMessage, InTool, TextOr, function_tool};
pub(crate) use super::written::{WireMessage, WireTool, wire_message, wire_tool};
use crate::types::{ChatResponse, Content, FinishReason, Message, Role, ToolCall, Usage};

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
        let message = |wire: Value| {
            serde_json::from_value::<InMessage>(wire)
                .map_err(|e| e.to_string())
                .and_then(InMessage::into_message)
        };
        let asked = json!({ "role": "assistant", "content": [{ "type": "refusal", "refusal": "no" }],
            "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "add", "arguments": { "a": 1 } } }] });
        let asked = message(asked).unwrap();
        assert_eq!(asked.text(), "no", "a refusal part is text");
        assert_eq!(
            asked.tool_calls[0].arguments, r#"{"a":1}"#,
            "object arguments as JSON text"
        );
        let bad = json!({ "role": "assistant", "tool_calls": [{ "id": "c1", "function": { "name": "add", "arguments": 7 } }] });
        assert!(message(bad).unwrap_err().contains("JSON string"));
        assert!(
            message(json!({ "role": "tool", "content": "2" }))
                .unwrap_err()
                .contains("tool_call_id")
        );
        assert!(
            message(json!({ "content": "hi" }))
                .unwrap_err()
                .contains("role")
        );
        let part = json!({ "role": "user", "content": [{ "type": "input_audio" }] });
        assert!(
            message(part).unwrap_err().contains("input_audio"),
            "a part's own error, not \"matched neither\""
        );
        let tool = |wire: Value| {
            serde_json::from_value::<InTool>(wire)
                .map_err(|e| e.to_string())
                .and_then(InTool::into_tool)
        };
        let add = tool(json!({ "type": "function", "function": { "name": "add" } })).unwrap();
        assert_eq!(
            add.parameters["type"], "object",
            "no parameters: an empty object schema"
        );
        assert!(tool(json!({ "type": "code_interpreter" })).is_err());
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
