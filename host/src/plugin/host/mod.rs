//! What the host gives a filter instance: its store data, the resources
//! behind request and response handles, and the `next`, `context` and
//! `log` imports.
//!
//! Requests and responses live in the instance's resource table as the
//! host's own values. `next` takes the request the guest holds (a cheap
//! clone: its big parts are shared), runs the inner layers, and hands the
//! response back as a new handle; a pass-through layer never copies a
//! message.
//!
//! Everything a filter makes the host hold is charged to it: each value it
//! creates or changes in its table (and each response `next` hands it) by
//! its weight until it is dropped, its FCtx and its writes to the shared
//! context until the invoke ends. Past `Limits::host_mib` the call faults.
//! Its calls through `next` are counted per hook call, its log lines per
//! call, and what it logs is made printable.
//!
//! One file per imported interface, as wasmtime-wasi's `p2/host/` does:
//! `resources` (the request and response resources of `types`), `next`,
//! `context` (the shared context and FCtx), `log`; and one unit per
//! granted service (`timer`, `approval`, `trace`, `memory`, `kv`, `http`,
//! `model` with `model-stream`, `metrics`), each behind the one trait of
//! `service`, which holds what they share. This file holds the store data
//! and its accounting.

mod approval;
mod context;
mod conversations;
mod http;
mod kv;
mod log;
mod memory;
mod metrics;
mod model;
mod next;
mod resources;
pub(crate) mod service;
mod timer;
mod trace;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;
use wasmtime::component::{HasSelf, Linker, Resource, ResourceTable};
use wasmtime_wasi::{WasiCtxView, WasiView};
use wasmtime_wasi_http::{WasiHttpCtx, WasiHttpCtxView, WasiHttpView};

use super::bindings::Filter as FilterWorld;
use super::bindings::shallot::filter::types as wit;
use super::convert;
use super::stats::Stats;
use crate::escape::{self, TEXT_CAP};
use crate::onion::{Branch, Invoke, PriorValue};
use crate::onion::{Chat, Next, Tool, Turn};
use crate::sandbox::{self, Confinement, HostMemoryExceeded, Limits, Sandboxed};
use crate::types::{Call, Cause, ChainError, ErrorKind, Origin};
use crate::types::{JsonMap, Weigh, json_weight};

pub use http::{HttpGrant, HttpOrigin};
pub use kv::KvGrant;
pub use model::ModelGrant;
pub(crate) use service::GrantedServices;
pub use trace::TraceTarget;

/// Which filter an instance belongs to, for logs and error attribution.
#[derive(Debug)]
pub(crate) struct Identity {
    pub name: Arc<str>,
    pub plugin: Arc<Path>,
    /// What the filter did so far, shared by its instances.
    pub stats: Stats,
}

impl Identity {
    pub(crate) fn origin(&self, call: Call) -> Origin {
        Origin {
            filter: self.name.clone(),
            plugin: Some(self.plugin.clone()),
            call,
        }
    }
}

/// The inner part of the chain that the current hook may call.
pub(crate) enum Continuation {
    None,
    Chat(Next<Chat>),
    Tool(Next<Tool>),
    Turn(Next<Turn>),
}

/// What a call into the instance runs within: its invoke, the filter's
/// position in it (which keys its FCtx), and the rest of the chain.
pub(crate) struct Scope {
    pub invoke: Arc<Invoke>,
    pub id: usize,
    /// The batch branch of a concurrent tool call, if it is one.
    pub branch: Option<Arc<Branch>>,
    pub next: Continuation,
}

impl Scope {
    /// A scope for a call outside the chains (system prompt, tokens).
    pub(crate) fn outside_chains(invoke: Arc<Invoke>, id: usize) -> Self {
        Scope {
            invoke,
            id,
            branch: None,
            next: Continuation::None,
        }
    }
}

