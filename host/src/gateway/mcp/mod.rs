//! `POST /mcp`: the gateway as an MCP server (streamable HTTP, through the
//! official SDK's server side). It federates the `[[mcp]]` servers' tools
//! into one list, shows each client key the tools it may call, and runs
//! every `tools/call` through the endpoint's tool chain before it reaches
//! the server, so a policy, an approval, a redaction or a rate limit on a
//! tool is a filter.
//!
//! A `tools/list` is the menu a model would be offered: the key's tools go
//! through the endpoint's chat filters as the tools of a request with no
//! messages, answered not by a model but by [`Menu`], which says which
//! tools reached it; a filter that trims a model's menu (`tool-guard`,
//! one of yours) trims the list the same way.
//!
//! Every HTTP request is checked before the protocol sees it: its `Host`
//! (against DNS rebinding), its key (as for `/v1`: `401` without one),
//! for a request that carries no session, the cap on open sessions, and
//! for one that does, that its key opened it (`404` otherwise); its body
//! then arrives whole within the read timeout (`408`). A
//! call then takes a place among the requests served at once, runs within
//! the request deadline (cancelled with its reason at the deadline or when
//! the client cancels it or goes away) and its result's text is shown the
//! client through the token transforms, as every answer of the gateway.
//!
//! When the endpoint is replaced (a reload, a server's tools changing),
//! its clients are told `notifications/tools/list_changed`: those
//! listening with `subscriptions/listen` (the 2026-07-28 protocol) on
//! their listen, the sessions of the initialize handshake on their
//! session. A shutdown ends a listen at once, gracefully.

