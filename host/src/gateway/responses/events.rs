//! The Responses API's answer: a `response` object, or its typed stream
//! events, each with its `sequence_number`. Where an object holds the
//! answer's text (the whole response, and a stream's closing events,
//! which repeat it as OpenAI's protocol has them), it is written around
//! the text, which is escaped a piece at a time as it is sent.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Body;
use serde::Serialize;
use serde_json::{Value, json};

use super::super::dialect::{Dialect, Frame};
use super::super::wire::{ApiError, now, open, spliced, unique_id};
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
    /// The stream's function calls, as output items, once it ended.
    calls: Vec<Value>,
    /// The stream's message item, once it opened: its id and its text.
    message: Option<(String, String)>,
    /// The same, once the text is whole, for the closing events.
    closed: Option<(String, Arc<str>)>,
    /// What is left of the stream's end.
    closing: VecDeque<Closing>,
}

/// A `response.output_text.delta` event, the one sent for every piece of
/// text: written straight to its text, no JSON tree built.
#[derive(Serialize)]
struct TextDelta<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    sequence_number: u64,
    item_id: &'a str,
    output_index: u32,
    content_index: u32,
    delta: &'a str,
    logprobs: [(); 0],
}

/// A step of a stream's end, made when the client takes it.
enum Closing {
    /// An event that does not hold the text (a call's).
    Event(&'static str, Value),
    TextDone,
    PartDone,
    ItemDone,
    Finished(FinishReason, Usage),
}

/// An output text part up to its text: `...,"text":` TEXT `}`.
const TEXT_PART: &[u8] = br#"{"type":"output_text","annotations":[],"logprobs":[],"text":"#;

impl Responses {
    pub(super) fn new(id: String, model: String, echoed: Value) -> Self {
        Responses {
            id,
            model,
            created_at: now(),
            echoed,
            sequence: 0,
            calls: Vec::new(),
            message: None,
            closed: None,
            closing: VecDeque::new(),
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

    /// The finished response, without its output: `completed`, or
    /// `incomplete` with the reason (a filter's block, the token limit).
    fn finished(&self, reason: FinishReason, usage: &Usage) -> Value {
        let incomplete = match reason {
            FinishReason::ContentFiltered | FinishReason::Refusal => Some("content_filter"),
            FinishReason::LengthLimit => Some("max_output_tokens"),
            _ => None,
        };
        let status = if incomplete.is_some() {
            "incomplete"
        } else {
            "completed"
        };
        let mut whole = self.response(status, &[], Some(usage));
        if let Some(fields) = whole.as_object_mut() {
            fields.remove("output");
        }
        if let Some(reason) = incomplete {
            whole["incomplete_details"] = json!({ "reason": reason });
        }
        whole
    }

    /// The next event's `sequence_number`.
    fn number(&mut self) -> u64 {
        self.sequence += 1;
        self.sequence - 1
    }

    /// `fields` as an event of `kind`, numbered.
    fn numbered(&mut self, kind: &str, mut fields: Value) -> Value {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.number());
        fields
    }

    /// An event of `kind`, numbered.
    fn event(&mut self, kind: &'static str, fields: Value) -> Frame {
        let data = self.numbered(kind, fields);
        Frame::named(kind, &data)
    }

    /// An event of `kind`, numbered, whose data is `fields` and then
    /// `before`, the text and `after`.
    fn around_text(
        &mut self,
        kind: &'static str,
        fields: Value,
        before: &[u8],
        after: &[u8],
    ) -> Frame {
        let data = self.numbered(kind, fields);
        let mut head = open(&data);
        head.extend_from_slice(before);
        let (_, text) = self.closed.as_ref().expect("a message to close");
        Frame::spliced(kind, head, text.clone(), after.to_vec())
    }
}

/// An output array holding the message `id` first, then `calls`: the JSON
/// text before its text and after it.
fn output_around_text(id: &str, calls: &[Value]) -> (Vec<u8>, Vec<u8>) {
    let item = json!({ "type": "message", "id": id, "status": "completed", "role": "assistant" });
    let mut before = b"[".to_vec();
    before.extend(open(&item));
    before.extend_from_slice(br#","content":["#);
    before.extend_from_slice(TEXT_PART);
    let mut after = b"}]}".to_vec();
    for call in calls {
        after.push(b',');
        after.extend(call.to_string().into_bytes());
    }
    after.push(b']');
    (before, after)
}

fn message_item(id: &str, status: &str) -> Value {
    json!({ "type": "message", "id": id, "status": status, "role": "assistant", "content": [] })
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
    fn unkept(&mut self) {
        self.echoed["store"] = Value::Bool(false);
    }

    /// `{<response>,"output":[<the message, its text escaped as it is
    /// sent>,<function calls>...]}`.
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body {
        let head = self.finished(response.finish_reason, &response.usage);
        let mut before = open(&head);
        before.extend_from_slice(br#","output":"#);
        let text = shown.unwrap_or_default();
        let calls: Vec<Value> = response
            .message
            .tool_calls
            .iter()
            .map(|call| call_item(call, &call.arguments, "completed"))
            .collect();
        if text.is_empty() && !calls.is_empty() {
            before.extend(serde_json::to_vec(&calls).expect("JSON serializes"));
            before.push(b'}');
            return Body::from(before);
        }
        let (output, mut after) = output_around_text(&unique_id("msg_"), &calls);
        before.extend(output);
        after.push(b'}');
        spliced(before, Some(text), after)
    }

    fn opening(&mut self) -> Vec<Frame> {
        let response = self.response("in_progress", &[], None);
        vec![
            self.event("response.created", json!({ "response": response })),
            self.event("response.in_progress", json!({ "response": response })),
        ]
    }

    fn text(&mut self, piece: &str) -> Vec<Frame> {
        let mut events = Vec::new();
        let item_id = match &mut self.message {
            Some((id, text)) => {
                text.push_str(piece);
                id.clone()
            }
            None => {
                let id = unique_id("msg_");
                let item = message_item(&id, "in_progress");
                let added = json!({ "output_index": 0, "item": item });
                events.push(self.event("response.output_item.added", added));
                let part = json!({ "item_id": id, "output_index": 0, "content_index": 0, "part": text_part("") });
                events.push(self.event("response.content_part.added", part));
                self.message = Some((id.clone(), piece.to_owned()));
                id
            }
        };
        let delta = TextDelta {
            kind: "response.output_text.delta",
            sequence_number: self.number(),
            item_id: &item_id,
            output_index: 0,
            content_index: 0,
            delta: piece,
            logprobs: [],
        };
        events.push(Frame::named(delta.kind, &delta));
        events
    }

    /// Nothing but an empty message's start when there is neither text nor
    /// a call: the message's closing events (which repeat its text), the
    /// calls' and the finished response come one at a time from `more`.
    fn end(&mut self, response: &ChatResponse) -> Vec<Frame> {
        let mut events = Vec::new();
        let calls = &response.message.tool_calls;
        // A stream with neither text nor calls still answers one (empty)
        // message, as the whole answer does.
        if self.message.is_none() && calls.is_empty() {
            events.extend(self.text(""));
        }
        if let Some((id, text)) = self.message.take() {
            self.closed = Some((id, Arc::from(text)));
            self.closing
                .extend([Closing::TextDone, Closing::PartDone, Closing::ItemDone]);
        }
        let first = usize::from(self.closed.is_some());
        for (n, call) in calls.iter().enumerate() {
            let index = first + n;
            let item = call_item(call, "", "in_progress");
            let id = item["id"].clone();
            let added = json!({ "output_index": index, "item": item });
            let delta = json!({ "item_id": id, "output_index": index, "delta": call.arguments });
            let done = json!({ "item_id": id, "output_index": index, "name": call.name, "arguments": call.arguments });
            let item = call_item(call, &call.arguments, "completed");
            let item_done = json!({ "output_index": index, "item": item });
            self.calls.push(item);
            self.closing.extend([
                Closing::Event("response.output_item.added", added),
                Closing::Event("response.function_call_arguments.delta", delta),
                Closing::Event("response.function_call_arguments.done", done),
                Closing::Event("response.output_item.done", item_done),
            ]);
        }
        self.closing
            .push_back(Closing::Finished(response.finish_reason, response.usage));
        events
    }

    fn more(&mut self) -> Option<Frame> {
        let step = self.closing.pop_front()?;
        let item_id = self.closed.as_ref().map(|(id, _)| id.clone());
        let at = json!({ "item_id": item_id, "output_index": 0, "content_index": 0 });
        Some(match step {
            Closing::Event(kind, fields) => self.event(kind, fields),
            Closing::TextDone => {
                let mut fields = at;
                fields["logprobs"] = json!([]);
                self.around_text("response.output_text.done", fields, br#","text":"#, b"}")
            }
            Closing::PartDone => {
                let mut before = br#","part":"#.to_vec();
                before.extend_from_slice(TEXT_PART);
                self.around_text("response.content_part.done", at, &before, b"}}")
            }
            Closing::ItemDone => {
                let item = json!({ "type": "message", "id": item_id, "status": "completed", "role": "assistant" });
                let mut before = br#","item":"#.to_vec();
                before.extend(open(&item));
                before.extend_from_slice(br#","content":["#);
                before.extend_from_slice(TEXT_PART);
                let fields = json!({ "output_index": 0 });
                self.around_text("response.output_item.done", fields, &before, b"}]}}")
            }
            Closing::Finished(reason, usage) => {
                let head = self.finished(reason, &usage);
                let kind = if head["status"] == "incomplete" {
                    "response.incomplete"
                } else {
                    "response.completed"
                };
                match &self.closed {
                    None => {
                        let mut whole = head;
                        whole["output"] = json!(self.calls);
                        self.event(kind, json!({ "response": whole }))
                    }
                    Some((id, _)) => {
                        let (output, mut after) = output_around_text(id, &self.calls);
                        let mut before = br#","response":"#.to_vec();
                        before.extend(open(&head));
                        before.extend_from_slice(br#","output":"#);
                        before.extend(output);
                        after.extend_from_slice(b"}}");
                        self.around_text(kind, json!({}), &before, &after)
                    }
                }
            }
        })
    }

    fn broken(&mut self, error: &ApiError) -> Vec<Frame> {
        let mut response = self.response("failed", &self.calls, None);
        let code = error.code.as_deref().unwrap_or(error.kind.as_str());
        response["error"] = json!({ "code": code, "message": error.message });
        vec![self.event("response.failed", json!({ "response": response }))]
    }
}
