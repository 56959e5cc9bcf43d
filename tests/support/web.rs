//! A web service on loopback for the tests of filters' outgoing HTTP: it
//! answers by path, well or badly, and counts what reaches it.
//!
//! - `/hello`: `200` and `hello from the service`.
//! - `/echo`: `200` and the size of the request body it read, in bytes.
//! - `/redirect?to=<url>`: `302` to `<url>`.
//! - `/header?name=<name>`: `200` with the request's header `name`.
//! - `/trickle?bytes=<n>`: `200` with `n` bytes, one every 50 ms.
//! - `/silent`: reads the request and never answers.
//! - `/flood`: `200` declaring 4 GiB, written as fast as the client reads.
//! - `/moderate`: OpenAI's `/v1/moderations` wire: flags an input that
//!   contains "attack" (category `violence`).
//! - `/webhook`: a plain JSON webhook, `{"text", "role", "context"} ->
//!   {"flagged", "reason"}`: flags a text that contains "attack".

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};

use crate::wire::{Received, read_request};

/// The service; it stops with the test's runtime.
pub struct WebService {
    pub address: SocketAddr,
    hits: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
}

impl WebService {
    /// Starts serving on a loopback port.
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0").await
    }

    /// Starts serving on `address` (e.g. another loopback address).
    pub async fn start_on(address: &str) -> Self {
        let listener = TcpListener::bind(address).await.expect("a loopback port");
        let address = listener.local_addr().unwrap();
        let hits = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(AtomicUsize::new(0));
        let (counting, bytes) = (hits.clone(), received.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                counting.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(serve(socket, bytes.clone()));
            }
        });
        WebService {
            address,
            hits,
            received,
        }
    }

    /// The origin, `http://127.0.0.1:<port>`.
    pub fn origin(&self) -> String {
        format!("http://{}", self.address)
    }

    /// The URL of `path` on this service.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.origin())
    }

    /// Connections that reached it.
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    /// Request body bytes it read, over all requests.
    pub fn received(&self) -> usize {
        self.received.load(Ordering::SeqCst)
    }
}

async fn serve(mut socket: TcpStream, received: Arc<AtomicUsize>) {
    let Some(Received { head, body, .. }) = read_request(&mut socket).await else {
        return;
    };
    let target = head.split(' ').nth(1).unwrap_or("/").to_owned();
    received.fetch_add(body.len(), Ordering::SeqCst);
    let (path, query) = target.split_once('?').unwrap_or((&target, ""));
    let _ = match path {
        "/hello" => answer(&mut socket, "200 OK", &[], b"hello from the service").await,
        "/header" => {
            let wanted = query.strip_prefix("name=").unwrap_or("host");
            let value = head
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case(wanted)
                        .then(|| value.trim().to_owned())
                })
                .unwrap_or_default();
            answer(&mut socket, "200 OK", &[], value.as_bytes()).await
        }
        "/echo" => {
            answer(
                &mut socket,
                "200 OK",
                &[],
                body.len().to_string().as_bytes(),
            )
            .await
        }
        "/redirect" => {
            let to = query.strip_prefix("to=").unwrap_or("/");
            answer(&mut socket, "302 Found", &[("location", to)], b"").await
        }
        "/trickle" => {
            let bytes: usize = query
                .strip_prefix("bytes=")
                .and_then(|n| n.parse().ok())
                .unwrap_or(10);
            trickle(&mut socket, bytes).await
        }
        "/silent" => {
            let _ = read_request(&mut socket).await;
            Ok(())
        }
        "/flood" => flood(&mut socket).await,
        "/moderate" => json_answer(&mut socket, moderation(&body)).await,
        "/webhook" => json_answer(&mut socket, webhook(&body)).await,
        _ => answer(&mut socket, "404 Not Found", &[], b"no such path").await,
    };
}

async fn answer(
    socket: &mut TcpStream,
    status: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    socket.write_all(head.as_bytes()).await?;
    socket.write_all(body).await
}

async fn json_answer(socket: &mut TcpStream, value: Value) -> std::io::Result<()> {
    let headers = [("content-type", "application/json")];
    answer(socket, "200 OK", &headers, value.to_string().as_bytes()).await
}

async fn trickle(socket: &mut TcpStream, bytes: usize) -> std::io::Result<()> {
    let head = format!("HTTP/1.1 200 OK\r\ncontent-length: {bytes}\r\nconnection: close\r\n\r\n");
    socket.write_all(head.as_bytes()).await?;
    for _ in 0..bytes {
        tokio::time::sleep(Duration::from_millis(50)).await;
        socket.write_all(b"t").await?;
    }
    Ok(())
}

async fn flood(socket: &mut TcpStream) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        4u64 << 30
    );
    socket.write_all(head.as_bytes()).await?;
    let chunk = vec![b'f'; 64 << 10];
    loop {
        socket.write_all(&chunk).await?;
    }
}

/// Whether a text is flagged: it contains "attack".
fn flagged(text: &str) -> bool {
    text.contains("attack")
}

fn moderation(body: &[u8]) -> Value {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let inputs: Vec<String> = match &request["input"] {
        Value::String(text) => vec![text.clone()],
        Value::Array(items) => items
            .iter()
            .filter_map(|i| i.as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    };
    let results: Vec<Value> = inputs
        .iter()
        .map(|text| {
            let hit = flagged(text);
            json!({
                "flagged": hit,
                "categories": { "violence": hit, "harassment": false },
                "category_scores": { "violence": if hit { 0.97 } else { 0.01 }, "harassment": 0.0 },
            })
        })
        .collect();
    json!({ "id": "modr-1", "model": request["model"], "results": results })
}

fn webhook(body: &[u8]) -> Value {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let text = request["text"].as_str().unwrap_or("");
    if flagged(text) {
        json!({ "flagged": true, "reason": "it speaks of an attack" })
    } else {
        json!({ "flagged": false })
    }
}
