//! `replay`: replays a conversation workload through the index and reports what routing
//! found. Its options, and the run they choose (paced beside 0.1.7, on head threads, over
//! sharing heads, over engines that publish their KV events); `report.rs` writes what it found.
#![deny(unsafe_code)]

mod report;

// The `superfluid-warm` binary's output helpers (thousands separators, what opening a file did),
// one copy for both binaries; not every one is used here.
#[allow(dead_code)]
#[path = "../../../../../src/bin/superfluid-warm/format.rs"]
mod format;

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use crate::format::{say_how_opened, thousands};
use crate::report::{
    engine_heads_report, engines_json, engines_text, heads_json, heads_text, replay_json, replay_text,
};
use clap::Parser;
use harness::engine_heads;
use harness::engine_replay::{self, ReplayEngines};
use harness::heads::run_heads;
use harness::replay::{self, Config, Policy};
use harness::trace::{self, TraceError};
use superfluid_warm::{DEFAULT_NODES_PER_PREFIX, Error, GroupKind, MAX_CAPACITY, Snapshot, Warm, describe_metrics};
use tracing_subscriber::EnvFilter;

/// Most head threads a replay starts.
const MAX_THREADS: u32 = 256;

/// Replays a conversation workload through the index beside 0.1.7's design, and reports what
/// routing found: the warm share, the load spread, time per request, and (with the options
/// below) node caches, restarts, heads sharing through NATS, engines publishing KV events.
#[derive(Parser)]
#[command(name = "replay", version)]
struct ReplayArgs {
    /// A Mooncake JSONL trace; without it, a built-in synthetic conversation workload.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Only the first N requests (the built-in workload makes exactly N; default 3000).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    requests: Option<u64>,
    /// Nodes in the cluster (at least 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    nodes: u32,
    /// Routing policy.
    #[arg(long, value_enum, default_value_t = Policy::Balanced)]
    policy: Policy,
    /// Load window, in requests (at least 1).
    #[arg(long, default_value_t = Config::default().window as u64, value_parser = clap::value_parser!(u64).range(1..))]
    window: u64,
    /// Share of the prompt the warm prefix must cover (balanced), 0 to 1.
    #[arg(long, default_value_t = Config::default().min_share, value_parser = share)]
    min_share: f64,
    /// Tokens of load difference that count as imbalance (balanced).
    #[arg(long, default_value_t = Config::default().balance_abs)]
    balance_abs: u64,
    /// The most tokens a node is given over the replay, as a multiple of the least loaded
    /// node's, plus one prompt (balanced; at least 1).
    #[arg(long, default_value_t = Config::default().max_imbalance, value_parser = at_least_one)]
    max_imbalance: f64,
    /// Keep the index in this file (default: a temporary file, removed after).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Index capacity in blocks (1 to 2^40). On an existing --db file with another capacity,
    /// only with --resize.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_CAPACITY))]
    capacity: Option<u64>,
    /// Let --capacity or --node-cache-blocks change the settings recorded in an existing --db
    /// file (a smaller one evicts its oldest entries).
    #[arg(long, requires = "db")]
    resize: bool,
    /// Skip the 0.1.7 baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Map tokens into a vocabulary of this size (e.g. 151936), as a tokenizer's ids are (at
    /// least 2).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    vocab: Option<u32>,
    /// Drive the index from this many head threads (each conversation on one), and report
    /// requests/s beside 0.1.7's behind one mutex (1 to 256).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_THREADS as i64))]
    threads: Option<u32>,
    /// Give every simulated node an LRU KV cache of this many 64-token blocks, and report the
    /// share of prompt tokens the chosen node really still held. The index is told the size too
    /// (`Builder::node_cache_blocks`), unless --no-index-cache.
    #[arg(long, conflicts_with = "threads", value_parser = clap::value_parser!(u64).range(1..=MAX_CAPACITY))]
    node_cache_blocks: Option<u64>,
    /// With --node-cache-blocks: do not tell the index the node size (what an index without node
    /// caches routes).
    #[arg(long, requires = "node_cache_blocks")]
    no_index_cache: bool,
    /// Nodes each block remembers (1 to 64).
    #[arg(
        long,
        default_value_t = DEFAULT_NODES_PER_PREFIX as u64,
        value_parser = clap::value_parser!(u64).range(1..=superfluid_warm::MAX_NODES_PER_PREFIX as u64)
    )]
    nodes_per_prefix: u64,
    /// Restart a pseudo-random node every N requests, telling the index (`forget_node`), and
    /// report the prompt tokens routed as warm to a node that had restarted since it ran them.
    #[arg(long, conflicts_with = "threads", value_parser = clap::value_parser!(u64).range(1..))]
    restart_every: Option<u64>,
    /// With --restart-every: do not tell the index (what a head without `forget_node` routes).
    #[arg(long, requires = "restart_every")]
    no_forget: bool,
    /// Spread the requests round-robin over this many heads that share one view through NATS
    /// JetStream (with --nats), beside as many heads that do not share, and report both warm
    /// shares and the lag from publish to applied.
    #[arg(
        long,
        requires = "nats",
        conflicts_with_all = ["threads", "node_cache_blocks", "restart_every", "db"],
        value_parser = clap::value_parser!(u32).range(1..=64)
    )]
    heads: Option<u32>,
    /// With --heads: the NATS server (JetStream on) they share through, e.g. nats://127.0.0.1:4222.
    #[arg(long, requires = "heads")]
    nats: Option<String>,
    /// Make the nodes simulated engines (blocks of --engine-block tokens, an LRU of
    /// --engine-cache-blocks each) that publish vLLM's KV cache events over loopback ZMQ to the
    /// index's listener; report the warm share the index claims against what the engines
    /// really held, the lag from publish to applied, and the rate the same events are applied
    /// at back to back. With --restart-every, engines restart and nobody tells the index.
    #[arg(long, conflicts_with_all = ["threads", "node_cache_blocks", "db", "no_forget"])]
    engine_events: bool,
    /// With --engine-events: engine blocks each engine's cache holds.
    #[arg(long, requires = "engine_events", default_value_t = 65_536, value_parser = clap::value_parser!(u64).range(1..))]
    engine_cache_blocks: u64,
    /// With --engine-events: tokens per engine block (vLLM's default 16; any size works).
    #[arg(long, requires = "engine_events", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    engine_block: u32,
    /// With --engine-events: give each engine an offload tier of this many engine blocks in CPU
    /// memory (vLLM's offloading connector): blocks evicted from the GPU move there and are
    /// published as CPU stores. With --engine-groups, vLLM 0.33's OffloadingConnector over every
    /// group instead (chunks of one block, keyed by group: a prompt's blocks are stored as it
    /// runs, and loaded past the GPU hit by the connector's rule). Reports the warm share by tier.
    #[arg(long, requires = "engine_events", default_value_t = 0)]
    offload_blocks: u64,
    /// With --engine-events: engine i publishes on loopback port PORT+2i and answers replays on
    /// PORT+2i+1, so that a `listen` can follow the same engines (the specs to give it are
    /// printed on stderr).
    #[arg(long, requires = "engine_events", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    engine_port: Option<u16>,
    /// With --engine-events: each engine's KV cache groups, as a hybrid-attention model's vLLM
    /// keeps them, e.g. `sliding:128,full` (gpt-oss) or `sliding:512,sliding:512,full` (Gemma
    /// 3's layout): `full`, or `sliding:W` for a sliding window of W tokens. Its events name
    /// each group; the index answers what vLLM's rule reuses over every group.
    #[arg(long, requires = "engine_events", value_delimiter = ',', value_parser = group_kind)]
    engine_groups: Vec<GroupKind>,
    /// With --offload-blocks: how much a token warm only in the offload tier counts against one
    /// in GPU memory when balanced weighs a node's warm prefix (1: tiers ignored).
    #[arg(long, requires = "engine_events", default_value_t = 0.5, value_parser = share)]
    offload_weight: f64,
    /// Skip the second, back-to-back pass (a fresh index fed one request after another with
    /// nothing between its calls, then 0.1.7 alone on the same choices; not run with --threads
    /// or --restart-every).
    #[arg(long)]
    no_back_to_back: bool,
    /// Serve the metrics at http://ADDR/metrics in Prometheus' text format while the replay
    /// runs (e.g. 127.0.0.1:9465). The process's counters add up every index it drives (the
    /// back-to-back pass's too: --no-back-to-back leaves the first pass alone), and its gauges
    /// are the last commit's.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
    /// As one JSON object.
    #[arg(long)]
    json: bool,
}

