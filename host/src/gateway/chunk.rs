//! A chat-completions stream's chunks, as typed structs serialized
//! straight to their event's text: no JSON tree is built for a chunk, and
//! a piece of text is escaped once, as it is written.

use serde::Serialize;
use serde_json::Value;

use super::wire::Head;
use crate::model::wire::wire_usage;
use crate::types::{ToolCall, Usage};

/// One `chat.completion.chunk`.
#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    /// One choice, or none in the last chunk of a stream that asked for
    /// usage.
    choices: &'a [Choice<'a>],
    /// Once a stream, in its last chunk: a tree is no cost there.
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Value>,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
}

/// What a chunk adds to the message: its role (the first chunk), a piece
/// of its text, or its tool calls.
#[derive(Serialize, Default)]
pub(super) struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<Vec<CallDelta<'a>>>,
}

#[derive(Serialize)]
struct CallDelta<'a> {
    index: usize,
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

#[derive(Serialize)]
struct Function<'a> {
    name: &'a str,
    arguments: &'a str,
}

impl<'a> Delta<'a> {
    /// The first chunk's: the assistant speaks, with no text yet.
    pub fn opening() -> Self {
        Delta {
            role: Some("assistant"),
            content: Some(""),
            ..Delta::default()
        }
    }

    /// A piece of the text.
    pub fn text(piece: &'a str) -> Self {
        Delta {
            content: Some(piece),
            ..Delta::default()
        }
    }

    /// The answer's tool calls, all in one chunk.
    pub fn tool_calls(calls: &'a [ToolCall]) -> Self {
        let calls = calls
            .iter()
            .enumerate()
            .map(|(index, call)| CallDelta {
                index,
                id: &call.id,
                kind: "function",
                function: Function {
                    name: &call.name,
                    arguments: &call.arguments,
                },
            })
            .collect();
        Delta {
            tool_calls: Some(calls),
            ..Delta::default()
        }
    }
}

impl Head {
    /// A stream chunk's text, with `delta` and `finish_reason`.
    pub(super) fn chunk(&self, delta: Delta<'_>, finish_reason: Option<&'static str>) -> String {
        let choices = [Choice {
            index: 0,
            delta,
            logprobs: None,
            finish_reason,
        }];
        self.chunk_text(&choices, None)
    }

    /// The last chunk's text, of a stream that asked for usage: no choices.
    pub(super) fn usage(&self, usage: &Usage) -> String {
        self.chunk_text(&[], Some(wire_usage(usage)))
    }

    fn chunk_text(&self, choices: &[Choice<'_>], usage: Option<Value>) -> String {
        let chunk = Chunk {
            id: &self.id,
            object: "chat.completion.chunk",
            created: self.created,
            model: &self.model,
            choices,
            usage,
        };
        serde_json::to_string(&chunk).expect("a chunk serializes")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn parsed(text: &str) -> Value {
        serde_json::from_str(text).expect("a chunk is JSON")
    }

    #[test]
    fn chunks_say_what_openais_clients_read() {
        let head = Head::new("m");
        let common = json!({ "id": head.id, "object": "chat.completion.chunk", "created": head.created, "model": "m" });
        let with = |choices: Value, usage: Option<Value>| {
            let mut chunk = common.clone();
            chunk["choices"] = choices;
            if let Some(usage) = usage {
                chunk["usage"] = usage;
            }
            chunk
        };
        let choice = |delta: Value, finish: Value| json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }]);
        assert_eq!(
            parsed(&head.chunk(Delta::opening(), None)),
            with(
                choice(json!({ "role": "assistant", "content": "" }), Value::Null),
                None
            )
        );
        assert_eq!(
            parsed(&head.chunk(Delta::text("a \"quoted\"\n\u{1}"), None)),
            with(
                choice(json!({ "content": "a \"quoted\"\n\u{1}" }), Value::Null),
                None
            )
        );
        let calls = [ToolCall {
            id: "c1".into(),
            name: "add".into(),
            arguments: r#"{"a":1}"#.into(),
        }];
        let call = json!({ "index": 0, "id": "c1", "type": "function", "function": { "name": "add", "arguments": r#"{"a":1}"# } });
        assert_eq!(
            parsed(&head.chunk(Delta::tool_calls(&calls), None)),
            with(choice(json!({ "tool_calls": [call] }), Value::Null), None)
        );
        assert_eq!(
            parsed(&head.chunk(Delta::default(), Some("stop"))),
            with(choice(json!({}), json!("stop")), None)
        );
        let usage = Usage {
            input_tokens: 3,
            output_tokens: 4,
            total_tokens: 7,
        };
        let wire = json!({ "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7 });
        assert_eq!(parsed(&head.usage(&usage)), with(json!([]), Some(wire)));
    }
}
