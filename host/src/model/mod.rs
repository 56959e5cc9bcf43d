//! Model terminals: what answers at the core of the chat chain.
//!
//! [`ChatModel`] is the seam: the embedded default model implements it for
//! offline use and tests, and any provider client can. The terminal
//! streams the model's tokens through the token transform chain when the
//! invoke has a sink, batching tokens that arrive together.

mod anthropic;
mod body;
mod embedded;
mod failure;
mod http;
mod openai;
mod pool;

use std::sync::Arc;

use async_trait::async_trait;
use futures::stream::BoxStream;
use futures::{FutureExt, StreamExt};

pub use crate::context::{BUDGET_HEADER, BUDGET_LEFT_HEADER, HOPS_HEADER};
pub use anthropic::{AnthropicConfig, AnthropicModel};
pub use embedded::EmbeddedModel;
pub use http::{HttpModel, Server};
pub(crate) use openai::wire;
pub use openai::{OpenAiConfig, OpenAiModel};
pub use pool::{PoolConfig, UpstreamHealth, UpstreamPool};

use crate::context::Context;
use crate::onion::Invoke;
use crate::onion::TokenStream;
use crate::onion::{Chat, SideModel, Terminal};
pub use crate::types::ResponseLimits;
use crate::types::{ChainError, ErrorKind};
use crate::types::{ChatRequest, ChatResponse, Message, TokenBatch, Weigh};
use crate::types::{EmbeddingRequest, EmbeddingResponse, ModelOptions};

/// A model server's default bound on a whole answer, and on the silence
/// between two stream events.
fn default_timeout_ms() -> u64 {
    120_000
}

/// A model server's default retries of a retryable failure before the
/// answer starts.
fn default_retries() -> u32 {
    2
}

/// One event of a streamed model answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    /// The next piece of the answer's text.
    Token {
        /// The text.
        text: String,
        /// Metadata, a JSON object as text.
        meta: Option<String>,
    },
    /// The whole answer, as the non-streaming call would return it. Sent
    /// once, last.
    Done(ChatResponse),
}

/// A model that answers chat requests.
#[async_trait]
pub trait ChatModel: Send + Sync + 'static {
    /// The model's name, for listings and responses.
    fn name(&self) -> &str;

    /// Answers `request` in one piece. `context` is the invoke's shared
    /// context (conversation id, tenant, ...).
    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError>;

    /// Answers `request` as a stream of tokens ending with [`ModelEvent::Done`].
    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError>;

    /// Embeds the inputs of `request`. A model without embeddings (the
    /// default) answers `not-found`.
    async fn embed(
        &self,
        request: &EmbeddingRequest,
        context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        let _ = (request, context);
        Err(no_embeddings(self.name()))
    }

    /// How the upstreams behind the model are doing, if it balances
    /// several (an [`UpstreamPool`]); none (the default) for one.
    fn upstreams(&self) -> Vec<UpstreamHealth> {
        Vec::new()
    }
}

/// The error of a model without embeddings.
fn no_embeddings(model: &str) -> ChainError {
    let message = format!("the model '{model}' has no embeddings");
    ChainError::new(ErrorKind::NotFound, message)
}

/// A shared model is the model it shares (as [`Server::connect`] gives
/// one, or one model behind several kernels).
#[async_trait]
impl<M: ChatModel + ?Sized> ChatModel for Arc<M> {
    fn name(&self) -> &str {
        (**self).name()
    }

    async fn chat(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        (**self).chat(request, context).await
    }

    async fn stream(
        &self,
        request: &ChatRequest,
        context: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        (**self).stream(request, context).await
    }

    async fn embed(
        &self,
        request: &EmbeddingRequest,
        context: &Context,
    ) -> Result<EmbeddingResponse, ChainError> {
        (**self).embed(request, context).await
    }

    fn upstreams(&self) -> Vec<UpstreamHealth> {
        (**self).upstreams()
    }
}

/// The chat chain's terminal over a [`ChatModel`].
pub(crate) struct ModelTerminal {
    pub model: Arc<dyn ChatModel>,
    pub limits: ResponseLimits,
}

#[async_trait]
impl Terminal<Chat> for ModelTerminal {
    async fn call(
        &self,
        mut request: ChatRequest,
        invoke: &Arc<Invoke>,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        // The system prompts are the innermost layer: after every filter.
        let prompts = invoke.system_prompts();
        if !prompts.is_empty() {
            let system = prompts
                .iter()
                .map(|prompt| Message::system(prompt.as_str()));
            request.messages_mut().splice(0..0, system);
        }
        let request = with_invoke_options(request, invoke);
        let Some(sink) = invoke.sink() else {
            let response = self.model.chat(&request, context).await?;
            self.check(&response)?;
            return Ok(response);
        };
        let mut tokens = TokenStream::open(invoke, sink.clone()).await?;
        match self.pump(&request, context, &mut tokens).await {
            Ok(response) => {
                tokens.finish(response.finish_reason).await?;
                Ok(response)
            }
            Err(error) => {
                tokens.abandon().await;
                Err(error)
            }
        }
    }
}

/// `request` with the invoke's model options (e.g. its route's upstream
/// model) where it sets none of its own.
fn with_invoke_options(mut request: ChatRequest, invoke: &Invoke) -> ChatRequest {
    let defaults = invoke.model_options();
    if *defaults != ModelOptions::default() {
        let options = Arc::unwrap_or_clone(request.options).or(defaults);
        request.options = Arc::new(options);
    }
    request
}

/// A side call (the `model` import): the model's own answer, checked
/// against the response limits; with the options the host built for it
/// alone (neither the invoke's options nor its system prompts), and never
/// streamed.
#[async_trait]
impl SideModel for ModelTerminal {
    async fn side_chat(
        &self,
        request: ChatRequest,
        _: &Arc<Invoke>,
        context: &Context,
    ) -> Result<ChatResponse, ChainError> {
        let response = self.model.chat(&request, context).await?;
        self.check(&response)?;
        Ok(response)
    }
}

impl ModelTerminal {
    fn check(&self, response: &ChatResponse) -> Result<(), ChainError> {
        let calls = response.message.tool_calls.len();
        self.limits.check(calls, response.weight())
    }

    /// Feeds the model's stream through the token chain; returns the
    /// model's own, untransformed response.
    async fn pump(
        &self,
        request: &ChatRequest,
        context: &Context,
        tokens: &mut TokenStream,
    ) -> Result<ChatResponse, ChainError> {
        // Fused: a stream that ended in the inner drain is not polled again.
        let mut events = self.model.stream(request, context).await?.fuse();
        let mut done = None;
        let mut streamed = 0;
        while let Some(first) = events.next().await {
            // Everything that already arrived goes through as one batch.
            let mut batch = TokenBatch::default();
            let mut event = Some(first);
            while let Some(current) = event.take() {
                match current? {
                    ModelEvent::Token { text, meta } => {
                        streamed += text.len() + meta.as_ref().map_or(0, String::len);
                        self.limits.check(0, streamed)?;
                        if !text.is_empty() {
                            batch.push(&text, meta.as_deref());
                        }
                    }
                    ModelEvent::Done(response) => {
                        self.check(&response)?;
                        done = Some(response);
                    }
                }
                event = events.next().now_or_never().flatten();
            }
            if !batch.is_empty() {
                tokens.push(batch).await?;
            }
        }
        done.ok_or_else(|| {
            ChainError::new(
                ErrorKind::Transient,
                "the model stream ended without a final response",
            )
        })
    }
}
