//! A streamed (SSE) answer: token batches forwarded as chunks, bounded
//! by what the client has not read.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tracing::Instrument;

use super::GatewayState;
use super::admission::ConcurrencyPermit;
use super::answer::{Responder, run};
use super::wire::ApiError;
use crate::config::RouteMode;
use crate::kernel::Kernel;
use crate::model::wire::wire_finish;
use crate::onion::{InvokeOptions, TokenSink};
use crate::types::{ChainError, ChatRequest, ChatResponse, ErrorKind, Origin, TokenBatch};

impl Responder {
    /// Server-sent chunks. Nothing is sent before the chat's first event,
    /// so a request that fails before any token gets its status, not a
    /// stream.
    pub(super) async fn stream(mut self, chat: ChatRequest) -> Result<Response, ApiError> {
        let (sender, mut events) = mpsc::unbounded_channel();
        let (kernel, mode) = (self.kernel.clone(), self.mode);
        let unsent = Arc::new(Unsent::default());
        let forward = Forward {
            sender: sender.clone(),
            unsent: unsent.clone(),
        };
        let options = InvokeOptions::from(self.context.clone()).stream_to(forward);
        // The chat runs on its own, holding the request's place, until it
        // ends, its deadline passes or the client goes away.
        let chatting = Chatting {
            kernel,
            mode,
            deadline: self.deadline,
            timed_out: self.timed_out(),
            place: self.place.take(),
            backlog: unsent.clone(),
            sender,
        };
        tokio::spawn(
            chatting
                .run(chat, options)
                .instrument(tracing::Span::current()),
        );
        let first = tokio::select! {
            first = events.recv() => first,
            () = self.shared.cut() => Some(Streamed::Done(Err(GatewayState::cut_error()))),
        };
        if let Some(Streamed::Done(Err(error))) = &first {
            return Err(ApiError::chain(error));
        }
        let opening = self
            .head
            .chunk(json!({ "role": "assistant", "content": "" }), None);
        let state = Chunks {
            answer: self,
            pending: first,
            events,
            unsent,
            delivered: false,
            ended: false,
        };
        let chunks = futures::stream::unfold(state, Chunks::next).flatten();
        // Every stream the chat ends (answered or broken) ends with the
        // `[DONE]` line OpenAI's clients wait for.
        let body = futures::stream::iter([opening])
            .chain(chunks)
            .map(|chunk| Event::default().data(chunk.to_string()))
            .chain(futures::stream::once(async {
                Event::default().data("[DONE]")
            }))
            .map(Ok::<_, Infallible>);
        Ok(Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response())
    }
}

/// A streamed chat on its own task, telling the response body what it
/// streams and how it ends.
struct Chatting {
    kernel: Kernel,
    mode: RouteMode,
    deadline: Duration,
    timed_out: ChainError,
    place: Option<ConcurrencyPermit>,
    backlog: Arc<Unsent>,
    sender: mpsc::UnboundedSender<Streamed>,
}

impl Chatting {
    async fn run(self, chat: ChatRequest, options: InvokeOptions) {
        let Chatting {
            kernel,
            mode,
            deadline,
            timed_out,
            place,
            backlog,
            sender,
        } = self;
        let _place = place;
        let chat = tokio::time::timeout(deadline, run(&kernel, mode, chat, options));
        tokio::select! {
            biased;
            () = backlog.overflow.notified() => {
                let _ = sender.send(Streamed::Done(Err(Unsent::error())));
            }
            done = chat => {
                // The client fell behind as the chat ended: what it
                // missed is gone, so the answer must not look whole.
                let done = match done {
                    _ if backlog.overflowed() => Err(Unsent::error()),
                    done => done.unwrap_or(Err(timed_out)),
                };
                let _ = sender.send(Streamed::Done(done));
            }
            () = sender.closed() => {}
        }
    }
}

/// What the streaming chat tells the response body.
pub(super) enum Streamed {
    Tokens(String),
    Done(Result<ChatResponse, ChainError>),
}

/// How much of a streamed answer may wait for a client that does not read
/// it: past this, the chat is stopped (its instances, its place and the
/// model's connection given back) and the stream ends with an error.
pub const MAX_UNSENT_BYTES: usize = 1 << 20;

/// Forwards each batch the token transforms deliver to the response body,
/// counting what the client has not taken yet.
pub(super) struct Forward {
    sender: mpsc::UnboundedSender<Streamed>,
    unsent: Arc<Unsent>,
}

