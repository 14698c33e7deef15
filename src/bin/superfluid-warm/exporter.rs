//! The binary's side of what the library tells an operator: the log subscriber (`RUST_LOG`,
//! plain or JSON lines on stderr) and the Prometheus exposition (served over HTTP, or rendered
//! once for a textfile collector).

use std::io::IsTerminal;
use std::net::SocketAddr;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use superfluid_warm::{METRICS, SnapshotStats, describe_metrics};
use tracing_subscriber::EnvFilter;

/// How log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// One line of text an event.
    Plain,
    /// One JSON object an event (timestamp, level, target, fields).
    Json,
}

/// Installs the log subscriber: `RUST_LOG`'s filter (e.g. `superfluid_warm=debug`), else
/// `default` (a level). Events go to stderr, which commands keep for what is not their output.
pub fn init_logs(format: LogFormat, default: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    // A second install (there is none) would only be refused: logs are best effort.
    let _ = match format {
        LogFormat::Plain => builder.with_ansi(std::io::stderr().is_terminal()).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// The exporter's settings: histograms with the buckets the library asks for (so that quantiles
/// aggregate across heads).
fn builder() -> Result<PrometheusBuilder, String> {
    METRICS
        .iter()
        .filter(|m| !m.buckets.is_empty())
        .try_fold(PrometheusBuilder::new(), |b, m| {
            b.set_buckets_for_metric(Matcher::Full(m.name.to_string()), m.buckets)
        })
        .map_err(|e| format!("metric buckets: {e}"))
}

/// Serves `/metrics` in Prometheus' text format on `addr` from a thread of its own, and makes
/// its recorder the process's.
///
/// # Errors
/// The address cannot be bound, or a recorder is already installed.
pub fn serve_metrics(addr: SocketAddr) -> Result<(), String> {
    builder()?.with_http_listener(addr).install().map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    describe_metrics();
    Ok(())
}

/// A file's figures in Prometheus' text format, for a textfile collector.
pub fn render_stats(stats: &SnapshotStats) -> Result<String, String> {
    let recorder = builder()?.build_recorder();
    let handle = recorder.handle();
    metrics::with_local_recorder(&recorder, || stats.record_metrics());
    Ok(handle.render())
}
