//! Configuration, at the head of the flow: a `shallot.toml` (an explicit,
//! ordered list of filters, and the model) or a plugins directory, read into
//! the specs a [`FilterSet`] loads.
//!
//! ```toml
//! # Plugin paths are relative to this directory, itself relative to this
//! # file. `${NAME}` and `${NAME:-default}` take environment variables (a
//! # relative value is relative to the working directory, as cargo reads
//! # CARGO_TARGET_DIR).
//! plugin_dir = "${CARGO_TARGET_DIR:-../target}/wasm32-wasip2/guest"
//!
//! [[filter]]
//! plugin = "logging.wasm"
//! isolation = "warm"            # trusted: reuse instances across invokes
//!
//! [[filter]]
//! name = "guard"                # default: its file's name
//! plugin = "safeguard.wasm"
//! config = { words = ["bomb"] }
//! limits = { memory_mib = 32, cpu_ms = 50, timeout_ms = 10000 }
//! grants = { clock = true }
//!
//! [[filter]]
//! plugin = "trace.wasm"
//! # Host services beyond nothing: real clocks, up to 30 s of sleeping per
//! # hook call (`timer`), the approval handler (`approval`), a trace sink
//! # ("stderr", or a file relative to this file), and a conversation store
//! # (a SQLite file relative to this file, "redis://host:6379/0", or
//! # ":memory:").
//! grants = { clock = true, sleep_ms = 30000, approval = true, trace = "trace.jsonl", memory = "conversations.db" }
//! ```
//!
//! The list order is the layer order (first = outermost). The same plugin
//! may appear twice under two names. A table with only `preset = "NAME"`
//! stands for that preset's filters, in its place ([`PRESETS`]: `minimal`,
//! `default`, `production`, `development`, `human_in_loop`, the first
//! seed's middleware presets):
//!
//! ```toml
//! [[filter]]
//! preset = "production"
//! ```
//!
//! A `[model]` table points `shallot chat` (and the gateway's routes that
//! name no upstream of their own) at a model server, as a route's
//! `upstream` table does ([`Server`]): OpenAI-compatible by default,
//! `api = "anthropic"` for Anthropic's Messages; without `api_key`,
//! `OPENAI_API_KEY` (or `ANTHROPIC_API_KEY`) is used:
//!
//! ```toml
//! [model]
//! base_url = "http://localhost:11434/v1"
//! model = "qwen2.5:7b"
//! timeout_ms = 60000
//! max_retries = 2
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::engine::Engine;
use crate::mcp::McpConfig;
use crate::model::Server;
use crate::plugin::{FilterSet, FilterSpec, Isolation, LoadError, LoadEvent};
use crate::plugin::{Grants, TraceTarget};
use crate::sandbox::Limits;
use crate::store::StoreSpec;

mod gateway;
mod keys;
mod presets;

pub use gateway::{LOOPBACK, McpGatewaySpec, PoolMember, RouteMode, RouteSpec, Upstream};
use gateway::{RouteEntry, ServerEntry};
pub use keys::ClientKey;
use keys::KeyEntry;
pub use presets::{PRESETS, preset};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    plugin_dir: Option<String>,
    #[serde(default, rename = "filter")]
    filters: Vec<toml::Spanned<FilterEntry>>,
    model: Option<ServerEntry>,
    #[serde(default, rename = "key")]
    keys: Vec<KeyEntry>,
    #[serde(default, rename = "route")]
    routes: Vec<RouteEntry>,
    #[serde(default)]
    mcp: Vec<McpConfig>,
    mcp_gateway: Option<McpGatewaySpec>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterEntry {
    name: Option<String>,
    plugin: Option<PathBuf>,
    /// A preset's name, in place of one filter: its filters.
    preset: Option<String>,
    config: Option<toml::Value>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    grants: Grants,
    #[serde(default)]
    isolation: Isolation,
}

/// A TOML error by its line and column, without quoting the line: a
/// config's lines can hold keys, and its errors reach logs and `/readyz`.
fn where_in(text: &str, error: &toml::de::Error) -> String {
    let message = error.message().trim_end();
    let Some(span) = error.span() else {
        return message.to_owned();
    };
    let before = text.get(..span.start).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before[before.rfind('\n').map_or(0, |at| at + 1)..]
        .chars()
        .count()
        + 1;
    format!("line {line}, column {column}: {message}")
}

