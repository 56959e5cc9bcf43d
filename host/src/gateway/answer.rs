//! One admitted request's answer, and the whole (JSON) answer.

use std::sync::Arc;
use std::time::Duration;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use tokio::sync::oneshot;
use tracing::Instrument;

use super::GatewayState;
use super::admission::ConcurrencyPermit;
use super::dialect::Dialect;
use super::responses::Keep;
use super::wire::ApiError;
use crate::config::RouteMode;
use crate::context::Context;
use crate::kernel::Kernel;
use crate::onion::{Cancel, InvokeOptions};
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

    /// A whole (JSON) answer, or the error it ended in. The answer is
    /// worked out on its own task, holding the request's place, so that
    /// neither the deadline nor the client going away drops it midway
    /// (see [`bounded`]).
    pub(super) async fn whole(mut self, chat: ChatRequest) -> Response {
        let cancel = Cancel::new();
        let (timed_out, deadline) = (self.timed_out(), self.deadline);
        let (kernel, context) = (self.kernel.clone(), self.context.clone());
        let (shared, model, mode) = (self.shared.clone(), self.model.clone(), self.mode);
        let (keep, place) = (self.keep.take(), self.place.take());
        let options = InvokeOptions::from(context)
            .cancel_on(cancel.clone())
            .shown();
        let answer = async move {
            let mut response = run(&kernel, mode, chat, options).await?;
            shared.metrics.usage(&model, &response.usage);
            // Shown: the text as the client is shown it, taken out (so
            // that a long answer is not held twice).
            let shown = response.message.take_text();
            let kept = match keep {
                Some(keep) => {
                    keep.keep(&response, shown.as_deref(), &shared.metrics, &model)
                        .await
                }
                None => true,
            };
            Ok((response, shown, kept))
        };
        let (mut sent, answered) = oneshot::channel();
        let working = async move {
            let _place = place;
            let gone = async {
                sent.closed().await;
                went_away()
            };
            let answer = bounded(answer, &cancel, deadline, timed_out, gone).await;
            let _ = sent.send(answer);
        };
        // Boxed once here: the future is some 7 KiB, under the size tokio
        // boxes itself, so it would be copied whole at each step of `spawn`.
        tokio::spawn(Box::pin(working).instrument(tracing::Span::current()));
        let answer = tokio::select! {
            answer = answered => answer.unwrap_or_else(|_| Err(lost())),
            () = self.shared.cut() => Err(GatewayState::cut_error()),
        };
        match answer {
            Ok((response, shown, kept)) => {
                if !kept {
                    self.dialect.unkept();
                }
                let body = self.dialect.whole(response, shown);
                ([(header::CONTENT_TYPE, "application/json")], body).into_response()
            }
            Err(error) => self.dialect.refuse(ApiError::chain(&error)),
        }
    }
}

/// How long a cancelled request's filters have to see their calls end
/// before the request is dropped.
pub(super) const GRACE: Duration = Duration::from_secs(2);

/// Runs `work` until it ends. If the request's `deadline` passes first
/// (`timed_out`), or `gone` says the client went away, `cancel` ends its
/// model and tool calls with that reason, and it has [`GRACE`] to end:
/// every filter sees its calls end (`trace` writes the turn's line, as
/// `cancelled`), and what is left is dropped.
pub(super) async fn bounded<T>(
    work: impl Future<Output = Result<T, ChainError>>,
    cancel: &Cancel,
    deadline: Duration,
    timed_out: ChainError,
    gone: impl Future<Output = ChainError>,
) -> Result<T, ChainError> {
    let mut work = std::pin::pin!(work);
    let reason = tokio::select! {
        done = &mut work => return done,
        () = tokio::time::sleep(deadline) => timed_out,
        reason = gone => reason,
    };
    cancel.cancel(reason.clone());
    tokio::time::timeout(GRACE, work)
        .await
        .unwrap_or(Err(reason))
}

/// Why a request whose client went away was cancelled.
pub(super) fn went_away() -> ChainError {
    ChainError::new(ErrorKind::Transient, "the client went away").at(Origin::terminal("gateway"))
}

/// The error of an answer whose task ended without one (it panicked).
fn lost() -> ChainError {
    ChainError::new(ErrorKind::Internal, "the answer was lost").at(Origin::terminal("gateway"))
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
            let options = options.model_options(Arc::unwrap_or_clone(chat.options));
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
