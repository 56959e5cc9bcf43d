//! What the loopback servers of the tests share: reading one HTTP/1.1
//! request.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// One request: its head as sent, and as much of its body (by its
/// `content-length`) as arrived before the client stopped sending.
pub(crate) struct Received {
    pub head: String,
    pub body: Vec<u8>,
    /// The body's length as the head declares it.
    pub length: usize,
}

/// Reads one request from `socket`; `None` if it closed before its head
/// ended.
pub(crate) async fn read_request(socket: &mut TcpStream) -> Option<Received> {
    let mut request = Vec::new();
    let mut buf = [0u8; 16 << 10];
    let body_start = loop {
        let n = socket.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return None;
        }
        request.extend_from_slice(&buf[..n]);
        if let Some(at) = request.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&request[..body_start]).into_owned();
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().to_owned())
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = request[body_start..].to_vec();
    while body.len() < length {
        let n = socket.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            break;
        }
        body.extend_from_slice(&buf[..n]);
    }
    body.truncate(length);
    Some(Received { head, body, length })
}
