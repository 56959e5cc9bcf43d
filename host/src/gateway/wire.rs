//! The gateway's side of the chat-completions protocol: a client's request
//! in our terms, and our answers, stream chunks and errors as OpenAI's
//! clients expect them.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::http::StatusCode;
use bytes::Bytes;
use futures::StreamExt;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use super::Route;
use super::chunk::Delta;
use super::dialect::{Dialect, Frame};
use super::handlers::{ChatApi, Prepared};
use crate::model::wire::{InMessage, InTool, wire_finish, wire_message, wire_usage};
use crate::types::{Call, Cause, ChainError, ChatRequest, ChatResponse, ErrorKind, ModelOptions};

/// A `POST /v1/chat/completions` body. Fields the gateway does not handle
/// itself (`temperature`, `max_tokens`, `tool_choice`, ...) go to the model
/// as options.
#[derive(Deserialize)]
pub(super) struct CompletionRequest {
    model: String,
    messages: Vec<InMessage>,
    #[serde(default)]
    tools: Option<Vec<InTool>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    options: Value,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

impl CompletionRequest {
    /// Whether a streamed answer ends with a usage chunk.
    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage == Some(true))
    }

    /// The request in our terms, or what is wrong with it.
    fn chat_request(self) -> Result<ChatRequest, String> {
        if self.messages.is_empty() {
            return Err("`messages` must not be empty".to_owned());
        }
        if self
            .options
            .get("n")
            .is_some_and(|n| !n.is_null() && n.as_f64() != Some(1.0))
        {
            return Err("only `n: 1` is supported".to_owned());
        }
        let messages = self
            .messages
            .into_iter()
            .enumerate()
            .map(|(i, m)| m.into_message().map_err(|e| format!("messages[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let tools = self
            .tools
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, t)| t.into_tool().map_err(|e| format!("tools[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let request = ChatRequest::new(messages)
            .with_tools(tools)
            .with_options(ModelOptions::from_json(&self.options)?);
        Ok(request)
    }
}

impl ChatApi for CompletionRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        read(body, "a chat completion request")
    }

    fn model(&self) -> &str {
        &self.model
    }

    fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    fn user(&self) -> Option<&str> {
        self.options.get("user").and_then(Value::as_str)
    }

    async fn prepare(self, route: &Route, _: Option<&str>) -> Result<Prepared, ApiError> {
        let include_usage = self.include_usage();
        let chat = self.chat_request().map_err(ApiError::invalid)?;
        let head = Head::new(&route.model);
        Ok(Prepared {
            chat,
            id: head.id.clone(),
            dialect: Box::new(Completions {
                head,
                include_usage,
            }),
            keep: None,
        })
    }
}

/// The request of type `T` in `body`, or a `400` saying where it is not
/// one (`messages[2].role: unknown variant ...`). The body is read once,
/// typed; only a body that fails is read again to find the place.
pub(super) fn read<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let mut again = serde_json::Deserializer::from_slice(body);
        let place = serde_path_to_error::deserialize::<_, T>(&mut again)
            .err()
            .map(|e| e.path().to_string())
            .filter(|place| place != ".");
        match place {
            Some(place) => {
                ApiError::invalid(format!("the request body is not {what}: {place}: {e}"))
            }
            None => ApiError::invalid(format!("the request body is not {what}: {e}")),
        }
    })
}

/// Names one answer (or one of its items): `prefix` and 128 random bits
/// from the operating system, as 32 hex digits. An id that grants access
/// (a kept response's) must not be guessed from another: no id shows a
/// seed, a count or a time.
pub(super) fn unique_id(prefix: &str) -> String {
    let mut bits = [0u8; 16];
    if let Err(e) = getrandom::fill(&mut bits) {
        // Never seen on a system that runs wasmtime; an id that cannot be
        // random is a keyed hash of a count (std's keys are random too).
        tracing::error!("the operating system's random source failed: {e}");
        bits = keyed_bits();
    }
    format!("{prefix}{:032x}", u128::from_be_bytes(bits))
}

/// 128 bits of SipHash under std's random keys over a count: what
/// [`unique_id`] falls back to.
fn keyed_bits() -> [u8; 16] {
    use std::hash::BuildHasher;
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let keys = std::hash::RandomState::new();
    let (high, low) = (keys.hash_one((n, 0u8)), keys.hash_one((n, 1u8)));
    (u128::from(high) << 64 | u128::from(low)).to_be_bytes()
}

/// Seconds since the epoch, as `created` says it.
pub(super) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The most of an answer's text one piece of a JSON body or one stream
/// event carries, in bytes: escaped, a piece is at most six times this.
pub(super) const TEXT_PIECE: usize = 16 << 10;

