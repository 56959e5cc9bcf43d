//! From a configuration to what a gateway serves: the routes (each model
//! name over its filters, its upstream and its mode) and the client keys.
//! What `shallot serve` runs at start and at every reload, and what an
//! embedder calls to serve the same `shallot.toml`.

use std::sync::Arc;

use crate::agent::{LoopConfig, NoHistory, ToolLoop};
use crate::config::{ClientKey, Config, McpGatewaySpec, RouteMode, RouteSpec, Upstream};
use crate::kernel::{BuildError, Kernel, KernelBuilder};
use crate::kv::open_kv;
use crate::mcp::{McpError, McpServer};
use crate::model::{ChatModel, EmbeddedModel, Server, UpstreamPool};
use crate::plugin::{FilterSet, LoadError};
use crate::types::ChainError;

use super::Route;
use super::mcp::McpEndpoint;

/// Why a configuration's routes could not be built.
#[derive(Debug, thiserror::Error)]
pub enum RouteError {
    /// The configuration's keys or routes are wrong.
    #[error(transparent)]
    Config(#[from] LoadError),
    /// A route (or `/mcp`) names a filter the plugin set does not have.
    #[error("route '{route}': there is no filter named '{filter}'")]
    NoSuchFilter {
        /// The route's model name (`/mcp` for the MCP endpoint).
        route: String,
        /// The filter it names.
        filter: String,
    },
    /// A route's kernel could not be built.
    #[error(transparent)]
    Kernel(#[from] BuildError),
    /// A route's upstream could not be set up.
    #[error("{0}")]
    Upstream(ChainError),
    /// An MCP server did not start, or did not list its tools.
    #[error(transparent)]
    Mcp(#[from] McpError),
    /// A route's response store could not be opened.
    #[error("route '{route}': its store: {error}")]
    Store {
        /// The route's model name.
        route: String,
        /// Why.
        error: String,
    },
    /// A key is allowed a model no route serves: a typo would otherwise
    /// lock its holder out without a word.
    #[error("key '{key}': no route serves the model '{model}' (served: {served})")]
    KeyWithoutRoute {
        /// The key's name.
        key: String,
        /// The model it is allowed.
        model: String,
        /// The models the routes serve, comma-separated.
        served: String,
    },
}

/// What a gateway serves, as a configuration describes it: the routes, the
/// client keys, the MCP endpoint, and the MCP servers the routes and the
/// endpoint share (started once).
pub struct Serving {
    /// The routes, each under its model name.
    pub routes: Vec<Route>,
    /// The keys clients must present (none: the gateway is open).
    pub keys: Vec<ClientKey>,
    /// The `/mcp` endpoint, if the `[mcp_gateway]` table asks for one.
    pub mcp: Option<McpEndpoint>,
    servers: Vec<Arc<McpServer>>,
}

impl Serving {
    /// The routes, keys and MCP endpoint `config` describes, over
    /// `plugins` (loaded from the same configuration): each `[[route]]`
    /// over the filters it names (all of `plugins` if it names none) and its
    /// upstream (`default`, if it names none: `None` is the embedded
    /// model), an `agent` route with the built-in tools, the MCP servers'
    /// tools and a tool loop that keeps no history (the client sends the
    /// conversation, or a `memory` filter keeps it). Without routes (or
    /// without a configuration), one proxy route over all of `plugins` and
    /// `default`, under that model's name. The `[[mcp]]` servers are
    /// started if an agent route or the endpoint uses them.
    pub async fn from_config(
        config: Option<&Config>,
        plugins: &FilterSet,
        default: Option<Server>,
    ) -> Result<Serving, RouteError> {
        let mut servers = Vec::new();
        if let Some(config) = config {
            let agents = config.routes()?.iter().any(|r| r.mode == RouteMode::Agent);
            if agents || config.mcp_gateway()?.is_some() {
                for server in config.mcp()? {
                    servers.push(McpServer::start(server).await?);
                }
            }
        }
        Self::over(config, plugins, default, servers).await
    }

    /// [`Serving::from_config`] over MCP servers already started (those of
    /// an earlier one, after their tools changed): none is started again.
    pub async fn over(
        config: Option<&Config>,
        plugins: &FilterSet,
        default: Option<Server>,
        servers: Vec<Arc<McpServer>>,
    ) -> Result<Serving, RouteError> {
        let (keys, specs) = match config {
            Some(config) => (config.keys()?, config.routes()?),
            None => (Vec::new(), Vec::new()),
        };
        let mcp = match config.map(Config::mcp_gateway).transpose()?.flatten() {
            None => None,
            Some(spec) => Some(endpoint(spec, plugins, &servers).await?),
        };
        if specs.is_empty() {
            let upstream = default.map_or(Upstream::Embedded, Upstream::Server);
            let (builder, model) = with_model(Kernel::builder().plugins(plugins), upstream)?;
            let routes = vec![Route::proxy(model, builder.build()?)];
            check_keys(&keys, &routes)?;
            return Ok(Serving {
                routes,
                keys,
                mcp,
                servers,
            });
        }
        let mut routes = Vec::with_capacity(specs.len());
        for spec in specs {
            routes.push(route(spec, plugins, default.as_ref(), &servers).await?);
        }
        check_keys(&keys, &routes)?;
        Ok(Serving {
            routes,
            keys,
            mcp,
            servers,
        })
    }

    /// The MCP servers its routes and endpoint use.
    pub fn servers(&self) -> &[Arc<McpServer>] {
        &self.servers
    }
}

/// The MCP endpoint `spec` asks for, its filters over `servers`, its
/// sessions in the store it names.
async fn endpoint(
    spec: McpGatewaySpec,
    plugins: &FilterSet,
    servers: &[Arc<McpServer>],
) -> Result<McpEndpoint, RouteError> {
    let mut builder = with_filters(plugins, spec.filters.as_deref(), "/mcp")?;
    for server in servers {
        builder = builder.mcp(server);
    }
    let sessions = match spec.sessions {
        None => None,
        Some(store) => Some(open_kv(store).await.map_err(|error| RouteError::Store {
            route: "/mcp".to_owned(),
            error,
        })?),
    };
    Ok(McpEndpoint {
        allowed_hosts: spec.allowed_hosts,
        max_sessions: spec.max_sessions,
        sessions,
        ..McpEndpoint::new(builder)?
    })
}

/// The route `spec` describes: its filters over its upstream (else the
/// `default` server, else the embedded model), an agent's tools from
/// `servers`, and its store.
async fn route(
    spec: RouteSpec,
    plugins: &FilterSet,
    default: Option<&Server>,
    servers: &[Arc<McpServer>],
) -> Result<Route, RouteError> {
    let builder = with_filters(plugins, spec.filters.as_deref(), &spec.model)?;
    let upstream = match spec.upstream.clone() {
        None => default.map_or(Upstream::Embedded, |s| Upstream::Server(s.clone())),
        Some(upstream) => upstream,
    };
    let (mut builder, _) = with_model(builder, upstream)?;
    if spec.mode == RouteMode::Agent {
        // A client sends its conversation (or a `memory` filter keeps
        // it): the loop keeps none, or every request would add to a
        // history in this process that nothing reads.
        let tool_loop = ToolLoop::new(LoopConfig::default(), NoHistory);
        builder = builder.builtin_tools().turn_terminal(tool_loop);
        for server in servers {
            builder = builder.mcp(server);
        }
    }
    let store = match &spec.store {
        None => None,
        Some(store) => Some(
            open_kv(store.clone())
                .await
                .map_err(|error| RouteError::Store {
                    route: spec.model.clone(),
                    error,
                })?,
        ),
    };
    Ok(Route {
        model: spec.model,
        kernel: builder.build()?,
        mode: spec.mode,
        store,
    })
}

/// A kernel builder over the filters `names` (all of `plugins` for
/// `None`), for `what` (a route's model name, in the error).
fn with_filters(
    plugins: &FilterSet,
    names: Option<&[String]>,
    what: &str,
) -> Result<KernelBuilder, RouteError> {
    let Some(names) = names else {
        return Ok(Kernel::builder().plugins(plugins));
    };
    let mut builder = Kernel::builder();
    for name in names {
        let filter = plugins
            .filters()
            .iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| RouteError::NoSuchFilter {
                route: what.to_owned(),
                filter: name.clone(),
            })?;
        builder = builder.wasm(filter.clone());
    }
    Ok(builder)
}

/// Fails on a key allowed a model no route serves.
fn check_keys(keys: &[ClientKey], routes: &[Route]) -> Result<(), RouteError> {
    for key in keys {
        for model in key.models.iter().flatten() {
            if !routes.iter().any(|route| &route.model == model) {
                let served: Vec<&str> = routes.iter().map(|r| r.model.as_str()).collect();
                return Err(RouteError::KeyWithoutRoute {
                    key: key.name.clone(),
                    model: model.clone(),
                    served: served.join(", "),
                });
            }
        }
    }
    Ok(())
}

/// `builder` over `upstream`, and that model's name.
fn with_model(
    builder: KernelBuilder,
    upstream: Upstream,
) -> Result<(KernelBuilder, String), RouteError> {
    let model: Arc<dyn ChatModel> = match upstream {
        Upstream::Server(server) => server.connect().map_err(RouteError::Upstream)?,
        Upstream::Pool { members, config } => {
            let mut pool = UpstreamPool::new(config);
            for member in members {
                let model = member.server.connect().map_err(RouteError::Upstream)?;
                pool = pool.upstream(member.name, member.weight, model);
            }
            Arc::new(pool)
        }
        Upstream::Embedded => Arc::new(EmbeddedModel::new()),
    };
    let name = model.name().to_owned();
    Ok((builder.model(model), name))
}
