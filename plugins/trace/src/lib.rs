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
//! With `arguments` and `results` a tool line also carries the call's
//! arguments and its result (off by default: a trace records sizes), with
//! the fields named in `redact` (at any depth, by name) and every match of
//! `redact_patterns` (in any string) replaced by `[redacted]`; one longer
//! than 16 KiB as JSON is cut there (`arguments_truncated`,
//! `output_truncated`), so the line still fits the sink.
//!
//! A turn that was cancelled (its deadline passed, or the client went
//! away) ends with `"outcome": "cancelled"` and the host's `reason`.
//!
//! Config: `{"turns": true, "chats": true, "tools": true, "arguments":
//! false, "results": false, "redact": [], "redact_patterns": []}` (all
//! optional).

use std::time::Instant;

use regex_lite::Regex;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use shallot_guest::{
    ChatRequest, ChatResponse, Filter, FilterError, Message, Next, ToolKind, ToolRequest,
    ToolResponse, TurnRequest, TurnResult, context, log, trace,
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
    #[serde(default)]
    arguments: bool,
    #[serde(default)]
    results: bool,
    /// Field names whose values are redacted, compared without case.
    #[serde(default)]
    redact: Vec<String>,
    #[serde(default)]
    redact_patterns: Vec<String>,
    #[serde(skip)]
    patterns: Vec<Regex>,
}

/// What a redacted value or match becomes.
const REDACTED: &str = "[redacted]";

/// The most of an argument or a result one line shows, as JSON text: the
/// sink takes lines of 64 KiB at most, and a longer one would be lost.
const SHOWN_CAP: usize = 16 << 10;

impl Trace {
    /// `text` (JSON, or any text) as it may be traced: parsed, its named
    /// fields and pattern matches redacted.
    /// Puts `text` (JSON, or any text) into `event` under `key` as it may
    /// be traced: parsed, its named fields and pattern matches redacted;
    /// past [`SHOWN_CAP`] as the start of its JSON text, with
    /// `<key>_truncated`.
    fn show(&self, event: &mut Map<String, Value>, key: &str, text: &str) {
        let mut value = serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.into()));
        self.redact(&mut value);
        let json = value.to_string();
        if json.len() > SHOWN_CAP {
            let cut = (0..=SHOWN_CAP)
                .rev()
                .find(|at| json.is_char_boundary(*at))
                .unwrap_or(0);
            value = Value::String(json[..cut].to_owned());
            event.insert(format!("{key}_truncated"), json!(true));
        }
        event.insert(key.into(), value);
    }

    fn redact(&self, value: &mut Value) {
        match value {
            Value::Object(map) => {
                for (name, field) in map.iter_mut() {
                    if self.redact.iter().any(|r| r.eq_ignore_ascii_case(name)) {
                        *field = json!(REDACTED);
                    } else {
                        self.redact(field);
                    }
                }
            }
            Value::Array(items) => items.iter_mut().for_each(|item| self.redact(item)),
            Value::String(text) => {
                for pattern in &self.patterns {
                    if let std::borrow::Cow::Owned(replaced) = pattern.replace_all(text, REDACTED) {
                        *text = replaced;
                    }
                }
            }
            _ => {}
        }
    }
}

/// The shared context's key the host sets when it cancels the invoke.
const CANCELLED: &str = "cancelled";

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
    fn configure(&mut self) -> Result<(), String> {
        self.patterns = self
            .redact_patterns
            .iter()
            .enumerate()
            .map(|(i, pattern)| match Regex::new(pattern) {
                Ok(regex) if regex.is_match("") => {
                    Err(format!("redact_patterns[{i}] matches the empty string"))
                }
                Ok(regex) => Ok(regex),
                Err(e) => Err(format!("redact_patterns[{i}]: {e}")),
            })
            .collect::<Result<_, _>>()?;
        Ok(())
    }

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
            "kind": match request.kind() {
                ToolKind::Call => "call",
                ToolKind::Prompt => "prompt",
                ToolKind::Resource => "resource",
            },
            "call_id": request.call_id(),
            "arguments_bytes": request.arguments().len(),
        }));
        if self.arguments {
            self.show(&mut event, "arguments", &request.arguments());
        }
        let started = Instant::now();
        let result = next.tool(request);
        match &result {
            Ok(response) => {
                let output = response.output();
                event.insert("output_bytes".into(), json!(output.len()));
                if self.results {
                    self.show(&mut event, "output", &output);
                }
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
            TurnResult::Error(e) => match context::get::<Value>(CANCELLED) {
                Some(reason) => {
                    event.insert("outcome".into(), json!("cancelled"));
                    event.insert("reason".into(), reason);
                }
                None => {
                    event.insert("outcome".into(), json!("error"));
                    event.insert("error".into(), error(e));
                }
            },
        }
        emit(event, started);
        result
    }
}
