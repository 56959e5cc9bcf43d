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

mod redis;
mod sqlite;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use crate::conversation::{OPERATION_TIMEOUT, StoreSpec};
use crate::types::{ChainError, ErrorKind};

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
/// What an expiring entry's place in the expiry index costs beside its
/// key: the instant, the key's header and the tree's spare room.
const INDEXED_BYTES: usize = 96;

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
}

/// Opens the key store `spec` names, or shares the one already open.
pub async fn open_kv(spec: impl Into<StoreSpec>) -> Result<Arc<dyn KvStore>, String> {
    static OPEN: Mutex<Option<HashMap<StoreSpec, Weak<dyn KvStore>>>> = Mutex::new(None);
    let spec = spec.into();
    let open = || OPEN.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(store) = open()
        .get_or_insert_default()
        .get(&spec)
        .and_then(Weak::upgrade)
    {
        return Ok(store);
    }
    let store: Arc<dyn KvStore> = match &spec {
        StoreSpec::InProcess(_) => Arc::new(InProcess::default()),
        StoreSpec::Redis(url) => Arc::new(redis::Redis::open(url).await?),
        StoreSpec::Sqlite(path) => Arc::new(sqlite::Sqlite::open(path).await?),
    };
    open()
        .get_or_insert_default()
        .insert(spec, Arc::downgrade(&store));
    Ok(store)
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
}

/// Keys kept in this process, each namespace under a lock of its own (a
/// flood in one holds up no other).
#[derive(Default)]
struct InProcess {
    namespaces: Mutex<HashMap<String, Arc<Mutex<Namespace>>>>,
    version: AtomicU64,
}

#[derive(Default)]
struct Namespace {
    entries: HashMap<String, Slot>,
    /// The keys that expire, by when: swept in that order, so a sweep
    /// costs what it removes, never a walk of the namespace.
    expiring: BTreeSet<(Instant, String)>,
    /// What it holds, as [`size`] charges it.
    bytes: usize,
    /// What each owner's keys hold of it.
    owners: HashMap<String, usize>,
}

struct Slot {
    value: String,
    version: u64,
    expires: Option<Instant>,
    /// Its last writer's owner, whose part it counts in.
    owner: Option<String>,
}

impl Slot {
    fn live(&self, now: Instant) -> bool {
        self.expires.is_none_or(|at| at > now)
    }

    fn size(&self, key: &str) -> usize {
        size(key, &self.value, self.expires, self.owner.as_deref())
    }
}

/// What an entry costs the host: its key, value and owner, and
/// [`ENTRY_BYTES`] for its slot in the map and their allocations; an entry
/// that expires has its key again in the expiry index.
fn size(key: &str, value: &str, expires: Option<Instant>, owner: Option<&str>) -> usize {
    let indexed = expires.map_or(0, |_| key.len() + INDEXED_BYTES);
    key.len() + value.len() + owner.map_or(0, str::len) + ENTRY_BYTES + indexed
}

/// Expired keys a write sweeps on its way, however much room it needs: a
/// namespace gives back what expired as it is used.
const SWEEP: usize = 64;

impl Namespace {
    fn live(&self, key: &str, now: Instant) -> Option<&Slot> {
        self.entries.get(key).filter(|slot| slot.live(now))
    }

    /// Writes `key` (keeping `expires`) for `owner`, within the
    /// namespace's cap and the owner's part of it: expired keys are swept
    /// before the write is refused.
    fn write(
        &mut self,
        key: &str,
        value: String,
        version: u64,
        expires: Option<Instant>,
        owner: Option<&str>,
    ) -> Result<(), ChainError> {
        let now = Instant::now();
        self.sweep(now, SWEEP);
        let new = size(key, &value, expires, owner);
        if let Err(full) = self.room(key, new, owner) {
            self.sweep(now, usize::MAX);
            self.room(key, new, owner).map_err(|_| full)?;
        }
        self.remove(key);
        if let Some(at) = expires {
            self.expiring.insert((at, key.to_owned()));
        }
        self.bytes += new;
        if let Some(owner) = owner {
            *self.owners.entry(owner.to_owned()).or_default() += new;
        }
        let slot = Slot {
            value,
            version,
            expires,
            owner: owner.map(str::to_owned),
        };
        self.entries.insert(key.to_owned(), slot);
        Ok(())
    }