/// The data of a filter instance's store.
pub struct HostState {
    pub(crate) table: ResourceTable,
    pub(crate) confinement: Confinement,
    pub(crate) identity: Arc<Identity>,
    pub(crate) limits: Limits,
    pub(crate) scope: Option<Scope>,
    /// The failures `next` handed to the guest in the current hook call,
    /// by the call's number (1-based), so that a filter which passes one on
    /// does not get the blame for it.
    inner_errors: Vec<(u32, ChainError)>,
    /// The call whose failure the guest declared it passes on (`pass-on`).
    passed_on: Option<u32>,
    /// Whether the component imports `pass-on`. If not (built for 0.1.0),
    /// an error equal to the last inner failure is taken as passed on.
    declares: bool,
    /// The weight charged for each value in the table, by handle.
    charges: HashMap<u32, usize>,
    /// Their sum.
    held: usize,
    /// Calls through `next` in the current hook call.
    next_calls: u32,
    /// The call in progress, if any: which imports it may use.
    call: Option<Call>,
    /// Shared-context keys the current call wrote, each with what it was
    /// before the call's first write of it, to undo if the call faults or
    /// is cancelled. A key is kept once however often it is written (a
    /// loop of writes must not grow it), and removing an absent key is not
    /// kept.
    journal: HashMap<String, PriorValue>,
    /// What the operator granted beyond the default imports.
    services: GrantedServices,
    /// What the current call spent of each service (in a token
    /// transformer's steps: what its stream did).
    spent: service::Spent,
    /// How the model stream ended, while its token transformer flushes.
    pub(crate) stream_end: Option<wit::FinishReason>,
    /// The filter's outgoing requests (`grants.http`).
    http: http::OutgoingHttp,
    http_ctx: WasiHttpCtx,
}

impl Drop for HostState {
    /// A call that never ended (cancelled by a deadline around it, such as
    /// the filter's own `timeout_ms`, or by the caller going away) loses
    /// its writes to the shared context, as a faulted one does.
    fn drop(&mut self) {
        self.undo();
    }
}

impl Sandboxed for HostState {
    fn confinement(&mut self) -> &mut Confinement {
        &mut self.confinement
    }
}

impl HostState {
    pub(crate) fn new(
        identity: Arc<Identity>,
        limits: Limits,
        confinement: Confinement,
        declares: bool,
        services: GrantedServices,
    ) -> Self {
        let mut table = ResourceTable::new();
        table.set_max_capacity(sandbox::HANDLES);
        let http = http::OutgoingHttp::new(
            services.http.clone(),
            identity.name.clone(),
            confinement.meter().clone(),
        );
        HostState {
            table,
            confinement,
            identity,
            limits,
            scope: None,
            inner_errors: Vec::new(),
            passed_on: None,
            declares,
            charges: HashMap::new(),
            held: 0,
            next_calls: 0,
            call: None,
            journal: HashMap::new(),
            services,
            spent: service::Spent::default(),
            stream_end: None,
            http,
            http_ctx: WasiHttpCtx::new(),
        }
    }

    /// Starts `call` within `scope` (none for configure and describe).
    /// With `fresh_quotas` its quotas of log lines, sleep, trace events,
    /// store operations and questions start anew; a token transformer's
    /// step goes on with what its stream has used, or a stream of many
    /// steps would have them many times over.
    pub(crate) fn enter(&mut self, call: Call, scope: Option<Scope>, fresh_quotas: bool) {
        self.call = Some(call);
        self.scope = scope;
        self.inner_errors.clear();
        self.passed_on = None;
        self.next_calls = 0;
        self.journal.clear();
        self.stream_end = None;
        if fresh_quotas {
            self.spent = service::Spent::default();
        }
        let context = self.scope.as_ref().map(|scope| scope.invoke.context());
        self.http.enter(Some(call), fresh_quotas, context);
    }

    /// Ends a call. A call that faulted loses its writes to the shared
    /// context: each key it wrote gets back the value it had before.
    pub(crate) fn leave(&mut self, faulted: bool) {
        if faulted {
            self.undo();
        }
        self.journal.clear();
        self.scope = None;
        self.call = None;
        self.http.enter(None, false, None);
    }

