//! The `kv` import: a filter's keys in the store its `grants.kv` names,
//! in its namespace. Bounded per call: key and value sizes, operations,
//! bytes written (as the filter's host memory cap), time to live, and the
//! time waited for the store (with the conversation store's).

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::HostState;
use super::service::{GrantedServices, PROMPTED, Service, Spent, error};
use crate::kv::{KvStore, Period, Window, open_kv};
use crate::plugin::bindings::shallot::filter::kv;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::store::StoreSpec;
use crate::types::Call;

/// The longest key, in bytes.
const KEY_CAP: usize = 512;
/// The largest value, in bytes.
const VALUE_CAP: usize = 1 << 20;
/// Key-store operations one call may make.
const OPS_PER_CALL: u32 = 256;
/// The longest time to live: a year.
const TTL_CAP_MS: u64 = 366 * 24 * 60 * 60 * 1000;
/// The most windows one take counts in.
const WINDOWS_CAP: usize = 8;
/// The largest amount a take adds: what a double (Redis's scripts) holds
/// exactly.
const AMOUNT_CAP: u64 = 1 << 53;

type Answer<T> = wasmtime::Result<Result<T, wit::FilterError>>;

/// The `kv` grant: a store (as for `memory`), and the namespace of the
/// filter's keys: its own name unless the operator names one, so that the
/// filters naming the same one share keys. Written `kv = "<store>"` or
/// `kv = { store = "<store>", namespace = "<name>" }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "KvForm")]
pub struct KvGrant {
    /// Where the keys are kept.
    pub store: StoreSpec,
    /// The namespace; `None`: the filter's name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl From<StoreSpec> for KvGrant {
    fn from(store: StoreSpec) -> Self {
        KvGrant {
            store,
            namespace: None,
        }
    }
}

