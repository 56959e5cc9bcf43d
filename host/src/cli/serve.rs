//! `shallot serve`: the filters as an OpenAI-compatible HTTP gateway.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use notify::{RecursiveMode, Watcher};
use std::sync::Arc;

use shallot::{Config, Engine, Gateway, GatewayConfig, McpServer, Route, Serving};
use tokio::net::TcpListener;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::mpsc;

use super::{ModelArgs, Source};

/// Serves OpenAI's `POST /v1/chat/completions` and `POST /v1/responses`,
/// Anthropic's `POST /v1/messages` (each JSON and `stream: true` SSE, tools
/// and tool calls passed through: the client runs its own tool loop),
/// `POST /v1/embeddings`, `GET /v1/models`, `GET /healthz`, `GET /readyz`,
/// `GET /metrics` (Prometheus) and `GET /openapi.json`. Each request is one
/// chat through the filters; what the client is shown of an answer goes
/// through the token transforms. Point any OpenAI client's `base_url` at
/// `http://<listen>/v1` (an Anthropic client's at `http://<listen>`), with
/// the model this prints. SIGHUP, or a change to
/// the config file or a plugin (and, in a plugins directory, its `.json`;
/// not a log or other file beside them), reloads: the new set is compiled
/// while the old one serves, then swapped in (requests in flight finish on theirs); a
/// broken one is reported and the old set keeps serving. `[[route]]` tables
/// in the config serve several models, each with its filters, upstream
/// (OpenAI-compatible or Anthropic's; several, balanced with failover) and
/// mode (`proxy`, or `agent`: one agent turn per request with the
/// gateway's tools); without them, one model through every filter. With `[[key]]`
/// tables in the config, clients must present one of those keys
/// (`Authorization: Bearer` or `x-api-key`; `401` otherwise); a key with `models` sees and uses only those. With an `[mcp_gateway]` table,
/// `POST /mcp` is an MCP server (streamable HTTP) over the `[[mcp]]` servers' tools: each key lists and calls
/// the tools its `tools` patterns allow and the filters leave on the menu, every call through the filters; a
/// server that says its tools changed has the set rebuilt over it, and `/mcp`'s clients are told
/// (`notifications/tools/list_changed`) at each reload. SIGTERM or Ctrl-C stops accepting and lets the requests in
/// flight finish. Built with the `otel` feature, spans go to the
/// OpenTelemetry collector at OTEL_EXPORTER_OTLP_ENDPOINT when it is set.
#[derive(Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    source: Source,
    #[command(flatten)]
    model: ModelArgs,
    /// The address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// The largest request body accepted (413 beyond).
    #[arg(long, value_name = "KIB", default_value_t = 4096, value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    max_body_kib: u32,
    /// Requests served at once.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrent: u32,
    /// Requests that may wait for a place (429 beyond, with Retry-After).
    #[arg(long, value_name = "N", default_value_t = 1024)]
    max_queued: usize,
    /// How long a request may wait for a place (then 503, with Retry-After).
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    queue_timeout_ms: u64,
    /// How long one request may take, streaming included (then 504, or an
    /// error event in a stream).
    #[arg(long, value_name = "MS", default_value_t = 300_000)]
    request_timeout_ms: u64,
    /// On SIGTERM or Ctrl-C, how long requests in flight get to finish
    /// (those still running then end with an error, a stream with an error
    /// event; those waiting for a place get 503 at once).
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    drain_timeout_ms: u64,
    /// Client connections open at once; more wait in the listen backlog
    /// until one closes. By default half the open-file limit (which serve
    /// raises to its hard limit), less a reserve: each client connection
    /// may need one to the upstream too.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: Option<u32>,
    /// How long a client may take to send a request's head, and then its
    /// body (408 if late), or sit idle between requests; then the
    /// connection is closed (against clients that open connections and
    /// send nothing, or a byte at a time).
    #[arg(long, value_name = "MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    read_timeout_ms: u64,
    /// Requests to models one client request may cause in all (its model
    /// calls, its filters' side calls, retries and failovers), across every
    /// gateway it passes through (x-shallot-budget): a loop of side calls
    /// back into the gateway ends there.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_model_requests: u64,
    /// Memory the requests being parsed and answered may hold at once: a
    /// request takes what parsing its body could build before it is parsed
    /// (413 if more than all of it; it waits, as for a place, for room).
    #[arg(long, value_name = "MIB", default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_request_mib: u32,
}

