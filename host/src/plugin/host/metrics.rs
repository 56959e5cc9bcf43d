//! `metrics`: the counters and histograms a filter declares, kept in its
//! stats (bounded there) and exported on the gateway's `/metrics`.

use super::HostState;
use super::granted::{Service, error};
use crate::plugin::bindings::shallot::filter::metrics;
use crate::plugin::bindings::shallot::filter::types as wit;
use crate::plugin::metrics::Sample;

impl HostState {
    fn record(
        &mut self,
        name: &str,
        labels: Vec<(String, String)>,
        sample: Sample,
    ) -> Result<(), wit::FilterError> {
        if let Some(refused) = self.out_of_place(Service::Metrics) {
            return Err(refused);
        }
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
