//! An OpenAI-compatible gateway in front of a [`Kernel`]: any OpenAI client,
//! in any language, gets the filters.
//!
//! `POST /v1/chat/completions` runs one chat-chain invoke per request
//! (system-prompt hooks, around-chat filters, the model) and answers as
//! OpenAI does: a JSON completion, or with `stream: true` server-sent
//! chunks, tool calls included, and a usage chunk when
//! `stream_options.include_usage` asks for it. What the client is shown of
//! the answer's text always goes through the token transforms, streamed or
//! not, so a redaction filter holds in both. The client runs its own tool
//! loop: the tools it offers go to the model and the model's calls come
//! back to it.
//!
//! Failures are OpenAI error objects with a status by their kind (see
//! `wire::ApiError::chain`); a blocked answer is a `200` whose
//! `finish_reason` is `content_filter`, as OpenAI does. A stream that fails
//! after it started ends with an error event, never a silent truncation.
//!
//! `GET /v1/models` lists the model, `GET /healthz` says the process is up,
//! `GET /readyz` that it serves, with the filters it runs and its reloads,
//! and `GET /metrics` gives Prometheus its counters (`metrics`). [`Gateway::swap`] serves a new kernel from the next request on
//! (`shallot serve` reloads on SIGHUP and on changed files); a request
//! finishes on the kernel it started with.
//!
//! Bounds ([`GatewayConfig`]): a request body cap (`413`), a cap on
//! concurrent requests with a bounded queue (`429` when the queue is full,
//! `503` when a queued request waited too long, both with `Retry-After`),
//! a per-request deadline (`504`), a cap on open connections and a
//! deadline for each request's head (against clients that hold connections
//! and send nothing), and on shutdown a bounded drain of the requests in
//! flight.

mod metrics;
mod wire;

use std::convert::Infallible;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, FromRequest, Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus_client::metrics::gauge::Gauge;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tracing::Instrument;

use self::metrics::Metrics;
use self::wire::{ApiError, CompletionRequest, Head};
use crate::agent::CONVERSATION_ID;
use crate::config::{ClientKey, RouteMode};
use crate::context::Context;
use crate::kernel::Kernel;
use crate::model::wire::wire_finish;
use crate::onion::{InvokeOptions, TokenSink};
use crate::types::{
    ChainError, ChatRequest, ChatResponse, ErrorKind, Origin, TokenBatch, TurnRequest, TurnResult,
};

/// A gateway's bounds.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The largest request body accepted, in bytes (default 4 MiB).
    pub max_body_bytes: usize,
    /// Requests served at once (default 256).
    pub max_concurrent: usize,
    /// Requests that may wait for one of those places (default 1024);
    /// beyond, `429`.
    pub max_queued: usize,
    /// How long a request may wait for a place (default 10 s); then `503`.
    pub queue_timeout: Duration,
    /// How long one request may take, streaming included (default 300 s);
    /// then `504`, or an error event in a stream.
    pub request_timeout: Duration,
    /// On shutdown, how long requests in flight get to finish (default
    /// 30 s).
    pub drain_timeout: Duration,
    /// Client connections open at once (default 10,000). At the cap the
    /// gateway accepts no more until one closes (new ones wait in the
    /// listen backlog), so clients that hold connections open cannot take
    /// the file descriptors its upstream connections need.
    pub max_connections: usize,
    /// How long a client may take to send a request's head, and then its
    /// body (default 30 s each; a body late is a `408`), and how long a
    /// connection may sit idle between requests; then it is closed. A
    /// client that opens connections and sends nothing, or a byte at a
    /// time, holds them no longer than this.
    pub read_timeout: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        GatewayConfig {
            max_body_bytes: 4 << 20,
            max_concurrent: 256,
            max_queued: 1024,
            queue_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(30),
            max_connections: 10_000,
            read_timeout: Duration::from_secs(30),
        }
    }
}

/// An OpenAI-compatible gateway in front of a kernel. Cheap to clone: the
/// clones are one gateway, so a reloader can [`swap`](Gateway::swap) in a
/// new kernel while [`serve`](Gateway::serve) runs.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