pub(crate) async fn run(engine: &Engine, args: ServeArgs) -> anyhow::Result<ExitCode> {
    // Watching (and SIGHUP's handler) before the first load, which can
    // take seconds: a SIGHUP meanwhile would otherwise end the process, and
    // a change meanwhile would be missed. Either reloads once after start.
    let reloads = Reloads::watch(&args.source)?;
    let serving = build(engine, &args, args.source.config()?.as_ref(), None).await?;
    let config = GatewayConfig {
        max_body_bytes: args.max_body_kib as usize * 1024,
        max_concurrent: args.max_concurrent as usize,
        max_queued: args.max_queued,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        request_timeout: Duration::from_millis(args.request_timeout_ms),
        drain_timeout: Duration::from_millis(args.drain_timeout_ms),
        max_connections: max_connections(args.max_connections),
        read_timeout: Duration::from_millis(args.read_timeout_ms),
        max_model_requests: args.max_model_requests,
        max_request_memory: (args.max_request_mib as usize) << 20,
    };
    // Installed before the address is printed: a supervisor may signal as
    // soon as it reads it.
    let mut terminate = signal(SignalKind::terminate())?;
    let mut interrupt = signal(SignalKind::interrupt())?;
    let stopped = async move {
        tokio::select! {
            _ = terminate.recv() => {}
            _ = interrupt.recv() => {}
        }
    };
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    let address = listener.local_addr()?;
    eprintln!(
        "shallot serve: http://{address}/v1 ({}); SIGHUP or a changed file reloads, SIGTERM or Ctrl-C stops",
        describe(&serving)
    );
    let servers = serving.servers().to_vec();
    let gateway = Gateway::new(serving.routes, config);
    gateway.set_keys(serving.keys);
    gateway.set_mcp(serving.mcp);
    let reloading = tokio::spawn(reload(
        engine.clone(),
        args,
        gateway.clone(),
        reloads,
        servers,
    ));
    gateway.serve(listener, stopped).await?;
    reloading.abort();
    eprintln!("shallot serve: stopped");
    Ok(ExitCode::SUCCESS)
}

/// File descriptors kept for what is not a connection: plugin files, the
/// compile cache, logs, the conversation store.
const RESERVED_FILES: u64 = 128;

/// The cap on client connections: `asked`, or what the open-file limit
/// allows (each client connection and one upstream connection for it),
/// after raising that limit to its hard limit.
fn max_connections(asked: Option<u32>) -> usize {
    let files = open_file_limit();
    let allowed = usize::try_from(files.saturating_sub(RESERVED_FILES) / 2)
        .unwrap_or(usize::MAX)
        .clamp(1, 1 << 20);
    match asked {
        None => {
            tracing::info!("serving up to {allowed} connections at once (open-file limit {files})");
            allowed
        }
        Some(asked) => {
            if asked as usize > allowed {
                tracing::warn!(
                    "--max-connections {asked} is more than the open-file limit ({files}) leaves room for with an upstream connection each ({allowed}); past that, accepting and connecting upstream fail"
                );
            }
            asked as usize
        }
    }
}

/// Raises this process's soft open-file limit to its hard limit, as far as
/// the system lets it, and returns the soft limit then in force.
fn open_file_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the rlimit it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return 1024;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads the rlimit it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        }
    }
    limit.rlim_cur
}

