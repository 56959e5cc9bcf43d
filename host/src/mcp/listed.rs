//! A server's tools (and what else it offers) as last listed, listed
//! again when it says they changed, and what the host does with the
//! server's notifications.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use rmcp::ClientHandler;
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::{ProgressNotificationParam, ResourceUpdatedNotificationParam, Tool};
use rmcp::service::{NotificationContext, Peer, RoleClient};
use tokio::sync::watch;

use super::offered::{Listing, Offered};

/// A server's tools as last listed, and who is told when they change.
pub(super) struct Listed {
    pub(super) tools: RwLock<Vec<Tool>>,
    /// Counts the changes; [`McpServer::changed`] waits for the next.
    pub(super) changes: watch::Sender<u64>,
    /// Set while a listing runs; `again` asks it for one more.
    pub(super) listing: AtomicBool,
    pub(super) again: AtomicBool,
    pub(super) name: String,
    pub(super) timeout: Duration,
    /// Where the progress the server reports on a call goes.
    pub(super) reports: ProgressDispatcher,
    /// Its prompts, resources and templates.
    pub(super) offered: Offered,
}

impl Listed {
    /// The tools as last listed.
    pub(super) fn held(&self) -> RwLockReadGuard<'_, Vec<Tool>> {
        self.tools.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The tools, listed over `peer` within `bound`.
    pub(super) async fn fetch(
        &self,
        peer: &Peer<RoleClient>,
        bound: Duration,
    ) -> Result<Vec<Tool>, String> {
        match tokio::time::timeout(bound, peer.list_all_tools()).await {
            Ok(Ok(tools)) => Ok(tools),
            Ok(Err(e)) => Err(format!("tools/list failed: {e}")),
            Err(_) => Err(format!("tools/list took over {} ms", bound.as_millis())),
        }
    }

    /// Lists the tools and what else it offers over `peer`, and says so
    /// if they changed.
    pub(super) async fn list(&self, peer: &Peer<RoleClient>) -> Result<(), String> {
        let tools = self.fetch(peer, self.timeout).await?;
        let offered = tokio::time::timeout(self.timeout, Listing::fetch(peer)).await;
        let offered =
            offered.map_err(|_| format!("listing took over {} ms", self.timeout.as_millis()))??;
        let mut held = self.tools.write().unwrap_or_else(PoisonError::into_inner);
        let tools_changed = *held != tools;
        *held = tools;
        drop(held);
        if self.offered.keep(offered) || tools_changed {
            self.changes.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// Lists again after the server said its tools changed: one listing
    /// at a time, and one more for what was said meanwhile, however often
    /// a server says it.
    pub(super) async fn relist(&self, peer: &Peer<RoleClient>) {
        self.again.store(true, Ordering::Release);
        // Whoever holds `listing` lists until nothing more was asked; one
        // that finds it held leaves its ask to the holder.
        while !self.listing.swap(true, Ordering::AcqRel) {
            while self.again.swap(false, Ordering::AcqRel) {
                if let Err(e) = self.list(peer).await {
                    tracing::warn!(server = %self.name, "its tools changed, and listing them: {e}");
                }
            }
            self.listing.store(false, Ordering::Release);
            if !self.again.load(Ordering::Acquire) {
                return;
            }
        }
    }
}

/// What the host does with a server's notifications: lists its tools,
/// prompts and resources again when it says they changed, and passes on
/// the progress it reports on a call and the resources it says were
/// updated.
#[derive(Clone)]
pub(super) struct Listener(pub(super) Arc<Listed>);

impl ClientHandler for Listener {
    async fn on_tool_list_changed(&self, context: NotificationContext<RoleClient>) {
        self.0.relist(&context.peer).await;
    }

    async fn on_prompt_list_changed(&self, context: NotificationContext<RoleClient>) {
        self.0.relist(&context.peer).await;
    }

    async fn on_resource_list_changed(&self, context: NotificationContext<RoleClient>) {
        self.0.relist(&context.peer).await;
    }

    async fn on_resource_updated(
        &self,
        params: ResourceUpdatedNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        // None may be listening.
        let _ = self.0.offered.updated.send(params.uri);
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        self.0.reports.handle_notification(params).await;
    }
}
