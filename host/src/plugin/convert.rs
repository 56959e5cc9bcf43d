//! The one place where WIT types and host types meet. Reading (host to
//! WIT) clones from a borrowed host value; writing (WIT to host) moves.

use super::bindings::shallot::filter::types as wit;
use crate::types::{Call, ChainError, ErrorKind};
use crate::types::{
    Content, ContentPart, FinishReason, Message, Role, TokenBatch, ToolCall, ToolCallRecord,
    ToolSpec, Usage,
};

pub(crate) fn message(m: &Message) -> wit::Message {
    wit::Message {
        role: match m.role {
            Role::System => wit::Role::System,
            Role::User => wit::Role::User,
            Role::Assistant => wit::Role::Assistant,
            Role::Tool => wit::Role::Tool,
        },
        content: m.content.as_ref().map(|content| match content {
            Content::Text(text) => wit::Content::Text(text.clone()),
            Content::Parts(parts) => wit::Content::Parts(
                parts
                    .iter()
                    .map(|part| match part {
                        ContentPart::Text { text } => wit::ContentPart::Text(text.clone()),
                        ContentPart::Image { url, detail } => wit::ContentPart::Image(wit::Image {
                            url: url.clone(),
                            detail: detail.clone(),
                        }),
                    })
                    .collect(),
            ),
        }),
        tool_calls: m.tool_calls.iter().map(tool_call).collect(),
        tool_call_id: m.tool_call_id.clone(),
    }
}

pub(crate) fn messages(list: &[Message]) -> Vec<wit::Message> {
    list.iter().map(message).collect()
}

impl From<wit::Message> for Message {
    fn from(m: wit::Message) -> Self {
        Message {
            role: match m.role {
                wit::Role::System => Role::System,
                wit::Role::User => Role::User,
                wit::Role::Assistant => Role::Assistant,
                wit::Role::Tool => Role::Tool,
            },
            content: m.content.map(|content| match content {
                wit::Content::Text(text) => Content::Text(text),
                wit::Content::Parts(parts) => Content::Parts(
                    parts
                        .into_iter()
                        .map(|part| match part {
                            wit::ContentPart::Text(text) => ContentPart::Text { text },
                            wit::ContentPart::Image(image) => ContentPart::Image {
                                url: image.url,
                                detail: image.detail,
                            },
                        })
                        .collect(),
                ),
            }),
            tool_calls: m.tool_calls.into_iter().map(ToolCall::from).collect(),
            tool_call_id: m.tool_call_id,
        }
    }
}

pub(crate) fn from_messages(list: Vec<wit::Message>) -> Vec<Message> {
    list.into_iter().map(Message::from).collect()
}

pub(crate) fn tool_call(c: &ToolCall) -> wit::ToolCall {
    wit::ToolCall {
        id: c.id.clone(),
        name: c.name.clone(),
        arguments: c.arguments.clone(),
    }
}

impl From<wit::ToolCall> for ToolCall {
    fn from(c: wit::ToolCall) -> Self {
        ToolCall {
            id: c.id,
            name: c.name,
            arguments: c.arguments,
        }
    }
}

pub(crate) fn tool_spec(t: &ToolSpec) -> wit::ToolSpec {
    wit::ToolSpec {
        name: t.name.clone(),
        description: t.description.clone(),
        parameters: t.parameters.to_string(),
        sensitive: t.sensitive,
    }
}

/// A tool spec from a guest, with its `parameters` already parsed.
pub(crate) fn from_tool_spec(t: wit::ToolSpec, parameters: crate::types::JsonMap) -> ToolSpec {
    ToolSpec {
        sensitive: t.sensitive,
        ..ToolSpec::new(t.name, t.description, serde_json::Value::Object(parameters))
    }
}

pub(crate) fn finish_reason(r: FinishReason) -> wit::FinishReason {
    match r {
        FinishReason::Complete => wit::FinishReason::Complete,
        FinishReason::ToolUse => wit::FinishReason::ToolUse,
        FinishReason::LengthLimit => wit::FinishReason::LengthLimit,
        FinishReason::ContentFiltered => wit::FinishReason::ContentFiltered,
        FinishReason::StopSequence => wit::FinishReason::StopSequence,
        FinishReason::PauseTurn => wit::FinishReason::PauseTurn,
        FinishReason::Refusal => wit::FinishReason::Refusal,
        FinishReason::Error => wit::FinishReason::Error,
        FinishReason::Unknown => wit::FinishReason::Unknown,
    }
}

