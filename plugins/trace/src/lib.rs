//! `trace`: one JSON line per turn, model call and tool call, with its
//! timing, sizes, finish reason and error, written to the operator's trace
//! sink (a file or stderr the operator chose with `grants = { trace =
//! "path/or/stderr" }`, never one the filter names). It never changes
//! anything; a sink that is not granted or fails costs a warning, not the
//! call.
//!
//! Timings need real clocks (`grants.clock = true`); without them `ms` is
//! 0. Every line also carries `ts` (the host's time) and `filter`, and the
//! shared context's `conversation_id`, `tenant`, `key` and `user` (the
//! keys the gateway sets) when set.
//!
//! Config: `{"turns": true, "chats": true, "tools": true}` (all optional).

use std::time::Instant;

use serde::Deserialize;
use serde_json::{Map, Value, json};
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Message, Next, ToolRequest, ToolResponse,
    TurnRequest, TurnResult, context, log, trace,
};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Trace {
    #[serde(default = "yes")]
    turns: bool,
    #[serde(default = "yes")]
    chats: bool,
    #[serde(default = "yes")]
    tools: bool,
}

fn yes() -> bool {
    true
}

/// Characters of text in `messages`.
fn chars(messages: &[Message]) -> usize {
    messages.iter().map(|m| m.text().chars().count()).sum()
}

fn error(error: &FilterError) -> Value {
    json!({ "kind": error.kind.as_str(), "message": error.message })
}

/// Writes `event` with the invoke's correlation keys and the time since
/// `started`; a sink that refuses it is logged, never the call's failure.
fn emit(mut event: Map<String, Value>, started: Instant) {
    event.insert("ms".into(), json!(started.elapsed().as_secs_f64() * 1000.0));
    for key in ["conversation_id", "tenant", "key", "user"] {
        if let Some(value) = context::get::<Value>(key) {
            event.insert(key.into(), value);
        }
    }
    if let Err(e) = trace::write(&Value::Object(event)) {
        log::warn(&format!("trace event dropped: {}", e.message));
    }
}

fn object(value: Value) -> Map<String, Value> {
    match value {
        Value::Object(map) => map,
        _ => Map::new(),
    }
}

#[shallot_guest::filter(name = "trace")]
impl Filter for Trace {
    fn wants(&self, hook: shallot_guest::Hook) -> bool {
        match hook {
            shallot_guest::Hook::AroundTurn => self.turns,
            shallot_guest::Hook::AroundChat => self.chats,
            shallot_guest::Hook::AroundTool => self.tools,
            _ => false,
        }
    }

    fn around_chat(&self, request: &ChatRequest, next: Next) -> Result<ChatResponse, FilterError> {
        let messages = request.messages();
        let mut event = object(json!({
            "event": "chat",
            "messages": messages.len(),
            "input_chars": chars(&messages),
            "tools_offered": request.tools().len(),
        }));
        let started = Instant::now();
        let result = next.chat(request);
        match &result {
            Ok(response) => {
                let usage = response.usage();
                let out = response.message();
                event.extend(object(json!({
                    "model": response.model(),
                    "finish_reason": response.finish_reason().as_str(),
                    "output_chars": out.text().chars().count(),
                    "tool_calls": out.tool_calls.len(),
                    "usage": {
                        "input_tokens": usage.input_tokens,
                        "output_tokens": usage.output_tokens,
                        "total_tokens": usage.total_tokens,
                    },
                })));
            }
            Err(e) => {
                event.insert("error".into(), error(e));
            }
        }
        emit(event, started);
        result
    }

    fn around_tool(&self, request: &ToolRequest, next: Next) -> Result<ToolResponse, FilterError> {
        let mut event = object(json!({
            "event": "tool",
            "tool": request.name(),
            "call_id": request.call_id(),
            "arguments_bytes": request.arguments().len(),
        }));
        let started = Instant::now();
        let result = next.tool(request);
        match &result {
            Ok(response) => {
                event.insert("output_bytes".into(), json!(response.output().len()));
            }
            Err(e) => {
                event.insert("error".into(), error(e));
            }
        }
        emit(event, started);
        result
    }

    fn around_turn(&self, request: &TurnRequest, next: Next) -> TurnResult {
        let messages = request.messages();
        let mut event = object(json!({
            "event": "turn",
            "new_messages": messages.len(),
            "input_chars": chars(&messages),
            "resume": request.resume(),
        }));
        let started = Instant::now();
        let result = next.turn(request);
        match &result {
            TurnResult::Done(done) => {
                let response = done.response();
                let calls = done.tool_calls();
                event.extend(object(json!({
                    "outcome": "done",
                    "iterations": done.iterations(),
                    "tool_calls": calls.len(),
                    "failed_tool_calls": calls.iter().filter(|c| c.error.is_some()).count(),
                    "finish_reason": response.finish_reason().as_str(),
                    "output_chars": response.text().chars().count(),
                })));
            }
            TurnResult::Interrupt(interrupt) => {
                event.insert("outcome".into(), json!("interrupt"));
                event.insert("reason".into(), json!(interrupt.reason()));
            }
            TurnResult::Error(e) => {
                event.insert("outcome".into(), json!("error"));
                event.insert("error".into(), error(e));
            }
        }
        emit(event, started);
        result
    }
}