/// A share, 0 to 1.
/// A KV cache group of `--engine-groups`: `full`, or `sliding:W` (a window of W tokens, 1 or
/// more).
fn group_kind(text: &str) -> Result<GroupKind, String> {
    match text.split_once(':') {
        None if text == "full" => Ok(GroupKind::Full),
        Some(("sliding", w)) => match w.parse::<u32>() {
            Ok(window) if window > 0 => Ok(GroupKind::SlidingWindow { window }),
            _ => Err(format!("{w}: give a sliding window of 1 token or more")),
        },
        _ => Err(format!("{text}: give full or sliding:W (a window of W tokens)")),
    }
}

fn share(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        Ok(v) => Err(format!("{v} is not a share from 0 to 1")),
        Err(e) => Err(format!("{e}: give a share from 0 to 1")),
    }
}

fn at_least_one(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(v) if v >= 1.0 && v.is_finite() => Ok(v),
        Ok(v) => Err(format!("{v} is not a ratio of at least 1")),
        Err(e) => Err(format!("{e}: give a ratio of at least 1")),
    }
}

impl ReplayArgs {
    fn config(&self) -> Config {
        Config {
            nodes: self.nodes as usize,
            policy: self.policy,
            window: usize::try_from(self.window).unwrap_or(usize::MAX),
            min_share: self.min_share,
            balance_abs: self.balance_abs,
            max_imbalance: self.max_imbalance,
            baseline: !self.no_baseline,
            vocab: self.vocab,
            node_cache_blocks: self.node_cache_blocks.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            index_told_cache: self.node_cache_blocks.is_some() && !self.no_index_cache,
            restart_every: self.restart_every.map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            forget: !self.no_forget,
            ..Config::default()
        }
    }
}

