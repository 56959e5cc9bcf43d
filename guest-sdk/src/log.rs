//! Log lines, attributed to the filter by the host (target `shallot::filter`).

pub use crate::bindings::shallot::filter::log::Level;
use crate::bindings::shallot::filter::log::log;

/// Logs `message` at `level`.
pub fn at(level: Level, message: &str) {
    log(level, message)
}

/// Logs at trace level.
pub fn trace(message: &str) {
    log(Level::Trace, message)
}

/// Logs at debug level.
pub fn debug(message: &str) {
    log(Level::Debug, message)
}

/// Logs at info level.
pub fn info(message: &str) {
    log(Level::Info, message)
}

/// Logs at warn level.
pub fn warn(message: &str) {
    log(Level::Warn, message)
}

/// Logs at error level.
pub fn error(message: &str) {
    log(Level::Error, message)
}
