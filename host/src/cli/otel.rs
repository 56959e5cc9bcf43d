//! OpenTelemetry export of the tracing spans (the `otel` feature): a span
//! per gateway request and one per filter call inside it, sent in batches
//! over OTLP/HTTP (JSON) from a thread of their own, off the request path.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::filter::{FilterExt as _, filter_fn};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::{EnvFilter, Layer};

/// The spans exported unless `SHALLOT_OTEL_FILTER` (an `EnvFilter`
/// directive, like RUST_LOG) says otherwise: requests and filter calls,
/// without log lines, whatever the log level on stderr.
const DEFAULT_FILTER: &str = "shallot=debug";

/// Exports while it lives; flushes what is left when dropped.
pub(crate) struct Export(SdkTracerProvider);

impl Drop for Export {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("warning: OpenTelemetry: the last spans were not sent: {e}");
        }
    }
}

/// The export layer, when an endpoint is configured the standard way
/// (`OTEL_EXPORTER_OTLP_ENDPOINT`, to which `/v1/traces` is added, or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as is; headers, timeout and
/// compression from the other `OTEL_EXPORTER_OTLP_*` variables).
pub(crate) fn layer<S>() -> Option<(impl Layer<S>, Export)>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
{
    let configured = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|name| std::env::var_os(name).is_some_and(|v| !v.is_empty()));
    if !configured {
        return None;
    }
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .build()
    {
        Ok(exporter) => exporter,
        Err(e) => {
            eprintln!("warning: OpenTelemetry: not exporting spans: {e}");
            return None;
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_resource(Resource::builder().with_service_name("shallot").build())
        .with_batch_exporter(exporter)
        .build();
    // An operator's own directive may ask for events (log lines, the
    // filters' included) on the spans; by default only spans go out.
    let chosen = std::env::var("SHALLOT_OTEL_FILTER")
        .ok()
        .and_then(|directive| EnvFilter::try_new(directive).ok());
    let events = chosen.is_some();
    let filter = chosen
        .unwrap_or_else(|| EnvFilter::new(DEFAULT_FILTER))
        .and(filter_fn(move |metadata| events || metadata.is_span()));
    let layer = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("shallot"))
        .with_filter(filter);
    Some((layer, Export(provider)))
}
