//! What each wasm filter did, for metrics (the gateway's `/metrics`) and
//! for embedders: calls and the filter's own CPU time by call, its own
//! errors by call and kind, and the tokens through its transformer.
//! Counted with relaxed atomics on the hot path; read as a snapshot.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::metrics::{FilterMetric, Metrics};
use crate::types::{Call, ErrorKind};

/// The calls counted, in the order of [`Stats`]'s arrays.
const CALLS: [Call; 10] = [
    Call::AroundChat,
    Call::AroundTool,
    Call::AroundTurn,
    Call::SystemPrompt,
    Call::TokenTransform,
    Call::Step,
    Call::Flush,
    Call::Configure,
    Call::Describe,
    Call::Instantiate,
];

/// The error kinds counted, in the order of [`Stats`]'s arrays.
const KINDS: [ErrorKind; 9] = [
    ErrorKind::Transient,
    ErrorKind::Timeout,
    ErrorKind::ContentFiltered,
    ErrorKind::InvalidRequest,
    ErrorKind::Auth,
    ErrorKind::NotFound,
    ErrorKind::LimitExceeded,
    ErrorKind::PluginFault,
    ErrorKind::Internal,
];

/// Upper bounds of the own-time buckets, in seconds: 1 µs to ~0.5 s, ×4.
pub const OWN_TIME_BUCKETS: [f64; 10] = [
    1e-6, 4e-6, 1.6e-5, 6.4e-5, 2.56e-4, 1.024e-3, 4.096e-3, 1.6384e-2, 6.5536e-2, 2.62144e-1,
];

fn call_index(call: Call) -> Option<usize> {
    CALLS.iter().position(|c| *c == call)
}

fn kind_index(kind: ErrorKind) -> usize {
    KINDS
        .iter()
        .position(|k| *k == kind)
        .unwrap_or(KINDS.len() - 1)
}

/// The live counters of one filter.
#[derive(Default, Debug)]
pub(crate) struct Stats {
    calls: [AtomicU64; CALLS.len()],
    own_nanos: [AtomicU64; CALLS.len()],
    /// Per call: how many fell in each bucket (not cumulative); the last
    /// is above every bound.
    buckets: [[AtomicU64; OWN_TIME_BUCKETS.len() + 1]; CALLS.len()],
    errors: [[AtomicU64; KINDS.len()]; CALLS.len()],
    tokens_in: AtomicU64,
    tokens_out: AtomicU64,
    /// The metrics the filter declared.
    pub(crate) metrics: Metrics,
}

impl Stats {
    /// A call into the filter ended, having run `own` of its own CPU time.
    pub(crate) fn called(&self, call: Call, own: Duration) {
        let Some(i) = call_index(call) else { return };
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(own.as_nanos()).unwrap_or(u64::MAX);
        self.own_nanos[i].fetch_add(nanos, Ordering::Relaxed);
        let seconds = own.as_secs_f64();
        let bucket = OWN_TIME_BUCKETS
            .iter()
            .position(|bound| seconds <= *bound)
            .unwrap_or(OWN_TIME_BUCKETS.len());
        self.buckets[i][bucket].fetch_add(1, Ordering::Relaxed);
    }

    /// The filter failed a call on its own account (its error, or a fault).
    pub(crate) fn failed(&self, call: Call, kind: ErrorKind) {
        if let Some(i) = call_index(call) {
            self.errors[i][kind_index(kind)].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Tokens into and out of one step or flush of its transformer.
    pub(crate) fn tokens(&self, into: usize, out: usize) {
        self.tokens_in.fetch_add(into as u64, Ordering::Relaxed);
        self.tokens_out.fetch_add(out as u64, Ordering::Relaxed);
    }

    /// A snapshot of the calls made so far.
    pub(crate) fn calls(&self) -> Vec<CallStats> {
        CALLS
            .iter()
            .enumerate()
            .filter_map(|(i, &call)| {
                let count = self.calls[i].load(Ordering::Relaxed);
                let errors: Vec<(ErrorKind, u64)> = KINDS
                    .iter()
                    .enumerate()
                    .map(|(k, &kind)| (kind, self.errors[i][k].load(Ordering::Relaxed)))
                    .filter(|(_, n)| *n > 0)
                    .collect();
                if count == 0 && errors.is_empty() {
                    return None;
                }
                let buckets = OWN_TIME_BUCKETS
                    .iter()
                    .chain([&f64::MAX])
                    .enumerate()
                    .map(|(b, bound)| (*bound, self.buckets[i][b].load(Ordering::Relaxed)))
                    .collect();
                Some(CallStats {
                    call,
                    count,
                    own_seconds: self.own_nanos[i].load(Ordering::Relaxed) as f64 / 1e9,
                    own_seconds_buckets: buckets,
                    errors,
                })
            })
            .collect()
    }

    /// Tokens into and out of the filter's transformers so far.
    pub(crate) fn token_counts(&self) -> (u64, u64) {
        (
            self.tokens_in.load(Ordering::Relaxed),
            self.tokens_out.load(Ordering::Relaxed),
        )
    }
}

/// What a filter did in one kind of call, so far.
#[derive(Debug, Clone, PartialEq)]
pub struct CallStats {
    /// Which call.
    pub call: Call,
    /// Calls that ended (faulted ones included).
    pub count: u64,
    /// The filter's own CPU time in them, in seconds (inner layers and
    /// time suspended excluded).
    pub own_seconds: f64,
    /// Calls by own time: each bound of [`OWN_TIME_BUCKETS`], then
    /// `f64::MAX` (Prometheus's `+Inf`), with the calls above the bound
    /// before it and at most this one (per bucket, not cumulative).
    pub own_seconds_buckets: Vec<(f64, u64)>,
    /// The filter's own failures, by kind (inner failures it passed on are
    /// not its own).
    pub errors: Vec<(ErrorKind, u64)>,
}

/// What a filter did so far: [`crate::WasmFilter::stats`].
#[derive(Debug, Clone, PartialEq)]
pub struct FilterStats {
    /// The filter's name.
    pub name: String,
    /// By kind of call, those it was called for.
    pub calls: Vec<CallStats>,
    /// Tokens its transformers took in.
    pub tokens_in: u64,
    /// Tokens its transformers emitted.
    pub tokens_out: u64,
    /// Instances ready for the next invoke (prepared ahead, or warm).
    pub instances_ready: usize,
    /// Instances in use by invokes now.
    pub instances_in_use: usize,
    /// The metrics it declared (the `metrics` import), by name.
    pub metrics: Vec<FilterMetric>,
}