    /// Puts back what the current call wrote to the shared context.
    fn undo(&mut self) {
        if let Some(scope) = &self.scope {
            for (key, before) in self.journal.drain() {
                scope.invoke.restore_context(scope.id, &key, before);
            }
        }
    }

    /// Host memory this filter holds: its table, and in the current invoke
    /// its FCtx and context writes.
    fn holding(&self) -> usize {
        self.held
            + self
                .scope
                .as_ref()
                .map_or(0, |scope| scope.invoke.held(scope.id))
    }

    /// Fails (a fault) if `more` bytes would take the filter past its cap.
    fn afford(&self, more: usize) -> wasmtime::Result<()> {
        if self.holding() + more > self.limits.host_bytes() {
            return Err(wasmtime::Error::new(HostMemoryExceeded));
        }
        Ok(())
    }

    /// Puts a value the filter caused into its table, charged to it.
    fn keep<T: Weigh + Send + 'static>(&mut self, value: T) -> wasmtime::Result<Resource<T>> {
        let weight = value.weight();
        self.afford(weight)?;
        let handle = self.table.push(value)?;
        self.charges.insert(handle.rep(), weight);
        self.held += weight;
        Ok(handle)
    }

    /// Takes a value out of the table, crediting its charge.
    pub(crate) fn take<T: 'static>(&mut self, handle: Resource<T>) -> wasmtime::Result<T> {
        let rep = handle.rep();
        let value = self.table.delete(handle)?;
        if let Some(weight) = self.charges.remove(&rep) {
            self.held -= weight;
        }
        Ok(value)
    }

    /// Charges a value the filter changed in place at its new weight.
    fn recharge<T: Weigh + 'static>(&mut self, handle: &Resource<T>) -> wasmtime::Result<()> {
        let weight = self.table.get(handle)?.weight();
        let old = self.charges.get(&handle.rep()).copied().unwrap_or(0);
        if weight > old {
            self.afford(weight - old)?;
        }
        self.charges.insert(handle.rep(), weight);
        self.held = self.held + weight - old;
        Ok(())
    }

    /// Attributes an error the guest returned: the inner failure it
    /// declared it passes on keeps its origin; anything else is this
    /// filter's own.
    pub(crate) fn attribute(&self, error: wit::FilterError, call: Call) -> ChainError {
        let passed = if self.declares {
            self.passed_on
                .and_then(|nth| self.inner_errors.iter().find(|(n, _)| *n == nth))
        } else {
            self.inner_errors.last().filter(|(_, inner)| {
                let seen = convert::filter_error(inner);
                seen.kind == error.kind && seen.message == error.message
            })
        };
        if let Some((_, inner)) = passed {
            return inner.clone();
        }
        let message = escape::printable(&error.message, TEXT_CAP);
        let mut error = ChainError::new(error.kind.into(), message).at(self.identity.origin(call));
        let stores = matches!(error.kind, ErrorKind::Transient | ErrorKind::Timeout);
        if self.spent.stores.failed && stores {
            error.cause = Some(Cause::StoreUnavailable);
        }
        self.identity.stats.failed(call, error.kind);
        error
    }
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.confinement.wasi,
            table: &mut self.table,
        }
    }
}

impl WasiHttpView for HostState {
    fn http(&mut self) -> WasiHttpCtxView<'_> {
        WasiHttpCtxView {
            ctx: &mut self.http_ctx,
            table: &mut self.table,
            hooks: &mut self.http,
        }
    }
}

/// The linker of filter instances: WASI 0.2 and `wasi:http` (with nothing
/// granted unless the filter's grants say so) and the `shallot:filter`
/// imports.
pub(crate) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    wasmtime_wasi_http::p2::add_only_http_to_linker_async(&mut linker)?;
    FilterWorld::add_to_linker::<HostState, HasSelf<HostState>>(&mut linker, |state| state)?;
    Ok(linker)
}

