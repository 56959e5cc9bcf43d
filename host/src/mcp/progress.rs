//! A call's progress, as its server reports it, relayed to where the
//! invoke's context says (the `/mcp` client whose call it is). The call
//! carries the token the SDK gives each request (never a client's): what
//! the server reports under it goes on until the call ends, and reports
//! under any other token go nowhere. What a server sends past what the
//! client has taken is dropped, and so are its words ([`Progress`]). A
//! report the server makes before the host hears the call's token, or that
//! arrives after the call's answer, is lost (the SDK names the token as it
//! sends the call, and hands each notification to a task of its own); one
//! not above the last passed on is dropped, so the client sees progress
//! grow.

use std::sync::Arc;

use futures::{FutureExt, StreamExt};
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, CancelledNotificationParam,
    ClientRequest, ProgressNotificationParam, RequestId, ServerResult,
};
use rmcp::service::{Peer, PeerRequestOptions, RoleClient, ServiceError};

use super::listed::{Asked, Askers};
use crate::context::{Asker, Progress, Report};

/// Whom a call reports its progress to and whom its server may ask.
#[derive(Clone, Copy)]
pub(super) struct Caller<'a> {
    pub(super) progress: Option<&'a Progress>,
    pub(super) asker: Option<&'a Arc<dyn Asker>>,
}

/// Calls the tool `params` names over `peer`; where the caller takes
/// progress, what the server reports of the call (heard by `reports`)
/// goes to it until the call ends, and where it answers questions, what
/// the server asks during the call (registered in `askers`) goes to it. A
/// call dropped before its answer is cancelled at the server.
pub(super) async fn called(
    peer: &Peer<RoleClient>,
    (reports, askers): (&ProgressDispatcher, &Askers),
    params: CallToolRequestParams,
    caller: Caller<'_>,
) -> Result<CallToolResult, ServiceError> {
    if caller.progress.is_none() && caller.asker.is_none() {
        return peer.call_tool(params).await;
    }
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
    let handle = peer
        .send_request_with_option(request, PeerRequestOptions::no_options())
        .await?;
    let _asked = caller
        .asker
        .map(|asker| Asked::new(askers, handle.id.clone(), asker.clone()));
    let (mut heard, progress) = match caller.progress {
        Some(progress) => (
            Some(reports.subscribe(handle.progress_token.clone()).await),
            Some(progress),
        ),
        None => (None, None),
    };
    let mut abandoned = Abandoned(Some((peer.clone(), handle.id.clone())));
    let answer = handle.await_response();
    tokio::pin!(answer);
    let mut relay = progress.map(|progress| Relay {
        progress,
        last: None,
    });
    let answered = match (&mut heard, &mut relay) {
        (Some(heard), Some(relay)) => loop {
            tokio::select! {
                biased;
                Some(said) = heard.next() => relay.pass(&said),
                answer = &mut answer => break answer,
            }
        },
        _ => answer.await,
    };
    abandoned.0 = None;
    // The SDK hands each notification to a task of its own, so a report the
    // server made just before its answer may still be on its way: what has
    // come by the time those tasks have had their turns goes on too.
    if let (Some(heard), Some(relay)) = (&mut heard, &mut relay) {
        for _ in 0..LATE_TURNS {
            tokio::task::yield_now().await;
            while let Some(Some(said)) = heard.next().now_or_never() {
                relay.pass(&said);
            }
        }
    }
    match answered? {
        ServerResult::CallToolResult(result) => Ok(result),
        _ => Err(ServiceError::UnexpectedResponse),
    }
}

/// How many turns the reports still on their way get after the answer.
const LATE_TURNS: usize = 4;

/// Passes a call's reports on, each above the one before: the SDK's tasks
/// may hand them over out of order, and progress only grows.
struct Relay<'a> {
    progress: &'a Progress,
    last: Option<f64>,
}

impl Relay<'_> {
    fn pass(&mut self, said: &ProgressNotificationParam) {
        if self.last.is_some_and(|last| said.progress <= last) {
            return;
        }
        self.last = Some(said.progress);
        self.progress.report(Report {
            progress: said.progress,
            total: said.total,
        });
    }
}

/// A call sent and not yet answered: dropped so, it is cancelled at the
/// server (`notifications/cancelled`), as the SDK's own calls are.
struct Abandoned(Option<(Peer<RoleClient>, RequestId)>);

impl Drop for Abandoned {
    fn drop(&mut self) {
        let Some((peer, id)) = self.0.take() else {
            return;
        };
        // Dropped outside a runtime (an embedder's sync code), there is no
        // one to send it.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let reason = Some("the call was abandoned".to_owned());
        runtime.spawn(async move {
            let _ = peer
                .notify_cancelled(CancelledNotificationParam::new(Some(id), reason))
                .await;
        });
    }
}