/// The piece of `text` from byte `at`: at most [`TEXT_PIECE`] bytes, cut
/// on a character boundary; `None` at the end.
pub(super) fn next_piece(text: &str, at: usize) -> Option<&str> {
    if at >= text.len() {
        return None;
    }
    let mut end = (at + TEXT_PIECE).min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    Some(&text[at..end])
}

/// A JSON body: `before`, `text` as a JSON string (`null` for none), then
/// `after`: of a known length when the text is short, else written as
/// [`spliced_bytes`] writes it.
pub(super) fn spliced(mut before: Vec<u8>, text: Option<String>, after: Vec<u8>) -> Body {
    match text {
        Some(text) if text.len() > TEXT_PIECE => {
            Body::from_stream(spliced_bytes(before, text, after).map(Ok::<_, Infallible>))
        }
        short => {
            before.extend(serde_json::to_vec(&short).expect("a string serializes"));
            before.extend(after);
            Body::from(before)
        }
    }
}

/// `before`, `text` as a JSON string, then `after`. A text longer than
/// [`TEXT_PIECE`] is escaped a piece at a time as the bytes are taken:
/// escaped at once it could take six times its size (every control
/// character is six bytes in JSON).
pub(super) fn spliced_bytes<T>(
    mut before: Vec<u8>,
    text: T,
    after: Vec<u8>,
) -> futures::stream::BoxStream<'static, Bytes>
where
    T: AsRef<str> + Send + 'static,
{
    if text.as_ref().len() <= TEXT_PIECE {
        before.extend(serde_json::to_vec(text.as_ref()).expect("a string serializes"));
        before.extend(after);
        return futures::stream::iter([Bytes::from(before)]).boxed();
    }
    let pieces = futures::stream::unfold((text, 0), |(text, at)| async move {
        let piece = next_piece(text.as_ref(), at)?;
        let escaped = serde_json::to_string(piece).expect("a string serializes");
        let inner = Bytes::copy_from_slice(&escaped.as_bytes()[1..escaped.len() - 1]);
        let at = at + piece.len();
        Some((inner, (text, at)))
    });
    before.push(b'"');
    let mut after = after;
    after.insert(0, b'"');
    futures::stream::iter([Bytes::from(before)])
        .chain(pieces)
        .chain(futures::stream::iter([Bytes::from(after)]))
        .boxed()
}

/// A JSON object's text without its closing brace, to write more fields
/// after it.
pub(super) fn open(object: &Value) -> Vec<u8> {
    let mut text = serde_json::to_vec(object).expect("a JSON value serializes");
    text.pop();
    text
}

/// The head every chunk and answer of one completion shares.
pub(super) struct Head {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Head {
    pub fn new(model: &str) -> Self {
        Head {
            id: unique_id("chatcmpl-"),
            created: now(),
            model: model.to_owned(),
        }
    }

