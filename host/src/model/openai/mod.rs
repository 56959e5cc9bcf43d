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
//! `assembly` puts a streamed answer together chunk by chunk; the model
//! module's `body` reads the server's bytes under caps, and its `failure`
//! types the server's failures.

mod assembly;
pub(crate) mod wire;

use std::time::Duration;

use async_trait::async_trait;
use eventsource_stream::{EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};
use serde::Deserialize;
use serde_json::{Value, json};

use self::assembly::Assembly;
use self::wire::{Chunk, Completion, answer, finish, refused, wire_message, wire_tool};
use super::body::{self, Refused};
use super::failure::{endpoint, http_client, send_retrying};
use super::{ChatModel, ModelEvent};
use crate::context::{Context, HOPS, HOPS_HEADER};
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
    #[serde(default = "super::default_timeout_ms")]
    pub timeout_ms: u64,
    /// Retries of a retryable failure before the answer starts.
    #[serde(default = "super::default_retries")]
    pub max_retries: u32,
}

/// The chat completions endpoint, under the API base.
const CHAT: &str = "chat/completions";
/// The embeddings endpoint, under the API base.
const EMBEDDINGS: &str = "embeddings";

/// Fields of a request's body that the client writes, whatever its
/// options say: the conversation, the tools, whether it streams, and how
/// many answers (one: only the first is read, the others would be paid
/// for).
const FRAMING: [&str; 5] = ["messages", "tools", "stream", "stream_options", "n"];

impl OpenAiConfig {
    /// A config for `base_url` and `model`, with the default timeout and retries.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        OpenAiConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            timeout_ms: super::default_timeout_ms(),
            max_retries: super::default_retries(),
        }
    }

    /// The model `SHALLOT_MODEL` names, else `gpt-4o-mini`.
    pub fn default_model() -> String {
        std::env::var("SHALLOT_MODEL").unwrap_or_else(|_| "gpt-4o-mini".to_owned())
    }

    /// The same, its missing `api_key` taken from `OPENAI_API_KEY`: the
    /// one place the key falls back to the environment.
    pub fn or_env_key(mut self) -> Self {
        if self.api_key.is_none() {
            self.api_key = std::env::var(API_KEY_VAR).ok();
        }
        self
    }

    /// From `OPENAI_BASE_URL` (default `https://api.openai.com/v1`),
    /// `OPENAI_API_KEY` and `SHALLOT_MODEL` (default `gpt-4o-mini`); `None`
    /// when neither the URL nor the key is set.
    pub fn from_env() -> Option<Self> {
        let base_url = std::env::var("OPENAI_BASE_URL").ok();
        let api_key = std::env::var(API_KEY_VAR).ok();
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

/// The environment variable an upstream's key falls back to.
const API_KEY_VAR: &str = "OPENAI_API_KEY";

/// A chat model behind an OpenAI-compatible endpoint.
pub struct OpenAiModel {
    config: OpenAiConfig,
    client: reqwest::Client,
    chat_url: reqwest::Url,
    embeddings_url: reqwest::Url,
}

impl OpenAiModel {
    /// A client for `config`; `invalid-request` if its `base_url` makes no
    /// URL.
    pub fn new(config: OpenAiConfig) -> Result<Self, ChainError> {
        let client = http_client(config.timeout_ms)?;
        Ok(OpenAiModel {
            chat_url: endpoint(&config.base_url, CHAT)?,
            embeddings_url: endpoint(&config.base_url, EMBEDDINGS)?,
            config,
            client,
        })
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
        // Options shape the answer; they never replace what frames the
        // request, nor ask for more answers than the one read.
        for (key, value) in request.options.iter() {
            if !FRAMING.contains(&key.as_str()) {
                body[key] = value.clone();
            }
        }
        if stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({ "include_usage": true });
        }
        body
    }

    /// Sends `body`, retrying retryable failures, one gateway further than
    /// `context`'s request came (`x-shallot-hops`).
    async fn send(
        &self,
        url: &reqwest::Url,
        body: &Value,
        whole: bool,
        context: &Context,
    ) -> Result<reqwest::Response, ChainError> {
        let hops = context.get(HOPS).and_then(|h| h.as_u64()).unwrap_or(0) + 1;
        send_retrying(self.config.max_retries, context, || {
            let post = self.client.post(url.clone());
            let mut post = post.header(HOPS_HEADER, hops).json(body);
            if whole {
                post = post.timeout(Duration::from_millis(self.config.timeout_ms));
            }
            if let Some(key) = &self.config.api_key {
                post = post.bearer_auth(key);
            }
            post
        })
        .await
    }
}

