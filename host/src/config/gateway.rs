//! The gateway's part of a `shallot.toml`: its routes (`[[route]]`) and
//! MCP endpoint (`[mcp_gateway]`), read into specs the gateway builds
//! from (the client keys are in `keys`).

use serde::Deserialize;

use super::Config;
use crate::model::{AnthropicConfig, OpenAiConfig, PoolConfig, Server};
use crate::plugin::LoadError;
use crate::store::StoreSpec;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RouteEntry {
    model: String,
    #[serde(default)]
    mode: RouteMode,
    filters: Option<Vec<String>>,
    upstream: Option<UpstreamEntry>,
    upstreams: Option<Vec<ServerEntry>>,
    cool_after: Option<u32>,
    cooldown_ms: Option<u64>,
    store: Option<StoreSpec>,
}

/// A server table: `[model]`, `upstream = { ... }`, or one of `upstreams`
/// (which may also give a `name` and a `weight`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ServerEntry {
    #[serde(default)]
    api: Api,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    weight: Option<u32>,
    base_url: String,
    model: String,
    #[serde(default)]
    api_key: Option<String>,
    #[serde(default)]
    timeout_ms: Option<u64>,
    #[serde(default)]
    max_retries: Option<u32>,
    #[serde(default)]
    max_tokens: Option<u64>,
}

/// The wire a server speaks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Api {
    /// OpenAI's chat completions (and every server compatible with it).
    #[default]
    Openai,
    /// Anthropic's Messages.
    Anthropic,
}

impl ServerEntry {
    /// The server of a table that stands alone (`[model]`, `upstream`):
    /// one without a pool's `name` and `weight`.
    pub(super) fn alone(&self) -> Result<Server, String> {
        if self.name.is_some() || self.weight.is_some() {
            return Err("`name` and `weight` go with `upstreams`".to_owned());
        }
        self.server()
    }

    /// The server, its key from the environment when the table has none
    /// (`OPENAI_API_KEY`, `ANTHROPIC_API_KEY`).
    fn server(&self) -> Result<Server, String> {
        Ok(match self.api {
            Api::Openai => {
                if self.max_tokens.is_some() {
                    return Err("`max_tokens` is for `api = \"anthropic\"` servers (an OpenAI-compatible request sets its own)".to_owned());
                }
                let mut server = OpenAiConfig::new(&self.base_url, &self.model);
                server.api_key.clone_from(&self.api_key);
                server.timeout_ms = self.timeout_ms.unwrap_or(server.timeout_ms);
                server.max_retries = self.max_retries.unwrap_or(server.max_retries);
                Server::OpenAi(server.or_env_key())
            }
            Api::Anthropic => {
                let mut server = AnthropicConfig::new(&self.base_url, &self.model);
                server.api_key.clone_from(&self.api_key);
                server.timeout_ms = self.timeout_ms.unwrap_or(server.timeout_ms);
                server.max_retries = self.max_retries.unwrap_or(server.max_retries);
                server.max_tokens = self.max_tokens.unwrap_or(server.max_tokens);
                Server::Anthropic(server.or_env_key())
            }
        })
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum UpstreamEntry {
    Named(String),
    Server(ServerEntry),
}

/// How a gateway route runs a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RouteMode {
    /// One request is one chat through the filters; the client runs its
    /// own tool loop.
    #[default]
    Proxy,
    /// One request is one agent turn: the turn filters and the tool loop,
    /// with the gateway's own tools; the final answer comes back.
    Agent,
}

/// What a route's model is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upstream {
    /// The embedded offline model.
    Embedded,
    /// A model server.
    Server(Server),
    /// Several servers, balanced by weight, with failover and cooldown.
    Pool {
        /// The servers, in the order they are listed.
        members: Vec<PoolMember>,
        /// When a failing one rests.
        config: PoolConfig,
    },
}

/// One server of a route's pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolMember {
    /// Its name in `/readyz` and `/metrics` (default `<model>@<base_url>`).
    pub name: String,
    /// Its share of the requests (0: a standby, sent only what the others
    /// fail).
    pub weight: u32,
    /// Where it is.
    pub server: Server,
}

/// A gateway route, as a `shallot.toml` `[[route]]` table gives it: the
/// public model name, its mode, the filters it runs (names of `[[filter]]`
/// entries, in order; all of them when not given) and its model (the
/// `[model]` table when not given, else the embedded model).
#[derive(Debug, Clone)]
pub struct RouteSpec {
    /// The name clients ask for.
    pub model: String,
    /// Proxy or agent.
    pub mode: RouteMode,
    /// The filters, by name, outermost first; `None`: every filter.
    pub filters: Option<Vec<String>>,
    /// The model behind it; `None`: the config's default.
    pub upstream: Option<Upstream>,
    /// Where the Responses API keeps its responses (`previous_response_id`):
    /// a conversation store, as a `memory` grant names one; `None`: none
    /// kept.
    pub store: Option<StoreSpec>,
}

