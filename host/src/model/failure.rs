//! How a model server is asked, and how its failures become typed errors:
//! the HTTP client, the retry loop, the server's status and message, its
//! `Retry-After`, and a transport that fails.

use std::time::Duration;

use serde_json::Value;

use super::body;
use crate::context::{BUDGET_HEADER, BUDGET_LEFT_HEADER, Context, Cost};
use crate::types::{ChainError, ErrorKind};

/// The HTTP client of a model server's client: connections within 10 s,
/// reads within `timeout_ms` of silence.
pub(super) fn http_client(timeout_ms: u64) -> Result<reqwest::Client, ChainError> {
    reqwest::Client::builder()
        .tls_backend_preconfigured((*crate::tls::client_config()).clone())
        .connect_timeout(Duration::from_secs(10))
        .read_timeout(Duration::from_millis(timeout_ms))
        .build()
        .map_err(|e| {
            ChainError::new(
                ErrorKind::Internal,
                format!("cannot build the HTTP client: {e}"),
            )
        })
}

/// `<base_url>/<path>`, parsed once when a client is made rather than at
/// every request (a tenth of a model call's host CPU went to parsing it).
pub(super) fn endpoint(base_url: &str, path: &str) -> Result<reqwest::Url, ChainError> {
    let url = format!("{}/{path}", base_url.trim_end_matches('/'));
    reqwest::Url::parse(&url).map_err(|e| {
        ChainError::new(
            ErrorKind::InvalidRequest,
            format!("the model server's base_url makes '{url}', which is not a URL: {e}"),
        )
    })
}

/// The longest a `Retry-After` (or backoff) wait may be.
const MAX_WAIT: Duration = Duration::from_secs(30);

/// Sends the request `post` builds until it succeeds, fails in a way not
/// worth retrying (anything but a transient failure or a timeout), or has
/// been retried `max_retries` times; waits as the server's `Retry-After`
/// says, else backs off (250 ms, doubling), never more than 30 s. Each
/// attempt spends from what `context` may (its tree, a side call's
/// tokens): one that cannot is not sent, and is not worth retrying.
pub(super) async fn send_retrying(
    max_retries: u32,
    context: &Context,
    post: impl Fn() -> reqwest::RequestBuilder,
) -> Result<reqwest::Response, ChainError> {
    let mut attempt = 0;
    loop {
        let lent = spend(context)?;
        let mut request = post();
        if let Some(lent) = lent {
            request = request.header(BUDGET_HEADER, lent);
        }
        let sent = request.send().await;
        settle(context, lent, &sent);
        let (error, retry_after) = match sent {
            Ok(response) if response.status().is_success() => return Ok(response),
            Ok(response) => status_error(response).await,
            Err(e) => (transport_error(e), None),
        };
        let retryable = matches!(error.kind, ErrorKind::Transient | ErrorKind::Timeout);
        if !retryable || attempt >= max_retries {
            return Err(error);
        }
        let backoff = Duration::from_millis(250 << attempt.min(6));
        let wait = retry_after.unwrap_or(backoff).min(MAX_WAIT);
        tracing::warn!(
            attempt = attempt + 1,
            wait_ms = wait.as_millis() as u64,
            "the model server failed ({error}); retrying"
        );
        tokio::time::sleep(wait).await;
        attempt += 1;
    }
}

/// Takes what one attempt may spend: a side call's worst case, and one
/// request of the tree with the loan a gateway there may spend.
fn spend(context: &Context) -> Result<Option<u64>, ChainError> {
    if let Some(tokens) = context.tokens() {
        tokens
            .reserve()
            .map_err(|why| ChainError::new(ErrorKind::LimitExceeded, why))?;
    }
    let Some(tree) = context.tree() else {
        return Ok(None);
    };
    match tree.take() {
        Some(lent) => Ok(Some(lent)),
        None => {
            if let Some(tokens) = context.tokens() {
                tokens.failed(Cost::Nothing);
            }
            Err(ChainError::new(
                ErrorKind::LimitExceeded,
                format!(
                    "this request has made every call to a model it may ({BUDGET_HEADER}): a route's model or a filter's side call leads back to a gateway, or it asks too often"
                ),
            ))
        }
    }
}

/// Settles what an attempt spent: the tree takes back what a gateway did
/// not spend of its loan (all of it from a server that is no gateway or
/// was never reached; none from one that may still be spending), and a
/// side call is charged what a failed attempt cost (an answer, once it is
/// read).
fn settle(context: &Context, lent: Option<u64>, sent: &Result<reqwest::Response, reqwest::Error>) {
    if let (Some(tree), Some(lent)) = (context.tree(), lent) {
        let unspent = match sent {
            Ok(response) => response
                .headers()
                .get(BUDGET_LEFT_HEADER)
                .and_then(|left| left.to_str().ok()?.parse::<u64>().ok())
                .map_or(lent, |left| left.min(lent)),
            Err(e) if e.is_connect() => lent,
            Err(_) => 0,
        };
        tree.give_back(unspent);
    }
    if let Some(tokens) = context.tokens() {
        match sent {
            Ok(response) if response.status().is_success() => {}
            Ok(_) => tokens.failed(Cost::Prompt),
            Err(e) if e.is_connect() => tokens.failed(Cost::Nothing),
            Err(_) => tokens.failed(Cost::Reserved),
        }
    }
}

/// A failed HTTP status as a typed error, with the server's message and its
/// `Retry-After`.
async fn status_error(response: reqwest::Response) -> (ChainError, Option<Duration>) {
    let status = response.status().as_u16();
    let retry_after = retry_after(response.headers());
    let text = body::error_text(response).await;
    let said = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| {
            v["error"]["message"]
                .as_str()
                .or_else(|| v["error"].as_str())
                .map(str::to_owned)
        })
        .unwrap_or(text);
    let kind = match status {
        // A loop (a gateway's 508) does not go away by asking again.
        508 => ErrorKind::InvalidRequest,
        408 | 409 | 429 | 500..=599 => ErrorKind::Transient,
        401 | 403 => ErrorKind::Auth,
        404 => ErrorKind::NotFound,
        _ => ErrorKind::InvalidRequest,
    };
    (
        ChainError::new(
            kind,
            format!(
                "the model server answered {status}: {}",
                body::cut(said.trim())
            ),
        ),
        retry_after,
    )
}

/// How long the server asks to wait: `retry-after-ms` (OpenAI's), else
/// `Retry-After` in seconds or as an HTTP date. A value that is no
/// duration is no answer.
pub(super) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    let seconds = |v: &str| {
        v.parse::<f64>()
            .ok()
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
    };
    if let Some(ms) = header("retry-after-ms").and_then(&seconds) {
        return Some(ms / 1000);
    }
    let value = header("retry-after")?;
    seconds(value).or_else(|| {
        let at = httpdate::parse_http_date(value).ok()?;
        Some(
            at.duration_since(std::time::SystemTime::now())
                .unwrap_or_default(),
        )
    })
}

fn transport_error(error: reqwest::Error) -> ChainError {
    // Without the URL: it may carry credentials (`user:pass@`, `?api-key=`)
    // and the error may reach a gateway's clients.
    let error = error.without_url();
    if error.is_timeout() {
        ChainError::new(
            ErrorKind::Timeout,
            format!("the model server did not answer in time: {error}"),
        )
    } else if error.is_builder() {
        ChainError::new(
            ErrorKind::InvalidRequest,
            format!("bad model request: {error}"),
        )
    } else {
        ChainError::new(
            ErrorKind::Transient,
            format!("cannot reach the model server: {error}"),
        )
    }
}
