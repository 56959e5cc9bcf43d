//! The counters and histograms a filter declares (the `metrics` import),
//! kept per filter beside its [`Stats`](super::stats::Stats) and exported
//! on the gateway's `/metrics`. Bounded so that a filter cannot blow up
//! the exposition: 32 metrics, 4 labels and 64 series (sets of label
//! values) a metric, label values of 64 bytes; the samples of a series
//! past the cap count in one whose values are all `other`.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

/// Metrics one filter may declare.
pub(crate) const METRICS_CAP: usize = 32;
/// Labels one metric may have.
pub(crate) const LABELS_CAP: usize = 4;
/// Series (sets of label values) one metric may have, the overflow
/// series included.
pub(crate) const SERIES_CAP: usize = 64;
/// The longest label value, in bytes; a longer one is cut.
pub(crate) const LABEL_VALUE_CAP: usize = 64;
/// The longest metric or label name, in bytes.
const NAME_CAP: usize = 48;
/// The value of every label of the series that takes the samples past
/// [`SERIES_CAP`].
pub(crate) const OVERFLOW: &str = "other";

/// The upper bounds of a filter histogram's buckets (Prometheus's default).
pub const HISTOGRAM_BUCKETS: [f64; 11] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// What a metric is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    /// Only goes up.
    Counter,
    /// Samples in [`HISTOGRAM_BUCKETS`].
    Histogram,
}

/// A sample of a metric: what `count` or `observe` gives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Sample {
    /// Added to a counter.
    Count(u64),
    /// Recorded in a histogram.
    Observe(f64),
}

impl Sample {
    fn kind(self) -> MetricKind {
        match self {
            Sample::Count(_) => MetricKind::Counter,
            Sample::Observe(_) => MetricKind::Histogram,
        }
    }
}

/// One series' value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetricValue {
    /// A counter's total.
    Counter(u64),
    /// A histogram: the sum and count of its samples, and how many fell in
    /// each bucket of [`HISTOGRAM_BUCKETS`] and above them (per bucket, not
    /// cumulative).
    Histogram {
        /// The samples' sum.
        sum: f64,
        /// How many samples.
        count: u64,
        /// Samples per bucket.
        buckets: Vec<u64>,
    },
}

/// A metric a filter declared, as it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct FilterMetric {
    /// Its name.
    pub name: String,
    /// A counter or a histogram.
    pub kind: MetricKind,
    /// Its label names, sorted.
    pub labels: Vec<String>,
    /// Each series: its label values (in the order of `labels`) and value.
    pub series: Vec<(Vec<String>, MetricValue)>,
}

#[derive(Debug)]
struct Declared {
    kind: MetricKind,
    labels: Vec<String>,
    series: BTreeMap<Vec<String>, MetricValue>,
}

/// A filter's metrics.
#[derive(Debug, Default)]
pub(crate) struct Metrics(Mutex<BTreeMap<String, Declared>>);

/// Label names the exposition gives a meaning of its own: the filter's
/// name (`filter`), a histogram's bucket (`le`), a summary's quantile.
/// A label named so would make a sample with one label twice, and a
/// Prometheus server refuses the whole scrape for it.
const RESERVED_LABELS: [&str; 3] = ["filter", "le", "quantile"];

/// Endings the exposition gives the samples of a family (a counter's
/// `_total`, a histogram's `_bucket`, `_sum` and `_count`, OpenMetrics'
/// `_created` and `_info`): a metric named with one could be taken for a
/// sample of another.
const RESERVED_ENDINGS: [&str; 6] = ["_total", "_bucket", "_sum", "_count", "_created", "_info"];

fn check_name(name: &str, what: &str) -> Result<(), String> {
    let mut bytes = name.bytes();
    let ok = bytes.next().is_some_and(|b| b.is_ascii_lowercase())
        && bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && name.len() <= NAME_CAP
        && !name.contains("__")
        && !name.ends_with('_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} `{}` must be 1 to {NAME_CAP} of a-z, 0-9 and single _, starting with a letter and not ending with _",
            crate::escape::printable(name, 64)
        ))
    }
}

