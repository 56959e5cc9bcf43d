//! `next`: the inner layers, called from a hook, bounded per hook call.

use std::time::Duration;

use wasmtime::component::Resource;

use super::HostState;
use crate::onion::{Chat, Tool, Turn};
use crate::plugin::bindings::shallot::filter::{next, types as wit};
use crate::plugin::convert;
use crate::plugin::instance::WasmChain;
use crate::types::{Call, ChainError, ErrorKind, Weigh};
use crate::types::{ChatRequest, ChatResponse, ToolRequest, ToolResponse, TurnRequest, TurnResult};

impl HostState {
    /// Hands the guest the failure of its current `next` call, numbered so
    /// that it can pass it on. Calls past the limit are not kept: their
    /// error (the limit) is the filter's own anyway.
    fn inner_failed(&mut self, error: ChainError) -> wit::FilterError {
        let seen = convert::filter_error(&error);
        if self.next_calls <= self.limits.next_calls {
            self.inner_errors.push((self.next_calls, error));
        }
        seen
    }

    /// Hands the guest what `next` returned. An answer bigger than the
    /// filter's whole host memory cap could never be held by it: the inner
    /// layers made it so, and the filter gets a `limit-exceeded` error it
    /// can handle in its place, not a fault that blames it. One that does
    /// not fit only because of what the filter already holds is the
    /// filter's fault, as for anything else it keeps.
    pub(super) fn hand_over<T: Weigh + Send + 'static>(
        &mut self,
        value: T,
    ) -> wasmtime::Result<Result<Resource<T>, wit::FilterError>> {
        let weight = value.weight();
        if weight > self.limits.host_bytes() {
            let message = format!(
                "the inner answer ({weight} bytes) does not fit in this filter's host memory cap of {} MiB",
                self.limits.host_mib
            );
            // About this filter (its cap), though not its fault.
            let mut error = ChainError::new(ErrorKind::LimitExceeded, message);
            if let Some(call) = self.call {
                error = error.at(self.identity.origin(call));
            }
            return Ok(Err(self.inner_failed(error)));
        }
        self.keep(value).map(Ok)
    }

    fn misuse(&self, what: &str) -> wit::FilterError {
        wit::FilterError {
            kind: wit::ErrorKind::InvalidRequest,
            message: format!("next.{what} called outside an around-{what} hook"),
        }
    }

    /// Runs the inner layers for a `next.*` call, with the request the
    /// guest lent; `None` when the current hook is not of chain `K`.
    async fn run_next<K: WasmChain>(
        &mut self,
        request: &Resource<K::Request>,
        within: Option<u32>,
    ) -> wasmtime::Result<Option<K::Output>> {
        self.next_calls = self.next_calls.saturating_add(1);
        let Some(next) = self
            .scope
            .as_ref()
            .and_then(|scope| K::resume(&scope.next))
            .cloned()
        else {
            return Ok(None);
        };
        let request = self.table.get(request)?.clone();
        if self.next_calls > self.limits.next_calls {
            let message = format!(
                "called next more than {} times in one hook call",
                self.limits.next_calls
            );
            let error = ChainError::new(ErrorKind::LimitExceeded, message)
                .at(self.identity.origin(K::HOOK.into()));
            return Ok(Some(K::fail(error)));
        }
        let meter = self.confinement.meter().clone();
        meter.enter_next();
        let output = match within {
            // The deadline is this filter's: its timeout error names it.
            Some(ms) => {
                match tokio::time::timeout(Duration::from_millis(ms.into()), next.call(request))
                    .await
                {
                    Ok(output) => output,
                    Err(_) => {
                        let message = format!("the inner call did not finish within {ms} ms");
                        let origin = self.identity.origin(K::HOOK.into());
                        K::fail(ChainError::new(ErrorKind::Timeout, message).at(origin))
                    }
                }
            }
            None => next.call(request).await,
        };
        meter.leave_next();
        Ok(Some(output))
    }

    /// A guest's `next.*` call of chain `K`: the inner layers' output,
    /// handed over to the guest.
    async fn inner<K: NextCall>(
        &mut self,
        request: Resource<K::Request>,
        within: Option<u32>,
    ) -> wasmtime::Result<K::Handed> {
        let output = self.run_next::<K>(&request, within).await?;
        K::hand(self, output)
    }

    /// Hands the guest the response of a chat or tool `next` (`what`).
    fn hand_response<T: Weigh + Send + 'static>(
        &mut self,
        output: Option<Result<T, ChainError>>,
        what: &str,
    ) -> wasmtime::Result<Result<Resource<T>, wit::FilterError>> {
        Ok(match output {
            None => Err(self.misuse(what)),
            Some(Ok(response)) => self.hand_over(response)?,
            Some(Err(error)) => Err(self.inner_failed(error)),
        })
    }

    /// Moves a turn result the guest returned out of its table.
    pub(crate) fn take_turn_result(
        &mut self,
        result: wit::TurnResult,
        call: Call,
    ) -> wasmtime::Result<TurnResult> {
        Ok(match result {
            wit::TurnResult::Done(done) => TurnResult::Done(self.take(done)?),
            wit::TurnResult::Interrupt(interrupt) => TurnResult::Interrupt(self.take(interrupt)?),
            wit::TurnResult::Error(error) => TurnResult::Error(self.attribute(error, call)),
        })
    }
}

