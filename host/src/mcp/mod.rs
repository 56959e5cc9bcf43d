//! MCP servers as tools of the agent, through the official Rust SDK
//! (`rmcp`): each `[[mcp]]` server's tools join the kernel's tools under
//! the operator's prefix, so a call goes through the tool chain (every
//! filter applies) and then to the server.
//!
//! A server is a command spoken to over stdio, or a streamable-HTTP URL.
//! It is started (or its session opened) when the kernel is built, its
//! tools listed then, again when it says they changed
//! (`notifications/tools/list_changed`: [`McpServer::changed`] tells who
//! builds kernels over it), and again, on the next call, after it died or
//! stopped answering: a call that finds it gone or
//! runs past `timeout_ms` fails with a typed error (`transient`,
//! `timeout`), the process is killed, and nothing waits on it. What a
//! server sends is bounded (a message of at most `max_message_kib`; a
//! longer one is dropped); what it writes to its stderr goes to the host's
//! debug log, a line (or a kibibyte) at a time.

mod listed;
mod offered;
mod progress;
mod result;

use self::listed::{Listed, Listener};
use self::offered::Offered;
pub use self::offered::ResourceWatch;

use std::collections::{BTreeMap, HashMap};
use std::process::Stdio;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use reqwest::header::{HeaderName, HeaderValue};
use rmcp::ServiceExt;
use rmcp::handler::client::progress::ProgressDispatcher;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService, ServiceError};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::transport::async_rw::AsyncRwTransport;
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::{Mutex, watch};

use crate::context::Context;
use crate::types::{ChainError, ErrorKind, Origin, ToolSpec};

/// One `[[mcp]]` table: a server and how its tools are named.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    /// The server's name, in errors and logs.
    pub name: String,
    /// What its tools are called in the kernel: `<prefix><tool>`
    /// (default: `<name>_`).
    pub prefix: Option<String>,
    /// The command that runs the server, spoken to over stdio; or
    /// `url`, not both.
    pub command: Option<String>,
    /// The server's streamable-HTTP endpoint (`https://host/mcp`); or
    /// `command`, not both.
    pub url: Option<String>,
    /// Headers sent with every request to `url` (an `Authorization`
    /// bearer token, say).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// Its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// Its environment, beside the host's `PATH` and `HOME` (nothing else
    /// of the host's is passed on).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The bound on each call (default 30 s).
    #[serde(default = "default_timeout")]
    pub timeout_ms: u64,
    /// The bound on starting it: the process (or the connection), the
    /// handshake and the first listing of its tools (default the larger
    /// of `timeout_ms` and 30 s: a server started by `npx` or `uvx` may
    /// fetch and compile itself first, which its calls never do).
    #[serde(default)]
    pub start_timeout_ms: Option<u64>,
    /// The largest message it may send, in KiB (default 4096); a longer
    /// one is dropped (the call it answers ends at its deadline).
    #[serde(default = "default_message_kib")]
    pub max_message_kib: usize,
}

fn default_timeout() -> u64 {
    30_000
}

fn default_message_kib() -> usize {
    4096
}

/// Why a server could not be started or listed.
#[derive(Debug, thiserror::Error)]
#[error("MCP server '{name}': {message}")]
pub struct McpError {
    /// The server's name.
    pub name: String,
    /// What went wrong.
    pub message: String,
}

/// A session with a server (and its process, for a command, which is
/// killed when it is dropped).
struct Connection {
    session: RunningService<RoleClient, Listener>,
    _process: Option<tokio::process::Child>,
}

/// A running MCP server: its tools, and the connection calls go over.
pub struct McpServer {
    config: McpConfig,
    listed: Arc<Listed>,
    connection: Mutex<Option<Arc<Connection>>>,
}

impl McpServer {
    /// Starts the server and lists its tools.
    pub async fn start(config: McpConfig) -> Result<Arc<Self>, McpError> {
        let fail = |message: String| McpError {
            name: config.name.clone(),
            message,
        };
        let listed = Arc::new(Listed {
            tools: RwLock::new(Vec::new()),
            changes: watch::Sender::new(0),
            listing: AtomicBool::new(false),
            again: AtomicBool::new(false),
            name: config.name.clone(),
            timeout: timeout(&config),
            reports: ProgressDispatcher::new(),
            offered: Offered::default(),
            askers: std::sync::Mutex::default(),
        });
        let connection = connect(&config, &listed)
            .await
            .map_err(|e| fail(e.message))?;
        let peer = connection.session.peer();
        let tools = listed
            .fetch(peer, start_bound(&config))
            .await
            .map_err(fail)?;
        *listed.tools.write().unwrap_or_else(PoisonError::into_inner) = tools;
        let offered = tokio::time::timeout(start_bound(&config), offered::Listing::fetch(peer));
        let offered = offered.await.unwrap_or_else(|_| {
            Err(format!(
                "listing its prompts and resources took over {} ms",
                start_ms(&config)
            ))
        });
        listed.offered.keep(offered.map_err(fail)?);
        Ok(Arc::new(McpServer {
            config,
            listed,
            connection: Mutex::new(Some(Arc::new(connection))),
        }))
    }

