//! What an operator grants a filter beyond the default nothing.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::conversation::StoreSpec;

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
}

/// The `kv` grant: a store (as for `memory`), and the namespace of the
/// filter's keys: its own name unless the operator names one, so that the
/// filters naming the same one share keys. Written `kv = "<store>"` or
/// `kv = { store = "<store>", namespace = "<name>" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "KvForm")]
pub struct KvGrant {
    /// Where the keys are kept.
    pub store: StoreSpec,
    /// The namespace; `None`: the filter's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl From<StoreSpec> for KvGrant {
    fn from(store: StoreSpec) -> Self {
        KvGrant {
            store,
            namespace: None,
        }
    }
}

/// The two ways an operator writes a `kv` grant.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a store (a SQLite file's path, a redis:// URL or \":memory:\") or a table { store = \"...\", namespace = \"...\" }"
)]
enum KvForm {
    Store(StoreSpec),
    Table(KvTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KvTable {
    store: StoreSpec,
    namespace: Option<String>,
}

impl From<KvForm> for KvGrant {
    fn from(form: KvForm) -> Self {
        match form {
            KvForm::Store(store) => store.into(),
            KvForm::Table(KvTable { store, namespace }) => KvGrant { store, namespace },
        }
    }
}

/// Where a filter's `trace` events go, parsed once from the operator's
/// text: `"stderr"`, else a file's path, appended to (created if missing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum TraceTarget {
    /// The host's standard error.
    Stderr,
    /// A file, one JSON line per event.
    File(PathBuf),
}

impl From<&str> for TraceTarget {
    fn from(target: &str) -> Self {
        match target {
            "stderr" => TraceTarget::Stderr,
            path => TraceTarget::File(path.into()),
        }
    }
}

impl From<String> for TraceTarget {
    fn from(target: String) -> Self {
        TraceTarget::from(target.as_str())
    }
}

impl From<PathBuf> for TraceTarget {
    fn from(path: PathBuf) -> Self {
        TraceTarget::File(path)
    }
}

impl From<TraceTarget> for String {
    fn from(target: TraceTarget) -> Self {
        target.to_string()
    }
}

impl fmt::Display for TraceTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceTarget::Stderr => f.write_str("stderr"),
            TraceTarget::File(path) => write!(f, "{}", path.display()),
        }
    }
}
