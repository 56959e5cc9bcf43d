//! A client for any server that speaks the OpenAI chat-completions protocol
//! (OpenAI, vLLM, Ollama, llama.cpp server, ...): JSON and SSE streaming,
//! tool calls (arguments arriving in pieces across chunks), the usage chunk,
//! finish reasons, and errors classified so a caller can act on them.
//!
//! Retryable failures (429, 5xx, timeouts, dropped connections) are retried
//! before any byte of the answer arrived, honouring `Retry-After`; once a
//! stream has started, a break is an error: tokens already delivered cannot
//! be taken back, and the token chain does not flush what it held.

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use super::{ChatModel, ModelEvent, ResponseLimits};
use crate::context::Context;
use crate::error::{ChainError, ErrorKind};
use crate::types::{
    ChatRequest, ChatResponse, Content, ContentPart, FinishReason, Message, Role, ToolCall, Usage,
};

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
            let tools: Vec<Value> = request
                .tools
                .iter()
                .map(|t| json!({ "type": "function", "function": { "name": t.name, "description": t.description, "parameters": t.parameters } }))
                .collect();
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
                Err(e) => (transport_error(&e), None),
            };
            let retryable = matches!(error.kind, ErrorKind::Transient | ErrorKind::Timeout);
            if !retryable || attempt >= self.config.max_retries {
                return Err(error);
            }
            let backoff = Duration::from_millis(250 << attempt.min(6));
            tokio::time::sleep(retry_after.unwrap_or(backoff).min(MAX_WAIT)).await;
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
        .map(Duration::from_secs_f64);
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

fn transport_error(error: &reqwest::Error) -> ChainError {
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

fn wire_message(m: &Message) -> Value {
    let role = match m.role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let content = match &m.content {
        None => Value::Null,
        Some(Content::Text(text)) => json!(text),
        Some(Content::Parts(parts)) => Value::Array(
            parts
                .iter()
                .map(|part| match part {
                    ContentPart::Text { text } => json!({ "type": "text", "text": text }),
                    ContentPart::Image { url, detail } => {
                        let mut image = json!({ "url": url });
                        if let Some(detail) = detail {
                            image["detail"] = json!(detail);
                        }
                        json!({ "type": "image_url", "image_url": image })
                    }
                })
                .collect(),
        ),
    };
    let mut wire = json!({ "role": role, "content": content });
    if !m.tool_calls.is_empty() {
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(|c| json!({ "id": c.id, "type": "function", "function": { "name": c.name, "arguments": c.arguments } }))
            .collect();
        wire["tool_calls"] = Value::Array(calls);
    }
    if let Some(id) = &m.tool_call_id {
        wire["tool_call_id"] = json!(id);
    }
    wire
}

/// The finish reason a provider reported, in our terms.
fn finish(reason: Option<&str>, calls: bool) -> FinishReason {
    match reason {
        Some("stop") => FinishReason::Complete,
        Some("tool_calls" | "function_call") => FinishReason::ToolUse,
        Some("length") => FinishReason::LengthLimit,
        Some("content_filter") => FinishReason::ContentFiltered,
        _ if calls => FinishReason::ToolUse,
        _ => FinishReason::Unknown,
    }
}

#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u32,
    #[serde(default)]
    completion_tokens: u32,
    #[serde(default)]
    total_tokens: u32,
}

impl From<WireUsage> for Usage {
    fn from(u: WireUsage) -> Self {
        Usage {
            input_tokens: u.prompt_tokens,
            output_tokens: u.completion_tokens,
            total_tokens: u.total_tokens,
        }
    }
}

#[derive(Deserialize)]
struct Completion {
    #[serde(default)]
    model: String,
    choices: Vec<Choice>,
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct Choice {
    message: WireAnswer,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireAnswer {
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireCall>,
}

#[derive(Deserialize)]
struct WireCall {
    id: String,
    function: WireFunction,
}

#[derive(Deserialize)]
struct WireFunction {
    name: String,
    #[serde(default)]
    arguments: String,
}

#[derive(Deserialize)]
struct Chunk {
    #[serde(default)]
    model: String,
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Delta,
    finish_reason: Option<String>,
}

#[derive(Deserialize, Default)]
struct Delta {
    content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<DeltaCall>,
}

#[derive(Deserialize)]
struct DeltaCall {
    #[serde(default)]
    index: usize,
    id: Option<String>,
    function: Option<DeltaFunction>,
}

#[derive(Deserialize)]
struct DeltaFunction {
    name: Option<String>,
    arguments: Option<String>,
}

fn answer(
    text: Option<String>,
    calls: Vec<ToolCall>,
    reason: FinishReason,
    usage: Usage,
    model: String,
) -> ChatResponse {
    let content = text.filter(|t| !t.is_empty()).map(Content::Text);
    let message = Message {
        role: Role::Assistant,
        content,
        tool_calls: calls,
        tool_call_id: None,
    };
    let mut response = ChatResponse::new(message, reason);
    response.usage = usage;
    response.model = model;
    response
}

/// A streamed answer as it is put together, chunk by chunk.
#[derive(Default)]
struct Assembly {
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
    fn add(&mut self, chunk: Chunk) -> Result<Option<String>, ChainError> {
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

    fn finish(self) -> ChatResponse {
        let calls: Vec<ToolCall> = self.calls.into_values().collect();
        let reason = finish(self.reason.as_deref(), !calls.is_empty());
        answer(Some(self.text), calls, reason, self.usage, self.model)
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
                    None if building.reason.is_some() => {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reasons_map_to_ours() {
        assert_eq!(finish(Some("stop"), false), FinishReason::Complete);
        assert_eq!(finish(Some("tool_calls"), true), FinishReason::ToolUse);
        assert_eq!(finish(Some("length"), false), FinishReason::LengthLimit);
        assert_eq!(
            finish(Some("content_filter"), false),
            FinishReason::ContentFiltered
        );
        assert_eq!(finish(None, true), FinishReason::ToolUse);
        assert_eq!(finish(Some("weird"), false), FinishReason::Unknown);
    }

    #[test]
    fn messages_go_out_in_the_wire_format() {
        let call = ToolCall {
            id: "c1".into(),
            name: "add".into(),
            arguments: r#"{"a":1}"#.into(),
        };
        let asked = Message {
            role: Role::Assistant,
            content: None,
            tool_calls: vec![call],
            tool_call_id: None,
        };
        assert_eq!(
            wire_message(&asked),
            json!({ "role": "assistant", "content": null, "tool_calls": [{ "id": "c1", "type": "function", "function": { "name": "add", "arguments": "{\"a\":1}" } }] })
        );
        assert_eq!(
            wire_message(&Message::tool_result("c1", "2")),
            json!({ "role": "tool", "content": "2", "tool_call_id": "c1" })
        );
    }
}
