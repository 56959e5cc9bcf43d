//! The one shape of a model server's client: a request sent one gateway
//! further (`x-shallot-hops`) and retried before the answer starts, a whole
//! answer read under its cap, a stream's events driven into the answer
//! being put together. What differs between servers (the endpoints, how a
//! request is written and authorized, how an answer and a stream event are
//! read) is the client's [`Protocol`]: OpenAI's chat completions or
//! Anthropic's Messages.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::stream::{self, BoxStream, StreamExt};

use super::body::{self, Refused};
use super::failure::{endpoint, http_client, send_retrying};
use super::{AnthropicConfig, ChatModel, ModelEvent, OpenAiConfig};
use crate::context::{Context, HOPS, HOPS_HEADER};
use crate::types::{
    ChainError, ChatRequest, ChatResponse, EmbeddingRequest, EmbeddingResponse, ErrorKind,
};

/// A model server's API: its endpoints, how a request is written and
/// authorized, how a whole answer is read, and the answer a stream's events
/// put together.
pub trait Protocol: Send + Sync + 'static {
    /// A streamed answer as it is put together, event by event.
    type Assembly: Assembly;
    /// The chat endpoint, under the API base.
    const CHAT: &'static str;
    /// The embeddings endpoint, if the API has one.
    const EMBEDDINGS: Option<&'static str>;

    /// The body asking `model` to answer `request`, streamed or whole, as
    /// JSON: written once, however often it is sent.
    fn body(&self, request: &ChatRequest, model: &str, stream: bool) -> Bytes;

    /// `post` with the API's own headers and its way of giving `key`.
    fn authorized(
        &self,
        post: reqwest::RequestBuilder,
        key: Option<&str>,
    ) -> reqwest::RequestBuilder;

    /// A whole answer's body as our response, or the error it carries.
    fn answer(&self, body: &[u8]) -> Result<ChatResponse, ChainError>;
}

/// A streamed answer being put together.
pub trait Assembly: Default + Send + 'static {
    /// Takes one event (never one without data) in.
    fn event(&mut self, event: &Event) -> Result<Step, ChainError>;

    /// Whether a stream the server closed now, without its end marker,
    /// holds the whole answer (some OpenAI-compatible servers close after
    /// the finish reason).
    fn whole(&self) -> bool {
        false
    }

    /// The answer put together.
    fn finish(self) -> ChatResponse;
}

/// What one stream event makes of the answer being put together.
pub enum Step {
    /// Nothing to pass on (a ping, a chunk without text).
    Skip,
    /// The next piece of the answer's text.
    Token(String),
    /// The answer is whole.
    Done,
}

/// A chat model behind a model server's HTTP API, `P` the API:
/// [`OpenAiModel`](super::OpenAiModel), [`AnthropicModel`](super::AnthropicModel).
pub struct HttpModel<P> {
    protocol: P,
    model: String,
    api_key: Option<String>,
    timeout: Duration,
    max_retries: u32,
    client: reqwest::Client,
    pub(super) chat_url: reqwest::Url,
    embeddings_url: Option<reqwest::Url>,
}

/// Where a server is and how it is asked: what every server's config gives.
pub(super) struct Reach<'a> {
    pub base_url: &'a str,
    pub model: &'a str,
    pub api_key: Option<&'a str>,
    pub timeout_ms: u64,
    pub max_retries: u32,
}

impl<P: Protocol> HttpModel<P> {
    /// A client of the server at `reach` speaking `protocol`;
    /// `invalid-request` if its `base_url` makes no URL.
    pub(super) fn open(protocol: P, reach: Reach<'_>) -> Result<Self, ChainError> {
        let embeddings_url = P::EMBEDDINGS.map(|path| endpoint(reach.base_url, path));
        Ok(HttpModel {
            protocol,
            model: reach.model.to_owned(),
            api_key: reach.api_key.map(str::to_owned),
            timeout: Duration::from_millis(reach.timeout_ms),
            max_retries: reach.max_retries,
            client: http_client(reach.timeout_ms)?,
            chat_url: endpoint(reach.base_url, P::CHAT)?,
            embeddings_url: embeddings_url.transpose()?,
        })
    }

    /// Sends `body` to `url`, retrying retryable failures, one gateway
    /// further than `context`'s request came; a `whole` answer within the
    /// timeout (a stream's bound is the silence between its events).
    async fn send(
        &self,
        url: &reqwest::Url,
        body: Bytes,
        whole: bool,
        context: &Context,
    ) -> Result<reqwest::Response, ChainError> {
        let hops = context.get(HOPS).and_then(|h| h.as_u64()).unwrap_or(0) + 1;
        send_retrying(self.max_retries, context, || {
            let post = self.client.post(url.clone()).header(HOPS_HEADER, hops);
            let json = post.header(reqwest::header::CONTENT_TYPE, "application/json");
            let mut post = json.body(body.clone());
            if whole {
                post = post.timeout(self.timeout);
            }
            self.protocol.authorized(post, self.api_key.as_deref())
        })
        .await
    }
}

