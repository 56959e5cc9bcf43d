//! `shallot.toml`: an explicit, ordered list of filters.
//!
//! ```toml
//! # Plugin paths are relative to this directory, itself relative to this file.
//! plugin_dir = "../target/wasm32-wasip2/guest"
//!
//! [[filter]]
//! plugin = "logging.wasm"
//! isolation = "warm"            # trusted: reuse instances across invokes
//!
//! [[filter]]
//! name = "guard"                # default: the plugin's own name
//! plugin = "safeguard.wasm"
//! config = { words = ["bomb"] }
//! limits = { memory_mib = 32, cpu_ms = 50, timeout_ms = 10000 }
//! grants = { clock = true }
//! ```
//!
//! The list order is the layer order (first = outermost). The same plugin
//! may appear twice under two names.
//!
//! A `[model]` table points `shallot chat` at an OpenAI-compatible server
//! (see [`OpenAiConfig`]); without `api_key`, `OPENAI_API_KEY` is used:
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

use super::filter::Isolation;
use super::loader::{FilterSpec, LoadError};
use crate::model::OpenAiConfig;
use crate::sandbox::{Grants, Limits};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    plugin_dir: Option<PathBuf>,
    #[serde(default, rename = "filter")]
    filters: Vec<FilterEntry>,
    model: Option<OpenAiConfig>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FilterEntry {
    name: Option<String>,
    plugin: PathBuf,
    config: Option<toml::Value>,
    #[serde(default)]
    limits: Limits,
    #[serde(default)]
    grants: Grants,
    #[serde(default)]
    isolation: Isolation,
}

fn parse(file: &Path) -> Result<ConfigFile, LoadError> {
    let text = std::fs::read_to_string(file).map_err(|source| LoadError::Read {
        path: file.into(),
        source,
    })?;
    toml::from_str(&text).map_err(|e| LoadError::Config {
        path: file.into(),
        message: e.to_string(),
    })
}

/// Reads a `shallot.toml`'s `[model]` table, if it has one, filling a
/// missing `api_key` from `OPENAI_API_KEY`.
pub fn read_model(file: &Path) -> Result<Option<OpenAiConfig>, LoadError> {
    Ok(parse(file)?.model.map(|mut model| {
        if model.api_key.is_none() {
            model.api_key = std::env::var("OPENAI_API_KEY").ok();
        }
        model
    }))
}

/// Reads a `shallot.toml` into plugin paths and filter specs, in order.
pub fn read_config(file: &Path) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
    let bad = |message: String| LoadError::Config {
        path: file.into(),
        message,
    };
    let parsed = parse(file)?;
    let base = file.parent().unwrap_or(Path::new("."));
    let dir = match parsed.plugin_dir {
        Some(dir) => base.join(dir),
        None => base.to_path_buf(),
    };
    parsed
        .filters
        .into_iter()
        .map(|entry| {
            let config = entry
                .config
                .map(|value| {
                    serde_json::to_value(value).map_err(|e| bad(format!("filter config: {e}")))
                })
                .transpose()?;
            let spec = FilterSpec {
                name: entry.name,
                config,
                limits: entry.limits,
                grants: entry.grants,
                isolation: entry.isolation,
            };
            Ok((dir.join(entry.plugin), spec))
        })
        .collect()
}

/// Lists a plugins directory: every `*.wasm` in file-name order, each with
/// the configuration in its sidecar `<stem>.json`, if there is one.
pub fn read_dir(dir: &Path) -> Result<Vec<(PathBuf, FilterSpec)>, LoadError> {
    let entries = std::fs::read_dir(dir).map_err(|source| LoadError::Read {
        path: dir.into(),
        source,
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
                Err(source) => {
                    return Err(LoadError::Read {
                        path: sidecar,
                        source,
                    });
                }
            };
            Ok((
                path,
                FilterSpec {
                    config,
                    ..FilterSpec::default()
                },
            ))
        })
        .collect()
}
