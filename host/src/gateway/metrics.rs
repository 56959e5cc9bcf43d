//! What `GET /metrics` tells Prometheus: requests by model, outcome and
//! mode, their latency, tokens in and out, requests in progress and
//! waiting, the filters served, and reloads.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::types::Usage;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Request {
    model: String,
    /// `json` or `stream`.
    mode: &'static str,
    /// The HTTP status.
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Model {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Tokens {
    model: String,
    /// `in` (the prompt) or `out` (the answer).
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reload {
    /// `swapped` or `failed`.
    outcome: &'static str,
}

/// The gateway's metrics and their registry.
pub(super) struct Metrics {
    registry: Registry,
    requests: Family<Request, Counter>,
    latency: Family<Model, Histogram>,
    tokens: Family<Tokens, Counter>,
    pub in_progress: Gauge,
    pub waiting: Gauge,
    pub filters: Gauge,
    reloads: Family<Reload, Counter>,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("shallot_gateway");
        let requests = Family::<Request, Counter>::default();
        registry.register(
            "requests",
            "Chat completion requests, by model, mode and HTTP status",
            requests.clone(),
        );
        let latency = Family::<Model, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0005, 2.0, 18))
        });
        registry.register(
            "request_seconds",
            "Time to the response (to its first chunk, for a stream)",
            latency.clone(),
        );
        let tokens = Family::<Tokens, Counter>::default();
        registry.register(
            "tokens",
            "Tokens the model reported, in and out",
            tokens.clone(),
        );
        let in_progress = Gauge::default();
        registry.register(
            "requests_in_progress",
            "Requests being served",
            in_progress.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "requests_waiting",
            "Requests waiting for a place",
            waiting.clone(),
        );
        let filters = Gauge::default();
        registry.register(
            "filters",
            "Filters in the set being served",
            filters.clone(),
        );
        let reloads = Family::<Reload, Counter>::default();
        registry.register(
            "reloads",
            "Reloads of the filter set, by outcome",
            reloads.clone(),
        );
        Metrics {
            registry,
            requests,
            latency,
            tokens,
            in_progress,
            waiting,
            filters,
            reloads,
        }
    }

    /// A request answered with `status` after `seconds`.
    pub fn request(&self, model: &str, stream: bool, status: u16, seconds: f64) {
        let mode = if stream { "stream" } else { "json" };
        let model = model.to_owned();
        self.requests
            .get_or_create(&Request {
                model: model.clone(),
                mode,
                status,
            })
            .inc();
        self.latency
            .get_or_create(&Model { model })
            .observe(seconds);
    }

    /// The tokens one answer used.
    pub fn usage(&self, model: &str, usage: &Usage) {
        for (direction, n) in [("in", usage.input_tokens), ("out", usage.output_tokens)] {
            let labels = Tokens {
                model: model.to_owned(),
                direction,
            };
            self.tokens.get_or_create(&labels).inc_by(n.into());
        }
    }

    pub fn reload(&self, swapped: bool) {
        let outcome = if swapped { "swapped" } else { "failed" };
        self.reloads.get_or_create(&Reload { outcome }).inc();
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String does not fail");
        text
    }
}
