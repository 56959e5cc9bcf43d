//! The `kv` import: a filter's keys in the store its `grants.kv` names,
//! in its namespace. Bounded per call: key and value sizes, operations,
//! bytes written (as the filter's host memory cap), time to live, and the
//! time waited for the store (with the conversation store's).

use std::time::Duration;

use super::HostState;
use super::granted::{GrantedKv, Service, error, not_granted};
use crate::plugin::bindings::shallot::filter::kv;
use crate::plugin::bindings::shallot::filter::types as wit;

/// The longest key, in bytes.
const KEY_CAP: usize = 512;
/// The largest value, in bytes.
const VALUE_CAP: usize = 1 << 20;
/// Key-store operations one call may make.
const OPS_PER_CALL: u32 = 256;
/// The longest time to live: a year.
const TTL_CAP_MS: u64 = 366 * 24 * 60 * 60 * 1000;

type Answer<T> = wasmtime::Result<Result<T, wit::FilterError>>;

impl HostState {
    /// The store and namespace, if granted, for one more operation of this
    /// call on `key`, writing `written` bytes that live `ttl_ms`.
    fn keys(
        &mut self,
        key: &str,
        written: usize,
        ttl_ms: u64,
    ) -> Result<(GrantedKv, String), wit::FilterError> {
        let Some(granted) = self.services.kv.clone() else {
            return Err(not_granted("kv", "kv = \":memory:\""));
        };
        if let Some(refused) = self.out_of_place(Service::Kv) {
            return Err(refused);
        }
        let invalid = |message: String| Err(error(wit::ErrorKind::InvalidRequest, message));
        if key.is_empty() || key.len() > KEY_CAP {
            return invalid(format!("a key must be 1 to {KEY_CAP} bytes"));
        }
        if ttl_ms > TTL_CAP_MS {
            return invalid(format!(
                "a time to live is at most {TTL_CAP_MS} ms (a year)"
            ));
        }
        let over = |message: String| Err(error(wit::ErrorKind::LimitExceeded, message));
        if written > VALUE_CAP {
            return over(format!(
                "a value of {written} bytes is over the cap of {VALUE_CAP}"
            ));
        }
        self.quotas.kv_ops += 1;
        if self.quotas.kv_ops > OPS_PER_CALL {
            return over(format!(
                "more than {OPS_PER_CALL} key-store operations in one call"
            ));
        }
        // What one call writes is bounded as what it makes the host hold.
        let written = written + key.len();
        self.quotas.stored_bytes = self.quotas.stored_bytes.saturating_add(written);
        if self.quotas.stored_bytes > self.limits.host_bytes() {
            return over(format!(
                "writing {} bytes to its stores in one call, more than the filter's host memory cap",
                self.quotas.stored_bytes
            ));
        }
        let namespace =
            (granted.namespace.clone()).unwrap_or_else(|| self.identity.name.to_string());
        Ok((granted, namespace))
    }
}

fn ttl(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl kv::Host for HostState {
    async fn get(&mut self, key: String) -> Answer<Option<kv::Entry>> {
        let (granted, namespace) = match self.keys(&key, 0, 0) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        let found = self.on_store(granted.store.get(&namespace, &key)).await;
        Ok(found.map(|entry| {
            entry.map(|entry| kv::Entry {
                value: entry.value,
                version: entry.version,
            })
        }))
    }

    async fn set(&mut self, key: String, value: String, ttl_ms: u64) -> Answer<u64> {
        let (granted, namespace) = match self.keys(&key, value.len(), ttl_ms) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        let set = granted.store.set(&namespace, &key, &value, ttl(ttl_ms));
        Ok(self.on_store(set).await)
    }

    async fn swap(
        &mut self,
        key: String,
        value: String,
        version: u64,
        ttl_ms: u64,
    ) -> Answer<Option<u64>> {
        let (granted, namespace) = match self.keys(&key, value.len(), ttl_ms) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        let swap = granted
            .store
            .swap(&namespace, &key, &value, version, ttl(ttl_ms));
        Ok(self.on_store(swap).await)
    }

    async fn add(&mut self, key: String, delta: i64, ttl_ms: u64) -> Answer<kv::Count> {
        let (granted, namespace) = match self.keys(&key, 20, ttl_ms) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        let added = self.on_store(granted.store.add(&namespace, &key, delta, ttl(ttl_ms)));
        Ok(added.await.map(|count| kv::Count {
            value: count.value,
            ttl_ms: count.ttl.map_or(0, |left| (left.as_millis() as u64).max(1)),
        }))
    }

    async fn delete(&mut self, key: String) -> Answer<bool> {
        let (granted, namespace) = match self.keys(&key, 0, 0) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        Ok(self.on_store(granted.store.delete(&namespace, &key)).await)
    }
}
