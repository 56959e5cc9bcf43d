//! The typed signals a blown budget or cap raises inside wasmtime, and how
//! an error from a call into a guest becomes a `ChainError`.

use crate::escape::{TEXT_CAP, printable};
use crate::types::{ChainError, ErrorKind, Origin};

use super::limiter::TABLE_ELEMENTS;
use super::{Confinement, HANDLES, Limits};

/// The filter's own CPU budget for one call ran out.
#[derive(Debug)]
pub(crate) struct CpuExceeded;

/// The filter's own wall-clock bound for one call ran out.
#[derive(Debug)]
pub(crate) struct WallExceeded;

/// The filter's tables grew past their cap.
#[derive(Debug)]
pub(crate) struct TablesExceeded;

/// The filter made the host hold more than its host memory cap.
#[derive(Debug)]
pub(crate) struct HostMemoryExceeded;

macro_rules! signals {
    ($($ty:ident => $text:literal),* $(,)?) => {$(
        impl std::fmt::Display for $ty {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str($text)
            }
        }
        impl std::error::Error for $ty {}
    )*};
}

signals! {
    CpuExceeded => "CPU budget exceeded",
    WallExceeded => "wall-clock bound exceeded",
    TablesExceeded => "table cap exceeded",
    HostMemoryExceeded => "host memory cap exceeded",
}

/// Turns a wasmtime error from a call into the guest into a typed error:
/// a budget or a cap (by its typed signal), a trap, or a contract
/// violation. What the guest wrote to stderr in this call is appended.
pub(crate) fn fault(
    error: wasmtime::Error,
    confinement: &Confinement,
    limits: &Limits,
    origin: Origin,
) -> ChainError {
    let (kind, message) = if error.is::<CpuExceeded>() {
        let message = format!("exceeded its CPU budget of {} ms", limits.cpu_ms);
        (ErrorKind::PluginFault, message)
    } else if error.is::<WallExceeded>() {
        let message = format!(
            "did not finish within its own wall-clock bound of {} ms (it slept or waited)",
            limits.wall_ms
        );
        (ErrorKind::Timeout, message)
    } else if confinement.limiter.denied {
        let message = format!("exceeded its memory cap of {} MiB", limits.memory_mib);
        (ErrorKind::PluginFault, message)
    } else if error.is::<HostMemoryExceeded>() {
        let message = format!("exceeded its host memory cap of {} MiB", limits.host_mib);
        (ErrorKind::PluginFault, message)
    } else if error.is::<TablesExceeded>() {
        let message = format!("grew its tables past {TABLE_ELEMENTS} elements");
        (ErrorKind::PluginFault, message)
    } else if matches!(
        error.downcast_ref::<wasmtime::component::ResourceTableError>(),
        Some(wasmtime::component::ResourceTableError::Full)
    ) {
        let message = format!("held more than {HANDLES} handles at once");
        (ErrorKind::PluginFault, message)
    } else if let Some(trap) = error.downcast_ref::<wasmtime::Trap>() {
        (ErrorKind::PluginFault, format!("trapped: {trap}"))
    } else {
        let message = format!(
            "failed: {}",
            printable(&error.root_cause().to_string(), TEXT_CAP)
        );
        (ErrorKind::PluginFault, message)
    };
    // What the guest wrote is the operator's to read, not a client's or
    // another filter's; where it trapped, only the log's.
    if let Some(trace) = error.downcast_ref::<wasmtime::WasmBacktrace>() {
        tracing::debug!(filter = &*origin.filter, "{message}: {trace}");
    }
    let detail = confinement
        .stderr
        .text()
        .map(|said| format!("it wrote: {said}"));
    ChainError {
        detail,
        ..ChainError::new(kind, message).at(origin)
    }
}

/// The error for a hook call that outlived its `timeout_ms`.
pub(crate) fn timed_out(limits: &Limits, origin: Origin) -> ChainError {
    ChainError::new(
        ErrorKind::Timeout,
        format!("did not finish within {} ms", limits.timeout_ms),
    )
    .at(origin)
}
