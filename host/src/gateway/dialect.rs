//! How one client API writes an answer. The gateway runs every request the
//! same way (one chat, or one agent turn, through the filters, its text
//! delivered through the token transforms); a dialect only says it in its
//! API's words: OpenAI's chat completions (`wire`), OpenAI's Responses
//! (`responses`) or Anthropic's Messages (`messages`). A stream is written
//! as [`Frame`]s: server-sent events whose long texts are escaped a piece
//! at a time as they are sent, never held escaped whole.

use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde::Serialize;

use super::wire::{ApiError, spliced_bytes};
use crate::types::ChatResponse;

/// One API's answers: whole, or as the events of a stream. A dialect is
/// made for one answer and may keep what its stream has said so far (the
/// blocks it opened, the text it sent).
pub(super) trait Dialect: Send + Sync + 'static {
    /// The body of a whole answer; `shown` is its text as the token
    /// transforms delivered it (the response's own text is taken out).
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body;

    /// The events that open a stream, before any text.
    fn opening(&mut self) -> Vec<Frame>;

    /// The events that carry the next piece of the answer's text (at most
    /// [`TEXT_PIECE`](super::wire::TEXT_PIECE) bytes).
    fn text(&mut self, piece: &str) -> Vec<Frame>;

    /// The events after the last piece of text: the tool calls, why the
    /// answer finished, its usage.
    fn end(&mut self, response: &ChatResponse) -> Vec<Frame>;

    /// The next event of the end, after those [`Dialect::end`] returned,
    /// for a dialect whose end is long (the Responses API's closing events
    /// repeat the whole text): one at a time, as the client takes them.
    fn more(&mut self) -> Option<Frame> {
        None
    }

    /// The events that end a stream broken by `error`.
    fn broken(&mut self, error: &ApiError) -> Vec<Frame>;

    /// The last event of every stream, answered or broken, if the API has
    /// one (chat completions' `[DONE]`).
    fn closing(&self) -> Option<Frame> {
        None
    }

    /// `error` as an answer, before any of the answer was sent.
    fn refuse(&self, error: ApiError) -> Response {
        error.into_response()
    }

    /// The answer was to be kept (the Responses API's `store`) and could
    /// not be: it is delivered all the same, saying so.
    fn unkept(&mut self) {}
}

/// One server-sent event, or a keep-alive comment.
pub(super) struct Frame(Kind);

enum Kind {
    Whole {
        name: Option<&'static str>,
        data: String,
    },
    /// `data` is `before`, `text` as a JSON string, then `after`.
    Spliced {
        name: &'static str,
        before: Vec<u8>,
        text: Arc<str>,
        after: Vec<u8>,
    },
    Comment,
}

impl Frame {
    /// An unnamed event of `data` (chat completions' chunks, `[DONE]`).
    pub(super) fn data(data: impl Into<String>) -> Frame {
        Frame(Kind::Whole {
            name: None,
            data: data.into(),
        })
    }

    /// An event of `name` whose data is `data` (a JSON tree, or a typed
    /// event written straight to its text).
    pub(super) fn named(name: &'static str, data: &impl Serialize) -> Frame {
        Frame(Kind::Whole {
            name: Some(name),
            data: serde_json::to_string(data).expect("an event serializes"),
        })
    }

    /// An event of `name` whose data is the JSON text `before`, `text` as a
    /// JSON string, then `after`: the text escaped as it is sent.
    pub(super) fn spliced(
        name: &'static str,
        before: Vec<u8>,
        text: Arc<str>,
        after: Vec<u8>,
    ) -> Frame {
        Frame(Kind::Spliced {
            name,
            before,
            text,
            after,
        })
    }

    /// A comment that keeps an idle connection open.
    pub(super) fn keep_alive() -> Frame {
        Frame(Kind::Comment)
    }

    /// The frame as it is sent. Data never holds a line break (JSON
    /// escapes them), so each event is one `data:` line.
    pub(super) fn into_bytes(self) -> BoxStream<'static, Bytes> {
        let line = |name: Option<&str>| match name {
            Some(name) => format!("event: {name}\ndata: ").into_bytes(),
            None => b"data: ".to_vec(),
        };
        match self.0 {
            Kind::Whole { name, data } => {
                let mut bytes = line(name);
                bytes.extend(data.into_bytes());
                bytes.extend_from_slice(b"\n\n");
                futures::stream::iter([Bytes::from(bytes)]).boxed()
            }
            Kind::Spliced {
                name,
                before,
                text,
                mut after,
            } => {
                let mut head = line(Some(name));
                head.extend(before);
                after.extend_from_slice(b"\n\n");
                spliced_bytes(head, text, after)
            }
            Kind::Comment => futures::stream::iter([Bytes::from_static(b":\n\n")]).boxed(),
        }
    }
}
