//! The imports a filter gets only when the operator grants them (`timer`,
//! `approval`, `memory`; `trace` and `kv` in files of their own), and
//! `model-stream`, which needs no grant. Without its grant a call fails with an `auth` error naming the grant to
//! add. Each works only in the calls it is for ([`Service::calls`]:
//! never while the instance is made, configured or described), and is
//! bounded per call in count, size and time waited. Time spent waiting in
//! `timer`, `approval` or the store is not the filter's own, as time in
//! `next` is not, but it is bounded per call, so a hook call outside
//! `next` never lasts longer than its `wall_ms` and these waits together.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;

use super::HostState;
use super::trace::TraceSink;
use crate::context::{CLIENT_KEY, TENANT};
use crate::conversation::{self, ConversationStore, open_store};
use crate::escape;
use crate::kv::{KvStore, open_kv};
use crate::onion::{ApprovalRequest, Approver};
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::bindings::shallot::filter::{approval, memory, model_stream, timer};
use crate::plugin::convert;
use crate::plugin::{Grants, HttpGrant, KvGrant, ModelGrant, TraceTarget};
use crate::types::{Call, ChainError, Weigh};

/// The longest conversation id, in bytes.
const CONVERSATION_ID_CAP: usize = 512;
/// Conversation-store operations one call may make.
const STORE_OPS_PER_CALL: u32 = 64;
/// Questions one call may put to the approval handler.
const ASKS_PER_CALL: u32 = 16;
/// The longest one call may wait for the approval handler in all, in ms,
/// whatever it asks for.
const APPROVAL_WAIT_CAP_MS: u32 = 10 * 60 * 1000;
/// The largest approval question's arguments (JSON text), in bytes.
const APPROVAL_ARGUMENTS_CAP: usize = 64 << 10;
/// Sleeps one call may make, each counting at least a millisecond of the
/// grant: a loop of `sleep(0)` costs the host a wake-up each time.
const SLEEPS_PER_CALL: u32 = 64;
/// The longest one call may wait for its stores (conversations, keys) in all.
const STORE_WAIT_CAP: Duration = Duration::from_secs(10);

/// A granted import, and the calls it may be used from.
#[derive(Clone, Copy)]
pub(super) enum Service {
    Timer,
    Approval,
    Trace,
    Memory,
    Kv,
    Http,
    Model,
    Metrics,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Service::Timer => "timer.sleep",
            Service::Approval => "approval.ask",
            Service::Trace => "trace.write",
            Service::Memory => "memory",
            Service::Kv => "kv",
            Service::Http => "wasi:http/outgoing-handler",
            Service::Model => "model.complete",
            Service::Metrics => "metrics",
        }
    }

    /// Where it may be called. A backoff belongs in a hook, not in making
    /// the instance; a question needs a caller waiting on a decision (an
    /// around hook), not a stream being shaped; the stores are for the
    /// chains (and, for keys, the system prompt), never per token.
    pub(super) fn calls(self) -> &'static [Call] {
        const AROUND: &[Call] = &[Call::AroundChat, Call::AroundTool, Call::AroundTurn];
        const HOOKS: &[Call] = &[
            Call::AroundChat,
            Call::AroundTool,
            Call::AroundTurn,
            Call::SystemPrompt,
            Call::Step,
            Call::Flush,
        ];
        const PROMPTED: &[Call] = &[
            Call::AroundChat,
            Call::AroundTool,
            Call::AroundTurn,
            Call::SystemPrompt,
        ];
        match self {
            Service::Timer | Service::Trace | Service::Http | Service::Metrics => HOOKS,
            Service::Approval | Service::Memory | Service::Model => AROUND,
            Service::Kv => PROMPTED,
        }
    }
}