/// Loads the filters and builds what the gateway serves (the config's
/// `[[route]]` tables, without any one proxy route over every filter and
/// the model the flags, `[model]` or the environment name; the client
/// keys; the MCP endpoint): all from `config`, one reading of the file.
/// Over `servers` when given (their tools changed), else starting the
/// config's MCP servers.
async fn build(
    engine: &Engine,
    args: &ServeArgs,
    config: Option<&Config>,
    servers: Option<Vec<Arc<McpServer>>>,
) -> anyhow::Result<Serving> {
    let plugins = args.source.load(engine, config).await?;
    let default = args.model.server(config)?;
    Ok(match servers {
        Some(servers) => Serving::over(config, &plugins, default, servers).await?,
        None => Serving::from_config(config, &plugins, default).await?,
    })
}

/// How what is served is announced: the models, their filters in all, and
/// the MCP endpoint's tools.
fn describe(serving: &Serving) -> String {
    let routes: &[Route] = &serving.routes;
    let models: Vec<&str> = routes.iter().map(|r| r.model.as_str()).collect();
    let filters: usize = routes.iter().map(|r| r.kernel.filters().count()).sum();
    let noun = if models.len() == 1 { "model" } else { "models" };
    let mut described = format!("{noun} '{}', {filters} filters", models.join("', '"));
    if let Some(endpoint) = &serving.mcp {
        let tools = endpoint.kernel.tools().len();
        described.push_str(&format!("; /mcp with {tools} tools"));
    }
    described
}

/// Says (on `changed`) when the tools of one of `servers` change, naming
/// it; until the task is aborted.
fn watch_tools(
    servers: &[Arc<McpServer>],
    changed: mpsc::UnboundedSender<String>,
) -> Vec<tokio::task::AbortHandle> {
    let watch = |server: Arc<McpServer>| {
        let changed = changed.clone();
        tokio::spawn(async move {
            let mut seen = server.changes();
            loop {
                seen = server.changed(seen).await;
                let what = format!("the tools of the MCP server '{}'", server.name());
                if changed.send(what).is_err() {
                    return;
                }
            }
        })
        .abort_handle()
    };
    servers.iter().cloned().map(watch).collect()
}

/// What asks for a reload: SIGHUP, and changes to the config file or a
/// plugin (each sent as the path that changed).
struct Reloads {
    changes: mpsc::UnboundedReceiver<String>,
    changed: mpsc::UnboundedSender<String>,
    /// The MCP servers whose tools changed: a rebuild over the same
    /// servers, none started again.
    tools: mpsc::UnboundedReceiver<String>,
    tools_changed: mpsc::UnboundedSender<String>,
    hangups: Signal,
    /// Kept alive for as long as changes are wanted.
    watcher: Option<notify::RecommendedWatcher>,
}

impl Reloads {
    fn watch(source: &Source) -> anyhow::Result<Self> {
        let (changed, changes) = mpsc::unbounded_channel();
        let (tools_changed, tools) = mpsc::unbounded_channel();
        let config = source.config().ok().flatten();
        let watcher = match watch(source, config.as_ref(), changed.clone()) {
            Ok(watcher) => Some(watcher),
            Err(e) => {
                eprintln!("shallot serve: not watching files ({e}); SIGHUP still reloads");
                None
            }
        };
        Ok(Reloads {
            changes,
            changed,
            tools,
            tools_changed,
            hangups: signal(SignalKind::hangup())?,
            watcher,
        })
    }

    /// Watches what the config names now (a reload can move the plugins
    /// to another directory, or a directory can have been replaced); the
    /// new watch is in place before the old one goes. A config naming
    /// directories that cannot be watched keeps the old watch.
    fn rewatch(&mut self, source: &Source, config: Option<&Config>) {
        if let Ok(watcher) = watch(source, config, self.changed.clone()) {
            self.watcher = Some(watcher);
        }
    }

