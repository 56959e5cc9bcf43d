//! What filters report in the shared context, as response headers: what a
//! limiting filter saw (the [`RATE_LIMIT`] key) as OpenAI answers it, and
//! what the `cache` filter did (the [`CACHE`] key) as `x-shallot-cache`.
//!
//! The limits: `x-ratelimit-limit-requests`,
//! `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests` (and
//! the `-tokens` three) on every response; the IETF draft's
//! `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset` (in
//! seconds) for the limit nearest being spent (`budget`'s too); and
//! `Retry-After` on a `429`, the longest wait of the limits left at 0.

use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header};
use serde_json::Value;

use crate::context::{CACHE, Context, RATE_LIMIT};

/// Adds the headers for what `context` holds under [`CACHE`] and
/// [`RATE_LIMIT`] to a response of `status`.
pub(super) fn headers(context: &Context, status: StatusCode, headers: &mut HeaderMap) {
    if let Some(Value::String(what)) = context.get(CACHE)
        && matches!(what.as_str(), "hit" | "miss" | "skip")
    {
        let what = HeaderValue::try_from(what).expect("a word is a header value");
        headers.insert(HeaderName::from_static("x-shallot-cache"), what);
    }
    limits(context, status, headers);
}

fn limits(context: &Context, status: StatusCode, headers: &mut HeaderMap) {
    let Some(Value::Object(limits)) = context.get(RATE_LIMIT) else {
        return;
    };
    let mut wait_ms: Option<u64> = None;
    let mut closest: Option<Seen> = None;
    for (what, seen) in &limits {
        let number = |field: &str| seen.get(field).and_then(Value::as_u64);
        let (Some(limit), Some(remaining), Some(reset_ms)) =
            (number("limit"), number("remaining"), number("reset_ms"))
        else {
            continue;
        };
        if remaining == 0 {
            wait_ms = Some(wait_ms.unwrap_or(0).max(reset_ms));
        }
        let seen = Seen {
            limit,
            remaining,
            reset_ms,
        };
        if closest.is_none_or(|closest| seen.closer_than(&closest)) {
            closest = Some(seen);
        }
        // OpenAI's clients read these two; other limits (`budget`) only
        // say when to retry.
        if !matches!(what.as_str(), "requests" | "tokens") {
            continue;
        }
        let mut put = |name: String, value: String| {
            if let (Ok(name), Ok(value)) =
                (HeaderName::try_from(name), HeaderValue::try_from(value))
            {
                headers.insert(name, value);
            }
        };
        put(format!("x-ratelimit-limit-{what}"), limit.to_string());
        put(
            format!("x-ratelimit-remaining-{what}"),
            remaining.to_string(),
        );
        put(format!("x-ratelimit-reset-{what}"), duration(reset_ms));
    }
    if let Some(closest) = closest {
        headers.insert(RATELIMIT_LIMIT, HeaderValue::from(closest.limit));
        headers.insert(RATELIMIT_REMAINING, HeaderValue::from(closest.remaining));
        let reset = closest.reset_ms.div_ceil(1000);
        headers.insert(RATELIMIT_RESET, HeaderValue::from(reset));
    }
    if status == StatusCode::TOO_MANY_REQUESTS
        && let Some(wait_ms) = wait_ms
    {
        let seconds = wait_ms.div_ceil(1000).max(1);
        headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    }
}

const RATELIMIT_LIMIT: HeaderName = HeaderName::from_static("ratelimit-limit");
const RATELIMIT_REMAINING: HeaderName = HeaderName::from_static("ratelimit-remaining");
const RATELIMIT_RESET: HeaderName = HeaderName::from_static("ratelimit-reset");

/// What one limit said: how much it allows, how much is left, and when
/// its window has room again.
#[derive(Clone, Copy)]
struct Seen {
    limit: u64,
    remaining: u64,
    reset_ms: u64,
}

