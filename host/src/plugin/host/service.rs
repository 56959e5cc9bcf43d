//! A granted service as one unit, as Spin's factors are: each import the
//! operator grants a filter (`timer`, `approval`, `trace`, `memory`, `kv`,
//! `wasi:http`, `model`, and `metrics`, which needs no grant) is a file
//! (or a folder) of its own that owns its grant type, where it may be
//! called, what its grant opens at load, what a call spends of it, and its
//! WIT interface; this file holds what they share. A new service is one
//! new unit: an impl of [`Service`], its field in [`GrantedServices`] and
//! in [`Spent`], its grant in `Grants`; and before it lands it answers
//! the new-service checklist of `docs/SECURITY.md` (who names it, what it
//! spends and when, what fans out, what it shares, what parses its output,
//! what an id grants, what work comes before admission).
//!
//! Without its grant a call fails with an `auth` error naming the grant to
//! add. Each works only in the calls it is for ([`Service::CALLS`]: never
//! while the instance is made, configured or described), and is bounded
//! per call in count, size and time waited. Time spent waiting in `timer`,
//! `approval`, a store, a request or a side call is not the filter's own
//! wall time, as time in `next` is not, but it is bounded per call, so a
//! hook call outside `next` never lasts longer than its `wall_ms` and
//! these waits together.

use std::future::Future;
use std::time::Duration;

use super::HostState;
use super::approval::{self, Approval};
use super::http::Http;
use super::kv::{self, Kv};
use super::memory::{self, Memory};
use super::metrics::Metrics;
use super::model::Model;
use super::timer::{self, Timer};
use super::trace::{self, Trace};
use crate::context::{CLIENT_KEY, TENANT};
use crate::plugin::Grants;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::convert;
use crate::types::{Call, Cause, ChainError};

/// The around hooks: where a caller waits on a decision.
pub(super) const AROUND: &[Call] = &[Call::AroundChat, Call::AroundTool, Call::AroundTurn];
/// The around hooks and the system prompt: the chains' calls.
pub(super) const PROMPTED: &[Call] = &[
    Call::AroundChat,
    Call::AroundTool,
    Call::AroundTurn,
    Call::SystemPrompt,
];
/// Every hook call and token step: never while an instance is made,
/// configured or described.
pub(super) const HOOKS: &[Call] = &[
    Call::AroundChat,
    Call::AroundTool,
    Call::AroundTurn,
    Call::SystemPrompt,
    Call::Step,
    Call::Flush,
];

/// One service a filter may be granted.
pub(crate) trait Service {
    /// The import (the WIT interface), as a message names it.
    const IMPORT: &'static str;
    /// A call of it, as a message names it (`trace.write`).
    const CALLED: &'static str;
    /// The calls it may be used from.
    const CALLS: &'static [Call];
    /// How an operator grants it, shown to a filter that lacks it.
    const GRANT: &'static str;
    /// What its grant opens at load, shared by the filter's instances.
    type Granted: Clone;
    /// What one call (a token transformer's stream) has spent of it.
    type Spent: Default;
    /// Its part of a filter's services, if granted.
    fn granted(services: &GrantedServices) -> Option<&Self::Granted>;
    /// Its part of a call's spending.
    fn spent(spent: &mut Spent) -> &mut Self::Spent;
}

/// What a filter's grants open at load: each service's part.
#[derive(Clone, Default)]
pub(crate) struct GrantedServices {
    pub timer: Option<<Timer as Service>::Granted>,
    pub approval: Option<<Approval as Service>::Granted>,
    pub trace: Option<<Trace as Service>::Granted>,
    pub memory: Option<<Memory as Service>::Granted>,
    pub kv: Option<<Kv as Service>::Granted>,
    pub http: Option<<Http as Service>::Granted>,
    pub model: Option<<Model as Service>::Granted>,
}

impl GrantedServices {
    /// Opens what `grants` name; a trace file or a store that cannot be
    /// opened is an error naming it.
    pub(crate) async fn open(grants: &Grants) -> Result<Self, String> {
        Ok(GrantedServices {
            timer: timer::open(grants.sleep_ms),
            approval: approval::open(grants.approval),
            trace: trace::open(grants.trace.as_ref())?,
            memory: memory::open(grants.memory.as_ref()).await?,
            kv: kv::open(grants.kv.as_ref()).await?,
            http: grants.http.clone().map(std::sync::Arc::new),
            model: grants.model.clone(),
        })
    }
}