#[async_trait]
impl<P: Protocol> ChatModel for HttpModel<P> {
    fn name(&self) -> &str {
        &self.model
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let body = self.protocol.body(request, &self.model, false);
        let response = self.send(&self.chat_url, body, true, context).await?;
        self.protocol
            .answer(&body::read(response, body::answer_cap()).await?)
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        let body = self.protocol.body(request, &self.model, true);
        let response = self.send(&self.chat_url, body, false, context).await?;
        let json = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
        if !json {
            return Ok(events::<P::Assembly>(response));
        }
        // A server that does not stream (or fails with a 200) answers
        // whole: the answer is one token and the end.
        let body = body::read(response, body::answer_cap()).await?;
        let answer = self.protocol.answer(&body)?;
        let text = answer.message.text();
        let token = (!text.is_empty()).then_some(Ok(ModelEvent::Token { text, meta: None }));
        let events = token.into_iter().chain([Ok(ModelEvent::Done(answer))]);
        Ok(stream::iter(events).boxed())
    }

    /// Forwards the request to the server's embeddings endpoint, asking
    /// for this model, and reads its answer.
    async fn embed(
        &self,
        request: &EmbeddingRequest,
        context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        let Some(url) = &self.embeddings_url else {
            return Err(super::no_embeddings(&self.model));
        };
        let body = EmbeddingRequest {
            model: self.model.clone(),
            ..request.clone()
        };
        let response = self.send(url, json_bytes(&body), true, context).await?;
        let answer = body::read(response, body::answer_cap()).await?;
        serde_json::from_slice(&answer).map_err(|e| {
            ChainError::new(
                ErrorKind::Transient,
                format!("the model server sent unreadable embeddings: {e}"),
            )
        })
    }
}

/// `value` as JSON. What a model request holds always is JSON: its maps'
/// keys are strings, and a number JSON cannot write is written `null`.
pub(super) fn json_bytes(value: &impl serde::Serialize) -> Bytes {
    Bytes::from(serde_json::to_vec(value).expect("a model request serializes as JSON"))
}

/// A streamed answer's events, put together by an `A`: its tokens as they
/// come, then the whole answer; or the error the stream broke with.
fn events<A: Assembly>(
    response: reqwest::Response,
) -> BoxStream<'static, Result<ModelEvent, ChainError>> {
    let bytes = body::checked(response.bytes_stream(), body::line_cap());
    // The state is dropped, and the connection with it, once the answer
    // is whole or the stream failed.
    let state = Some((bytes.eventsource().boxed(), A::default()));
    let stream = stream::unfold(state, |state| async move {
        let (mut events, mut building) = state?;
        loop {
            let step = match events.next().await {
                Some(Ok(event)) if event.data.trim().is_empty() => continue,
                Some(Ok(event)) => building.event(&event),
                Some(Err(error)) => Err(broken(error)),
                None if building.whole() => Ok(Step::Done),
                None => Err(ChainError::new(
                    ErrorKind::Transient,
                    "the model stream ended before the answer did",
                )),
            };
            let event = match step {
                Ok(Step::Skip) => continue,
                Ok(Step::Token(text)) => {
                    let token = ModelEvent::Token { text, meta: None };
                    return Some((Ok(token), Some((events, building))));
                }
                Ok(Step::Done) => Ok(ModelEvent::Done(building.finish())),
                Err(error) => Err(error),
            };
            return Some((event, None));
        }
    });
    stream.boxed()
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

/// A model server, by the API it speaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Server {
    /// OpenAI's chat completions (OpenAI, vLLM, Ollama, llama.cpp, ...).
    OpenAi(OpenAiConfig),
    /// Anthropic's Messages (`api = "anthropic"`).
    Anthropic(AnthropicConfig),
}

impl Server {
    /// A client of the server, whichever API it speaks: what the gateway's
    /// routes and `shallot chat` ask; `invalid-request` if its `base_url`
    /// makes no URL.
    pub fn connect(self) -> Result<Arc<dyn ChatModel>, ChainError> {
        Ok(match self {
            Server::OpenAi(config) => Arc::new(super::OpenAiModel::new(config)?),
            Server::Anthropic(config) => Arc::new(super::AnthropicModel::new(config)?),
        })
    }

    /// The same server reached at `base_url` instead.
    pub fn at(mut self, base_url: impl Into<String>) -> Self {
        match &mut self {
            Server::OpenAi(config) => config.base_url = base_url.into(),
            Server::Anthropic(config) => config.base_url = base_url.into(),
        }
        self
    }

    /// The same server asked for `model` instead.
    pub fn asking(mut self, model: impl Into<String>) -> Self {
        match &mut self {
            Server::OpenAi(config) => config.model = model.into(),
            Server::Anthropic(config) => config.model = model.into(),
        }
        self
    }
}
