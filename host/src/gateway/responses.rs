//! `POST /v1/responses`: OpenAI's Responses API, the one OpenAI's own
//! agents and newer SDK features use. A request is one chat (or, on an
//! agent route, one turn) like any other; its answer is a `response`, or
//! the stream of its typed events (`response.created`, the output items'
//! `output_text` and `function_call_arguments` deltas, then
//! `response.completed`, `response.incomplete` or `response.failed`).
//!
//! `previous_response_id` continues a kept response: the route's `store`
//! (a conversation store) keeps each response's conversation, the
//! client's input and the answer as it was shown, under the key's tenant.
//! A route without one answers `previous_response_id` and `store: true`
//! with a `400`: a response is never silently forgotten. `instructions`
//! are the request's own and are not carried over, as OpenAI does.

mod events;
mod read;

use std::sync::Arc;

use axum::http::StatusCode;
use serde::Deserialize;
use serde_json::{Value, json};

use self::events::Responses;
use self::read::{InChoice, InTool, Item};
use super::Route;
use super::handlers::{ChatApi, Prepared};
use super::metrics::Metrics;
use super::wire::{ApiError, read, unique_id};
use crate::conversation::{CONVERSATION_CAP, encoded_size};
use crate::kv::KvStore;
use crate::model::wire::TextOr;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, Content, ErrorKind, Message, ModelOptions, Role,
};

/// A `POST /v1/responses` body. Fields the gateway does not read
/// (`reasoning`, `text`, `truncation`, ...) are ignored.
#[derive(Deserialize)]
pub(super) struct ResponsesRequest {
    model: String,
    input: TextOr<Item>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    tools: Option<Vec<InTool>>,
    #[serde(default)]
    tool_choice: Option<InChoice>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    previous_response_id: Option<String>,
    #[serde(default)]
    store: Option<bool>,
    #[serde(default)]
    max_output_tokens: Option<u64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    parallel_tool_calls: Option<bool>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    metadata: Option<Value>,
}

impl ChatApi for ResponsesRequest {
    fn parse(body: &[u8]) -> Result<Self, ApiError> {
        read(body, "a Responses request")
    }

    fn model(&self) -> &str {
        &self.model
    }

    fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    fn user(&self) -> Option<&str> {
        self.user.as_deref()
    }