/// What a filter's grants give it at run time: the grants, and the trace
/// sink opened for it when it was loaded.
#[derive(Clone, Default)]
pub(crate) struct GrantedServices {
    pub sleep_ms: u32,
    pub approval: bool,
    pub trace: Option<Arc<TraceSink>>,
    pub memory: Option<Arc<dyn ConversationStore>>,
    pub kv: Option<GrantedKv>,
    pub http: Option<Arc<HttpGrant>>,
    pub model: Option<ModelGrant>,
}

/// The key store a filter is granted, and its namespace (`None`: the
/// filter's name).
#[derive(Clone)]
pub(crate) struct GrantedKv {
    pub store: Arc<dyn KvStore>,
    pub namespace: Option<String>,
}

impl GrantedServices {
    /// Opens what `grants` name; a trace file or a store that cannot be
    /// opened is an error naming it.
    pub(crate) async fn open(grants: &Grants) -> Result<Self, String> {
        let trace = match &grants.trace {
            None => None,
            Some(TraceTarget::Stderr) => Some(Arc::new(TraceSink::Stderr)),
            Some(TraceTarget::File(path)) => Some(Arc::new(TraceSink::open(path)?)),
        };
        let memory = match &grants.memory {
            None => None,
            Some(spec) => Some(open_store(spec.clone()).await?),
        };
        let kv = match &grants.kv {
            None => None,
            Some(KvGrant { namespace, .. }) if namespace.as_ref().is_some_and(String::is_empty) => {
                return Err("grants.kv: the namespace must not be empty".into());
            }
            Some(grant) => Some(GrantedKv {
                store: open_kv(grant.store.clone()).await?,
                namespace: grant.namespace.clone(),
            }),
        };
        Ok(GrantedServices {
            sleep_ms: grants.sleep_ms,
            approval: grants.approval,
            trace,
            memory,
            kv,
            http: grants.http.clone().map(Arc::new),
            model: grants.model.clone(),
        })
    }
}

pub(super) fn error(kind: wit::ErrorKind, message: impl Into<String>) -> wit::FilterError {
    wit::FilterError {
        kind,
        message: message.into(),
    }
}

pub(super) fn not_granted(import: &str, grant: &str) -> wit::FilterError {
    error(
        wit::ErrorKind::Auth,
        format!(
            "the `{import}` import is not granted to this filter; the operator grants it with `grants = {{ {grant} }}`"
        ),
    )
}

impl HostState {
    /// Refuses `service` in a call it is not for (typed: the filter can
    /// tell it from a failure of the service).
    pub(super) fn out_of_place(&self, service: Service) -> Option<wit::FilterError> {
        let allowed = service.calls();
        match self.call {
            Some(call) if allowed.contains(&call) => None,
            call => {
                let here = call.map_or("outside any call", Call::as_str);
                let places: Vec<&str> = allowed.iter().map(|c| c.as_str()).collect();
                let message = format!(
                    "{} may be called only from {}, not from {here}",
                    service.name(),
                    places.join(", ")
                );
                Some(error(wit::ErrorKind::InvalidRequest, message))
            }
        }
    }
}

impl model_stream::Host for HostState {
    fn end(&mut self) -> wasmtime::Result<Option<wit::FinishReason>> {
        Ok(self.stream_end)
    }
}