/// A stream's text delivered but not yet taken by the response body.
#[derive(Default)]
pub(super) struct Unsent {
    bytes: AtomicUsize,
    /// Set once the client fell too far behind: nothing more is sent, and
    /// the answer ends with an error however the chat ends.
    overflowed: AtomicBool,
    overflow: Notify,
}

impl Unsent {
    pub(super) fn overflowed(&self) -> bool {
        self.overflowed.load(Ordering::Acquire)
    }

    pub(super) fn error() -> ChainError {
        ChainError::new(
            ErrorKind::LimitExceeded,
            format!(
                "the client did not read the stream: more than {MAX_UNSENT_BYTES} bytes of the answer waited for it"
            ),
        )
        .at(Origin::terminal("gateway"))
    }
}

impl TokenSink for Forward {
    fn deliver(&self, tokens: &TokenBatch) {
        let unsent = &self.unsent;
        if unsent.overflowed() {
            return;
        }
        let text: String = tokens.iter().map(|token| token.text).collect();
        // One large batch to a client that has taken everything so far is
        // not falling behind: only text already waiting counts against it.
        let waiting = unsent.bytes.load(Ordering::Relaxed);
        if waiting > 0 && waiting + text.len() > MAX_UNSENT_BYTES {
            unsent.overflowed.store(true, Ordering::Release);
            unsent.overflow.notify_one();
            return;
        }
        unsent.bytes.fetch_add(text.len(), Ordering::Relaxed);
        let _ = self.sender.send(Streamed::Tokens(text));
    }
}

/// The chunks of one streamed answer, event by event.
pub(super) struct Chunks {
    answer: Responder,
    pending: Option<Streamed>,
    events: mpsc::UnboundedReceiver<Streamed>,
    unsent: Arc<Unsent>,
    /// Whether any text was streamed (a filter that answers itself streams
    /// none; its text is delivered whole at the end).
    delivered: bool,
    ended: bool,
}

impl Chunks {
    pub(super) async fn next(
        mut self,
    ) -> Option<(futures::stream::Iter<std::vec::IntoIter<Value>>, Self)> {
        if self.ended {
            return None;
        }
        let event = match self.pending.take() {
            Some(event) => Some(event),
            None => tokio::select! {
                event = self.events.recv() => event,
                () = self.answer.shared.cut() => Some(Streamed::Done(Err(GatewayState::cut_error()))),
            },
        };
        let chunks = match event {
            Some(Streamed::Tokens(text)) => {
                self.unsent.bytes.fetch_sub(text.len(), Ordering::Relaxed);
                self.delivered = true;
                self.answer.text_chunks(&text).collect()
            }
            Some(Streamed::Done(done)) => {
                self.ended = true;
                match done {
                    Ok(mut response) => self.last(&mut response).await,
                    Err(error) => vec![self.broken(&error)],
                }
            }
            None => {
                self.ended = true;
                let error =
                    ChainError::new(ErrorKind::Internal, "the answer ended without a result")
                        .at(Origin::terminal("gateway"));
                vec![self.broken(&error)]
            }
        };
        Some((futures::stream::iter(chunks), self))
    }

    /// The error event that ends a broken stream, counted.
    pub(super) fn broken(&self, error: &ChainError) -> Value {
        let error = ApiError::chain(error);
        let metrics = &self.answer.shared.metrics;
        metrics.stream_error(&self.answer.head.model, error.status.as_u16());
        error.body
    }

    /// The chunks after the last token: text a filter answered with (not
    /// streamed), the tool calls, the finish reason, the usage.
    pub(super) async fn last(&self, response: &mut ChatResponse) -> Vec<Value> {
        let head = &self.answer.head;
        let mut chunks = Vec::new();
        if !self.delivered {
            match self.answer.delivered(response).await {
                Ok(Some(text)) => chunks.extend(self.answer.text_chunks(&text)),
                Ok(_) => {}
                Err(error) => return vec![self.broken(&error)],
            }
        }
        if !response.message.tool_calls.is_empty() {
            chunks.push(head.tool_calls(&response.message.tool_calls));
        }
        let reason = wire_finish(response.finish_reason);
        chunks.push(head.chunk(json!({}), Some(reason)));
        if self.answer.include_usage {
            chunks.push(head.usage(&response.usage));
        }
        let metrics = &self.answer.shared.metrics;
        metrics.usage(&head.model, &response.usage);
        chunks
    }
}
