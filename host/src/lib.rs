//! shallot: a WebAssembly plugin host for the filters of an LLM agent kernel.
//!
//! Filters are onion layers around a model call (the chat chain), a tool
//! call (the tool chain) and a whole agent turn (the turn chain), plus a
//! streaming token transform. They are WebAssembly components written in
//! any language that targets WASI 0.2, each sandboxed in its own store: a
//! hostile or broken filter fails its own request and nothing else.
//!
//! ```no_run
//! use shallot::{Context, Engine, EngineConfig, Kernel, FilterSet};
//! use shallot::types::{ChatRequest, Message};
//!
//! # async fn run() -> anyhow::Result<()> {
//! let engine = Engine::new(EngineConfig::default())?;
//! let plugins = FilterSet::from_dir(&engine, "plugins".as_ref(), &mut |_| {}).await?;
//! let kernel = Kernel::builder().plugins(&plugins).build()?;
//! let response = kernel.chat(ChatRequest::new(vec![Message::user("hello")]), Context::new()).await?;
//! println!("{}", response.text());
//! # Ok(())
//! # }
//! ```
//!
//! # Layers
//!
//! The modules form layers, lowest first. A module imports only from
//! modules before it in this list (`scripts/check-layers` checks it), so
//! data flows one way: configuration -> plugin set -> onion -> terminals.
//!
//! layers: escape tls context types sandbox store conversation kv cache compile engine onion plugin tool mcp model agent kernel config gateway
//!
//! - `escape`: text from guests, models and clients made safe for a
//!   terminal, a log line or a JSON line.
//! - `tls`: the TLS client every outgoing connection uses.
//! - `context`, `types`: the data that flows through the chains (messages,
//!   requests, responses, tokens, typed errors) and the shared context.
//! - `sandbox`, `conversation`, `kv`, `cache`, `compile`, `engine`: the wasmtime core
//!   (limits, meters, faults; the conversation stores the `memory` grant
//!   opens and the key stores the `kv` grant opens; compiled-code cache; out-of-process compiles; the engine and
//!   its instance slots). No plugin state.
//! - `onion`: composition of the chains, one call's `Invoke`, the token
//!   transforms; a sandboxed filter is one more `Filter` to it.
//! - `plugin`: wasm filters (loading, instances, admission, the host side
//!   of the WIT contract): `WasmFilter`, a `Filter` the onion runs.
//! - `tool`, `mcp`, `model`, `agent`: the terminals (tools, MCP servers'
//!   tools, models, the tool loop).
//! - `kernel`: builds the onions over the terminals and runs invokes.
//! - `config`: `shallot.toml` and plugins directories, read into specs.
//! - `gateway`: the OpenAI-compatible HTTP server in front of a kernel
//!   (`shallot serve`).
//!
//! `docs/ARCHITECTURE.md` says what each module owns and may not touch,
//! and the invariants.
//!
//! Every module is private; the items meant for users are re-exported here,
//! each reachable by one path, except the data types, which live in
//! [`types`].

#![warn(missing_docs)]
#![warn(clippy::too_many_lines)]

mod agent;
mod cache;
mod compile;
mod config;
mod context;
mod conversation;
mod engine;
mod escape;
mod gateway;
mod kernel;
mod kv;
mod mcp;
mod model;
mod onion;
mod plugin;
mod sandbox;
mod store;
mod tls;
mod tool;
pub mod types;

pub use agent::{History, LoopConfig, MemoryHistory, NoHistory, OnEnvError, ToolLoop};
pub use cache::{Cache, CacheState};
pub use config::{
    ClientKey, Config, PRESETS, PoolMember, RouteMode, RouteSpec, Upstream, preset, read_config,
    read_dir,
};
pub use context::{
    CACHE, CANCELLED, CLIENT_KEY, CONVERSATION_ID, Context, HOPS, IDENTITY_KEYS, MAX_HOPS,
    RATE_LIMIT, Reducers, TENANT, UPSTREAM, USER,
};
pub use conversation::{
    CONVERSATION_CAP, ConversationStore, IN_PROCESS_CAP, IN_PROCESS_PART_CAP, LOAD_LIMIT, PART_CAP,
    STORE_CAP, open_store,
};
pub use engine::{Engine, EngineConfig, EngineError, MAX_MEMORY_MIB};
pub use escape::{json_line, terminal_line, terminal_text};
pub use gateway::{
    CONVERSATION_HEADER, Gateway, GatewayConfig, MAX_UNSENT_BYTES, McpEndpoint, OPENAPI, Route,
    RouteError, Serving,
};
pub use kernel::{BuildError, Kernel, KernelBuilder};
pub use kv::{
    Count, Entry, KvStore, NAMESPACE_CAP, Period, STORED_NAMESPACE_CAP, Seen, Taken, Window,
    open_kv,
};
pub use mcp::{McpConfig, McpError, McpServer, ResourceWatch};
pub use model::{
    AnthropicConfig, AnthropicModel, BUDGET_HEADER, BUDGET_LEFT_HEADER, ChatModel, EmbeddedModel,
    HOPS_HEADER, HttpModel, ModelEvent, OpenAiConfig, OpenAiModel, PoolConfig, ResponseLimits,
    Server, UpstreamHealth, UpstreamPool,
};
pub use onion::{
    ApprovalRequest, Approver, Cancel, ChainKind, Chat, Fctx, Filter, FilterScope, Hook, Invoke,
    InvokeOptions, Next, Terminal, TokenSink, TokenStream, TokenTransform, Tool, Turn,
};
pub use plugin::{
    CallStats, FilterMetric, FilterSet, FilterSpec, FilterStats, Grants, HISTOGRAM_BUCKETS,
    HttpGrant, HttpOrigin, Isolation, KvGrant, LoadError, LoadEvent, MetricKind, MetricValue,
    ModelGrant, OWN_TIME_BUCKETS, Plugin, TraceTarget, WIT_PACKAGE, WIT_VERSION, WasmFilter,
    cache_state, compile_plugin, configure_filter, read_plugin,
};
pub use sandbox::Limits;
pub use store::{StoreSpec, StoreState, store_states};
pub use tool::ToolRegistry;
pub use types::error::{Call, Cause, ChainError, ErrorKind, Origin};
