//! A fast OpenAI-compatible model server for the gateway benchmark
//! (`scripts/bench-gateway`): every chat completion is answered at once
//! with the same short answer, as JSON or, with `"stream": true`, as
//! server-sent chunks. `mock_upstream 127.0.0.1:9100 [PACE_MS]`: with a
//! pace, each chunk of a stream waits that long before it goes out (slow
//! streams, to hold many open at once).

use std::sync::OnceLock;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures::StreamExt as _;

const ANSWER: &str = r#"{"id":"chatcmpl-mock","object":"chat.completion","created":0,"model":"mock","choices":[{"index":0,"message":{"role":"assistant","content":"The answer is 42."},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}"#;

const STREAM: &str = concat!(
    "data: {\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"The answer \"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"is 42.\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n",
    "data: {\"id\":\"chatcmpl-mock\",\"object\":\"chat.completion.chunk\",\"created\":0,\"model\":\"mock\",\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":5,\"total_tokens\":17}}\n\n",
    "data: [DONE]\n\n",
);

/// How long each chunk of a stream waits before it goes out.
static PACE: OnceLock<Duration> = OnceLock::new();

async fn complete(body: Bytes) -> Response {
    let streamed = body
        .windows(b"\"stream\":true".len())
        .any(|w| w == b"\"stream\":true");
    let pace = PACE.get().copied().unwrap_or_default();
    if streamed && !pace.is_zero() {
        let events = STREAM.split_inclusive("\n\n").map(move |event| async move {
            tokio::time::sleep(pace).await;
            Ok::<_, std::convert::Infallible>(event)
        });
        let body = Body::from_stream(futures::stream::iter(events).then(|event| event));
        ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
    } else if streamed {
        ([(header::CONTENT_TYPE, "text/event-stream")], STREAM).into_response()
    } else {
        ([(header::CONTENT_TYPE, "application/json")], ANSWER).into_response()
    }
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let address = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:9100".to_owned());
    let pace = std::env::args().nth(2).map_or(0, |ms| {
        ms.parse()
            .expect("PACE_MS is a whole number of milliseconds")
    });
    PACE.get_or_init(|| Duration::from_millis(pace));
    let listener = tokio::net::TcpListener::bind(&address).await?;
    eprintln!("mock upstream: http://{address}/v1");
    let app = Router::new().route("/v1/chat/completions", post(complete));
    // As a real model server on a fast network would: answers go out as
    // they are written, not held for the client's delayed ACK.
    let listener = axum::serve::ListenerExt::tap_io(listener, |connection| {
        let _ = connection.set_nodelay(true);
    });
    axum::serve(listener, app).await
}