mod sessions;
mod told;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ServerCapabilities, ServerConfig, SubscriptionFilter,
    Tool,
};
use rmcp::service::{NotificationContext, RequestContext, RoleServer, SubscriptionContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{Value, json};

use self::sessions::{SESSION_ID, Sessions};
use self::told::Handshaken;
use super::GatewayState;
use super::answer::bounded;
use super::handlers::caller;
use crate::config::{ClientKey, LOOPBACK};
use crate::context::Context;
use crate::kernel::{BuildError, Kernel, KernelBuilder};
use crate::model::{ChatModel, ModelEvent};
use crate::onion::{Cancel, InvokeOptions};
use crate::types::{
    ChainError, ChatRequest, ChatResponse, ErrorKind, FinishReason, Message, Origin, ToolSpec,
};

/// The gateway's MCP endpoint: the kernel whose tool chain every
/// `tools/call` runs through (its tools are the MCP servers'), and the
/// `Host` headers it answers.
#[derive(Clone)]
pub struct McpEndpoint {
    /// The filters and the servers' tools; its model answers menus
    /// (`tools/list`), see [`McpEndpoint::new`].
    pub kernel: Kernel,
    /// The `Host`s it answers (`name` or `name:port`; `"*"`: any).
    pub allowed_hosts: Vec<String>,
    /// Sessions open at once; a client that would open another gets `503`.
    pub max_sessions: usize,
}

/// How long a session may sit unused before it is closed.
const SESSION_IDLE: Duration = Duration::from_secs(300);

impl McpEndpoint {
    /// An endpoint serving the tools of `builder` (its filters and the
    /// servers added with [`KernelBuilder::mcp`]), to loopback `Host`s, at
    /// most 4096 sessions at once. Its model is the endpoint's menu: a
    /// `tools/list` runs the chat filters and is answered with the tools
    /// that reached it (any model given to `builder` is replaced).
    pub fn new(builder: KernelBuilder) -> Result<Self, BuildError> {
        Ok(McpEndpoint {
            kernel: builder.model(Menu).build()?,
            allowed_hosts: LOOPBACK.map(String::from).to_vec(),
            max_sessions: 4096,
        })
    }
}

/// Who asks, put on the request before the protocol reads it: its key and
/// the endpoint being served when it came.
#[derive(Clone)]
struct Caller {
    key: Option<ClientKey>,
    endpoint: McpEndpoint,
    context: Context,
}

/// The `/mcp` service: the SDK's streamable-HTTP server over [`Tools`],
/// its sessions in memory, behind [`admit`]; beside it, [`told::tell`].
pub(super) fn service(
    shared: Arc<GatewayState>,
) -> (
    StreamableHttpService<Tools, LocalSessionManager>,
    Arc<Sessions>,
) {
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(SESSION_IDLE);
    sessions.session_config.init_timeout = Some(shared.config.read_timeout);
    let sessions = Arc::new(sessions);
    // `admit` checks the Host against the endpoint being served (it can
    // change on a reload); the body is bounded as every request's.
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_max_request_body_bytes(shared.config.max_body_bytes);
    let handshaken = Arc::new(Handshaken::default());
    tokio::spawn(told::tell(
        shared.menus.subscribe(),
        shared.draining.subscribe(),
        Arc::downgrade(&handshaken),
        Arc::downgrade(&sessions),
    ));
    let tools = move || {
        Ok(Tools {
            shared: shared.clone(),
            handshaken: handshaken.clone(),
        })
    };
    (
        StreamableHttpService::new(tools, sessions.clone(), config),
        Arc::new(Sessions::new(sessions)),
    )
}

/// The checks before the protocol: an endpoint served, the `Host`, the
/// key, the cap on sessions or the session's opener. What passes goes on
/// with its [`Caller`]; a session it opens is its key's.
pub(super) async fn admit(
    State((shared, sessions)): State<(Arc<GatewayState>, Arc<Sessions>)>,
    mut request: Request,
    next: Next,
) -> Response {
    let served = shared.served();
    let Some(endpoint) = served.mcp.clone() else {
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
    let key = match served.authorize(request.headers()) {
        Ok(key) => key.cloned(),
        Err(error) => return refuse(StatusCode::UNAUTHORIZED, &error.message),
    };
    let context = match caller("mcp", key.as_ref(), request.headers(), &shared.config) {
        Ok(context) => context,
        Err(error) => return refuse(error.status, &error.message),
    };
    let session = request.headers().get(SESSION_ID);
    match session.map(|id| id.to_str().unwrap_or_default()) {
        Some(id) if !sessions.may_use(id, key.as_ref()) => return sessions::not_found(),
        Some(_) => {}
        None if sessions.manager.sessions.read().await.len() >= endpoint.max_sessions => {
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                "too many MCP sessions are open; close one (DELETE /mcp) or retry later",
            );
        }
        None => {}
    }
    let sessionless = session.is_none();
    request.extensions_mut().insert(Caller {
        key: key.clone(),
        endpoint,
        context,
    });
    // The message whole within the read timeout, as for `/v1`; then the
    // memory parsing it could take, before rmcp parses it (`tools/call`
    // takes a place of its own as it runs).
    let (parts, body) = request.into_parts();
    let within = shared.config.read_timeout;
    let body = axum::body::to_bytes(body, shared.config.max_body_bytes);
    let body = match tokio::time::timeout(within, body).await {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => {
            return refuse(
                StatusCode::PAYLOAD_TOO_LARGE,
                "the message is over the body cap",
            );
        }
        Err(_) => {
            let late = format!(
                "the message did not arrive within {} ms",
                within.as_millis()
            );
            return refuse(StatusCode::REQUEST_TIMEOUT, &late);
        }
    };
    let _memory = match shared.memory(&body).await {
        Ok(memory) => memory,
        Err(error) => return refuse(error.status, &error.message),
    };
    let response = next.run(Request::from_parts(parts, body.into())).await;
    let opened = response.headers().get(SESSION_ID);
    if let (true, Some(id)) = (sessionless, opened.and_then(|id| id.to_str().ok())) {
        sessions.opened(id, key.as_ref()).await;
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

/// The MCP server one session speaks to: what a request may see comes
/// from its [`Caller`], so one session is as good as another.
#[derive(Clone)]
pub(super) struct Tools {
    shared: Arc<GatewayState>,
    handshaken: Arc<Handshaken>,
}

impl Tools {
    fn caller(context: &RequestContext<RoleServer>) -> Result<Caller, ErrorData> {
        context
            .extensions
            .get::<axum::http::request::Parts>()
            .and_then(|parts| parts.extensions.get::<Caller>())
            .cloned()
            .ok_or_else(|| ErrorData::internal_error("the request was not admitted", None))
    }

    /// A `tools/call` through the tool chain, bounded and cancellable.
    async fn run(
        &self,
        caller: &Caller,
        name: &str,
        arguments: Value,
        context: &RequestContext<RoleServer>,
    ) -> Result<String, ChainError> {
        let place = self.shared.place().await.map_err(|refused| {
            ChainError::new(ErrorKind::Overloaded, refused.message).at(Origin::terminal("gateway"))
        })?;
        let cancel = Cancel::new();
        let options = InvokeOptions::from(caller.context.clone())
            .cancel_on(cancel.clone())
            .shown();
        let kernel = &caller.endpoint.kernel;
        let deadline = self.shared.config.request_timeout;
        let timed_out = ChainError::new(
            ErrorKind::Timeout,
            format!("the call did not finish within {} ms", deadline.as_millis()),
        )
        .at(Origin::terminal("gateway"));
        let gone = async {
            context.ct.cancelled().await;
            ChainError::new(ErrorKind::Transient, "the client cancelled the call")
                .at(Origin::terminal("gateway"))
        };
        let call = async { Ok(kernel.tool(name, arguments, options).await?.output) };
        let output = bounded(call, &cancel, deadline, timed_out, gone).await;
        drop(place);
        output
    }
}

impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        let capabilities = ServerCapabilities::builder()
            .enable_tools()
            .enable_tool_list_changed()
            .build();
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new("shallot", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "The tools of this gateway's MCP servers; every call runs through its filters.",
            )
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.handshaken.add(context.peer);
    }

    fn accepted_subscription_filter(&self, _: &SubscriptionFilter) -> Option<SubscriptionFilter> {
        Some(SubscriptionFilter::builder().tools_list_changed().build())
    }

    /// A `subscriptions/listen`: see [`told::listen`].
    async fn listen(&self, context: SubscriptionContext) -> Result<(), ErrorData> {
        let menus = self.shared.menus.subscribe();
        told::listen(context, menus, self.shared.draining.subscribe()).await;
        Ok(())
    }

    async fn list_tools(
        &self,
        _: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        let caller = Self::caller(&context)?;
        let kernel = &caller.endpoint.kernel;
        let given: Vec<ToolSpec> = kernel
            .tools()
            .into_iter()
            .filter(|tool| caller.key.as_ref().is_none_or(|k| k.may_call(&tool.name)))
            .collect();
        let menu = ChatRequest::new(Vec::new()).with_tools(given.clone());
        let options = InvokeOptions::from(caller.context.clone());
        let deadline = self.shared.config.request_timeout;
        let answered = tokio::time::timeout(deadline, kernel.chat(menu, options)).await;
        let reached = match answered {
            Ok(Ok(response)) => response.metadata.get(MENU).cloned(),
            Ok(Err(error)) => return Err(ErrorData::internal_error(error.message, None)),
            Err(_) => {
                let message = format!("the menu took over {} ms", deadline.as_millis());
                return Err(ErrorData::internal_error(message, None));
            }
        };
        let reached: Vec<String> = reached
            .and_then(|names| serde_json::from_value(names).ok())
            .unwrap_or_default();
        let tools = given
            .into_iter()
            .filter(|tool| reached.contains(&tool.name))
            .map(|tool| {
                let schema = match tool.parameters {
                    Value::Object(schema) => schema,
                    _ => serde_json::Map::new(),
                };
                Tool::new(tool.name, tool.description, schema)
            })
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let caller = Self::caller(&context)?;
        let name = request.name.as_ref();
        let offered = caller.key.as_ref().is_none_or(|key| key.may_call(name))
            && caller
                .endpoint
                .kernel
                .tools()
                .iter()
                .any(|t| t.name == name);
        if !offered {
            self.shared.metrics.mcp_call("", "refused");
            let message = format!("unknown tool '{}'", crate::escape::terminal_line(name));
            return Err(ErrorData::invalid_params(message, None));
        }
        let arguments = request.arguments.map_or(Value::Null, Value::Object);
        let arguments = match arguments {
            Value::Null => Value::Object(serde_json::Map::new()),
            arguments => arguments,
        };
        let result = match self.run(&caller, name, arguments, &context).await {
            Ok(output) => result(output),
            Err(error) if error.kind == ErrorKind::Overloaded => {
                self.shared.metrics.mcp_call(name, "refused");
                return Err(ErrorData::internal_error(error.message, None));
            }
            Err(error) => failed(&error),
        };
        let outcome = if result.is_error == Some(true) {
            "error"
        } else {
            "ok"
        };
        self.shared.metrics.mcp_call(name, outcome);
        Ok(result.into())
    }
}

/// The metadata key [`Menu`] answers with the names of the tools that
/// reached it.
const MENU: &str = "mcp_menu";

/// The endpoint's "model": it answers a `tools/list`'s menu with the names
/// of the tools that reached it through the chat filters (under
/// `mcp_menu` in the metadata), and nothing else. Of those, only tools the
/// key was given are listed: a filter can take tools off, never add one.
struct Menu;

#[async_trait]
impl ChatModel for Menu {
    fn name(&self) -> &str {
        "mcp-menu"
    }

    async fn chat(&self, request: &ChatRequest, _: &Context) -> Result<ChatResponse, ChainError> {
        let names: Vec<&str> = request.tools.iter().map(|t| t.name.as_str()).collect();
        let mut response = ChatResponse::new(Message::assistant(""), FinishReason::Complete);
        response.metadata.insert(MENU.to_owned(), json!(names));
        Ok(response)
    }

    async fn stream(
        &self,
        _: &ChatRequest,
        _: &Context,
    ) -> Result<BoxStream<'static, Result<ModelEvent, ChainError>>, ChainError> {
        Err(ChainError::new(
            ErrorKind::InvalidRequest,
            "the MCP endpoint answers menus, not streams",
        )
        .at(Origin::terminal("gateway")))
    }
}

/// A tool's output as an MCP result: a JSON string as its text, other JSON
/// as text and as structured content (an object); an error object (a
/// filter's refusal, `{"error": {...}}`) marked as an error.
fn result(output: String) -> CallToolResult {
    let value: Option<Value> = serde_json::from_str(&output).ok();
    match value {
        Some(Value::String(text)) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Some(value) if value.get("error").is_some_and(Value::is_object) => {
            CallToolResult::error(vec![ContentBlock::text(output)])
        }
        Some(value @ Value::Object(_)) => {
            let mut result = CallToolResult::success(vec![ContentBlock::text(output)]);
            result.structured_content = Some(value);
            result
        }
        _ => CallToolResult::success(vec![ContentBlock::text(output)]),
    }
}

/// A call the chain failed, as an MCP result marked as an error: what the
/// model would see as the tool's failure.
fn failed(error: &ChainError) -> CallToolResult {
    let text = serde_json::json!({
        "error": {
            "type": "tool_error",
            "kind": error.kind.as_str(),
            "message": error.message,
        }
    });
    CallToolResult::error(vec![ContentBlock::text(text.to_string())])
}
