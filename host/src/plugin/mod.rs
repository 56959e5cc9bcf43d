//! WebAssembly filters: loading plugin files, configuring filters from
//! them, and running their hooks in sandboxed instances.
//!
//! `loader` reads and compiles one file; `set` loads a whole plugins
//! directory or a `shallot.toml`; `filter` is a configured filter (a
//! [`Guest`](crate::onion::Guest) of the onion) and `instance` one of its
//! instances, which `admission` reserves for invokes and hands to their
//! calls; `host` is what an instance imports; `convert` maps WIT types to
//! ours; `stats` counts what each filter did, and `metrics` keeps the
//! metrics it declares.

mod admission;
pub(crate) mod bindings;
mod convert;
mod error;
mod filter;
mod grants;
pub(crate) mod host;
mod instance;
mod loader;
mod making;
mod metrics;
mod set;
mod stats;

pub(crate) use admission::{admit, need};
pub use error::LoadError;
pub use filter::{Isolation, WasmFilter};
pub use grants::Grants;
pub use host::{HttpGrant, HttpOrigin, KvGrant, ModelGrant, TraceTarget};
pub(crate) use instance::FilterInstance;
pub use loader::{
    FilterSpec, Plugin, WIT_PACKAGE, WIT_VERSION, cache_state, compile_plugin, configure_filter,
    read_plugin,
};
pub use metrics::{FilterMetric, HISTOGRAM_BUCKETS, MetricKind, MetricValue};
pub use set::{FilterSet, LoadEvent};
pub use stats::{CallStats, FilterStats, OWN_TIME_BUCKETS};
