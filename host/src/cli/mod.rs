//! Command-line interface: argument parsing, output, and progress. Thin:
//! everything it does is a call into the library.

mod chat;
#[cfg(feature = "otel")]
mod otel;
mod plugins;
mod serve;

use std::ffi::OsStr;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use shallot::{Config, Engine, EngineConfig, FilterSet, LoadEvent, OpenAiConfig, Server};

/// shallot: run LLM agent filters as sandboxed WebAssembly plugins.
///
/// Filters are onion layers around a model call, a tool call and an agent
/// turn, plus a streaming token transform. Drop `.wasm` filters into a
/// plugins directory (layered in file-name order, each optionally with a
/// `<name>.json` config beside it) or list them in a `shallot.toml`.
#[derive(Parser)]
#[command(name = "shallot", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Where compiled plugins are cached [default: $SHALLOT_CACHE_DIR, $XDG_CACHE_HOME/shallot or ~/.cache/shallot]
    #[arg(long, global = true, value_name = "DIR")]
    cache_dir: Option<PathBuf>,
    /// Compile plugins on every run instead of caching them.
    #[arg(long, global = true)]
    no_cache: bool,
    /// Filter instances that may be in use at once across all requests. A
    /// request holds one per filter hook on its stack (a streamed answer,
    /// for as long as it streams), so concurrent streams through N filters
    /// need N or more each (a filter's own cap is its `limits.instances`);
    /// each slot reserves address space for a filter's memory, which
    /// bounds this at about 10,000.
    #[arg(long, global = true, value_name = "N", default_value_t = EngineConfig::default().instance_slots,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    instance_slots: u32,
    /// Idle filter instances kept ready across all filters (`warm` ones
    /// between requests, fresh ones for `invoke` filters); more keep a busy
    /// gateway from making new instances, at about 100 KiB each.
    #[arg(long, global = true, value_name = "N", default_value_t = EngineConfig::default().idle_instances,
          value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    idle_instances: u32,
    /// Log more: -v for info, -vv for debug (filters' own logs), -vvv for trace. RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// How log lines are written to stderr: `text` for people, `json` (one
    /// object per line, with the request's span fields) for log collectors.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Send prompts through the filters to the model and print the answers.
    Chat(chat::ChatArgs),
    /// Serve the filters as an OpenAI-compatible HTTP gateway.
    Serve(serve::ServeArgs),
    /// Inspect plugins.
    #[command(subcommand)]
    Plugins(plugins::PluginsCommand),
}

/// Where the filters come from.
#[derive(Args, Debug, Clone)]
#[group(multiple = false)]
pub(crate) struct Source {
    /// A plugins directory: every *.wasm, in file-name order.
    #[arg(long, value_name = "DIR")]
    plugins: Option<PathBuf>,
    /// A shallot.toml listing filters explicitly (name, plugin, config, limits, grants, isolation).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
}

impl Source {
    /// The config file, read once for everything taken from it; `None`
    /// without `--config`.
    pub(crate) fn config(&self) -> anyhow::Result<Option<Config>> {
        Ok(self.config.as_deref().map(Config::read).transpose()?)
    }

    /// Loads the plugin set (from `config`, what [`Source::config`] read),
    /// reporting slow compiles on stderr.
    pub(crate) async fn load(
        &self,
        engine: &Engine,
        config: Option<&Config>,
    ) -> anyhow::Result<FilterSet> {
        let mut progress = |event: LoadEvent<'_>| report(&event);
        let set = match (&self.plugins, config) {
            (Some(dir), _) => FilterSet::from_dir(engine, dir, &mut progress).await?,
            (_, Some(config)) => {
                FilterSet::from_specs(engine, config.filters()?, &mut progress).await?
            }
            (None, None) => {
                eprintln!("note: no --plugins or --config: the prompts go to the model unfiltered");
                FilterSet::default()
            }
        };
        Ok(set)
    }
}

