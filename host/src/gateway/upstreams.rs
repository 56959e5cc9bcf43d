//! The health of the upstreams behind the routes served, for `/metrics`
//! (read at each scrape) and `/readyz`: each upstream of a route that
//! balances several, whether it is healthy, whether it rests, its
//! requests, failures and cooldowns.

use std::sync::{Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use serde_json::{Value, json};

use super::Route;
use super::metrics::family;
use crate::model::UpstreamHealth;

/// The routes being served, by model name, for their upstreams' health.
#[derive(Default)]
pub(super) struct ServedUpstreams(Mutex<Vec<Route>>);

impl std::fmt::Debug for ServedUpstreams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the upstreams served")
    }
}

impl ServedUpstreams {
    /// Serves `routes` from now on.
    pub fn set(&self, routes: &[Route]) {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = routes.to_vec();
    }
}

/// A route's upstreams as `/readyz` lists them.
pub(super) fn ready(route: &Route) -> Vec<Value> {
    route
        .kernel
        .upstreams()
        .iter()
        .map(|u| {
            json!({
                "name": u.name,
                "weight": u.weight,
                "healthy": u.healthy,
                "resting_ms": u.resting.map(|left| left.as_millis() as u64),
                "requests": u.requests,
                "failures": u.failures,
                "cooldowns": u.cooldowns,
            })
        })
        .collect()
}

impl Collector for ServedUpstreams {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let health: Vec<(Vec<(&'static str, String)>, UpstreamHealth)> = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .flat_map(|route| {
                route.kernel.upstreams().into_iter().map(|upstream| {
                    let labels = vec![
                        ("model", route.model.clone()),
                        ("upstream", upstream.name.clone()),
                    ];
                    (labels, upstream)
                })
            })
            .collect();
        let gauges = [
            (
                "upstream_healthy",
                "Whether each upstream's last request succeeded (1) or failed (0)",
                (|u: &UpstreamHealth| u.healthy) as fn(&UpstreamHealth) -> bool,
            ),
            (
                "upstream_resting",
                "Whether each upstream rests (1), failing too often, and gets no requests while another can take them",
                |u: &UpstreamHealth| u.resting.is_some(),
            ),
        ];
        for (name, help, value) in gauges {
            let rows = health
                .iter()
                .map(|(labels, u)| (labels.clone(), ConstGauge::new(i64::from(value(u)))));
            family(&mut encoder, (name, help, MetricType::Gauge), rows)?;
        }
        let counters = [
            (
                "upstream_requests",
                "Requests sent to each upstream",
                (|u: &UpstreamHealth| u.requests) as fn(&UpstreamHealth) -> u64,
            ),
            (
                "upstream_failures",
                "Requests each upstream failed in a way another could answer (and that went to the next one)",
                |u: &UpstreamHealth| u.failures,
            ),
            (
                "upstream_cooldowns",
                "Times each upstream was set to rest",
                |u: &UpstreamHealth| u.cooldowns,
            ),
        ];
        for (name, help, value) in counters {
            let rows = health
                .iter()
                .map(|(labels, u)| (labels.clone(), ConstCounter::new(value(u))));
            family(&mut encoder, (name, help, MetricType::Counter), rows)?;
        }
        Ok(())
    }
}
