//! What an operator grants a filter beyond the default nothing: each
//! field a service's grant, each service a unit of its own under
//! `plugin/host/` (its grant's type, where it may be called, what it
//! spends: see `plugin::host::service`).

use serde::{Deserialize, Serialize};

use crate::plugin::host::{HttpGrant, KvGrant, ModelGrant, TraceTarget};
use crate::store::StoreSpec;

/// Capabilities an operator grants a filter beyond the default nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Grants {
    /// Real wall and monotonic clocks (otherwise both read zero).
    pub clock: bool,
    /// Milliseconds one hook call may sleep through the `timer` import, in
    /// all (0, the default: none).
    pub sleep_ms: u32,
    /// Whether the filter may ask the host's approval handler (the
    /// `approval` import).
    pub approval: bool,
    /// Where the filter's `trace` events go. `None`: no tracing.
    pub trace: Option<TraceTarget>,
    /// The conversation store of the `memory` import. `None`: no store.
    pub memory: Option<StoreSpec>,
    /// The key store of the `kv` import, and the namespace its keys live
    /// in. `None`: no store.
    pub kv: Option<KvGrant>,
    /// The origins `wasi:http/outgoing-handler` may reach, and its bounds.
    /// `None`: every request is refused.
    pub http: Option<HttpGrant>,
    /// The model of the `model` import (side calls), and its bounds.
    /// `None`: no side calls.
    pub model: Option<ModelGrant>,
}