/// Which model the filters wrap.
#[derive(Args, Debug, Clone)]
pub(crate) struct ModelArgs {
    /// Use the OpenAI-compatible server at this API base instead of the
    /// embedded model, e.g. http://localhost:11434/v1 (Ollama),
    /// http://localhost:8000/v1 (vLLM), https://api.openai.com/v1. The bearer
    /// token comes from OPENAI_API_KEY. Without this flag: the `[model]` table
    /// of --config (`api = "anthropic"` there for Anthropic's Messages API),
    /// then OPENAI_BASE_URL / OPENAI_API_KEY, then the embedded offline model.
    /// With a `[model]` table, this flag moves that server to URL, keeping
    /// its API and key.
    #[arg(long, value_name = "URL")]
    model_url: Option<String>,
    /// The model to ask the server for [default: SHALLOT_MODEL, else gpt-4o-mini].
    #[arg(long, value_name = "NAME")]
    model: Option<String>,
}

impl ModelArgs {
    /// The model server the flags, the config file or the environment
    /// name, in that order of precedence; `None` for the embedded model.
    pub(crate) fn server(&self, config: Option<&Config>) -> anyhow::Result<Option<Server>> {
        let configured = config.map(Config::model).transpose()?.flatten();
        let found = configured.or_else(|| OpenAiConfig::from_env().map(Server::OpenAi));
        let server = match (&self.model_url, found) {
            (Some(url), Some(server)) => Some(server.at(url)),
            (Some(url), None) => {
                let server = OpenAiConfig::new(url, OpenAiConfig::default_model()).or_env_key();
                Some(Server::OpenAi(server))
            }
            (None, server) => server,
        };
        match (server, &self.model) {
            (Some(server), Some(model)) => Ok(Some(server.asking(model))),
            (None, Some(_)) => anyhow::bail!(
                "--model names a model on a server: give the server with --model-url, a [model] table in --config, or OPENAI_BASE_URL"
            ),
            (server, None) => Ok(server),
        }
    }
}

impl Source {
    /// The directories whose changes change the set: the plugins
    /// directory, or the config file's and each of its plugins' (as
    /// `config`, the file as last read, names them).
    pub(crate) fn watched(&self, config: Option<&Config>) -> Vec<PathBuf> {
        let mut dirs = Vec::new();
        if let Some(dir) = &self.plugins {
            dirs.push(dir.clone());
        }
        if let Some(file) = &self.config {
            let parent = |path: &std::path::Path| {
                path.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map_or_else(|| PathBuf::from("."), std::path::Path::to_path_buf)
            };
            dirs.push(parent(file));
            if let Some(Ok(specs)) = config.map(Config::filters) {
                dirs.extend(specs.iter().map(|(path, _)| parent(path)));
            }
        }
        dirs.sort();
        dirs.dedup();
        dirs
    }

    /// Which changes in the [`watched`](Self::watched) directories can
    /// change the set.
    pub(crate) fn changes(&self, config: Option<&Config>) -> Changes {
        let mut names = Vec::new();
        if let Some(file) = &self.config {
            names.extend(file.file_name().map(OsStr::to_owned));
            if let Some(Ok(specs)) = config.map(Config::filters) {
                names.extend(
                    specs
                        .iter()
                        .filter_map(|(path, _)| path.file_name().map(OsStr::to_owned)),
                );
            }
        }
        Changes {
            names,
            sidecars: self.plugins.is_some(),
        }
    }
}

/// The files whose changes reload the set (see [`Source::changes`]).
pub(crate) struct Changes {
    /// The config file's name and those of the plugins it names.
    names: Vec<std::ffi::OsString>,
    /// A plugins directory: its `<stem>.json` configs count.
    sidecars: bool,
}

impl Changes {
    /// Whether a change to `path` can change the set: the config file, a
    /// plugin (any `*.wasm`, and each plugin file the config names), a
    /// plugin's `<stem>.json` in a plugins directory, or a directory or
    /// link swapped in (as Kubernetes updates a mounted ConfigMap, through
    /// `..data`). Other files beside them (a log, a trace, a store) never
    /// reload it, or a gateway logging next to its config would reload
    /// forever.
    pub(crate) fn concern(&self, path: &Path) -> bool {
        let Some(name) = path.file_name() else {
            return true;
        };
        let extension = path.extension().and_then(OsStr::to_str);
        extension == Some("wasm")
            || (self.sidecars && extension == Some("json"))
            || self.names.iter().any(|known| known == name)
            || name.as_encoded_bytes().starts_with(b"..")
            || std::fs::symlink_metadata(path).is_ok_and(|m| !m.is_file())
    }
}