/// A `shallot.toml`, read and parsed once: the filters, the model, the
/// gateway's client keys and routes all come from the same version of the
/// file (a reload reads it once, so a write in between cannot mix two).
/// Each part is checked when it is asked for: `shallot chat` does not need
/// the keys' environment variables set.
#[derive(Debug)]
pub struct Config {
    file: PathBuf,
    parsed: ConfigFile,
    text: String,
}

impl Config {
    /// Reads and parses `file`; a syntax error is placed by line and
    /// column.
    pub fn read(file: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(file).map_err(|error| LoadError::Read {
            path: file.into(),
            error,
        })?;
        let parsed = toml::from_str(&text).map_err(|e| LoadError::Config {
            path: file.into(),
            message: where_in(&text, &e),
        })?;
        Ok(Config {
            file: file.into(),
            parsed,
            text,
        })
    }

    /// The file it was read from.
    pub fn file(&self) -> &Path {
        &self.file
    }

    fn bad(&self, message: String) -> LoadError {
        LoadError::Config {
            path: self.file.clone(),
            message,
        }
    }

    /// The server the `[model]` table names, as a route's `upstream` table
    /// would (`api = "anthropic"`, a missing `api_key` from the environment).
    pub fn model(&self) -> Result<Option<Server>, LoadError> {
        let Some(entry) = &self.parsed.model else {
            return Ok(None);
        };
        let server = entry
            .alone()
            .map_err(|e| self.bad(format!("[model]: {e}")))?;
        Ok(Some(server))
    }

    /// The MCP servers (`[[mcp]]` tables), `${NAME}` taken from the
    /// environment in their commands, arguments, environments, URLs and
    /// headers, and a
    /// command given as a relative path taken from this file's directory.
    pub fn mcp(&self) -> Result<Vec<McpConfig>, LoadError> {
        let base = self.file.parent().unwrap_or(Path::new("."));
        let mut names = std::collections::BTreeSet::new();
        let mut servers = Vec::new();
        for server in &self.parsed.mcp {
            if !names.insert(server.name.as_str()) {
                let message = format!("[[mcp]] '{}': name: two servers have it", server.name);
                return Err(self.bad(message));
            }
            servers.push(self.mcp_server(server, base)?);
        }
        Ok(servers)
    }

    /// One `[[mcp]]` table as a server's configuration, `${NAME}` taken
    /// from the environment and a relative command from `base`.
    fn mcp_server(&self, server: &McpConfig, base: &Path) -> Result<McpConfig, LoadError> {
        let bad =
            |what: &str, e: String| self.bad(format!("[[mcp]] '{}': {what}: {e}", server.name));
        let text = |value: &str, what: &str| {
            expand_text(value)
                .map(|(text, _)| text)
                .map_err(|e| bad(what, e))
        };
        if server.command.is_some() == server.url.is_some() {
            return Err(bad(
                "the server",
                "give one of `command` and `url`".to_owned(),
            ));
        }
        let command = match &server.command {
            None => None,
            Some(command) => {
                let command = text(command, "command")?;
                Some(
                    match command.contains('/') && Path::new(&command).is_relative() {
                        true => base.join(&command).to_string_lossy().into_owned(),
                        false => command,
                    },
                )
            }
        };
        let url = server
            .url
            .as_deref()
            .map(|url| text(url, "url"))
            .transpose()?;
        let headers = server
            .headers
            .iter()
            .map(|(k, v)| Ok((k.clone(), text(v, "headers")?)))
            .collect::<Result<_, LoadError>>()?;
        let args = server
            .args
            .iter()
            .map(|a| text(a, "args"))
            .collect::<Result<_, _>>()?;
        let env = server
            .env
            .iter()
            .map(|(k, v)| Ok((k.clone(), text(v, "env")?)))
            .collect::<Result<_, LoadError>>()?;
        Ok(McpConfig {
            command,
            url,
            headers,
            args,
            env,
            ..server.clone()
        })
    }

