//! A streamed (SSE) answer: token batches forwarded as chunks, bounded
//! by what the client has not read.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tracing::Instrument;

use super::GatewayState;
use super::admission::ConcurrencyPermit;
use super::answer::{Responder, bounded, run, went_away};
use super::dialect::Frame;
use super::wire::{self, ApiError};
use crate::config::RouteMode;
use crate::kernel::Kernel;
use crate::onion::{Cancel, InvokeOptions, TokenSink};
use crate::types::{ChainError, ChatRequest, ChatResponse, ErrorKind, Origin, TokenBatch};

impl Responder {
    /// Server-sent events, in the dialect's words. Nothing is sent before
    /// the chat's first event, so a request that fails before any token
    /// gets its status, not a stream.
    pub(super) async fn stream(mut self, chat: ChatRequest) -> Response {
        let (sender, mut events) = mpsc::unbounded_channel();
        let (kernel, mode) = (self.kernel.clone(), self.mode);
        let unsent = Arc::new(Unsent::default());
        let forward = Forward {
            sender: sender.clone(),
            unsent: unsent.clone(),
        };
        let cancel = Cancel::new();
        // Shown: an answer no model streamed (a filter answered) reaches
        // the stream through the token transforms, within the chat.
        let options = InvokeOptions::from(self.context.clone())
            .stream_to(forward)
            .cancel_on(cancel.clone())
            .shown();
        // The chat runs on its own, holding the request's place, until it
        // ends, its deadline passes or the client goes away.
        let chatting = Chatting {
            kernel,
            mode,
            deadline: self.deadline,
            timed_out: self.timed_out(),
            cancel,
            place: self.place.take(),
            backlog: unsent.clone(),
            sender,
        };
        // Boxed once, as the whole answer's task is (`answer.rs`).
        tokio::spawn(Box::pin(chatting.run(chat, options)).instrument(tracing::Span::current()));
        let first = tokio::select! {
            first = events.recv() => first,
            () = self.shared.cut() => Some(Streamed::Done(Err(GatewayState::cut_error()))),
        };
        if let Some(Streamed::Done(Err(error))) = &first {
            return self.dialect.refuse(ApiError::chain(error));
        }
        self.respond(first, events, unsent)
    }

    /// The event stream, from the chat's `first` event on: the dialect's
    /// opening, the chunks, and its closing.
    fn respond(
        mut self,
        first: Option<Streamed>,
        events: mpsc::UnboundedReceiver<Streamed>,
        unsent: Arc<Unsent>,
    ) -> Response {
        let opening = self.dialect.opening();
        let closing = self.dialect.closing();
        let shown = self.keep.is_some().then(String::new);
        let state = Chunks {
            answer: self,
            pending: first,
            events,
            unsent,
            shown,
            text: None,
            end: None,
            tail: VecDeque::new(),
            finishing: false,
            ended: false,
        };
        let chunks = futures::stream::unfold(state, Chunks::next).flatten();
        // Every stream the chat ends (answered or broken) ends with the
        // dialect's last event, if it has one (`[DONE]`).
        let body = futures::stream::iter(opening)
            .chain(chunks)
            .chain(futures::stream::iter(closing))
            .flat_map(Frame::into_bytes)
            .map(Ok::<_, Infallible>);
        let headers = [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ];
        (headers, Body::from_stream(body)).into_response()
    }
}

/// A streamed chat on its own task, telling the response body what it
/// streams and how it ends.
struct Chatting {
    kernel: Kernel,
    mode: RouteMode,
    deadline: Duration,
    timed_out: ChainError,
    cancel: Cancel,
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
            cancel,
            place,
            backlog,
            sender,
        } = self;
        let _place = place;
        // The client went away, or fell so far behind that what it
        // missed is gone.
        let gone = async {
            tokio::select! {
                () = sender.closed() => went_away(),
                () = backlog.overflow.notified() => Unsent::error(),
            }
        };
        let chat = run(&kernel, mode, chat, options);
        let done = match bounded(chat, &cancel, deadline, timed_out, gone).await {
            // The client fell behind as the chat ended: the answer must
            // not look whole.
            _ if backlog.overflowed() => Err(Unsent::error()),
            done => done,
        };
        let _ = sender.send(Streamed::Done(done));
    }
}

/// What the streaming chat tells the response body.
pub(super) enum Streamed {
    Tokens(String),
    Done(Result<ChatResponse, ChainError>),
}

/// How long a stream may go without an event before it sends a comment,
/// so that proxies and clients do not take a slow model for a dead
/// connection.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

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