    /// Waits for the next reload to be asked for, and for its changes to
    /// settle (an editor or a copy writes in several steps): until no
    /// change came for `SETTLE`, or `SETTLED` after the first one for a
    /// file that keeps changing. Says what asked for it: `SIGHUP`, the
    /// files that changed and the MCP servers whose tools did, each once,
    /// in the order they came; and whether only servers' tools did (then
    /// the servers are kept).
    async fn next(&mut self) -> (String, bool) {
        let mut asked = Vec::new();
        let mut only_tools = true;
        let mut ask = |why: String, tools: bool| {
            only_tools &= tools;
            if !asked.contains(&why) {
                asked.push(why);
            }
        };
        tokio::select! {
            Some(path) = self.changes.recv() => ask(path, false),
            Some(server) = self.tools.recv() => ask(server, true),
            _ = self.hangups.recv() => ask("SIGHUP".to_owned(), false),
        }
        let settled = tokio::time::Instant::now() + SETTLED;
        loop {
            let quiet = (tokio::time::Instant::now() + SETTLE).min(settled);
            tokio::select! {
                Some(path) = self.changes.recv() => ask(path, false),
                Some(server) = self.tools.recv() => ask(server, true),
                _ = self.hangups.recv() => ask("SIGHUP".to_owned(), false),
                () = tokio::time::sleep_until(quiet) => break,
            }
        }
        (asked.join(", "), only_tools)
    }
}

/// Reloads whenever asked: the new set is loaded and compiled while the old
/// one serves, then swapped in; a broken one leaves the old set serving and
/// is reported. When only MCP servers' tools changed, the same servers
/// serve the new set; otherwise the config's servers are started again.
async fn reload(
    engine: Engine,
    args: ServeArgs,
    gateway: Gateway,
    mut reloads: Reloads,
    mut servers: Vec<Arc<McpServer>>,
) {
    let mut watching = watch_tools(&servers, reloads.tools_changed.clone());
    loop {
        let (asked, only_tools) = reloads.next().await;
        // A path can be named by whoever can write beside the config.
        let asked = shallot::terminal_line(&asked);
        let config = args.source.config();
        let kept = only_tools.then(|| servers.clone());
        let built = match &config {
            Ok(config) => build(&engine, &args, config.as_ref(), kept).await,
            Err(e) => Err(anyhow::anyhow!("{e:#}")),
        };
        reloads.rewatch(&args.source, config.ok().flatten().as_ref());
        match built {
            Ok(serving) => {
                let described = describe(&serving);
                if !only_tools {
                    watching.iter().for_each(tokio::task::AbortHandle::abort);
                    servers = serving.servers().to_vec();
                    watching = watch_tools(&servers, reloads.tools_changed.clone());
                }
                gateway.swap_serving(serving);
                eprintln!("shallot serve: reloaded ({described}); asked by {asked}");
            }
            Err(e) => {
                let error = format!("{e:#}");
                // Reported in /readyz before it is announced.
                gateway.reload_failed(error.clone());
                let error = shallot::terminal_text(&error);
                eprintln!(
                    "shallot serve: reload failed (asked by {asked}), still serving the previous set: {error}"
                );
            }
        }
    }
}

/// How long changes must stop before a reload starts.
const SETTLE: Duration = Duration::from_millis(200);
/// The longest a reload waits for changes to stop.
const SETTLED: Duration = Duration::from_secs(5);

/// Watches the config file's directory and every plugin's directory.
fn watch(
    source: &Source,
    config: Option<&Config>,
    changed: mpsc::UnboundedSender<String>,
) -> notify::Result<notify::RecommendedWatcher> {
    let changes = source.changes(config);
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        // A lost event (the queue overflowed) may have been any change.
        let concerned = |e: &notify::Event| {
            e.need_rescan() || e.paths.is_empty() || e.paths.iter().any(|p| changes.concern(p))
        };
        // A write finished counts (a slow copy's last word); reads do not.
        let closed_written = |e: &notify::Event| {
            use notify::event::{AccessKind, AccessMode, EventKind};
            e.kind == EventKind::Access(AccessKind::Close(AccessMode::Write))
        };
        let wanted = |e: &notify::Event| !e.kind.is_access() || closed_written(e);
        if let Ok(e) = event
            && wanted(&e)
            && concerned(&e)
        {
            let what = match e.paths.iter().find(|p| changes.concern(p)) {
                Some(path) if !e.need_rescan() => path.display().to_string(),
                _ => "a change the file watcher lost track of".to_owned(),
            };
            let _ = changed.send(what);
        }
    })?;
    for dir in source.watched(config) {
        watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    }
    Ok(watcher)
}
