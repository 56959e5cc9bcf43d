//! One run of the tool loop: the messages so far, the calls made, the model
//! rounds, and how a run ends (done, paused, stopped at a limit).

use std::sync::Arc;

use super::{Hold, Paused, conversation, spec_of};
use crate::agent::History;
use crate::onion::Invoke;
use crate::types::{ChainError, ErrorKind, Origin};
use crate::types::{
    ChatResponse, FinishReason, Message, Resumable, ToolCall, ToolCallRecord, ToolSpec, TurnDone,
    TurnInterrupt, TurnRequest, TurnResult,
};

/// One run of the loop: the messages so far and what was done.
pub(super) struct Run<'a> {
    pub(super) history: &'a dyn History,
    pub(super) conversation: Option<String>,
    pub(super) messages: Vec<Message>,
    pub(super) calls: Vec<ToolCallRecord>,
    pub(super) rounds: u32,
    pub(super) last: Option<ChatResponse>,
    /// The tools the model was last offered, as the chat filters left
    /// them: a tool a filter added (and serves in its around-tool) can be
    /// called although it is not registered.
    pub(super) offered: Option<Arc<Vec<ToolSpec>>>,
    /// The `on_tool_call` policy's verdict on each call it was asked about.
    pub(super) verdicts: Vec<(ToolCall, Option<String>)>,
    /// The outputs of the current batch's calls so far, while each was to
    /// a `return_direct` tool and worked; `None` once one was not. A batch
    /// paused midway keeps it, so that it is judged whole.
    pub(super) direct: Option<Vec<String>>,
    /// Why each call of the current batch was refused, while every one so
    /// far was; `None` once one was not. Kept across a pause, as `direct`.
    pub(super) denied: Option<Vec<String>>,
}

impl<'a> Run<'a> {
    /// The tool calls of the current round, as the model asked for them.
    pub(super) fn batch(&self) -> Arc<[ToolCall]> {
        let calls = self.last.as_ref().map(|r| r.message.tool_calls.as_slice());
        Arc::from(calls.unwrap_or_default())
    }

    pub(super) fn start(history: &'a dyn History, invoke: &Invoke, request: &TurnRequest) -> Self {
        let conversation = conversation(invoke);
        let stored = conversation
            .as_deref()
            .map(|c| history.load(c))
            .unwrap_or_default();
        let mut messages = if request.load_history {
            stored.clone()
        } else {
            Vec::new()
        };
        messages.extend(request.messages.iter().cloned());
        let run = Run {
            history,
            conversation,
            messages,
            calls: Vec::new(),
            rounds: 0,
            last: None,
            offered: None,
            verdicts: Vec::new(),
            direct: None,
            denied: None,
        };
        // A re-entry sends the history it already has: store only what
        // follows it, so nothing is stored twice.
        let fresh = match request.messages.starts_with(&stored) {
            true => &request.messages[stored.len()..],
            false => &request.messages[..],
        };
        run.store(fresh);
        run
    }

    /// Picks up a paused turn where it stopped.
    pub(super) fn resume(history: &'a dyn History, invoke: &Invoke, paused: &Paused) -> Self {
        Run {
            history,
            conversation: conversation(invoke),
            messages: paused.messages.clone(),
            calls: paused.calls.clone(),
            rounds: paused.rounds,
            last: Some(paused.last.clone()),
            offered: paused.offered.clone(),
            verdicts: paused.verdicts.clone(),
            direct: paused.direct.clone(),
            denied: paused.denied.clone(),
        }
    }

    pub(super) fn store(&self, messages: &[Message]) {
        if let Some(conversation) = self.conversation.as_deref()
            && !messages.is_empty()
        {
            self.history.append(conversation, messages);
        }
    }

    pub(super) fn push(&mut self, message: Message) {
        self.store(std::slice::from_ref(&message));
        self.messages.push(message);
    }

    pub(super) fn summary(&self, response: ChatResponse) -> TurnDone {
        TurnDone {
            response,
            tool_calls: self.calls.clone(),
            iterations: self.rounds,
            messages: Arc::new(self.messages.clone()),
        }
    }

    /// Starts a batch of the model's calls.
    pub(super) fn begin_batch(&mut self) {
        self.direct = Some(Vec::new());
        self.denied = Some(Vec::new());
    }

    /// Records outcomes of the current batch: the tool messages and call
    /// records.
    pub(super) fn record(
        &mut self,
        tools: &[Arc<ToolSpec>],
        calls: Vec<ToolCall>,
        outcomes: Vec<Result<String, ChainError>>,
    ) {
        for (call, outcome) in calls.into_iter().zip(outcomes) {
            let direct = spec_of(tools, &call.name).is_some_and(|t| t.return_direct);
            match (&mut self.direct, &outcome) {
                (Some(answers), Ok(output)) if direct => answers.push(model_text(output)),
                _ => self.direct = None,
            }
            match (&mut self.denied, refusal(&outcome)) {
                (Some(reasons), Some(reason)) => reasons.push(format!("{}: {reason}", call.name)),
                _ => self.denied = None,
            }
            let (content, output, error) = match outcome {
                Ok(output) => (model_text(&output), Some(output), None),
                Err(error) => (error_text(&error), None, Some(error)),
            };
            self.push(Message::tool_result(call.id.clone(), content));
            self.calls.push(ToolCallRecord {
                call,
                output,
                error,
            });
        }
    }