/// Requests of the built-in workload when --requests is not given, and its conversations per
/// request.
const BUILT_IN_REQUESTS: usize = 3000;
const BUILT_IN_REQUESTS_PER_CONVERSATION: usize = 25;

/// A progress bar on stderr, drawn only when it is a terminal.
fn progress(len: usize, label: &'static str) -> indicatif::ProgressBar {
    let target = if std::io::stderr().is_terminal() {
        indicatif::ProgressDrawTarget::stderr()
    } else {
        indicatif::ProgressDrawTarget::hidden()
    };
    let bar = indicatif::ProgressBar::with_draw_target(Some(len as u64), target);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{msg:<32} {wide_bar} {pos}/{len} requests, {eta} left")
    {
        bar.set_style(style);
    }
    bar.set_message(label);
    bar
}

/// Refuses a --capacity or --node-cache-blocks that would change what an existing --db file
/// records, unless --resize says so: a smaller capacity evicts entries for good.
fn guard_settings(args: &ReplayArgs, db: &Path) -> Result<(), ReplayError> {
    let asks = args.capacity.is_some() || (args.node_cache_blocks.is_some() && !args.no_index_cache);
    if !asks || args.resize || std::fs::metadata(db).map_or(true, |m| m.len() == 0) {
        return Ok(());
    }
    let snapshot = match Snapshot::open(db) {
        Ok(snapshot) => snapshot,
        Err(Error::CrashedWriter { pid }) => {
            return Err(ReplayError::Refused(format!(
                "{} was left open by a head{} that crashed, so its settings cannot be read to compare: recover it \
                 with `superfluid-warm check --repair` first, or add --resize",
                db.display(),
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            )));
        }
        // Other errors of the file are the open's to report, which follows.
        Err(_) => return Ok(()),
    };
    let (capacity, entries) = (snapshot.capacity(), snapshot.entries());
    if let Some(asked) = args.capacity.filter(|&c| c != capacity) {
        let effect = if asked < entries {
            format!("evicting at least {} of them, oldest first", thousands(entries - asked))
        } else {
            "evicting nothing now".to_string()
        };
        return Err(ReplayError::Refused(format!(
            "{} holds {} entries at capacity {}; --capacity {} would record a new capacity, {effect}: add --resize to \
             change it, or leave --capacity out to keep the file's",
            db.display(),
            thousands(entries),
            thousands(capacity),
            thousands(asked)
        )));
    }
    let recorded = snapshot.node_cache_default()?;
    if let Some(asked) = args.node_cache_blocks.filter(|&b| !args.no_index_cache && Some(b) != recorded) {
        return Err(ReplayError::Refused(format!(
            "{} records {}; --node-cache-blocks {asked} would record a new size for every node (a smaller one \
             forgets what no longer fits): add --resize to change it, or leave it out",
            db.display(),
            recorded.map_or_else(|| "no node cache size".to_string(), |b| format!("node caches of {b} blocks"))
        )));
    }
    Ok(())
}

