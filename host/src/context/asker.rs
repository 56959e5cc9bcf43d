//! Whom the server behind a tool may ask, during a call, for a model's
//! answer (`sampling/createMessage`) or a person's
//! (`elicitation/create`), and tell what it logs: the `/mcp` client whose
//! call it is, where it said it can answer. Carried on the invoke's context, the host's own (no
//! filter sees or sets it), to the terminal that calls the server; a call
//! with no one to ask is refused to the server, saying so, never answered
//! on anyone's behalf.

use async_trait::async_trait;
use serde_json::Value;

/// Who answers a server's questions during a call, as JSON (the
/// protocol's params and results).
#[async_trait]
pub(crate) trait Asker: std::fmt::Debug + Send + Sync + 'static {
    /// The answer to a `sampling/createMessage` with `params`, or why
    /// there is none.
    async fn sample(&self, params: Value) -> Result<Value, String>;
    /// The answer to an `elicitation/create` with `params`, or why there
    /// is none.
    async fn elicit(&self, params: Value) -> Result<Value, String>;
    /// Passes on a `notifications/message` (a log line) with `params`, if
    /// the client takes it at its level.
    fn log(&self, params: Value);
}
