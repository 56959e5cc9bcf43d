//! One invoke: a single call into the kernel (a chat, a tool call or a
//! turn) with its shared context, every filter's private context (FCtx),
//! and the filter instances it holds.
//!
//! FCtx lives here, in the host, keyed by filter: seeded from the filter's
//! init on first entry, handed to each hook call and taken back. Nothing a
//! filter keeps survives the invoke, so an instance never has to.

use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::OwnedSemaphorePermit;

use crate::context::Context;
use crate::error::ChainError;
use crate::kernel::Core;
use crate::onion::{Fctx, Next};
use crate::plugin::pool::Lease;
use crate::stream::TokenSink;
use crate::types::{ChatRequest, ChatResponse, ToolRequest, ToolResponse};

/// A call in progress. Terminals get it to reach the shared context and,
/// for the turn terminal, the chat and tool chains of the same invoke.
pub struct Invoke {
    core: Arc<Core>,
    context: Context,
    fctx: Mutex<Vec<Option<Fctx>>>,
    pub(crate) leases: Box<[Lease]>,
    sink: Option<Arc<dyn TokenSink>>,
    /// The instance slots reserved for this invoke, released when it ends.
    _admission: Option<OwnedSemaphorePermit>,
}

impl Invoke {
    pub(crate) fn new(
        core: Arc<Core>,
        context: Context,
        sink: Option<Arc<dyn TokenSink>>,
        leases: Box<[Lease]>,
        admission: Option<OwnedSemaphorePermit>,
    ) -> Self {
        let fctx = Mutex::new(vec![None; core.filters.len()]);
        Invoke {
            core,
            context,
            fctx,
            leases,
            sink,
            _admission: admission,
        }
    }

    /// The shared context.
    pub fn context(&self) -> &Context {
        &self.context
    }

    /// Runs the chat chain within this invoke (the turn loop's model call).
    /// Tokens stream to the invoke's sink, if it has one.
    pub async fn chat(self: &Arc<Self>, request: ChatRequest) -> Result<ChatResponse, ChainError> {
        Next::start(self.core.chat.clone(), self.clone())
            .call(request)
            .await
    }

    /// Runs the tool chain within this invoke.
    pub async fn tool(self: &Arc<Self>, request: ToolRequest) -> Result<ToolResponse, ChainError> {
        Next::start(self.core.tool.clone(), self.clone())
            .call(request)
            .await
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.core
    }

    pub(crate) fn sink(&self) -> Option<&Arc<dyn TokenSink>> {
        self.sink.as_ref()
    }

    /// Filter `id`'s private context: its latest state, or its init.
    pub(crate) fn fctx(&self, id: usize) -> Fctx {
        let states = self.fctx.lock().unwrap_or_else(PoisonError::into_inner);
        states[id]
            .clone()
            .unwrap_or_else(|| self.core.filters[id].init.clone())
    }

    pub(crate) fn set_fctx(&self, id: usize, fctx: Fctx) {
        self.fctx.lock().unwrap_or_else(PoisonError::into_inner)[id] = Some(fctx);
    }
}

impl Drop for Invoke {
    fn drop(&mut self) {
        // Warm filters get their instances back; the rest are dropped.
        for (id, lease) in self.leases.iter_mut().enumerate() {
            if let Some(filter) = self.core.filters[id].wasm() {
                filter.reclaim(lease.drain());
            }
        }
    }
}