/// What can stop a replay: the index's errors, the trace's, a refused option, or the output
/// going away.
#[derive(Debug)]
enum ReplayError {
    Index(Error),
    Trace(TraceError),
    Output(std::io::Error),
    TempDir(std::io::Error),
    /// The options ask for what the replay refuses (exit 2, like a usage error): the message
    /// says why and what to ask instead.
    Refused(String),
}

impl From<Error> for ReplayError {
    fn from(e: Error) -> Self {
        ReplayError::Index(e)
    }
}

impl From<TraceError> for ReplayError {
    fn from(e: TraceError) -> Self {
        ReplayError::Trace(e)
    }
}

impl std::fmt::Display for ReplayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayError::Index(e) => write!(f, "{e}"),
            ReplayError::Trace(e) => write!(f, "{e}"),
            ReplayError::Output(e) => write!(f, "writing the output: {e}"),
            ReplayError::TempDir(e) => {
                write!(f, "cannot make a temporary directory for the index: {e}; pass --db PATH")
            }
            ReplayError::Refused(why) => write!(f, "{why}"),
        }
    }
}

fn main() -> ExitCode {
    let args = ReplayArgs::parse();
    // Warnings and errors on stderr; `RUST_LOG` (e.g. `superfluid_warm=debug`) for more.
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    match run(&mut std::io::stdout().lock(), &args) {
        Ok(code) => code,
        // A reader that went away (`replay | head`) ends the replay quietly, as it asked.
        Err(ReplayError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replay: {e}");
            ExitCode::from(if matches!(e, ReplayError::Refused(_)) { 2 } else { 1 })
        }
    }
}

/// Writes the report, a line.
fn emit(out: &mut impl Write, text: &str) -> Result<ExitCode, ReplayError> {
    writeln!(out, "{text}").map_err(ReplayError::Output)?;
    Ok(ExitCode::SUCCESS)
}

/// Serves `/metrics` in Prometheus' text format on `addr` from a thread of its own, and makes
/// its recorder the process's.
fn serve_metrics(addr: std::net::SocketAddr) -> Result<(), String> {
    harness::prometheus::builder()
        .map_err(|e| format!("metric buckets: {e}"))?
        .with_http_listener(addr)
        .install()
        .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    describe_metrics();
    Ok(())
}

