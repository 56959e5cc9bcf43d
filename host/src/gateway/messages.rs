//! `POST /v1/messages`: Anthropic's Messages API, so that Claude-based
//! tools and the `anthropic` SDKs (pointed at the gateway with
//! `ANTHROPIC_BASE_URL`) get the filters. A request is one chat (or, on an
//! agent route, one turn) like any other; its answer is a `message`, or
//! the stream of `message_start`, `content_block_*`, `message_delta` and
//! `message_stop` events, with `tool_use` blocks for the model's calls and
//! Anthropic's error objects (an `error` event once a stream started).
//! Clients may present their key as `x-api-key` (Anthropic's header) or
//! `Authorization: Bearer`.

mod answer;
mod read;

use serde::Deserialize;

use self::answer::Messages;
pub(super) use self::answer::refused;
use self::read::{InChoice, InMessage, InTool, System};
use super::Route;
use super::handlers::{ChatApi, Prepared};
use super::wire::{ApiError, read, unique_id};
use crate::types::{ChatRequest, ModelOptions, Stop};

/// A `POST /v1/messages` body. Fields the gateway does not read
/// (`thinking`, `service_tier`, ...) are ignored.
#[derive(Deserialize)]
pub(super) struct MessagesRequest {
    model: String,
    max_tokens: u64,
    messages: Vec<InMessage>,
    #[serde(default)]
    system: Option<System>,
    #[serde(default)]
    tools: Option<Vec<InTool>>,
    #[serde(default)]
    tool_choice: Option<InChoice>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stop_sequences: Option<Vec<String>>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<u64>,
    #[serde(default)]
    metadata: Option<Metadata>,
}

#[derive(Deserialize)]
struct Metadata {
    #[serde(default)]
    user_id: Option<String>,
}

impl ChatApi for MessagesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        read(body, "a Messages request")
    }

    fn model(&self) -> &str {
        &self.model
    }

    fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    fn user(&self) -> Option<&str> {
        self.metadata.as_ref()?.user_id.as_deref()
    }

    async fn prepare(self, route: &Route, _: Option<&str>) -> Result<Prepared, ApiError> {
        let chat = self.chat_request().map_err(ApiError::invalid)?;
        let id = unique_id("msg_");
        let dialect = Messages::new(id.clone(), route.model.clone());
        Ok(Prepared {
            chat,
            id,
            dialect: Box::new(dialect),
            keep: None,
        })
    }
}

impl MessagesRequest {
    /// The request in our terms, or what is wrong with it.
    fn chat_request(self) -> Result<ChatRequest, String> {
        if self.messages.is_empty() {
            return Err("`messages` must not be empty".to_owned());
        }
        let user = self.user().map(str::to_owned);
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        messages.extend(self.system.map(System::into_message));
        for (i, message) in self.messages.into_iter().enumerate() {
            message
                .into_messages(&mut messages)
                .map_err(|e| format!("messages[{i}]: {e}"))?;
        }
        let tools = self
            .tools
            .into_iter()
            .flatten()
            .enumerate()
            .map(|(i, tool)| tool.into_tool().map_err(|e| format!("tools[{i}]: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        let (tool_choice, parallel) = match self.tool_choice {
            Some(choice) => choice.into_choice().map(|(c, p)| (Some(c), p))?,
            None => (None, true),
        };
        let options = ModelOptions {
            max_tokens: Some(self.max_tokens),
            tool_choice,
            parallel_tool_calls: (!parallel).then_some(false),
            stop: self.stop_sequences.map(Stop::Any),
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            user,
            ..ModelOptions::default()
        };
        let request = ChatRequest::new(messages)
            .with_tools(tools)
            .with_options(options);
        Ok(request)
    }
}
