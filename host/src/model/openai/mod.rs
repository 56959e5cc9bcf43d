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
//! The client is the model module's one HTTP client shape (`http`) over
//! this protocol: `wire` is the protocol's JSON (requests, answers, chunks)
//! in our terms, `written` what we send and `read` what a client sends the
//! gateway, each a typed struct; `assembly` puts a streamed answer
//! together chunk by chunk.

mod assembly;
mod read;
pub(crate) mod wire;
mod written;

use std::borrow::Cow;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use self::assembly::Assembly;
use self::wire::{
    Completion, WireMessage, WireTool, answer, finish, refused, wire_message, wire_tool,
};
use super::body;
use super::http::{HttpModel, Protocol, Reach};
use crate::types::{ChainError, ErrorKind};
use crate::types::{ChatRequest, ChatResponse, ModelOptions, ToolCall, Usage};

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

/// Fields of a request's body that the client writes, whatever its
/// options say: the conversation, the tools, whether it streams, and how
/// many answers (one: only the first is read, the others would be paid
/// for).
const FRAMING: [&str; 5] = ["messages", "tools", "stream", "stream_options", "n"];

/// A chat request as chat completions write it, borrowed from ours.
#[derive(Serialize)]
struct Outgoing<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(flatten)]
    options: Cow<'a, ModelOptions>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<IncludeUsage>,
}

#[derive(Serialize)]
struct IncludeUsage {
    include_usage: bool,
}

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
pub type OpenAiModel = HttpModel<OpenAi>;

impl OpenAiModel {
    /// A client for `config`; `invalid-request` if its `base_url` makes no
    /// URL.
    pub fn new(config: OpenAiConfig) -> Result<Self, ChainError> {
        let reach = Reach {
            base_url: &config.base_url,
            model: &config.model,
            api_key: config.api_key.as_deref(),
            timeout_ms: config.timeout_ms,
            max_retries: config.max_retries,
        };
        HttpModel::open(OpenAi, reach)
    }
}

/// OpenAI's chat completions, as a [`Protocol`].
pub struct OpenAi;

impl Protocol for OpenAi {
    type Assembly = Assembly;
    const CHAT: &'static str = "chat/completions";
    const EMBEDDINGS: Option<&'static str> = Some("embeddings");

    fn body(&self, request: &ChatRequest, model: &str, stream: bool) -> Bytes {
        let options = &request.options;
        // Options shape the answer; they never replace what frames the
        // request, nor ask for more answers than the one read.
        let framing = options
            .extra
            .keys()
            .any(|key| FRAMING.contains(&key.as_str()));
        let shaping = if options.model.is_none() && !framing {
            Cow::Borrowed(&**options)
        } else {
            let mut shaping = (**options).clone();
            shaping.model = None;
            shaping
                .extra
                .retain(|key, _| !FRAMING.contains(&key.as_str()));
            Cow::Owned(shaping)
        };
        let body = Outgoing {
            model: options.model.as_deref().unwrap_or(model),
            messages: request.messages.iter().map(wire_message).collect(),
            tools: request.tools.iter().map(wire_tool).collect(),
            options: shaping,
            stream: stream.then_some(true),
            stream_options: stream.then_some(IncludeUsage {
                include_usage: true,
            }),
        };
        super::http::json_bytes(&body)
    }

    fn authorized(
        &self,
        post: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder {
        match key {
            Some(key) => post.bearer_auth(key),
            None => post,
        }
    }

    /// The first choice, or the error a server sent with a `200`.
    fn answer(&self, body: &[u8]) -> Result<ChatResponse, ChainError> {
        let completion: Completion = serde_json::from_slice(body).map_err(|e| {
            ChainError::new(
                ErrorKind::Transient,
                format!("the model server sent an unreadable answer: {e}"),
            )
        })?;
        if let Some(error) = &completion.error {
            return Err(said_error("answered with an error", error));
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
}

/// The error a server's `error` field says, cut to a readable length:
/// `{"message": ...}` or a bare string.
pub(super) fn said_error(what: &str, error: &Value) -> ChainError {
    let said = error["message"].as_str().or_else(|| error.as_str());
    let said = body::cut(said.unwrap_or("(no message)"));
    ChainError::new(
        ErrorKind::Transient,
        format!("the model server {what}: {said}"),
    )
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