    /// A whole answer as the body of a JSON response, its text as
    /// delivered through the token transforms. A text longer than
    /// [`TEXT_PIECE`] is written as the body is sent, a piece at a time:
    /// escaped at once it could take six times its size (every control
    /// character is six bytes in JSON).
    pub fn completion(&self, mut response: ChatResponse, delivered: Option<String>) -> Body {
        response.message.content = None;
        let mut message = serde_json::to_value(wire_message(&response.message))
            .expect("a message serializes as JSON");
        if let Some(fields) = message.as_object_mut() {
            fields.remove("content");
        }
        let head = json!({
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "usage": wire_usage(&response.usage),
        });
        let finish = json!(wire_finish(response.finish_reason));
        // `{<head>,"choices":[{...,"message":{<message>,"content":` TEXT `}}]}`
        let mut prefix = open(&head);
        prefix.extend_from_slice(br#","choices":[{"index":0,"logprobs":null,"finish_reason":"#);
        prefix.extend_from_slice(finish.to_string().as_bytes());
        prefix.extend_from_slice(br#","message":"#);
        prefix.extend(open(&message));
        if message.as_object().is_some_and(|fields| !fields.is_empty()) {
            prefix.push(b',');
        }
        prefix.extend_from_slice(br#""content":"#);
        spliced(prefix, delivered, b"}}]}".to_vec())
    }
}

/// OpenAI's chat completions as a [`Dialect`]: a `chat.completion`, or
/// `chat.completion.chunk`s ending with `[DONE]`.
pub(super) struct Completions {
    pub head: Head,
    /// Whether a stream ends with a usage chunk.
    pub include_usage: bool,
}

impl Dialect for Completions {
    fn whole(&mut self, response: ChatResponse, shown: Option<String>) -> Body {
        self.head.completion(response, shown)
    }

    fn opening(&mut self) -> Vec<Frame> {
        vec![Frame::data(self.head.chunk(Delta::opening(), None))]
    }

    fn text(&mut self, piece: &str) -> Vec<Frame> {
        vec![Frame::data(self.head.chunk(Delta::text(piece), None))]
    }

    fn end(&mut self, response: &ChatResponse) -> Vec<Frame> {
        let mut events = Vec::new();
        let calls = &response.message.tool_calls;
        if !calls.is_empty() {
            events.push(Frame::data(self.head.chunk(Delta::tool_calls(calls), None)));
        }
        let reason = wire_finish(response.finish_reason);
        events.push(Frame::data(self.head.chunk(Delta::default(), Some(reason))));
        if self.include_usage {
            events.push(Frame::data(self.head.usage(&response.usage)));
        }
        events
    }

    fn broken(&mut self, error: &ApiError) -> Vec<Frame> {
        vec![Frame::data(error.body().to_string())]
    }

    fn closing(&self) -> Option<Frame> {
        Some(Frame::data("[DONE]"))
    }
}

/// An error as the gateway's clients read it, with the HTTP status for
/// it; each API says it in its own shape (OpenAI's here, [`ApiError::body`]).
pub(super) struct ApiError {
    pub status: StatusCode,
    /// OpenAI's `type` (`invalid_request_error`, `rate_limit_error`, ...).
    pub kind: String,
    /// OpenAI's `code`, where there is one (`model_not_found`, ...).
    pub code: Option<String>,
    pub message: String,
    /// Worth retrying soon (`Retry-After: 1`): the gateway or the engine was
    /// busy, not the request wrong or over a quota.
    pub retry: bool,
}

impl ApiError {
    /// An error the gateway itself raises (bad request, unknown model, ...).
    pub fn new(status: StatusCode, kind: &str, code: Option<&str>, message: String) -> Self {
        ApiError {
            status,
            kind: kind.to_owned(),
            code: code.map(str::to_owned),
            message,
            retry: false,
        }
    }

    /// The error in OpenAI's shape.
    pub fn body(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": null, "code": self.code } })
    }

    /// The same, worth retrying soon.
    pub fn busy(status: StatusCode, code: &str, message: String) -> Self {
        let kind = if status == StatusCode::TOO_MANY_REQUESTS {
            "rate_limit_error"
        } else {
            "server_error"
        };
        ApiError {
            retry: true,
            ..Self::new(status, kind, Some(code), message)
        }
    }

    /// A bad request body.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            message.into(),
        )
    }

    /// A failure of the chain, its status by its kind (a store's failure
    /// by its cause: `503` `store_unavailable`): the message names
    /// the filter (by name, never its plugin file) or terminal it came
    /// from. The model server refusing the
    /// gateway's own credentials is the gateway's problem, not the
    /// client's: a `502` that does not repeat the server's words (they can
    /// quote the key).
    pub fn chain(error: &ChainError) -> Self {
        let upstream = error
            .origin
            .as_ref()
            .is_none_or(|origin| origin.call == Call::Terminal);
        if error.kind == ErrorKind::Auth && upstream {
            // Not the server's words: they can quote the key.
            tracing::warn!(
                "the model server refused the gateway's credentials (its answer is not logged): check the upstream's api_key"
            );
            return Self::new(
                StatusCode::BAD_GATEWAY,
                "server_error",
                Some("upstream_auth"),
                "the model server refused the gateway's credentials".to_owned(),
            );
        }
        if error.cause == Some(Cause::StoreUnavailable) {
            // The store, not the model server: alerts on `upstream` must
            // not blame the provider for it.
            tracing::warn!("{error}");
            let message = error.public();
            return Self::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                message,
            );
        }
        let (status, kind, code) = match error.kind {
            ErrorKind::InvalidRequest => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            ErrorKind::ContentFiltered => (
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some("content_filter"),
            ),
            ErrorKind::Auth => (StatusCode::UNAUTHORIZED, "authentication_error", None),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", None),
            ErrorKind::LimitExceeded => (
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("limit_exceeded"),
            ),
            ErrorKind::Overloaded => {
                let message = error.public();
                return Self::busy(StatusCode::SERVICE_UNAVAILABLE, "overloaded", message);
            }
            ErrorKind::Transient => (StatusCode::BAD_GATEWAY, "server_error", Some("upstream")),
            ErrorKind::Timeout => (StatusCode::GATEWAY_TIMEOUT, "server_error", Some("timeout")),
            ErrorKind::PluginFault => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                Some("plugin_fault"),
            ),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        // The client is told the filter by name; the plugin file, what it
        // wrote and where it trapped go to the log.
        if status.is_server_error() {
            tracing::warn!("{error}");
        } else {
            tracing::debug!("{error}");
        }
        Self::new(status, kind, code, error.public())
    }
}
