//! One admitted request's answer, and the whole (JSON) answer.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::{IntoResponse, Response};

use super::GatewayState;
use super::admission::ConcurrencyPermit;
use super::dialect::Dialect;
use super::responses::Keep;
use super::wire::ApiError;
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
    /// The route's model, for the metrics.
    pub(super) model: String,
    /// How the client's API says the answer.
    pub(super) dialect: Box<dyn Dialect>,
    pub(super) context: Context,
    pub(super) deadline: Duration,
    /// The request's place, held while its chat runs.
    pub(super) place: Option<ConcurrencyPermit>,
    /// Where the exchange is kept once answered, if the client asked.
    pub(super) keep: Option<Keep>,
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

    /// A whole (JSON) answer, or the error it ended in.
    pub(super) async fn whole(mut self, chat: ChatRequest) -> Response {
        let timed_out = self.timed_out();
        let (deadline, shared) = (self.deadline, self.shared.clone());
        let keep = self.keep.take();
        let answer = async {
            let options = InvokeOptions::from(self.context.clone());
            let mut response = run(&self.kernel, self.mode, chat, options).await?;
            shared.metrics.usage(&self.model, &response.usage);
            let shown = self.delivered(&mut response).await?;
            if let Some(keep) = keep {
                keep.keep(&response, shown.as_deref()).await?;
            }
            Ok((response, shown))
        };
        let answer = tokio::select! {
            answer = tokio::time::timeout(deadline, answer) => {
                answer.unwrap_or(Err(timed_out))
            }
            () = shared.cut() => Err(GatewayState::cut_error()),
        };
        match answer {
            Ok((response, shown)) => {
                let body = self.dialect.whole(response, shown);
                ([(header::CONTENT_TYPE, "application/json")], body).into_response()
            }
            Err(error) => self.dialect.refuse(ApiError::chain(&error)),
        }
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
