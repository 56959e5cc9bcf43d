//! How each Redis server the stores use has answered lately, for
//! `/readyz` and as a breaker: every store over one server (keys and
//! conversations, of every filter and route) reports to one record, by the
//! address it shows (never its credentials). While a server fails, one
//! operation a second tries it and the others fail at once, instead of
//! each waiting on the client's reconnection to fail.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::Serialize;

/// One server's record.
pub(crate) struct Health {
    shown: String,
    /// Whether `down` holds a failure: an answer costs a load, not a lock.
    failing: AtomicBool,
    down: Mutex<Option<Down>>,
}

struct Down {
    since: Instant,
    /// When an operation last tried the server.
    tried: Instant,
    error: String,
}

/// How often an operation tries a server that is failing.
pub(crate) const RETRY_EVERY: Duration = Duration::from_secs(1);

/// A store's server as `/readyz` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StoreState {
    /// Which server (`redis at 127.0.0.1:6379`).
    pub store: String,
    /// Whether its last operation was answered.
    pub up: bool,
    /// Since when it has failed, in milliseconds, while it does.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub down_for_ms: Option<u64>,
    /// Its last failure, while it fails.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

static SERVERS: Mutex<Vec<Weak<Health>>> = Mutex::new(Vec::new());

/// The record of the server shown as `shown`: the one its other stores
/// report to, or a new one.
pub(crate) fn register(shown: &str) -> Arc<Health> {
    let mut servers = SERVERS.lock().unwrap_or_else(|e| e.into_inner());
    servers.retain(|server| server.strong_count() > 0);
    if let Some(known) = servers
        .iter()
        .filter_map(Weak::upgrade)
        .find(|server| server.shown == shown)
    {
        return known;
    }
    let health = Arc::new(Health {
        shown: shown.to_owned(),
        failing: AtomicBool::new(false),
        down: Mutex::new(None),
    });
    servers.push(Arc::downgrade(&health));
    health
}

/// Every server a store in use is over, and how it has answered lately.
pub fn store_states() -> Vec<StoreState> {
    let servers = SERVERS.lock().unwrap_or_else(|e| e.into_inner());
    servers
        .iter()
        .filter_map(Weak::upgrade)
        .map(|server| server.state())
        .collect()
}

impl Health {
    /// The server answered an operation.
    pub(crate) fn answered(&self) {
        if self.failing.load(Ordering::Relaxed) {
            *self.down.lock().unwrap_or_else(|e| e.into_inner()) = None;
            self.failing.store(false, Ordering::Relaxed);
        }
    }

    /// The server failed an operation (no answer, or a broken connection).
    pub(crate) fn failed(&self, error: &dyn std::fmt::Display) {
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let since = down.as_ref().map_or(now, |down| down.since);
        *down = Some(Down {
            since,
            tried: now,
            error: crate::escape::printable(&error.to_string(), 200),
        });
        self.failing.store(true, Ordering::Relaxed);
    }

    /// Whether an operation may try the server: always while it answers;
    /// while it fails, one each [`RETRY_EVERY`]. `Err` says why not.
    pub(crate) fn may_try(&self) -> Result<(), String> {
        if !self.failing.load(Ordering::Relaxed) {
            return Ok(());
        }
        let mut down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        let Some(down) = down.as_mut() else {
            return Ok(());
        };
        if down.tried.elapsed() >= RETRY_EVERY {
            down.tried = Instant::now();
            return Ok(());
        }
        Err(format!(
            "it has not answered for {} ms, and is asked again once a second ({})",
            down.since.elapsed().as_millis(),
            down.error
        ))
    }

    fn state(&self) -> StoreState {
        let down = self.down.lock().unwrap_or_else(|e| e.into_inner());
        StoreState {
            store: self.shown.clone(),
            up: down.is_none(),
            down_for_ms: down
                .as_ref()
                .map(|down| down.since.elapsed().as_millis() as u64),
            error: down.as_ref().map(|down| down.error.clone()),
        }
    }
}
