//! The shared context of the current invoke: one per invoke, seen by every
//! filter and by the terminal. Values are JSON; these helpers (de)serialize.

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::shallot::filter::context as raw;

/// The key a limiting filter (`rate-limit`, `budget`) leaves what it saw
/// under: `{"requests": {"limit", "remaining", "reset_ms"}, "tokens": {...}}`.
/// `shallot serve` answers it as OpenAI's `x-ratelimit-*` headers, and a
/// `limit-exceeded` refusal with `Retry-After`.
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

/// Removes `key`.
pub fn remove(key: &str) {
    raw::remove(key)
}

/// All keys, sorted.
pub fn keys() -> Vec<String> {
    raw::keys()
}