/// What every request handler shares.
struct Shared {
    config: GatewayConfig,
    /// The routes being served; a request takes its route when it starts
    /// and finishes on it, whatever is swapped in meanwhile.
    served: RwLock<Served>,
    /// Places among the requests served at once.
    places: Arc<Semaphore>,
    /// Requests waiting for a place.
    queued: AtomicUsize,
    /// Swaps so far, and the last reload that failed since the last swap.
    reloads: Mutex<Reloads>,
    metrics: Metrics,
    /// Set when the drain after a shutdown runs out: answers still in
    /// flight end with an error (a stream with an error event), never
    /// silently cut.
    cut: tokio::sync::watch::Sender<bool>,
    /// Set when the drain starts: no request takes a place from then on.
    draining: tokio::sync::watch::Sender<bool>,
}

/// One model a gateway serves: the name clients ask for, the kernel (the
/// filters over the model) behind it, and how a request runs through it.
#[derive(Clone)]
pub struct Route {
    /// The name clients ask for (`model` in a request, `/v1/models`).
    pub model: String,
    /// The filters and the model.
    pub kernel: Kernel,
    /// A chat through the filters, or a whole agent turn.
    pub mode: RouteMode,
}

impl Route {
    /// A proxy route: one request is one chat through `kernel`'s filters.
    pub fn proxy(model: impl Into<String>, kernel: Kernel) -> Self {
        Route {
            model: model.into(),
            kernel,
            mode: RouteMode::Proxy,
        }
    }
}

#[derive(Clone)]
struct Served {
    routes: Arc<[Route]>,
    /// The keys clients must present; none: the gateway is open.
    keys: Arc<[ClientKey]>,
}

impl Served {
    /// The routes `key` may use (all of them without keys).
    fn routes_for<'a>(&'a self, key: Option<&'a ClientKey>) -> impl Iterator<Item = &'a Route> {
        self.routes
            .iter()
            .filter(move |route| key.is_none_or(|key| key.may_use(&route.model)))
    }

    /// The route of `model`, if `key` may use it; else a `404` naming the
    /// models it may use (the others do not exist for it).
    fn route(&self, key: Option<&ClientKey>, model: &str) -> Result<&Route, ApiError> {
        self.routes
            .iter()
            .find(|route| route.model == model && key.is_none_or(|key| key.may_use(model)))
            .ok_or_else(|| {
                let models: Vec<&str> = self.routes_for(key).map(|r| r.model.as_str()).collect();
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    Some("model_not_found"),
                    format!(
                        "the model '{model}' does not exist; this gateway serves {}",
                        models.join(", ")
                    ),
                )
            })
    }

    fn filters(&self) -> usize {
        self.routes.iter().map(|r| r.kernel.filters().count()).sum()
    }

    /// The key a request presents, if keys are required: `401` when it
    /// presents none or an unknown one.
    fn authorize(&self, headers: &HeaderMap) -> Result<Option<&ClientKey>, ApiError> {
        if self.keys.is_empty() {
            return Ok(None);
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| {
                // The scheme's name is case-insensitive (RFC 9110).
                let (scheme, key) = value.trim().split_once(char::is_whitespace)?;
                scheme.eq_ignore_ascii_case("bearer").then(|| key.trim())
            });
        let unauthorized = |code: Option<&str>, message: &str| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                code,
                message.to_owned(),
            )
        };
        let Some(presented) = presented else {
            return Err(unauthorized(
                None,
                "no API key: send one as `Authorization: Bearer <key>`",
            ));
        };
        self.keys
            .iter()
            .find(|key| key.matches(presented))
            .map(Some)
            .ok_or_else(|| unauthorized(Some("invalid_api_key"), "the API key is not valid"))
    }
}

#[derive(Default)]
struct Reloads {
    swapped: u64,
    failed: u64,
    last_error: Option<String>,
}

impl Gateway {
    /// A gateway serving `routes`, each under its model name.
    pub fn new(routes: Vec<Route>, config: GatewayConfig) -> Self {
        Gateway {
            shared: Arc::new(Shared {
                places: Arc::new(Semaphore::new(config.max_concurrent)),
                queued: AtomicUsize::new(0),
                served: RwLock::new(Served {
                    routes: routes.into(),
                    keys: Arc::new([]),
                }),
                reloads: Mutex::new(Reloads::default()),
                metrics: Metrics::new(),
                cut: tokio::sync::watch::Sender::new(false),
                draining: tokio::sync::watch::Sender::new(false),
                config,
            }),
        }
        .counting_filters()
    }

