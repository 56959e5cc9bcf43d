//! What an operator grants a filter beyond the default nothing.

use serde::{Deserialize, Serialize};

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
    /// Where the filter's `trace` events go: `"stderr"`, or a file that
    /// is appended to (created if missing). `None`: no tracing.
    pub trace: Option<String>,
    /// The conversation store of the `memory` import: a SQLite file's
    /// path, a `redis://` URL, or `:memory:` (this process only;
    /// `:memory:<name>` for another one). `None`: no store.
    pub memory: Option<String>,
}
