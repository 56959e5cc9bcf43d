//! A gateway in front of a [`Kernel`] that speaks the APIs clients send:
//! any OpenAI or Anthropic client, in any language, gets the filters.
//!
//! `POST /v1/chat/completions` (OpenAI's chat completions), `POST
//! /v1/responses` (OpenAI's Responses) and `POST /v1/messages`
//! (Anthropic's Messages) each run one chat-chain invoke per request
//! (system-prompt hooks, around-chat filters, the model), or an agent turn
//! on an agent route, and answer in their API's words (`dialect`): a JSON
//! answer, or with `stream: true` its server-sent events, tool calls
//! included. What the client is shown of the answer's text always goes
//! through the token transforms, streamed or not, so a redaction filter
//! holds in every API. The client runs its own tool loop: the tools it
//! offers go to the model and the model's calls come back to it.
//!
//! Failures are error objects in the API's shape with a status by their
//! kind (see `wire::ApiError::chain`); a blocked answer is a `200` that
//! says so (`finish_reason: content_filter`, `status: incomplete`,
//! `stop_reason: refusal`). A stream that fails
//! after it started ends with an error event, never a silent truncation.
//!
//! `GET /v1/models` lists the model, `GET /healthz` says the process is up,
//! `GET /readyz` that it serves, with the filters it runs, its upstreams'
//! health and its reloads, `GET /metrics` gives Prometheus its counters
//! (`metrics`), and `GET /openapi.json` documents it all ([`OPENAPI`]). [`Gateway::swap`] serves a new kernel from the next request on
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
//!
//! One file per concern: this one the gateway's state and its public
//! handle; `build` (a configuration's routes and keys), `server` (the router, the connections, the drain), `routes`
//! and `auth` (what a request may reach, and with which key), `admission`
//! (a request's place and the queue), `handlers` (the endpoints),
//! `answer` (an admitted request and its JSON answer), `stream` (the SSE
//! answer), `dialect` (how an API says an answer), `wire` (chat
//! completions' request, answer and error shapes), `responses` and
//! `messages` (the other two APIs), `embeddings`, `upstreams` (their
//! health), `metrics`, `openapi` (the document of it all).

mod admission;
mod answer;
mod auth;
mod bounds;
mod build;
mod chunk;
mod dialect;
mod embeddings;
mod handlers;
mod mcp;
mod messages;
mod metrics;
mod openapi;
mod reported;
mod responses;
mod routes;
mod server;
mod stream;
mod upstreams;
mod wire;

use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Duration;

use tokio::sync::Semaphore;

use self::admission::kib;
use self::metrics::Metrics;
use self::routes::RouteTable;

pub use self::build::{RouteError, Serving};
pub use self::handlers::CONVERSATION_HEADER;
pub use self::mcp::McpEndpoint;
pub use self::openapi::OPENAPI;
pub use self::stream::MAX_UNSENT_BYTES;
use crate::config::{ClientKey, RouteMode};
use crate::kernel::Kernel;
use crate::kv::KvStore;
use crate::types::{ChainError, ErrorKind, Origin};

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
    /// Requests to models that one client request may cause in all
    /// (default 256): its model calls and its filters' side calls, each
    /// retry and each upstream of a pool, across every gateway it passes
    /// through (a gateway lends the next half of what is left, in
    /// `x-shallot-budget`, and a request that carries less gets less).
    /// Past it a call fails `limit-exceeded`: a loop of side calls back
    /// into the gateway ends there however wide it fans out.
    pub max_model_requests: u64,
    /// Memory the requests being parsed and answered may hold at once, in
    /// bytes (default 1 GiB): before a body is parsed, a request takes
    /// what parsing it could build (a JSON tree takes up to dozens of
    /// times its text), and keeps what its chat holds until it is
    /// answered. A request past all of it is `413`; one that finds too
    /// little left waits as for a place.
    pub max_request_memory: usize,
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
            max_model_requests: 256,
            max_request_memory: 1 << 30,
        }
    }
}

/// An OpenAI-compatible gateway in front of a kernel. Cheap to clone: the
/// clones are one gateway, so a reloader can [`swap`](Gateway::swap) in a
/// new kernel while [`serve`](Gateway::serve) runs.
#[derive(Clone)]
pub struct Gateway {
    shared: Arc<GatewayState>,
}

/// What every request handler shares.
struct GatewayState {
    config: GatewayConfig,
    /// The routes being served; a request takes its route when it starts
    /// and finishes on it, whatever is swapped in meanwhile.
    served: RwLock<RouteTable>,
    /// Places among the requests served at once.
    places: Arc<Semaphore>,
    /// What requests may hold at once, in KiB.
    memory: Arc<Semaphore>,
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
    /// Bumped each time the MCP endpoint is replaced: `/mcp`'s clients
    /// are told its tools may have changed.
    menus: tokio::sync::watch::Sender<u64>,
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
    /// Where the Responses API keeps responses (`previous_response_id`),
    /// each owner's in a namespace of its own (so each under its own cap)
    /// for 30 days; `None`: it keeps none, and a request that asks is a
    /// `400`.
    pub store: Option<Arc<dyn KvStore>>,
}

impl Route {
    /// A proxy route: one request is one chat through `kernel`'s filters.
    pub fn proxy(model: impl Into<String>, kernel: Kernel) -> Self {
        Route {
            model: model.into(),
            kernel,
            mode: RouteMode::Proxy,
            store: None,
        }
    }

    /// The route, keeping the Responses API's responses in `store`.
    pub fn with_store(mut self, store: Arc<dyn KvStore>) -> Self {
        self.store = Some(store);
        self
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
            shared: Arc::new(GatewayState {
                places: Arc::new(Semaphore::new(config.max_concurrent)),
                memory: Arc::new(Semaphore::new(kib(config.max_request_memory))),
                queued: AtomicUsize::new(0),
                served: RwLock::new(RouteTable {
                    routes: routes.into(),
                    keys: Arc::new([]),
                    mcp: None,
                }),
                reloads: Mutex::new(Reloads::default()),
                metrics: Metrics::new(),
                cut: tokio::sync::watch::Sender::new(false),
                draining: tokio::sync::watch::Sender::new(false),
                menus: tokio::sync::watch::Sender::new(0),
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

    /// Serves what a configuration describes ([`Serving::from_config`]) from
    /// now on: its routes, its keys and its MCP endpoint, in one step.
    /// `/mcp`'s clients are told its tools changed, as by
    /// [`set_mcp`](Gateway::set_mcp).
    pub fn swap_serving(&self, served: Serving) {
        self.replace(|table| {
            table.routes = served.routes.into();
            table.keys = served.keys.into();
            table.mcp = served.mcp;
        });
        self.shared.menus.send_modify(|menus| *menus += 1);
    }

    /// Serves `endpoint` at `POST /mcp` from now on (`None`: no endpoint,
    /// `404`). Its clients are told `notifications/tools/list_changed`
    /// (those listening with `subscriptions/listen`, and the sessions of
    /// the initialize handshake), so they list their tools again.
    pub fn set_mcp(&self, endpoint: Option<McpEndpoint>) {
        self.shared
            .served
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .mcp = endpoint;
        self.shared.menus.send_modify(|menus| *menus += 1);
    }

    fn replace(&self, change: impl FnOnce(&mut RouteTable)) {
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
}

impl GatewayState {
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

    fn served(&self) -> RouteTable {
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
        self.metrics.upstreams.set(&served.routes);
    }

    fn reloads(&self) -> MutexGuard<'_, Reloads> {
        self.reloads.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