/// A whole answer's body as our response: the first choice, or the error
/// a server sent with a `200`.
fn completed(body: &[u8]) -> Result<ChatResponse, ChainError> {
    let completion: Completion = serde_json::from_slice(body).map_err(|e| {
        ChainError::new(
            ErrorKind::Transient,
            format!("the model server sent an unreadable answer: {e}"),
        )
    })?;
    if let Some(error) = &completion.error {
        let said = error["message"].as_str().or_else(|| error.as_str());
        return Err(ChainError::new(
            ErrorKind::Transient,
            format!(
                "the model server answered with an error: {}",
                body::cut(said.unwrap_or("(no message)"))
            ),
        ));
    }
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
    let (content, refusal) = (choice.message.content, choice.message.refusal);
    let refused_only = content.as_deref().is_none_or(str::is_empty) && refusal.is_some();
    let reason = refused(reason, refused_only);
    let usage = completion.usage.map(Usage::from).unwrap_or_default();
    let text = if refused_only { refusal } else { content };
    Ok(answer(text, calls, reason, usage, completion.model))
}

#[async_trait]
impl ChatModel for OpenAiModel {
    fn name(&self) -> &str {
        &self.config.model
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let response = self
            .send(&self.chat_url, &self.body(request, false), true, context)
            .await?;
        completed(&body::read(response, body::answer_cap()).await?)
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let response = self
            .send(&self.chat_url, &self.body(request, true), false, context)
            .await?;
        let json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
        if json {
            // A server that does not stream (or fails with a 200) answers
            // whole: the answer is one token and the end.
            let answer = completed(&body::read(response, body::answer_cap()).await?)?;
            let text = answer.message.text();
            let token = (!text.is_empty()).then_some(Ok(ModelEvent::Token { text, meta: None }));
            let events = token.into_iter().chain([Ok(ModelEvent::Done(answer))]);
            return Ok(stream::iter(events).boxed());
        }
        let bytes = body::checked(response.bytes_stream(), body::line_cap());
        let events = bytes.eventsource().boxed();
        let state = (events, Some(Assembly::default()));
        let stream = stream::unfold(state, |(mut events, mut assembly)| async move {
            loop {
                let building = assembly.as_mut()?;
                match step(events.next().await, building) {
                    Step::Skip => continue,
                    Step::Token(text) => {
                        let token = ModelEvent::Token { text, meta: None };
                        return Some((Ok(token), (events, assembly)));
                    }
                    Step::Done(done) => return Some((Ok(ModelEvent::Done(done)), (events, None))),
                    Step::Fail(error) => return Some((Err(error), (events, None))),
                }
            }
        });
        Ok(stream.boxed())
    }

    /// Forwards the request to the server's `/embeddings`, asking for
    /// this model, and returns its answer as it is.
    async fn embed(&self, request: &Value, context: &Context) -> Result<Value, ChainError> {
        let mut body = request.clone();
        body["model"] = json!(self.config.model);
        let response = self
            .send(&self.embeddings_url, &body, true, context)
            .await?;
        let answer = body::read(response, body::answer_cap()).await?;
        serde_json::from_slice(&answer).map_err(|e| {
            ChainError::new(
                ErrorKind::Transient,
                format!("the model server's embeddings are not JSON: {e}"),
            )
        })
    }
}

/// What one event of a model stream makes of the answer being assembled.
enum Step {
    /// Nothing to pass on yet (a keep-alive, a chunk without text).
    Skip,
    Token(String),
    /// The answer is whole.
    Done(ChatResponse),
    /// The stream failed; it ends here.
    Fail(ChainError),
}

type StreamEvent = Result<eventsource_stream::Event, EventStreamError<Refused>>;

