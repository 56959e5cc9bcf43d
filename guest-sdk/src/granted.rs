//! Host services the operator grants a filter in its `grants` (see the
//! book's configuration chapter, docs/book/configuration.md): without the grant each call returns an `auth` error
//! naming the grant to add.

/// Waiting, for a backoff between retries (granted by `grants.sleep_ms`).
pub mod timer {
    use crate::FilterError;
    use crate::bindings::shallot::filter::timer as wit;

    /// Sleeps `ms` milliseconds. The time is not the filter's own (its
    /// `wall_ms`), but one hook call may sleep at most the granted
    /// `sleep_ms` in all: past it this returns `limit-exceeded` at once.
    pub fn sleep(ms: u32) -> Result<(), FilterError> {
        wit::sleep(ms).map_err(|e| FilterError::new(e.kind, e.message))
    }
}

/// The host's approval handler: a person at the terminal or the
/// embedder's policy (granted by `grants.approval`).
pub mod approval {
    use crate::FilterError;
    use crate::bindings::shallot::filter::approval as wit;

    /// Asks whether `tool` may run with `arguments` (a JSON object as
    /// text), saying why in `reason`. `Ok(false)` when denied or when no
    /// handler is installed; a `timeout` error when it does not answer
    /// within `timeout_ms`.
    pub fn ask(
        tool: &str,
        arguments: &str,
        reason: &str,
        timeout_ms: u32,
    ) -> Result<bool, FilterError> {
        wit::ask(tool, arguments, reason, timeout_ms)
            .map_err(|e| FilterError::new(e.kind, e.message))
    }
}

/// The operator's trace sink (granted by `grants.trace`): JSON lines to a
/// file or stderr the operator chose.
pub mod trace {
    use crate::FilterError;
    use crate::bindings::shallot::filter::trace as wit;

    /// Writes `event`, a JSON object, as one line; the host adds `ts`
    /// (milliseconds since the Unix epoch) and `filter` (this filter's
    /// name).
    pub fn write(event: &serde_json::Value) -> Result<(), FilterError> {
        wit::write(&event.to_string()).map_err(|e| FilterError::new(e.kind, e.message))
    }
}

/// Conversation memory (granted by `grants.memory`): the store the
/// operator chose (an SQLite file, Redis, or in-process), by conversation id.
pub mod memory {
    use crate::bindings::shallot::filter::memory as wit;
    use crate::{FilterError, Message};

    fn own(e: crate::bindings::shallot::filter::types::FilterError) -> FilterError {
        FilterError::new(e.kind, e.message)
    }

    /// The conversation's messages, oldest first (the latest 10,000 at
    /// most); empty for one never written.
    pub fn load(conversation: &str) -> Result<Vec<Message>, FilterError> {
        wit::load(conversation).map_err(own)
    }

    /// Appends `messages` to the conversation.
    pub fn append(conversation: &str, messages: &[Message]) -> Result<(), FilterError> {
        wit::append(conversation, messages).map_err(own)
    }

    /// Forgets the conversation.
    pub fn clear(conversation: &str) -> Result<(), FilterError> {
        wit::clear(conversation).map_err(own)
    }
}

/// Shared state (granted by `grants.kv`): keys kept across invokes in the
/// store the operator chose (in-process, an SQLite file, or Redis shared
/// by several hosts), in this filter's namespace. A key is 1 to 512
/// bytes, a value at most 1 MiB; a `ttl_ms` of 0 keeps a key until it is
/// deleted.
pub mod kv {
    use crate::FilterError;
    use crate::bindings::shallot::filter::kv as wit;

    pub use wit::{Count, Entry, Period, Taken, Window, WindowSeen};

    fn own(e: crate::bindings::shallot::filter::types::FilterError) -> FilterError {
        FilterError::new(e.kind, e.message)
    }

    /// The key's value and version; `None` for a key never written,
    /// deleted or expired.
    pub fn get(key: &str) -> Result<Option<Entry>, FilterError> {
        wit::get(key).map_err(own)
    }

    /// Writes `value`; its new version.
    pub fn set(key: &str, value: &str, ttl_ms: u64) -> Result<u64, FilterError> {
        wit::set(key, value, ttl_ms).map_err(own)
    }

    /// Compare-and-set: writes `value` only if the key's version is still
    /// `version` (0: only if absent). The new version, or `None` when the
    /// key moved on and nothing was written.
    pub fn swap(
        key: &str,
        value: &str,
        version: u64,
        ttl_ms: u64,
    ) -> Result<Option<u64>, FilterError> {
        wit::swap(key, value, version, ttl_ms).map_err(own)
    }

    /// Adds `delta` to the counter at `key` atomically (absent: 0); a
    /// counter this creates lives `ttl_ms`, and a later add keeps that
    /// expiry. The count and its time left.
    pub fn add(key: &str, delta: i64, ttl_ms: u64) -> Result<Count, FilterError> {
        wit::add(key, delta, ttl_ms).map_err(own)
    }

    /// Forgets the key; whether it was there.
    pub fn delete(key: &str) -> Result<bool, FilterError> {
        wit::delete(key).map_err(own)
    }

    /// Counts in several windows at once, all or nothing, on the store's
    /// clock: each window's `amount` is added only if no window had
    /// counted its `limit` yet (`Taken::admitted`). At most 8 windows.
    ///
    /// ```ignore
    /// use shallot_guest::kv::{self, Period, Window};
    /// let window = |key: &str, period, limit| Window { key: key.into(), period, limit, amount: 1 };
    /// let taken = kv::take(&[
    ///     window("requests:rae:minute", Period::Sliding(60_000), 60),
    ///     window("requests:rae:day", Period::Aligned(86_400_000), 10_000),
    /// ])?;
    /// ```
    pub fn take(windows: &[Window]) -> Result<Taken, FilterError> {
        wit::take(windows).map_err(own)
    }

