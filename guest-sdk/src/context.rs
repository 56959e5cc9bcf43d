//! The shared context of the current invoke: one per invoke, seen by every
//! filter and by the terminal. Values are JSON; these helpers (de)serialize.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::shallot::filter::context as raw;

/// The key a limiting filter (`rate-limit`, `budget`) leaves what it saw
/// under: `{"requests": {"limit", "remaining", "reset_ms"}, "tokens":
/// {...}}` ([`report_limit`]). `shallot serve` answers it as OpenAI's
/// `x-ratelimit-*` headers, and a `limit-exceeded` refusal with
/// `Retry-After`.
pub const RATE_LIMIT: &str = "rate_limit";

/// The value under `key`, `None` when absent or not a `T`.
pub fn get<T: DeserializeOwned>(key: &str) -> Option<T> {
    raw::get(key).and_then(|json| serde_json::from_str(&json).ok())
}

/// The value under `key` as JSON text.
pub fn get_json(key: &str) -> Option<String> {
    raw::get(key)
}

/// Stores `value` under `key`.
pub fn set<T: Serialize + ?Sized>(key: &str, value: &T) {
    let json = serde_json::to_string(value)
        .unwrap_or_else(|e| panic!("context value for {key:?} does not serialize: {e}"));
    raw::set(key, &json).unwrap_or_else(|e| panic!("host refused context value for {key:?}: {e}"));
}

/// The value under `key` as text: a string as it is, any other JSON value
/// as its JSON text; `None` when absent. For a value that names something
/// (a user, a tenant, a bucket).
pub fn get_text(key: &str) -> Option<String> {
    let json = raw::get(key)?;
    Some(match serde_json::from_str::<serde_json::Value>(&json) {
        Ok(serde_json::Value::String(text)) => text,
        _ => json,
    })
}

/// Records under [`RATE_LIMIT`] what a limit of `what` (`requests`,
/// `tokens`, `budget`, ...) looked like to this request, beside what other
/// limits recorded: `shallot serve` answers `requests` and `tokens` as
/// `x-ratelimit-*` headers, and any limit left at 0 as `Retry-After` on a
/// refusal.
pub fn report_limit(what: &str, limit: u64, remaining: u64, reset_ms: u64) {
    let mut limits: serde_json::Map<String, serde_json::Value> =
        get(RATE_LIMIT).unwrap_or_default();
    let seen = serde_json::json!({ "limit": limit, "remaining": remaining, "reset_ms": reset_ms });
    limits.insert(what.to_owned(), seen);
    set(RATE_LIMIT, &limits);
}

/// Removes `key`.
pub fn remove(key: &str) {
    raw::remove(key)
}

/// All keys, sorted.
pub fn keys() -> Vec<String> {
    raw::keys()
}
