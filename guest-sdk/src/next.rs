//! The inner layers of the chain the current hook belongs to: the next
//! filter, or the terminal (the model, the tool, the tool loop).

use std::cell::Cell;
use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::shallot::filter::next as wit;
use crate::bindings::shallot::filter::types::{self as wtypes, TurnRequest};
use crate::{ChatRequest, ChatResponse, Fctx, FilterError, ToolRequest, ToolResponse, TurnResult};

thread_local! {
    /// Calls through `next` in the current hook call, counted as the host
    /// counts them, so a failure can be named when it is passed on.
    static CALLS: Cell<u32> = const { Cell::new(0) };
}

/// Starts a hook call's count.
pub(crate) fn begin_hook() {
    CALLS.with(|calls| calls.set(0));
}

/// Numbers the call about to be made.
fn count() -> u32 {
    CALLS.with(|calls| {
        let nth = calls.get().saturating_add(1);
        calls.set(nth);
        nth
    })
}

fn inner<T>(result: Result<T, wtypes::FilterError>, nth: u32) -> Result<T, FilterError> {
    result.map_err(|error| FilterError::inner(error, nth))
}

/// Calls the inner layers of the chat chain.
pub(crate) fn chat(request: &ChatRequest) -> Result<ChatResponse, FilterError> {
    let nth = count();
    inner(wit::chat(request), nth)
}

/// As [`chat`], but gives up after `timeout_ms` with a `timeout` error; the
/// inner call is cancelled.
pub(crate) fn chat_within(
    request: &ChatRequest,
    timeout_ms: u32,
) -> Result<ChatResponse, FilterError> {
    let nth = count();
    inner(wit::chat_within(request, timeout_ms), nth)
}

/// Calls the inner layers of the tool chain.
pub(crate) fn tool(request: &ToolRequest) -> Result<ToolResponse, FilterError> {
    let nth = count();
    inner(wit::tool(request), nth)
}

/// As [`tool`], bounded by `timeout_ms`.
pub(crate) fn tool_within(
    request: &ToolRequest,
    timeout_ms: u32,
) -> Result<ToolResponse, FilterError> {
    let nth = count();
    inner(wit::tool_within(request, timeout_ms), nth)
}

/// Calls the inner layers of the turn chain: the rest of the turn filters,
/// then the tool loop. Failures are a [`TurnResult::Error`], not an `Err`.
pub(crate) fn turn(request: &TurnRequest) -> TurnResult {
    let nth = count();
    TurnResult::inner(wit::turn(request), nth)
}

/// As [`turn`], bounded by `timeout_ms`.
pub(crate) fn turn_within(request: &TurnRequest, timeout_ms: u32) -> TurnResult {
    let nth = count();
    TurnResult::inner(wit::turn_within(request, timeout_ms), nth)
}

/// The inner layers of the chain a hook belongs to: the next filter, or
/// the terminal (the model, the tool, the tool loop), and the filter's
/// private context ([`Next::fctx`]), as a native filter's `Next` is.
///
/// Only the method of the hook's own chain may be called (`chat` from
/// `around_chat`, ...); any other returns an `invalid-request` error. A hook
/// may call it zero times (short-circuit), once, or several times (retry).
/// An inner failure comes back as a [`FilterError`]: return it unchanged
/// (with `?`) and it keeps its origin, the filter or terminal that failed;
/// change it, or build your own, and it is this filter's error.
pub struct Next<S = ()> {
    state: PhantomData<fn() -> S>,
}

impl<S> Clone for Next<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Next<S> {}

impl<S> std::fmt::Debug for Next<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Next")
    }
}

impl<S> Next<S> {
    pub(crate) const fn new() -> Self {
        Next { state: PhantomData }
    }

    /// Calls the inner layers of the chat chain.
    pub fn chat(self, request: &ChatRequest) -> Result<ChatResponse, FilterError> {
        chat(request)
    }

    /// As [`Next::chat`], but gives up after `timeout_ms` with a `timeout`
    /// error; the inner call is cancelled.
    pub fn chat_within(
        self,
        request: &ChatRequest,
        timeout_ms: u32,
    ) -> Result<ChatResponse, FilterError> {
        chat_within(request, timeout_ms)
    }

    /// Calls the inner layers of the tool chain.
    pub fn tool(self, request: &ToolRequest) -> Result<ToolResponse, FilterError> {
        tool(request)
    }

    /// As [`Next::tool`], bounded by `timeout_ms`.
    pub fn tool_within(
        self,
        request: &ToolRequest,
        timeout_ms: u32,
    ) -> Result<ToolResponse, FilterError> {
        tool_within(request, timeout_ms)
    }

    /// Calls the inner layers of the turn chain: the rest of the turn
    /// filters, then the tool loop. Failures are a [`TurnResult::Error`],
    /// not an `Err`.
    pub fn turn(self, request: &TurnRequest) -> TurnResult {
        turn(request)
    }

    /// As [`Next::turn`], bounded by `timeout_ms`.
    pub fn turn_within(self, request: &TurnRequest, timeout_ms: u32) -> TurnResult {
        turn_within(request, timeout_ms)
    }
}

impl<S: Serialize + DeserializeOwned + Default> Next<S> {
    /// The filter's private context (FCtx) in this invoke.
    pub fn fctx(self) -> Fctx<S> {
        Fctx::new()
    }
}

/// Declares to the host that the error being returned is the failure of
/// call `nth`.
pub(crate) fn pass_on(nth: u32) {
    wit::pass_on(nth);
}
