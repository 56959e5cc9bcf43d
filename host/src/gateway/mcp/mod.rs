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
mod asked;
mod offers;
mod results;
mod sessions;
mod told;

use std::sync::Arc;
use std::time::Duration;

use rmcp::ErrorData;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CompleteRequestParams, CompleteResult,
    GetPromptRequestParams, GetPromptResponse, Implementation, ListPromptsResult,
    ListResourceTemplatesResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ProgressToken, ReadResourceRequestParams, ReadResourceResponse,
    ServerCapabilities, ServerConfig, SubscribeRequestParams, SubscriptionFilter, Tool,
    UnsubscribeRequestParams,
};
use rmcp::service::{NotificationContext, Peer, RequestContext, RoleServer, SubscriptionContext};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use serde_json::Value;
use tokio::task::JoinHandle;

use self::results::{MENU, Menu, failed, result};
use self::sessions::Sessions;
use self::told::Handshaken;
use super::GatewayState;
use super::answer::bounded;
use crate::config::{ClientKey, LOOPBACK};
use crate::context::{Context, Progress};
use crate::kernel::{BuildError, Kernel, KernelBuilder};
use crate::kv::KvStore;
use crate::onion::{Cancel, InvokeOptions};
use crate::types::{ChainError, ChatRequest, ErrorKind, Origin, ToolSpec};

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
    /// Where the sessions of the initialize handshake are kept so that any
    /// replica sharing the store serves them; `None`: in this process.
    pub sessions: Option<Arc<dyn KvStore>>,
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
            sessions: None,
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
    let mut config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_max_request_body_bytes(shared.config.max_body_bytes);
    config.session_store = Some(Arc::new(sessions::Kept(Arc::downgrade(&shared))));
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
            subscriptions: Arc::default(),
            level: Arc::default(),
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
    /// The session's subscriptions to resources.
    subscriptions: Arc<offers::Subscriptions>,
    /// The least level of a server's log lines the session takes.
    level: Arc<std::sync::atomic::AtomicU8>,
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
            .enable_completions()
            .enable_prompts()
            .enable_resources()
            .enable_tools()
            .enable_prompts_list_changed()
            .enable_resources_list_changed()
            .enable_resources_subscribe()
            .enable_tool_list_changed()
            .build();
        let mut capabilities = capabilities;
        #[allow(deprecated, reason = "clients of the 2025 protocols set a log level")]
        {
            capabilities.logging = Some(serde_json::Map::new());
        }
        ServerConfig::new(capabilities)
            .with_server_info(Implementation::new("shallot", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "The tools, prompts and resources of this gateway's MCP servers; every call, prompt and read runs through its filters.",
            )
    }

    async fn on_initialized(&self, context: NotificationContext<RoleServer>) {
        self.handshaken.add(context.peer);
    }

    /// The lists a listen may hear of; not a resource's updates, which a
    /// session subscribes to with `resources/subscribe`.
    fn accepted_subscription_filter(
        &self,
        asked: &SubscriptionFilter,
    ) -> Option<SubscriptionFilter> {
        let mut accepted = SubscriptionFilter::builder();
        if asked.tools_list_changed != Some(false) {
            accepted = accepted.tools_list_changed();
        }
        if asked.prompts_list_changed == Some(true) {
            accepted = accepted.prompts_list_changed();
        }
        if asked.resources_list_changed == Some(true) {
            accepted = accepted.resources_list_changed();
        }
        Some(accepted.build())
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

    async fn list_prompts(
        &self,
        _: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListPromptsResult, ErrorData> {
        Self::prompts(&context)
    }

    async fn get_prompt(
        &self,
        request: GetPromptRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<GetPromptResponse, ErrorData> {
        self.prompt(request, context).await
    }

    async fn list_resources(
        &self,
        _: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        Self::resources(&context)
    }

    async fn list_resource_templates(
        &self,
        _: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListResourceTemplatesResult, ErrorData> {
        Self::templates(&context)
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        self.read(request, context).await
    }

    async fn subscribe(
        &self,
        request: SubscribeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        Tools::subscribe(self, request.uri, context).await
    }

    async fn unsubscribe(
        &self,
        request: UnsubscribeRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        Tools::unsubscribe(self, &request.uri);
        Ok(())
    }

    /// The least level of a server's log lines this session takes.
    #[allow(deprecated, reason = "clients of the 2025 protocols set a log level")]
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        _: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        let named = serde_json::to_value(request.level).unwrap_or_default();
        let level = asked::rank(named.as_str().unwrap_or_default());
        self.level
            .store(level, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    async fn complete(
        &self,
        request: CompleteRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CompleteResult, ErrorData> {
        Tools::complete(self, request, context).await
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
        let shown = (&caller.endpoint.kernel, &caller.context);
        let client = asked::Client::of(&context.peer, shown, self.level.clone());
        caller.context = caller.context.with_asker(Arc::new(client));
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
