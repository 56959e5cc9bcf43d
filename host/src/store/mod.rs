//! What every store shares, whatever it keeps (the `memory` import's
//! conversations, the `kv` import's keys, a gateway's kept responses):
//! how a grant names one ([`StoreSpec`]), the bound on each operation,
//! one open store per name ([`Registry`]), the connection to a Redis
//! server and its record of how it answers ([`connect_redis`],
//! [`store_states`]), and an SQLite file on the blocking pool
//! ([`SqliteFile`]).

mod health;
mod redis;
mod sqlite;

pub use health::{StoreState, store_states};
pub(crate) use redis::{Connected, connect as connect_redis};
pub(crate) use sqlite::SqliteFile;

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// How long one store operation may take before it is a `transient` error.
pub(crate) const OPERATION_TIMEOUT: Duration = Duration::from_secs(2);

/// Which store a grant names (a filter's `grants.memory` or `grants.kv`, a
/// route's `store`), parsed once from the operator's text: `:memory:` (or
/// `:memory:<name>`), a `redis://`, `rediss://` or `redis+...://` URL
/// (`redis+unix:///path`; Sentinel's `redis+sentinel://` is refused when
/// it is opened), else a SQLite file's path.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum StoreSpec {
    /// A store in this process, by name (`""` for `:memory:` itself).
    InProcess(String),
    /// A Redis server's URL.
    Redis(String),
    /// An SQLite file, created when the filter loads.
    Sqlite(PathBuf),
}

impl From<&str> for StoreSpec {
    fn from(spec: &str) -> Self {
        if let Some(name) = spec.strip_prefix(":memory:") {
            StoreSpec::InProcess(name.to_owned())
        } else if spec.starts_with("redis://")
            || spec.starts_with("rediss://")
            || spec.starts_with("redis+")
        {
            StoreSpec::Redis(spec.to_owned())
        } else {
            StoreSpec::Sqlite(spec.into())
        }
    }
}

impl From<String> for StoreSpec {
    fn from(spec: String) -> Self {
        StoreSpec::from(spec.as_str())
    }
}

impl From<StoreSpec> for String {
    fn from(spec: StoreSpec) -> Self {
        spec.to_string()
    }
}

impl fmt::Display for StoreSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreSpec::InProcess(name) => write!(f, ":memory:{name}"),
            StoreSpec::Redis(url) => f.write_str(url),
            StoreSpec::Sqlite(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The stores of one kind open in this process, by name: filters granted
/// the same store share one (one connection, one file handle), and a store
/// no one holds any more is let go.
pub(crate) struct Registry<S: ?Sized> {
    open: Mutex<Option<HashMap<StoreSpec, Weak<S>>>>,
}

impl<S: ?Sized> Registry<S> {
    pub(crate) const fn new() -> Self {
        Registry {
            open: Mutex::new(None),
        }
    }

    /// The store `spec` names, shared if it is open, else made by `make`.
    pub(crate) async fn open(
        &self,
        spec: StoreSpec,
        make: impl AsyncFnOnce(&StoreSpec) -> Result<Arc<S>, String>,
    ) -> Result<Arc<S>, String> {
        let open = || self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let found = open()
            .get_or_insert_default()
            .get(&spec)
            .and_then(Weak::upgrade);
        if let Some(store) = found {
            return Ok(store);
        }
        let store = make(&spec).await?;
        open()
            .get_or_insert_default()
            .insert(spec, Arc::downgrade(&store));
        Ok(store)
    }
}
