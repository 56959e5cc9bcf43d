//! The `trace` import: JSON lines to the sink the operator chose in
//! `grants.trace` (a file or stderr), never one the filter names, with the
//! host's own fields (`ts`, `filter`) that the filter cannot forge.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::HostState;
use super::service::{GrantedServices, HOOKS, Service, Spent, error};
use crate::escape;
use crate::plugin::bindings::shallot::filter::trace;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::types::Call;

/// The largest trace event, in bytes.
const TRACE_EVENT_CAP: usize = 64 << 10;
/// Trace events one call may write.
const TRACE_EVENTS_PER_CALL: u32 = 256;
/// Where a filter's `trace` events go, parsed once from the operator's
/// text: `"stderr"`, else a file's path, appended to (created if missing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub enum TraceTarget {
    /// The host's standard error.
    Stderr,
    /// A file, one JSON line per event.
    File(PathBuf),
}

impl From<&str> for TraceTarget {
    fn from(target: &str) -> Self {
        match target {
            "stderr" => TraceTarget::Stderr,
            path => TraceTarget::File(path.into()),
        }
    }
}

impl From<String> for TraceTarget {
    fn from(target: String) -> Self {
        TraceTarget::from(target.as_str())
    }
}

impl From<PathBuf> for TraceTarget {
    fn from(path: PathBuf) -> Self {
        TraceTarget::File(path)
    }
}

impl From<TraceTarget> for String {
    fn from(target: TraceTarget) -> Self {
        target.to_string()
    }
}

impl fmt::Display for TraceTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TraceTarget::Stderr => f.write_str("stderr"),
            TraceTarget::File(path) => write!(f, "{}", path.display()),
        }
    }
}

/// The `trace` service: its grant opens a sink; whom a line is of, the
/// host says (`filter`), never the filter.
pub(crate) struct Trace;

impl Service for Trace {
    const IMPORT: &'static str = "trace";
    const CALLED: &'static str = "trace.write";
    const CALLS: &'static [Call] = HOOKS;
    const GRANT: &'static str = "trace = \"stderr\"";
    type Granted = Arc<TraceSink>;
    /// Events written.
    type Spent = u32;

    fn granted(services: &GrantedServices) -> Option<&Arc<TraceSink>> {
        services.trace.as_ref()
    }

    fn spent(spent: &mut Spent) -> &mut u32 {
        &mut spent.trace
    }
}

/// What `grants.trace` opens: its sink, or why it cannot be.
pub(super) fn open(target: Option<&TraceTarget>) -> Result<Option<Arc<TraceSink>>, String> {
    Ok(match target {
        None => None,
        Some(TraceTarget::Stderr) => Some(Arc::new(TraceSink::Stderr)),
        Some(TraceTarget::File(path)) => Some(Arc::new(TraceSink::open(path)?)),
    })
}

/// Where trace events go: the operator's choice, never the filter's.
pub(crate) enum TraceSink {
    Stderr,
    File(Mutex<std::fs::File>),
}

impl TraceSink {
    fn open(path: &Path) -> Result<Self, String> {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map(|file| TraceSink::File(Mutex::new(file)))
            .map_err(|e| format!("grants.trace: cannot open {}: {e}", path.display()))
    }

    /// Writes one line in one write, so lines of several filters (or
    /// processes appending to one file) never interleave within a line.
    fn write(&self, line: &[u8]) -> std::io::Result<()> {
        match self {
            TraceSink::Stderr => std::io::stderr().lock().write_all(line),
            TraceSink::File(file) => file
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .write_all(line),
        }
    }
}

impl trace::Host for HostState {
    fn write(&mut self, event: String) -> wasmtime::Result<Result<(), wit::FilterError>> {
        let sink = match self.admit::<Trace>() {
            Ok(sink) => sink,
            Err(refused) => return Ok(Err(refused)),
        };
        let events = self.spent::<Trace>();
        *events += 1;
        if *events > TRACE_EVENTS_PER_CALL {
            let message = format!("more than {TRACE_EVENTS_PER_CALL} trace events in one call");
            return Ok(Err(error(wit::ErrorKind::LimitExceeded, message)));
        }
        let over = |bytes: usize| {
            let message =
                format!("a trace event of {bytes} bytes is over the cap of {TRACE_EVENT_CAP}");
            Ok(Err(error(wit::ErrorKind::LimitExceeded, message)))
        };
        if event.len() > TRACE_EVENT_CAP {
            return over(event.len());
        }
        let mut fields = match self.json_object(&event, "a trace event")? {
            Ok(fields) => fields,
            Err(message) => return Ok(Err(error(wit::ErrorKind::InvalidRequest, message))),
        };
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        fields.insert("ts".into(), ts.into());
        fields.insert("filter".into(), self.identity.name.to_string().into());
        // The cap is on the line as written: escaping can make text from
        // the guest six times longer.
        let mut line = escape::json_line(&fields).into_bytes();
        if line.len() > TRACE_EVENT_CAP {
            return over(line.len());
        }
        line.push(b'\n');
        if let Err(e) = sink.write(&line) {
            let message = format!("the trace sink refused the event: {e}");
            return Ok(Err(error(wit::ErrorKind::Transient, message)));
        }
        Ok(Ok(()))
    }
}
