//! The in-process key store: each namespace a map under a lock of its
//! own, its expiring keys indexed by when, and what it holds charged as
//! the host's own memory.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;

use super::windows::{self, Counters, Period, Taken, Window};
use super::{
    Count, ENTRY_BYTES, Entry, KvStore, NAMESPACE_CAP, counter, full, owner_cap, owner_full, sum,
};
use crate::types::ChainError;

/// The store's clock: an instant and the Unix time it was, so that
/// windows are named in milliseconds since the epoch while expiry stays
/// on the monotonic clock.
static ORIGIN: LazyLock<(Instant, u64)> = LazyLock::new(|| {
    let unix = SystemTime::now().duration_since(UNIX_EPOCH);
    (Instant::now(), unix.map_or(0, |d| d.as_millis() as u64))
});

/// `at` in milliseconds since the Unix epoch.
fn unix_ms(at: Instant) -> u64 {
    let (origin, unix) = *ORIGIN;
    unix + at.saturating_duration_since(origin).as_millis() as u64
}

/// The instant that is `ms` since the Unix epoch.
fn instant(ms: u64) -> Instant {
    let (origin, unix) = *ORIGIN;
    origin + Duration::from_millis(ms.saturating_sub(unix))
}

/// What an expiring entry's place in the expiry index costs beside its
/// key: the instant, the key's header and the tree's spare room.
const INDEXED_BYTES: usize = 96;

/// Keys kept in this process, each namespace under a lock of its own (a
/// flood in one holds up no other).
#[derive(Default)]
pub(super) struct InProcess {
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

/// A namespace's counters under its lock, for a take by `owner`.
struct Locked<'a> {
    space: &'a mut Namespace,
    next: &'a dyn Fn() -> u64,
    owner: Option<&'a str>,
    now: Instant,
}

impl Counters for Locked<'_> {
    type Error = ChainError;

    fn read(&mut self, key: &str) -> Result<Option<(String, Option<u64>)>, ChainError> {
        let slot = self.space.live(key, self.now);
        Ok(slot.map(|slot| (slot.value.clone(), slot.expires.map(unix_ms))))
    }

    fn write(&mut self, key: &str, value: i64, expires: Option<u64>) -> Result<(), ChainError> {
        let (expires, owner) = match self.space.live(key, self.now) {
            Some(slot) => (slot.expires, slot.owner.clone()),
            None => (expires.map(instant), self.owner.map(str::to_owned)),
        };
        let version = (self.next)();
        self.space
            .write(key, value.to_string(), version, expires, owner.as_deref())
    }

    fn room(&mut self, keys: &[&str]) -> Result<(), ChainError> {
        let widest = i64::MIN.to_string();
        let new = keys
            .iter()
            .map(|key| size(key, &widest, Some(self.now), self.owner))
            .sum();
        self.space.sweep(self.now, SWEEP);
        // No key is empty: this asks for room beside every key.
        if let Err(full) = self.space.room("", new, self.owner) {
            self.space.sweep(self.now, usize::MAX);
            self.space.room("", new, self.owner).map_err(|_| full)?;
        }
        Ok(())
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

    async fn take(
        &self,
        namespace: &str,
        owner: Option<&str>,
        windows: &[Window],
    ) -> Result<Taken, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, next| {
            let mut locked = Locked {
                space,
                next,
                owner,
                now,
            };
            windows::take(&mut locked, unix_ms(now), windows)
        })
    }

    async fn settle(
        &self,
        namespace: &str,
        key: &str,
        period: Period,
        ends_ms: u64,
        delta: i64,
    ) -> Result<Option<u64>, ChainError> {
        let now = Instant::now();
        self.with(namespace, |space, next| {
            let mut locked = Locked {
                space,
                next,
                owner: None,
                now,
            };
            windows::settle(&mut locked, key, period, ends_ms, delta)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::InProcess;
    use crate::kv::{KvStore, NAMESPACE_CAP};
    use crate::types::ErrorKind;

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