    /// Whether `new` bytes written to `key` for `owner` fit the namespace
    /// and the owner's part of it, `key`'s old entry given back.
    fn room(&self, key: &str, new: usize, owner: Option<&str>) -> Result<(), ChainError> {
        let old = self.entries.get(key);
        let old_size = old.map_or(0, |slot| slot.size(key));
        if self.bytes - old_size + new > NAMESPACE_CAP {
            return Err(full("in-process", NAMESPACE_CAP));
        }
        if let Some(owner) = owner {
            let cap = owner_cap(NAMESPACE_CAP);
            let held = self.owners.get(owner).copied().unwrap_or(0);
            let mine = old.filter(|slot| slot.owner.as_deref() == Some(owner));
            if held - mine.map_or(0, |slot| slot.size(key)) + new > cap {
                return Err(owner_full("in-process", cap));
            }
        }
        Ok(())
    }

    /// Removes up to `most` keys that expired by `now`, soonest first.
    fn sweep(&mut self, now: Instant, most: usize) {
        for _ in 0..most {
            let Some((at, key)) = self.expiring.first().cloned() else {
                return;
            };
            if at > now {
                return;
            }
            self.remove(&key);
        }
    }

    fn remove(&mut self, key: &str) -> Option<Slot> {
        let slot = self.entries.remove(key)?;
        if let Some(at) = slot.expires {
            self.expiring.remove(&(at, key.to_owned()));
        }
        let size = slot.size(key);
        self.bytes -= size;
        if let Some(owner) = &slot.owner
            && let Some(held) = self.owners.get_mut(owner)
        {
            *held -= size;
            if *held == 0 {
                self.owners.remove(owner);
            }
        }
        // A map keeps its room when emptied: what a flood grew, it gives
        // back once the keys are gone.
        if self.entries.capacity() > 4 * self.entries.len().max(64) {
            self.entries.shrink_to_fit();
        }
        Some(slot)
    }
}

impl InProcess {
    /// Runs `work` on the namespace, under its own lock, with the store's
    /// next version.
    fn with<T>(
        &self,
        namespace: &str,
        work: impl FnOnce(&mut Namespace, &dyn Fn() -> u64) -> Result<T, ChainError>,
    ) -> Result<T, ChainError> {
        let space = {
            let mut namespaces = self
                .namespaces
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            namespaces.entry(namespace.to_owned()).or_default().clone()
        };
        let mut space = space.lock().unwrap_or_else(PoisonError::into_inner);
        work(&mut space, &|| {
            self.version.fetch_add(1, Ordering::Relaxed) + 1
        })
    }
}

