//! The endpoints: models, health and readiness, metrics, and chat
//! completions up to the answer.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::answer::Responder;
use super::bounds::{Admitted, Routed};
use super::dialect::Dialect;
use super::responses::Keep;
use super::wire::ApiError;
use super::{GatewayConfig, GatewayState, Route};
use super::{reported, upstreams};
use crate::config::{ClientKey, RouteMode};
use crate::context::{CLIENT_KEY, CONVERSATION_ID, HOPS, MAX_HOPS, TENANT, USER};
use crate::context::{Context, Tree};
use crate::model::{BUDGET_HEADER, BUDGET_LEFT_HEADER, HOPS_HEADER};
use crate::types::{ChatRequest, Weigh};

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.retry {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// `GET /v1/models`: the models the client's key may use.
pub(super) async fn models(
    State(gateway): State<Arc<GatewayState>>,
    headers: HeaderMap,
) -> Response {
    let served = gateway.served();
    let key = match served.authorize(&headers) {
        Ok(key) => key,
        Err(error) => return error.into_response(),
    };
    let models: Vec<Value> = served.routes_for(key).map(model_object).collect();
    axum::Json(json!({ "object": "list", "data": models })).into_response()
}

/// `GET /v1/models/{model}`: one of them, or a `404`.
pub(super) async fn model(
    State(gateway): State<Arc<GatewayState>>,
    Path(model): Path<String>,
    headers: HeaderMap,
) -> Response {
    let served = gateway.served();
    match served
        .authorize(&headers)
        .and_then(|key| served.route(key, &model))
    {
        Ok(route) => axum::Json(model_object(route)).into_response(),
        Err(error) => error.into_response(),
    }
}

/// A route as OpenAI's model object.
pub(super) fn model_object(route: &Route) -> Value {
    json!({ "id": route.model, "object": "model", "created": 0, "owned_by": "shallot" })
}

pub(super) async fn ready(State(gateway): State<Arc<GatewayState>>) -> Response {
    let served = gateway.served();
    let routes: Vec<Value> = served
        .routes
        .iter()
        .map(|route| {
            let filters: Vec<Value> = route
                .kernel
                .filters()
                .map(|(name, hooks)| {
                    let hooks: Vec<&str> = hooks.iter().map(|h| h.as_str()).collect();
                    json!({ "name": name, "hooks": hooks })
                })
                .collect();
            let mode = match route.mode {
                RouteMode::Proxy => "proxy",
                RouteMode::Agent => "agent",
            };
            let mut ready = json!({ "model": route.model, "mode": mode, "filters": filters });
            let upstreams = upstreams::ready(route);
            if !upstreams.is_empty() {
                ready["upstreams"] = json!(upstreams);
            }
            ready
        })
        .collect();
    let reloads = gateway.reloads();
    let mut ready = json!({
        "ready": true,
        "routes": routes,
        "reloads": { "swapped": reloads.swapped, "failed": reloads.failed, "last_error": reloads.last_error },
    });
    let stores = crate::store::store_states();
    if !stores.is_empty() {
        ready["stores"] = json!(stores);
    }
    if let Some(endpoint) = &served.mcp {
        let tools: Vec<String> = endpoint
            .kernel
            .tools()
            .into_iter()
            .map(|t| t.name)
            .collect();
        let filters: Vec<&str> = endpoint.kernel.filters().map(|(name, _)| name).collect();
        ready["mcp"] = json!({ "tools": tools, "filters": filters });
    }
    axum::Json(ready).into_response()
}

pub(super) async fn exposition(State(gateway): State<Arc<GatewayState>>) -> Response {
    let content_type = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    (
        [(header::CONTENT_TYPE, content_type)],
        gateway.metrics.encode(),
    )
        .into_response()
}

/// A chat API's request, as its endpoint reads it: OpenAI's chat
/// completions, OpenAI's Responses, Anthropic's Messages. Every one runs
/// the same way from there (`answer`).
pub(super) trait ChatApi: Sized + Send {
    /// The request in `body`, or what is wrong with it.
    fn parse(body: &[u8]) -> Result<Self, ApiError>;

    /// The model asked for.
    fn model(&self) -> &str;

    /// Whether the answer is streamed.
    fn stream(&self) -> bool;

    /// Who the client says the end user is, if it does.
    fn user(&self) -> Option<&str>;

    /// The chat to run on `route` and how to say its answer; `owner` is
    /// the key's tenant (or name) that what is kept belongs to.
    fn prepare(
        self,
        route: &Route,
        owner: Option<&str>,
    ) -> impl Future<Output = Result<Prepared, ApiError>> + Send;
}

/// What a chat API's request comes to: the chat, how its answer is said,
/// where it is kept.
pub(super) struct Prepared {
    pub chat: ChatRequest,
    /// The answer's id, for the logs.
    pub id: String,
    pub dialect: Box<dyn Dialect>,
    pub keep: Option<Keep>,
}

/// One request of the chat API `A`, admitted by its bounds
/// ([`bounds`](super::bounds)), which count and log what it answers.
pub(super) async fn answer<A: ChatApi>(
    State(gateway): State<Arc<GatewayState>>,
    admitted: Admitted,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let mut routed = None;
    let mut response = match ask::<A>(gateway, &admitted, &headers, body, &mut routed).await {
        Ok(response) => response,
        Err(error) => admitted.api.refuse(error),
    };
    if let Some(model) = routed {
        response.extensions_mut().insert(Routed(model));
    }
    response
}

/// The admitted request parsed (its body is weighed and its memory taken
/// before: a JSON body becomes many times its size as a tree), routed and
/// answered.
async fn ask<A: ChatApi>(
    gateway: Arc<GatewayState>,
    admitted: &Admitted,
    headers: &HeaderMap,
    body: Bytes,
    routed: &mut Option<String>,
) -> Result<Response, ApiError> {
    let (served, key) = (&admitted.served, admitted.key());
    let mut place = admitted.take_place();
    let request = A::parse(&body)?;
    drop(body);
    let route = served.route(key, request.model())?;
    *routed = Some(route.model.clone());
    tracing::Span::current().record("model", route.model.as_str());
    let stream = request.stream();
    let mut context = caller(&route.model, key, headers, &gateway.config)?;
    if let Some(user) = request.user() {
        context = context.with(USER, user);
    }
    // Behind keys, what is kept (a conversation, a response) belongs to
    // the tenant (or the key): a client cannot name its way into another
    // tenant's.
    let owner = key.map(|k| k.tenant.as_deref().unwrap_or(&k.name));
    if let Some(conversation) = conversation(headers)? {
        let id = match owner {
            Some(owner) => format!("{owner}/{conversation}"),
            None => conversation.to_owned(),
        };
        context = context.with(CONVERSATION_ID, id);
    }
    let prepared = request.prepare(route, owner).await?;
    if route.mode == RouteMode::Agent && !prepared.chat.tools.is_empty() {
        return Err(ApiError::invalid(format!(
            "the model '{}' runs its own tools: send no `tools`",
            route.model
        )));
    }
    // The tree it was parsed to is gone: what the request holds now is
    // its chat.
    if let Some(place) = &mut place {
        place.shrink_to(prepared.chat.weight());
    }
    tracing::Span::current().record("id", prepared.id.as_str());
    let answer = Responder {
        mode: route.mode,
        model: route.model.clone(),
        dialect: prepared.dialect,
        keep: prepared.keep,
        context: context.clone(),
        kernel: route.kernel.clone(),
        deadline: gateway.config.request_timeout,
        place,
        shared: gateway.clone(),
    };
    let mut response = if stream {
        answer.stream(prepared.chat).await
    } else {
        answer.whole(prepared.chat).await
    };
    // What the filters reported (limits, the cache), answered or refused.
    let status = response.status();
    reported::headers(&context, status, response.headers_mut());
    unspent(&context, stream, response.headers_mut());
    Ok(response)
}

/// Who asks, as every endpoint's context says it: the model asked for, the
/// gateways the request came through, the client's key and its tenant;
/// and the requests to models it may cause ([`tree`]).
pub(super) fn caller(
    model: &str,
    key: Option<&ClientKey>,
    headers: &HeaderMap,
    config: &GatewayConfig,
) -> Result<Context, ApiError> {
    let mut context = Context::new()
        .with("model", model)
        .with(HOPS, hops(headers)?)
        .with_tree(tree(headers, config)?);
    if let Some(key) = key {
        context = context.with(CLIENT_KEY, key.name.as_str());
        if let Some(tenant) = &key.tenant {
            context = context.with(TENANT, tenant.as_str());
        }
    }
    Ok(context)
}

/// The header a client names a conversation with, for filters that keep
/// conversations server-side (`memory`): the client then sends only the
/// new messages, and any replica sharing the store can answer. Behind
/// client keys the conversation id filters see is `<tenant>/<id>` (the
/// key's name when it has no tenant), so tenants never share one.
pub const CONVERSATION_HEADER: &str = "x-shallot-conversation";

/// How many gateways the request passed through before this one
/// (`x-shallot-hops`); refused at [`MAX_HOPS`]: a route's model, or a
/// filter's side call, that leads back to a gateway.
fn hops(headers: &HeaderMap) -> Result<u64, ApiError> {
    let Some(value) = headers.get(HOPS_HEADER) else {
        return Ok(0);
    };
    let hops: u64 = value
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| ApiError::invalid(format!("the {HOPS_HEADER} header must be a number")))?;
    if hops >= MAX_HOPS {
        // A 400, not HTTP's 508: the count is the client's to send, and no
        // client retries a 400.
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some("loop_detected"),
            format!(
                "this request has passed through {hops} gateways: a route's model or a filter's side call leads back to a gateway"
            ),
        ));
    }
    Ok(hops)
}

