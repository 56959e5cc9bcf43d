//! What `GET /metrics` tells Prometheus: requests by model, outcome and
//! mode, their latency, tokens in and out, requests in progress and
//! waiting, client connections open, the filters served, and reloads; and per filter of the set
//! being served, its calls, own CPU time and own errors by call, tokens
//! through its transformer, and its instances ready and in use.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

use std::sync::{Arc, Mutex, PoisonError};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

use super::upstreams::ServedUpstreams;
use crate::plugin::{
    CallStats, FilterMetric, FilterStats, HISTOGRAM_BUCKETS, MetricKind, MetricValue, WasmFilter,
};
use crate::types::Usage;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Request {
    model: String,
    /// `json`, `stream` or `embeddings`.
    mode: &'static str,
    /// The HTTP status.
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Model {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Broken {
    model: String,
    /// The status the error would have had before the stream started.
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Tokens {
    model: String,
    /// `in` (the prompt) or `out` (the answer).
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kept {
    model: String,
    /// `kept` or `failed`.
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reload {
    /// `swapped` or `failed`.
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct McpCall {
    tool: String,
    /// `ok`, `error` (the result is an error) or `refused` (a tool the
    /// key may not call, or no place for the call).
    outcome: &'static str,
}

/// Labels of a per-filter metric.
type Labels = Vec<(&'static str, String)>;

fn labels(filter: &FilterStats, more: &[(&'static str, &str)]) -> Labels {
    let mut labels = vec![("filter", filter.name.clone())];
    labels.extend(more.iter().map(|(k, v)| (*k, (*v).to_owned())));
    labels
}

/// Writes one metric family of constant values.
pub(super) fn family<M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    (name, help, kind): (&str, &str, MetricType),
    rows: impl IntoIterator<Item = (Labels, M)>,
) -> Result<(), std::fmt::Error> {
    let mut family = encoder.encode_descriptor(name, help, None, kind)?;
    for (labels, value) in rows {
        value.encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

/// The filters of the set being served, read at each scrape.
#[derive(Default)]
pub(super) struct ServedFilters(Mutex<Vec<Arc<WasmFilter>>>);

impl std::fmt::Debug for ServedFilters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the filters served")
    }
}

impl ServedFilters {
    /// Serves `filters` from now on (each once, though routes share them).
    pub fn set<'a>(&self, filters: impl Iterator<Item = &'a Arc<WasmFilter>>) {
        let mut unique: Vec<Arc<WasmFilter>> = Vec::new();
        for filter in filters {
            if !unique.iter().any(|f| Arc::ptr_eq(f, filter)) {
                unique.push(filter.clone());
            }
        }
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = unique;
    }
}

impl Collector for ServedFilters {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats: Vec<FilterStats> = self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|f| f.stats())
            .collect();
        let calls = || {
            stats.iter().flat_map(|filter| {
                let call = |c: &CallStats| labels(filter, &[("call", c.call.as_str())]);
                filter.calls.iter().map(move |c| (call(c), c))
            })
        };
        family(
            &mut encoder,
            (
                "filter_calls",
                "Calls into each filter served, by call (hook, token step, ...)",
                MetricType::Counter,
            ),
            calls().map(|(labels, c)| (labels, ConstCounter::new(c.count))),
        )?;
        let mut own = encoder.encode_descriptor(
            "filter_own_seconds",
            "Each filter's own CPU time per call (inner layers excluded)",
            None,
            MetricType::Histogram,
        )?;
        for (labels, call) in calls() {
            own.encode_family(&labels)?.encode_histogram::<NoLabelSet>(
                call.own_seconds,
                call.count,
                &call.own_seconds_buckets,
                None,
            )?;
        }
        family(
            &mut encoder,
            (
                "filter_errors",
                "Each filter's own failures (faults included, inner failures it passed on not), by call and kind",
                MetricType::Counter,
            ),
            calls().flat_map(|(labels, call)| {
                call.errors.iter().map(move |(kind, n)| {
                    let mut labels = labels.clone();
                    labels.push(("kind", kind.as_str().to_owned()));
                    (labels, ConstCounter::new(*n))
                })
            }),
        )?;
        encode_tokens_and_instances(&stats, &mut encoder)?;
        encode_declared(&stats, &mut encoder)
    }
}

/// A label value as the text exposition writes it: `\`, `"` and line
/// feeds escaped (prometheus-client writes values as they are), so no
/// value a filter gives can end its line or forge another.
fn escaped(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A filter's name in a metric family's name: its `-` as `_`. A name is
/// a-z and 0-9 in runs joined by single `-` (the loader sees to it), so
/// this has no `__` and no `_` at either end.
fn family_part(name: &str) -> String {
    name.replace('-', "_")
}

/// The metrics each filter declared, each a family
/// `plugin_<filter>__<metric>` labelled with the filter's name and its own
/// labels. Neither part has a `__` (a metric's name has none either), so
/// no two filters' metrics are one family, however their names begin.
/// The same filter twice (a set served by several routes) is one.
fn encode_declared(
    stats: &[FilterStats],
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    let mut named = std::collections::HashSet::new();
    for filter in stats {
        for metric in &filter.metrics {
            let name = format!("plugin_{}__{}", family_part(&filter.name), metric.name);
            if named.insert(name.clone()) {
                encode_metric(encoder, &name, &filter.name, metric)?;
            }
        }
    }
    Ok(())
}

fn encode_metric(
    encoder: &mut DescriptorEncoder,
    name: &str,
    filter: &str,
    metric: &FilterMetric,
) -> Result<(), std::fmt::Error> {
    let help = format!("Declared by the filter {}", family_part(filter));
    let kind = match metric.kind {
        MetricKind::Counter => MetricType::Counter,
        MetricKind::Histogram => MetricType::Histogram,
    };
    let mut family = encoder.encode_descriptor(name, &help, None, kind)?;
    for (values, value) in &metric.series {
        let mut labels = vec![("filter".to_owned(), escaped(filter))];
        labels.extend(
            metric
                .labels
                .iter()
                .cloned()
                .zip(values.iter().map(|v| escaped(v))),
        );
        let mut series = family.encode_family(&labels)?;
        match value {
            MetricValue::Counter(n) => ConstCounter::new(*n).encode(series)?,
            MetricValue::Histogram {
                sum,
                count,
                buckets,
            } => {
                let bounds = HISTOGRAM_BUCKETS.iter().chain([&f64::MAX]);
                let buckets: Vec<(f64, u64)> =
                    bounds.copied().zip(buckets.iter().copied()).collect();
                series.encode_histogram::<NoLabelSet>(*sum, *count, &buckets, None)?;
            }
        }
    }
    Ok(())
}

/// The per-filter token counts and instance gauges.
fn encode_tokens_and_instances(
    stats: &[FilterStats],
    encoder: &mut DescriptorEncoder,
) -> Result<(), std::fmt::Error> {
    family(
        encoder,
        (
            "filter_tokens",
            "Tokens into and out of each filter's token transformers",
            MetricType::Counter,
        ),
        stats.iter().flat_map(|f| {
            [("in", f.tokens_in), ("out", f.tokens_out)].map(|(direction, n)| {
                (labels(f, &[("direction", direction)]), ConstCounter::new(n))
            })
        }),
    )?;
    family(
        encoder,
        (
            "filter_instances",
            "Each filter's instances, ready for the next invoke or in use now",
            MetricType::Gauge,
        ),
        stats.iter().flat_map(|f| {
            [("ready", f.instances_ready), ("in_use", f.instances_in_use)]
                .map(|(state, n)| (labels(f, &[("state", state)]), ConstGauge::new(n as i64)))
        }),
    )
}

/// Registers `metric` under `name` and gives it back.
fn registered<M: Metric + Clone>(registry: &mut Registry, name: &str, help: &str, metric: M) -> M {
    registry.register(name, help, metric.clone());
    metric
}

/// The gateway's metrics and their registry.
pub(super) struct Metrics {
    registry: Registry,
    requests: Family<Request, Counter>,
    broken: Family<Broken, Counter>,
    latency: Family<Model, Histogram>,
    tokens: Family<Tokens, Counter>,
    pub in_progress: Gauge,
    pub waiting: Gauge,
    pub filters: Gauge,
    pub connections: Gauge,
    reloads: Family<Reload, Counter>,
    mcp_calls: Family<McpCall, Counter>,
    kept: Family<Kept, Counter>,
    /// The filters of the set being served, for the per-filter metrics.
    pub served: Arc<ServedFilters>,
    /// The routes being served, for their upstreams' health.
    pub upstreams: Arc<ServedUpstreams>,
}

/// The gauges of what is served at once: requests in progress, waiting
/// for a place, filters, connections.
fn gauges(registry: &mut Registry) -> [Gauge; 4] {
    [
        ("requests_in_progress", "Requests being served"),
        ("requests_waiting", "Requests waiting for a place"),
        ("filters", "Filters in the set being served"),
        ("connections", "Client connections open"),
    ]
    .map(|(name, help)| registered(registry, name, help, Gauge::default()))
}

/// A histogram of request times: from half a millisecond, doubling.
fn latency_buckets() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 18))
}

/// `registry` with the per-filter and per-upstream collectors.
fn collecting(
    mut registry: Registry,
    served: &Arc<ServedFilters>,
    upstreams: &Arc<ServedUpstreams>,
) -> Registry {
    registry.register_collector(Box::new(served.clone()));
    registry.register_collector(Box::new(upstreams.clone()));
    registry
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("shallot_gateway");
        let [in_progress, waiting, filters, connections] = gauges(&mut registry);
        let served = Arc::new(ServedFilters::default());
        let upstreams = Arc::new(ServedUpstreams::default());
        Metrics {
            requests: registered(
                &mut registry,
                "requests",
                "Requests of the APIs (chat, embeddings, MCP), by model, mode (json, stream, embeddings, mcp) and HTTP status",
                Family::<Request, Counter>::default(),
            ),
            broken: registered(
                &mut registry,
                "stream_errors",
                "Streams that started (counted as requests with status 200) and ended with an error event, by model and the error's status",
                Family::<Broken, Counter>::default(),
            ),
            latency: registered(
                &mut registry,
                "request_seconds",
                "Time to the response (to its first chunk, for a stream)",
                Family::<Model, Histogram>::new_with_constructor(latency_buckets),
            ),
            tokens: registered(
                &mut registry,
                "tokens",
                "Tokens the model reported, in and out",
                Family::<Tokens, Counter>::default(),
            ),
            in_progress,
            waiting,
            filters,
            connections,
            reloads: registered(
                &mut registry,
                "reloads",
                "Reloads of the filter set, by outcome",
                Family::<Reload, Counter>::default(),
            ),
            mcp_calls: registered(
                &mut registry,
                "mcp_calls",
                "tools/call requests of /mcp, by tool and outcome (ok, error, refused)",
                Family::<McpCall, Counter>::default(),
            ),
            kept: registered(
                &mut registry,
                "responses_kept",
                "Responses API answers to be kept (store), by model and outcome (kept, failed: delivered with store false)",
                Family::<Kept, Counter>::default(),
            ),
            registry: collecting(registry, &served, &upstreams),
            served,
            upstreams,
        }
    }

    /// An answer of `model` to be kept, and whether it was.
    pub fn kept(&self, model: &str, kept: bool) {
        let outcome = if kept { "kept" } else { "failed" };
        let model = model.to_owned();
        self.kept.get_or_create(&Kept { model, outcome }).inc();
    }

    /// A `tools/call` of `/mcp` that ended as `outcome`; a tool the key may
    /// not call is counted without its name (a client picks the names).
    pub fn mcp_call(&self, tool: &str, outcome: &'static str) {
        let tool = tool.to_owned();
        self.mcp_calls
            .get_or_create(&McpCall { tool, outcome })
            .inc();
    }

    /// A request answered with `status` after `seconds`, in `mode`
    /// (`json`, `stream`, `embeddings`, `mcp`).
    pub fn request(&self, model: &str, mode: &'static str, status: u16, seconds: f64) {
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

    /// A stream of `model` that ended with an error of `status`.
    pub fn stream_error(&self, model: &str, status: u16) {
        let model = model.to_owned();
        self.broken.get_or_create(&Broken { model, status }).inc();
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