    /// The gateway's MCP endpoint (`POST /mcp`), if the `[mcp_gateway]`
    /// table asks for one (it is not served without): the filters its
    /// `tools/call`s run through and the hosts it answers.
    pub fn mcp_gateway(&self) -> Result<Option<McpGatewaySpec>, LoadError> {
        let Some(spec) = &self.parsed.mcp_gateway else {
            return Ok(None);
        };
        if self.parsed.mcp.is_empty() {
            return Err(self.bad(
                "[mcp_gateway]: there are no [[mcp]] servers whose tools it would serve".to_owned(),
            ));
        }
        Ok(Some(spec.clone()))
    }

    /// Makes a SQLite store's path, the operator's file, relative to this
    /// file.
    fn locate(&self, store: &mut StoreSpec) -> Result<(), LoadError> {
        if let StoreSpec::Sqlite(path) = store {
            let base = self.file.parent().unwrap_or(Path::new("."));
            *path = base.join(expand(&path.to_string_lossy()).map_err(|e| self.bad(e))?);
        }
        Ok(())
    }

    /// The filters (`[[filter]]` tables): plugin paths and filter specs, in
    /// order.
    pub fn filters(&self) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
        let bad = |message: String| self.bad(message);
        let base = self.file.parent().unwrap_or(Path::new("."));
        let dir = match &self.parsed.plugin_dir {
            Some(dir) => base.join(expand(dir).map_err(bad)?),
            None => base.to_path_buf(),
        };
        let mut filters = Vec::new();
        for entry in &self.parsed.filters {
            let line = self.text[..entry.span().start].matches('\n').count() + 1;
            let source = format!("{}, the [[filter]] at line {line}", self.file.display());
            let entry = entry.get_ref().clone();
            let only_named = entry.name.is_none()
                && entry.config.is_none()
                && entry.limits == Limits::default()
                && entry.grants == Grants::default()
                && entry.isolation == Isolation::default();
            let plugin = match (entry.plugin, entry.preset) {
                (Some(plugin), None) => plugin,
                (None, Some(_)) if !only_named => {
                    let message = "a `preset` table takes nothing else (list a filter of it on its own to change it)";
                    return Err(bad(format!("{source}: {message}")));
                }
                (None, Some(name)) => {
                    filters.extend(self.preset(&name, &dir, &source)?);
                    continue;
                }
                _ => {
                    return Err(bad(format!("{source}: give one of `plugin` and `preset`")));
                }
            };
            let config = entry
                .config
                .map(|value| {
                    serde_json::to_value(value).map_err(|e| bad(format!("filter config: {e}")))
                })
                .transpose()?;
            let mut grants = entry.grants;
            // A trace file and the SQLite stores are the operator's files,
            // relative to this file.
            if let Some(TraceTarget::File(path)) = &mut grants.trace {
                *path = base.join(expand(&path.to_string_lossy()).map_err(bad)?);
            }
            let kv = grants.kv.as_mut().map(|kv| &mut kv.store);
            for store in [grants.memory.as_mut(), kv].into_iter().flatten() {
                self.locate(store)?;
            }
            let spec = FilterSpec {
                name: entry.name,
                config,
                limits: entry.limits,
                grants,
                isolation: entry.isolation,
                source: Some(source),
            };
            filters.push((dir.join(plugin), spec));
        }
        Ok(filters)
    }

    /// The filters of the preset `name`, named by a `[[filter]]` table
    /// (`source`) that says nothing else.
    fn preset(
        &self,
        name: &str,
        dir: &Path,
        source: &str,
    ) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
        let filters = presets::preset(name).ok_or_else(|| {
            let names = presets::names();
            self.bad(format!("{source}: no preset '{name}' (there are {names})"))
        })?;
        let source = format!("{source}, preset '{name}'");
        let placed = |(plugin, spec): (String, FilterSpec)| {
            let spec = FilterSpec {
                source: Some(source.clone()),
                ..spec
            };
            (dir.join(plugin), spec)
        };
        Ok(filters.into_iter().map(placed).collect())
    }
}

/// Reads a `shallot.toml` into plugin paths and filter specs, in order
/// ([`Config::filters`] of [`Config::read`]).
pub fn read_config(file: &Path) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
    Config::read(file)?.filters()
}