/// The requests to models a request may cause: what its client lent it
/// (`x-shallot-budget`, from a gateway it came through), never more than
/// this gateway's own bound.
fn tree(headers: &HeaderMap, config: &GatewayConfig) -> Result<Arc<Tree>, ApiError> {
    let lent = match headers.get(BUDGET_HEADER) {
        None => u64::MAX,
        Some(value) => value
            .to_str()
            .ok()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                ApiError::invalid(format!("the {BUDGET_HEADER} header must be a number"))
            })?,
    };
    Ok(Arc::new(Tree::new(lent.min(config.max_model_requests))))
}

/// What a request's tree did not spend, for the gateway that lent it
/// (`x-shallot-budget-left`): all it has left once a whole answer is made;
/// nothing for a stream, which may spend on after its head is sent.
pub(super) fn unspent(context: &Context, stream: bool, headers: &mut HeaderMap) {
    let left = match (context.tree(), stream) {
        (Some(tree), false) => tree.left(),
        _ => 0,
    };
    headers.insert(BUDGET_LEFT_HEADER, left.into());
}

/// The conversation a request names, if any: 1 to 256 printable ASCII
/// characters.
pub(super) fn conversation(headers: &HeaderMap) -> Result<Option<&str>, ApiError> {
    let Some(value) = headers.get(CONVERSATION_HEADER) else {
        return Ok(None);
    };
    match value.to_str() {
        Ok(id) if !id.is_empty() && id.len() <= 256 && id.bytes().all(|b| b.is_ascii_graphic()) => {
            Ok(Some(id))
        }
        _ => Err(ApiError::invalid(format!(
            "the {CONVERSATION_HEADER} header must be 1 to 256 printable ASCII characters"
        ))),
    }
}
