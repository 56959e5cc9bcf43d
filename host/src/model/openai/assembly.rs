//! A streamed answer put together chunk by chunk: text, tool calls whose
//! arguments arrive in pieces (by index), the finish reason and the usage
//! chunk, bounded by the default [`ResponseLimits`] as it grows.

use std::collections::BTreeMap;

use super::super::ResponseLimits;
use super::wire::{Chunk, answer, finish};
use crate::types::ChainError;
use crate::types::{ChatResponse, ToolCall, Usage};

/// A streamed answer as it is put together, chunk by chunk.
#[derive(Default)]
pub(super) struct Assembly {
    text: String,
    /// Bytes of text and tool calls so far, checked as chunks arrive.
    bytes: usize,
    calls: BTreeMap<usize, ToolCall>,
    reason: Option<String>,
    usage: Usage,
    model: String,
}

impl Assembly {
    /// Folds a chunk in and returns its text, if any; fails once the
    /// answer goes past the default [`ResponseLimits`].
    pub(super) fn add(&mut self, chunk: Chunk) -> Result<Option<String>, ChainError> {
        let limits = ResponseLimits::default();
        if !chunk.model.is_empty() {
            self.model = chunk.model;
        }
        if let Some(usage) = chunk.usage {
            self.usage = usage.into();
        }
        let mut text = None;
        for choice in chunk.choices {
            if let Some(reason) = choice.finish_reason {
                self.reason = Some(reason);
            }
            for piece in choice.delta.tool_calls {
                let call = self.calls.entry(piece.index).or_insert_with(|| ToolCall {
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
            if let Some(content) = choice.delta.content.filter(|c| !c.is_empty()) {
                self.bytes += content.len();
                limits.check(self.calls.len(), self.bytes)?;
                self.text.push_str(&content);
                text = Some(content);
            }
        }
        Ok(text)
    }

    /// Whether the server already said why the answer ended.
    pub(super) fn has_finished(&self) -> bool {
        self.reason.is_some()
    }

    pub(super) fn finish(self) -> ChatResponse {
        let calls: Vec<ToolCall> = self.calls.into_values().collect();
        let reason = finish(self.reason.as_deref(), !calls.is_empty());
        answer(Some(self.text), calls, reason, self.usage, self.model)
    }
}
