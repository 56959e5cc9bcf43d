//! Typed failures, and the turn result that may carry one.

use crate::bindings::shallot::filter::types as wit;
use crate::{ErrorKind, TurnDone, TurnInterrupt, next};

/// A typed failure: returned by a hook that fails on its own account, and
/// by [`next`](crate::next) when an inner layer failed.
///
/// An error `next` returned, handed back unchanged (with `?` or as a
/// value, cloned or not), keeps its origin: the host reports the filter or
/// terminal that failed. One you build, or change, is your filter's.
#[derive(Debug, Clone)]
pub struct FilterError {
    /// What kind of failure it is.
    pub kind: ErrorKind,
    /// What went wrong, for people.
    pub message: String,
    /// Set on an inner failure: which `next` call returned it, and what it
    /// said then, to tell whether it is handed back unchanged.
    inner: Option<Inner>,
}

#[derive(Debug, Clone)]
struct Inner {
    nth: u32,
    kind: ErrorKind,
    message: String,
}

impl FilterError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        FilterError {
            kind,
            message: message.into(),
            inner: None,
        }
    }

    /// An `invalid-request` error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidRequest, message)
    }

    /// The failure of `next` call `nth`.
    pub(crate) fn inner(error: wit::FilterError, nth: u32) -> Self {
        FilterError {
            inner: Some(Inner {
                nth,
                kind: error.kind,
                message: error.message.clone(),
            }),
            kind: error.kind,
            message: error.message,
        }
    }

    /// Lowers the error a hook returns, first telling the host when it is
    /// an inner failure handed back unchanged.
    pub(crate) fn returned(self) -> wit::FilterError {
        if let Some(inner) = &self.inner
            && inner.kind == self.kind
            && inner.message == self.message
        {
            next::pass_on(inner.nth);
        }
        wit::FilterError {
            kind: self.kind,
            message: self.message,
        }
    }
}

impl From<wit::FilterError> for FilterError {
    /// An error as data (a tool call's recorded failure): not an inner
    /// failure of this hook.
    fn from(error: wit::FilterError) -> Self {
        FilterError::new(error.kind, error.message)
    }
}

/// How a turn ended: a final answer, a pause for approval, or a failure.
pub enum TurnResult {
    /// The turn reached a final answer.
    Done(TurnDone),
    /// The turn paused for a human's approval of tool calls.
    Interrupt(TurnInterrupt),
    /// The turn failed.
    Error(FilterError),
}

impl TurnResult {
    /// The result of `next` call `nth`.
    pub(crate) fn inner(result: wit::TurnResult, nth: u32) -> Self {
        match result {
            wit::TurnResult::Done(done) => TurnResult::Done(done),
            wit::TurnResult::Interrupt(interrupt) => TurnResult::Interrupt(interrupt),
            wit::TurnResult::Error(error) => TurnResult::Error(FilterError::inner(error, nth)),
        }
    }

    /// Lowers the result a hook returns.
    pub(crate) fn returned(self) -> wit::TurnResult {
        match self {
            TurnResult::Done(done) => wit::TurnResult::Done(done),
            TurnResult::Interrupt(interrupt) => wit::TurnResult::Interrupt(interrupt),
            TurnResult::Error(error) => wit::TurnResult::Error(error.returned()),
        }
    }
}
