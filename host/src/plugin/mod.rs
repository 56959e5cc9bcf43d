//! WebAssembly filters: loading plugin files, configuring filters from
//! them, and running their hooks in sandboxed instances.
//!
//! `loader` reads and compiles one file; `set` loads a whole plugins
//! directory or `shallot.toml`; `filter` is a configured filter and
//! `instance` one of its instances (`crate::admission` hands them to
//! invokes); `host` is what an instance imports; `convert` maps WIT types
//! to ours.

pub(crate) mod bindings;
mod config;
mod convert;
mod filter;
pub(crate) mod host;
mod instance;
mod loader;
mod set;

pub use config::{read_config, read_dir, read_model};
pub(crate) use filter::WasmTokenTransform;
pub use filter::{Isolation, WasmFilter};
pub(crate) use instance::FilterInstance;
pub use loader::{
    FilterSpec, LoadError, Plugin, WIT_PACKAGE, WIT_VERSION, cache_state, compile, configure, read,
};
pub use set::{LoadEvent, PluginSet};