    /// Points the filter metrics at the set being served.
    fn counting_filters(self) -> Self {
        self.shared.count_filters();
        self
    }

    /// Serves `routes` from now on: requests in flight finish on the route
    /// they started with.
    pub fn swap(&self, routes: Vec<Route>) {
        self.replace(|served| served.routes = routes.into());
    }

    /// Serves `routes` to `keys` from now on, both in one step: no request
    /// sees the new keys with the old routes (a key limited to a model
    /// that only the new routes serve would get a `404`) or the reverse.
    pub fn swap_with_keys(&self, routes: Vec<Route>, keys: Vec<ClientKey>) {
        self.replace(|served| {
            served.routes = routes.into();
            served.keys = keys.into();
        });
    }

    fn replace(&self, change: impl FnOnce(&mut Served)) {
        change(
            &mut self
                .shared
                .served
                .write()
                .unwrap_or_else(PoisonError::into_inner),
        );
        let mut reloads = self.shared.reloads();
        reloads.swapped += 1;
        reloads.last_error = None;
        drop(reloads);
        self.shared.metrics.reload(true);
        self.shared.count_filters();
    }

    /// Requires every `/v1` request to present one of `keys` (`Authorization:
    /// Bearer <key>`; `401` otherwise); with none, the gateway is open. The
    /// key's name and tenant go into the invoke's shared context (`key`,
    /// `tenant`) for the filters.
    pub fn set_keys(&self, keys: Vec<ClientKey>) {
        self.shared
            .served
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .keys = keys.into();
    }

    /// Records a reload that failed (the old kernel keeps serving):
    /// `/readyz` shows it until the next swap.
    pub fn reload_failed(&self, error: impl Into<String>) {
        let mut reloads = self.shared.reloads();
        reloads.failed += 1;
        reloads.last_error = Some(error.into());
        self.shared.metrics.reload(false);
    }

    /// Serves on `listener` until `shutdown` resolves, then stops accepting
    /// and gives the requests in flight `drain_timeout` to finish; those
    /// still running then end with an error (a stream with an error event
    /// before `[DONE]`), within a second more. At most `max_connections`
    /// are open at once, and each must send a request's head within
    /// `read_timeout` (also the longest a connection may sit idle).
    pub async fn serve(
        &self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        let config = &self.shared.config;
        let app = self.router();
        let mut http = hyper::server::conn::http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(config.read_timeout);
        let graceful = GracefulShutdown::new();
        let connections = Arc::new(Semaphore::new(config.max_connections));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                () = &mut shutdown => break,
                accepted = accept(&listener, &connections) => accepted,
            };
            let Some((stream, place)) = accepted else {
                continue;
            };
            // Chunks go out as they are written: without it, a small SSE
            // chunk waits for the client's delayed ACK (40 ms).
            let _ = stream.set_nodelay(true);
            let service = TowerToHyperService::new(app.clone());
            let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
            let open = Open::count(&self.shared.metrics.connections);
            tokio::spawn(async move {
                let _ = connection.await;
                drop((open, place));
            });
        }
        drop(listener);
        self.shared.draining.send_replace(true);
        let drained = graceful.shutdown();
        tokio::pin!(drained);
        let drain = config.drain_timeout;
        if tokio::time::timeout(drain, &mut drained).await.is_err() {
            tracing::warn!(
                "requests still in flight after the {drain:?} drain; ending them with an error"
            );
            self.shared.cut.send_replace(true);
            // Their error answers (events) go out, then the server stops.
            let _ = tokio::time::timeout(CUT_GRACE, &mut drained).await;
        }
        Ok(())
    }

    fn router(&self) -> Router {
        Router::new()
            .route("/v1/chat/completions", post(completions))
            .route("/v1/models", get(models))
            .route("/v1/models/{*model}", get(model))
            .route("/healthz", get(|| async { "ok\n" }))
            .route("/readyz", get(ready))
            .route("/metrics", get(exposition))
            .fallback(|| async {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    Some("unknown_url"),
                    "no such endpoint".to_owned(),
                )
            })
            .method_not_allowed_fallback(|| async {
                ApiError::new(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "invalid_request_error",
                    Some("method_not_allowed"),
                    "this endpoint does not take that method".to_owned(),
                )
            })
            .layer(DefaultBodyLimit::max(self.shared.config.max_body_bytes))
            .with_state(self.shared.clone())
    }
}

