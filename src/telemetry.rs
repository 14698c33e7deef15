//! What the library tells an operator. Events go through `tracing`, at the level a person
//! should hear of them and with fields rather than prose; figures go through the `metrics`
//! facade, under Prometheus names and units. The library only records: the head picks the
//! subscriber and the recorder (the binary installs `RUST_LOG`'s filter and a Prometheus
//! exporter). Nothing is logged per request at info or above, and with no recorder installed a
//! figure costs a thread-local read and an atomic load.
//!
//! Every name is in [`METRICS`]; this file is the only one that writes them.

use std::time::Duration;

use metrics::{Unit, counter, gauge, histogram};

use crate::decided::engines::{EngineCounts, EngineGauges};
use crate::error::Error;

/// A commit that takes longer than this is logged (warn): the durability promise is a sync
/// window, and a commit this slow means the disk, not the batch, sets the pace.
pub(crate) const SLOW_COMMIT: Duration = Duration::from_secs(1);

/// What kind of figure a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// Only goes up (`_total`).
    Counter,
    /// Goes up and down.
    Gauge,
    /// A distribution (Prometheus `_bucket`, `_sum`, `_count`, or quantiles).
    Histogram,
}

/// One metric the library records: its name, kind, unit, labels and what it means.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct Metric {
    /// Its Prometheus name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// Its labels (`node`: a node's name; `head`: a sharing head's name).
    pub labels: &'static [&'static str],
    /// Its help text.
    pub help: &'static str,
    /// For a histogram, the bucket bounds an exporter that keeps buckets should use (so that
    /// heads aggregate alike); empty for the others.
    pub buckets: &'static [f64],
}

