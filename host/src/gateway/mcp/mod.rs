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

pub(super) mod admit;
mod sessions;
mod told;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;
use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ProgressToken,
    ServerCapabilities, ServerConfig, SubscriptionFilter, Tool,
};
use rmcp::service::{NotificationContext, Peer, RequestContext, RoleServer, SubscriptionContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use self::sessions::Sessions;
use self::told::Handshaken;
use super::GatewayState;
use super::answer::bounded;
use crate::config::{ClientKey, LOOPBACK};
use crate::context::{Context, Progress};
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
/// its sessions in memory, behind [`admit::gate`], the bounds and
/// [`admit::admit`]; beside it,
/// [`told::tell`].
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
    // `gate` checks the Host against the endpoint being served (it can
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

    /// `work` (`what` the client asked: "the call", "the listing") with a
    /// place among the requests served at once, within the request
    /// deadline, cancelled with its reason at the deadline or when the
    /// client cancels it; `work` is given the invoke's options.
    async fn bounded<T, F>(
        &self,
        caller: &Caller,
        context: &RequestContext<RoleServer>,
        what: &str,
        work: impl FnOnce(InvokeOptions) -> F,
    ) -> Result<T, ChainError>
    where
        F: Future<Output = Result<T, ChainError>>,
    {
        let place = self.shared.place().await.map_err(|refused| {
            ChainError::new(ErrorKind::Overloaded, refused.message).at(Origin::terminal("gateway"))
        })?;
        let cancel = Cancel::new();
        let options = InvokeOptions::from(caller.context.clone()).cancel_on(cancel.clone());
        let deadline = self.shared.config.request_timeout;
        let timed_out = ChainError::new(
            ErrorKind::Timeout,
            format!("{what} did not finish within {} ms", deadline.as_millis()),
        )
        .at(Origin::terminal("gateway"));
        let gone = async {
            context.ct.cancelled().await;
            ChainError::new(ErrorKind::Transient, format!("the client cancelled {what}"))
                .at(Origin::terminal("gateway"))
        };
        let output = bounded(work(options), &cancel, deadline, timed_out, gone).await;
        drop(place);
        output
    }

    /// The tools of the key that reached the end of the chat filters.
    async fn menu(
        &self,
        caller: &Caller,
        context: &RequestContext<RoleServer>,
    ) -> Result<Vec<ToolSpec>, ChainError> {
        let kernel = &caller.endpoint.kernel;
        let given: Vec<ToolSpec> = kernel
            .tools()
            .into_iter()
            .filter(|tool| caller.key.as_ref().is_none_or(|k| k.may_call(&tool.name)))
            .collect();
        let menu = ChatRequest::new(Vec::new()).with_tools(given.clone());
        let listing = |options: InvokeOptions| kernel.chat(menu, options);
        let response = self
            .bounded(caller, context, "the listing", listing)
            .await?;
        let reached: Vec<String> = response
            .metadata
            .get(MENU)
            .cloned()
            .and_then(|names| serde_json::from_value(names).ok())
            .unwrap_or_default();
        Ok(given
            .into_iter()
            .filter(|tool| reached.contains(&tool.name))
            .collect())
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
        let tools = self
            .menu(&caller, &context)
            .await
            .map_err(|error| ErrorData::internal_error(error.message, None))?
            .into_iter()
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
        let mut caller = Self::caller(&context)?;
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
        let relaying = context.meta.get_progress_token().map(|token| {
            let (progress, relaying) = relay(context.peer.clone(), token);
            caller.context = caller.context.with_progress(progress);
            relaying
        });
        let kernel = caller.endpoint.kernel.clone();
        let call = |options: InvokeOptions| async move {
            Ok(kernel.tool(name, arguments, options.shown()).await?.output)
        };
        let answer = self.bounded(&caller, &context, "the call", call).await;
        // The progress reported goes before the answer.
        drop(caller);
        if let Some(relaying) = relaying {
            let _ = tokio::time::timeout(told::NOTICE, relaying).await;
        }
        let result = match answer {
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

/// A tool's output as an MCP result: a JSON string as its text, an array
/// of MCP content blocks as that content (a server's images, audio and
/// resources, as it sent them), other JSON as text and as structured
/// content (an object); an error object (a filter's refusal,
/// `{"error": {...}}`) marked as an error.
fn result(output: String) -> CallToolResult {
    let value: Option<Value> = serde_json::from_str(&output).ok();
    match value {
        Some(Value::String(text)) => CallToolResult::success(vec![ContentBlock::text(text)]),
        Some(Value::Array(blocks)) if !blocks.is_empty() => {
            match serde_json::from_value::<Vec<ContentBlock>>(Value::Array(blocks)) {
                Ok(content) => CallToolResult::success(content),
                Err(_) => CallToolResult::success(vec![ContentBlock::text(output)]),
            }
        }
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

/// Where the progress of a call that asked for it (its `progressToken`)
/// goes: to its client, under the client's token, each report within
/// [`told::NOTICE`] (a client that does not read gets no more), ending
/// when the call has ended.
fn relay(peer: Peer<RoleServer>, token: ProgressToken) -> (Progress, JoinHandle<()>) {
    let (progress, mut reports) = Progress::channel();
    let relaying = tokio::spawn(async move {
        while let Some(report) = reports.recv().await {
            let mut said = ProgressNotificationParam::new(token.clone(), report.progress);
            said.total = report.total;
            let told = tokio::time::timeout(told::NOTICE, peer.notify_progress(said)).await;
            if !matches!(told, Ok(Ok(()))) {
                return;
            }
        }
    });
    (progress, relaying)
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

#[cfg(test)]
mod tests {
    use rmcp::model::ContentBlock;
    use serde_json::json;

    use super::result;

    #[test]
    fn content_blocks_stay_content_and_other_arrays_stay_text() {
        let blocks = json!([
            { "type": "text", "text": "a red pixel" },
            { "type": "image", "data": "iVBORw0KGgo=", "mimeType": "image/png" },
            { "type": "resource", "resource": { "uri": "test://doc", "text": "the doc" } },
        ]);
        let typed = result(blocks.to_string());
        assert_eq!(typed.content.len(), 3);
        assert!(typed.content[1].as_image().is_some());
        assert!(typed.content[2].as_resource().is_some());
        assert_eq!(typed.structured_content, None);

        let numbers = json!([1, 2, 3]).to_string();
        let text = result(numbers.clone());
        assert_eq!(text.content, vec![ContentBlock::text(numbers)]);

        // A server's text that spells blocks is text: a text result is a
        // JSON string, never read as content.
        let spelled = json!(blocks.to_string()).to_string();
        let said = result(spelled);
        assert_eq!(said.content, vec![ContentBlock::text(blocks.to_string())]);
    }
}