/// A label value as kept: at most [`LABEL_VALUE_CAP`] bytes, cut on a
/// character boundary.
fn cut(value: &str) -> String {
    let mut end = value.len().min(LABEL_VALUE_CAP);
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    value[..end].to_owned()
}

/// `name` and `labels` checked as a sample's, the labels sorted by name
/// and their values cut: the label names and values.
fn checked(
    name: &str,
    mut labels: Vec<(String, String)>,
    sample: Sample,
) -> Result<(Vec<String>, Vec<String>), String> {
    check_name(name, "a metric's name")?;
    if let Some(ending) = RESERVED_ENDINGS.iter().find(|e| name.ends_with(*e)) {
        return Err(format!(
            "a metric's name must not end with `{ending}`, which the exposition gives its samples"
        ));
    }
    if matches!(sample, Sample::Observe(v) if !v.is_finite()) {
        return Err("a histogram's sample must be a finite number".into());
    }
    if labels.len() > LABELS_CAP {
        return Err(format!("a metric has at most {LABELS_CAP} labels"));
    }
    labels.sort();
    for pair in labels.windows(2) {
        if pair[0].0 == pair[1].0 {
            return Err(format!("the label `{}` is given twice", pair[0].0));
        }
    }
    for (label, _) in &labels {
        check_name(label, "a label's name")?;
        if RESERVED_LABELS.contains(&label.as_str()) {
            return Err(format!(
                "the label `{label}` is the exposition's (`filter` names the filter, `le` a histogram's bucket, `quantile` a summary's)"
            ));
        }
    }
    Ok(labels.into_iter().map(|(n, v)| (n, cut(&v))).unzip())
}

impl MetricValue {
    /// A series of `kind` with no samples yet.
    fn empty(kind: MetricKind) -> Self {
        match kind {
            MetricKind::Counter => MetricValue::Counter(0),
            MetricKind::Histogram => MetricValue::Histogram {
                sum: 0.0,
                count: 0,
                buckets: vec![0; HISTOGRAM_BUCKETS.len() + 1],
            },
        }
    }

    /// Adds `sample`, of this series' kind.
    fn add(&mut self, sample: Sample) {
        match (self, sample) {
            (MetricValue::Counter(total), Sample::Count(n)) => *total = total.saturating_add(n),
            (
                MetricValue::Histogram {
                    sum,
                    count,
                    buckets,
                },
                Sample::Observe(v),
            ) => {
                *sum += v;
                *count += 1;
                let at = HISTOGRAM_BUCKETS
                    .iter()
                    .position(|b| v <= *b)
                    .unwrap_or(HISTOGRAM_BUCKETS.len());
                buckets[at] += 1;
            }
            _ => unreachable!("the kind was checked"),
        }
    }
}

impl Metrics {
    /// Adds `sample` to `name` in the series `labels`, declaring the
    /// metric on its first use; an error says why it is refused.
    pub(crate) fn record(
        &self,
        name: &str,
        labels: Vec<(String, String)>,
        sample: Sample,
    ) -> Result<(), String> {
        let kind = sample.kind();
        let (names, values) = checked(name, labels, sample)?;
        let mut metrics = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if !metrics.contains_key(name) && metrics.len() >= METRICS_CAP {
            return Err(format!("a filter declares at most {METRICS_CAP} metrics"));
        }
        let declared = metrics.entry(name.to_owned()).or_insert_with(|| Declared {
            kind,
            labels: names.clone(),
            series: BTreeMap::new(),
        });
        if declared.kind != kind {
            return Err(format!("`{name}` is a {:?}, not a {kind:?}", declared.kind).to_lowercase());
        }
        if declared.labels != names {
            return Err(format!(
                "`{name}` has the labels [{}], not [{}]",
                declared.labels.join(", "),
                names.join(", ")
            ));
        }
        let values =
            if declared.series.contains_key(&values) || declared.series.len() + 1 < SERIES_CAP {
                values
            } else {
                vec![OVERFLOW.to_owned(); names.len()]
            };
        declared
            .series
            .entry(values)
            .or_insert_with(|| MetricValue::empty(kind))
            .add(sample);
        Ok(())
    }

