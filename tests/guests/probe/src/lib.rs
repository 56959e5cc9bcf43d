//! Test guest: a configurable filter for the onion's peer cases. Each
//! option is one behaviour a test asks for; with none it passes through.

use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use shallot_guest::{
    ChatRequest, ChatResponse, Fctx, Filter, FilterError, FinishReason, Hook, Message, Next,
    TokenOut, TokenTransform, Tokens, ToolRequest, ToolResponse, TurnDone, TurnRequest, TurnResult,
    context,
};

#[derive(Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
struct Probe {
    /// Appends `<tag>_before` / `<tag>_after` to the context list "trace".
    tag: String,
    /// The live hooks (`chat`, `tool`, `turn`, `tokens`); all by default.
    hooks: Option<Vec<String>>,
    /// Answers without calling next.
    short_circuit: bool,
    /// Calls next this many times (retry); 0 means once.
    calls: u32,
    /// Counts hook calls in FCtx `n` and copies FCtx to context `fctx:<tag>`.
    count: bool,
    /// The FCtx seed.
    init: Option<Value>,
    /// Sets FCtx `seen: true`.
    mark: bool,
    /// Copies context "id" into FCtx before next and checks it after.
    echo_id: bool,
    /// Turns an error from next into an answer `caught: <message>`.
    catch: bool,
    /// Calls next with this bound, in milliseconds.
    within_ms: Option<u32>,
    /// Doubles numeric tool arguments before next.
    double_args: bool,
    /// Doubles a numeric tool result after next.
    double_result: bool,
    /// Prepends a system message with this text (chat and turn).
    system: Option<String>,
    /// Appends request.resume() to the context list "resume".
    record_resume: bool,
    /// Counts calls in a static: instance memory, not FCtx.
    instance_counter: bool,
    /// Token transform: prefix each token with this.
    prefix: Option<String>,
    /// Token transform: emit one token per this many (buffering), rest on flush.
    batch: Option<usize>,
    /// Token transform: drop tokens with this exact text.
    drop: Option<String>,
    /// Turn: re-enter with the run's messages plus feedback until the
    /// answer is accepted (validation retry).
    revise: Option<Revise>,
    /// System prompt: appends this line to the prompt.
    append_system: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Revise {
    /// The answer text that passes.
    accept: String,
    /// The user message sent back when it does not.
    feedback: String,
    retries: u32,
}

#[derive(Serialize, Deserialize, Default)]
struct State(serde_json::Map<String, Value>);

static INSTANCE_CALLS: AtomicU32 = AtomicU32::new(0);

fn push(key: &str, item: Value) {
    let mut list: Vec<Value> = context::get(key).unwrap_or_default();
    list.push(item);
    context::set(key, &list);
}

impl Probe {
    fn before(&self, fctx: &Fctx<State>) {
        if !self.tag.is_empty() {
            push("trace", json!(format!("{}_before", self.tag)));
        }
        if self.count || self.mark || self.echo_id {
            let id: Value = context::get("id").unwrap_or(Value::Null);
            fctx.update(|State(state)| {
                if self.count {
                    let n = state.get("n").and_then(Value::as_u64).unwrap_or(0);
                    state.insert("n".into(), json!(n + 1));
                }
                if self.mark {
                    state.insert("seen".into(), json!(true));
                }
                if self.echo_id {
                    state.insert("id".into(), id);
                }
            });
        }
        if self.instance_counter {
            let calls = INSTANCE_CALLS.fetch_add(1, Ordering::Relaxed) + 1;
            push("instance_calls", json!(calls));
        }
    }

    fn after(&self, fctx: &Fctx<State>) -> Result<(), FilterError> {
        let State(state) = fctx.get();
        if self.echo_id {
            let mine = state.get("id").cloned().unwrap_or(Value::Null);
            let now: Value = context::get("id").unwrap_or(Value::Null);
            if mine != now {
                return Err(FilterError::invalid(format!(
                    "FCtx id {mine} but context id {now}"
                )));
            }
        }
        if !self.tag.is_empty() {
            push("trace", json!(format!("{}_after", self.tag)));
            if self.count || self.mark || self.echo_id {
                context::set(&format!("fctx:{}", self.tag), &state);
            }
        }
        Ok(())
    }

    fn times(&self) -> u32 {
        self.calls.max(1)
    }
}

#[shallot_guest::filter(name = "probe")]
impl Filter for Probe {
    type State = State;

    fn wants(&self, hook: Hook) -> bool {
        let name = match hook {
            Hook::AroundChat => "chat",
            Hook::AroundTool => "tool",
            Hook::AroundTurn => "turn",
            Hook::TokenTransform => "tokens",
            Hook::SystemPrompt => "system-prompt",
        };
        self.hooks
            .as_ref()
            .is_none_or(|hooks| hooks.iter().any(|h| h == name))
    }

    fn init(&self) -> State {
        match &self.init {
            Some(Value::Object(map)) => State(map.clone()),
            _ => State::default(),
        }
    }

