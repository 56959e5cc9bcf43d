//! `shallot serve`: the filters as an OpenAI-compatible HTTP gateway.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use shallot::{ChatModel, EmbeddedModel, Engine, GatewayConfig, Kernel, OpenAiModel};
use tokio::net::TcpListener;

use super::{ModelArgs, Source};

/// Serves `POST /v1/chat/completions` (JSON and `stream: true` SSE, tools
/// and tool calls passed through: the client runs its own tool loop),
/// `GET /v1/models`, `GET /healthz` and `GET /readyz`. Each request is one
/// chat through the filters; what the client is shown of an answer goes
/// through the token transforms. Point any OpenAI client's `base_url` at
/// `http://<listen>/v1`, with the model this prints. SIGTERM or Ctrl-C
/// stops accepting and lets the requests in flight finish.
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
    #[arg(long, value_name = "KIB", default_value_t = 4096)]
    max_body_kib: usize,
    /// Requests served at once.
    #[arg(long, value_name = "N", default_value_t = 256)]
    max_concurrent: usize,
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
    /// On SIGTERM or Ctrl-C, how long requests in flight get to finish.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    drain_timeout_ms: u64,
}

pub(crate) async fn run(engine: &Engine, args: ServeArgs) -> anyhow::Result<ExitCode> {
    let plugins = args.source.load(engine).await?;
    let builder = Kernel::builder().plugins(&plugins);
    let (builder, model) = match args.model.server(&args.source)? {
        Some(server) => {
            let model = OpenAiModel::new(server)?;
            let name = model.name().to_owned();
            (builder.model(model), name)
        }
        None => {
            let model = EmbeddedModel::new();
            let name = model.name().to_owned();
            (builder.model(model), name)
        }
    };
    let kernel = builder.build()?;
    let config = GatewayConfig {
        max_body_bytes: args.max_body_kib * 1024,
        max_concurrent: args.max_concurrent,
        max_queued: args.max_queued,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        request_timeout: Duration::from_millis(args.request_timeout_ms),
        drain_timeout: Duration::from_millis(args.drain_timeout_ms),
        ..GatewayConfig::new(model.as_str())
    };
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", args.listen))?;
    let address = listener.local_addr()?;
    eprintln!(
        "shallot serve: http://{address}/v1 (model '{model}', {} filters); SIGTERM or Ctrl-C stops",
        kernel.filters().count()
    );
    shallot::serve(listener, kernel, config, stopped()).await?;
    eprintln!("shallot serve: stopped");
    Ok(ExitCode::SUCCESS)
}

/// Resolves on SIGTERM or Ctrl-C.
async fn stopped() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
}