    /// Resolves when the server's tools have changed since `seen`
    /// (a count this returns; `0` at start): a kernel built over
    /// [`McpServer::tools`] before then offers the old list.
    pub async fn changed(&self, seen: u64) -> u64 {
        let mut changes = self.listed.changes.subscribe();
        let changed = changes.wait_for(|n| *n != seen).await.map(|n| *n);
        match changed {
            Ok(n) => n,
            // The sender lives as long as `self`.
            Err(_) => std::future::pending().await,
        }
    }

    /// How many times its tools have changed.
    pub fn changes(&self) -> u64 {
        *self.listed.changes.borrow()
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Its tools as the kernel registers them: prefixed, with the
    /// server's descriptions and schemas.
    pub fn tools(&self) -> Vec<ToolSpec> {
        let prefix = self.prefix();
        let tools = self.listed.held();
        tools
            .iter()
            .map(|tool| {
                let description = tool.description.as_deref().unwrap_or_default();
                let schema = Value::Object((*tool.input_schema).clone());
                ToolSpec::new(format!("{prefix}{}", tool.name), description, schema)
            })
            .collect()
    }

    /// The server's name of the kernel's tool `name`.
    pub fn tool_of(&self, name: &str) -> Option<String> {
        let tool = name.strip_prefix(&self.prefix())?;
        let tools = self.listed.held();
        tools
            .iter()
            .any(|t| t.name == tool)
            .then(|| tool.to_owned())
    }

    fn prefix(&self) -> String {
        self.config
            .prefix
            .clone()
            .unwrap_or_else(|| format!("{}_", self.config.name))
    }

    /// Calls the server's tool `tool` with `arguments`: its result, as
    /// [`result::output`] maps it, or a typed error. A server that is
    /// gone is started again first; one that fails the call's transport
    /// or runs past the bound is killed.
    pub async fn call(&self, tool: &str, arguments: Value) -> Result<Value, ChainError> {
        self.call_for(tool, arguments, &Context::new()).await
    }

    /// As [`McpServer::call`], for the invoke of `context`: what the server
    /// reports of the call's progress goes where it says, and what the
    /// server asks during the call to whom it says.
    pub(crate) async fn call_for(
        &self,
        tool: &str,
        arguments: Value,
        context: &Context,
    ) -> Result<Value, ChainError> {
        let connection = self.connection().await?;
        let mut params = CallToolRequestParams::new(tool.to_owned());
        params.arguments = match arguments {
            Value::Object(map) => Some(map),
            Value::Null => None,
            other => {
                let message = format!("the arguments are not an object: {other}");
                return Err(self.error(ErrorKind::InvalidRequest, message));
            }
        };
        let peer = connection.session.peer();
        let caller = progress::Caller {
            progress: context.progress(),
            asker: context.asker(),
        };
        let heard = (&self.listed.reports, &self.listed.askers);
        let call = progress::called(peer, heard, params, caller);
        let answered = tokio::time::timeout(timeout(&self.config), call);
        match answered.await {
            Ok(Ok(answer)) => {
                result::output(answer).map_err(|(kind, message)| self.error(kind, message))
            }
            Ok(Err(ServiceError::McpError(error))) => {
                Err(self.error(ErrorKind::InvalidRequest, error.message.into_owned()))
            }
            Ok(Err(error)) => {
                self.drop_connection(&connection).await;
                Err(self.error(
                    ErrorKind::Transient,
                    format!("the server failed the call: {error}"),
                ))
            }
            Err(_) => {
                self.drop_connection(&connection).await;
                let message = format!("the call took over {} ms", self.config.timeout_ms);
                Err(self.error(ErrorKind::Timeout, message))
            }
        }
    }

    /// The live connection, started again if the server is gone.
    async fn connection(&self) -> Result<Arc<Connection>, ChainError> {
        let mut held = self.connection.lock().await;
        if let Some(connection) = held.as_ref().filter(|c| !c.session.is_transport_closed()) {
            return Ok(connection.clone());
        }
        tracing::warn!(server = %self.config.name, "the MCP server is gone; starting it again");
        let connection = Arc::new(
            connect(&self.config, &self.listed)
                .await
                .map_err(|e| self.error(ErrorKind::Transient, e.message))?,
        );
        *held = Some(connection.clone());
        drop(held);
        // Started again, it may offer other tools.
        if let Err(e) = self.listed.list(connection.session.peer()).await {
            tracing::warn!(server = %self.config.name, "started again, and listing its tools: {e}");
        }
        Ok(connection)
    }

    /// Forgets `connection` (its process is killed when the last call on
    /// it ends), so the next call starts the server again.
    async fn drop_connection(&self, connection: &Arc<Connection>) {
        let mut held = self.connection.lock().await;
        if held.as_ref().is_some_and(|c| Arc::ptr_eq(c, connection)) {
            *held = None;
        }
    }

    fn error(&self, kind: ErrorKind, message: String) -> ChainError {
        let terminal = format!("mcp:{}", self.config.name);
        ChainError::new(kind, message).at(Origin::terminal(&terminal))
    }
}

/// The most of a server's stderr logged as one line.
const STDERR_PIECE: usize = 1024;

fn timeout(config: &McpConfig) -> Duration {
    Duration::from_millis(config.timeout_ms)
}

/// The bound on starting the server, in ms.
fn start_ms(config: &McpConfig) -> u64 {
    config
        .start_timeout_ms
        .unwrap_or(config.timeout_ms.max(default_timeout()))
}

fn start_bound(config: &McpConfig) -> Duration {
    Duration::from_millis(start_ms(config))
}

/// Starts a session with the server (spawning it, for a command), within
/// the bound.
async fn connect(config: &McpConfig, listed: &Arc<Listed>) -> Result<Connection, McpError> {
    let fail = |message: String| McpError {
        name: config.name.clone(),
        message,
    };
    let listener = Listener(listed.clone());
    let bound = start_bound(config);
    let (session, process) = match (&config.command, &config.url) {
        (Some(command), None) => {
            let (transport, process) = spawn(config, command).map_err(fail)?;
            (
                tokio::time::timeout(bound, listener.clone().serve(transport)).await,
                Some(process),
            )
        }
        (None, Some(url)) => {
            let transport = http(config, url).map_err(fail)?;
            (
                tokio::time::timeout(bound, listener.clone().serve(transport)).await,
                None,
            )
        }
        _ => return Err(fail("give one of `command` and `url`".to_owned())),
    };
    match session {
        Ok(Ok(session)) => Ok(Connection {
            session,
            _process: process,
        }),
        Ok(Err(e)) => Err(fail(format!("the session did not start: {e}"))),
        Err(_) => Err(fail(format!(
            "did not start within {} ms",
            start_ms(config)
        ))),
    }
}

/// The transport to a streamable-HTTP server: the host's TLS, the
/// configured headers, replies bounded as a stdio server's lines are.
fn http(
    config: &McpConfig,
    url: &str,
) -> Result<StreamableHttpClientTransport<reqwest::Client>, String> {
    let mut headers = HashMap::new();
    for (name, value) in &config.headers {
        let bad = |e: &dyn std::fmt::Display| format!("header '{name}': {e}");
        let name = HeaderName::try_from(name.as_str()).map_err(|e| bad(&e))?;
        let value = HeaderValue::try_from(value.as_str()).map_err(|e| bad(&e))?;
        headers.insert(name, value);
    }
    let client = reqwest::Client::builder()
        .tls_backend_preconfigured((*crate::tls::client_config()).clone())
        .connect_timeout(start_bound(config))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
    let bound = config.max_message_kib << 10;
    let transport = StreamableHttpClientTransportConfig::with_uri(url)
        .custom_headers(headers)
        .max_sse_event_size(bound)
        .max_json_response_size(bound);
    Ok(StreamableHttpClientTransport::with_client(
        client, transport,
    ))
}

/// Spawns the server's command, its stdio piped: the transport over its
/// stdin and stdout, and the process. Its stderr is read into the log.
fn spawn(
    config: &McpConfig,
    program: &str,
) -> Result<(AsyncRwTransport<RoleClient, ChildStdout, ChildStdin>, Child), String> {
    let mut command = tokio::process::Command::new(program);
    command.args(&config.args).env_clear().kill_on_drop(true);
    for key in ["PATH", "HOME"] {
        if let Some(value) = std::env::var_os(key) {
            command.env(key, value);
        }
    }
    command
        .envs(&config.env)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut process = command
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    let (Some(stdout), Some(stdin), Some(stderr)) = (
        process.stdout.take(),
        process.stdin.take(),
        process.stderr.take(),
    ) else {
        return Err("its stdio could not be piped".to_owned());
    };
    let name = config.name.clone();
    tokio::spawn(async move {
        // A line at a time, a long one in pieces: the server's stderr
        // never holds more than a piece of memory here.
        let mut stderr = BufReader::new(stderr);
        let mut piece = Vec::with_capacity(STDERR_PIECE);
        loop {
            piece.clear();
            let mut limited = (&mut stderr).take(STDERR_PIECE as u64);
            match limited.read_until(b'\n', &mut piece).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let line = String::from_utf8_lossy(&piece);
                    let line = crate::escape::terminal_line(line.trim_end());
                    tracing::debug!(server = %name, "{line}");
                }
            }
        }
    });
    let bound = config.max_message_kib << 10;
    let transport = AsyncRwTransport::new_client(stdout, stdin).with_max_line_length(bound);
    Ok((transport, process))
}