/// What the current call has spent of each service (a token transformer's
/// steps: its stream), and of what they share; started afresh with each
/// call that is not a step.
#[derive(Default)]
pub(crate) struct Spent {
    pub timer: <Timer as Service>::Spent,
    pub approval: <Approval as Service>::Spent,
    pub trace: <Trace as Service>::Spent,
    pub memory: <Memory as Service>::Spent,
    pub kv: <Kv as Service>::Spent,
    pub model: <Model as Service>::Spent,
    /// Nothing: a filter's metrics are bounded in its stats.
    pub metrics: <Metrics as Service>::Spent,
    /// Nothing here: its requests are counted where they are sent
    /// (`http::OutgoingHttp`, the hooks of its `wasi:http` view).
    pub http: <Http as Service>::Spent,
    /// What the stores (`memory`, `kv`) were written and waited for.
    pub stores: Stores,
    /// Log lines written (`log` needs no grant).
    pub log_lines: u32,
}

/// What a call wrote to its stores, as they keep it, and waited for them.
#[derive(Default)]
pub(crate) struct Stores {
    pub written: usize,
    pub waited: Duration,
    /// Whether one of them failed to answer (down, unreachable, or past
    /// the call's wait): the filter's own transient error is then theirs.
    pub failed: bool,
}

/// The longest one call may wait for its stores (conversations, keys) in all.
const STORE_WAIT_CAP: Duration = Duration::from_secs(10);

pub(super) fn error(kind: wit::ErrorKind, message: impl Into<String>) -> wit::FilterError {
    wit::FilterError {
        kind,
        message: message.into(),
    }
}

impl HostState {
    /// The service `S` for one more use in the current call: what its
    /// grant opened, or the filter's error (`auth` naming the grant to add;
    /// `invalid-request` in a call it is not for: the filter can tell it
    /// from a failure of the service).
    pub(super) fn admit<S: Service>(&self) -> Result<S::Granted, wit::FilterError> {
        let Some(granted) = S::granted(&self.services) else {
            return Err(error(
                wit::ErrorKind::Auth,
                format!(
                    "the `{}` import is not granted to this filter; the operator grants it with `grants = {{ {} }}`",
                    S::IMPORT,
                    S::GRANT
                ),
            ));
        };
        match self.call {
            Some(call) if S::CALLS.contains(&call) => Ok(granted.clone()),
            call => {
                let here = call.map_or("outside any call", Call::as_str);
                let places: Vec<&str> = S::CALLS.iter().map(|c| c.as_str()).collect();
                let message = format!(
                    "{} may be called only from {}, not from {here}",
                    S::CALLED,
                    places.join(", ")
                );
                Err(error(wit::ErrorKind::InvalidRequest, message))
            }
        }
    }

    /// Whom the invoke is for, where a client key says: its tenant, else
    /// the key's name (set by the gateway; no filter can change them). A
    /// shared store keeps each owner's part apart.
    pub(super) fn owner(&self) -> Option<String> {
        let context = self.scope.as_ref()?.invoke.context();
        let owner = context.get(TENANT).or_else(|| context.get(CLIENT_KEY))?;
        owner.as_str().map(str::to_owned)
    }

    /// What the current call has spent of `S`.
    pub(super) fn spent<S: Service>(&mut self) -> &mut S::Spent {
        S::spent(&mut self.spent)
    }

    /// Waits for a store operation, outside the filter's own wall clock but
    /// within what is left of the call's store time. The CPU the store
    /// spends in the call's thread (all of an in-process store's work) is
    /// the filter's own: a flood of writes pays for itself.
    pub(super) async fn on_store<T>(
        &mut self,
        operation: impl Future<Output = Result<T, ChainError>>,
    ) -> Result<T, wit::FilterError> {
        let left = STORE_WAIT_CAP.saturating_sub(self.spent.stores.waited);
        let spent = || {
            let message = format!(
                "this call waited {} s for its stores in all, its most",
                STORE_WAIT_CAP.as_secs()
            );
            error(wit::ErrorKind::Timeout, message)
        };
        // Not even started once the call's time is spent: a write the
        // filter is told timed out must not happen.
        if left.is_zero() {
            return Err(spent());
        }
        let waiting = self.confinement.meter().wait();
        let started = tokio::time::Instant::now();
        let result = tokio::time::timeout(left, operation).await;
        self.spent.stores.waited += started.elapsed();
        drop(waiting);
        let failed = match result {
            Ok(Ok(done)) => return Ok(done),
            Ok(Err(e)) if e.cause != Some(Cause::StoreUnavailable) => {
                return Err(convert::filter_error(&e));
            }
            Ok(Err(e)) => convert::filter_error(&e),
            Err(_) => spent(),
        };
        self.spent.stores.failed = true;
        Err(failed)
    }

    /// Counts `bytes` more written to the stores in this call: refused
    /// past the filter's host memory cap, so a loop cannot flood a store.
    pub(super) fn write_to_stores(&mut self, bytes: usize) -> Result<(), wit::FilterError> {
        let written = &mut self.spent.stores.written;
        *written = written.saturating_add(bytes);
        if *written > self.limits.host_bytes() {
            let message = format!(
                "writing {} bytes (as stored) to its stores in one call, more than the filter's host memory cap",
                *written
            );
            return Err(error(wit::ErrorKind::LimitExceeded, message));
        }
        Ok(())
    }
}