const fn metric(name: &'static str, kind: MetricKind, labels: &'static [&'static str], help: &'static str) -> Metric {
    Metric { name, kind, labels, help, buckets: &[] }
}

/// A histogram of seconds.
const fn timing(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
    Metric { name, kind: MetricKind::Histogram, labels, help, buckets: SECONDS }
}

/// A histogram of sizes (changes, blocks).
const fn sizes(name: &'static str, help: &'static str) -> Metric {
    Metric { name, kind: MetricKind::Histogram, labels: &[], help, buckets: SIZES }
}

/// Buckets of the `_seconds` histograms: 50 µs to 10 s (a commit, a lag, a wait).
const SECONDS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Buckets of the batch sizes (changes, blocks): 1 to 2^18.
const SIZES: &[f64] = &[1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16_384.0, 65_536.0, 262_144.0];

use MetricKind::{Counter, Gauge, Histogram};

const REQUESTS: &str = "superfluid_warm_requests_total";
const REQUEST_TOKENS: &str = "superfluid_warm_request_tokens_total";
const WARM_TOKENS: &str = "superfluid_warm_warm_tokens_total";
const RANS: &str = "superfluid_warm_rans_total";
const QUEUE_BLOCKS: &str = "superfluid_warm_queue_blocks";
const UNCOMMITTED_BYTES: &str = "superfluid_warm_uncommitted_bytes";
const BACKPRESSURE: &str = "superfluid_warm_backpressure_wait_seconds";
const COMMITS: &str = "superfluid_warm_commits_total";
const COMMIT_FAILURES: &str = "superfluid_warm_commit_failures_total";
const COMMIT_SECONDS: &str = "superfluid_warm_commit_duration_seconds";
const BATCH_CHANGES: &str = "superfluid_warm_commit_batch_changes";
const BATCH_BLOCKS: &str = "superfluid_warm_commit_batch_blocks";
const ENTRIES: &str = "superfluid_warm_entries";
const LEGACY_ENTRIES: &str = "superfluid_warm_legacy_entries";
const CAPACITY: &str = "superfluid_warm_capacity_entries";
const FILE_BYTES: &str = "superfluid_warm_file_size_bytes";
const NODE_HELD: &str = "superfluid_warm_node_held_blocks";
const NODE_CACHE: &str = "superfluid_warm_node_cache_blocks";
const NODE_CACHE_CAPACITY: &str = "superfluid_warm_node_cache_capacity_blocks";
const SHARE_CONNECTED: &str = "superfluid_warm_share_connected";
const SHARE_DISCONNECTS: &str = "superfluid_warm_share_disconnects_total";
const SHARE_APPLIED: &str = "superfluid_warm_share_applied_events_total";
const SHARE_LAG: &str = "superfluid_warm_share_lag_seconds";
const SHARE_BUFFERED: &str = "superfluid_warm_share_buffered_events";
const SHARE_DROPPED: &str = "superfluid_warm_share_dropped_events_total";
const SHARE_HALTED: &str = "superfluid_warm_share_halted";
const ENGINE_BATCHES: &str = "superfluid_warm_engine_batches_total";
const ENGINE_STORED: &str = "superfluid_warm_engine_stored_blocks_total";
const ENGINE_REMOVED: &str = "superfluid_warm_engine_removed_blocks_total";
const ENGINE_GAPS: &str = "superfluid_warm_engine_gaps_total";
const ENGINE_LOST: &str = "superfluid_warm_engine_lost_gaps_total";
const ENGINE_REPLAYS: &str = "superfluid_warm_engine_replays_total";
const ENGINE_CLEARS: &str = "superfluid_warm_engine_clears_total";
const ENGINE_RESTARTS: &str = "superfluid_warm_engine_restarts_total";
const ENGINE_DUPLICATES: &str = "superfluid_warm_engine_duplicate_batches_total";
const ENGINE_UNKNOWN_PARENTS: &str = "superfluid_warm_engine_unknown_parents_total";
const ENGINE_UNDECODABLE: &str = "superfluid_warm_engine_undecodable_total";
const ENGINE_LAG: &str = "superfluid_warm_engine_lag_seconds";
const ENGINE_CONNECTED: &str = "superfluid_warm_engine_connected";
const ENGINE_BLOCKS: &str = "superfluid_warm_engine_blocks";
const ENGINE_GROUPS: &str = "superfluid_warm_engine_kv_cache_groups";
const ROUTE_REQUESTS: &str = "superfluid_warm_route_requests_total";
const ROUTE_FAILURES: &str = "superfluid_warm_route_failures_total";
const ROUTE_EJECTIONS: &str = "superfluid_warm_route_ejections_total";
const ROUTE_EJECTED: &str = "superfluid_warm_route_ejected";
const ROUTE_PREDICTED: &str = "superfluid_warm_route_predicted_tokens_total";
const ROUTE_DELIVERED: &str = "superfluid_warm_route_delivered_tokens_total";
const ROUTE_PROMPT: &str = "superfluid_warm_route_prompt_tokens_total";
const ROUTE_MISPREDICTED: &str = "superfluid_warm_route_mispredicted_total";
const ROUTE_LOAD_ONLY: &str = "superfluid_warm_route_load_only_total";
const ROUTE_DECISION: &str = "superfluid_warm_route_decision_seconds";
const ROUTE_TOKENIZE: &str = "superfluid_warm_route_tokenize_seconds";
const ROUTE_GATHERED: &str = "superfluid_warm_route_gathered_seconds";

const NODE: &[&str] = &["node"];
const HEAD: &[&str] = &["head"];
const NODE_REASON: &[&str] = &["node", "reason"];
const REASON: &[&str] = &["reason"];

/// Every metric the library records, for a dashboard, an exporter's buckets, or
/// [`describe_metrics`].
pub const METRICS: &[Metric] = &[
    metric(REQUESTS, Counter, &[], "Requests a head answered (warmest, warm_nodes)"),
    metric(REQUEST_TOKENS, Counter, &[], "Prompt tokens of those requests, in whole 64-token blocks"),
    metric(WARM_TOKENS, Counter, &[], "Tokens of the longest warm prefix each request was answered"),
    metric(RANS, Counter, &[], "ran calls decided"),
    metric(QUEUE_BLOCKS, Gauge, &[], "Blocks of decided changes waiting for the commit thread"),
    metric(UNCOMMITTED_BYTES, Gauge, &[], "Bytes the changes not yet committed hold (memtable, queue, batch)"),
    timing(BACKPRESSURE, &[], "Time a change waited for the commit thread (back-pressure)"),
    metric(COMMITS, Counter, &[], "Commits (each durable)"),
    metric(COMMIT_FAILURES, Counter, &[], "Commits that failed and were rolled back"),
    timing(COMMIT_SECONDS, &[], "Time to write and durably commit a batch"),
    sizes(BATCH_CHANGES, "Changes (ran, forget, engine batch) in a committed batch"),
    sizes(BATCH_BLOCKS, "Blocks the changes of a committed batch put"),
    metric(ENTRIES, Gauge, &[], "Entries (block hashes) in the file, as of the last commit"),
    metric(LEGACY_ENTRIES, Gauge, &[], "Of those, imported from 0.1.7"),
    metric(CAPACITY, Gauge, &[], "Most entries kept"),
    metric(FILE_BYTES, Gauge, &[], "Size of the index file"),
    metric(NODE_HELD, Gauge, NODE, "Blocks naming the node, as of the last commit"),
    metric(NODE_CACHE, Gauge, NODE, "Blocks the index counts in the node's KV cache"),
    metric(NODE_CACHE_CAPACITY, Gauge, NODE, "Most blocks the node's KV cache holds"),
    metric(SHARE_CONNECTED, Gauge, HEAD, "1 while the head is connected to its NATS server"),
    metric(SHARE_DISCONNECTS, Counter, HEAD, "Times the head lost its NATS connection"),
    metric(SHARE_APPLIED, Counter, HEAD, "Stream events applied"),
    timing(SHARE_LAG, HEAD, "From another head's publish to this head applying the event"),
    metric(SHARE_BUFFERED, Gauge, HEAD, "Own events not yet acknowledged by the stream"),
    metric(SHARE_DROPPED, Counter, HEAD, "Own events dropped unpublished (the buffer was full)"),
    metric(SHARE_HALTED, Gauge, HEAD, "1 once the head stopped applying the stream (see the log)"),
    metric(ENGINE_BATCHES, Counter, NODE, "Engine event batches applied"),
    metric(ENGINE_STORED, Counter, NODE, "Engine blocks stored (BlockStored events' blocks)"),
    metric(ENGINE_REMOVED, Counter, NODE, "Engine blocks removed (BlockRemoved events' blocks)"),
    metric(
        ENGINE_GAPS,
        Counter,
        NODE,
        "Gaps seen in an engine's stream (batches missing; a sharing head counts those its listener saw, and a lost one again as the stream applies it)",
    ),
    metric(ENGINE_LOST, Counter, NODE, "Gaps no replay covered (the node was cleared)"),
    metric(ENGINE_REPLAYS, Counter, NODE, "Replays asked of an engine"),
    metric(ENGINE_CLEARS, Counter, NODE, "Times all a node held was dropped (cleared, restart, lost gap)"),
    metric(ENGINE_RESTARTS, Counter, NODE, "Engine restarts seen"),
    metric(ENGINE_DUPLICATES, Counter, NODE, "Engine batches that came twice"),
    metric(ENGINE_UNKNOWN_PARENTS, Counter, NODE, "Blocks stored under a parent the index does not hold"),
    metric(ENGINE_UNDECODABLE, Counter, NODE, "Engine messages that did not decode"),
    timing(
        ENGINE_LAG,
        NODE,
        "From an engine's publish to its batch applied (on a sharing head: forwarded to the stream)",
    ),
    metric(ENGINE_CONNECTED, Gauge, NODE, "1 while the listener is connected to the engine"),
    metric(ENGINE_BLOCKS, Gauge, NODE, "Engine blocks the node holds, by its events"),
    metric(
        ENGINE_GROUPS,
        Gauge,
        NODE,
        "KV cache groups the node's engine named (several, or one not of full attention: a hybrid model)",
    ),
    metric(ROUTE_REQUESTS, Counter, NODE, "Requests a routing head sent to the engine (retries included)"),
    metric(ROUTE_FAILURES, Counter, NODE_REASON, "Requests the engine failed before the client had a byte"),
    metric(ROUTE_EJECTIONS, Counter, NODE, "Times the engine was taken out of the choice after failing in a row"),
    metric(ROUTE_EJECTED, Gauge, NODE, "1 while the engine is out of the choice"),
    metric(ROUTE_PREDICTED, Counter, NODE, "Warm tokens predicted for the answers that told cached_tokens"),
    metric(ROUTE_DELIVERED, Counter, NODE, "cached_tokens the engine reported for those answers"),
    metric(ROUTE_PROMPT, Counter, NODE, "Prompt tokens of those answers"),
    metric(ROUTE_MISPREDICTED, Counter, NODE, "Answers whose prediction was off by more than 64 tokens"),
    metric(ROUTE_LOAD_ONLY, Counter, REASON, "Requests routed on load alone (unrendered, late, no_events, error)"),
    timing(ROUTE_DECISION, &[], "From a request's tokens to its engine chosen (the index's answer and the cost)"),
    timing(ROUTE_TOKENIZE, &[], "Rendering and tokenizing a request's prompt"),
    timing(ROUTE_GATHERED, &[], "A long prompt's wait, once routed, for the requests of its burst to be decided"),
];

/// Gives the installed recorder every metric's help text and unit (once, after installing it;
/// the Prometheus exporter prints them as `# HELP`), and registers the metrics without labels,
/// so that a counter that has not moved (commit failures) is exported as 0 rather than absent.
/// Labelled ones start at 0 when their head or engine starts.
pub fn describe_metrics() {
    describe();
    for m in METRICS.iter().filter(|m| m.labels.is_empty()) {
        match m.kind {
            Counter => counter!(m.name).increment(0),
            Gauge => drop(gauge!(m.name)),
            Histogram => drop(histogram!(m.name)),
        }
    }
}

/// A routing head starts with this engine: its counters at 0.
pub(crate) fn route_engine(node: &str) {
    for name in [ROUTE_REQUESTS, ROUTE_EJECTIONS, ROUTE_PREDICTED, ROUTE_DELIVERED, ROUTE_PROMPT, ROUTE_MISPREDICTED] {
        counter!(name, "node" => node.to_string()).increment(0);
    }
    gauge!(ROUTE_EJECTED, "node" => node.to_string()).set(0.0);
}

pub(crate) fn route_sent(node: &str) {
    counter!(ROUTE_REQUESTS, "node" => node.to_string()).increment(1);
}

pub(crate) fn route_failed(node: &str, why: &str) {
    counter!(ROUTE_FAILURES, "node" => node.to_string(), "reason" => why.to_string()).increment(1);
}

pub(crate) fn route_ejected(node: &str, back: bool) {
    if back {
        tracing::info!(node, "engine answers its health check again: back in the choice");
    } else {
        counter!(ROUTE_EJECTIONS, "node" => node.to_string()).increment(1);
        tracing::warn!(node, "engine failed requests in a row: out of the choice until its health check answers");
    }
    gauge!(ROUTE_EJECTED, "node" => node.to_string()).set(if back { 0.0 } else { 1.0 });
}

pub(crate) fn route_delivered(node: &str, predicted: u64, delivered: u64, prompt: u64, off: bool) {
    counter!(ROUTE_PREDICTED, "node" => node.to_string()).increment(predicted);
    counter!(ROUTE_DELIVERED, "node" => node.to_string()).increment(delivered);
    counter!(ROUTE_PROMPT, "node" => node.to_string()).increment(prompt);
    if off {
        counter!(ROUTE_MISPREDICTED, "node" => node.to_string()).increment(1);
        tracing::info!(
            node,
            predicted,
            delivered,
            prompt,
            "the engine reused a different prefix than the index predicted (a stale index, blocks it held before the head followed its events, another tokenizer, or another block size?)"
        );
    }
}

pub(crate) fn route_load_only(why: &'static str) {
    counter!(ROUTE_LOAD_ONLY, "reason" => why).increment(1);
}

pub(crate) fn route_decision(tokenize: Option<Duration>, decide: Duration) {
    if let Some(t) = tokenize {
        histogram!(ROUTE_TOKENIZE).record(t.as_secs_f64());
    }
    histogram!(ROUTE_DECISION).record(decide.as_secs_f64());
}

pub(crate) fn route_gathered(waited: Duration) {
    histogram!(ROUTE_GATHERED).record(waited.as_secs_f64());
}

/// Gives the recorder every metric's help text and unit.
pub(crate) fn describe() {
    for m in METRICS {
        let unit = if m.name.ends_with("_seconds") {
            Unit::Seconds
        } else if m.name.ends_with("_bytes") {
            Unit::Bytes
        } else {
            Unit::Count
        };
        match m.kind {
            Counter => metrics::describe_counter!(m.name, unit, m.help),
            Gauge => metrics::describe_gauge!(m.name, unit, m.help),
            Histogram => metrics::describe_histogram!(m.name, unit, m.help),
        }
    }
}

/// A `warmest` or `warm_nodes` answered: `tokens` asked (whole blocks), `warm` of them warm on
/// the answer's first node.
pub(crate) fn answered(tokens: usize, warm: usize) {
    counter!(REQUESTS).increment(1);
    counter!(REQUEST_TOKENS).increment(tokens as u64);
    counter!(WARM_TOKENS).increment(warm as u64);
}

/// A `ran` decided.
pub(crate) fn ran() {
    counter!(RANS).increment(1);
}

/// What waits for the commit thread, after a change was queued or the queue taken.
pub(crate) fn queued(blocks: usize, bytes: usize) {
    gauge!(QUEUE_BLOCKS).set(blocks as f64);
    gauge!(UNCOMMITTED_BYTES).set(bytes as f64);
}

/// A change waited `waited` for the commit thread.
pub(crate) fn backpressure(waited: Duration) {
    histogram!(BACKPRESSURE).record(waited.as_secs_f64());
    tracing::debug!(waited_ms = waited.as_secs_f64() * 1e3, "a change waited for the commit thread");
}

/// A batch of `changes` putting `blocks` blocks committed in `took`.
pub(crate) fn committed(took: Duration, changes: usize, blocks: usize) {
    counter!(COMMITS).increment(1);
    histogram!(COMMIT_SECONDS).record(took.as_secs_f64());
    histogram!(BATCH_CHANGES).record(changes as f64);
    histogram!(BATCH_BLOCKS).record(blocks as f64);
    if took >= SLOW_COMMIT {
        tracing::warn!(took_ms = took.as_millis() as u64, changes, blocks, "slow commit");
    } else {
        tracing::trace!(took_us = took.as_micros() as u64, changes, blocks, "committed");
    }
}

/// A commit failed and its batch was rolled back (its changes are retried every window):
/// logged as an error when commits start failing (`first`), at debug while they go on failing.
pub(crate) fn commit_failed(error: &Error, first: bool) {
    counter!(COMMIT_FAILURES).increment(1);
    let needs_reopen = error.needs_reopen();
    match (first, needs_reopen) {
        (true, true) => tracing::error!(
            error = %error,
            needs_reopen,
            "I/O error latched: no commit can succeed until the index is reopened"
        ),
        (true, false) => {
            tracing::error!(error = %error, needs_reopen, "commit failed; its changes are kept and retried");
        }
        (false, _) => tracing::debug!(error = %error, needs_reopen, "commit failed again"),
    }
}

/// A commit succeeded after commits had failed.
pub(crate) fn commits_recovered() {
    tracing::info!("commits succeed again");
}

/// The file's figures as of the last commit.
pub(crate) fn figures(entries: u64, legacy_entries: u64, capacity: u64, file_bytes: Option<u64>) {
    gauge!(ENTRIES).set(entries as f64);
    gauge!(LEGACY_ENTRIES).set(legacy_entries as f64);
    gauge!(CAPACITY).set(capacity as f64);
    if let Some(bytes) = file_bytes {
        gauge!(FILE_BYTES).set(bytes as f64);
    }
}

/// One node's figures as of a commit.
pub(crate) struct NodeFigures {
    pub name: String,
    /// Blocks naming it.
    pub held: u64,
    /// What its cache holds and its capacity, if the index keeps its cache.
    pub cache: Option<(u64, Option<u64>)>,
}

/// A node's figures.
pub(crate) fn node(node: &NodeFigures) {
    gauge!(NODE_HELD, "node" => node.name.clone()).set(node.held as f64);
    if let Some((blocks, capacity)) = node.cache {
        gauge!(NODE_CACHE, "node" => node.name.clone()).set(blocks as f64);
        if let Some(capacity) = capacity {
            gauge!(NODE_CACHE_CAPACITY, "node" => node.name.clone()).set(capacity as f64);
        }
    }
}

/// An engine stream's counts as a file or a head reports them whole (absolute counters): for
/// a textfile of one file's figures.
pub(crate) fn engine_totals(node: &str, counts: &EngineCounts, gauges: EngineGauges) {
    let label = || ("node", node.to_string());
    for (name, value) in engine_counters(counts) {
        counter!(name, &[label()]).absolute(value);
    }
    engine_gauges(node, gauges);
}

/// An engine's gauges: its blocks and its KV cache groups.
fn engine_gauges(node: &str, gauges: EngineGauges) {
    let label = || ("node", node.to_string());
    gauge!(ENGINE_BLOCKS, &[label()]).set(gauges.engine_blocks as f64);
    gauge!(ENGINE_GROUPS, &[label()]).set(gauges.groups as f64);
}

/// Each engine counter and its count.
fn engine_counters(c: &EngineCounts) -> [(&'static str, u64); 8] {
    [
        (ENGINE_BATCHES, c.batches),
        (ENGINE_STORED, c.stored),
        (ENGINE_REMOVED, c.removed),
        (ENGINE_GAPS, c.gaps),
        (ENGINE_LOST, c.lost),
        (ENGINE_CLEARS, c.clears),
        (ENGINE_RESTARTS, c.restarts),
        (ENGINE_DUPLICATES, c.duplicate_batches),
    ]
}

/// Node `node`'s engine batch `seq` was decided: counts went from `before` to `after` (the
/// engine holding `engine_blocks` blocks), and `gap_from` is where a gap before it is replayed
/// from. Gaps, restarts, lost gaps and clears are logged.
pub(crate) fn engine_decided(
    node: &str,
    seq: u64,
    gap_from: Option<u64>,
    (before, after): (&EngineCounts, &EngineCounts),
    gauges: EngineGauges,
) {
    let label = || ("node", node.to_string());
    // Every counter, moved or not: a stream's counters are exported from its first batch on.
    for ((name, now), (_, was)) in engine_counters(after).into_iter().zip(engine_counters(before)) {
        counter!(name, &[label()]).increment(now.saturating_sub(was));
    }
    let unknown = after.unknown_parents.saturating_sub(before.unknown_parents);
    counter!(ENGINE_UNKNOWN_PARENTS, &[label()]).increment(unknown);
    if unknown > 0 {
        tracing::debug!(node, seq, blocks = unknown, "engine blocks stored under a parent the index does not hold");
    }
    engine_gauges(node, gauges);
    let restarted = after.restarts > before.restarts;
    let lost = after.lost > before.lost;
    if let Some(from) = gap_from {
        tracing::warn!(node, seq, from, "engine stream gap: batches missing");
    }
    if restarted {
        tracing::warn!(node, seq, "engine restarted: what the node held is dropped");
    }
    if lost {
        tracing::warn!(node, seq, "engine gap not covered by a replay: what the node held is dropped");
    }
    if after.clears > before.clears && !restarted && !lost {
        tracing::info!(node, seq, "engine cleared everything it held");
    }
}

/// A gap before node `node`'s batch `seq`, seen by a sharing head before it forwards the batch
/// to the stream (its listener replays from `from`).
#[cfg(feature = "nats")]
pub(crate) fn engine_gap(node: &str, seq: u64, from: u64) {
    counter!(ENGINE_GAPS, "node" => node.to_string()).increment(1);
    tracing::warn!(node, seq, from, "engine stream gap: batches missing");
}

/// The listener asked node `node`'s engine to replay from `from`: `replayed` batches came back;
/// `covered`: they reached the gap.
#[cfg(feature = "engines")]
pub(crate) fn engine_replay(node: &str, from: u64, replayed: usize, covered: bool) {
    counter!(ENGINE_REPLAYS, "node" => node.to_string()).increment(1);
    if covered {
        tracing::info!(node, from, replayed, "engine gap replayed");
    } else {
        tracing::warn!(node, from, replayed, "engine replay fell short of the gap");
    }
}

/// Node `node`'s replay endpoint did not answer (`error`): it is left alone for `backoff`, the
/// gaps meanwhile clearing the node at once.
#[cfg(feature = "engines")]
pub(crate) fn engine_replay_failed(node: &str, error: &str, backoff: std::time::Duration) {
    tracing::warn!(
        node,
        error,
        backoff_s = backoff.as_secs_f64(),
        "engine replay endpoint did not answer: gaps clear the node without asking it for a while; check \
         its replay endpoint"
    );
}

/// A gap of node `node` from `from` was not replayed: its replay endpoint is left alone (it did
/// not answer lately); the node is cleared.
#[cfg(feature = "engines")]
pub(crate) fn engine_replay_skipped(node: &str, from: u64) {
    tracing::warn!(node, from, "engine gap not replayed: its replay endpoint did not answer lately; node cleared");
}

/// Node `node`'s live batch was applied `lag` after its engine published it.
#[cfg(feature = "engines")]
pub(crate) fn engine_lag(node: &str, lag: f64) {
    histogram!(ENGINE_LAG, "node" => node.to_string()).record(lag.max(0.0));
}

/// A message from node `node`'s engine did not decode (the stream resyncs after it): warned of
/// if `loud`.
#[cfg(feature = "engines")]
pub(crate) fn engine_undecodable(node: &str, error: &dyn std::fmt::Display, loud: bool) {
    counter!(ENGINE_UNDECODABLE, "node" => node.to_string()).increment(1);
    if loud {
        tracing::warn!(node, error = %error, "engine message did not decode (warned of once a minute at most)");
    } else {
        tracing::debug!(node, error = %error, "engine message did not decode");
    }
}

/// The listener stopped following node `node`'s engine.
#[cfg(feature = "engines")]
pub(crate) fn engine_stopped(node: &str) {
    gauge!(ENGINE_CONNECTED, "node" => node.to_string()).set(0.0);
}

/// The listener started following node `node`'s engine: its counters start at 0.
#[cfg(feature = "engines")]
pub(crate) fn engine_listening(node: &str) {
    counter!(ENGINE_REPLAYS, "node" => node.to_string()).increment(0);
    counter!(ENGINE_UNDECODABLE, "node" => node.to_string()).increment(0);
    gauge!(ENGINE_CONNECTED, "node" => node.to_string()).set(0.0);
    drop(histogram!(ENGINE_LAG, "node" => node.to_string()));
}

/// Whether the listener is connected to node `node`'s engine; `was` the last state seen.
#[cfg(feature = "engines")]
pub(crate) fn engine_connection(node: &str, endpoint: &str, connected: bool, was: bool) {
    gauge!(ENGINE_CONNECTED, "node" => node.to_string()).set(if connected { 1.0 } else { 0.0 });
    match (was, connected) {
        (false, true) => tracing::info!(node, endpoint, "engine connected"),
        (true, false) => tracing::warn!(node, endpoint, "engine connection lost"),
        _ => {}
    }
}

/// ZMQ dropped node `node`'s connection to `endpoint` for good (a frame over the size cap) and
/// the listener made it again: what was sent on it is lost, the node is cleared at its next
/// batch.
#[cfg(feature = "engines")]
pub(crate) fn engine_connection_dropped(node: &str, endpoint: &str) {
    tracing::warn!(
        node,
        endpoint,
        "engine connection dropped by ZMQ (a frame over the 256 MiB cap): connected again; the node is cleared \
         at its next batch"
    );
}

/// The listener's thread for node `node` stopped on `error` (the index must be reopened).
#[cfg(feature = "engines")]
pub(crate) fn engine_listener_stopped(node: &str, error: &Error) {
    tracing::error!(node, error = %error, "engine listener stopped: the index must be reopened");
}

/// Sharing head `head`'s link started: its figures start at 0.
#[cfg(feature = "nats")]
pub(crate) fn share_started(head: &str) {
    for name in [SHARE_DISCONNECTS, SHARE_APPLIED, SHARE_DROPPED] {
        counter!(name, "head" => head.to_string()).increment(0);
    }
    for name in [SHARE_CONNECTED, SHARE_BUFFERED, SHARE_HALTED] {
        gauge!(name, "head" => head.to_string()).set(0.0);
    }
    drop(histogram!(SHARE_LAG, "head" => head.to_string()));
}

/// Sharing head `head`'s connection to its server at `url` went from `was` to `connected`
/// (both false: the head stopped).
#[cfg(feature = "nats")]
pub(crate) fn share_connection(head: &str, url: &str, connected: bool, was: bool) {
    let url = redacted(url);
    match (was, connected) {
        (false, true) => tracing::info!(head, url, "NATS connection up"),
        (true, false) => {
            counter!(SHARE_DISCONNECTS, "head" => head.to_string()).increment(1);
            tracing::warn!(head, url, "NATS connection lost; reconnecting (events are buffered)");
        }
        _ => {}
    }
    // Last: whoever sees the gauge change also finds the count and the log line.
    gauge!(SHARE_CONNECTED, "head" => head.to_string()).set(if connected { 1.0 } else { 0.0 });
}

/// Sharing head `head`'s first connection to `url` failed (it retries, and says so at debug).
#[cfg(feature = "nats")]
pub(crate) fn share_unreachable(head: &str, url: &str, error: &dyn std::fmt::Display) {
    let url = redacted(url);
    tracing::warn!(head, url, error = %error, "cannot reach the NATS server; retrying (events are buffered)");
}

/// A server URL without its user and password.
#[cfg(feature = "nats")]
pub(crate) fn redacted(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((_, host)) => format!("{scheme}://***@{host}"),
            None => url.to_string(),
        },
        None => url.to_string(),
    }
}

