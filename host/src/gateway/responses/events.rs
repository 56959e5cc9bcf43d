//! The Responses API's answer: a `response` object, or its typed stream
//! events, each with its `sequence_number`.

use axum::body::Body;
use axum::response::sse::Event;
use serde_json::{Value, json};

use super::super::dialect::{Dialect, named};
use super::super::wire::{ApiError, now, unique_id};
use crate::types::{ChatResponse, FinishReason, ToolCall, Usage};

/// OpenAI's Responses as a [`Dialect`].
pub(super) struct Responses {
    id: String,
    model: String,
    created_at: u64,
    /// The request's own fields a response repeats (`instructions`,
    /// `tools`, `store`, ...).
    echoed: Value,
    /// Events sent so far.
    sequence: u64,
    /// The output items finished so far in the stream.
    output: Vec<Value>,
    /// The stream's message item while it is open: its id and its text.
    message: Option<(String, String)>,
}

impl Responses {
    pub(super) fn new(id: String, model: String, echoed: Value) -> Self {
        Responses {
            id,
            model,
            created_at: now(),
            echoed,
            sequence: 0,
            output: Vec::new(),
            message: None,
        }
    }

    /// The response object, as it stands.
    fn response(&self, status: &str, output: &[Value], usage: Option<&Usage>) -> Value {
        let mut response = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage.map(wire_usage),
            "error": null,
            "incomplete_details": null,
            "text": { "format": { "type": "text" } },
            "truncation": "disabled",
        });
        if let (Some(fields), Some(echoed)) = (response.as_object_mut(), self.echoed.as_object()) {
            fields.extend(echoed.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        response
    }

    /// The finished response: `completed`, or `incomplete` with the reason
    /// (a filter's block, the token limit).
    fn finished(&self, response: &ChatResponse, output: &[Value]) -> Value {
        let incomplete = match response.finish_reason {
            FinishReason::ContentFiltered | FinishReason::Refusal => Some("content_filter"),
            FinishReason::LengthLimit => Some("max_output_tokens"),
            _ => None,
        };
        let status = if incomplete.is_some() {
            "incomplete"
        } else {
            "completed"
        };
        let mut whole = self.response(status, output, Some(&response.usage));
        if let Some(reason) = incomplete {
            whole["incomplete_details"] = json!({ "reason": reason });
        }
        whole
    }

    /// An event of `kind`, numbered.
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        named(kind, &data)
    }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    let content = if status == "completed" {
        json!([text_part(text)])
    } else {
        json!([])
    };
    json!({ "type": "message", "id": id, "status": status, "role": "assistant", "content": content })
}

fn text_part(text: &str) -> Value {
    json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] })
}

fn call_item(call: &ToolCall, arguments: &str, status: &str) -> Value {
    json!({
        "type": "function_call",
        "id": format!("fc_{}", call.id),
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    })
}

fn wire_usage(usage: &Usage) -> Value {
    json!({
        "input_tokens": usage.input_tokens,
        "input_tokens_details": { "cached_tokens": 0 },
        "output_tokens": usage.output_tokens,
        "output_tokens_details": { "reasoning_tokens": 0 },
        "total_tokens": usage.total_tokens,
    })
}

impl Dialect for Responses {
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body {
        let mut output = Vec::new();
        let text = shown.unwrap_or_default();
        if !text.is_empty() || response.message.tool_calls.is_empty() {
            output.push(message_item(&unique_id("msg_"), &text, "completed"));
        }
        let calls = &response.message.tool_calls;
        output.extend(
            calls
                .iter()
                .map(|c| call_item(c, &c.arguments, "completed")),
        );
        Body::from(self.finished(&response, &output).to_string())
    }

    fn opening(&mut self) -> Vec<Event> {
        let response = self.response("in_progress", &[], None);
        vec![
            self.event("response.created", json!({ "response": response })),
            self.event("response.in_progress", json!({ "response": response })),
        ]
    }

    fn text(&mut self, piece: &str) -> Vec<Event> {
        let mut events = Vec::new();
        let index = self.output.len();
        let item_id = match &mut self.message {
            Some((id, text)) => {
                text.push_str(piece);
                id.clone()
            }
            None => {
                let id = unique_id("msg_");
                let item = message_item(&id, "", "in_progress");
                events.push(self.event(
                    "response.output_item.added",
                    json!({ "output_index": index, "item": item }),
                ));
                let part = json!({ "item_id": id, "output_index": index, "content_index": 0, "part": text_part("") });
                events.push(self.event("response.content_part.added", part));
                self.message = Some((id.clone(), piece.to_owned()));
                id
            }
        };
        let delta = json!({ "item_id": item_id, "output_index": index, "content_index": 0, "delta": piece, "logprobs": [] });
        events.push(self.event("response.output_text.delta", delta));
        events
    }

    fn end(&mut self, response: &ChatResponse) -> Vec<Event> {
        let mut events = Vec::new();
        let calls = &response.message.tool_calls;
        // A stream with neither text nor calls still answers one (empty)
        // message, as the whole answer does.
        if self.message.is_none() && calls.is_empty() {
            events.extend(self.text(""));
        }
        if let Some((id, text)) = self.message.take() {
            let index = self.output.len();
            let at = json!({ "item_id": id, "output_index": index, "content_index": 0 });
            let mut done = at.clone();
            done["text"] = json!(text);
            done["logprobs"] = json!([]);
            events.push(self.event("response.output_text.done", done));
            let mut part = at;
            part["part"] = text_part(&text);
            events.push(self.event("response.content_part.done", part));
            let item = message_item(&id, &text, "completed");
            events.push(self.event(
                "response.output_item.done",
                json!({ "output_index": index, "item": item }),
            ));
            self.output.push(item);
        }
        for call in calls {
            let index = self.output.len();
            let item = call_item(call, "", "in_progress");
            let id = item["id"].clone();
            events.push(self.event(
                "response.output_item.added",
                json!({ "output_index": index, "item": item }),
            ));
            let delta = json!({ "item_id": id, "output_index": index, "delta": call.arguments });
            events.push(self.event("response.function_call_arguments.delta", delta));
            let done = json!({ "item_id": id, "output_index": index, "name": call.name, "arguments": call.arguments });
            events.push(self.event("response.function_call_arguments.done", done));
            let item = call_item(call, &call.arguments, "completed");
            events.push(self.event(
                "response.output_item.done",
                json!({ "output_index": index, "item": item }),
            ));
            self.output.push(item);
        }
        let whole = self.finished(response, &self.output);
        let kind = if whole["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        events.push(self.event(kind, json!({ "response": whole })));
        events
    }

    fn broken(&mut self, error: &ApiError) -> Vec<Event> {
        let mut response = self.response("failed", &self.output, None);
        let code = error.code.as_deref().unwrap_or(error.kind.as_str());
        response["error"] = json!({ "code": code, "message": error.message });
        vec![self.event("response.failed", json!({ "response": response }))]
    }
}