/// The gateway's MCP endpoint, as the `[mcp_gateway]` table gives it.
///
/// ```toml
/// [mcp_gateway]
/// filters = ["trace", "guard"]      # [[filter]] names, in order (default: all)
/// allowed_hosts = ["mcp.example.com"]  # `Host`s it answers (default: loopback)
/// max_sessions = 4096               # sessions open at once (503 beyond)
/// sessions = "redis://10.0.0.3:6379/0"  # sessions any replica serves
/// ```
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct McpGatewaySpec {
    /// The filters a `tools/call` runs through, by name, outermost first;
    /// `None`: every filter.
    pub filters: Option<Vec<String>>,
    /// The `Host` headers it answers (`name` or `name:port`; `"*"`: any),
    /// against DNS rebinding; default `localhost`, `127.0.0.1`, `::1`.
    #[serde(default = "loopback")]
    pub allowed_hosts: Vec<String>,
    /// Sessions open at once (default 4096); a client that would open
    /// another gets `503`. An idle session closes after five minutes.
    #[serde(default = "max_sessions")]
    pub max_sessions: usize,
    /// Where the sessions of the initialize handshake are kept, so that
    /// any replica sharing the store serves them (a load balancer needs
    /// no affinity): a `redis://` URL, an SQLite file or `:memory:`.
    /// `None`: only the replica that opened a session serves it.
    pub sessions: Option<StoreSpec>,
}

/// The names of loopback, the `Host`s an MCP endpoint answers by default.
pub const LOOPBACK: [&str; 3] = ["localhost", "127.0.0.1", "::1"];

fn loopback() -> Vec<String> {
    LOOPBACK.map(String::from).to_vec()
}

fn max_sessions() -> usize {
    4096
}

impl Config {
    /// The gateway routes (`[[route]]` tables), in order.
    ///
    /// ```toml
    /// [[route]]
    /// model = "support"                      # what clients ask for
    /// mode = "proxy"                         # or "agent": one agent turn per request
    /// filters = ["logging", "guard"]         # [[filter]] names, in order (default: all)
    /// upstream = { base_url = "http://localhost:8000/v1", model = "Qwen/Qwen2.5-7B-Instruct" }
    ///
    /// [[route]]
    /// model = "demo"
    /// upstream = "embedded"                  # the offline model
    /// store = "responses.db"                 # keeps Responses API responses
    ///
    /// [[route]]
    /// model = "balanced"
    /// upstreams = [                          # weighted, with failover
    ///   { base_url = "http://gpu-a:8000/v1", model = "qwen", weight = 3, max_retries = 0 },
    ///   { base_url = "http://gpu-b:8000/v1", model = "qwen", name = "gpu-b" },
    /// ]
    /// cool_after = 3                         # failures in a row before one rests
    /// cooldown_ms = 30000                    # and for how long
    /// ```
    ///
    /// An upstream without `api_key` takes `OPENAI_API_KEY`.
    pub fn routes(&self) -> Result<Vec<RouteSpec>, LoadError> {
        let mut seen = std::collections::HashSet::new();
        self.parsed
            .routes
            .iter()
            .cloned()
            .map(|route| {
                if !seen.insert(route.model.clone()) {
                    return Err(self.bad(format!("two routes serve the model '{}'", route.model)));
                }
                let upstream = upstream(&route).map_err(|e| self.bad(e))?;
                let mut store = route.store;
                if let Some(store) = &mut store {
                    self.locate(store)?;
                }
                Ok(RouteSpec {
                    model: route.model,
                    mode: route.mode,
                    filters: route.filters,
                    upstream,
                    store,
                })
            })
            .collect()
    }
}

/// A route's upstream (`None`: it has none of its own), or what is wrong
/// with it.
fn upstream(route: &RouteEntry) -> Result<Option<Upstream>, String> {
    let name = &route.model;
    let server = match (&route.upstream, &route.upstreams) {
        (Some(_), Some(_)) => {
            return Err(format!(
                "route '{name}': give `upstream` or `upstreams`, not both"
            ));
        }
        (_, None) if route.cool_after.is_some() || route.cooldown_ms.is_some() => {
            return Err(format!(
                "route '{name}': `cool_after` and `cooldown_ms` go with `upstreams`"
            ));
        }
        (None, Some(members)) => {
            let pool = pool(name, members.clone(), route.cool_after, route.cooldown_ms)?;
            return Ok(Some(pool));
        }
        (None, None) => return Ok(None),
        (Some(UpstreamEntry::Named(upstream)), None) if upstream == "embedded" => {
            return Ok(Some(Upstream::Embedded));
        }
        (Some(UpstreamEntry::Named(upstream)), None) => {
            return Err(format!(
                "route '{name}': upstream '{upstream}' is neither \"embedded\" nor a server table"
            ));
        }
        (Some(UpstreamEntry::Server(server)), None) => server,
    };
    let server = server.alone().map_err(|e| format!("route '{name}': {e}"))?;
    Ok(Some(Upstream::Server(server)))
}

/// A route's `upstreams`, or what is wrong with them.
fn pool(
    route: &str,
    members: Vec<ServerEntry>,
    cool_after: Option<u32>,
    cooldown_ms: Option<u64>,
) -> Result<Upstream, String> {
    if members.is_empty() {
        return Err(format!("route '{route}': `upstreams` is empty"));
    }
    let mut config = PoolConfig::default();
    if let Some(cool_after) = cool_after {
        if cool_after == 0 {
            return Err(format!("route '{route}': `cool_after` must be at least 1"));
        }
        config.cool_after = cool_after;
    }
    if let Some(ms) = cooldown_ms {
        config.cooldown = std::time::Duration::from_millis(ms);
    }
    let mut names = std::collections::HashSet::new();
    let members = members
        .into_iter()
        .map(|entry| {
            let weight = entry.weight.unwrap_or(1);
            let server = entry
                .server()
                .map_err(|e| format!("route '{route}': {e}"))?;
            let name = entry
                .name
                .unwrap_or_else(|| format!("{}@{}", entry.model, entry.base_url));
            if !names.insert(name.clone()) {
                return Err(format!("route '{route}': two upstreams are named '{name}'"));
            }
            Ok(PoolMember {
                name,
                weight,
                server,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(Upstream::Pool { members, config })
}
