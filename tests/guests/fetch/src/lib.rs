//! Test guest: sends outgoing HTTP requests through `wasi:http` (with
//! wstd, as a Rust filter would) and answers the chat with what each
//! request came to, one line each: `<status> <bytes> <first 64 bytes of
//! the body>` or `error <ErrorCode>`. Where it sends them is its
//! configuration, so the tests can point it at unlisted origins,
//! loopback, redirects and hostile servers.

use serde::Deserialize;
use shallot_guest::{ChatRequest, ChatResponse, Filter, FilterError, FinishReason, Message, Next};
use wstd::http::error::ErrorCode;
use wstd::http::{Body, Client, Request};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Fetch {
    /// Where to send.
    url: String,
    /// How many times (each a request of its own).
    #[serde(default = "one")]
    times: u32,
    /// A body of this many bytes (a POST), or none (a GET).
    #[serde(default)]
    body_bytes: usize,
    /// Follow one redirect, as a browser's `fetch` would.
    #[serde(default)]
    follow: bool,
    /// When: `configure` (while the instance is made) or `chat`.
    #[serde(default = "chat")]
    on: String,
    /// A header to send, name and value (a `Host` of its own, say).
    header: Option<(String, String)>,
}

fn one() -> u32 {
    1
}

fn chat() -> String {
    "chat".into()
}

/// What one request came to.
async fn outcome(
    url: &str,
    body_bytes: usize,
    follow: bool,
    header: Option<&(String, String)>,
) -> (String, Option<String>) {
    let mut request = if body_bytes > 0 {
        Request::post(url).header("content-length", body_bytes)
    } else {
        Request::get(url)
    };
    if let Some((name, value)) = header {
        request = request.header(name.as_str(), value.as_str());
    }
    let request = if body_bytes > 0 {
        request.body(Body::from("x".repeat(body_bytes)))
    } else {
        request.body(Body::empty())
    };
    let mut response = match Client::new().send(request.expect("a valid request")).await {
        Ok(response) => response,
        Err(e) => return (failure(&e), None),
    };
    let status = response.status();
    let location = response
        .headers()
        .get("location")
        .and_then(|l| l.to_str().ok())
        .filter(|_| follow && status.is_redirection())
        .map(str::to_owned);
    match response.body_mut().contents().await {
        Ok(body) => {
            let head = String::from_utf8_lossy(&body[..body.len().min(64)]).into_owned();
            (
                format!("{} {} {head}", status.as_u16(), body.len()),
                location,
            )
        }
        Err(e) => (failure(&e), None),
    }
}

fn failure(e: &wstd::http::Error) -> String {
    match e.downcast_ref::<ErrorCode>() {
        Some(code) => format!(
            "error {}",
            format!("{code:?}").trim_start_matches("ErrorCode::")
        ),
        None => format!("error {e:#}"),
    }
}

impl Fetch {
    fn run(&self) -> Vec<String> {
        wstd::runtime::block_on(async {
            let mut lines = Vec::new();
            for _ in 0..self.times {
                let header = self.header.as_ref();
                let (line, location) =
                    outcome(&self.url, self.body_bytes, self.follow, header).await;
                lines.push(line);
                if let Some(location) = location {
                    lines.push(outcome(&location, 0, false, None).await.0);
                }
            }
            lines
        })
    }
}

#[shallot_guest::filter]
impl Filter for Fetch {
    fn configure(&mut self) -> Result<(), String> {
        if self.on == "configure" {
            return Err(self.run().join("\n"));
        }
        Ok(())
    }

    fn around_chat(
        &self,
        _request: &ChatRequest,
        _next: Next,
    ) -> Result<ChatResponse, FilterError> {
        let lines = self.run();
        Ok(ChatResponse::new(
            &Message::assistant(lines.join("\n")),
            FinishReason::Complete,
        ))
    }
}
