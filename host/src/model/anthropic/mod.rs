//! A client for Anthropic's Messages API as a model upstream (Anthropic
//! itself, or any server that speaks it): the chat chain's request
//! translated to a Messages request and the answer back, JSON and
//! streamed (text deltas as tokens, `tool_use` blocks as tool calls, their
//! `input_json_delta` pieces put together), errors typed as the OpenAI
//! client's are, and the same retries before the answer starts.
//!
//! `wire` is the translation both ways.

mod wire;

use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::Value;

use super::body::{self, Refused};
use super::failure::{endpoint, http_client, send_retrying};
use super::openai::wire::answer;
use super::{ChatModel, ModelEvent};
use crate::context::HOPS_HEADER;
use crate::context::{Context, HOPS};
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
pub struct AnthropicModel {
    config: AnthropicConfig,
    client: reqwest::Client,
    url: reqwest::Url,
}

impl AnthropicModel {
    /// A client for `config`; `invalid-request` if its `base_url` makes no
    /// URL.
    pub fn new(config: AnthropicConfig) -> Result<Self, ChainError> {
        let client = http_client(config.timeout_ms)?;
        Ok(AnthropicModel {
            url: endpoint(&config.base_url, "messages")?,
            config,
            client,
        })
    }

    async fn send(
        &self,
        request: &ChatRequest,
        stream: bool,
        context: &Context,
    ) -> Result<reqwest::Response, ChainError> {
        let config = &self.config;
        let body = wire::body(request, &config.model, config.max_tokens, stream);
        let hops = context.get(HOPS).and_then(|h| h.as_u64()).unwrap_or(0) + 1;
        send_retrying(config.max_retries, context, || {
            let mut post = self
                .client
                .post(self.url.clone())
                .header(HOPS_HEADER, hops)
                .header("anthropic-version", VERSION)
                .json(&body);
            if !stream {
                post = post.timeout(Duration::from_millis(config.timeout_ms));
            }
            if let Some(key) = &config.api_key {
                post = post.header("x-api-key", key);
            }
            post
        })
        .await
    }
}

#[async_trait]
impl ChatModel for AnthropicModel {
    fn name(&self) -> &str {
        &self.config.model
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let response = self.send(request, false, context).await?;
        wire::message(&body::read(response, body::answer_cap()).await?)
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let response = self.send(request, true, context).await?;
        let bytes = body::checked(response.bytes_stream(), body::line_cap());
        let events = bytes.eventsource().boxed();
        let state = (events, Some(Assembly::default()));
        let stream = stream::unfold(state, |(mut events, mut assembly)| async move {
            loop {
                let building = assembly.as_mut()?;
                match building.step(events.next().await) {
                    Ok(Step::Skip) => continue,
                    Ok(Step::Token(text)) => {
                        let token = ModelEvent::Token { text, meta: None };
                        return Some((Ok(token), (events, assembly)));
                    }
                    Ok(Step::Done) => {
                        let done = std::mem::take(building).finish();
                        return Some((Ok(ModelEvent::Done(done)), (events, None)));
                    }
                    Err(error) => return Some((Err(error), (events, None))),
                }
            }
        });
        Ok(stream.boxed())
    }
}

/// What one event makes of the answer being assembled.
enum Step {
    Skip,
    Token(String),
    Done,
}

/// A streamed answer, put together event by event.
#[derive(Default)]
struct Assembly {
    model: String,
    text: String,
    calls: Vec<ToolCall>,
    /// The content block each call was started in.
    call_blocks: Vec<u64>,
    stop_reason: Option<String>,
    usage: Usage,
}

type StreamEvent = Result<eventsource_stream::Event, EventStreamError<Refused>>;

/// The event that arrived, or the error for a stream that broke or ended
/// before the answer did.
fn arrived(event: Option<StreamEvent>) -> Result<eventsource_stream::Event, ChainError> {
    match event {
        Some(Ok(event)) => Ok(event),
        Some(Err(EventStreamError::Transport(Refused::Transport(e)))) if e.is_timeout() => {
            let message = format!("the model stream fell silent: {e}");
            Err(ChainError::new(ErrorKind::Timeout, message))
        }
        Some(Err(EventStreamError::Transport(e @ Refused::LineTooLong(_)))) => {
            Err(ChainError::new(ErrorKind::LimitExceeded, e.to_string()))
        }
        Some(Err(e)) => {
            let message = format!("the model stream broke: {e}");
            Err(ChainError::new(ErrorKind::Transient, message))
        }
        None => {
            let message = "the model stream ended before the answer did";
            Err(ChainError::new(ErrorKind::Transient, message))
        }
    }
}

impl Assembly {
    fn step(&mut self, event: Option<StreamEvent>) -> Result<Step, ChainError> {
        let event = arrived(event)?;
        if event.data.trim().is_empty() {
            return Ok(Step::Skip);
        }
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
                self.calls.push(ToolCall {
                    id: block["id"].as_str().unwrap_or_default().to_owned(),
                    name: block["name"].as_str().unwrap_or_default().to_owned(),
                    arguments: String::new(),
                });
                self.call_blocks.push(index);
            }
            "content_block_start" if data["content_block"]["type"] == "text" => {
                return Ok(self.text(data["content_block"]["text"].as_str()));
            }
            "content_block_delta" => {
                let delta = &data["delta"];
                match delta["type"].as_str() {
                    Some("text_delta") => return Ok(self.text(delta["text"].as_str())),
                    Some("input_json_delta") => {
                        let at = self.call_blocks.iter().position(|b| *b == index);
                        let call = at.and_then(|at| self.calls.get_mut(at)).ok_or_else(|| {
                            wire::unreadable("a tool input delta for no tool_use block".to_owned())
                        })?;
                        call.arguments
                            .push_str(delta["partial_json"].as_str().unwrap_or_default());
                    }
                    _ => {}
                }
            }
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

    fn text(&mut self, text: Option<&str>) -> Step {
        match text {
            Some(text) if !text.is_empty() => {
                self.text.push_str(text);
                Step::Token(text.to_owned())
            }
            _ => Step::Skip,
        }
    }

    fn finish(self) -> ChatResponse {
        let reason = wire::finish(self.stop_reason.as_deref());
        answer(Some(self.text), self.calls, reason, self.usage, self.model)
    }
}