impl timer::Host for HostState {
    async fn sleep(&mut self, ms: u32) -> wasmtime::Result<Result<(), wit::FilterError>> {
        if self.services.sleep_ms == 0 {
            return Ok(Err(not_granted("timer", "sleep_ms = 30000")));
        }
        if let Some(refused) = self.out_of_place(Service::Timer) {
            return Ok(Err(refused));
        }
        let quotas = &mut self.quotas;
        quotas.sleeps += 1;
        if quotas.sleeps > SLEEPS_PER_CALL {
            let message = format!("more than {SLEEPS_PER_CALL} sleeps in one call");
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let total = quotas.slept.saturating_add(ms.max(1));
        if total > self.services.sleep_ms {
            let message = format!(
                "sleeping {ms} ms more would take this hook call to {total} ms, past its grant of {} ms",
                self.services.sleep_ms
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        quotas.slept = total;
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        tokio::time::sleep(Duration::from_millis(ms.into())).await;
        meter.leave_next();
        Ok(Ok(()))
    }
}

impl approval::Host for HostState {
    async fn ask(
        &mut self,
        tool: String,
        arguments: String,
        reason: String,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<bool, wit::FilterError>> {
        if !self.services.approval {
            return Ok(Err(not_granted("approval", "approval = true")));
        }
        if let Some(refused) = self.out_of_place(Service::Approval) {
            return Ok(Err(refused));
        }
        self.quotas.asks += 1;
        if self.quotas.asks > ASKS_PER_CALL {
            let message = format!("more than {ASKS_PER_CALL} approval questions in one call");
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        if arguments.len() > APPROVAL_ARGUMENTS_CAP {
            let message = format!(
                "an approval question's arguments of {} bytes are over the cap of {APPROVAL_ARGUMENTS_CAP}",
                arguments.len()
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let arguments = match self.json_object(&arguments, "the arguments")? {
            Ok(map) => serde_json::Value::Object(map),
            Err(message) => return Ok(Err(error(wit::ErrorKind::InvalidRequest, message))),
        };
        let Some(scope) = &self.scope else {
            return Ok(Err(error(
                wit::ErrorKind::InvalidRequest,
                "approval.ask called outside a hook",
            )));
        };
        let Some(approver) = scope.invoke.onion().approver.clone() else {
            return Ok(Ok(false));
        };
        let request = ApprovalRequest {
            filter: self.identity.name.clone(),
            tool: escape::printable(&tool, escape::TEXT_CAP),
            arguments,
            reason: escape::printable(&reason, escape::TEXT_CAP),
            context: scope.invoke.context().clone(),
        };
        // The guest's copies (up to its memory cap) are not held through a
        // wait of up to ten minutes.
        drop((tool, reason));
        Ok(self.answer(approver, &request, timeout_ms).await)
    }
}

impl HostState {
    /// Waits for the approver's answer to `request`, at most `timeout_ms`
    /// and what is left of the call's approval wait; the wait is not the
    /// guest's CPU time.
    async fn answer(
        &mut self,
        approver: Arc<dyn Approver>,
        request: &ApprovalRequest,
        timeout_ms: u32,
    ) -> Result<bool, wit::FilterError> {
        let left = Duration::from_millis(APPROVAL_WAIT_CAP_MS.into())
            .saturating_sub(self.quotas.approval_wait);
        let wait = Duration::from_millis(timeout_ms.into()).min(left);
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let started = tokio::time::Instant::now();
        // A handler that panics fails the question, not the host.
        let asked = AssertUnwindSafe(approver.approve(request)).catch_unwind();
        let answer = tokio::time::timeout(wait, asked).await;
        self.quotas.approval_wait += started.elapsed();
        meter.leave_next();
        match answer {
            Ok(Ok(approved)) => Ok(approved),
            Ok(Err(_)) => Err(error(
                wit::ErrorKind::Internal,
                "the approval handler failed",
            )),
            Err(_) => {
                let message = format!(
                    "the approval handler did not answer within {} ms",
                    wait.as_millis()
                );
                Err(error(wit::ErrorKind::Timeout, message))
            }
        }
    }
}

impl HostState {
    /// The store, if granted, for one more operation of this call, with
    /// the conversation key checked.
    fn store(
        &mut self,
        conversation: &str,
    ) -> Result<Arc<dyn ConversationStore>, wit::FilterError> {
        let Some(store) = self.services.memory.clone() else {
            return Err(not_granted("memory", "memory = \"conversations.db\""));
        };
        if let Some(refused) = self.out_of_place(Service::Memory) {
            return Err(refused);
        }
        if conversation.is_empty() || conversation.len() > CONVERSATION_ID_CAP {
            let message = format!("a conversation id must be 1 to {CONVERSATION_ID_CAP} bytes");
            return Err(error(wit::ErrorKind::InvalidRequest, message));
        }
        // Behind client keys an invoke is for one owner (the key's tenant,
        // else the key): its filters keep that owner's conversations only,
        // in its part of the store, as the gateway names them.
        if let Some(owner) = self.owner()
            && conversation::part(conversation) != owner
        {
            let message = format!(
                "a conversation of another owner: this invoke keeps only those whose id starts `{owner}/` (its `conversation_id` does)"
            );
            return Err(error(wit::ErrorKind::InvalidRequest, message));
        }
        self.quotas.store_ops += 1;
        if self.quotas.store_ops > STORE_OPS_PER_CALL {
            let message =
                format!("more than {STORE_OPS_PER_CALL} conversation-store operations in one call");
            return Err(error(wit::ErrorKind::LimitExceeded, message));
        }
        Ok(store)
    }

    /// Whom the invoke is for, where a client key says: its tenant, else
    /// the key's name (set by the gateway; no filter can change them).
    fn owner(&self) -> Option<String> {
        let context = self.scope.as_ref()?.invoke.context();
        let owner = context.get(TENANT).or_else(|| context.get(CLIENT_KEY))?;
        owner.as_str().map(str::to_owned)
    }

    /// The most a conversation load hands the filter: half its free host
    /// memory, so that it can still pass what it loaded on (a request
    /// carrying the history is held in the host too).
    fn load_room(&self) -> usize {
        self.limits.host_bytes().saturating_sub(self.holding()) / 2
    }

    /// Waits for a store operation, outside the filter's own wall clock but
    /// within what is left of the call's store time. The CPU the store
    /// spends in the call's thread (all of an in-process store's work) is
    /// the filter's own: a flood of writes pays for itself.
    pub(super) async fn on_store<T>(
        &mut self,
        operation: impl Future<Output = Result<T, ChainError>>,
    ) -> Result<T, wit::FilterError> {
        let left = STORE_WAIT_CAP.saturating_sub(self.quotas.store_wait);
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
        self.quotas.store_wait += started.elapsed();
        drop(waiting);
        match result {
            Ok(done) => done.map_err(|e| convert::filter_error(&e)),
            Err(_) => Err(spent()),
        }
    }
}

impl memory::Host for HostState {
    async fn load(
        &mut self,
        conversation: String,
    ) -> wasmtime::Result<Result<Vec<wit::Message>, wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        let room = self.load_room();
        let messages = match self.on_store(store.load(&conversation, room)).await {
            Ok(messages) => messages,
            Err(e) => return Ok(Err(e)),
        };
        // The store measured its own form; what the filter is handed is
        // held in the host's: the oldest go until that fits too.
        let mut weight: usize = messages.iter().map(Weigh::weight).sum();
        let dropped = messages
            .iter()
            .take_while(|message| {
                let over = weight > room;
                if over {
                    weight -= message.weight();
                }
                over
            })
            .count();
        Ok(Ok(convert::messages(&messages[dropped..])))
    }

    async fn append(
        &mut self,
        conversation: String,
        messages: Vec<wit::Message>,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        let messages = convert::from_messages(messages);
        // What one call writes is bounded like what it makes the host
        // hold, as the store keeps it (its encoding can be several times
        // what the guest handed over), so a loop cannot flood the store.
        let stored = conversation::stored_size(&conversation, &messages);
        self.quotas.stored_bytes = self.quotas.stored_bytes.saturating_add(stored);
        if self.quotas.stored_bytes > self.limits.host_bytes() {
            let message = format!(
                "appending {} bytes (as stored) in one call, more than the filter's host memory cap",
                self.quotas.stored_bytes
            );
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        Ok(self.on_store(store.append(&conversation, &messages)).await)
    }

    async fn clear(
        &mut self,
        conversation: String,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let store = match self.store(&conversation) {
            Ok(store) => store,
            Err(e) => return Ok(Err(e)),
        };
        Ok(self.on_store(store.clear(&conversation)).await)
    }
}