/// An open connection, counted while it lives (whatever ends it).
struct Open(Gauge);

impl Open {
    fn count(gauge: &Gauge) -> Self {
        gauge.inc();
        Open(gauge.clone())
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The next connection, once there is a place for it among the open ones;
/// `None` when accepting failed (then after a pause, if the failure was the
/// gateway's, such as running out of file descriptors, not the client's).
async fn accept(
    listener: &TcpListener,
    places: &Arc<Semaphore>,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    let place = places.clone().acquire_owned().await.ok()?;
    match listener.accept().await {
        Ok((stream, _)) => Some((stream, place)),
        Err(e) if client_gone(&e) => None,
        Err(e) => {
            tracing::error!("accepting a connection failed: {e}; trying again in a second");
            tokio::time::sleep(Duration::from_secs(1)).await;
            None
        }
    }
}

/// Whether accepting failed because the client went away.
fn client_gone(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    matches!(
        error.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    )
}

/// How long answers cut at the end of a drain get to send their error.
const CUT_GRACE: Duration = Duration::from_secs(1);

impl Shared {
    /// Resolves when the drain runs out.
    async fn cut(&self) {
        let mut cut = self.cut.subscribe();
        let _ = cut.wait_for(|cut| *cut).await;
    }

    /// The error an answer cut at the end of the drain ends with.
    fn cut_error() -> ChainError {
        ChainError::new(
            ErrorKind::Overloaded,
            "the gateway is shutting down and the answer did not finish in time; retry it",
        )
        .at(Origin::terminal("gateway"))
    }

    fn served(&self) -> Served {
        self.served
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Points the filters gauge and the per-filter metrics at the set
    /// being served.
    fn count_filters(&self) {
        let served = self.served();
        self.metrics.filters.set(served.filters() as i64);
        let filters = served.routes.iter().flat_map(|r| r.kernel.wasm_filters());
        self.metrics.served.set(filters);
    }

    fn reloads(&self) -> MutexGuard<'_, Reloads> {
        self.reloads.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body)).into_response();
        if self.retry {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// `GET /v1/models`: the models the client's key may use.
async fn models(State(gateway): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let served = gateway.served();
    let key = match served.authorize(&headers) {
        Ok(key) => key,
        Err(error) => return error.into_response(),
    };
    let models: Vec<Value> = served.routes_for(key).map(model_object).collect();
    axum::Json(json!({ "object": "list", "data": models })).into_response()
}

/// `GET /v1/models/{model}`: one of them, or a `404`.
async fn model(
    State(gateway): State<Arc<Shared>>,
    Path(model): Path<String>,
    headers: HeaderMap,
) -> Response {
    let served = gateway.served();
    match served
        .authorize(&headers)
        .and_then(|key| served.route(key, &model))
    {
        Ok(route) => axum::Json(model_object(route)).into_response(),
        Err(error) => error.into_response(),
    }
}

/// A route as OpenAI's model object.
fn model_object(route: &Route) -> Value {
    json!({ "id": route.model, "object": "model", "created": 0, "owned_by": "shallot" })
}

async fn ready(State(gateway): State<Arc<Shared>>) -> Response {
    let served = gateway.served();
    let routes: Vec<Value> = served
        .routes
        .iter()
        .map(|route| {
            let filters: Vec<Value> = route
                .kernel
                .filters()
                .map(|(name, hooks)| {
                    let hooks: Vec<&str> = hooks.iter().map(|h| h.as_str()).collect();
                    json!({ "name": name, "hooks": hooks })
                })
                .collect();
            let mode = match route.mode {
                RouteMode::Proxy => "proxy",
                RouteMode::Agent => "agent",
            };
            json!({ "model": route.model, "mode": mode, "filters": filters })
        })
        .collect();
    let reloads = gateway.reloads();
    axum::Json(json!({
        "ready": true,
        "routes": routes,
        "reloads": { "swapped": reloads.swapped, "failed": reloads.failed, "last_error": reloads.last_error },
    }))
    .into_response()
}

async fn exposition(State(gateway): State<Arc<Shared>>) -> Response {
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    (
        [(header::CONTENT_TYPE, content_type)],
        gateway.metrics.encode(),
    )
        .into_response()
}

async fn completions(
    State(gateway): State<Arc<Shared>>,
    headers: HeaderMap,
    request: Request,
) -> Response {
    let body = read_body(&gateway, request).await;
    let started = Instant::now();
    let mut routed = None;
    let span = tracing::info_span!(
        "request",
        id = tracing::field::Empty,
        model = tracing::field::Empty
    );
    let response = match complete(gateway.clone(), &headers, body, &mut routed)
        .instrument(span.clone())
        .await
    {
        Ok(response) => response,
        Err(error) => error.into_response(),
    };
    let stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"text/event-stream"));
    // Labelled by the route's model, never by what a client asked for:
    // clients do not get to make up label values.
    let model = routed.unwrap_or_default();
    let seconds = started.elapsed().as_secs_f64();
    gateway
        .metrics
        .request(&model, stream, response.status().as_u16(), seconds);
    span.in_scope(|| {
        tracing::info!(
            status = response.status().as_u16(),
            stream,
            ms = seconds * 1000.0,
            "answered"
        );
    });
    response
}

async fn complete(
    gateway: Arc<Shared>,
    headers: &HeaderMap,
    body: Result<Bytes, ApiError>,
    routed: &mut Option<String>,
) -> Result<Response, ApiError> {
    let served = gateway.served();
    let key = served.authorize(headers)?;
    let body = body?;
    let request: CompletionRequest = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(format!(
            "the request body is not a chat completion request: {e}"
        ))
    })?;
    let route = served.route(key, &request.model)?;
    *routed = Some(route.model.clone());
    tracing::Span::current().record("model", route.model.as_str());
    let chat = request.chat_request().map_err(ApiError::invalid)?;
    if route.mode == RouteMode::Agent && !chat.tools.is_empty() {
        return Err(ApiError::invalid(format!(
            "the model '{}' runs its own tools: send no `tools`",
            route.model
        )));
    }
    let place = gateway.place().await?;
    let mut context = Context::new().with("model", request.model.as_str());
    if let Some(user) = &request.user {
        context = context.with("user", user.as_str());
    }
    if let Some(key) = key {
        context = context.with("key", key.name.as_str());
        if let Some(tenant) = &key.tenant {
            context = context.with("tenant", tenant.as_str());
        }
    }
    if let Some(conversation) = conversation(headers)? {
        // Behind keys, a conversation belongs to the tenant (or the key):
        // a client cannot name its way into another tenant's.
        let owner = key.map(|k| k.tenant.as_deref().unwrap_or(&k.name));
        let id = match owner {
            Some(owner) => format!("{owner}/{conversation}"),
            None => conversation.to_owned(),
        };
        context = context.with(CONVERSATION_ID, id);
    }
    let head = Head::new(&route.model);
    tracing::Span::current().record("id", head.id.as_str());
    let answer = Answer {
        head,
        mode: route.mode,
        include_usage: request.include_usage(),
        context,
        kernel: route.kernel.clone(),
        deadline: gateway.config.request_timeout,
        place: Some(place),
        shared: gateway.clone(),
    };
    if request.stream() {
        answer.stream(chat).await
    } else {
        answer.whole(chat).await
    }
}

