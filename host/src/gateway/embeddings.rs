//! `POST /v1/embeddings`: OpenAI's embeddings, forwarded to the route's
//! model (an OpenAI-compatible upstream, or the embedded model's
//! deterministic vectors) behind the gateway's keys, its places, its
//! deadline and its drain, counted in `/metrics` as mode `embeddings`.
//! Embeddings go through no filter: there is no conversation to shape, and
//! nothing of them is shown as text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::GatewayState;
use super::bounds::{Admitted, Routed};
use super::handlers::{caller, unspent};
use super::wire::ApiError;
use crate::context::Context;
use crate::types::{ChainError, EmbeddingRequest, EmbeddingResponse, ErrorKind};

/// One request, admitted by its bounds ([`bounds`](super::bounds)), which
/// count and log what it answers.
pub(super) async fn embeddings(
    State(gateway): State<Arc<GatewayState>>,
    admitted: Admitted,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut routed = None;
    let mut response = match embed(&gateway, &admitted, &headers, &body, &mut routed).await {
        Ok((answer, context)) => {
            let mut response = axum::Json(answer).into_response();
            unspent(&context, false, response.headers_mut());
            response
        }
        Err(error) => admitted.api.refuse(error),
    };
    if let Some(model) = routed {
        response.extensions_mut().insert(Routed(model));
    }
    response
}

/// The admitted request parsed, routed and forwarded, holding its place.
async fn embed(
    gateway: &Arc<GatewayState>,
    admitted: &Admitted,
    headers: &HeaderMap,
    body: &[u8],
    routed: &mut Option<String>,
) -> Result<(EmbeddingResponse, Context), ApiError> {
    let (served, key) = (&admitted.served, admitted.key());
    let _place = admitted.take_place();
    let request = serde_json::from_slice::<EmbeddingRequest>(body)
        .map_err(|e| ApiError::invalid(format!("the body is not an embeddings request: {e}")))?
        .check()
        .map_err(|e| ApiError::chain(&e))?;
    let route = served.route(key, &request.model)?;
    *routed = Some(route.model.clone());
    tracing::Span::current().record("model", route.model.as_str());
    let context = caller(&route.model, key, headers, &gateway.config)?;
    // Within the request deadline, and cut as a chat is when a drain runs
    // out (the gateway stops: retry elsewhere).
    let within = gateway.config.request_timeout;
    let embedding = tokio::time::timeout(within, route.kernel.embed(&request, &context));
    let answer = tokio::select! {
        answer = embedding => answer.unwrap_or_else(|_| {
            let message = format!("the embeddings took longer than {} ms", within.as_millis());
            Err(ChainError::new(ErrorKind::Timeout, message))
        }),
        () = gateway.cut() => Err(GatewayState::cut_error()),
    }
    .map_err(|e| ApiError::chain(&e))?;
    // Named as the client asked, as a chat completion is.
    let answer = EmbeddingResponse {
        model: route.model.clone(),
        ..answer
    };
    Ok((answer, context))
}