impl From<wit::FinishReason> for FinishReason {
    fn from(r: wit::FinishReason) -> Self {
        match r {
            wit::FinishReason::Complete => FinishReason::Complete,
            wit::FinishReason::ToolUse => FinishReason::ToolUse,
            wit::FinishReason::LengthLimit => FinishReason::LengthLimit,
            wit::FinishReason::ContentFiltered => FinishReason::ContentFiltered,
            wit::FinishReason::StopSequence => FinishReason::StopSequence,
            wit::FinishReason::PauseTurn => FinishReason::PauseTurn,
            wit::FinishReason::Refusal => FinishReason::Refusal,
            wit::FinishReason::Error => FinishReason::Error,
            wit::FinishReason::Unknown => FinishReason::Unknown,
        }
    }
}

pub(crate) fn usage(u: Usage) -> wit::Usage {
    wit::Usage {
        input_tokens: u.input_tokens,
        output_tokens: u.output_tokens,
        total_tokens: u.total_tokens,
    }
}

impl From<wit::Usage> for Usage {
    fn from(u: wit::Usage) -> Self {
        Usage {
            input_tokens: u.input_tokens,
            output_tokens: u.output_tokens,
            total_tokens: u.total_tokens,
        }
    }
}

fn error_kind(k: ErrorKind) -> wit::ErrorKind {
    match k {
        // The contract has no word for it yet: to a filter, overload is a
        // transient failure worth retrying later.
        ErrorKind::Transient | ErrorKind::Overloaded => wit::ErrorKind::Transient,
        ErrorKind::Timeout => wit::ErrorKind::Timeout,
        ErrorKind::ContentFiltered => wit::ErrorKind::ContentFiltered,
        ErrorKind::InvalidRequest => wit::ErrorKind::InvalidRequest,
        ErrorKind::Auth => wit::ErrorKind::Auth,
        ErrorKind::NotFound => wit::ErrorKind::NotFound,
        ErrorKind::LimitExceeded => wit::ErrorKind::LimitExceeded,
        ErrorKind::PluginFault => wit::ErrorKind::PluginFault,
        ErrorKind::Internal => wit::ErrorKind::Internal,
    }
}

impl From<wit::ErrorKind> for ErrorKind {
    fn from(k: wit::ErrorKind) -> Self {
        match k {
            wit::ErrorKind::Transient => ErrorKind::Transient,
            wit::ErrorKind::Timeout => ErrorKind::Timeout,
            wit::ErrorKind::ContentFiltered => ErrorKind::ContentFiltered,
            wit::ErrorKind::InvalidRequest => ErrorKind::InvalidRequest,
            wit::ErrorKind::Auth => ErrorKind::Auth,
            wit::ErrorKind::NotFound => ErrorKind::NotFound,
            wit::ErrorKind::LimitExceeded => ErrorKind::LimitExceeded,
            wit::ErrorKind::PluginFault => ErrorKind::PluginFault,
            wit::ErrorKind::Internal => ErrorKind::Internal,
        }
    }
}

/// An error as a filter is told it, the origin folded into the message so
/// that an outer filter can still tell who failed: an inner filter by its
/// name and call, never its plugin's file, stderr or backtrace; a
/// terminal's error in its own words.
pub(crate) fn filter_error(e: &ChainError) -> wit::FilterError {
    let message = match &e.origin {
        Some(origin) if origin.call != Call::Terminal => {
            format!("{}: {}", origin.public(), e.message)
        }
        _ => e.message.clone(),
    };
    wit::FilterError {
        kind: error_kind(e.kind),
        message,
    }
}

pub(crate) fn tool_call_record(r: &ToolCallRecord) -> wit::ToolCallRecord {
    wit::ToolCallRecord {
        call: tool_call(&r.call),
        output: r.output.clone(),
        error: r.error.as_ref().map(filter_error),
    }
}

pub(crate) fn token_batch(b: TokenBatch) -> wit::TokenBatch {
    wit::TokenBatch {
        text: b.text,
        ends: b.ends,
        metas: b
            .metas
            .into_iter()
            .map(|(index, json)| wit::TokenMeta { index, json })
            .collect(),
    }
}

impl From<wit::TokenBatch> for TokenBatch {
    fn from(b: wit::TokenBatch) -> Self {
        TokenBatch {
            text: b.text,
            ends: b.ends,
            metas: b.metas.into_iter().map(|m| (m.index, m.json)).collect(),
        }
    }
}
