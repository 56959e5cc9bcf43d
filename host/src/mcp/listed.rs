//! A server's tools (and what else it offers) as last listed, listed
//! again when it says they changed, and what the host does with the
//! server's notifications.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use std::collections::HashMap;
use std::sync::Mutex;

use rmcp::handler::client::progress::ProgressDispatcher;
#[allow(deprecated, reason = "servers of the 2025 protocols log so")]
use rmcp::model::LoggingMessageNotificationParam;
use rmcp::model::{
    ClientConfig, ElicitRequestParams, ElicitResult, Implementation, ProgressNotificationParam,
    RequestId, ResourceUpdatedNotificationParam, Tool,
};
#[allow(deprecated, reason = "servers of the 2025 protocols ask for sampling")]
use rmcp::model::{CreateMessageRequestParams, CreateMessageResult};
use rmcp::service::{InboundStreamOrigin, NotificationContext, Peer, RequestContext, RoleClient};
use rmcp::{ClientHandler, ErrorData};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::watch;

use super::offered::{Listing, Offered};
use crate::context::Asker;

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
    /// Whom the server may ask during each call in flight, by the call's
    /// request id.
    pub(super) askers: Askers,
}

/// Whom the server may ask during each call in flight.
pub(super) type Askers = Mutex<HashMap<RequestId, Arc<dyn Asker>>>;

/// A call's asker, registered while the call is in flight.
pub(super) struct Asked<'a> {
    askers: &'a Askers,
    id: RequestId,
}

impl<'a> Asked<'a> {
    pub(super) fn new(askers: &'a Askers, id: RequestId, asker: Arc<dyn Asker>) -> Self {
        let mut held = askers.lock().unwrap_or_else(PoisonError::into_inner);
        held.insert(id.clone(), asker);
        Asked { askers, id }
    }
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        let mut held = self.askers.lock().unwrap_or_else(PoisonError::into_inner);
        held.remove(&self.id);
    }
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

impl Listener {
    /// Who answers the server's request `context`: the asker of the call
    /// on whose response stream it came (the protocol's association); for
    /// one that came on no call's stream (over stdio, or on the server's
    /// own stream, where servers that name no related request send it),
    /// the asker of the one call in flight that has one, if only one has
    /// (the SDK's own coarse association); else no one.
    fn asker(&self, context: &RequestContext<RoleClient>) -> Result<Arc<dyn Asker>, ErrorData> {
        let held = self.0.askers.lock().unwrap_or_else(PoisonError::into_inner);
        let asker = match context.extensions.get::<InboundStreamOrigin>() {
            Some(InboundStreamOrigin::OutboundRequest(id)) => held.get(id).cloned(),
            _ if held.len() == 1 => held.values().next().cloned(),
            _ => None,
        };
        asker.ok_or_else(|| {
            ErrorData::invalid_request(
                "no one can answer this: it came during no call (or during several) of a client that said it answers it",
                None,
            )
        })
    }

    /// `params` to `ask` (the asker's), within the server's call bound:
    /// its answer, or why there is none.
    async fn ask<P: Serialize, T: DeserializeOwned, F>(
        &self,
        params: P,
        ask: impl FnOnce(Value) -> F,
    ) -> Result<T, ErrorData>
    where
        F: Future<Output = Result<Value, String>>,
    {
        let params = serde_json::to_value(params)
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let answer = tokio::time::timeout(self.0.timeout, ask(params)).await;
        let answer = answer
            .map_err(|_| ErrorData::internal_error("the client did not answer in time", None))?
            .map_err(|why| ErrorData::internal_error(why, None))?;
        serde_json::from_value(answer)
            .map_err(|e| ErrorData::internal_error(format!("the client's answer: {e}"), None))
    }
}

impl ClientHandler for Listener {
    /// The host says it can answer sampling and elicitation: it passes
    /// each to the client of the call it came in, if that client can.
    fn get_info(&self) -> ClientConfig {
        let capabilities = serde_json::from_value(serde_json::json!({
            "sampling": {},
            "elicitation": { "form": {}, "url": {} },
        }))
        .unwrap_or_default();
        ClientConfig::new(
            capabilities,
            Implementation::new("shallot", env!("CARGO_PKG_VERSION")),
        )
    }

    #[allow(deprecated, reason = "servers of the 2025 protocols ask for sampling")]
    async fn create_message(
        &self,
        params: CreateMessageRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<CreateMessageResult, ErrorData> {
        let asker = self.asker(&context)?;
        self.ask(params, |params| async move { asker.sample(params).await })
            .await
    }

    async fn create_elicitation(
        &self,
        params: ElicitRequestParams,
        context: RequestContext<RoleClient>,
    ) -> Result<ElicitResult, ErrorData> {
        let asker = self.asker(&context)?;
        self.ask(params, |params| async move { asker.elicit(params).await })
            .await
    }

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

    /// A log line goes to the client of the one call in flight whose
    /// client hears them, if only one is (a notification carries no mark
    /// of the stream it came on); else nowhere.
    #[allow(deprecated, reason = "servers of the 2025 protocols log so")]
    async fn on_logging_message(
        &self,
        params: LoggingMessageNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        let asker = {
            let held = self.0.askers.lock().unwrap_or_else(PoisonError::into_inner);
            (held.len() == 1)
                .then(|| held.values().next().cloned())
                .flatten()
        };
        if let (Some(asker), Ok(params)) = (asker, serde_json::to_value(params)) {
            asker.log(params);
        }
    }

    async fn on_progress(
        &self,
        params: ProgressNotificationParam,
        _: NotificationContext<RoleClient>,
    ) {
        self.0.reports.handle_notification(params).await;
    }
}
