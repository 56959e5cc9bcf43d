//! Anthropic's Messages wire in our terms: a `message` (and a stream's
//! usage) as our response; `written` is the request going out.

use serde_json::Value;

pub(super) use super::written::outgoing;
use crate::model::openai::wire::answer;
use crate::types::{ChainError, ChatResponse, ErrorKind, FinishReason, ToolCall, Usage};

/// Anthropic's stop reason in our terms.
pub(super) fn finish(reason: Option<&str>) -> FinishReason {
    match reason {
        Some("end_turn") => FinishReason::Complete,
        Some("tool_use") => FinishReason::ToolUse,
        Some("max_tokens" | "model_context_window_exceeded") => FinishReason::LengthLimit,
        Some("stop_sequence") => FinishReason::StopSequence,
        Some("pause_turn") => FinishReason::PauseTurn,
        Some("refusal") => FinishReason::Refusal,
        _ => FinishReason::Unknown,
    }
}

/// A usage object's counts, where they are.
pub(super) fn usage(wire: &Value, into: &mut Usage) {
    let count = |field: &str| wire[field].as_u64().map(|n| n as u32);
    if let Some(input) = count("input_tokens") {
        let cached = count("cache_read_input_tokens").unwrap_or(0)
            + count("cache_creation_input_tokens").unwrap_or(0);
        into.input_tokens = input + cached;
    }
    if let Some(output) = count("output_tokens") {
        into.output_tokens = output;
    }
    into.total_tokens = into.input_tokens + into.output_tokens;
}

/// A `message` (a whole answer) as our response.
pub(super) fn message(body: &[u8]) -> Result<ChatResponse, ChainError> {
    let message: Value = serde_json::from_slice(body).map_err(|e| unreadable(e.to_string()))?;
    if message["type"] == "error" {
        let said = message["error"]["message"]
            .as_str()
            .unwrap_or("(no message)");
        let message = format!("the model server answered with an error: {said}");
        return Err(ChainError::new(ErrorKind::Transient, message));
    }
    let Some(blocks) = message["content"].as_array() else {
        return Err(unreadable("it has no `content`".to_owned()));
    };
    let mut text = String::new();
    let mut calls = Vec::new();
    for block in blocks {
        match block["type"].as_str() {
            Some("text") => text.push_str(block["text"].as_str().unwrap_or_default()),
            Some("tool_use") => calls.push(ToolCall {
                id: block["id"].as_str().unwrap_or_default().to_owned(),
                name: block["name"].as_str().unwrap_or_default().to_owned(),
                arguments: block["input"].to_string(),
            }),
            _ => {}
        }
    }
    let mut counted = Usage::default();
    usage(&message["usage"], &mut counted);
    let reason = finish(message["stop_reason"].as_str());
    let model = message["model"].as_str().unwrap_or_default().to_owned();
    Ok(answer(Some(text), calls, reason, counted, model))
}

pub(super) fn unreadable(why: String) -> ChainError {
    ChainError::new(
        ErrorKind::Transient,
        format!("the model server sent an unreadable answer: {why}"),
    )
}
