//! `metrics`: the counters and histograms a filter declares, kept in its
//! stats (bounded there) and exported on the gateway's `/metrics`.

use super::HostState;
use super::service::{GrantedServices, HOOKS, Service, Spent, error};
use crate::plugin::bindings::shallot::filter::metrics;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::metrics::Sample;
use crate::types::Call;

/// The `metrics` service: no grant (a filter's metrics are its own, under
/// its name, bounded in the filter's stats).
pub(crate) struct Metrics;

impl Service for Metrics {
    const IMPORT: &'static str = "metrics";
    const CALLED: &'static str = "metrics";
    const CALLS: &'static [Call] = HOOKS;
    const GRANT: &'static str = "";
    type Granted = ();
    type Spent = ();

    fn granted(_: &GrantedServices) -> Option<&()> {
        Some(&())
    }

    fn spent(spent: &mut Spent) -> &mut () {
        &mut spent.metrics
    }
}

impl HostState {
    fn record(
        &mut self,
        name: &str,
        labels: Vec<(String, String)>,
        sample: Sample,
    ) -> Result<(), wit::FilterError> {
        self.admit::<Metrics>()?;
        self.identity
            .stats
            .metrics
            .record(name, labels, sample)
            .map_err(|why| error(wit::ErrorKind::InvalidRequest, why))
    }
}

impl metrics::Host for HostState {
    fn count(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
        value: u64,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        Ok(self.record(&name, labels, Sample::Count(value)))
    }

    fn observe(
        &mut self,
        name: String,
        labels: Vec<(String, String)>,
        value: f64,
    ) -> wasmtime::Result<Result<(), wit::FilterError>> {
        Ok(self.record(&name, labels, Sample::Observe(value)))
    }
}