/// The events of one streamed answer, as they come: a piece of text at a
/// time, so that no more than one piece of a long text is escaped at once.
pub(super) struct Chunks {
    answer: Responder,
    pending: Option<Streamed>,
    events: mpsc::UnboundedReceiver<Streamed>,
    unsent: Arc<Unsent>,
    /// The text streamed so far, when the exchange is kept.
    shown: Option<String>,
    /// Text not yet sent, and how much of it was.
    text: Option<(String, usize)>,
    /// The answer, once its text is all that is left to send before the
    /// dialect's end.
    end: Option<ChatResponse>,
    /// Events to send after the text.
    tail: VecDeque<Frame>,
    /// Whether the dialect has more of its end to say ([`Dialect::more`]).
    finishing: bool,
    ended: bool,
}

impl Chunks {
    pub(super) async fn next(
        mut self,
    ) -> Option<(futures::stream::Iter<std::vec::IntoIter<Frame>>, Self)> {
        loop {
            if let Some(events) = self.piece() {
                return Some((futures::stream::iter(events), self));
            }
            if let Some(response) = self.end.take() {
                // The dialect's end, once the last of the text is out.
                self.tail.extend(self.answer.dialect.end(&response));
                self.finishing = true;
            }
            if let Some(event) = self.tail.pop_front() {
                return Some((futures::stream::iter(vec![event]), self));
            }
            if self.finishing {
                match self.answer.dialect.more() {
                    Some(event) => return Some((futures::stream::iter(vec![event]), self)),
                    None => self.finishing = false,
                }
            }
            if self.ended {
                return None;
            }
            let event = match self.pending.take() {
                Some(event) => Some(event),
                None => tokio::select! {
                    event = self.events.recv() => event,
                    () = self.answer.shared.cut() => Some(Streamed::Done(Err(GatewayState::cut_error()))),
                    () = tokio::time::sleep(KEEP_ALIVE) => {
                        return Some((futures::stream::iter(vec![Frame::keep_alive()]), self));
                    }
                },
            };
            match event {
                Some(Streamed::Tokens(text)) => {
                    self.unsent.bytes.fetch_sub(text.len(), Ordering::Relaxed);
                    self.send(text);
                }
                Some(Streamed::Done(done)) => {
                    self.ended = true;
                    match done {
                        Ok(mut response) => self.last(&mut response).await,
                        Err(error) => self.broken(&error),
                    }
                }
                None => {
                    self.ended = true;
                    let error =
                        ChainError::new(ErrorKind::Internal, "the answer ended without a result")
                            .at(Origin::terminal("gateway"));
                    self.broken(&error);
                }
            }
        }
    }

    /// Sends `text` next, a piece at a time (and keeps it, if asked).
    fn send(&mut self, text: String) {
        if let Some(shown) = &mut self.shown {
            shown.push_str(&text);
        }
        self.text = Some((text, 0));
    }

    /// The events of the next piece of the text not yet sent.
    fn piece(&mut self) -> Option<Vec<Frame>> {
        let (text, at) = self.text.as_mut()?;
        let Some(piece) = wire::next_piece(text, *at) else {
            self.text = None;
            return None;
        };
        *at += piece.len();
        Some(self.answer.dialect.text(piece))
    }

    /// Ends a broken stream with the dialect's error events, counted.
    pub(super) fn broken(&mut self, error: &ChainError) {
        let error = ApiError::chain(error);
        let metrics = &self.answer.shared.metrics;
        metrics.stream_error(&self.answer.model, error.status.as_u16());
        self.tail.extend(self.answer.dialect.broken(&error));
    }

    /// What follows the last token (text a filter answered with came
    /// through the chat's token transforms as its last): the dialect's end
    /// (tool calls, finish, usage); the exchange kept first, if asked, so
    /// that an answer whose keeping failed says so in its end (`store:
    /// false`) rather than as if it could be continued.
    pub(super) async fn last(&mut self, response: &mut ChatResponse) {
        if let Some(keep) = self.answer.keep.take() {
            let shown = self.shown.take().filter(|text| !text.is_empty());
            let (metrics, model) = (&self.answer.shared.metrics, &self.answer.model);
            if !keep.keep(response, shown.as_deref(), metrics, model).await {
                self.answer.dialect.unkept();
            }
        }
        let metrics = &self.answer.shared.metrics;
        metrics.usage(&self.answer.model, &response.usage);
        self.end = Some(std::mem::take(response));
    }
}