    /// The metrics as they stand.
    pub(crate) fn snapshot(&self) -> Vec<FilterMetric> {
        let metrics = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        metrics
            .iter()
            .map(|(name, declared)| FilterMetric {
                name: name.clone(),
                kind: declared.kind,
                labels: declared.labels.clone(),
                series: declared
                    .series
                    .iter()
                    .map(|(values, value)| (values.clone(), value.clone()))
                    .collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by(route: &str) -> Vec<(String, String)> {
        vec![("route".into(), route.into())]
    }

    #[test]
    fn series_past_the_cap_count_in_the_overflow_series_and_totals_stay_true() {
        let metrics = Metrics::default();
        for n in 0..1000 {
            metrics
                .record("hits", by(&format!("r{n}")), Sample::Count(1))
                .unwrap();
        }
        let hits = &metrics.snapshot()[0];
        assert_eq!(hits.series.len(), SERIES_CAP);
        let total: u64 = hits
            .series
            .iter()
            .map(|(_, v)| match v {
                MetricValue::Counter(n) => *n,
                MetricValue::Histogram { .. } => 0,
            })
            .sum();
        assert_eq!(total, 1000);
        let overflow = hits
            .series
            .iter()
            .find(|(values, _)| values == &[OVERFLOW])
            .unwrap();
        assert_eq!(
            overflow.1,
            MetricValue::Counter(1000 - (SERIES_CAP as u64 - 1))
        );
    }

    #[test]
    fn a_metric_keeps_its_kind_and_labels_within_its_caps() {
        let metrics = Metrics::default();
        metrics
            .record("seconds", by("a"), Sample::Observe(0.2))
            .unwrap();
        let kind = metrics
            .record("seconds", by("a"), Sample::Count(1))
            .unwrap_err();
        assert!(kind.contains("is a histogram"), "{kind}");
        let labels = metrics
            .record("seconds", vec![], Sample::Observe(0.2))
            .unwrap_err();
        assert!(labels.contains("has the labels [route]"), "{labels}");
        for n in 1..METRICS_CAP {
            metrics
                .record(&format!("m{n}"), vec![], Sample::Count(1))
                .unwrap();
        }
        let full = metrics
            .record("one_more", vec![], Sample::Count(1))
            .unwrap_err();
        assert!(full.contains("at most 32 metrics"), "{full}");
        let long = vec![("route".into(), "é".repeat(100))];
        metrics
            .record("seconds", long, Sample::Observe(0.2))
            .unwrap();
        let nan = metrics
            .record("seconds", by("a"), Sample::Observe(f64::NAN))
            .unwrap_err();
        assert!(nan.contains("finite"), "{nan}");
        let kept = &metrics
            .snapshot()
            .into_iter()
            .find(|m| m.name == "seconds")
            .unwrap()
            .series;
        assert!(
            kept.iter()
                .all(|(values, _)| values[0].len() <= LABEL_VALUE_CAP)
        );
    }

    #[test]
    fn names_the_exposition_would_misread_and_its_own_labels_are_refused() {
        let metrics = Metrics::default();
        for bad in [
            "Hits",
            "1hits",
            "hits-total",
            "",
            &"h".repeat(49),
            "a__b",
            "hits_",
            "hits_total",
            "wait_bucket",
            "wait_count",
            "wait_sum",
            "build_info",
        ] {
            assert!(
                metrics.record(bad, vec![], Sample::Count(1)).is_err(),
                "{bad}"
            );
        }
        for reserved in ["filter", "le", "quantile"] {
            let label = vec![(reserved.into(), "forged".into())];
            let refused = metrics.record("hits", label, Sample::Count(1)).unwrap_err();
            assert!(refused.contains(reserved), "{refused}");
        }
    }
}
