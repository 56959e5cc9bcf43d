//! A model server on loopback speaking Anthropic's Messages wire
//! (`POST /v1/messages`, JSON and its SSE events), for the tests of the
//! Anthropic upstream. It answers like a small model:
//!
//! - the last message holds a `tool_result`: `the tool said <content>`;
//! - tools are offered: a `tool_use` of the first one, with the input
//!   `{"expression": "(2 + 3) * 4"}`;
//! - otherwise: `claude heard: <the last user text>`;
//!
//! and to the model `overloaded`, Anthropic's `529 overloaded_error`. It
//! records each request's headers and body.

use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::wire::read_request;

/// The server; it stops with the test's runtime.
pub struct AnthropicServer {
    /// The API base to point a client at (`http://127.0.0.1:<port>/v1`).
    pub url: String,
    seen: Arc<Mutex<Vec<(String, Value)>>>,
}

impl AnthropicServer {
    /// Starts serving on a loopback port.
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let recorded = seen.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, recorded.clone()));
            }
        });
        AnthropicServer { url, seen }
    }

    /// Each request's head (lower-cased) and body, in order.
    pub fn requests(&self) -> Vec<(String, Value)> {
        self.seen.lock().unwrap().clone()
    }
}

async fn serve(mut socket: TcpStream, seen: Arc<Mutex<Vec<(String, Value)>>>) {
    let Some(received) = read_request(&mut socket).await else {
        return;
    };
    let body: Value = serde_json::from_slice(&received.body).unwrap_or(Value::Null);
    seen.lock()
        .unwrap()
        .push((received.head.to_ascii_lowercase(), body.clone()));
    if !received.head.starts_with("POST /v1/messages ") {
        let error = json!({ "type": "error", "error": { "type": "not_found_error", "message": "no such path" } });
        return respond(&mut socket, 404, "application/json", &error.to_string()).await;
    }
    if body["model"] == "overloaded" {
        let error = json!({ "type": "error", "error": { "type": "overloaded_error", "message": "Overloaded" } });
        return respond(&mut socket, 529, "application/json", &error.to_string()).await;
    }
    let (block, stop) = answer(&body);
    let message = json!({
        "id": "msg_test", "type": "message", "role": "assistant", "model": body["model"],
        "content": [block], "stop_reason": stop, "stop_sequence": null,
        "usage": { "input_tokens": 10, "output_tokens": 5 },
    });
    if body["stream"] != true {
        return respond(&mut socket, 200, "application/json", &message.to_string()).await;
    }
    let mut start = message.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    start["usage"] = json!({ "input_tokens": 10, "output_tokens": 1 });
    let mut events = vec![
        (
            "message_start",
            json!({ "type": "message_start", "message": start }),
        ),
        ("ping", json!({ "type": "ping" })),
    ];
    let (empty, pieces) = if block["type"] == "text" {
        let text = block["text"].as_str().unwrap();
        let half = text.len() / 2;
        let deltas =
            [&text[..half], &text[half..]].map(|t| json!({ "type": "text_delta", "text": t }));
        (json!({ "type": "text", "text": "" }), deltas)
    } else {
        let input = block["input"].to_string();
        let half = input.len() / 2;
        let deltas = [&input[..half], &input[half..]]
            .map(|t| json!({ "type": "input_json_delta", "partial_json": t }));
        let mut empty = block.clone();
        empty["input"] = json!({});
        (empty, deltas)
    };
    events.push((
        "content_block_start",
        json!({ "type": "content_block_start", "index": 0, "content_block": empty }),
    ));
    for delta in pieces {
        events.push((
            "content_block_delta",
            json!({ "type": "content_block_delta", "index": 0, "delta": delta }),
        ));
    }
    events.push((
        "content_block_stop",
        json!({ "type": "content_block_stop", "index": 0 }),
    ));
    events.push(("message_delta", json!({ "type": "message_delta", "delta": { "stop_reason": stop, "stop_sequence": null }, "usage": { "output_tokens": 5 } })));
    events.push(("message_stop", json!({ "type": "message_stop" })));
    let text: String = events
        .iter()
        .map(|(name, data)| format!("event: {name}\ndata: {data}\n\n"))
        .collect();
    respond(&mut socket, 200, "text/event-stream", &text).await;
}

/// The answer's one content block and its stop reason.
fn answer(body: &Value) -> (Value, &'static str) {
    let last = body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or_default();
    let blocks = last["content"].as_array().cloned().unwrap_or_default();
    if let Some(result) = blocks.iter().find(|b| b["type"] == "tool_result") {
        let said = result["content"].as_str().unwrap_or_default();
        return (
            json!({ "type": "text", "text": format!("the tool said {said}") }),
            "end_turn",
        );
    }
    if let Some(tool) = body["tools"].as_array().and_then(|t| t.first()) {
        let input = json!({ "expression": "(2 + 3) * 4" });
        return (
            json!({ "type": "tool_use", "id": "toolu_1", "name": tool["name"], "input": input }),
            "tool_use",
        );
    }
    let text = match &last["content"] {
        Value::String(text) => text.clone(),
        _ => blocks.iter().filter_map(|b| b["text"].as_str()).collect(),
    };
    (
        json!({ "type": "text", "text": format!("claude heard: {text}") }),
        "end_turn",
    )
}

async fn respond(socket: &mut TcpStream, status: u16, kind: &str, body: &str) {
    let response = format!(
        "HTTP/1.1 {status} Answer\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = socket.write_all(response.as_bytes()).await;
    let _ = socket.shutdown().await;
}