/// The request's body, if it arrives whole within the read timeout and
/// the body cap.
async fn read_body(gateway: &Shared, request: Request) -> Result<Bytes, ApiError> {
    let within = gateway.config.read_timeout;
    let read = tokio::time::timeout(within, Bytes::from_request(request, &())).await;
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
    read.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
            format!(
                "the request body is larger than {} bytes",
                gateway.config.max_body_bytes
            )
        } else {
            rejection.body_text()
        };
        ApiError::new(status, "invalid_request_error", None, message)
    })
}

impl Shared {
    /// Waits for a place among the requests served at once: `429` if too
    /// many already wait, `503` if the wait runs out or the gateway starts
    /// shutting down (those waiting are told at once, to retry elsewhere).
    async fn place(&self) -> Result<Place, ApiError> {
        let placed = |permit| {
            self.metrics.in_progress.inc();
            Place {
                _permit: permit,
                in_progress: self.metrics.in_progress.clone(),
            }
        };
        let shutting_down = || {
            ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "shutting_down",
                "the gateway is shutting down; retry the request".to_owned(),
            )
        };
        let mut draining = self.draining.subscribe();
        if *draining.borrow() {
            return Err(shutting_down());
        }
        if let Ok(permit) = self.places.clone().try_acquire_owned() {
            return Ok(placed(permit));
        }
        let waiting = Waiting::join(self).ok_or_else(|| {
            ApiError::busy(
                StatusCode::TOO_MANY_REQUESTS,
                "queue_full",
                format!(
                    "{} requests are in progress and {} waiting; try again later",
                    self.config.max_concurrent, self.config.max_queued
                ),
            )
        })?;
        let place = tokio::select! {
            place = tokio::time::timeout(
                self.config.queue_timeout,
                self.places.clone().acquire_owned(),
            ) => place,
            _ = draining.wait_for(|draining| *draining) => return Err(shutting_down()),
        };
        drop(waiting);
        match place {
            Ok(Ok(permit)) => Ok(placed(permit)),
            _ => Err(ApiError::busy(
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                format!(
                    "no place to serve the request within {} ms; try again later",
                    self.config.queue_timeout.as_millis()
                ),
            )),
        }
    }
}

