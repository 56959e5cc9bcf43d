//! A client for any server that speaks the OpenAI chat-completions protocol
//! (OpenAI, vLLM, Ollama, llama.cpp server, ...): JSON and SSE streaming,
//! tool calls (arguments arriving in pieces across chunks), the usage chunk,
//! finish reasons, and errors classified so a caller can act on them.
//!
//! Retryable failures (429, 5xx, timeouts, dropped connections) are retried
//! before any byte of the answer arrived, honouring `Retry-After`; once a
//! stream has started, a break is an error: tokens already delivered cannot
//! be taken back, and the token chain does not flush what it held.
//!
//! `wire` is the protocol's JSON (requests, answers, chunks) in our terms;
//! `assembly` puts a streamed answer together chunk by chunk.

mod assembly;
pub(crate) mod wire;

use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use self::assembly::Assembly;
use self::wire::{Chunk, Completion, answer, finish, wire_message, wire_tool};
use super::{ChatModel, ModelEvent};
use crate::context::Context;
use crate::types::{ChainError, ErrorKind};
use crate::types::{ChatRequest, ChatResponse, ToolCall, Usage};

/// How to reach an OpenAI-compatible server.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenAiConfig {
    /// The API base, e.g. `https://api.openai.com/v1` or `http://localhost:11434/v1`.
    pub base_url: String,
    /// The model to ask for (a request's `model` option overrides it).
    pub model: String,
    /// The bearer token, if the server wants one.
    #[serde(default)]
    pub api_key: Option<String>,
    /// Bound on a whole answer, and on the silence between two stream chunks.
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// Retries of a retryable failure before the answer starts.
    #[serde(default = "default_retries")]
    pub max_retries: u32,
}

fn default_timeout_ms() -> u64 {
    120_000
}

fn default_retries() -> u32 {
    2
}

/// The longest a `Retry-After` (or backoff) wait may be.
const MAX_WAIT: Duration = Duration::from_secs(30);

impl OpenAiConfig {
    /// A config for `base_url` and `model`, with the default timeout and retries.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        OpenAiConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            timeout_ms: default_timeout_ms(),
            max_retries: default_retries(),
        }
    }

    /// The model `SHALLOT_MODEL` names, else `gpt-4o-mini`.
    pub fn default_model() -> String {
        std::env::var("SHALLOT_MODEL").unwrap_or_else(|_| "gpt-4o-mini".to_owned())
    }

    /// From `OPENAI_BASE_URL` (default `https://api.openai.com/v1`),
    /// `OPENAI_API_KEY` and `SHALLOT_MODEL` (default `gpt-4o-mini`); `None`
    /// when neither the URL nor the key is set.
    pub fn from_env() -> Option<Self> {
        let base_url = std::env::var("OPENAI_BASE_URL").ok();
        let api_key = std::env::var("OPENAI_API_KEY").ok();
        if base_url.is_none() && api_key.is_none() {
            return None;
        }
        let base_url = base_url.unwrap_or_else(|| "https://api.openai.com/v1".to_owned());
        let model = Self::default_model();
        Some(OpenAiConfig {
            api_key,
            ..Self::new(base_url, model)
        })
    }
}

/// A chat model behind an OpenAI-compatible endpoint.
pub struct OpenAiModel {
    config: OpenAiConfig,
    client: reqwest::Client,
}

impl OpenAiModel {
    /// A client for `config`.
    pub fn new(config: OpenAiConfig) -> Result<Self, ChainError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .read_timeout(Duration::from_millis(config.timeout_ms))
            .build()
            .map_err(|e| {
                ChainError::new(
                    ErrorKind::Internal,
                    format!("cannot build the HTTP client: {e}"),
                )
            })?;
        Ok(OpenAiModel { config, client })
    }

    fn body(&self, request: &ChatRequest, stream: bool) -> Value {
        let mut body = json!({
            "model": self.config.model,
            "messages": request.messages.iter().map(wire_message).collect::<Vec<_>>(),
        });
        if !request.tools.is_empty() {
            let tools: Vec<Value> = request.tools.iter().map(wire_tool).collect();
            body["tools"] = Value::Array(tools);
        }
        for (key, value) in request.options.iter() {
            body[key] = value.clone();
        }
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({ "include_usage": true });
        }
        body
    }

    /// Sends `body`, retrying retryable failures.
    async fn send(&self, body: &Value, whole: bool) -> Result<reqwest::Response, ChainError> {
        let url = format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        );
        let mut attempt = 0;
        loop {
            let mut post = self.client.post(&url).json(body);
            if whole {
                post = post.timeout(Duration::from_millis(self.config.timeout_ms));
            }
            if let Some(key) = &self.config.api_key {
                post = post.bearer_auth(key);
            }
            let (error, retry_after) = match post.send().await {
                Ok(response) if response.status().is_success() => return Ok(response),
                Ok(response) => status_error(response).await,
                Err(e) => (transport_error(e), None),
            };
            let retryable = matches!(error.kind, ErrorKind::Transient | ErrorKind::Timeout);
            if !retryable || attempt >= self.config.max_retries {
                return Err(error);
            }
            let backoff = Duration::from_millis(250 << attempt.min(6));
            let wait = retry_after.unwrap_or(backoff).min(MAX_WAIT);
            tracing::warn!(
                attempt = attempt + 1,
                wait_ms = wait.as_millis() as u64,
                "the model server failed ({error}); retrying"
            );
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }
}

