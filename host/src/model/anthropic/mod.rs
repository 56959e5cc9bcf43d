//! A client for Anthropic's Messages API as a model upstream (Anthropic
//! itself, or any server that speaks it): the chat chain's request
//! translated to a Messages request and the answer back, JSON and
//! streamed (text deltas as tokens, `tool_use` blocks as tool calls, their
//! `input_json_delta` pieces put together), errors typed as the OpenAI
//! client's are, and the same retries before the answer starts: the model
//! module's one HTTP client shape (`http`) over this protocol.
//!
//! `wire` is the translation both ways.

mod wire;
mod written;

use bytes::Bytes;
use eventsource_stream::Event;
use serde::Deserialize;
use serde_json::Value;

use super::ResponseLimits;
use super::http::{self, HttpModel, Protocol, Reach, Step};
use super::openai::wire::answer;
use crate::types::{ChainError, ChatRequest, ChatResponse, ErrorKind, ToolCall, Usage};

/// How to reach a server of Anthropic's Messages API.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AnthropicConfig {
    /// The API base, e.g. `https://api.anthropic.com/v1` (requests go to
    /// `<base_url>/messages`).
    pub base_url: String,
    /// The model to ask for (a request's `model` option overrides it).
    pub model: String,
    /// The key (`x-api-key`); without one, `ANTHROPIC_API_KEY`.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Bound on a whole answer, and on the silence between two events.
    #[serde(default = "super::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Retries of a retryable failure before the answer starts.
    #[serde(default = "super::default_retries")]
    pub max_retries: u32,
    /// `max_tokens` for a request that sets none (Anthropic requires one).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
}

fn default_max_tokens() -> u64 {
    4096
}

/// The API version every request names.
const VERSION: &str = "2023-06-01";

impl AnthropicConfig {
    /// A config for `base_url` and `model`, with the defaults.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        AnthropicConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            timeout_ms: super::default_timeout_ms(),
            max_retries: super::default_retries(),
            max_tokens: default_max_tokens(),
        }
    }

    /// The same, its missing `api_key` taken from `ANTHROPIC_API_KEY`.
    pub fn or_env_key(mut self) -> Self {
        if self.api_key.is_none() {
            self.api_key = std::env::var("ANTHROPIC_API_KEY").ok();
        }
        self
    }
}

/// A chat model behind Anthropic's Messages API.
pub type AnthropicModel = HttpModel<Anthropic>;

impl AnthropicModel {
    /// A client for `config`; `invalid-request` if its `base_url` makes no
    /// URL.
    pub fn new(config: AnthropicConfig) -> Result<Self, ChainError> {
        let protocol = Anthropic {
            max_tokens: config.max_tokens,
        };
        let reach = Reach {
            base_url: &config.base_url,
            model: &config.model,
            api_key: config.api_key.as_deref(),
            timeout_ms: config.timeout_ms,
            max_retries: config.max_retries,
        };
        HttpModel::open(protocol, reach)
    }
}

/// Anthropic's Messages, as a [`Protocol`].
pub struct Anthropic {
    /// `max_tokens` for a request that sets none.
    max_tokens: u64,
}

impl Protocol for Anthropic {
    type Assembly = Assembly;
    const CHAT: &'static str = "messages";
    const EMBEDDINGS: Option<&'static str> = None;

    fn body(&self, request: &ChatRequest, model: &str, stream: bool) -> Bytes {
        http::json_bytes(&wire::outgoing(request, model, self.max_tokens, stream))
    }

    fn authorized(
        &self,
        post: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let post = post.header("anthropic-version", VERSION);
        match key {
            Some(key) => post.header("x-api-key", key),
            None => post,
        }
    }

    fn answer(&self, body: &[u8]) -> Result<ChatResponse, ChainError> {
        wire::message(body)
    }
}

/// A streamed answer, put together event by event, bounded by the
/// default [`ResponseLimits`] as it grows.
#[derive(Default)]
pub struct Assembly {
    model: String,
    text: String,
    calls: Vec<ToolCall>,
    /// The content block each call was started in.
    call_blocks: Vec<u64>,
    /// Bytes of text and tool calls so far.
    bytes: usize,
    stop_reason: Option<String>,
    usage: Usage,
}

impl http::Assembly for Assembly {
    fn event(&mut self, event: &Event) -> Result<Step, ChainError> {
        let data: Value = serde_json::from_str(&event.data)
            .map_err(|e| wire::unreadable(format!("an event that is not JSON: {e}")))?;
        let index = data["index"].as_u64().unwrap_or_default();
        match data["type"].as_str().unwrap_or(event.event.as_str()) {
            "message_start" => {
                let message = &data["message"];
                self.model = message["model"].as_str().unwrap_or_default().to_owned();
                wire::usage(&message["usage"], &mut self.usage);
            }
            "content_block_start" if data["content_block"]["type"] == "tool_use" => {
                let block = &data["content_block"];
                let call = ToolCall {
                    id: block["id"].as_str().unwrap_or_default().to_owned(),
                    name: block["name"].as_str().unwrap_or_default().to_owned(),
                    arguments: String::new(),
                };
                let bytes = call.id.len() + call.name.len();
                self.calls.push(call);
                self.call_blocks.push(index);
                self.grow(bytes)?;
            }
            "content_block_start" if data["content_block"]["type"] == "text" => {
                return self.text(data["content_block"]["text"].as_str());
            }
            "content_block_delta" => return self.delta(index, &data["delta"]),
            "message_delta" => {
                if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                    self.stop_reason = Some(reason.to_owned());
                }
                wire::usage(&data["usage"], &mut self.usage);
            }
            "message_stop" => return Ok(Step::Done),
            "error" => {
                let said = data["error"]["message"].as_str().unwrap_or("(no message)");
                let message =
                    format!("the model server broke off the stream with an error: {said}");
                return Err(ChainError::new(ErrorKind::Transient, message));
            }
            _ => {}
        }
        Ok(Step::Skip)
    }

    fn finish(self) -> ChatResponse {
        let reason = wire::finish(self.stop_reason.as_deref());
        answer(Some(self.text), self.calls, reason, self.usage, self.model)
    }
}

impl Assembly {
    /// A content block's delta: text, or a piece of a tool call's input.
    fn delta(&mut self, index: u64, delta: &Value) -> Result<Step, ChainError> {
        match delta["type"].as_str() {
            Some("text_delta") => self.text(delta["text"].as_str()),
            Some("input_json_delta") => {
                let piece = delta["partial_json"].as_str().unwrap_or_default();
                self.grow(piece.len())?;
                let at = self.call_blocks.iter().position(|b| *b == index);
                let call = at.and_then(|at| self.calls.get_mut(at)).ok_or_else(|| {
                    wire::unreadable("a tool input delta for no tool_use block".to_owned())
                })?;
                call.arguments.push_str(piece);
                Ok(Step::Skip)
            }
            _ => Ok(Step::Skip),
        }
    }

    fn text(&mut self, text: Option<&str>) -> Result<Step, ChainError> {
        match text {
            Some(text) if !text.is_empty() => {
                self.grow(text.len())?;
                self.text.push_str(text);
                Ok(Step::Token(text.to_owned()))
            }
            _ => Ok(Step::Skip),
        }
    }

    /// Counts `bytes` more of the answer; fails once it goes past the
    /// default [`ResponseLimits`].
    fn grow(&mut self, bytes: usize) -> Result<(), ChainError> {
        self.bytes += bytes;
        ResponseLimits::default().check(self.calls.len(), self.bytes)
    }
}