/// A request's place among those served at once, counted until it is
/// given back.
struct Place {
    _permit: OwnedSemaphorePermit,
    in_progress: Gauge,
}

impl Drop for Place {
    fn drop(&mut self) {
        self.in_progress.dec();
    }
}

/// One request in the queue, counted until it leaves (served, refused or
/// dropped with its connection).
struct Waiting<'a>(&'a Shared);

impl<'a> Waiting<'a> {
    fn join(shared: &'a Shared) -> Option<Self> {
        let max = shared.config.max_queued;
        shared
            .queued
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        shared.metrics.waiting.inc();
        Some(Waiting(shared))
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.queued.fetch_sub(1, Ordering::AcqRel);
        self.0.metrics.waiting.dec();
    }
}

/// One admitted request: what its answer needs, and its place.
struct Answer {
    shared: Arc<Shared>,
    mode: RouteMode,
    /// The kernel being served when the request started.
    kernel: Kernel,
    head: Head,
    include_usage: bool,
    context: Context,
    deadline: Duration,
    /// The request's place, held while its chat runs.
    place: Option<Place>,
}

impl Answer {
    fn timed_out(&self) -> ChainError {
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
    async fn delivered(&self, response: &mut ChatResponse) -> Result<Option<String>, ChainError> {
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
    fn text_chunks<'a>(&'a self, text: &'a str) -> impl Iterator<Item = Value> + 'a {
        wire::pieces(text).map(|piece| self.head.chunk(json!({ "content": piece }), None))
    }

    /// A JSON completion.
    async fn whole(self, chat: ChatRequest) -> Result<Response, ApiError> {
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
            () = self.shared.cut() => Err(Shared::cut_error()),
        }
        .map_err(|e| ApiError::chain(&e))?;
        Ok(([(header::CONTENT_TYPE, "application/json")], answer).into_response())
    }

    /// Server-sent chunks. Nothing is sent before the chat's first event,
    /// so a request that fails before any token gets its status, not a
    /// stream.
    async fn stream(mut self, chat: ChatRequest) -> Result<Response, ApiError> {
        let (sender, mut events) = mpsc::unbounded_channel();
        let (kernel, mode) = (self.kernel.clone(), self.mode);
        let unsent = Arc::new(Unsent::default());
        let forward = Forward {
            sender: sender.clone(),
            unsent: unsent.clone(),
        };
        let options = InvokeOptions::from(self.context.clone()).stream_to(forward);
        let (deadline, timed_out) = (self.deadline, self.timed_out());
        // The chat runs on its own, holding the request's place, until it
        // ends, its deadline passes or the client goes away.
        let place = self.place.take();
        let span = tracing::Span::current();
        let backlog = unsent.clone();
        let chatting = async move {
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
        };
        tokio::spawn(chatting.instrument(span));
        let first = tokio::select! {
            first = events.recv() => first,
            () = self.shared.cut() => Some(Streamed::Done(Err(Shared::cut_error()))),
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
        let body = futures::stream::iter([opening]).chain(chunks).map(|chunk| {
            let data = match chunk {
                Value::String(done) => done,
                chunk => chunk.to_string(),
            };
            Ok::<_, Infallible>(Event::default().data(data))
        });
        Ok(Sse::new(body)
            .keep_alive(KeepAlive::default())
            .into_response())
    }
}

/// The header a client names a conversation with, for filters that keep
/// conversations server-side (`memory`): the client then sends only the
/// new messages, and any replica sharing the store can answer. Behind
/// client keys the conversation id filters see is `<tenant>/<id>` (the
/// key's name when it has no tenant), so tenants never share one.
pub const CONVERSATION_HEADER: &str = "x-shallot-conversation";

/// The conversation a request names, if any: 1 to 256 printable ASCII
/// characters.
fn conversation(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let Some(value) = headers.get(CONVERSATION_HEADER) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(id) if !id.is_empty() && id.len() <= 256 && id.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(id))
        }
        _ => Err(ApiError::invalid(format!(
            "the {CONVERSATION_HEADER} header must be 1 to 256 printable ASCII characters"
        ))),
    }
}

