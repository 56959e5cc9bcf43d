//! shallot: a WebAssembly plugin host for the filters of an LLM agent kernel.
//!
//! Filters are onion layers around a model call (the chat chain), a tool
//! call (the tool chain) and a whole agent turn (the turn chain), plus a
//! streaming token transform. They are WebAssembly components written in
//! any language that targets WASI 0.2, each sandboxed in its own store: a
//! hostile or broken filter fails its own request and nothing else.
//!
//! ```no_run
//! use shallot::{Context, Engine, EngineConfig, Kernel, PluginSet};
//! use shallot::types::{ChatRequest, Message};
//!
//! # async fn run() -> anyhow::Result<()> {
//! let engine = Engine::new(EngineConfig::default())?;
//! let plugins = PluginSet::from_dir(&engine, "plugins".as_ref(), &mut |_| {}).await?;
//! let kernel = Kernel::builder().plugins(&plugins).build()?;
//! let response = kernel.chat(ChatRequest::new(vec![Message::user("hello")]), Context::new()).await?;
//! println!("{}", response.text());
//! # Ok(())
//! # }
//! ```
//!
//! The crate is organised along the data flow: `plugin` loads filters,
//! `kernel` composes them (`onion`) over terminals (`model`, `tool`), and
//! each call is an `invoke` with its own context; `sandbox` and `engine` are
//! the wasmtime core everything else builds on; `token_transform` is the
//! token chain.

#![warn(missing_docs)]

mod admission;
pub mod agent;
pub mod cache;
mod compile;
pub mod context;
pub mod engine;
pub mod error;
pub mod invoke;
pub mod kernel;
pub mod model;
pub mod onion;
pub mod plugin;
pub mod sandbox;
pub mod token_transform;
pub mod tool;
pub mod types;

pub use agent::{History, LoopConfig, MemoryHistory, ToolLoop};
pub use context::Context;
pub use engine::{Engine, EngineConfig, EngineError};
pub use error::{Call, ChainError, ErrorKind, Origin};
pub use invoke::{Invoke, InvokeOptions};
pub use kernel::{BuildError, Kernel, KernelBuilder};
pub use model::{ChatModel, EmbeddedModel, ModelEvent, OpenAiConfig, OpenAiModel, ResponseLimits};
pub use onion::{ChainKind, Chat, Fctx, Filter, Hook, Next, Terminal, Tool, Turn};
pub use plugin::{FilterSpec, Isolation, LoadError, LoadEvent, PluginSet, WasmFilter};
pub use sandbox::{Grants, Limits};
pub use token_transform::{TokenSink, TokenStream, TokenTransform};
pub use tool::ToolRegistry;
pub use types::Decision;