/// What a chain's `next` gives a guest back.
trait NextCall: WasmChain {
    /// The WIT form of the chain's output.
    type Handed;

    /// Hands `output` over to the guest; `None` for a `next` of this
    /// chain called from another chain's hook.
    fn hand(state: &mut HostState, output: Option<Self::Output>) -> wasmtime::Result<Self::Handed>;
}

impl NextCall for Chat {
    type Handed = Result<Resource<ChatResponse>, wit::FilterError>;

    fn hand(state: &mut HostState, output: Option<Self::Output>) -> wasmtime::Result<Self::Handed> {
        state.hand_response(output, "chat")
    }
}

impl NextCall for Tool {
    type Handed = Result<Resource<ToolResponse>, wit::FilterError>;

    fn hand(state: &mut HostState, output: Option<Self::Output>) -> wasmtime::Result<Self::Handed> {
        state.hand_response(output, "tool")
    }
}

impl NextCall for Turn {
    type Handed = wit::TurnResult;

    fn hand(state: &mut HostState, output: Option<Self::Output>) -> wasmtime::Result<Self::Handed> {
        Ok(match output {
            None => wit::TurnResult::Error(state.misuse("turn")),
            Some(TurnResult::Done(done)) => match state.hand_over(done)? {
                Ok(done) => wit::TurnResult::Done(done),
                Err(error) => wit::TurnResult::Error(error),
            },
            Some(TurnResult::Interrupt(interrupt)) => match state.hand_over(interrupt)? {
                Ok(interrupt) => wit::TurnResult::Interrupt(interrupt),
                Err(error) => wit::TurnResult::Error(error),
            },
            Some(TurnResult::Error(error)) => wit::TurnResult::Error(state.inner_failed(error)),
        })
    }
}

impl next::Host for HostState {
    async fn chat(
        &mut self,
        request: Resource<ChatRequest>,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        self.inner::<Chat>(request, None).await
    }

    async fn tool(
        &mut self,
        request: Resource<ToolRequest>,
    ) -> wasmtime::Result<Result<Resource<ToolResponse>, wit::FilterError>> {
        self.inner::<Tool>(request, None).await
    }

    async fn turn(&mut self, request: Resource<TurnRequest>) -> wasmtime::Result<wit::TurnResult> {
        self.inner::<Turn>(request, None).await
    }

    async fn chat_within(
        &mut self,
        request: Resource<ChatRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Resource<ChatResponse>, wit::FilterError>> {
        self.inner::<Chat>(request, Some(timeout_ms)).await
    }

    async fn tool_within(
        &mut self,
        request: Resource<ToolRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<Result<Resource<ToolResponse>, wit::FilterError>> {
        self.inner::<Tool>(request, Some(timeout_ms)).await
    }

    async fn turn_within(
        &mut self,
        request: Resource<TurnRequest>,
        timeout_ms: u32,
    ) -> wasmtime::Result<wit::TurnResult> {
        self.inner::<Turn>(request, Some(timeout_ms)).await
    }

    async fn pass_on(&mut self, nth: u32) -> wasmtime::Result<()> {
        self.passed_on = Some(nth);
        Ok(())
    }
}
