//! The floor under any gateway on this machine, for the gateway benchmark
//! (`scripts/bench-gateway`): an HTTP hop built from the gateway's own
//! parts (axum in, reqwest out, tokio, mimalloc) and nothing else. Each
//! chat completion's body goes to the upstream as it came and the answer
//! comes back byte for byte, streamed as it arrives: no parsing, no
//! filters. What `shallot serve` adds over this hop is shallot's; what the
//! hop adds over the upstream is the machine's and the parts'.
//! `bare_proxy 127.0.0.1:9106 http://127.0.0.1:9100`.

use std::sync::OnceLock;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use mimalloc::MiMalloc;

#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// The upstream's chat completions URL, and the client that reaches it.
static UPSTREAM: OnceLock<(String, reqwest::Client)> = OnceLock::new();

async fn forward(body: Bytes) -> Response {
    let (url, client) = UPSTREAM.get().expect("set before serving");
    let answer = client
        .post(url)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body)
        .send()
        .await;
    match answer {
        Ok(answer) => {
            let status = answer.status();
            let kind = answer.headers().get(header::CONTENT_TYPE).cloned();
            let mut response = Body::from_stream(answer.bytes_stream()).into_response();
            *response.status_mut() = status;
            if let Some(kind) = kind {
                response.headers_mut().insert(header::CONTENT_TYPE, kind);
            }
            response
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(address), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: bare_proxy LISTEN UPSTREAM (e.g. 127.0.0.1:9106 http://127.0.0.1:9100)");
        std::process::exit(2);
    };
    UPSTREAM.get_or_init(|| {
        (
            format!("{upstream}/v1/chat/completions"),
            reqwest::Client::new(),
        )
    });
    let listener = tokio::net::TcpListener::bind(&address).await?;
    eprintln!("bare proxy: http://{address}/v1 -> {upstream}/v1");
    let app = Router::new().route("/v1/chat/completions", post(forward));
    // As the gateway does: answers go out as they are written.
    let listener = axum::serve::ListenerExt::tap_io(listener, |connection| {
        let _ = connection.set_nodelay(true);
    });
    axum::serve(listener, app).await
}
