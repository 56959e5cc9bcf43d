//! Shared state: where the `kv` import keeps a filter's keys across
//! invokes, as the operator chose in its `grants.kv` (the same forms as
//! `grants.memory`: a SQLite file's path, a `redis://` URL shared by
//! several hosts, or `:memory:` in this process).
//!
//! Every key lives in a namespace (the filter's name, or the one the
//! operator gives filters that share keys), and no operation can name a
//! key of another: the namespace is part of the stored key, length first,
//! so no key of one reads as a key of another. Every write gives the key a
//! new version from one counter of the store, so a compare-and-set on a
//! version never mistakes a key deleted and written again for the one it
//! read. `add` is atomic in every store (a Redis script, an SQLite
//! transaction, a lock), so several hosts count one counter.
//!
//! What a store keeps is bounded for each namespace, so that filters
//! sharing a store share none of its room: the in-process one holds at
//! most [`NAMESPACE_CAP`] bytes for each (it is the host's own memory,
//! charged as it holds it), an SQLite file or a Redis server
//! [`STORED_NAMESPACE_CAP`]; expired keys are swept before a write is
//! refused. An SQLite file holds at most [`STORE_CAP`] in all, and a
//! Redis server is bounded by its own `maxmemory` too. Past a bound a
//! write is `limit-exceeded`; a store that does not answer within
//! [`OPERATION_TIMEOUT`] is `transient`.

mod in_process;
mod redis;
mod sqlite;
mod windows;

pub use windows::{Period, Seen, Taken, Window};

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::store::{OPERATION_TIMEOUT, Registry, StoreSpec};
use crate::types::{Cause, ChainError, ErrorKind};

/// The most the in-process store holds for one namespace, in bytes (keys,
/// values and [`ENTRY_BYTES`] each).
pub const NAMESPACE_CAP: usize = 16 << 20;
/// The most an SQLite file of keys holds, in bytes.
pub const STORE_CAP: usize = 1 << 30;
/// The most one namespace holds in an SQLite file or a Redis server, in
/// bytes (keys, values and [`ENTRY_BYTES`] each): filters that share a
/// store share none of its room.
pub const STORED_NAMESPACE_CAP: usize = 64 << 20;
/// The most one owner's keys hold in a namespace: an eighth of it (2 MiB
/// in the process, room for a largest value and its key; 8 MiB in an
/// SQLite file or a Redis server).
pub const fn owner_cap(namespace_cap: usize) -> usize {
    namespace_cap / 8
}

/// The error for a write past an owner's part of a namespace.
fn owner_full(kind: &str, cap: usize) -> ChainError {
    ChainError::new(
        ErrorKind::LimitExceeded,
        format!(
            "the key store ({kind}) is full for this owner: its keys in this namespace hold at most {cap} bytes"
        ),
    )
}
/// What an entry costs the host beside its key and value: its slot in the
/// map (the key's and value's headers, the version and expiry, the
/// control byte) with the spare room a map keeps (up to about twice its
/// entries), and the allocator's overhead of the two texts.
const ENTRY_BYTES: usize = 256;

/// A key's value and the version of its last write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The value written.
    pub value: String,
    /// The version of that write: never the same twice for a key.
    pub version: u64,
}

/// A counter after an add: its value, and its time left to live (`None`:
/// it lives until deleted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Count {
    /// The counter after the add.
    pub value: i64,
    /// Its time left to live; `None`: until deleted.
    pub ttl: Option<Duration>,
}

