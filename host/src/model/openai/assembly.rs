//! A streamed answer put together chunk by chunk: text, tool calls whose
//! arguments arrive in pieces (by index), the finish reason and the usage
//! chunk, bounded by the default [`ResponseLimits`] as it grows.

use std::collections::BTreeMap;

use eventsource_stream::Event;

use super::super::ResponseLimits;
use super::super::http::{self, Step};
use super::said_error;
use super::wire::{Chunk, answer, finish, refused};
use crate::types::{ChainError, ErrorKind};
use crate::types::{ChatResponse, ToolCall, Usage};

/// A streamed answer as it is put together, chunk by chunk.
#[derive(Default)]
pub struct Assembly {
    text: String,
    /// Bytes of text and tool calls so far, checked as chunks arrive.
    bytes: usize,
    calls: BTreeMap<usize, ToolCall>,
    reason: Option<String>,
    usage: Usage,
    model: String,
    /// Whether the model refused (its refusal is the text).
    refused: bool,
}

impl Assembly {
    /// Folds a chunk in and returns its text, if any; fails once the
    /// answer goes past the default [`ResponseLimits`].
    fn add(&mut self, chunk: Chunk) -> Result<Option<String>, ChainError> {
        let limits = ResponseLimits::default();
        if !chunk.model.is_empty() {
            self.model = chunk.model;
        }
        if let Some(usage) = chunk.usage {
            self.usage = usage.into();
        }
        let mut text = None;
        // Only the first of `n` answers is read.
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if let Some(reason) = choice.finish_reason.filter(|r| !r.is_empty()) {
                self.reason = Some(reason);
            }
            for piece in choice.delta.tool_calls {
                let index = piece
                    .index
                    .unwrap_or_else(|| self.unindexed(piece.id.as_deref()));
                let call = self.calls.entry(index).or_insert_with(|| ToolCall {
                    id: String::new(),
                    name: String::new(),
                    arguments: String::new(),
                });
                if let Some(id) = piece.id {
                    call.id = id;
                }
                if let Some(function) = piece.function {
                    let name = function.name.as_deref().unwrap_or("");
                    let arguments = function.arguments.as_deref().unwrap_or("");
                    self.bytes += name.len() + arguments.len();
                    call.name.push_str(name);
                    call.arguments.push_str(arguments);
                }
                limits.check(self.calls.len(), self.bytes)?;
            }
            let refusal = choice.delta.refusal.filter(|r| !r.is_empty());
            self.refused |= refusal.is_some();
            let content = choice.delta.content.filter(|c| !c.is_empty());
            if let Some(content) = content.or(refusal) {
                self.bytes += content.len();
                limits.check(self.calls.len(), self.bytes)?;
                self.text.push_str(&content);
                text = Some(content);
            }
        }
        Ok(text)
    }

    /// The call a tool-call piece without an index belongs to: a new one
    /// when it brings an id the last call does not have, else the last.
    fn unindexed(&self, id: Option<&str>) -> usize {
        match self.calls.last_key_value() {
            None => 0,
            Some((last, call)) if id.is_some_and(|id| !call.id.is_empty() && call.id != id) => {
                last + 1
            }
            Some((last, _)) => *last,
        }
    }
}

impl http::Assembly for Assembly {
    fn event(&mut self, event: &Event) -> Result<Step, ChainError> {
        if event.data.trim() == "[DONE]" {
            return Ok(Step::Done);
        }
        let chunk: Chunk = serde_json::from_str(&event.data).map_err(|e| {
            let message = format!("the model stream sent an unreadable chunk: {e}");
            ChainError::new(ErrorKind::Transient, message)
        })?;
        if let Some(error) = &chunk.error {
            return Err(said_error("broke off the stream with an error", error));
        }
        Ok(self.add(chunk)?.map_or(Step::Skip, Step::Token))
    }

    /// Whether the server already said why the answer ended.
    fn whole(&self) -> bool {
        self.reason.is_some()
    }

    fn finish(self) -> ChatResponse {
        let calls: Vec<ToolCall> = self.calls.into_values().collect();
        let reason = finish(self.reason.as_deref(), !calls.is_empty());
        let reason = refused(reason, self.refused);
        answer(Some(self.text), calls, reason, self.usage, self.model)
    }
}
