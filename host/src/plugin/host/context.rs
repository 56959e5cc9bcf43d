//! `fctx` and `context`: the filter's private context and the invoke's
//! shared one, both charged to the filter that writes them.

use super::{HostState, json_text};
use crate::context::IDENTITY_KEYS;
use crate::plugin::bindings::shallot::filter::{context, fctx, log};
use crate::sandbox::HostMemoryExceeded;

/// Why a filter may not change identity key `key`.
fn identity(key: &str) -> String {
    format!("'{key}' says whom the invoke is for: filters may read it, not change it")
}

impl fctx::Host for HostState {
    fn get(&mut self) -> wasmtime::Result<String> {
        match &self.scope {
            Some(scope) => Ok(scope
                .invoke
                .fctx(scope.branch.as_deref(), scope.id)
                .to_string()),
            None => Err(wasmtime::Error::msg("fctx.get called outside a hook")),
        }
    }

    fn set(&mut self, state: String) -> wasmtime::Result<Result<(), String>> {
        if let Err(e) = json_text(&state, "the FCtx state") {
            return Ok(Err(e));
        }
        let Some(scope) = &self.scope else {
            return Err(wasmtime::Error::msg("fctx.set called outside a hook"));
        };
        let room = self.limits.host_bytes().saturating_sub(self.held);
        if !scope
            .invoke
            .set_fctx_within(scope.branch.as_deref(), scope.id, state.into(), room)
        {
            return Err(wasmtime::Error::new(HostMemoryExceeded));
        }
        Ok(Ok(()))
    }
}

impl context::Host for HostState {
    fn get(&mut self, key: String) -> wasmtime::Result<Option<String>> {
        Ok(self
            .scope
            .as_ref()
            .and_then(|scope| scope.invoke.context().get_json(&key)))
    }

    fn set(&mut self, key: String, value: String) -> wasmtime::Result<Result<(), String>> {
        if IDENTITY_KEYS.contains(&key.as_str()) {
            return Ok(Err(identity(&key)));
        }
        let value = match self.parse_json(&value, "context value")? {
            Ok(value) => value,
            Err(e) => return Ok(Err(e)),
        };
        let Some(scope) = &self.scope else {
            return Ok(Err("no invoke is in progress".to_owned()));
        };
        let room = self.limits.host_bytes().saturating_sub(self.held);
        match scope
            .invoke
            .write_context(scope.id, &key, Some(value), room)
        {
            Some(before) => {
                // The first write of a key in a call is the one to undo.
                self.journal.entry(key).or_insert(before);
                Ok(Ok(()))
            }
            None => Err(wasmtime::Error::new(HostMemoryExceeded)),
        }
    }

    fn remove(&mut self, key: String) -> wasmtime::Result<()> {
        if IDENTITY_KEYS.contains(&key.as_str()) {
            // As the filter's own log line: capped per call.
            let said = format!("not removed: {}", identity(&key));
            return log::Host::log(self, log::Level::Warn, said);
        }
        if let Some(scope) = &self.scope
            && let Some(before) = scope.invoke.write_context(scope.id, &key, None, usize::MAX)
            && !before.absent()
        {
            self.journal.entry(key).or_insert(before);
        }
        Ok(())
    }

    fn keys(&mut self) -> wasmtime::Result<Vec<String>> {
        Ok(self
            .scope
            .as_ref()
            .map(|scope| scope.invoke.context().keys())
            .unwrap_or_default())
    }
}
