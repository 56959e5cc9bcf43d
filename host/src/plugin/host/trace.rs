//! The `trace` import: JSON lines to the sink the operator chose in
//! `grants.trace` (a file or stderr), never one the filter names, with the
//! host's own fields (`ts`, `filter`) that the filter cannot forge.

use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use super::HostState;
use super::granted::{Service, error, not_granted};
use crate::escape;
use crate::plugin::bindings::shallot::filter::trace;
use crate::plugin::bindings::shallot::filter::types as wit;

/// The largest trace event, in bytes.
const TRACE_EVENT_CAP: usize = 64 << 10;
/// Trace events one call may write.
const TRACE_EVENTS_PER_CALL: u32 = 256;
/// Where trace events go: the operator's choice, never the filter's.
pub(crate) enum TraceSink {
    Stderr,
    File(Mutex<std::fs::File>),
}

impl TraceSink {
    pub(super) fn open(path: &Path) -> Result<Self, String> {
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
        let Some(sink) = self.services.trace.clone() else {
            return Ok(Err(not_granted("trace", "trace = \"stderr\"")));
        };
        if let Some(refused) = self.out_of_place(Service::Trace) {
            return Ok(Err(refused));
        }
        self.quotas.trace_events += 1;
        if self.quotas.trace_events > TRACE_EVENTS_PER_CALL {
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
