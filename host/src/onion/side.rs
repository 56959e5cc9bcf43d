//! Models a filter may call aside (the `model` import, `grants.model`):
//! outside the onion, so no filter sees the call and nothing of it reaches
//! the caller's stream. The kernel names its own model `default` and the
//! embedded one `embedded`; an embedder adds others with
//! `KernelBuilder::side_model`.

use std::sync::Arc;

use async_trait::async_trait;

use super::Invoke;
use crate::context::Context;
use crate::types::{ChainError, ChatRequest, ChatResponse};

/// A model answering side calls.
#[async_trait]
pub trait SideModel: Send + Sync + 'static {
    /// Answers `request` in one piece, for a filter of `invoke`.
    async fn side_chat(
        &self,
        request: ChatRequest,
        invoke: &Arc<Invoke>,
        context: &Context,
    ) -> Result<ChatResponse, ChainError>;
}
