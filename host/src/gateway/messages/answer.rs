//! The Messages API's answer: a `message`, or its stream of events, and
//! its errors in Anthropic's shape. The events sent for every piece of
//! text are typed structs written straight to their text.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde_json::{Value, json};

use super::super::dialect::{Dialect, Frame};
use super::super::wire::{ApiError, open, spliced};
use crate::types::{ChatResponse, FinishReason, ToolCall, Usage};

/// A `content_block_delta` event, the one sent for every piece of text:
/// written straight to its text, no JSON tree built.
#[derive(Serialize)]
struct BlockDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    index: usize,
    delta: Delta<'a>,
}

#[derive(Serialize)]
#[serde(tag = "type")]
enum Delta<'a> {
    #[serde(rename = "text_delta")]
    Text { text: &'a str },
    #[serde(rename = "input_json_delta")]
    InputJson { partial_json: &'a str },
}

/// Anthropic's Messages as a [`Dialect`].
pub(super) struct Messages {
    id: String,
    model: String,
    /// Content blocks started so far in the stream.
    blocks: usize,
    /// Whether the stream's text block is open.
    text_open: bool,
}

impl Messages {
    pub(super) fn new(id: String, model: String) -> Self {
        Messages {
            id,
            model,
            blocks: 0,
            text_open: false,
        }
    }

    fn block_start(&mut self, block: Value) -> Frame {
        let index = self.blocks;
        self.blocks += 1;
        Frame::named(
            "content_block_start",
            &json!({ "type": "content_block_start", "index": index, "content_block": block }),
        )
    }

    fn delta(index: usize, delta: Delta<'_>) -> Frame {
        let event = BlockDelta {
            kind: "content_block_delta",
            index,
            delta,
        };
        Frame::named("content_block_delta", &event)
    }

    fn block_stop(index: usize) -> Frame {
        Frame::named(
            "content_block_stop",
            &json!({ "type": "content_block_stop", "index": index }),
        )
    }
}

impl Dialect for Messages {
    /// `{<head>,"content":[{"type":"text","text":` TEXT `},<tool_use>...]}`,
    /// the text escaped as it is sent.
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body {
        let head = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "stop_reason": stop_reason(response.finish_reason),
            "stop_sequence": null,
            "usage": usage(&response.usage),
        });
        let mut before = open(&head);
        before.extend_from_slice(br#","content":["#);
        let text = shown.unwrap_or_default();
        let calls = &response.message.tool_calls;
        let with_text = !text.is_empty() || calls.is_empty();
        let mut after = Vec::new();
        for (i, call) in calls.iter().enumerate() {
            if i > 0 || with_text {
                after.push(b',');
            }
            after.extend(tool_use(call).to_string().into_bytes());
        }
        after.extend_from_slice(b"]}");
        if !with_text {
            before.extend(after);
            return Body::from(before);
        }
        before.extend_from_slice(br#"{"type":"text","text":"#);
        after.insert(0, b'}');
        spliced(before, Some(text), after)
    }

    fn opening(&mut self) -> Vec<Frame> {
        let message = json!({
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": usage(&Usage::default()),
        });
        vec![Frame::named(
            "message_start",
            &json!({ "type": "message_start", "message": message }),
        )]
    }

    fn text(&mut self, piece: &str) -> Vec<Frame> {
        let mut events = Vec::new();
        if !self.text_open {
            self.text_open = true;
            events.push(self.block_start(json!({ "type": "text", "text": "" })));
        }
        events.push(Self::delta(self.blocks - 1, Delta::Text { text: piece }));
        events
    }

    fn end(&mut self, response: &ChatResponse) -> Vec<Frame> {
        let mut events = Vec::new();
        if std::mem::take(&mut self.text_open) {
            events.push(Self::block_stop(self.blocks - 1));
        }
        for call in &response.message.tool_calls {
            let mut block = tool_use(call);
            block["input"] = json!({});
            events.push(self.block_start(block));
            let index = self.blocks - 1;
            let delta = Delta::InputJson {
                partial_json: &call.arguments,
            };
            events.push(Self::delta(index, delta));
            events.push(Self::block_stop(index));
        }
        let delta = json!({
            "type": "message_delta",
            "delta": { "stop_reason": stop_reason(response.finish_reason), "stop_sequence": null },
            "usage": usage(&response.usage),
        });
        events.push(Frame::named("message_delta", &delta));
        events.push(Frame::named(
            "message_stop",
            &json!({ "type": "message_stop" }),
        ));
        events
    }

    fn broken(&mut self, error: &ApiError) -> Vec<Frame> {
        vec![Frame::named("error", &body(error))]
    }

    fn refuse(&self, error: ApiError) -> Response {
        refused(error)
    }
}

/// A tool call as a `tool_use` block; arguments that are not a JSON
/// object (a model's broken output) are kept as `{"arguments": text}`.
fn tool_use(call: &ToolCall) -> Value {
    let input = match serde_json::from_str::<Value>(&call.arguments) {
        Ok(input @ Value::Object(_)) => input,
        _ => json!({ "arguments": call.arguments }),
    };
    json!({ "type": "tool_use", "id": call.id, "name": call.name, "input": input })
}

fn stop_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::ToolUse => "tool_use",
        FinishReason::LengthLimit => "max_tokens",
        FinishReason::StopSequence => "stop_sequence",
        FinishReason::PauseTurn => "pause_turn",
        FinishReason::ContentFiltered | FinishReason::Refusal => "refusal",
        _ => "end_turn",
    }
}

fn usage(usage: &Usage) -> Value {
    json!({ "input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens })
}

/// An error as Anthropic's clients read it: `{"type": "error", "error":
/// {"type": ..., "message": ...}}`, its type by its status.
fn body(error: &ApiError) -> Value {
    let kind = match error.status {
        StatusCode::BAD_REQUEST => "invalid_request_error",
        StatusCode::UNAUTHORIZED => "authentication_error",
        StatusCode::FORBIDDEN => "permission_error",
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
        StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
        StatusCode::GATEWAY_TIMEOUT | StatusCode::REQUEST_TIMEOUT => "timeout_error",
        status if status.is_client_error() => "invalid_request_error",
        _ => "api_error",
    };
    json!({ "type": "error", "error": { "type": kind, "message": error.message } })
}

/// An error as Anthropic's API writes it, with `Retry-After` when a retry
/// may succeed: the errors of the `/v1/messages` route.
pub(in crate::gateway) fn refused(error: ApiError) -> Response {
    let mut response = (error.status, axum::Json(body(&error))).into_response();
    if error.retry {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}