/// The two ways an operator writes a `kv` grant.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "a store (a SQLite file's path, a redis:// URL or \":memory:\") or a table { store = \"...\", namespace = \"...\" }"
)]
enum KvForm {
    Store(StoreSpec),
    Table(KvTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct KvTable {
    store: StoreSpec,
    namespace: Option<String>,
}

impl From<KvForm> for KvGrant {
    fn from(form: KvForm) -> Self {
        match form {
            KvForm::Store(store) => store.into(),
            KvForm::Table(KvTable { store, namespace }) => KvGrant { store, namespace },
        }
    }
}

/// The `kv` service: who names its namespace is the operator (or the
/// filter's name, which the operator or its file gives), never the filter.
pub(crate) struct Kv;

/// The key store a filter is granted, and its namespace (`None`: the
/// filter's name).
#[derive(Clone)]
pub(crate) struct GrantedKv {
    pub store: Arc<dyn KvStore>,
    pub namespace: Option<String>,
}

impl Service for Kv {
    const IMPORT: &'static str = "kv";
    const CALLED: &'static str = "kv";
    const CALLS: &'static [Call] = PROMPTED;
    const GRANT: &'static str = "kv = \":memory:\"";
    type Granted = GrantedKv;
    /// Operations made.
    type Spent = u32;

    fn granted(services: &GrantedServices) -> Option<&GrantedKv> {
        services.kv.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut u32 {
        &mut spent.kv
    }
}

/// What `grants.kv` opens: its store, and its namespace.
pub(super) async fn open(grant: Option<&KvGrant>) -> Result<Option<GrantedKv>, String> {
    let Some(grant) = grant else {
        return Ok(None);
    };
    if grant.namespace.as_ref().is_some_and(String::is_empty) {
        return Err("grants.kv: the namespace must not be empty".into());
    }
    Ok(Some(GrantedKv {
        store: open_kv(grant.store.clone()).await?,
        namespace: grant.namespace.clone(),
    }))
}

impl HostState {
    /// The store and namespace, if granted, for one more operation of this
    /// call on `key`, writing `written` bytes that live `ttl_ms`.
    fn keys(
        &mut self,
        key: &str,
        written: usize,
        ttl_ms: u64,
    ) -> Result<(GrantedKv, String), wit::FilterError> {
        let granted = self.admit::<Kv>()?;
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
        let ops = self.spent::<Kv>();
        *ops += 1;
        if *ops > OPS_PER_CALL {
            return over(format!(
                "more than {OPS_PER_CALL} key-store operations in one call"
            ));
        }
        // What one call writes is bounded as what it makes the host hold.
        self.write_to_stores(written + key.len())?;
        let namespace =
            (granted.namespace.clone()).unwrap_or_else(|| self.identity.name.to_string());
        Ok((granted, namespace))
    }
}

/// `period` as the store takes it, or why it cannot be.
fn period(period: kv::Period) -> Result<Period, wit::FilterError> {
    let period = match period {
        kv::Period::Fixed(width) => Period::Fixed(width),
        kv::Period::Sliding(width) => Period::Sliding(width),
        kv::Period::Aligned(width) => Period::Aligned(width),
        kv::Period::Month => return Ok(Period::Month),
    };
    let (Period::Fixed(width) | Period::Sliding(width) | Period::Aligned(width)) = period else {
        unreachable!("a month has no width")
    };
    if width == 0 || width > TTL_CAP_MS {
        return Err(error(
            wit::ErrorKind::InvalidRequest,
            format!("a window is 1 to {TTL_CAP_MS} ms (a year) wide"),
        ));
    }
    Ok(period)
}

/// `windows` as the store takes them, each one operation of the call.
fn windows(
    state: &mut HostState,
    windows: Vec<kv::Window>,
) -> Result<(GrantedKv, String, Vec<Window>), wit::FilterError> {
    if windows.is_empty() || windows.len() > WINDOWS_CAP {
        return Err(error(
            wit::ErrorKind::InvalidRequest,
            format!("a take counts in 1 to {WINDOWS_CAP} windows"),
        ));
    }
    let mut taken = Vec::with_capacity(windows.len());
    let mut granted = None;
    for window in windows {
        let period = period(window.period)?;
        if window.amount > AMOUNT_CAP {
            return Err(error(
                wit::ErrorKind::InvalidRequest,
                format!("a take adds at most {AMOUNT_CAP} (2^53) to a window"),
            ));
        }
        granted = Some(state.keys(&window.key, 20, 0)?);
        taken.push(Window {
            key: window.key,
            period,
            limit: window.limit,
            amount: window.amount,
        });
    }
    let (granted, namespace) = granted.expect("at least one window");
    Ok((granted, namespace, taken))
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
        let owner = self.owner();
        let set = granted
            .store
            .set(&namespace, owner.as_deref(), &key, &value, ttl(ttl_ms));
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
        let owner = self.owner();
        let swap = granted.store.swap(
            &namespace,
            owner.as_deref(),
            &key,
            &value,
            version,
            ttl(ttl_ms),
        );
        Ok(self.on_store(swap).await)
    }

    async fn add(&mut self, key: String, delta: i64, ttl_ms: u64) -> Answer<kv::Count> {
        let (granted, namespace) = match self.keys(&key, 20, ttl_ms) {
            Ok(keys) => keys,
            Err(e) => return Ok(Err(e)),
        };
        let owner = self.owner();
        let add = granted
            .store
            .add(&namespace, owner.as_deref(), &key, delta, ttl(ttl_ms));
        let added = self.on_store(add);
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

    async fn take(&mut self, windows: Vec<kv::Window>) -> Answer<kv::Taken> {
        let (granted, namespace, windows) = match self::windows(self, windows) {
            Ok(taken) => taken,
            Err(e) => return Ok(Err(e)),
        };
        let owner = self.owner();
        let take = granted.store.take(&namespace, owner.as_deref(), &windows);
        Ok(self.on_store(take).await.map(|taken| kv::Taken {
            admitted: taken.admitted,
            windows: (taken.windows.into_iter())
                .map(|seen| kv::WindowSeen {
                    used: seen.used,
                    reset_ms: seen.reset_ms,
                    ends_ms: seen.ends_ms,
                })
                .collect(),
        }))
    }

    async fn settle(
        &mut self,
        key: String,
        period: kv::Period,
        ends_ms: u64,
        delta: i64,
    ) -> Answer<Option<u64>> {
        let checked = self::period(period).and_then(|period| Ok((period, self.keys(&key, 20, 0)?)));
        let (period, (granted, namespace)) = match checked {
            Ok(checked) => checked,
            Err(e) => return Ok(Err(e)),
        };
        let settle = granted
            .store
            .settle(&namespace, &key, period, ends_ms, delta);
        Ok(self.on_store(settle).await)
    }
}