    /// Ends the batch: when every call of it was to a `return_direct`
    /// tool and none failed, their outputs are the turn's answer.
    pub(super) fn settle(&mut self) -> Option<TurnResult> {
        let answers = self.direct.take().filter(|answers| !answers.is_empty())?;
        let mut answer = ChatResponse::new(
            Message::assistant(answers.join("\n")),
            FinishReason::Complete,
        );
        answer.metadata.insert("return_direct".into(), true.into());
        self.push(answer.message.clone());
        Some(TurnResult::Done(self.summary(answer)))
    }

    /// Ends the batch when every call of it was refused: the turn stops
    /// with an answer saying so ([`super::LoopConfig::stop_on_all_denied`]).
    pub(super) fn all_denied(&mut self) -> Option<TurnResult> {
        let reasons = self.denied.take().filter(|reasons| !reasons.is_empty())?;
        let text = format!(
            "Every tool call was refused, so the turn stops here: {}",
            reasons.join("; ")
        );
        let mut answer = ChatResponse::new(Message::assistant(text), FinishReason::ContentFiltered);
        answer
            .metadata
            .insert("stopped".into(), "all_denied".into());
        self.push(answer.message.clone());
        Some(TurnResult::Done(self.summary(answer)))
    }

    /// Pauses the turn: `hold` waits for a decision, then `later` (calls
    /// of the same batch, sorted again when the turn resumes).
    pub(super) fn pause(&mut self, hold: Hold, later: Vec<ToolCall>) -> TurnResult {
        let pending = Some(hold.calls[0].clone());
        let last = self
            .last
            .clone()
            .unwrap_or_else(|| ChatResponse::new(Message::assistant(""), FinishReason::Unknown));
        let paused = Paused {
            messages: std::mem::take(&mut self.messages),
            calls: std::mem::take(&mut self.calls),
            rounds: self.rounds,
            pending: hold.calls,
            later,
            verdicts: std::mem::take(&mut self.verdicts),
            direct: self.direct.take(),
            offered: self.offered.clone(),
            denied: self.denied.take(),
            last,
        };
        TurnResult::Interrupt(TurnInterrupt {
            reason: hold.reason,
            pending,
            kind: hold.kind,
            paused: Some(Resumable::new(Arc::new(paused))),
        })
    }

    pub(super) fn done(self, response: ChatResponse) -> TurnResult {
        TurnResult::Done(self.summary(response))
    }

    /// Stops at a limit, keeping what ran.
    pub(super) fn stop(self, message: String) -> TurnResult {
        let last = self
            .last
            .clone()
            .unwrap_or_else(|| ChatResponse::new(Message::assistant(""), FinishReason::Unknown));
        let mut error =
            ChainError::new(ErrorKind::LimitExceeded, message).at(Origin::terminal("tool-loop"));
        error.ran = Some(Arc::new(self.summary(last)));
        TurnResult::Error(error)
    }
}

/// What a tool result looks like to the model: a JSON string as its text,
/// any other JSON as JSON.
fn model_text(output: &str) -> String {
    match serde_json::from_str::<serde_json::Value>(output) {
        Ok(serde_json::Value::String(text)) => text,
        _ => output.to_owned(),
    }
}

/// A failed call as the model sees it: a JSON error object of type
/// `tool_error`, with the error's kind and message.
/// Why a call was refused rather than run, if it was: a result that says
/// so (`approval`'s `not_approved`, `tool-guard`'s `not_allowed`), a
/// filter's `content-filtered` error, or the loop's own refusal (a denial
/// on resume, a tool not offered).
fn refusal(outcome: &Result<String, ChainError>) -> Option<String> {
    match outcome {
        Ok(output) => {
            let value: serde_json::Value = serde_json::from_str(output).ok()?;
            let error = &value["error"];
            matches!(error["type"].as_str(), Some("not_approved" | "not_allowed"))
                .then(|| error["message"].as_str().unwrap_or("refused").to_owned())
        }
        Err(error) => {
            let by_loop = error.kind == ErrorKind::InvalidRequest
                && error
                    .origin
                    .as_ref()
                    .is_some_and(|o| o.filter.as_ref() == "tool-loop");
            (error.kind == ErrorKind::ContentFiltered || by_loop).then(|| error.message.clone())
        }
    }
}

fn error_text(error: &ChainError) -> String {
    let error = serde_json::json!({
        "type": "tool_error",
        "kind": error.kind.as_str(),
        "message": error.message,
    });
    serde_json::json!({ "error": error }).to_string()
}