impl Seen {
    /// Whether this limit is nearer being spent than `other`: the smaller
    /// share left (limits of requests, tokens and money compare as
    /// shares), then the longer wait.
    fn closer_than(&self, other: &Seen) -> bool {
        let mine = u128::from(self.remaining) * u128::from(other.limit.max(1));
        let theirs = u128::from(other.remaining) * u128::from(self.limit.max(1));
        mine < theirs || (mine == theirs && self.reset_ms > other.reset_ms)
    }
}

/// A time as OpenAI's reset headers write it: `20ms`, `7.66s`, `6m0s`,
/// `1h2m3s`.
fn duration(ms: u64) -> String {
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (hours, minutes) = (ms / 3_600_000, ms / 60_000 % 60);
    let seconds = (ms % 60_000) as f64 / 1000.0;
    let seconds = format!("{seconds:.2}");
    let seconds = seconds.trim_end_matches('0').trim_end_matches('.');
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, _) => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m{seconds}s"),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, StatusCode};
    use serde_json::json;

    use super::{duration, headers};
    use crate::context::{CACHE, Context, RATE_LIMIT};

    #[test]
    fn durations_read_as_openai_writes_them() {
        assert_eq!(duration(20), "20ms");
        assert_eq!(duration(7660), "7.66s");
        assert_eq!(duration(1000), "1s");
        assert_eq!(duration(360_000), "6m0s");
        assert_eq!(duration(3_723_000), "1h2m3s");
    }

    #[test]
    fn a_refusal_says_when_to_retry_and_a_pass_only_what_is_left() {
        let seen = json!({
            "requests": { "limit": 2, "remaining": 0, "reset_ms": 4200 },
            "tokens": { "limit": 100, "remaining": 40, "reset_ms": 9000 },
            "budget": { "limit": 5, "remaining": 0, "reset_ms": 7000 },
        });
        let context = Context::new().with(RATE_LIMIT, seen.clone());
        let mut refused = HeaderMap::new();
        headers(&context, StatusCode::TOO_MANY_REQUESTS, &mut refused);
        assert_eq!(
            refused["retry-after"], "7",
            "the longest wait of a spent limit"
        );
        assert!(refused.get("x-ratelimit-limit-budget").is_none());
        assert_eq!(refused["x-ratelimit-remaining-requests"], "0");
        assert_eq!(refused["x-ratelimit-reset-tokens"], "9s");
        let standard = ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"]
            .map(|name| refused[name].to_str().unwrap().to_owned());
        assert_eq!(
            standard,
            ["5", "0", "7"],
            "the limit nearest being spent: none left, the longest wait"
        );
        let tokens_closer = json!({
            "requests": { "limit": 100, "remaining": 60, "reset_ms": 1000 },
            "tokens": { "limit": 1000, "remaining": 100, "reset_ms": 2500 },
        });
        let mut shares = HeaderMap::new();
        let context = Context::new().with(RATE_LIMIT, tokens_closer);
        headers(&context, StatusCode::OK, &mut shares);
        assert_eq!(
            shares["ratelimit-remaining"], "100",
            "a tenth left beats 60%"
        );
        assert_eq!(shares["ratelimit-reset"], "3", "seconds, rounded up");
        let context = Context::new().with(RATE_LIMIT, seen);
        let mut passed = HeaderMap::new();
        headers(&context, StatusCode::OK, &mut passed);
        assert!(passed.get("retry-after").is_none());
        assert_eq!(passed["x-ratelimit-limit-tokens"], "100");
        let mut none = HeaderMap::new();
        headers(
            &Context::new().with(RATE_LIMIT, "junk"),
            StatusCode::OK,
            &mut none,
        );
        assert!(none.is_empty());
    }

    #[test]
    fn what_the_cache_did_is_a_header_and_nothing_else_a_filter_writes_is() {
        let mut said = HeaderMap::new();
        headers(
            &Context::new().with(CACHE, "hit"),
            StatusCode::OK,
            &mut said,
        );
        assert_eq!(said["x-shallot-cache"], "hit");
        let mut forged = HeaderMap::new();
        let context = Context::new().with(CACHE, "hit\r\nset-cookie: x");
        headers(&context, StatusCode::OK, &mut forged);
        assert!(forged.is_empty(), "{forged:?}");
    }
}
