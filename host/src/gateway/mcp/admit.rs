//! What `/mcp` checks before the protocol sees a request, around the
//! bounds every API request passes ([`bounds`](crate::gateway::bounds):
//! its key, its message whole within the read timeout, the memory parsing
//! it could take): first an endpoint served and the `Host` (against DNS
//! rebinding, [`gate`]); then the cap on open sessions or the session's
//! opener ([`admit`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::sessions::{self, SESSION_ID, Sessions};
use super::{Caller, McpEndpoint};
use crate::config::ClientKey;
use crate::gateway::GatewayState;
use crate::gateway::bounds::Admitted;
use crate::gateway::handlers::caller;
use crate::gateway::wire::ApiError;

/// The checks before the bounds: an endpoint served, and the `Host`.
pub(in crate::gateway) async fn gate(
    State(shared): State<Arc<GatewayState>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(endpoint) = shared.served().mcp else {
        return refuse(
            StatusCode::NOT_FOUND,
            "this gateway serves no MCP endpoint (add an [mcp_gateway] table)",
        );
    };
    if !host_allowed(request.headers(), &endpoint.allowed_hosts) {
        return refuse(
            StatusCode::FORBIDDEN,
            "the Host is not one this endpoint answers (its allowed_hosts)",
        );
    }
    next.run(request).await
}

/// The checks after the bounds: the cap on sessions or the session's
/// opener. What passes goes on with its [`Caller`]; a session it opens is
/// its key's.
pub(in crate::gateway) async fn admit(
    State((shared, sessions)): State<(Arc<GatewayState>, Arc<Sessions>)>,
    admitted: Admitted,
    mut request: Request,
    next: Next,
) -> Response {
    let Some(endpoint) = admitted.served.mcp.clone() else {
        return refuse(StatusCode::NOT_FOUND, "this gateway serves no MCP endpoint");
    };
    let key = admitted.key().cloned();
    let context = match caller("mcp", key.as_ref(), request.headers(), &shared.config) {
        Ok(context) => context,
        Err(error) => return refused(error),
    };
    let sessionless = request.headers().get(SESSION_ID).is_none();
    if let Err(refused) = may_open(&sessions, &endpoint, key.as_ref(), request.headers()).await {
        return refused;
    }
    request.extensions_mut().insert(Caller {
        key: key.clone(),
        endpoint: endpoint.clone(),
        context,
    });
    let response = next.run(request).await;
    let opened = response.headers().get(SESSION_ID);
    if let (true, Some(id)) = (sessionless, opened.and_then(|id| id.to_str().ok())) {
        sessions.opened(id, key.as_ref(), &endpoint).await;
    }
    response
}

/// Whether a request may go on to its session: one that names a session
/// only if its key opened it (`404` otherwise), one that names none only
/// while fewer than the endpoint's cap are open (`503`).
async fn may_open(
    sessions: &Sessions,
    endpoint: &McpEndpoint,
    key: Option<&ClientKey>,
    headers: &HeaderMap,
) -> Result<(), Response> {
    match headers
        .get(SESSION_ID)
        .map(|id| id.to_str().unwrap_or_default())
    {
        Some(id) if !sessions.may_use(id, key, endpoint).await => Err(sessions::not_found()),
        Some(_) => Ok(()),
        None if sessions.manager.sessions.read().await.len() >= endpoint.max_sessions => {
            Err(refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many MCP sessions are open; close one (DELETE /mcp) or retry later",
            ))
        }
        None => Ok(()),
    }
}

/// `error` before the protocol, as JSON-RPC writes it: the errors of the
/// `/mcp` route.
pub(in crate::gateway) fn refused(error: ApiError) -> Response {
    let mut response = refuse(error.status, &error.message);
    if error.retry {
        let after = header::HeaderValue::from_static("1");
        response.headers_mut().insert(header::RETRY_AFTER, after);
    }
    response
}

/// A refusal before the protocol: the status, and a JSON-RPC error saying
/// why (as the protocol's own errors are written).
fn refuse(status: StatusCode, message: &str) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": { "code": -32600, "message": message },
    });
    let mut response = (status, axum::Json(body)).into_response();
    if status == StatusCode::UNAUTHORIZED {
        let challenge = header::HeaderValue::from_static("Bearer");
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, challenge);
    }
    response
}

/// Whether the request's `Host` (without its port, or with it) is allowed.
fn host_allowed(headers: &HeaderMap, allowed: &[String]) -> bool {
    if allowed.iter().any(|host| host == "*") {
        return true;
    }
    let Some(host) = headers.get(header::HOST).and_then(|h| h.to_str().ok()) else {
        return false;
    };
    let name = match host.strip_prefix('[') {
        Some(bracketed) => bracketed.split(']').next().unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _)| name),
    };
    allowed
        .iter()
        .any(|a| a.eq_ignore_ascii_case(host) || a.eq_ignore_ascii_case(name))
}
