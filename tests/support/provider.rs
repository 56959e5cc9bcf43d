//! A fake model provider on loopback, speaking chat-completions over
//! HTTP/1.1, JSON and SSE.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::wire::read_request;

/// What the fake provider answers one request with.
#[derive(Clone, Debug)]
pub enum Canned {
    /// A JSON body with this status and extra headers.
    Json(u16, Value, Vec<(&'static str, String)>),
    /// A server-sent-event stream of these `data:` payloads, then `[DONE]`
    /// if `done`, then the connection closes.
    Sse(Vec<Value>, bool),
    /// Starts a stream with these `data:` payloads, then falls silent.
    Stall(Vec<Value>),
    /// An event-stream head and these bytes as they are (any framing, any
    /// encoding), then silence.
    Raw(Vec<u8>),
    /// Never answers.
    Hang,
    /// Closes the connection without answering.
    Close,
}

/// A local server that speaks enough HTTP/1.1 and chat-completions to play
/// a model provider: each request gets the next canned answer (the last
/// repeats), and every request body is recorded.
pub struct FakeProvider {
    /// The API base to point a client at.
    pub url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

impl FakeProvider {
    /// Starts serving on a loopback port.
    pub async fn start(script: Vec<Canned>) -> Self {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a loopback port");
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let recorded = bodies.clone();
        tokio::spawn(async move {
            let mut served = 0usize;
            while let Ok((mut socket, _)) = listener.accept().await {
                let canned = script
                    .get(served)
                    .or(script.last())
                    .cloned()
                    .expect("a script");
                served += 1;
                let recorded = recorded.clone();
                tokio::spawn(async move {
                    let Some(received) = read_request(&mut socket).await else {
                        return;
                    };
                    if received.body.len() < received.length {
                        return;
                    }
                    let body = serde_json::from_slice(&received.body).unwrap_or(Value::Null);
                    recorded.lock().unwrap().push(body);
                    match canned {
                        Canned::Json(status, body, headers) => {
                            let body = body.to_string();
                            let extra: String = headers
                                .iter()
                                .map(|(k, v)| format!("{k}: {v}\r\n"))
                                .collect();
                            let response = format!(
                                "HTTP/1.1 {status} Canned\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n{extra}\r\n{body}",
                                body.len()
                            );
                            let _ = socket.write_all(response.as_bytes()).await;
                        }
                        Canned::Sse(chunks, done) => {
                            send_events(&mut socket, chunks).await;
                            if done {
                                let _ = socket.write_all(b"data: [DONE]\n\n").await;
                            }
                        }
                        Canned::Stall(chunks) => {
                            send_events(&mut socket, chunks).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                        Canned::Raw(bytes) => {
                            send_events(&mut socket, vec![]).await;
                            let _ = socket.write_all(&bytes).await;
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                        }
                        Canned::Hang => tokio::time::sleep(Duration::from_secs(3600)).await,
                        Canned::Close => {}
                    }
                    let _ = socket.shutdown().await;
                });
            }
        });
        FakeProvider { url, bodies }
    }

    /// The request bodies received, in order.
    pub fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }
}

/// Answers with an event-stream head and `chunks` as `data:` events.
async fn send_events(socket: &mut tokio::net::TcpStream, chunks: Vec<Value>) {
    use tokio::io::AsyncWriteExt;
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n";
    let _ = socket.write_all(head.as_bytes()).await;
    for chunk in chunks {
        let _ = socket
            .write_all(format!("data: {chunk}\n\n").as_bytes())
            .await;
        let _ = socket.flush().await;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