/// Runs `chat` as the route's mode asks: a chat through the filters, or an
/// agent turn (the client sends the whole conversation, so no stored
/// history is loaded) whose final answer is the response.
async fn run(
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

/// What the streaming chat tells the response body.
enum Streamed {
    Tokens(String),
    Done(Result<ChatResponse, ChainError>),
}

/// How much of a streamed answer may wait for a client that does not read
/// it: past this, the chat is stopped (its instances, its place and the
/// model's connection given back) and the stream ends with an error.
pub const MAX_UNSENT_BYTES: usize = 1 << 20;

/// Forwards each batch the token transforms deliver to the response body,
/// counting what the client has not taken yet.
struct Forward {
    sender: mpsc::UnboundedSender<Streamed>,
    unsent: Arc<Unsent>,
}

/// A stream's text delivered but not yet taken by the response body.
#[derive(Default)]
struct Unsent {
    bytes: AtomicUsize,
    /// Set once the client fell too far behind: nothing more is sent, and
    /// the answer ends with an error however the chat ends.
    overflowed: AtomicBool,
    overflow: Notify,
}

impl Unsent {
    fn overflowed(&self) -> bool {
        self.overflowed.load(Ordering::Acquire)
    }

    fn error() -> ChainError {
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
struct Chunks {
    answer: Answer,
    pending: Option<Streamed>,
    events: mpsc::UnboundedReceiver<Streamed>,
    unsent: Arc<Unsent>,
    /// Whether any text was streamed (a filter that answers itself streams
    /// none; its text is delivered whole at the end).
    delivered: bool,
    ended: bool,
}

impl Chunks {
    async fn next(mut self) -> Option<(futures::stream::Iter<std::vec::IntoIter<Value>>, Self)> {
        if self.ended {
            return None;
        }
        let event = match self.pending.take() {
            Some(event) => Some(event),
            None => tokio::select! {
                event = self.events.recv() => event,
                () = self.answer.shared.cut() => Some(Streamed::Done(Err(Shared::cut_error()))),
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
                let mut chunks = match done {
                    Ok(mut response) => self.last(&mut response).await,
                    Err(error) => vec![self.broken(&error)],
                };
                chunks.push(Value::String("[DONE]".to_owned()));
                chunks
            }
            None => {
                self.ended = true;
                let error =
                    ChainError::new(ErrorKind::Internal, "the answer ended without a result")
                        .at(Origin::terminal("gateway"));
                vec![self.broken(&error), Value::String("[DONE]".to_owned())]
            }
        };
        Some((futures::stream::iter(chunks), self))
    }

    /// The error event that ends a broken stream, counted.
    fn broken(&self, error: &ChainError) -> Value {
        let error = ApiError::chain(error);
        let metrics = &self.answer.shared.metrics;
        metrics.stream_error(&self.answer.head.model, error.status.as_u16());
        error.body
    }

    /// The chunks after the last token: text a filter answered with (not
    /// streamed), the tool calls, the finish reason, the usage.
    async fn last(&self, response: &mut ChatResponse) -> Vec<Value> {
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