#[async_trait]
impl KvStore for InProcess {
    async fn get(&self, namespace: &str, key: &str) -> Result<Option<Entry>, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, _| {
            Ok(space.live(key, now).map(|slot| Entry {
                value: slot.value.clone(),
                version: slot.version,
            }))
        })
    }

    async fn set(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        ttl: Option<Duration>,
    ) -> Result<u64, ChainError> {
        let expires = ttl.map(|ttl| Instant::now() + ttl);
        self.with(namespace, |space, next| {
            let version = next();
            space.write(key, value.to_owned(), version, expires, owner)?;
            Ok(version)
        })
    }

    async fn swap(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        value: &str,
        expected: u64,
        ttl: Option<Duration>,
    ) -> Result<Option<u64>, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, next| {
            let current = space.live(key, now).map_or(0, |slot| slot.version);
            if current != expected {
                return Ok(None);
            }
            let version = next();
            let expires = ttl.map(|ttl| now + ttl);
            space.write(key, value.to_owned(), version, expires, owner)?;
            Ok(Some(version))
        })
    }

    async fn add(
        &self,
        namespace: &str,
        owner: Option<&str>,
        key: &str,
        delta: i64,
        ttl: Option<Duration>,
    ) -> Result<Count, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, next| {
            // A counter stays in its creator's part.
            let (current, expires, owner) = match space.live(key, now) {
                Some(slot) => (counter(&slot.value)?, slot.expires, slot.owner.clone()),
                None => (0, ttl.map(|ttl| now + ttl), owner.map(str::to_owned)),
            };
            let value = sum(current, delta)?;
            let version = next();
            space.write(key, value.to_string(), version, expires, owner.as_deref())?;
            let ttl = expires.map(|at| at.saturating_duration_since(now));
            Ok(Count { value, ttl })
        })
    }

    async fn delete(&self, namespace: &str, key: &str) -> Result<bool, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, _| {
            Ok(space.remove(key).is_some_and(|slot| slot.live(now)))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{InProcess, KvStore, NAMESPACE_CAP, stored_key};
    use crate::types::ErrorKind;

    #[test]
    fn no_namespace_spells_another_ones_key() {
        assert_ne!(stored_key("a:b", "c"), stored_key("a", "b:c"));
        assert_ne!(stored_key("1:a", "b"), stored_key("1", "a:b"));
    }

    #[tokio::test]
    async fn versions_move_on_with_every_write_and_a_stale_swap_writes_nothing() {
        let store = InProcess::default();
        let first = store.set("n", None, "k", "one", None).await.unwrap();
        store.delete("n", "k").await.unwrap();
        let second = store.set("n", None, "k", "two", None).await.unwrap();
        assert!(second > first, "written again, a key has a new version");
        assert_eq!(
            store
                .swap("n", None, "k", "three", first, None)
                .await
                .unwrap(),
            None
        );
        assert_eq!(store.get("n", "k").await.unwrap().unwrap().value, "two");
        assert!(
            store
                .swap("n", None, "k", "three", second, None)
                .await
                .unwrap()
                .is_some()
        );
        assert!(
            store
                .swap("n", None, "new", "x", 0, None)
                .await
                .unwrap()
                .is_some()
        );
        assert_eq!(
            store.swap("n", None, "new", "y", 0, None).await.unwrap(),
            None
        );
    }

    #[tokio::test]
    async fn a_counter_keeps_the_expiry_it_was_created_with_and_refuses_overflow() {
        let store = InProcess::default();
        let ttl = Some(Duration::from_secs(60));
        let first = store.add("n", None, "c", 1, ttl).await.unwrap();
        let second = store
            .add("n", None, "c", 1, Some(Duration::from_secs(3600)))
            .await
            .unwrap();
        assert_eq!(second.value, 2);
        assert!(second.ttl.unwrap() <= first.ttl.unwrap());
        store
            .set("n", None, "big", &i64::MAX.to_string(), None)
            .await
            .unwrap();
        let over = store.add("n", None, "big", 1, None).await.unwrap_err();
        assert_eq!(over.kind, ErrorKind::InvalidRequest);
        store.set("n", None, "text", "ten", None).await.unwrap();
        assert_eq!(
            store
                .add("n", None, "text", 1, None)
                .await
                .unwrap_err()
                .kind,
            ErrorKind::InvalidRequest
        );
        assert_eq!(store.get("n", "text").await.unwrap().unwrap().value, "ten");
    }

    #[tokio::test]
    async fn a_namespace_is_capped_and_expired_keys_make_room() {
        let store = InProcess::default();
        let value = "v".repeat(1 << 20);
        // Written already expired: they hold room until a write needs it.
        for n in 0..15 {
            let expired = Some(Duration::ZERO);
            store
                .set("n", None, &format!("k{n}"), &value, expired)
                .await
                .unwrap();
        }
        store.set("other", None, "k", &value, None).await.unwrap();
        for n in 0..15 {
            store
                .set("n", None, &format!("l{n}"), &value, None)
                .await
                .unwrap();
        }
        let full = store
            .set("n", None, "one-more", &value, None)
            .await
            .unwrap_err();
        assert_eq!(full.kind, ErrorKind::LimitExceeded, "{full}");
        assert!(full.to_string().contains(&NAMESPACE_CAP.to_string()));
        assert!(
            store.set("other", None, "k2", &value, None).await.is_ok(),
            "another namespace has its own room"
        );
    }
}
