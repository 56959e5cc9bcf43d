//! The host's approval handler: what a filter granted the `approval`
//! import asks before a tool runs. The CLI asks a person at the terminal;
//! an embedder installs its own policy with `KernelBuilder::approver`.
//! With none installed, every question is answered no.

use std::sync::Arc;

use async_trait::async_trait;
use serde_json::Value;

use crate::context::Context;

/// A question to the approval handler.
#[derive(Debug, Clone)]
pub struct ApprovalRequest {
    /// The filter that asks.
    pub filter: Arc<str>,
    /// The tool it asks about.
    pub tool: String,
    /// The call's arguments.
    pub arguments: Value,
    /// Why it asks, in the filter's words.
    pub reason: String,
    /// The invoke's shared context (tenant, user, conversation, ...).
    pub context: Context,
}

/// Decides whether a tool call may run.
#[async_trait]
pub trait Approver: Send + Sync + 'static {
    /// `true` approves the call, `false` denies it. The asking filter
    /// bounds the wait; a handler that does not answer in time is a
    /// timeout, which the filter turns into its configured decision.
    async fn approve(&self, request: &ApprovalRequest) -> bool;
}

#[async_trait]
impl<F> Approver for F
where
    F: Fn(&ApprovalRequest) -> bool + Send + Sync + 'static,
{
    async fn approve(&self, request: &ApprovalRequest) -> bool {
        self(request)
    }
}
