//! The bounds every API request passes, one layer on every API route
//! (chat completions, Responses, Messages, embeddings, `/mcp`), in this
//! order: its key, from the headers before any of its body is read; its
//! body, whole within the read timeout and the body cap; a place among the
//! requests served at once, with its queue; the memory parsing the body
//! could take. After the handler: the request's metrics and its log line.
//!
//! Each route says in its [`Api`] how its errors are written (its API's
//! dialect: OpenAI's error object, Anthropic's, JSON-RPC's), what
//! `/metrics` counts it as and whether it takes a place here (an `/mcp`
//! request does not: it may be a listen that lasts for hours, so each of
//! its calls takes a place of its own as it runs). The handler finds what
//! was admitted in the request's [`Admitted`] extension. The deadline is
//! the answer's, not this layer's, since a stream outlives its handler:
//! the chat's [`Responder`](super::answer::Responder), the embeddings and
//! each MCP call run within it and are cancelled at it.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tracing::Instrument;

use super::GatewayState;
use super::admission::{ConcurrencyPermit, MemoryPermit};
use super::routes::RouteTable;
use super::wire::ApiError;
use crate::config::ClientKey;

/// What a route is to its bounds.
#[derive(Clone, Copy)]
pub(super) struct Api {
    /// What `/metrics` counts its requests as; `None`: `json` or
    /// `stream`, as its answer is.
    mode: Option<&'static str>,
    /// Whether its request takes a place here.
    placed: bool,
    /// Its errors, in its API's shape.
    refuse: fn(ApiError) -> Response,
}

impl Api {
    /// A chat API whose errors `refuse` writes.
    pub(super) const fn chat(refuse: fn(ApiError) -> Response) -> Api {
        Api {
            mode: None,
            placed: true,
            refuse,
        }
    }

    /// OpenAI's embeddings.
    pub(super) const EMBEDDINGS: Api = Api {
        mode: Some("embeddings"),
        placed: true,
        refuse: ApiError::into_response,
    };

    /// `/mcp`, whose errors `refuse` writes as JSON-RPC's.
    pub(super) const fn mcp(refuse: fn(ApiError) -> Response) -> Api {
        Api {
            mode: Some("mcp"),
            placed: false,
            refuse,
        }
    }

    /// `error` as this API answers it.
    pub(super) fn refuse(&self, error: ApiError) -> Response {
        (self.refuse)(error)
    }
}

/// What a request was admitted with, for its handler: the routes and keys
/// being served when it came (a reload while it runs changes nothing for
/// it), its key, its API, and its place.
#[derive(Clone)]
pub(super) struct Admitted {
    pub(super) served: RouteTable,
    key: Option<usize>,
    pub(super) api: Api,
    place: Arc<Mutex<Option<ConcurrencyPermit>>>,
}

impl Admitted {
    /// The key the request presented (none: the gateway is open).
    pub(super) fn key(&self) -> Option<&ClientKey> {
        self.key.map(|i| &self.served.keys[i])
    }

    /// The request's place, holding the memory its body may take, for the
    /// work that outlives the handler (a chat's own task): taken once;
    /// left untaken, it is given back when the handler has answered.
    pub(super) fn take_place(&self) -> Option<ConcurrencyPermit> {
        self.place
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// Taken out of the request (never copied: it is there for its handler
/// alone); a route left without its bounds is the gateway's bug, `500`.
impl<S: Sync> FromRequestParts<S> for Admitted {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts.extensions.remove::<Admitted>().ok_or_else(|| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                None,
                "the request was not admitted".to_owned(),
            )
        })
    }
}

/// The route's model a handler answered for, on its response: the label
/// of its metrics (never what a client asked for: clients do not get to
/// make up label values).
#[derive(Clone)]
pub(super) struct Routed(pub(super) String);

/// The layer: admits the request, runs its handler in the request's span,
/// counts and logs what it answered.
pub(super) async fn bounds(
    State((shared, api)): State<(Arc<GatewayState>, Api)>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let span = tracing::info_span!(
        "request",
        id = tracing::field::Empty,
        model = tracing::field::Empty
    );
    let mut response = match admit(&shared, api, request).await {
        Ok((request, memory)) => {
            let response = next.run(request).instrument(span.clone()).await;
            drop(memory);
            response
        }
        Err(error) => api.refuse(error),
    };
    let model = response.extensions_mut().remove::<Routed>();
    let model = model.map(|routed| routed.0).unwrap_or_default();
    let mode = api.mode.unwrap_or_else(|| {
        let streamed = response
            .headers()
            .get(header::CONTENT_TYPE)
            .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
        if streamed { "stream" } else { "json" }
    });
    let status = response.status().as_u16();
    let seconds = started.elapsed().as_secs_f64();
    shared.metrics.request(&model, mode, status, seconds);
    span.in_scope(|| tracing::info!(status, mode, ms = seconds * 1000.0, "answered"));
    response
}

/// The request, admitted: its key, its body, its place and memory. What
/// the handler does not hold (the memory of a request without a place
/// here) is held until it has answered.
async fn admit(
    shared: &GatewayState,
    api: Api,
    request: Request,
) -> Result<(Request, Option<MemoryPermit>), ApiError> {
    let served = shared.served();
    let key = served.key_index(request.headers())?;
    let (parts, body) = request.into_parts();
    let body = read_body(shared, body).await?;
    let place = match api.placed {
        true => Some(shared.place().await?),
        false => None,
    };
    let memory = shared.memory(&body).await?;
    let (place, memory) = match place {
        Some(place) => (Some(place.holding(memory)), None),
        None => (None, Some(memory)),
    };
    let mut request = Request::from_parts(parts, Body::from(body));
    request.extensions_mut().insert(Admitted {
        served,
        key,
        api,
        place: Arc::new(Mutex::new(place)),
    });
    Ok((request, memory))
}

/// The request's body, if it arrives whole within the read timeout
/// (`408`) and the body cap (`413`). Written here rather than as
/// tower-http's `TimeoutLayer`, which would bound the whole response (a
/// stream included), and whose body timeout fails as a bare body error.
async fn read_body(shared: &GatewayState, body: Body) -> Result<Bytes, ApiError> {
    let (within, cap) = (shared.config.read_timeout, shared.config.max_body_bytes);
    let read = tokio::time::timeout(within, axum::body::to_bytes(body, cap)).await;
    let Ok(read) = read else {
        return Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            Some("request_timeout"),
            format!(
                "the request body did not arrive within {} ms",
                within.as_millis()
            ),
        ));
    };
    read.map_err(|error| {
        let over = std::error::Error::source(&error)
            .is_some_and(|e| e.is::<http_body_util::LengthLimitError>());
        match over {
            true => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                None,
                format!("the request body is larger than {cap} bytes"),
            ),
            false => ApiError::invalid(format!("the request body could not be read: {error}")),
        }
    })
}
