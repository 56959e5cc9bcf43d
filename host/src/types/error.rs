//! Typed errors. A failure anywhere inside a chain (a filter's own error, a
//! trap, a deadline, a memory cap, a terminal failure) becomes a
//! [`ChainError`] value naming where it came from; nothing inside a chain
//! panics the host or reaches another request.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// The class of a failure, which decides what a caller may do about it.
/// Printed and serialized in kebab-case (`limit-exceeded`), as the WIT
/// contract names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorKind {
    /// Worth retrying: overload, a dropped connection, a 5xx.
    Transient,
    /// A deadline passed.
    Timeout,
    /// Content was blocked.
    ContentFiltered,
    /// The request is wrong; retrying will not help.
    InvalidRequest,
    /// Credentials are missing or refused.
    Auth,
    /// A named thing (tool, model, conversation) does not exist.
    NotFound,
    /// A configured limit was reached.
    LimitExceeded,
    /// A filter trapped, ran out of time or memory, or broke the contract.
    PluginFault,
    /// The host is saturated: an invoke waited longer than the engine's
    /// queue timeout for the instances it needs. Retry later.
    Overloaded,
    /// A bug or an unexpected state in the host.
    Internal,
}

impl ErrorKind {
    /// The kebab-case name used in the WIT contract and in messages.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorKind::Transient => "transient",
            ErrorKind::Timeout => "timeout",
            ErrorKind::ContentFiltered => "content-filtered",
            ErrorKind::InvalidRequest => "invalid-request",
            ErrorKind::Auth => "auth",
            ErrorKind::NotFound => "not-found",
            ErrorKind::LimitExceeded => "limit-exceeded",
            ErrorKind::PluginFault => "plugin-fault",
            ErrorKind::Overloaded => "overloaded",
            ErrorKind::Internal => "internal",
        }
    }
}

/// The call into a filter (or the terminal) that failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// The around-chat hook.
    AroundChat,
    /// The around-tool hook.
    AroundTool,
    /// The around-turn hook.
    AroundTurn,
    /// The system-prompt hook.
    SystemPrompt,
    /// A token transformer's constructor or destructor.
    TokenTransform,
    /// A token transformer's step.
    Step,
    /// A token transformer's flush.
    Flush,
    /// `configure`, with the operator's configuration.
    Configure,
    /// `describe`.
    Describe,
    /// Making the instance (the component's start functions).
    Instantiate,
    /// A terminal's own work: the model's answer, the tool loop's limits.
    Terminal,
}

impl Call {
    /// The kebab-case name, as the WIT contract names the hooks.
    pub fn as_str(self) -> &'static str {
        match self {
            Call::AroundChat => "around-chat",
            Call::AroundTool => "around-tool",
            Call::AroundTurn => "around-turn",
            Call::SystemPrompt => "system-prompt",
            Call::TokenTransform => "token-transform",
            Call::Step => "step",
            Call::Flush => "flush",
            Call::Configure => "configure",
            Call::Describe => "describe",
            Call::Instantiate => "instantiate",
            Call::Terminal => "terminal",
        }
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl PartialEq<&str> for Call {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl PartialEq<str> for Call {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

/// Where an error came from: the filter, its plugin file, and the call.
/// For a terminal's error `filter` names the terminal (`model`, `tools`,
/// `turn`, `tool-loop`) or the host part that failed (`engine`, `kernel`,
/// `gateway`), `plugin` is `None` and `call` is [`Call::Terminal`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The filter's name (or the terminal's).
    pub filter: Arc<str>,
    /// `None` for a native (Rust) filter or a terminal.
    pub plugin: Option<Arc<Path>>,
    /// The call that failed.
    pub call: Call,
}

impl Origin {
    /// The origin of a terminal's (or a host part's) error: `terminal`
    /// names it (`model`, `tool-loop`, `engine`, `gateway`, ...).
    pub fn terminal(terminal: &str) -> Self {
        Origin {
            filter: terminal.into(),
            plugin: None,
            call: Call::Terminal,
        }
    }
}

impl Origin {
    /// Where the error came from as a client or another filter is told
    /// it: the filter's name and the call (or the terminal), never the
    /// plugin's file.
    pub fn public(&self) -> String {
        if self.call == Call::Terminal {
            return format!("the {}", self.filter);
        }
        format!("filter '{}' in {}", self.filter, self.call)
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.call == Call::Terminal {
            return write!(f, "the {}", self.filter);
        }
        write!(f, "filter '{}'", self.filter)?;
        if let Some(plugin) = &self.plugin {
            write!(f, " ({})", plugin.display())?;
        }
        write!(f, " in {}", self.call)
    }
}

/// What lies behind a failure, where the host knows more than its kind
/// says: a client can be told apart what the model server did and what a
/// store did (the gateway answers a store's failure `503`
/// `store_unavailable`, not `502` `upstream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Cause {
    /// A shared store (keys, conversations, kept responses) did not
    /// answer in time, or could not be reached: this error, or a filter's
    /// own transient error in a call in which one of its stores failed.
    StoreUnavailable,
}

/// A failure inside a chain, as a value.
#[derive(Debug, Clone, PartialEq)]
pub struct ChainError {
    /// What class of failure it is.
    pub kind: ErrorKind,
    /// What happened, in words (text from a filter is made printable).
    pub message: String,
    /// The filter (or terminal, or host part) it came from.
    pub origin: Option<Origin>,
    /// For the operator only: what a faulted filter wrote to stderr in the
    /// call, and the wasm backtrace. In the error's `Display` (the log, the
    /// CLI), never in what a client or another filter is told
    /// ([`ChainError::public`]).
    pub detail: Option<String>,
    /// For a turn that stopped at a limit: what it had done by then (the
    /// tool calls made, the messages so far).
    pub ran: Option<Arc<super::TurnDone>>,
    /// What lies behind it, where the host knows ([`Cause`]).
    pub cause: Option<Cause>,
}

impl ChainError {
    /// An error of `kind` not attributed to a filter.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ChainError {
            kind,
            message: message.into(),
            origin: None,
            detail: None,
            ran: None,
            cause: None,
        }
    }

    /// The error, with what lies behind it.
    pub fn because(mut self, cause: Cause) -> Self {
        self.cause = Some(cause);
        self
    }

    /// The error as a client or another filter is told it: where it came
    /// from by name and call ([`Origin::public`]), what happened, and its
    /// kind; no plugin file, stderr or backtrace.
    pub fn public(&self) -> String {
        match &self.origin {
            Some(origin) => format!(
                "{}: {} ({})",
                origin.public(),
                self.message,
                self.kind.as_str()
            ),
            None => format!("{} ({})", self.message, self.kind.as_str()),
        }
    }

    /// Attributes the error to `origin`.
    pub fn at(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }
}

impl fmt::Display for ChainError {
    /// The whole error, for the operator: the plugin file, and what the
    /// filter wrote or where it trapped.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(origin) = &self.origin {
            write!(f, "{origin}: ")?;
        }
        write!(f, "{} ({})", self.message, self.kind.as_str())?;
        if let Some(detail) = &self.detail {
            write!(f, "; {detail}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ChainError {}