fn run(out: &mut impl Write, args: &ReplayArgs) -> Result<ExitCode, ReplayError> {
    if let Some(addr) = args.metrics {
        serve_metrics(addr).map_err(ReplayError::Refused)?;
    }
    let config = args.config();
    let wanted = args.requests.map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    let (mut workload, source) = match &args.trace {
        Some(p) => (trace::read(p)?, format!("trace {}", p.display())),
        None => {
            let n = wanted.unwrap_or(BUILT_IN_REQUESTS);
            let conversations = n.div_ceil(BUILT_IN_REQUESTS_PER_CONVERSATION);
            (
                trace::synthetic(n, conversations, 42),
                format!("the built-in synthetic workload ({} conversations)", thousands(conversations as u64)),
            )
        }
    };
    if let Some(n) = wanted {
        workload.truncate(n);
    }
    if workload.is_empty() {
        return Err(ReplayError::Refused(format!("{source} holds no request: nothing to replay")));
    }
    // Without --db, the index lives in a temporary directory, removed with it.
    let (path, _temporary) = match &args.db {
        Some(db) => {
            guard_settings(args, db)?;
            (db.clone(), None)
        }
        None => {
            let dir = tempfile::tempdir().map_err(ReplayError::TempDir)?;
            (dir.path().join("replay.redb"), Some(dir))
        }
    };
    let mut builder = Warm::builder();
    if let Some(c) = args.capacity {
        builder.capacity(c);
    }
    builder.nodes_per_prefix(usize::try_from(args.nodes_per_prefix).unwrap_or(usize::MAX));
    if let Some(blocks) = args.node_cache_blocks.filter(|_| !args.no_index_cache) {
        builder.node_cache_blocks(blocks);
    }
    let engines = ReplayEngines {
        block: args.engine_block as usize,
        cache_blocks: usize::try_from(args.engine_cache_blocks).unwrap_or(usize::MAX),
        restart_every: config.restart_every,
        offload_blocks: usize::try_from(args.offload_blocks).unwrap_or(usize::MAX),
        offload_weight: args.offload_weight,
        port: args.engine_port,
        groups: args.engine_groups.clone(),
    };
    if let Some(port) = args.engine_port {
        let nodes = args.nodes as usize;
        let Some(specs) = (0..nodes).map(|i| engines.ports(i)).collect::<Option<Vec<_>>>() else {
            let last = u64::from(port) + 2 * u64::from(args.nodes) - 1;
            return Err(ReplayError::Refused(format!(
                "--engine-port {port}: {} nodes need ports {port} to {last}, past 65535",
                args.nodes
            )));
        };
        if args.heads.is_some() {
            return Err(ReplayError::Refused(
                "--engine-port: not with --heads (each side drives engines of its own)".into(),
            ));
        }
        let specs: Vec<String> = specs
            .iter()
            .enumerate()
            .map(|(i, (events, replays))| {
                format!("--engine {}=tcp://127.0.0.1:{events},replay=tcp://127.0.0.1:{replays}", replay::node_name(i))
            })
            .collect();
        eprintln!("replay: the engines publish where `listen` can follow them:\n  {}", specs.join(" "));
    }
    if let (Some(heads), Some(url), true) = (args.heads, args.nats.as_deref(), args.engine_events) {
        let dir = tempfile::tempdir().map_err(ReplayError::TempDir)?;
        let r = engine_heads::run(&builder, dir.path(), url, &workload, &config, &engines, heads as usize)?;
        return emit(out, &engine_heads_report(&r, &source, args.json));
    }
    if let (Some(heads), Some(url)) = (args.heads, args.nats.as_deref()) {
        let dir = tempfile::tempdir().map_err(ReplayError::TempDir)?;
        let r = run_heads(&builder, dir.path(), url, &workload, &config, heads as usize)?;
        return emit(out, &if args.json { heads_json(&r, &config, &source) } else { heads_text(&r, &config, &source) });
    }
    if args.engine_events {
        let dir = tempfile::tempdir().map_err(ReplayError::TempDir)?;
        let bar = progress(workload.len(), "replaying over engines that publish their KV events");
        let report = engine_replay::run(&path, &dir.path().join("ingest.redb"), &workload, &config, &engines, |i| {
            bar.set_position(i as u64)
        });
        bar.finish_and_clear();
        let r = report?;
        return emit(
            out,
            &if args.json { engines_json(&r, &engines, &source) } else { engines_text(&r, &engines, &source) },
        );
    }
    let warm = builder.open(&path)?;
    if args.db.is_some() {
        say_how_opened(&path, &warm.stats()?);
    }
    let bar = progress(workload.len(), "replaying, beside 0.1.7");
    let (report, threaded) = match args.threads {
        None => (replay::run(&warm, &workload, &config, |i| bar.set_position(i as u64)), None),
        Some(t) => match replay::run_threads(&warm, &workload, &config, t as usize) {
            Ok(threaded) => (Ok(threaded.report.clone()), Some(threaded)),
            Err(e) => (Err(e), None),
        },
    };
    bar.finish_and_clear();
    let closed = warm.close();
    let report = report?;
    closed?;
    // Saturated: a fresh index, after the first has closed (one heavy job at a time), on the
    // disk of --db if one is given. Restarts are a paced replay's only.
    let back = match threaded.is_none() && args.restart_every.is_none() && !args.no_back_to_back {
        true => {
            let dir = match args.db.as_deref().and_then(Path::parent).filter(|p| !p.as_os_str().is_empty()) {
                Some(parent) => tempfile::tempdir_in(parent),
                None => tempfile::tempdir(),
            }
            .map_err(ReplayError::TempDir)?;
            let warm = builder.open(dir.path().join("back-to-back.redb"))?;
            let bar = progress(workload.len(), "back to back, then 0.1.7 alone");
            let back = replay::back_to_back(&warm, &workload, &config, |i| bar.set_position(i as u64));
            bar.finish_and_clear();
            let closed = warm.close();
            let back = back?;
            closed?;
            Some(back)
        }
        false => None,
    };
    let text = if args.json {
        replay_json(&report, &config, &source, threaded.as_ref(), back.as_ref())
    } else {
        replay_text(&report, &config, &source, args.db.as_deref(), threaded.as_ref(), back.as_ref())
    };
    emit(out, &text)
}
