//! How one client API writes an answer. The gateway runs every request the
//! same way (one chat, or one agent turn, through the filters, its text
//! delivered through the token transforms); a dialect only says it in its
//! API's words: OpenAI's chat completions (`wire`), OpenAI's Responses
//! (`responses`) or Anthropic's Messages (`messages`).

use axum::body::Body;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};

use super::wire::ApiError;
use crate::types::ChatResponse;

/// One API's answers: whole, or as the events of a stream. A dialect is
/// made for one answer and may keep what its stream has said so far (the
/// blocks it opened, the text it sent).
pub(super) trait Dialect: Send + Sync + 'static {
    /// The body of a whole answer; `shown` is its text as the token
    /// transforms delivered it (the response's own text is taken out).
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body;

    /// The events that open a stream, before any text.
    fn opening(&mut self) -> Vec<Event>;

    /// The events that carry the next piece of the answer's text.
    fn text(&mut self, piece: &str) -> Vec<Event>;

    /// The events after the last piece of text: the tool calls, why the
    /// answer finished, its usage.
    fn end(&mut self, response: &ChatResponse) -> Vec<Event>;

    /// The events that end a stream broken by `error`.
    fn broken(&mut self, error: &ApiError) -> Vec<Event>;

    /// The last event of every stream, answered or broken, if the API has
    /// one (chat completions' `[DONE]`).
    fn closing(&self) -> Option<Event> {
        None
    }

    /// `error` as an answer, before any of the answer was sent.
    fn refuse(&self, error: ApiError) -> Response {
        error.into_response()
    }
}

/// A stream event of `name` whose data is `data`.
pub(super) fn named(name: &str, data: &serde_json::Value) -> Event {
    Event::default().event(name).data(data.to_string())
}
