//! Why a plugin could not be loaded: one error per way a file, its
//! configuration or its contract can be wrong, each a line that says what
//! to do.

use std::path::{Path, PathBuf};

use super::loader::{WIT_PACKAGE, WIT_VERSION};
use crate::types::ChainError;

/// Why a plugin could not be loaded. Every variant names the file it is
/// about (`path`) and prints as one line that says what to do.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file (or directory) could not be read.
    #[error("{path}: cannot read it: {error}{}", missing_guest_hint(path, error))]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// The operating system's error.
        error: std::io::Error,
    },
    /// The file is empty.
    #[error("{path}: the file is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// The file is not WebAssembly.
    #[error("{path}: not a WebAssembly file (it does not start with \\0asm)")]
    NotWasm {
        /// The file.
        path: PathBuf,
    },
    /// The file is a core module, not a component.
    #[error(
        "{path}: a core WebAssembly module, not a component; build it for the wasm32-wasip2 target \
         (or wrap it with `wasm-tools component new`)"
    )]
    CoreModule {
        /// The file.
        path: PathBuf,
    },
    /// The component is malformed, or the compiler refused it.
    #[error("{path}: not a valid component: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The parser's or compiler's words.
        message: String,
    },
    /// The component was built for another version of the contract.
    #[error(
        "{path}: built for {found}, but this host speaks {WIT_PACKAGE}@{WIT_VERSION}; rebuild it against this version of shallot-guest"
    )]
    WrongVersion {
        /// The file.
        path: PathBuf,
        /// The package and version it was built for.
        found: String,
    },
    /// The component is not a filter (it exports no `plugin` interface).
    #[error(
        "{path}: not a shallot filter: it exports {exports}; a filter exports {WIT_PACKAGE}/plugin@{WIT_VERSION} (see the shallot-guest crate)"
    )]
    NotAFilter {
        /// The file.
        path: PathBuf,
        /// What it exports instead.
        exports: String,
    },
    /// The component imports something the host does not give filters.
    #[error(
        "{path}: needs an import shallot does not provide (filters get no filesystem, network or other host APIs): {message}"
    )]
    UnknownImport {
        /// The file.
        path: PathBuf,
        /// The linker's words, naming the import.
        message: String,
    },
    /// The file is past a bound checked before compiling (size, functions,
    /// code per function, locals, nesting).
    #[error("{path}: refused before compiling: {message}")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Which bound, and by how much.
        message: String,
    },
    /// The compile went past its memory cap or its deadline.
    #[error("{path}: refused while compiling: {message}")]
    CompileLimit {
        /// The file.
        path: PathBuf,
        /// Which limit.
        message: String,
    },
    /// The filter failed to instantiate, configure or describe itself.
    #[error("{path}: {error}{}", configured_in.as_ref().map(|at| format!(" (configured in {at})")).unwrap_or_default())]
    Filter {
        /// The plugin file.
        path: PathBuf,
        /// The filter's error, naming it and the call.
        error: Box<ChainError>,
        /// Where its configuration came from, if it came from a file.
        configured_in: Option<String>,
    },
    /// The filter's limits are not usable.
    #[error("{path}: invalid limits: {message}")]
    Limits {
        /// The plugin file.
        path: PathBuf,
        /// Which limit, and its allowed range.
        message: String,
    },
    /// Two filters have the same name.
    #[error("two filters are named '{name}'; give one a different `name` in shallot.toml")]
    DuplicateName {
        /// The name.
        name: String,
    },
    /// A configuration file (a `shallot.toml` or a sidecar) is wrong.
    #[error("{path}: {message}")]
    Config {
        /// The configuration file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// For a missing file where guests are built: how to build them.
fn missing_guest_hint(path: &Path, error: &std::io::Error) -> &'static str {
    let in_guests = path.components().any(|c| c.as_os_str() == "wasm32-wasip2");
    if error.kind() == std::io::ErrorKind::NotFound && in_guests {
        " (build the guests first: `rustup target add wasm32-wasip2 && cargo build-guests`, and `scripts/build-polyglot` for the Python and JavaScript ones)"
    } else {
        ""
    }
}