    async fn prepare(mut self, route: &Route, owner: Option<&str>) -> Result<Prepared, ApiError> {
        let store = match (&route.store, self.store) {
            (_, Some(false)) if self.previous_response_id.is_some() => {
                return Err(ApiError::invalid(
                    "`previous_response_id` continues a kept response, so `store` cannot be false",
                ));
            }
            (Some(store), stored) if stored != Some(false) => Some(store.clone()),
            (None, _) if self.previous_response_id.is_some() || self.store == Some(true) => {
                return Err(unkept(&route.model));
            }
            _ => None,
        };
        let mut history = match (&store, &self.previous_response_id) {
            (Some(store), Some(previous)) => earlier(store.as_ref(), owner, previous).await?,
            _ => Vec::new(),
        };
        input(std::mem::take(&mut self.input), &mut history).map_err(ApiError::invalid)?;
        let chat = self.chat_request(&history)?;
        let id = unique_id("resp_");
        let keep = store.map(|store| Keep {
            store,
            namespace: kept_in(owner),
            id: id.clone(),
            history,
        });
        let echoed = json!({
            "instructions": self.instructions,
            "tools": self.tools.as_deref().unwrap_or_default(),
            "tool_choice": self.tool_choice.as_ref().map_or(json!("auto"), |c| json!(c)),
            "parallel_tool_calls": self.parallel_tool_calls.unwrap_or(true),
            "previous_response_id": self.previous_response_id,
            "store": keep.is_some(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata.clone().unwrap_or(json!({})),
            "user": self.user,
        });
        let dialect = Responses::new(id.clone(), route.model.clone(), echoed);
        Ok(Prepared {
            chat,
            id,
            dialect: Box::new(dialect),
            keep,
        })
    }
}

impl ResponsesRequest {
    /// The chat over `history` (kept and new input), with the request's
    /// instructions first and its tools and options.
    fn chat_request(&self, history: &[Message]) -> Result<ChatRequest, ApiError> {
        let mut messages = Vec::with_capacity(history.len() + 1);
        if let Some(instructions) = &self.instructions {
            messages.push(Message::system(instructions.as_str()));
        }
        messages.extend_from_slice(history);
        if !messages.iter().any(|m| m.role != Role::System) {
            return Err(ApiError::invalid("`input` must not be empty"));
        }
        let tools = self
            .tools
            .iter()
            .flatten()
            .enumerate()
            .map(|(i, tool)| {
                tool.to_tool()
                    .map_err(|e| ApiError::invalid(format!("tools[{i}]: {e}")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let tool_choice = self.tool_choice.as_ref().map(InChoice::to_choice);
        let options = ModelOptions {
            max_tokens: self.max_output_tokens,
            temperature: self.temperature,
            top_p: self.top_p,
            tool_choice,
            parallel_tool_calls: self.parallel_tool_calls,
            user: self.user.clone(),
            ..ModelOptions::default()
        };
        let request = ChatRequest::new(messages)
            .with_tools(tools)
            .with_options(options);
        Ok(request)
    }
}

/// The `400` of a route that keeps no responses.
fn unkept(model: &str) -> ApiError {
    ApiError::new(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        Some("store_not_configured"),
        format!(
            "the model '{model}' keeps no responses (its route has no `store`): send the whole conversation as `input`, with `store: false` and no `previous_response_id`"
        ),
    )
}

/// How long a kept response may be continued: OpenAI keeps responses for
/// 30 days.
const KEPT_FOR: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

/// The key-store namespace an owner's responses are kept in, each owner's
/// its own (so each under its own cap: one tenant's fill is no other's),
/// and apart from every owner's on a gateway without keys (an owner is
/// never empty). No filter's own namespace has a `:` (a filter's name is
/// a-z, 0-9 and `-`), so none is one of these.
fn kept_in(owner: Option<&str>) -> String {
    format!("responses:{}", owner.unwrap_or_default())
}

/// Whether `id` is one [`unique_id`] made for a response: `resp_` and 32
/// hex digits. Anything else names no kept response.
fn well_formed(id: &str) -> bool {
    id.strip_prefix("resp_")
        .is_some_and(|bits| bits.len() == 32 && bits.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// The conversation of the kept response `id`, or a `400` naming it: the
/// same for an id that is not kept (or no longer), not well formed, or
/// another owner's.
async fn earlier(
    store: &dyn KvStore,
    owner: Option<&str>,
    id: &str,
) -> Result<Vec<Message>, ApiError> {
    let kept = if well_formed(id) {
        store
            .get(&kept_in(owner), id)
            .await
            .map_err(|e| ApiError::chain(&e))?
    } else {
        None
    };
    let history: Vec<Message> = kept
        .and_then(|entry| match serde_json::from_str(&entry.value) {
            Ok(history) => Some(history),
            Err(e) => {
                tracing::warn!(id, "a kept response that does not read as messages: {e}");
                None
            }
        })
        .unwrap_or_default();
    if history.is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("previous_response_not_found"),
            format!(
                "no response '{}' is kept here",
                crate::escape::printable(id, 80)
            ),
        ));
    }
    Ok(history)
}

/// The request's `input` (a string, or items) added to `messages`.
fn input(input: TextOr<Item>, messages: &mut Vec<Message>) -> Result<(), String> {
    match input {
        TextOr::Text(text) => messages.push(Message::user(text)),
        TextOr::List(items) => {
            for (i, item) in items.into_iter().enumerate() {
                item.into_messages(messages)
                    .map_err(|e| format!("input[{i}]: {e}"))?;
            }
        }
    }
    Ok(())
}

/// Where an answered exchange is kept: the conversation so far (kept and
/// new input), to which the answer, as the client was shown it, is added.
pub(super) struct Keep {
    store: Arc<dyn KvStore>,
    namespace: String,
    id: String,
    history: Vec<Message>,
}

impl Keep {
    /// Keeps the exchange that `response` answered, its text as `shown`:
    /// whether it was kept. An answer the model made is delivered however
    /// keeping it went; one not kept says `store: false` (and cannot be
    /// continued), and the failure goes to the log and to `/metrics`.
    pub(super) async fn keep(
        mut self,
        response: &ChatResponse,
        shown: Option<&str>,
        metrics: &Metrics,
        model: &str,
    ) -> bool {
        self.history.push(Message {
            content: shown.map(|text| Content::Text(text.to_owned())),
            tool_calls: response.message.tool_calls.clone(),
            ..Message::new(Role::Assistant, "")
        });
        // Its latest messages, at most a conversation's cap of them.
        let mut bytes: usize = self.history.iter().map(encoded_size).sum();
        let oldest = self
            .history
            .iter()
            .take_while(|message| {
                let over = bytes > CONVERSATION_CAP;
                if over {
                    bytes -= encoded_size(message);
                }
                over
            })
            .count();
        let kept = match serde_json::to_string(&self.history[oldest..]) {
            Ok(value) => {
                let ttl = Some(KEPT_FOR);
                self.store
                    .set(&self.namespace, None, &self.id, &value, ttl)
                    .await
                    .map(drop)
            }
            Err(e) => Err(ChainError::new(ErrorKind::Internal, e.to_string())),
        };
        if let Err(error) = &kept {
            tracing::warn!(model, "an answer was delivered without being kept: {error}");
        }
        metrics.kept(model, kept.is_ok());
        kept.is_ok()
    }
}