/// Takes the next event (`None`: the server closed the stream) into the
/// answer being assembled.
fn step(event: Option<StreamEvent>, building: &mut Assembly) -> Step {
    let event = match event {
        Some(Ok(event)) => event,
        Some(Err(e)) => return Step::Fail(broken(e)),
        // Some servers close without `[DONE]` after the finish reason.
        None if building.has_finished() => return Step::Done(std::mem::take(building).finish()),
        None => {
            let message = "the model stream ended before the answer did";
            return Step::Fail(ChainError::new(ErrorKind::Transient, message));
        }
    };
    let data = event.data.trim();
    if data.is_empty() {
        return Step::Skip;
    }
    if data == "[DONE]" {
        return Step::Done(std::mem::take(building).finish());
    }
    let chunk: Chunk = match serde_json::from_str(&event.data) {
        Ok(chunk) => chunk,
        Err(e) => {
            let message = format!("the model stream sent an unreadable chunk: {e}");
            return Step::Fail(ChainError::new(ErrorKind::Transient, message));
        }
    };
    if let Some(error) = &chunk.error {
        let said = error["message"].as_str().or_else(|| error.as_str());
        let message = format!(
            "the model server broke off the stream with an error: {}",
            said.unwrap_or("(no message)")
        );
        return Step::Fail(ChainError::new(ErrorKind::Transient, message));
    }
    match building.add(chunk) {
        Ok(Some(text)) => Step::Token(text),
        Ok(None) => Step::Skip,
        Err(error) => Step::Fail(error),
    }
}

/// The error a broken model stream ends with.
fn broken(error: EventStreamError<Refused>) -> ChainError {
    match error {
        EventStreamError::Transport(Refused::Transport(e)) if e.is_timeout() => ChainError::new(
            ErrorKind::Timeout,
            format!("the model stream fell silent: {e}"),
        ),
        EventStreamError::Transport(e @ Refused::LineTooLong(_)) => {
            ChainError::new(ErrorKind::LimitExceeded, e.to_string())
        }
        e => ChainError::new(ErrorKind::Transient, format!("the model stream broke: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use reqwest::header::{HeaderMap, HeaderValue};

    use super::super::failure::retry_after;

    fn headers(pairs: &[(&'static str, String)]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn a_base_url_that_makes_no_url_is_refused_when_the_client_is_made() {
        let config = super::OpenAiConfig::new("127.0.0.1:8080/v1", "m");
        let Err(error) = super::OpenAiModel::new(config) else {
            panic!("a base_url without a scheme makes no URL");
        };
        assert_eq!(error.kind, crate::types::ErrorKind::InvalidRequest);
        assert!(error.message.contains("base_url"), "{}", error.message);
        let config = super::OpenAiConfig::new("http://127.0.0.1:8080/v1/", "m");
        let model = super::OpenAiModel::new(config).unwrap();
        assert_eq!(
            model.chat_url.as_str(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
    }

    #[test]
    fn retry_after_reads_milliseconds_seconds_and_dates_and_nothing_else() {
        let wait = |pairs: &[(&'static str, String)]| retry_after(&headers(pairs));
        assert_eq!(
            wait(&[
                ("retry-after-ms", "1500".into()),
                ("retry-after", "9".into())
            ]),
            Some(Duration::from_millis(1500)),
            "OpenAI's milliseconds first"
        );
        assert_eq!(
            wait(&[("retry-after", "2.5".into())]),
            Some(Duration::from_millis(2500))
        );
        let soon = SystemTime::now() + Duration::from_secs(120);
        let waited = wait(&[("retry-after", httpdate::fmt_http_date(soon))]).unwrap();
        assert!(
            (Duration::from_secs(110)..=Duration::from_secs(120)).contains(&waited),
            "{waited:?}"
        );
        let past = SystemTime::now() - Duration::from_secs(60);
        assert_eq!(
            wait(&[("retry-after", httpdate::fmt_http_date(past))]),
            Some(Duration::ZERO)
        );
        for nonsense in ["-1", "1e400", "NaN", "soon"] {
            assert_eq!(
                wait(&[("retry-after", nonsense.into())]),
                None,
                "{nonsense}"
            );
        }
    }
}