/// Sharing head `head` applied a stream event, `lag` after another head published it (`None`:
/// its own).
#[cfg(feature = "nats")]
pub(crate) fn share_applied(head: &str, lag: Option<Duration>) {
    counter!(SHARE_APPLIED, "head" => head.to_string()).increment(1);
    if let Some(lag) = lag {
        histogram!(SHARE_LAG, "head" => head.to_string()).record(lag.as_secs_f64());
    }
}

/// Sharing head `head`'s own events not yet acknowledged, and how many it dropped just now.
#[cfg(feature = "nats")]
pub(crate) fn share_outbox(head: &str, buffered: usize, dropped: u64) {
    gauge!(SHARE_BUFFERED, "head" => head.to_string()).set(buffered as f64);
    if dropped > 0 {
        counter!(SHARE_DROPPED, "head" => head.to_string()).increment(dropped);
        tracing::warn!(head, dropped, buffered, "own events dropped unpublished: the buffer is full");
    }
}

/// Sharing head `head` stopped applying the stream, for `why`.
#[cfg(feature = "nats")]
pub(crate) fn share_halted(head: &str, why: &str) {
    gauge!(SHARE_HALTED, "head" => head.to_string()).set(1.0);
    tracing::error!(head, why, "sharing link halted: this head no longer applies the stream");
}