/// A failed HTTP status as a typed error, with the server's message and its
/// `Retry-After`.
async fn status_error(response: reqwest::Response) -> (ChainError, Option<Duration>) {
    let status = response.status().as_u16();
    let retry_after = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<f64>().ok())
        .and_then(|seconds| Duration::try_from_secs_f64(seconds).ok());
    let text = response.text().await.unwrap_or_default();
    let said = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .map(str::to_owned)
        })
        .unwrap_or(text);
    let kind = match status {
        429 | 500..=599 => ErrorKind::Transient,
        401 | 403 => ErrorKind::Auth,
        404 => ErrorKind::NotFound,
        _ => ErrorKind::InvalidRequest,
    };
    (
        ChainError::new(
            kind,
            format!("the model server answered {status}: {}", said.trim()),
        ),
        retry_after,
    )
}

fn transport_error(error: reqwest::Error) -> ChainError {
    // Without the URL: it may carry credentials (`user:pass@`, `?api-key=`)
    // and the error may reach a gateway's clients.
    let error = error.without_url();
    if error.is_timeout() {
        ChainError::new(
            ErrorKind::Timeout,
            format!("the model server did not answer in time: {error}"),
        )
    } else if error.is_builder() {
        ChainError::new(
            ErrorKind::InvalidRequest,
            format!("bad model request: {error}"),
        )
    } else {
        ChainError::new(
            ErrorKind::Transient,
            format!("cannot reach the model server: {error}"),
        )
    }
}

#[async_trait]
impl ChatModel for OpenAiModel {
    fn name(&self) -> &str {
        &self.config.model
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        _context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let response = self.send(&self.body(request, false), true).await?;
        let completion: Completion = response.json().await.map_err(|e| {
            ChainError::new(
                ErrorKind::Transient,
                format!("the model server sent an unreadable answer: {e}"),
            )
        })?;
        let choice = completion.choices.into_iter().next().ok_or_else(|| {
            ChainError::new(
                ErrorKind::Transient,
                "the model server sent an answer with no choices",
            )
        })?;
        let calls: Vec<ToolCall> = choice
            .message
            .tool_calls
            .into_iter()
            .map(|c| ToolCall {
                id: c.id,
                name: c.function.name,
                arguments: c.function.arguments,
            })
            .collect();
        let reason = finish(choice.finish_reason.as_deref(), !calls.is_empty());
        let usage = completion.usage.map(Usage::from).unwrap_or_default();
        Ok(answer(
            choice.message.content,
            calls,
            reason,
            usage,
            completion.model,
        ))
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        _context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let response = self.send(&self.body(request, true), false).await?;
        let events = response.bytes_stream().eventsource().boxed();
        let state = (events, Some(Assembly::default()));
        let stream = stream::unfold(state, |(mut events, mut assembly)| async move {
            loop {
                let building = assembly.as_mut()?;
                let event = match events.next().await {
                    Some(Ok(event)) => event,
                    Some(Err(EventStreamError::Transport(e))) if e.is_timeout() => {
                        let error = ChainError::new(
                            ErrorKind::Timeout,
                            format!("the model stream fell silent: {e}"),
                        );
                        return Some((Err(error), (events, None)));
                    }
                    Some(Err(e)) => {
                        let error = ChainError::new(
                            ErrorKind::Transient,
                            format!("the model stream broke: {e}"),
                        );
                        return Some((Err(error), (events, None)));
                    }
                    // Some servers close without `[DONE]` after the finish reason.
                    None if building.has_finished() => {
                        let done = assembly.take()?.finish();
                        return Some((Ok(ModelEvent::Done(done)), (events, None)));
                    }
                    None => {
                        let error = ChainError::new(
                            ErrorKind::Transient,
                            "the model stream ended before the answer did",
                        );
                        return Some((Err(error), (events, None)));
                    }
                };
                if event.data.trim() == "[DONE]" {
                    let done = assembly.take()?.finish();
                    return Some((Ok(ModelEvent::Done(done)), (events, None)));
                }
                let chunk: Chunk = match serde_json::from_str(&event.data) {
                    Ok(chunk) => chunk,
                    Err(e) => {
                        let error = ChainError::new(
                            ErrorKind::Transient,
                            format!("the model stream sent an unreadable chunk: {e}"),
                        );
                        return Some((Err(error), (events, None)));
                    }
                };
                if let Some(error) = &chunk.error {
                    let said = error["message"].as_str().or_else(|| error.as_str());
                    let error = ChainError::new(
                        ErrorKind::Transient,
                        format!(
                            "the model server broke off the stream with an error: {}",
                            said.unwrap_or("(no message)")
                        ),
                    );
                    return Some((Err(error), (events, None)));
                }
                let text = match building.add(chunk) {
                    Ok(text) => text,
                    Err(error) => return Some((Err(error), (events, None))),
                };
                if let Some(text) = text {
                    return Some((
                        Ok(ModelEvent::Token { text, meta: None }),
                        (events, assembly),
                    ));
                }
            }
        });
        Ok(stream.boxed())
    }
}
