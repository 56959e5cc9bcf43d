//! Typed access to a filter's private context (FCtx).

use serde::Serialize;
use serde::de::DeserializeOwned;

/// A filter's private context for the current invoke, typed.
///
/// The host hands the state in as JSON with each hook call and takes it
/// back afterwards. It is parsed on first access and written back only if
/// [`Fctx::get_mut`] or [`Fctx::set`] was used, so a hook that never looks
/// at its state pays nothing for it.
pub struct Fctx<S> {
    raw: String,
    state: Option<S>,
    changed: bool,
}

impl<S: Serialize + DeserializeOwned + Default> Fctx<S> {
    pub(crate) fn new(raw: String) -> Self {
        Self { raw, state: None, changed: false }
    }

    /// The current state.
    pub fn get(&mut self) -> &S {
        self.load()
    }

    /// The current state, to change. The change is kept for the rest of the
    /// invoke when the hook returns successfully.
    pub fn get_mut(&mut self) -> &mut S {
        self.changed = true;
        self.load()
    }

    /// Replaces the state.
    pub fn set(&mut self, state: S) {
        self.changed = true;
        self.state = Some(state);
    }

    fn load(&mut self) -> &mut S {
        let raw = &self.raw;
        self.state.get_or_insert_with(|| {
            // The host only ever hands back JSON this filter produced (its
            // `init` or an earlier hook's state), so a mismatch is a bug in
            // the filter's State type: fail loudly rather than lose state.
            serde_json::from_str(raw)
                .unwrap_or_else(|e| panic!("FCtx does not match the filter's State type: {e}"))
        })
    }

    /// The state to hand back to the host, `None` when unchanged.
    pub(crate) fn into_changed(self) -> Option<String> {
        match (self.changed, self.state) {
            (true, Some(state)) => Some(
                serde_json::to_string(&state)
                    .unwrap_or_else(|e| panic!("FCtx state does not serialize: {e}")),
            ),
            _ => None,
        }
    }
}