/// Expands `${NAME}` and `${NAME:-default}` in a path from the environment.
/// A path that starts with a variable's (relative) value is made absolute
/// from the working directory, as cargo reads CARGO_TARGET_DIR; one that
/// starts with a default stays relative to the file.
fn expand(text: &str) -> Result<PathBuf, String> {
    let (out, from_env_at_start) = expand_text(text)?;
    let path = PathBuf::from(out);
    if from_env_at_start && path.is_relative() {
        return std::path::absolute(&path).map_err(|e| format!("'{text}': {e}"));
    }
    Ok(path)
}

/// Expands `${NAME}` and `${NAME:-default}` in `text` from the
/// environment; also whether it starts with a variable's value.
fn expand_text(text: &str) -> Result<(String, bool), String> {
    let mut out = String::new();
    let mut rest = text;
    let mut from_env_at_start = false;
    while let Some(start) = rest.find("${") {
        let Some(len) = rest[start..].find('}') else {
            return Err(format!("'{text}': an unclosed ${{"));
        };
        out.push_str(&rest[..start]);
        let inner = &rest[start + 2..start + len];
        let (name, default) = match inner.split_once(":-") {
            Some((name, default)) => (name, Some(default)),
            None => (inner, None),
        };
        match (std::env::var(name).ok().filter(|v| !v.is_empty()), default) {
            (Some(value), _) => {
                from_env_at_start |= out.is_empty();
                out.push_str(&value);
            }
            (None, Some(default)) => out.push_str(default),
            (None, None) => return Err(format!("'{text}': {name} is not set")),
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    Ok((out, from_env_at_start))
}

/// Lists a plugins directory: every `*.wasm` in file-name order, each with
/// the configuration in its sidecar `<stem>.json`, if there is one.
pub fn read_dir(dir: &Path) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|error| LoadError::Read {
        path: dir.into(),
        error,
    })?;
    let files: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.is_file())
        .collect();
    let with = |ext: &'static str| {
        files
            .iter()
            .filter(move |path| path.extension().is_some_and(|e| e == ext))
    };
    // A configuration whose plugin is missing is an error, not a filter
    // that silently vanishes (it may be the safeguard).
    if let Some(sidecar) = with("json").find(|json| !json.with_extension("wasm").is_file()) {
        return Err(LoadError::Config {
            path: sidecar.clone(),
            message: format!(
                "configures a plugin that is not here: there is no {} beside it",
                sidecar.with_extension("wasm").display()
            ),
        });
    }
    let mut wasm: Vec<PathBuf> = with("wasm").cloned().collect();
    wasm.sort_by(|a, b| a.file_name().cmp(&b.file_name()));
    wasm.into_iter()
        .map(|path| {
            let sidecar = path.with_extension("json");
            let config = match std::fs::read_to_string(&sidecar) {
                Ok(text) => Some(serde_json::from_str(&text).map_err(|e| LoadError::Config {
                    path: sidecar.clone(),
                    message: format!("not JSON: {e}"),
                })?),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(error) => {
                    return Err(LoadError::Read {
                        path: sidecar,
                        error,
                    });
                }
            };
            let source = config.is_some().then(|| sidecar.display().to_string());
            Ok((
                path,
                FilterSpec {
                    config,
                    source,
                    ..FilterSpec::default()
                },
            ))
        })
        .collect()
}

impl FilterSet {
    /// Loads every `*.wasm` of `dir` in file-name order (sidecar `<stem>.json`
    /// configs), each in `invoke` isolation.
    pub async fn from_dir(
        engine: &Engine,
        dir: &Path,
        progress: &mut (dyn FnMut(LoadEvent<'_>) + Send),
    ) -> Result<Self, LoadError> {
        Self::from_specs(engine, read_dir(dir)?, progress).await
    }

    /// Loads the filters a `shallot.toml` lists.
    pub async fn from_config(
        engine: &Engine,
        file: &Path,
        progress: &mut (dyn FnMut(LoadEvent<'_>) + Send),
    ) -> Result<Self, LoadError> {
        Self::from_specs(engine, read_config(file)?, progress).await
    }
}

#[cfg(test)]
mod tests;