    fn around_chat(
        &self,
        request: &ChatRequest,
        next: Next<State>,
    ) -> Result<ChatResponse, FilterError> {
        let fctx = next.fctx();
        self.before(&fctx);
        if let Some(text) = &self.system {
            request.insert_message(0, &Message::system(text.as_str()));
        }
        let mut result = Ok(ChatResponse::from_text(
            format!("short:{}", self.tag),
            FinishReason::Complete,
        ));
        if !self.short_circuit {
            for _ in 0..self.times() {
                result = match self.within_ms {
                    Some(ms) => next.chat_within(request, ms),
                    None => next.chat(request),
                };
            }
        }
        let response = match result {
            Err(error) if self.catch => {
                ChatResponse::from_text(format!("caught: {}", error.message), FinishReason::Error)
            }
            other => other?,
        };
        self.after(&fctx)?;
        Ok(response)
    }

    fn around_tool(
        &self,
        request: &ToolRequest,
        next: Next<State>,
    ) -> Result<ToolResponse, FilterError> {
        let fctx = next.fctx();
        self.before(&fctx);
        if self.double_args {
            let mut args: serde_json::Map<String, Value> =
                serde_json::from_str(&request.arguments()).unwrap_or_default();
            for value in args.values_mut() {
                if let Some(n) = value.as_i64() {
                    *value = json!(n * 2);
                }
            }
            request
                .set_arguments(&Value::Object(args).to_string())
                .map_err(FilterError::invalid)?;
        }
        let mut result = Ok(ToolResponse::from_value("short"));
        if !self.short_circuit {
            for _ in 0..self.times() {
                result = match self.within_ms {
                    Some(ms) => next.tool_within(request, ms),
                    None => next.tool(request),
                };
            }
        }
        let response = match result {
            Err(error) if self.catch => ToolResponse::from_value(&json!({"caught": error.message})),
            other => other?,
        };
        if self.double_result {
            let value: Value = serde_json::from_str(&response.output()).unwrap_or(Value::Null);
            if let Some(n) = value.as_i64() {
                response
                    .set_output(&(n * 2).to_string())
                    .map_err(FilterError::invalid)?;
            }
        }
        self.after(&fctx)?;
        Ok(response)
    }

    fn around_turn(&self, request: &TurnRequest, next: Next<State>) -> TurnResult {
        let fctx = next.fctx();
        self.before(&fctx);
        if self.record_resume {
            push("resume", json!(request.resume()));
        }
        if let Some(text) = &self.system {
            let mut messages = request.messages();
            messages.insert(0, Message::system(text.as_str()));
            request.set_messages(&messages);
        }
        let mut result = if self.short_circuit {
            let answer =
                ChatResponse::from_text(format!("short:{}", self.tag), FinishReason::Complete);
            TurnResult::Done(TurnDone::new(answer, &request.messages()))
        } else {
            next.turn(request)
        };
        for _ in 1..self.times() {
            if let TurnResult::Done(_) = result {
                result = next.turn(request);
            }
        }
        if let Some(revise) = &self.revise {
            for _ in 0..revise.retries {
                let TurnResult::Done(done) = &result else {
                    break;
                };
                if done.response().text() == revise.accept {
                    break;
                }
                let mut messages = done.messages();
                messages.push(Message::user(revise.feedback.as_str()));
                let again = TurnRequest::new(&messages);
                again.set_load_history(false);
                result = next.turn(&again);
            }
        }
        if let Err(error) = self.after(&fctx) {
            return TurnResult::Error(error);
        }
        result
    }

    fn system_prompt(&self, prompt: String) -> Result<String, FilterError> {
        Ok(match &self.append_system {
            Some(line) if prompt.is_empty() => line.clone(),
            Some(line) => format!("{prompt}\n{line}"),
            None => prompt,
        })
    }

    fn token_transform(&self) -> Box<dyn TokenTransform> {
        Box::new(Transform {
            prefix: self.prefix.clone().unwrap_or_default(),
            batch: self.batch.unwrap_or(0),
            drop: self.drop.clone(),
            buffer: Vec::new(),
        })
    }
}

struct Transform {
    prefix: String,
    batch: usize,
    drop: Option<String>,
    buffer: Vec<(String, Option<String>)>,
}

impl Transform {
    fn emit_buffer(&mut self, out: &mut TokenOut) {
        if self.buffer.is_empty() {
            return;
        }
        let text: String = self.buffer.iter().map(|(t, _)| t.as_str()).collect();
        let meta = self.buffer[0].1.clone();
        out.push(&text, meta.as_deref());
        self.buffer.clear();
    }
}

impl TokenTransform for Transform {
    fn step(&mut self, tokens: Tokens, out: &mut TokenOut) -> Result<(), FilterError> {
        for token in tokens.iter() {
            if self.drop.as_deref() == Some(token.text) {
                continue;
            }
            let text = format!("{}{}", self.prefix, token.text);
            if self.batch == 0 {
                out.push(&text, token.meta);
                continue;
            }
            self.buffer.push((text, token.meta.map(str::to_owned)));
            if self.buffer.len() == self.batch {
                self.emit_buffer(out);
            }
        }
        Ok(())
    }

    fn flush(&mut self, _: FinishReason, out: &mut TokenOut) -> Result<(), FilterError> {
        self.emit_buffer(out);
        Ok(())
    }
}
