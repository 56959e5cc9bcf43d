//! One admitted request's answer, and the whole (JSON) answer.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::GatewayState;
use super::admission::ConcurrencyPermit;
use super::wire::{self, ApiError, Head};
use crate::config::RouteMode;
use crate::context::Context;
use crate::kernel::Kernel;
use crate::onion::InvokeOptions;
use crate::types::{
    ChainError, ChatRequest, ChatResponse, ErrorKind, Origin, TurnRequest, TurnResult,
};

/// One admitted request: what its answer needs, and its place.
pub(super) struct Responder {
    pub(super) shared: Arc<GatewayState>,
    pub(super) mode: RouteMode,
    /// The kernel being served when the request started.
    pub(super) kernel: Kernel,
    pub(super) head: Head,
    pub(super) include_usage: bool,
    pub(super) context: Context,
    pub(super) deadline: Duration,
    /// The request's place, held while its chat runs.
    pub(super) place: Option<ConcurrencyPermit>,
}

impl Responder {
    pub(super) fn timed_out(&self) -> ChainError {
        ChainError::new(
            ErrorKind::Timeout,
            format!(
                "the request did not finish within {} ms",
                self.deadline.as_millis()
            ),
        )
        .at(Origin::terminal("gateway"))
    }

    /// The text a client is shown of `response`, taken out of it (so that
    /// a long answer is not held twice): through the token transforms.
    pub(super) async fn delivered(
        &self,
        response: &mut ChatResponse,
    ) -> Result<Option<String>, ChainError> {
        match response.message.take_text() {
            None => Ok(None),
            Some(text) => Ok(Some(
                self.kernel
                    .delivered_text(&text, self.context.clone())
                    .await?,
            )),
        }
    }

    /// The chunks that stream `text`, a piece of at most
    /// [`wire::TEXT_PIECE`] bytes each, so that no event is bigger than six
    /// times that, escaped, however much text a token batch or a filter's
    /// own answer holds.
    pub(super) fn text_chunks<'a>(&'a self, text: &'a str) -> impl Iterator<Item = Value> + 'a {
        wire::pieces(text).map(|piece| self.head.chunk(json!({ "content": piece }), None))
    }

    /// A JSON completion.
    pub(super) async fn whole(self, chat: ChatRequest) -> Result<Response, ApiError> {
        let answer = async {
            let options = InvokeOptions::from(self.context.clone());
            let mut response = run(&self.kernel, self.mode, chat, options).await?;
            self.shared.metrics.usage(&self.head.model, &response.usage);
            let delivered = self.delivered(&mut response).await?;
            Ok(self.head.completion(response, delivered))
        };
        let answer = tokio::select! {
            answer = tokio::time::timeout(self.deadline, answer) => {
                answer.unwrap_or_else(|_| Err(self.timed_out()))
            }
            () = self.shared.cut() => Err(GatewayState::cut_error()),
        }
        .map_err(|e| ApiError::chain(&e))?;
        Ok(([(header::CONTENT_TYPE, "application/json")], answer).into_response())
    }
}

/// Runs `chat` as the route's mode asks: a chat through the filters, or an
/// agent turn (the client sends the whole conversation, so no stored
/// history is loaded) whose final answer is the response.
pub(super) async fn run(
    kernel: &Kernel,
    mode: RouteMode,
    chat: ChatRequest,
    options: InvokeOptions,
) -> Result<ChatResponse, ChainError> {
    match mode {
        RouteMode::Proxy => kernel.chat(chat, options).await,
        RouteMode::Agent => {
            let turn = TurnRequest {
                load_history: false,
                ..TurnRequest::new(chat.messages.to_vec())
            };
            // The client's options (temperature, max_tokens, ...) reach
            // every model call of the turn.
            let options = options.model_options((*chat.options).clone());
            match kernel.turn(turn, options).await {
                TurnResult::Done(done) => Ok(done.response),
                TurnResult::Interrupt(paused) => Err(ChainError::new(
                    ErrorKind::InvalidRequest,
                    format!(
                        "the turn paused for a human ({}: {}); a gateway cannot answer for one",
                        paused.kind.as_str(),
                        paused.reason
                    ),
                )
                .at(Origin::terminal("gateway"))),
                TurnResult::Error(error) => Err(error),
            }
        }
    }
}