/// Sharing head `head`'s link hit `error` doing `what` (it retries).
#[cfg(feature = "nats")]
pub(crate) fn share_retry(head: &str, what: &str, error: &dyn std::fmt::Display) {
    tracing::debug!(head, what, error = %error, "sharing link error; retrying");
}

/// A clean close's compaction of `path` was `skipped` (a reader held the file) or failed.
pub(crate) fn compaction(path: &std::path::Path, skipped: bool) {
    if skipped {
        tracing::info!(path = %path.display(), "compaction on close skipped: a read was in progress, or the file could not be read");
    } else {
        tracing::warn!(path = %path.display(), "compaction on close failed: the file is not sealed, its next open verifies every page");
    }
}

/// A close left changes uncommitted (a failed last commit): the file is not sealed.
pub(crate) fn closed_unclean(path: &std::path::Path) {
    tracing::warn!(path = %path.display(), "closed with changes not committed: the file is not sealed");
}

#[cfg(all(test, feature = "nats"))]
mod tests {
    #[test]
    fn a_url_is_logged_without_its_password() {
        assert_eq!(super::redacted("nats://user:secret@10.0.0.1:4222"), "nats://***@10.0.0.1:4222");
        assert_eq!(super::redacted("nats://10.0.0.1:4222"), "nats://10.0.0.1:4222");
        assert_eq!(super::redacted("garbage"), "garbage");
    }
}
