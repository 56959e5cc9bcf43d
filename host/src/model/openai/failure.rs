//! How a model server's failures become typed errors: its status and
//! message, its `Retry-After`, and a transport that fails.

use std::time::Duration;

use serde_json::Value;

use super::body;
use crate::types::{ChainError, ErrorKind};

/// A failed HTTP status as a typed error, with the server's message and its
/// `Retry-After`.
pub(super) async fn status_error(response: reqwest::Response) -> (ChainError, Option<Duration>) {
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

pub(super) fn transport_error(error: reqwest::Error) -> ChainError {
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
