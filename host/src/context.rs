//! The shared context of an invoke: one key-value map per invoke, readable
//! and writable by every filter and by the terminals (conversation id,
//! tenant, user id, ...). Distinct from each filter's private FCtx.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde_json::Value;

/// A handle to an invoke's shared context. Clones share the same map, so
/// the caller keeps a clone to read what filters wrote.
#[derive(Debug, Clone, Default)]
pub struct Context {
    values: Arc<Mutex<BTreeMap<String, Value>>>,
}

impl Context {
    /// An empty context.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets `key` and returns the context, for building one inline.
    pub fn with(self, key: &str, value: impl Into<Value>) -> Self {
        self.set(key, value);
        self
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Value>> {
        // A panicking writer cannot leave a map half-updated.
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The value under `key`.
    pub fn get(&self, key: &str) -> Option<Value> {
        self.lock().get(key).cloned()
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: impl Into<Value>) {
        self.lock().insert(key.to_owned(), value.into());
    }

    /// Removes `key`.
    pub fn remove(&self, key: &str) {
        self.lock().remove(key);
    }

    /// All keys, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// A copy of every entry.
    pub fn snapshot(&self) -> BTreeMap<String, Value> {
        self.lock().clone()
    }

    /// Sets `key` and returns the value it had.
    pub(crate) fn replace(&self, key: &str, value: Value) -> Option<Value> {
        self.lock().insert(key.to_owned(), value)
    }

    /// Removes `key` and returns its value.
    pub(crate) fn take(&self, key: &str) -> Option<Value> {
        self.lock().remove(key)
    }

    /// The value under `key` as JSON text.
    pub(crate) fn get_json(&self, key: &str) -> Option<String> {
        self.lock().get(key).map(Value::to_string)
    }
}