/// Where shared state is kept. Every operation names its namespace and
/// key; `ttl` `None` keeps a key until deleted. A write says whom it is
/// for, its `owner` (an invoke's tenant, else its client key; `None`: no
/// one's): a key counts in its last writer's part of the namespace, which
/// holds at most an eighth of it, so that no tenant of a shared namespace
/// (a rate limiter's counters) fills it for the others.
#[async_trait]
pub trait KvStore: Send + Sync + 'static {
    /// The live value of the key, if any.
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Entry>, ChainError>;
    /// Writes the key; its new version.
    async fn set(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        ttl: Option<Duration>,
    ) -> Result<u64, ChainError>;
    /// Writes the key only if its version is `version` (0: absent); the
    /// new version, or `None` with nothing written.
    async fn swap(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        version: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, ChainError>;
    /// Adds `delta` to the counter (absent: 0), giving it `ttl` if this
    /// creates it (and counting it in its creator's part); `invalid-request`
    /// for a key that holds no integer or a sum out of range, with nothing
    /// changed.
    async fn add(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        delta: i64,
        ttl: Option<Duration>,
    ) -> Result<Count, ChainError>;
    /// Forgets the key; whether it was live.
    async fn delete(&self, namespace: &str, key: &str) -> Result<bool, ChainError>;
    /// Counts in `windows`, all or nothing, on the store's clock: each
    /// window's amount is added only if none has counted its limit.
    /// Counters it creates count in `owner`'s part.
    async fn take(
        &self,
        namespace: &str,
        owner: Option<&str>,
        windows: &[Window],
    ) -> Result<Taken, ChainError>;
    /// Adds `delta` to the counter of `key`'s window of `period` that ends
    /// at `ends_ms`, while it lives, never below 0; the counter after, or
    /// `None` when that window's counter is gone.
    async fn settle(
        &self,
        namespace: &str,
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, ChainError>;
}

/// Opens the key store `spec` names, or shares the one already open.
pub async fn open_kv(spec: impl Into<StoreSpec>) -> Result<Arc<dyn KvStore>, String> {
    static OPEN: Registry<dyn KvStore> = Registry::new();
    OPEN.open(spec.into(), async |spec| {
        Ok(match spec {
            StoreSpec::InProcess(_) => {
                Arc::new(in_process::InProcess::default()) as Arc<dyn KvStore>
            }
            StoreSpec::Redis(url) => Arc::new(redis::Redis::open(url).await?),
            StoreSpec::Sqlite(path) => Arc::new(sqlite::Sqlite::open(path).await?),
        })
    })
    .await
}

/// The key a shared store keeps for `key` of `namespace`: the namespace's
/// length first, so that no namespace's keys can spell another's.
fn stored_key(namespace: &str, key: &str) -> String {
    format!("{}:{namespace}:{key}", namespace.len())
}

/// `value` read as a counter.
fn counter(value: &str) -> Result<i64, ChainError> {
    value.parse().map_err(|_| {
        ChainError::new(
            ErrorKind::InvalidRequest,
            "the key holds a value that is not a decimal integer, so it cannot be added to",
        )
    })
}

/// `current + delta`, or the error for a sum out of range.
fn sum(current: i64, delta: i64) -> Result<i64, ChainError> {
    current.checked_add(delta).ok_or_else(|| {
        ChainError::new(
            ErrorKind::InvalidRequest,
            format!("adding {delta} to {current} would go past the 64-bit range"),
        )
    })
}

/// The error for a write past a store's bound.
fn full(kind: &str, cap: usize) -> ChainError {
    ChainError::new(
        ErrorKind::LimitExceeded,
        format!("the key store ({kind}) is full: it holds at most {cap} bytes"),
    )
}

/// A store's failure to answer, as a call sees it: the kind of store, not
/// where it is (that goes to the log).
fn unavailable(kind: &str, shown: &str, error: impl std::fmt::Display) -> ChainError {
    tracing::warn!("the key store {shown} failed: {error}");
    ChainError::new(
        ErrorKind::Transient,
        format!("the key store ({kind}) failed: {error}"),
    )
    .because(Cause::StoreUnavailable)
}

#[cfg(test)]
mod tests {
    use super::stored_key;

    #[test]
    fn no_namespace_spells_another_ones_key() {
        assert_ne!(stored_key("a:b", "c"), stored_key("a", "b:c"));
        assert_ne!(stored_key("1:a", "b"), stored_key("1", "a:b"));
    }
}