    /// Adds `delta` to the counter of the window a take saw end at
    /// `ends_ms` (settling what it held, or giving it back), only while
    /// that window's counter lives and never below 0: the counter after,
    /// or `None` when the window had ended.
    pub fn settle(
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, FilterError> {
        wit::settle(key, period, ends_ms, delta).map_err(own)
    }

    /// How a filter goes on when its store fails (a `kv` call's
    /// `transient` or `timeout`: down, slow, unreachable), as its
    /// operator says in its `on_store_error` option: `closed` fails the
    /// request (a limit that cannot be checked refuses), `open` goes on
    /// without the store (a cache that cannot be read is a miss).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum OnStoreError {
        /// Go on without the store, the failure logged.
        Open,
        /// Fail the request.
        Closed,
    }

    impl OnStoreError {
        /// `result`; or, open and the store failed, `None` (the failure
        /// logged as `what`'s). Other errors (a full store, a bad key)
        /// are errors either way.
        pub fn tolerate<T>(
            self,
            result: Result<T, FilterError>,
            what: &str,
        ) -> Result<Option<T>, FilterError> {
            match result {
                Ok(value) => Ok(Some(value)),
                Err(e) if self == OnStoreError::Open && failed(&e) => {
                    crate::log::warn(&format!(
                        "{what}: the store failed, so this request goes on without it: {}",
                        e.message
                    ));
                    Ok(None)
                }
                Err(e) => Err(e),
            }
        }
    }

    /// Whether `error` is the store failing, not refusing.
    fn failed(error: &FilterError) -> bool {
        use crate::ErrorKind;
        matches!(error.kind, ErrorKind::Transient | ErrorKind::Timeout)
    }

    /// What an admitted take added to one window, kept to settle it when
    /// the request ends: with what was used (an answer's tokens, its
    /// price), or nothing (a request that failed gives it back).
    #[derive(Debug, Clone)]
    pub struct Hold {
        /// The window's key and period, as taken.
        pub key: String,
        pub period: Period,
        /// The window's end, as the take saw it: its name to `settle`.
        pub ends_ms: u64,
        /// What the take added.
        pub amount: u64,
    }

    impl Hold {
        /// What `window`'s take, which saw it as `seen`, added.
        pub fn of(window: &Window, seen: &WindowSeen) -> Self {
            Hold {
                key: window.key.clone(),
                period: window.period,
                ends_ms: seen.ends_ms,
                amount: window.amount,
            }
        }

        /// Makes what was added `used`, in the window it was added to (a
        /// window that ended takes nothing, and no later window is
        /// charged): tried twice, and if the store cannot take it, logged
        /// as owed, as `what`'s, never failing the answer. The counter
        /// after, if the window still counts.
        pub fn settle(&self, used: u64, what: &str) -> Option<u64> {
            let delta = used as i64 - self.amount as i64;
            if delta == 0 {
                return None;
            }
            let settle = || settle(&self.key, self.period, self.ends_ms, delta);
            let mut tried = settle();
            if tried.as_ref().is_err_and(failed) {
                tried = settle();
            }
            tried.unwrap_or_else(|e| {
                crate::log::warn(&format!(
                    "{what}: owed: {delta} not added to {}, the answer delivered: {}",
                    self.key, e.message
                ));
                None
            })
        }
    }
}

/// Side calls to a model the operator names (granted by `grants.model`):
/// outside the onion, so no filter sees them and nothing of them reaches
/// the caller's stream.
pub mod model {
    use crate::bindings::shallot::filter::model as wit;
    use crate::{ChatRequest, ChatResponse, FilterError};

    /// The granted model's answer to `request`. One hook call may make the
    /// grant's `calls` and spend its `tokens` (past either,
    /// `limit-exceeded`); the request's `max_tokens` is capped to what is
    /// left.
    pub fn complete(request: &ChatRequest) -> Result<ChatResponse, FilterError> {
        wit::complete(request).map_err(|e| FilterError::new(e.kind, e.message))
    }
}

/// Counters and histograms of the filter's own, on the gateway's
/// `/metrics` as `shallot_gateway_plugin_<filter>__<name>` (no grant
/// needed). A metric is declared by its first use: its kind and label
/// names stay; at most 32 metrics, 4 labels and 64 series a metric (more
/// series count in the one labelled `other`), label values of 64 bytes.
pub mod metrics {
    use crate::FilterError;
    use crate::bindings::shallot::filter::metrics as wit;

    fn pairs(labels: &[(&str, &str)]) -> Vec<(String, String)> {
        labels
            .iter()
            .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
            .collect()
    }

    /// Adds `value` to the counter `name` in the series `labels`.
    pub fn count(name: &str, labels: &[(&str, &str)], value: u64) -> Result<(), FilterError> {
        wit::count(name, &pairs(labels), value).map_err(|e| FilterError::new(e.kind, e.message))
    }

    /// Records `value` in the histogram `name` (buckets 0.005 to 10).
    pub fn observe(name: &str, labels: &[(&str, &str)], value: f64) -> Result<(), FilterError> {
        wit::observe(name, &pairs(labels), value).map_err(|e| FilterError::new(e.kind, e.message))
    }
}
