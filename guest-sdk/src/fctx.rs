//! Typed access to a filter's private context (FCtx).

use std::marker::PhantomData;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::shallot::filter::fctx as raw;

/// A filter's private context for the current invoke, typed.
///
/// The state lives in the host: one per filter per invoke, the same in the
/// filter's around-turn, around-chat and around-tool. Every read sees the
/// latest write, including writes the filter's own inner hooks made while
/// `next` ran; a hook that never touches it pays nothing.
pub struct Fctx<S> {
    state: PhantomData<fn() -> S>,
}

impl<S: Serialize + DeserializeOwned + Default> Fctx<S> {
    pub(crate) fn new() -> Self {
        Fctx { state: PhantomData }
    }

    /// The current state.
    pub fn get(&self) -> S {
        let json = raw::get();
        // The host only hands back JSON this filter produced (its `init` or
        // an earlier `set`), so a mismatch is a bug in the State type: fail
        // loudly rather than lose state.
        serde_json::from_str(&json)
            .unwrap_or_else(|e| panic!("FCtx does not match the filter's State type: {e}"))
    }

    /// Replaces the state.
    pub fn set(&self, state: &S) {
        let json = serde_json::to_string(state)
            .unwrap_or_else(|e| panic!("FCtx state does not serialize: {e}"));
        raw::set(&json).unwrap_or_else(|e| panic!("host refused the FCtx state: {e}"));
    }

    /// Changes the state in place and returns what `change` returns.
    pub fn update<R>(&self, change: impl FnOnce(&mut S) -> R) -> R {
        let mut state = self.get();
        let result = change(&mut state);
        self.set(&state);
        result
    }
}
