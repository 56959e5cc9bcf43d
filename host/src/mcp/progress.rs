//! A call's progress, as its server reports it, relayed to where the
//! invoke's context says (the `/mcp` client whose call it is). The call
//! carries the token the SDK gives each request (never a client's): what
//! the server reports under it goes on until the call ends, and reports
//! under any other token go nowhere. What a server sends past what the
//! client has taken is dropped, and so are its words ([`Progress`]). A
//! report the server makes before the host hears the call's token is lost
//! (the SDK names the token as it sends the call).

use futures::StreamExt;
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::{
    CallToolRequest, CallToolRequestParams, CallToolResult, CancelledNotificationParam,
    ClientRequest, RequestId, ServerResult,
};
use rmcp::service::{Peer, PeerRequestOptions, RoleClient, ServiceError};

use crate::context::{Progress, Report};

/// Calls the tool `params` names over `peer`; where `progress` is given,
/// what the server reports of the call (heard by `reports`) goes to it
/// until the call ends. A call dropped before its answer is cancelled at
/// the server.
pub(super) async fn called(
    peer: &Peer<RoleClient>,
    reports: &ProgressDispatcher,
    params: CallToolRequestParams,
    progress: Option<&Progress>,
) -> Result<CallToolResult, ServiceError> {
    let Some(progress) = progress else {
        return peer.call_tool(params).await;
    };
    let request = ClientRequest::CallToolRequest(CallToolRequest::new(params));
    let handle = peer
        .send_request_with_option(request, PeerRequestOptions::no_options())
        .await?;
    let mut heard = reports.subscribe(handle.progress_token.clone()).await;
    let mut abandoned = Abandoned(Some((peer.clone(), handle.id.clone())));
    let answer = handle.await_response();
    tokio::pin!(answer);
    let answered = loop {
        tokio::select! {
            answer = &mut answer => break answer,
            Some(said) = heard.next() => progress.report(Report {
                progress: said.progress,
                total: said.total,
            }),
        }
    };
    abandoned.0 = None;
    match answered? {
        ServerResult::CallToolResult(result) => Ok(result),
        _ => Err(ServiceError::UnexpectedResponse),
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
        let reason = Some("the call was abandoned".to_owned());
        tokio::spawn(async move {
            let _ = peer
                .notify_cancelled(CancelledNotificationParam::new(Some(id), reason))
                .await;
        });
    }
}
