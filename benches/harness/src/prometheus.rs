//! A Prometheus recorder's settings with the library's histogram buckets ([`superfluid_warm::METRICS`]),
//! for the replay's `--metrics` and the tests (the binary's exporter folds the same buckets).

use metrics_exporter_prometheus::{BuildError, Matcher, PrometheusBuilder};

/// A Prometheus builder whose histograms keep the buckets the library asks for (so that
/// quantiles aggregate across heads).
///
/// # Errors
/// A metric with empty buckets (none is).
pub fn builder() -> Result<PrometheusBuilder, BuildError> {
    superfluid_warm::METRICS.iter().filter(|m| !m.buckets.is_empty()).try_fold(PrometheusBuilder::new(), |b, m| {
        b.set_buckets_for_metric(Matcher::Full(m.name.to_string()), m.buckets)
    })
}