impl HostState {
    /// Parses JSON text a guest gave, once it is known to fit: a value
    /// built from text takes many times the text's size (`[0,0,…]`, two
    /// bytes an element, is 32 bytes an element as a `Value`), so the
    /// text is first walked without building anything, and a document
    /// that would take the filter past its cap faults (as keeping it
    /// would) before the host allocates it. Text that is not JSON is an
    /// error for the guest.
    pub(crate) fn parse_json(
        &self,
        text: &str,
        what: &str,
    ) -> wasmtime::Result<Result<Value, String>> {
        let weight = match json_weight(text) {
            Ok(weight) => weight,
            Err(e) => return Ok(Err(format!("{what} is not JSON: {e}"))),
        };
        self.afford(weight)?;
        Ok(serde_json::from_str(text).map_err(|e| format!("{what} is not JSON: {e}")))
    }

    /// [`HostState::parse_json`] of text that must be an object.
    fn json_object(&self, text: &str, what: &str) -> wasmtime::Result<Result<JsonMap, String>> {
        Ok(match self.parse_json(text, what)? {
            Ok(Value::Object(map)) => Ok(map),
            Ok(_) => Err(format!("{what} must be a JSON object")),
            Err(e) => Err(e),
        })
    }
}

/// Checks that `text` is JSON.
fn json_text(text: &str, what: &str) -> Result<(), String> {
    serde_json::from_str::<serde::de::IgnoredAny>(text)
        .map(|_| ())
        .map_err(|e| format!("{what} is not JSON: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::ErrorKind;

    fn state(declares: bool) -> HostState {
        let limits = Limits::default();
        let identity = Arc::new(Identity {
            name: "outer".into(),
            plugin: Arc::from(Path::new("outer.wasm")),
            stats: Stats::default(),
        });
        let confinement = Confinement::new(&limits, false);
        let mut state = HostState::new(
            identity,
            limits,
            confinement,
            declares,
            GrantedServices::default(),
        );
        let origin = Identity {
            name: "inner".into(),
            plugin: Arc::from(Path::new("inner.wasm")),
            stats: Stats::default(),
        }
        .origin(Call::AroundChat);
        for (nth, message) in [(1, "first"), (2, "second")] {
            let error = ChainError::new(ErrorKind::Transient, message).at(origin.clone());
            state.inner_errors.push((nth, error));
        }
        state
    }

    fn returned(message: &str) -> wit::FilterError {
        wit::FilterError {
            kind: wit::ErrorKind::Transient,
            message: message.into(),
        }
    }

    fn blamed(error: ChainError) -> (String, String) {
        (error.origin.unwrap().filter.to_string(), error.message)
    }

    #[test]
    fn a_declared_failure_keeps_its_origin_and_an_undeclared_one_is_the_filters() {
        let mut state = state(true);
        let own = ("outer".to_owned(), "second".to_owned());
        assert_eq!(
            blamed(state.attribute(returned("second"), Call::AroundChat)),
            own
        );
        state.passed_on = Some(1);
        let first = ("inner".to_owned(), "first".to_owned());
        assert_eq!(
            blamed(state.attribute(returned("second"), Call::AroundChat)),
            first
        );
        state.passed_on = Some(7);
        assert_eq!(
            blamed(state.attribute(returned("second"), Call::AroundChat)),
            own
        );
    }

    #[test]
    fn a_component_that_cannot_declare_passes_on_what_equals_the_last_failure() {
        let state = state(false);
        let seen = |nth: usize| convert::filter_error(&state.inner_errors[nth].1);
        let last = ("inner".to_owned(), "second".to_owned());
        assert_eq!(blamed(state.attribute(seen(1), Call::AroundChat)), last);
        let first = seen(0).message;
        assert_eq!(
            blamed(state.attribute(seen(0), Call::AroundChat)).0,
            "outer"
        );
        assert!(first.ends_with("first"), "{first}");
    }
}
