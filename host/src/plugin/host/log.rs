//! `log`: a filter's log lines, attributed to it, capped per call and made
//! printable.

use super::HostState;
use crate::escape::{self, TEXT_CAP};
use crate::plugin::bindings::shallot::filter::log;

/// Log lines one call may write; later ones are dropped.
const LOG_LINES_PER_CALL: u32 = 256;

impl log::Host for HostState {
    fn log(&mut self, level: log::Level, message: String) -> wasmtime::Result<()> {
        self.spent.log_lines += 1;
        let filter = &*self.identity.name;
        if self.spent.log_lines > LOG_LINES_PER_CALL {
            if self.spent.log_lines == LOG_LINES_PER_CALL + 1 {
                tracing::warn!(
                    target: "shallot::filter",
                    filter,
                    "more than {LOG_LINES_PER_CALL} log lines in one call; the rest of this call's are dropped"
                );
            }
            return Ok(());
        }
        let message = escape::printable(&message, TEXT_CAP);
        match level {
            log::Level::Trace => tracing::trace!(target: "shallot::filter", filter, "{message}"),
            log::Level::Debug => tracing::debug!(target: "shallot::filter", filter, "{message}"),
            log::Level::Info => tracing::info!(target: "shallot::filter", filter, "{message}"),
            log::Level::Warn => tracing::warn!(target: "shallot::filter", filter, "{message}"),
            log::Level::Error => tracing::error!(target: "shallot::filter", filter, "{message}"),
        }
        Ok(())
    }
}