/// Shows a compile as it starts, so a slow one is never a silent pause.
fn report(event: &LoadEvent<'_>) {
    match event {
        LoadEvent::Compiling { path, size } => {
            eprintln!("compiling {} ({})...", path.display(), human_size(*size));
        }
        LoadEvent::Warning { message } => eprintln!("warning: {message}"),
        LoadEvent::Loaded { filter, .. } => {
            let hooks: Vec<&str> = filter.hooks().iter().map(|h| h.as_str()).collect();
            tracing::info!(
                "loaded filter '{}' from {} ({}; {})",
                filter.name(),
                filter.plugin().path().display(),
                hooks.join(", "),
                filter.isolation().as_str()
            );
        }
    }
}

pub(crate) fn human_size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = init_logging(cli.verbose, cli.log_format);
    let mut config = EngineConfig {
        instance_slots: cli.instance_slots,
        idle_instances: cli.idle_instances,
        ..EngineConfig::default()
    };
    if cli.no_cache {
        config.cache_dir = None;
    } else if let Some(dir) = cli.cache_dir.clone() {
        config.cache_dir = Some(dir);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let (slots, idle) = (config.instance_slots, config.idle_instances);
        let engine = Engine::new(config).map_err(|e| {
            anyhow::anyhow!("{e} (with {slots} instance slots and {idle} idle instances: each reserves address space for a filter's memory; try fewer --instance-slots or --idle-instances)")
        })?;
        match cli.command {
            Command::Chat(args) => chat::run(&engine, args).await,
            Command::Serve(args) => serve::run(&engine, args).await,
            Command::Plugins(command) => plugins::run(&engine, command).await,
        }
    });
    // A compile still running (a reload when SIGTERM came) does not hold
    // the exit: its thread is left to the process's end.
    runtime.shutdown_background();
    match result {
        Ok(code) => code,
        Err(e) => {
            // An error can quote a filter or a model: nothing in it may
            // move the cursor or forge a line.
            eprintln!("error: {}", shallot::terminal_text(&format!("{e:#}")));
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr and, with the `otel` feature and an OTLP endpoint in the
/// environment, exports spans; keep what it returns until the end.
fn init_logging(verbose: u8, format: LogFormat) -> Telemetry {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::{EnvFilter, Layer as _};
    let default = match verbose {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("warn,shallot={default}")));
    let logs = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false);
    let logs = match format {
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).boxed(),
        LogFormat::Json => logs.json().with_current_span(true).boxed(),
    };
    let registry = tracing_subscriber::registry().with(logs.with_filter(filter));
    #[cfg(feature = "otel")]
    {
        let (layer, export) = otel::layer().unzip();
        registry.with(layer).init();
        Telemetry { _export: export }
    }
    #[cfg(not(feature = "otel"))]
    {
        registry.init();
        Telemetry {}
    }
}

/// What must outlive the command: the span export, flushed when dropped.
struct Telemetry {
    #[cfg(feature = "otel")]
    _export: Option<otel::Export>,
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::Source;

    #[test]
    fn only_plugins_their_sidecars_the_config_and_swapped_links_concern_a_reload() {
        let dir = std::env::temp_dir().join(format!("shallot-changes-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("..data")).unwrap();
        let config = dir.join("shallot.toml");
        std::fs::write(&config, "[[filter]]\nplugin = \"guard.component\"\n").unwrap();

        let plugins = Source {
            plugins: Some(dir.clone()),
            config: None,
        }
        .changes(None);
        assert!(plugins.concern(&dir.join("safeguard.wasm")));
        assert!(plugins.concern(&dir.join("safeguard.json")));
        assert!(!plugins.concern(&dir.join("gateway.log")));
        assert!(!plugins.concern(&dir.join("trace.jsonl")));

        let source = Source {
            plugins: None,
            config: Some(config.clone()),
        };
        let configured = source.changes(source.config().unwrap().as_ref());
        assert!(configured.concern(&config));
        assert!(configured.concern(Path::new("plugins/safeguard.wasm")));
        assert!(
            configured.concern(&dir.join("guard.component")),
            "a plugin it names"
        );
        assert!(
            configured.concern(&dir.join("..data")),
            "a directory swapped in"
        );
        assert!(configured.concern(&dir.join("..2026_12_01_10_00_00.123")));
        assert!(!configured.concern(&dir.join("shallot.toml.new")));
        assert!(!configured.concern(&dir.join("safeguard.json")));
        assert!(!configured.concern(&dir.join("conversations.db")));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
