//! The command line. The only module that knows clap and how output is formatted.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::exporter::{LogFormat, init_logs, render_stats, serve_metrics};
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use superfluid_warm::tools::engine_heads::{self, EngineHeadsReport};
use superfluid_warm::tools::engine_replay::{self, EngineReport, Engines};
use superfluid_warm::tools::heads::{HeadsReport, run_heads};
use superfluid_warm::tools::replay::{self, BackToBack, Config, Policy, Report, Threaded, Timing};
use superfluid_warm::tools::trace::{self, TraceError};
use superfluid_warm::{
    DEFAULT_NODES_PER_PREFIX, DEFAULT_SYNC_WINDOW, DumpEntry, Error, FileCheck, IndexFile, LegacyJson, MAX_CAPACITY,
    SharedWarm, Sharing, Snapshot, Stats, Warm,
};
use superfluid_warm::{
    EngineBatch, EngineEndpoint, EngineOutcome, EngineSink, Hit, ListenStats, Listener, Medium, Namespace, ReadIndex,
    Reader,
};

/// What every command does with a file a crashed head left, said once.
const CRASH_RULE: &str = "A file left open by a head that crashed: `dump` and `stats` refuse it and `check` reports \
it, until it is recovered; the commands that write (`check --repair`, `compact`, `forget`, `import`, `replay --db`) \
recover it to its last commit and say so.";

#[derive(Parser)]
#[command(
    name = "superfluid-warm",
    version,
    about = "Which node last ran each prompt prefix: inspect, import, replay",
    after_help = CRASH_RULE
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// How log lines are written to stderr: `plain`, or `json` (one object a line). Which
    /// events: `RUST_LOG` (e.g. `superfluid_warm=debug`); without it, warnings and errors, and
    /// for `listen` also what an operator should hear of (connections, replays, restarts).
    #[arg(long, global = true, value_enum, default_value = "plain")]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Every entry, newest first; reads the file live while a head writes it.
    Dump(DumpArgs),
    /// Entries, per-node counts, clock range, capacity used, file size, schema.
    Stats {
        /// The index file.
        path: PathBuf,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
        /// In Prometheus' text format, under the names `listen --metrics` serves, for a
        /// textfile collector (write it to a temporary file and rename it into the
        /// collector's directory, so that it is never read half written).
        #[arg(long, conflicts_with = "json")]
        prometheus: bool,
    },
    /// Checks the invariants and, where no head has the file open, redb's integrity (on a copy).
    /// Exit code 0: healthy; 1: the file could not be checked (no index there, not an index,
    /// unreadable, or a head is creating it: retry); 2: a problem was found (each is listed), a file a crashed head left included.
    Check {
        /// The index file.
        path: PathBuf,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
        /// Recover a file left by a crashed head first (opens it as a head, which repairs it to
        /// its last commit).
        #[arg(long)]
        repair: bool,
    },
    /// Gives a closed index's free pages back to the filesystem (entries unchanged).
    Compact {
        /// The index file (no head may have it open).
        path: PathBuf,
    },
    /// Imports a superfluid 0.1.7 warm.json into an index (the JSON file is only read, and is
    /// checked whole before the index is touched).
    Import {
        /// The 0.1.7 file.
        old: PathBuf,
        /// The index file (created if absent; a failed import into a new file leaves none).
        path: PathBuf,
    },
    /// Forgets a node that restarted or left (its KV cache is gone): no answer names it for
    /// anything it ran before. Durable when it returns; the file must be closed (no head).
    Forget {
        /// The index file.
        path: PathBuf,
        /// The node's name.
        node: String,
    },
    /// Replays a conversation workload through the index and reports what routing found.
    Replay(ReplayArgs),
    /// Answers `warm_nodes` for each prompt of a file (one JSON array of token ids a line), from
    /// the index's last commit, whether or not a head has it open.
    Ask {
        /// The index file.
        path: PathBuf,
        /// The model the prompts are for.
        #[arg(long)]
        model: String,
        /// The tenant (cache salt) the prompts are for, if any.
        #[arg(long)]
        tenant: Option<String>,
        /// The prompts: one JSON array of token ids a line.
        #[arg(long)]
        prompts: PathBuf,
        /// One JSON object a line.
        #[arg(long)]
        json: bool,
    },
    /// Keeps the index of what each engine holds from its KV cache events (vLLM's or SGLang's,
    /// over ZMQ), as a head that only listens, until SIGTERM or Ctrl-C (then closes the file
    /// cleanly). A status line a node goes to stderr every --status-every seconds.
    ///
    /// Exit code 0: stopped by SIGTERM, SIGINT or --duration (also while starting), the file
    /// closed cleanly. 1: it could not start (the file could not be opened, an engine endpoint
    /// refused), or it could not go on and stopped at once, for a supervisor to restart it: the
    /// file's writes failed for good (a full disk: an I/O error latches until the file is
    /// reopened), the NATS link halted (its stream was deleted) or had no stream within
    /// --nats-wait, or the file was deleted or replaced under it. The reason is on stderr and in
    /// the status file `PATH.listen.json` (`stats` shows it), and the file is closed cleanly
    /// where it still can be. 2: an option was refused.
    Listen(ListenArgs),
}

#[derive(Args)]
struct DumpArgs {
    /// The index file.
    path: PathBuf,
    /// One JSON object a line.
    #[arg(long)]
    json: bool,
    /// Only entries of this node.
    #[arg(long)]
    node: Option<String>,
    /// At most this many entries.
    #[arg(long)]
    limit: Option<usize>,
    /// Oldest first.
    #[arg(long)]
    oldest_first: bool,
    /// The blocks each engine holds, as its KV events said (engine hash, store clock, parent,
    /// copies in GPU memory, CPU memory and on storage), instead of the prefix table.
    #[arg(long, conflicts_with = "oldest_first")]
    engines: bool,
}

/// Most head threads a replay starts.
const MAX_THREADS: u32 = 256;

#[derive(Args)]
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
    /// published as CPU stores. Reports the warm share by tier.
    #[arg(long, requires = "engine_events", default_value_t = 0)]
    offload_blocks: u64,
    /// With --engine-events: engine i publishes on loopback port PORT+2i and answers replays on
    /// PORT+2i+1, so that a `listen` can follow the same engines (the specs to give it are
    /// printed on stderr).
    #[arg(long, requires = "engine_events", value_name = "PORT", value_parser = clap::value_parser!(u16).range(1..))]
    engine_port: Option<u16>,
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

/// What can stop a command: the index's errors, a trace's, a refusal of the command's own, or
/// the output going away.
#[derive(Debug)]
enum CliError {
    Index(Error),
    Trace(TraceError),
    Output(std::io::Error),
    TempDir(std::io::Error),
    /// The command refuses what it was asked (exit 2, like a usage error): the message says why
    /// and what to ask instead.
    Refused(String),
    /// Nothing went wrong, but the command found nothing of what it was asked about (exit 1).
    NotFound(String),
    /// `listen` stopped on its own: it could not go on (exit 1; the message says why).
    Stopped(String),
}

impl From<Error> for CliError {
    fn from(e: Error) -> Self {
        CliError::Index(e)
    }
}

impl From<TraceError> for CliError {
    fn from(e: TraceError) -> Self {
        CliError::Trace(e)
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Index(Error::AlreadyOpen { path }) => write!(
                f,
                "{} is open in a running head; stop it first, or read it live with `dump`, `stats` or `check`",
                path.display()
            ),
            CliError::Index(Error::CrashedWriter { pid }) => write!(
                f,
                "the file was left open by a head{} that crashed; recover it to its last commit with \
                 `superfluid-warm check --repair FILE`",
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            ),
            CliError::Index(e) if e.needs_reopen() => write!(
                f,
                "the disk failed while writing the index ({}); what was committed before is intact: free space \
                 or fix the disk, then run the command again",
                storage_cause(e)
            ),
            CliError::Index(e) => write!(f, "{e}"),
            CliError::Trace(e) => write!(f, "{e}"),
            CliError::Output(e) => write!(f, "writing the output: {e}"),
            CliError::TempDir(e) => write!(f, "cannot make a temporary directory for the index: {e}; pass --db PATH"),
            CliError::Refused(why) | CliError::NotFound(why) | CliError::Stopped(why) => write!(f, "{why}"),
        }
    }
}

/// What the storage said underneath a failed write, without the library's advice to its callers.
fn storage_cause(e: &Error) -> String {
    match e {
        Error::Storage { source, .. } => source.to_string(),
        Error::CommitFailed { source } => storage_cause(source),
        e => e.to_string(),
    }
}

/// Exit code of `check` when it finds a problem, and of a refused command.
const UNHEALTHY: u8 = 2;

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    // `listen` runs for days: what an operator should hear of (its own info events, and every
    // library's warnings); the other commands print their output and only warnings besides.
    let level = if matches!(cli.command, Command::Listen(_)) { "warn,superfluid_warm=info" } else { "warn" };
    init_logs(cli.log_format, level);
    match run(cli.command) {
        Ok(code) => code,
        // A reader that went away (`dump | head`) ends the command quietly, as it asked.
        Err(CliError::Output(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("superfluid-warm: {e}");
            match e {
                // A file a crashed head left is a problem found (as `check` reports it).
                CliError::Refused(_) | CliError::Index(Error::CrashedWriter { .. }) => ExitCode::from(UNHEALTHY),
                _ => ExitCode::FAILURE,
            }
        }
    }
}

#[derive(Args)]
struct ListenArgs {
    /// The index file (created if absent).
    path: PathBuf,
    /// An engine: NAME=ENDPOINT[,replay=ENDPOINT][,model=M][,topic=T][,bind], e.g.
    /// `gpu-0=tcp://10.0.0.7:5557,replay=tcp://10.0.0.7:5558`. NAME is the node the head routes
    /// to; `bind` listens on ENDPOINT (for an engine configured to connect). Once per engine.
    #[arg(long = "engine", required_unless_present = "nats")]
    engines: Vec<String>,
    /// The model engines serve, unless their spec names one.
    #[arg(long)]
    model: Option<String>,
    /// Seconds a replay may take before its gap is taken as lost (the node is then cleared).
    #[arg(long, default_value_t = 5.0)]
    replay_timeout: f64,
    /// Seconds between status lines (0: none).
    #[arg(long, default_value_t = 10.0)]
    status_every: f64,
    /// Stop after this many seconds, as on SIGTERM.
    #[arg(long)]
    duration: Option<f64>,
    /// redb's page cache in MiB. A head that only listens reads little: 32 MiB keeps a head
    /// following 8 full engines of 65,536 blocks under 256 MiB resident.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(1..=65536))]
    cache_mb: u64,
    /// Share through this NATS JetStream server (e.g. nats://127.0.0.1:4222): the engines'
    /// batches are published to the stream, which every head sharing it applies in order (this
    /// one too, into PATH), instead of into PATH alone. Several heads may publish the same
    /// engine's batches: the stream stores each once.
    #[arg(long)]
    nats: Option<String>,
    /// With --nats: the stream's name.
    #[arg(long, requires = "nats", default_value = "warm")]
    stream: String,
    /// With --nats: this head's name in the stream (unique among the heads).
    #[arg(long, requires = "nats", default_value = "listen")]
    head: String,
    /// With --nats: seconds to wait at startup for the server and the stream (JetStream); none
    /// by then (nothing listens at the URL, JetStream is off) stops `listen` with exit code 1.
    #[arg(long, requires = "nats", default_value_t = 30.0)]
    nats_wait: f64,
    /// Serve the metrics at http://ADDR/metrics in Prometheus' text format (e.g.
    /// 0.0.0.0:9464).
    #[arg(long, value_name = "ADDR")]
    metrics: Option<std::net::SocketAddr>,
}

fn run(command: Command) -> Result<ExitCode, CliError> {
    let out = &mut std::io::stdout().lock();
    match command {
        Command::Dump(args) => dump(out, &args),
        Command::Stats { path, json, prometheus: false } => stats(out, &path, json),
        Command::Stats { path, prometheus: true, .. } => {
            let text = render_stats(&Snapshot::open(&path)?.stats()?).map_err(CliError::Refused)?;
            write!(out, "{text}").map_err(CliError::Output)?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { path, json, repair } => {
            if repair {
                existing(&path)?;
                let warm = Warm::open(&path)?;
                say_how_opened(&path, &warm.stats()?);
                warm.close()?;
            }
            report_check(out, json, &IndexFile::new(&path).check()?)
        }
        Command::Compact { path } => {
            let done = IndexFile::new(&path).compact()?;
            if let Some(pid) = done.recovered_from {
                say_recovered(&path, pid);
            }
            emit(out, &format!("compacted {}: {} -> {} bytes", path.display(), done.bytes_before, done.bytes_after))
        }
        Command::Import { old, path } => import(out, &old, &path),
        Command::Forget { path, node } => forget(out, &path, &node),
        Command::Replay(args) => replay_cmd(out, &args),
        Command::Listen(args) => listen(out, &args),
        Command::Ask { path, model, tenant, prompts, json } => {
            ask(out, &path, (&model, tenant.as_deref()), &prompts, json)
        }
    }
}

fn ask(
    out: &mut impl Write,
    path: &Path,
    (model, tenant): (&str, Option<&str>),
    prompts: &Path,
    json: bool,
) -> Result<ExitCode, CliError> {
    let namespace = Namespace::of(model, tenant.map(str::as_bytes))?;
    let text = std::fs::read_to_string(prompts)
        .map_err(|e| CliError::Refused(format!("cannot read the prompts {}: {e}", prompts.display())))?;
    let reader = Reader::open(path)?;
    let mut nowhere = false;
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let tokens: Vec<u32> = serde_json::from_str(line).map_err(|e| {
            CliError::Refused(format!(
                "{} line {}: not a JSON array of token ids (0 to 2^32-1): {e}",
                prompts.display(),
                i + 1
            ))
        })?;
        let hits = reader.warm_nodes_prefix(&reader.prefix(&namespace, &tokens))?;
        nowhere |= hits.is_empty();
        let line = match json {
            true => json!({
                "line": i + 1, "tokens": tokens.len(),
                "warm_nodes": hits.iter().map(|h| json!({
                    "node": h.node, "tokens": h.tokens, "tier": tier_name(h.tier), "gpu_tokens": h.gpu_tokens,
                })).collect::<Vec<_>>(),
            })
            .to_string(),
            false if hits.is_empty() => format!("{}: {} tokens, warm nowhere", i + 1, tokens.len()),
            false => format!(
                "{}: {} tokens, warm on {}",
                i + 1,
                tokens.len(),
                hits.iter().map(hit_text).collect::<Vec<_>>().join(", ")
            ),
        };
        writeln!(out, "{line}").map_err(CliError::Output)?;
    }
    // A typo in the model name answers "warm nowhere" for every prompt: say so.
    if nowhere {
        let models = Snapshot::open(path)?.models()?;
        if !models.contains(model) {
            let known: Vec<&str> = models.iter().map(String::as_str).collect();
            eprintln!(
                "superfluid-warm: {} holds no block of model `{model}`; its models: {}",
                path.display(),
                if known.is_empty() { "none".to_string() } else { known.join(", ") }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Seconds as a `Duration`, refusing what is not a finite, non-negative number.
fn seconds(what: &str, s: f64) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| CliError::Refused(format!("--{what} must be a number of seconds, 0 or more (got {s})")))
}

fn listen(out: &mut impl Write, args: &ListenArgs) -> Result<ExitCode, CliError> {
    // SIGTERM and SIGINT are caught before anything is opened: one that comes while the file
    // opens (a recovery or a page check may take a while) stops `listen` once it is open, with
    // the file closed cleanly, never in the middle of the open (which leaves it to recover).
    let mut signals = Signals::catch()?;
    if let Some(addr) = args.metrics {
        serve_metrics(addr).map_err(CliError::Refused)?;
    }
    let engines = EngineEndpoint::parse_all(&args.engines, args.model.as_deref())?;
    let (timeout, every) =
        (seconds("replay-timeout", args.replay_timeout)?, seconds("status-every", args.status_every)?);
    let until = args.duration.map(|d| seconds("duration", d)).transpose()?;
    let nats_wait = seconds("nats-wait", args.nats_wait)?;
    let mut builder = Warm::builder();
    builder.cache_size(usize::try_from(args.cache_mb << 20).unwrap_or(usize::MAX));
    let sink = match &args.nats {
        Some(url) => {
            let shared = SharedWarm::open(&builder, &args.path, Sharing::nats(url, &args.stream, &args.head))?;
            say_how_opened(&args.path, &shared.stats()?.0);
            Sink::Shared(Arc::new(shared))
        }
        None => {
            let warm = builder.open(&args.path)?;
            say_how_opened(&args.path, &warm.stats()?);
            Sink::Own(Arc::new(warm))
        }
    };
    let status = listen_status_path(&args.path);
    // The status file is refreshed every --status-every seconds, or every 10 s without lines.
    let refresh = if every.is_zero() { Duration::from_secs(10) } else { every };
    if signals.came(Duration::from_millis(10)) {
        eprintln!("superfluid-warm: stopped while starting (SIGTERM or SIGINT)");
        write_listen_status(&status, &[], &ListenHealth::default(), false, refresh);
        return match sink.close() {
            Some(Err(e)) => Err(e.into()),
            _ => emit(out, &format!("stopped; {} closed cleanly", args.path.display())),
        };
    }
    // The file as opened: one deleted or replaced under `listen` is noticed.
    let opened = file_identity(&args.path);
    let fatal = Arc::new(Mutex::new(None));
    let watched = Arc::new(Watched { sink: sink.clone(), fatal: Arc::clone(&fatal) });
    let listener = Listener::start(watched, &engines, timeout)?;
    let mut health = ListenHealth::default();
    health.look(&sink, args.nats.is_none());
    write_listen_status(&status, &listener.stats(), &health, true, refresh);
    eprintln!("superfluid-warm: listening to {} engine(s) into {}", engines.len(), args.path.display());
    let print = |stats: &[ListenStats], health: &ListenHealth| {
        for s in stats {
            let ms = |l: Option<f64>| l.map_or_else(|| "-".to_string(), |l| format!("{:.1} ms", l * 1000.0));
            let lag = format!("{} p50, {} p99", ms(s.lag_p50), ms(s.lag_p99));
            let silent = s.silent_for.map_or_else(|| "never heard".to_string(), |t| format!("last batch {t:.1} s ago"));
            eprintln!(
                "  {}: {} batches ({} undecodable, {} malformed), {} replays ({} short, {} skipped{}), {} connections dropped, lag {lag}, {silent}{}",
                s.node,
                s.received,
                s.undecodable,
                s.malformed,
                s.replays,
                s.replays_short,
                s.replays_skipped,
                match (s.replaying, s.replay_backoff) {
                    (true, _) => ": waiting for a replay, its blocks not answered meanwhile".to_string(),
                    (false, Some(b)) => format!(": replay endpoint mute, asked again in {b:.0} s"),
                    (false, None) => String::new(),
                },
                s.dropped,
                s.error.as_ref().map_or_else(String::new, |e| format!("; error: {e}"))
            );
        }
        if let Some(line) = health.sharing_line() {
            eprintln!("  {line}");
        }
        if let Some(error) = &health.error {
            eprintln!("  stopping: {error}");
        }
    };
    let started = Instant::now();
    let deadline = until.map(|d| started + d);
    let mut next_refresh = started + refresh;
    let mut warned: Option<String> = None;
    let ended = loop {
        let now = Instant::now();
        let wait = [Some(LISTEN_CHECK), deadline.map(|d| d - now), Some(next_refresh.saturating_duration_since(now))]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(LISTEN_CHECK)
            .max(Duration::from_millis(1));
        if signals.came(wait) || deadline.is_some_and(|d| Instant::now() >= d) {
            break None;
        }
        health.look(&sink, health.ready);
        if let Some(why) = listen_trouble(args, &sink, &fatal, opened, &health, started.elapsed() >= nats_wait) {
            break Some(why);
        }
        if let Some(link) = health.link_error.as_ref().filter(|e| warned.as_ref() != Some(*e)) {
            tracing::warn!(error = %link, "the NATS link has trouble; retrying (its events are buffered)");
            warned = Some(link.clone());
        }
        if Instant::now() >= next_refresh {
            next_refresh += refresh;
            let stats = listener.stats();
            write_listen_status(&status, &stats, &health, true, refresh);
            if !every.is_zero() {
                print(&stats, &health);
            }
        }
    };
    health.error.clone_from(&ended);
    // The file at the path is not the one opened: closing the handle closes the old one.
    let gone = file_identity(&args.path) != opened;
    let stats = listener.stop();
    write_listen_status(&status, &stats, &health, false, refresh);
    print(&stats, &health);
    // Every listening thread has ended, and with it its handle on the index.
    let closed = sink.close();
    match (ended, closed) {
        (None, Some(Err(e))) => Err(e.into()),
        (None, Some(Ok(()))) => emit(out, &format!("stopped; {} closed cleanly", args.path.display())),
        // Not reached (every thread has ended): dropped, it closes best effort.
        (None, None) => emit(out, &format!("stopped; {} closed", args.path.display())),
        (Some(why), closed) => {
            let closed = match closed {
                Some(Ok(())) if gone => "the file it had opened closed".to_string(),
                Some(Ok(())) => format!("{} closed cleanly", args.path.display()),
                Some(Err(e)) => format!(
                    "{} could not be closed cleanly ({}): its next open recovers it to its last commit",
                    args.path.display(),
                    storage_cause(&e)
                ),
                None => format!("{} closed", args.path.display()),
            };
            Err(CliError::Stopped(format!("{why}; stopped with exit code 1 so that it can be restarted; {closed}")))
        }
    }
}

/// How often `listen` looks for what stops it: a signal, a failed disk, a halted NATS link, its
/// file deleted.
const LISTEN_CHECK: Duration = Duration::from_millis(100);

/// Why `listen` cannot go on, if it cannot: its file's writes failed for good (an I/O error
/// latched), the NATS link halted or was not up within --nats-wait (`waited`), or the file was
/// deleted or replaced under it.
fn listen_trouble(
    args: &ListenArgs,
    sink: &Sink,
    fatal: &Mutex<Option<Error>>,
    opened: Option<(u64, u64)>,
    health: &ListenHealth,
    waited: bool,
) -> Option<String> {
    let path = args.path.display();
    if let Some(e) = fatal.lock().ok().and_then(|mut f| f.take()) {
        return Some(format!(
            "writing {path} failed for good ({}; a full disk?): this process can write it no more; what was \
             committed before is intact",
            storage_cause(&e)
        ));
    }
    if let Sink::Shared(shared) = sink {
        if let Some(halted) = shared.share_stats().halted {
            return Some(format!("the NATS link halted: {halted}"));
        }
        if !health.ready && waited {
            let why = health.link_error.as_deref().unwrap_or("the server did not answer");
            return Some(format!(
                "no NATS stream to share through after --nats-wait {} s ({why}); check that nats-server -js runs at {}",
                args.nats_wait,
                args.nats.as_deref().unwrap_or_default()
            ));
        }
    }
    match (opened, file_identity(&args.path)) {
        (Some(_), None) => {
            Some(format!("{path} was deleted while listening: nothing written since is anywhere a reader can see"))
        }
        (Some(was), Some(now)) if was != now => Some(format!(
            "{path} was replaced by another file while listening: what this process writes goes to the old one"
        )),
        _ => None,
    }
}

/// The device and inode of the file at `path`, if there is one.
fn file_identity(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// SIGTERM and SIGINT, caught on a runtime of their own from the start of `listen`.
struct Signals {
    runtime: tokio::runtime::Runtime,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    /// Catches them: from here on neither ends the process by itself.
    fn catch() -> Result<Signals, CliError> {
        use tokio::signal::unix::{SignalKind, signal};
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(CliError::Output)?;
        let entered = runtime.enter();
        let term = signal(SignalKind::terminate()).map_err(CliError::Output)?;
        let int = signal(SignalKind::interrupt()).map_err(CliError::Output)?;
        drop(entered);
        Ok(Signals { runtime, term, int })
    }

    /// Whether SIGTERM or SIGINT came, since they were caught or within `wait`.
    fn came(&mut self, wait: Duration) -> bool {
        let Signals { runtime, term, int } = self;
        runtime.block_on(async {
            tokio::select! {
                biased;
                _ = term.recv() => true,
                _ = int.recv() => true,
                () = tokio::time::sleep(wait) => false,
            }
        })
    }
}

/// What `listen` knows besides its engines' threads: how its NATS link stands, and why it
/// stopped on its own (if it did).
#[derive(Default)]
struct ListenHealth {
    /// The link has opened the stream (always, without --nats).
    ready: bool,
    /// The link's figures (with --nats).
    sharing: Option<superfluid_warm::ShareStats>,
    /// What the link finds wrong now (not connected, its last error), if anything.
    link_error: Option<String>,
    /// Why `listen` stopped on its own.
    error: Option<String>,
}

impl ListenHealth {
    /// Looks at the link again (`ready`: it had opened the stream).
    fn look(&mut self, sink: &Sink, ready: bool) {
        let Sink::Shared(shared) = sink else {
            self.ready = true;
            return;
        };
        self.ready = ready || shared.wait_ready(Duration::ZERO).is_ok();
        let s = shared.share_stats();
        self.link_error = match (&s.halted, s.connected, &s.error) {
            (Some(halted), _, _) => Some(halted.clone()),
            (None, true, _) if self.ready => None,
            (None, _, Some(error)) => Some(error.clone()),
            (None, false, None) => Some("not connected to the NATS server".into()),
            (None, true, None) => None,
        };
        self.sharing = Some(s);
    }

    /// The status line of the link (with --nats).
    fn sharing_line(&self) -> Option<String> {
        let s = self.sharing.as_ref()?;
        let state = match (self.ready, s.connected) {
            (true, true) => "connected",
            (false, true) => "connected, no stream yet",
            (_, false) => "NOT connected",
        };
        Some(format!(
            "nats stream {}: {state}; applied up to {} ({} unapplied), {} published, {} buffered, {} dropped{}",
            s.stream,
            s.applied,
            s.unapplied,
            s.published,
            s.buffered,
            s.dropped,
            self.link_error.as_ref().map_or_else(String::new, |e| format!("; error: {e}"))
        ))
    }

    /// The link as the status file keeps it.
    fn sharing_json(&self, running: bool) -> serde_json::Value {
        match &self.sharing {
            None => serde_json::Value::Null,
            Some(s) => json!({
                "stream": s.stream, "head": s.head, "connected": s.connected && running, "ready": self.ready,
                "applied": s.applied, "unapplied": s.unapplied, "published": s.published,
                "buffered": s.buffered, "dropped": s.dropped, "error": self.link_error, "halted": s.halted,
            }),
        }
    }
}

/// Where `listen` applies the engines' batches: its own file, or the stream it shares.
#[derive(Clone)]
enum Sink {
    Own(Arc<Warm>),
    Shared(Arc<SharedWarm>),
}

impl Sink {
    /// Closes the file, if this is the last handle on it (`None`: it is not).
    fn close(self) -> Option<Result<(), Error>> {
        match self {
            Sink::Own(warm) => Arc::try_unwrap(warm).ok().map(Warm::close),
            Sink::Shared(shared) => Arc::try_unwrap(shared).ok().map(SharedWarm::close),
        }
    }
}

/// The sink `listen`'s threads apply to: keeps the first error after which the file takes no
/// more writes (an I/O error latched, a full disk), for `listen` to stop on.
struct Watched {
    sink: Sink,
    fatal: Arc<Mutex<Option<Error>>>,
}

impl Watched {
    fn note<T>(&self, result: Result<T, Error>) -> Result<T, Error> {
        if let Err(e) = &result
            && e.needs_reopen()
            && let Ok(mut fatal) = self.fatal.lock()
        {
            fatal.get_or_insert_with(|| e.clone());
        }
        result
    }
}

impl EngineSink for Watched {
    fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome, Error> {
        self.note(match &self.sink {
            Sink::Own(warm) => EngineSink::engine_batch(&**warm, node, batch),
            Sink::Shared(shared) => EngineSink::engine_batch(&**shared, node, batch),
        })
    }

    fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<(), Error> {
        self.note(match &self.sink {
            Sink::Own(warm) => EngineSink::engine_resync(&**warm, node, batch),
            Sink::Shared(shared) => EngineSink::engine_resync(&**shared, node, batch),
        })
    }

    fn engine_in_doubt(&self, node: &str, in_doubt: bool) -> Result<(), Error> {
        self.note(match &self.sink {
            Sink::Own(warm) => EngineSink::engine_in_doubt(&**warm, node, in_doubt),
            Sink::Shared(shared) => EngineSink::engine_in_doubt(&**shared, node, in_doubt),
        })
    }
}

/// A medium's name, as vLLM's events spell it.
fn tier_name(m: Medium) -> &'static str {
    match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        Medium::Storage => "STORAGE",
        _ => "other",
    }
}

/// A warm node as `ask` prints it: its tokens, and where they are when not all in GPU memory.
fn hit_text(h: &Hit) -> String {
    match h.tier {
        Medium::Gpu => format!("{} ({} tokens)", h.node, h.tokens),
        tier => format!(
            "{} ({} tokens, {} in GPU memory, the rest up to {})",
            h.node,
            h.tokens,
            h.gpu_tokens,
            tier_name(tier)
        ),
    }
}

/// Where `listen` keeps its live status (connections, replays, lag) for `stats` to show: beside
/// the index file, as `<file>.listen.json`.
fn listen_status_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".listen.json");
    PathBuf::from(name)
}

/// Writes `listen`'s status file (whole, by a rename: a reader never sees half of one; on a
/// full disk, where no new file can be made, over the old one in place). A failure is said on
/// stderr and does not stop the listener.
fn write_listen_status(path: &Path, stats: &[ListenStats], health: &ListenHealth, running: bool, refresh: Duration) {
    let ms = |l: Option<f64>| l.map(|l| l * 1000.0);
    let line = json!({
        "pid": std::process::id(), "running": running, "written_at": unix_now(),
        "refresh_s": refresh.as_secs_f64(), "error": health.error, "sharing": health.sharing_json(running),
        "engines": stats.iter().map(|s| json!({
            "node": s.node, "connected": s.connected && running, "received": s.received,
            "undecodable": s.undecodable, "malformed": s.malformed, "replays": s.replays,
            "replays_short": s.replays_short, "replays_skipped": s.replays_skipped, "replaying": s.replaying,
            "replay_backoff_s": s.replay_backoff, "dropped": s.dropped, "lag_p50_ms": ms(s.lag_p50), "lag_p99_ms": ms(s.lag_p99),
            "silent_for_s": s.silent_for, "error": s.error,
        })).collect::<Vec<_>>(),
    })
    .to_string();
    let tmp = path.with_extension("json.tmp");
    let written = std::fs::write(&tmp, &line).and_then(|()| std::fs::rename(&tmp, path));
    let Err(e) = written else { return };
    let _ = std::fs::remove_file(&tmp);
    // The old file's blocks hold the new text (a few hundred bytes) where no new block is free.
    let in_place = std::fs::OpenOptions::new().write(true).open(path).and_then(|mut f| {
        f.write_all(line.as_bytes())?;
        f.set_len(line.len() as u64)
    });
    if in_place.is_err() {
        eprintln!("superfluid-warm: cannot write the status file {}: {e}", path.display());
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What `stats` shows of a listener: its status file's engines, if a listener is running (its
/// process is alive and it wrote within three refreshes), and otherwise why not; and why it
/// stopped on its own, if it did.
fn listen_status(path: &Path) -> (Option<String>, Vec<serde_json::Value>, Option<String>) {
    let Ok(text) = std::fs::read_to_string(listen_status_path(path)) else { return (None, Vec::new(), None) };
    let Ok(status) = serde_json::from_str::<serde_json::Value>(&text) else {
        return (Some("its status file does not parse".into()), Vec::new(), None);
    };
    let error = status["error"].as_str().map(str::to_string);
    let age = unix_now() - status["written_at"].as_f64().unwrap_or(0.0);
    let alive = status["pid"].as_u64().is_some_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
    let fresh = age <= 3.0 * status["refresh_s"].as_f64().unwrap_or(10.0) + 5.0;
    let engines = status["engines"].as_array().cloned().unwrap_or_default();
    if status["running"].as_bool() == Some(false) {
        (Some(format!("stopped {age:.0} s ago")), engines, error)
    } else if !alive || !fresh {
        (Some(format!("not running (its last status is {age:.0} s old)")), engines, error)
    } else {
        (None, engines, error)
    }
}

fn emit(out: &mut impl Write, text: &str) -> Result<ExitCode, CliError> {
    writeln!(out, "{text}").map_err(CliError::Output)?;
    Ok(ExitCode::SUCCESS)
}

/// An index file that must already be there (a typo must not create one).
fn existing(path: &Path) -> Result<(), CliError> {
    match std::fs::metadata(path) {
        Ok(_) => Ok(()),
        Err(_) => Err(CliError::Index(Error::Io {
            path: path.to_path_buf(),
            source: std::sync::Arc::new(std::io::Error::new(std::io::ErrorKind::NotFound, "no index file here")),
        })),
    }
}

/// Says on stderr what opening the file as a head did besides opening it: recovering a crashed
/// head's file, upgrading an older schema.
fn say_how_opened(path: &Path, stats: &Stats) {
    if let Some(pid) = stats.recovered_from {
        say_recovered(path, pid);
    }
    if let Some(from) = stats.upgraded_from {
        eprintln!(
            "superfluid-warm: upgraded {} from schema {from} to {} (older builds no longer open it)",
            path.display(),
            superfluid_warm::SCHEMA_VERSION
        );
    }
}

/// Says on stderr that a writing command recovered a crashed head's file.
fn say_recovered(path: &Path, pid: u32) {
    eprintln!(
        "superfluid-warm: recovered {} to its last commit: a head (process {pid}) had left it open",
        path.display()
    );
}

/// Lower-case hex of a key.
fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

/// `n` with a comma between each group of three digits.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What a command that may create files finds at a path before it runs: so that on failure it
/// removes only what it created (never a symlink, or a file, that was there before).
struct Created {
    /// The file a failure should remove, if the command creates it: `path` itself, or the end
    /// of a chain of dangling symlinks at `path`.
    target: Option<PathBuf>,
    /// The side file a head makes beside `path` (beside the link, not its target), if it was
    /// not there before.
    side_file: Option<PathBuf>,
}

impl Created {
    fn note(path: &Path) -> Created {
        let target = match std::fs::metadata(path) {
            // Nothing is created where a file is, or where nothing can be (a symlink loop).
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(dangling_end(path)),
            _ => None,
        };
        let side_file = IndexFile::new(path).seal_path();
        let side_file = (target.is_some() && std::fs::symlink_metadata(&side_file).is_err()).then_some(side_file);
        Created { target, side_file }
    }

    /// Removes what the command created (the file and its side file), and nothing else.
    fn remove(&self) {
        for made in self.target.iter().chain(&self.side_file) {
            let _ = std::fs::remove_file(made);
        }
    }
}

/// Where a file created at `path`, which does not exist, lands: `path`, or the end of the chain
/// of dangling symlinks that starts there.
fn dangling_end(path: &Path) -> PathBuf {
    let mut at = path.to_path_buf();
    // As many links as the kernel follows.
    for _ in 0..40 {
        match std::fs::read_link(&at) {
            Ok(link) => at = at.parent().map_or(link.clone(), |dir| dir.join(link)),
            Err(_) => break,
        }
    }
    at
}

fn import(out: &mut impl Write, old: &Path, path: &Path) -> Result<ExitCode, CliError> {
    // Read and checked whole before the index is touched: a bad file changes nothing.
    let legacy = LegacyJson::read(old)?;
    let created = Created::note(path);
    let imported = Warm::open(path).and_then(|warm| {
        let stats = warm.stats();
        let report = warm.import(&legacy);
        // Closed either way; the import's error is the one that matters.
        let closed = warm.close();
        let (stats, report) = (stats?, report?);
        closed.map(|()| (stats, report))
    });
    let (opened, report) = match imported {
        Ok(done) => done,
        Err(e) => {
            // Another head's file, made since the look: not this command's to remove.
            if !matches!(e, Error::AlreadyOpen { .. }) {
                created.remove();
            }
            return Err(e.into());
        }
    };
    say_how_opened(path, &opened);
    let line = if report.already_imported {
        format!("{} was imported before: nothing to do", old.display())
    } else {
        format!(
            "imported {} of {} entries from {} ({} evicted to stay in capacity)",
            report.imported,
            report.in_file,
            old.display(),
            report.evicted
        )
    };
    emit(out, &line)
}

fn forget(out: &mut impl Write, path: &Path, node: &str) -> Result<ExitCode, CliError> {
    // Read first: a node the file does not name needs no write (and no upgrade).
    let named = match Snapshot::open(path) {
        Ok(snapshot) => Some(snapshot.nodes().any(|(n, forgotten)| n == node && !forgotten)),
        // Recovered below, which says so.
        Err(Error::CrashedWriter { .. }) => None,
        Err(e) => return Err(e.into()),
    };
    if named == Some(false) {
        return emit(
            out,
            &format!("node {node} of {}: not known (nothing to forget; the file is unchanged)", path.display()),
        );
    }
    let warm = Warm::open(path)?;
    let stats = warm.stats()?;
    say_how_opened(path, &stats);
    let known = stats.nodes.iter().any(|n| n.name == node && !n.forgotten);
    if known {
        warm.forget_node(node)?;
    }
    warm.close()?;
    let what = if known { "forgotten" } else { "not known (nothing to forget)" };
    emit(out, &format!("node {node} of {}: {what}", path.display()))
}

/// A node name as `dump` shows it.
fn shown_node(name: &str, forgotten: bool) -> String {
    if forgotten { format!("{name} (forgotten)") } else { name.to_string() }
}

fn dump(out: &mut impl Write, args: &DumpArgs) -> Result<ExitCode, CliError> {
    let DumpArgs { path, json, node, limit, oldest_first, engines } = args;
    let (json, oldest_first) = (*json, *oldest_first);
    let snapshot = Snapshot::open(path)?;
    if let Some(wanted) = node
        && !snapshot.nodes().any(|(n, _)| n == wanted)
    {
        let names: Vec<&str> = snapshot.nodes().map(|(n, _)| n).collect();
        return Err(CliError::NotFound(format!(
            "no node is named {wanted:?} in {}; its nodes: {}",
            path.display(),
            if names.is_empty() { "none".to_string() } else { names.join(", ") }
        )));
    }
    if *engines {
        return dump_engines(out, &snapshot, json, node.as_deref(), limit.unwrap_or(usize::MAX));
    }
    // Rows stream out as they are read; the table's node column is as wide as the widest name
    // the file holds.
    let node_w = snapshot.nodes().map(|(n, forgotten)| shown_node(n, forgotten).len()).max().unwrap_or(0).max(4);
    if !json {
        writeln!(out, "{:<32}  {:<node_w$}  {:>12}  {:>8}  model; other nodes", "hash", "node", "clock", "tokens")
            .map_err(CliError::Output)?;
    }
    let limit = limit.unwrap_or(usize::MAX);
    let mut rows = Rows::new(limit);
    if limit > 0 {
        snapshot.visit(!oldest_first, |e| {
            if node.as_ref().is_some_and(|n| *n != e.node) {
                return true;
            }
            rows.wrote(if json {
                writeln!(out, "{}", dump_json(&e))
            } else {
                writeln!(out, "{}", dump_row(&e, node_w))
            })
        })?;
    }
    let shown = rows.end()?;
    if json {
        return Ok(ExitCode::SUCCESS);
    }
    emit(out, &format!("{} {} shown", thousands(shown as u64), if shown == 1 { "entry" } else { "entries" }))
}

/// `dump --engines`: each engine block, node by node, as it is read.
fn dump_engines(
    out: &mut impl Write,
    snapshot: &Snapshot,
    json: bool,
    node: Option<&str>,
    limit: usize,
) -> Result<ExitCode, CliError> {
    if !json {
        writeln!(
            out,
            "{:<20}  {:<16}  {:>10}  {:<16}  {:>3}  {:>3}  {:>7}  {:>6}  model",
            "node", "engine hash", "stored at", "parent", "GPU", "CPU", "STORAGE", "tokens"
        )
        .map_err(CliError::Output)?;
    }
    let mut rows = Rows::new(limit);
    if limit > 0 {
        snapshot.visit_engine_blocks(|b| {
            if node.is_some_and(|n| n != b.node) {
                return true;
            }
            let written = if json {
                let line = json!({
                    "node": b.node, "engine_hash": format!("{:016x}", b.hash), "stored_at": b.stored_at,
                    "parent": b.parent.map(|p| format!("{p:016x}")),
                    "copies": {"GPU": b.copies[0], "CPU": b.copies[1], "STORAGE": b.copies[2]},
                    "tokens": b.tokens, "model": b.model,
                });
                writeln!(out, "{line}")
            } else {
                let parent = b.parent.map_or_else(|| "-".to_string(), |p| format!("{p:016x}"));
                writeln!(
                    out,
                    "{:<20}  {:016x}  {:>10}  {parent:<16}  {:>3}  {:>3}  {:>7}  {:>6}  {}",
                    b.node,
                    b.hash,
                    b.stored_at,
                    b.copies[0],
                    b.copies[1],
                    b.copies[2],
                    b.tokens,
                    b.model.as_deref().unwrap_or("")
                )
            };
            rows.wrote(written)
        })?;
    }
    rows.end()?;
    Ok(ExitCode::SUCCESS)
}

/// The rows a dump writes as it reads them: up to a limit, stopping at the first failed write.
struct Rows {
    shown: usize,
    limit: usize,
    failed: Option<std::io::Error>,
}

impl Rows {
    fn new(limit: usize) -> Rows {
        Rows { shown: 0, limit, failed: None }
    }

    /// Counts a row written; whether to go on.
    fn wrote(&mut self, written: std::io::Result<()>) -> bool {
        match written {
            Ok(()) => {
                self.shown += 1;
                self.shown < self.limit
            }
            Err(err) => {
                self.failed = Some(err);
                false
            }
        }
    }

    /// The rows written, or the write that failed.
    fn end(self) -> Result<usize, CliError> {
        match self.failed {
            Some(err) => Err(CliError::Output(err)),
            None => Ok(self.shown),
        }
    }
}

fn dump_json(e: &DumpEntry) -> serde_json::Value {
    json!({
        "hash": hex(&e.key), "node": e.node, "clock": e.clock, "tokens": e.tokens,
        "model": e.model, "tenant": e.tenant, "legacy": e.tokens.is_none(), "forgotten": e.forgotten,
        "others": e.others.iter().map(|(n, c, f)| json!({"node": n, "clock": c, "forgotten": f})).collect::<Vec<_>>(),
    })
}

fn dump_row(e: &DumpEntry, node_w: usize) -> String {
    let tokens = e.tokens.map_or("0.1.7".to_string(), |t| t.to_string());
    let model = match (&e.model, e.tenant) {
        (Some(m), true) => format!("{m} (tenant)"),
        (Some(m), false) => m.clone(),
        (None, _) => "(0.1.7 import)".into(),
    };
    let others: Vec<String> = e.others.iter().map(|(n, c, f)| format!("{}@{c}", shown_node(n, *f))).collect();
    let others = if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) };
    let node = shown_node(&e.node, e.forgotten);
    format!("{:<32}  {node:<node_w$}  {:>12}  {:>8}  {model}{others}", hex(&e.key), e.clock, tokens)
}

fn stats(out: &mut impl Write, path: &Path, json: bool) -> Result<ExitCode, CliError> {
    let snapshot = Snapshot::open(path).inspect_err(|_| {
        // A file its listener could not close (its disk failed): why it stopped, beside why
        // the file cannot be read.
        if let (_, _, Some(error)) = listen_status(path) {
            eprintln!("superfluid-warm: the listener of {} stopped on its own: {error}", path.display());
        }
    })?;
    let s = snapshot.stats()?;
    let side_file_missing = snapshot.side_file_missing();
    // The listener's live figures (connections, replays, lag), from its status file.
    let (listener_down, listening, listener_error) = listen_status(path);
    let live = |node: &str| listening.iter().find(|l| l["node"].as_str() == Some(node)).cloned();
    if json {
        let per_node: serde_json::Map<String, serde_json::Value> =
            s.per_node.iter().map(|(n, c)| (n.clone(), json!(c))).collect();
        let line = json!({
            "entries": s.entries, "legacy_entries": s.legacy_entries, "per_node": per_node,
            "clock_min": s.clock_range.map(|r| r.0), "clock_max": s.clock_range.map(|r| r.1),
            "clock_high_water": s.clock, "capacity": s.capacity, "file_bytes": s.file_bytes,
            "schema": s.schema, "hash_scheme": s.hash_scheme, "writer_pid": s.writer,
            "side_file_missing": side_file_missing,
            "others": s.others, "reclaimable": s.reclaimable, "forgotten_nodes": s.forgotten_nodes,
            "stream_position": s.stream_position, "node_cache_default": s.node_cache_default,
            "node_caches": s.node_caches.iter().map(|c| json!({
                "node": c.node, "held": c.held, "capacity": c.capacity, "floor": c.floor,
            })).collect::<Vec<_>>(),
            "engines": s.engines.iter().map(|e| json!({
                "node": e.node, "last_seq": e.last_seq, "last_ts": e.last_ts,
                "engine_blocks": e.engine_blocks, "blocks": e.blocks, "counts": e.counts,
                "engine_blocks_by_tier": {"GPU": e.by_tier[0], "CPU": e.by_tier[1], "STORAGE": e.by_tier[2]},
                "listener": live(&e.node),
            })).collect::<Vec<_>>(),
            "listener_running": listener_down.is_none() && !listening.is_empty(),
            "listener_down": listener_down,
            "listener_error": listener_error,
        });
        return emit(out, &line.to_string());
    }
    let used = if s.capacity == 0 { 0.0 } else { 100.0 * s.entries as f64 / s.capacity as f64 };
    // 0.1.7's rule evicts an eighth of the capacity when a `ran` goes over it, after the `ran`:
    // one prompt longer than that leaves the index over capacity until the next.
    let over = if s.entries > s.capacity {
        " (over: 0.1.7's rule evicts an eighth of the capacity once per `ran`, so a `ran` longer than that overshoots until the next)"
    } else {
        ""
    };
    let mut text = format!(
        "entries        {} ({} from 0.1.7)\ncapacity       {} ({used:.1}% used){over}\n",
        thousands(s.entries),
        thousands(s.legacy_entries),
        thousands(s.capacity)
    );
    text += &match s.clock_range {
        Some((lo, hi)) => format!("clock          {lo} .. {hi} (high-water {})\n", s.clock),
        None => format!("clock          empty (high-water {})\n", s.clock),
    };
    text += &format!(
        "other nodes    {} (nodes a block names besides the last to run it)\nreclaimable    {} (blocks and other nodes naming one of {} forgotten node incarnations)\n",
        thousands(s.others),
        thousands(s.reclaimable),
        s.forgotten_nodes
    );
    text +=
        &format!("file           {} bytes\nschema         {} ({})\n", thousands(s.file_bytes), s.schema, s.hash_scheme);
    if s.stream_position > 0 {
        text += &format!("shared         applied a NATS stream up to sequence {}\n", s.stream_position);
    }
    text += &match (s.writer, side_file_missing) {
        (Some(pid), true) => format!(
            "writer         pid {pid}, running, but its side file {} was deleted: restart that head to recreate it\n",
            IndexFile::new(path).seal_path().display()
        ),
        (Some(pid), false) => format!("writer         pid {pid}\n"),
        (None, _) => "writer         none (closed cleanly)\n".into(),
    };
    if let Some(error) = &listener_error {
        text += &format!("listener       stopped on its own: {error}\n");
    }
    if let Some(blocks) = s.node_cache_default {
        text += &format!("node caches    {} blocks a node unless set per node\n", thousands(blocks));
    }
    text += "per node:";
    for (node, n) in &s.per_node {
        text += &format!("\n  {node:<20} {:>12}", thousands(*n));
    }
    let sized: Vec<_> = s.node_caches.iter().filter(|c| c.capacity.is_some()).collect();
    if !sized.is_empty() {
        text += "\nnode caches (blocks held / capacity):";
        for c in sized {
            let capacity = c.capacity.map_or_else(|| "none".to_string(), thousands);
            text += &format!("\n  {:<20} {} / {capacity}", c.node, thousands(c.held));
        }
    }
    if !s.engines.is_empty() {
        text += "\nengine streams (what each engine says it holds):";
        if let Some(why) = &listener_down {
            text += &format!("\n  (listener {why}: connections and lag as it last saw them)");
        } else if listening.is_empty() {
            text += "\n  (no listener status beside this file: connections and lag unknown)";
        }
        for e in &s.engines {
            let c = &e.counts;
            let seq = e.last_seq.map_or_else(|| "none".to_string(), |q| q.to_string());
            text += &format!(
                "\n  {:<20} last seq {seq}, {} engine blocks ({} on the GPU, {} only in CPU memory, {} only on storage; {} of 64 tokens); {} batches, {} stored, {} removed, {} clears, {} restarts, {} gaps ({} lost), {} duplicate batches, {} duplicate blocks, {} unknown parents, {} unknown removals, {} other medium, {} unkeyed, {} malformed",
                e.node,
                thousands(e.engine_blocks as u64),
                thousands(e.by_tier[0] as u64),
                thousands(e.by_tier[1] as u64),
                thousands(e.by_tier[2] as u64),
                thousands(e.blocks as u64),
                c.batches,
                c.stored,
                c.removed,
                c.clears,
                c.restarts,
                c.gaps,
                c.lost,
                c.duplicate_batches,
                c.duplicate_blocks,
                c.unknown_parents,
                c.unknown_removals,
                c.other_medium,
                c.unkeyed,
                c.malformed
            );
            if let Some(l) = live(&e.node) {
                let lag = |k: &str| l[k].as_f64().map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
                let connected = if l["connected"].as_bool() == Some(true) { "connected" } else { "not connected" };
                text += &format!(
                    "\n  {:<20} {connected}; {} replays ({} short); lag {} p50, {} p99; {}",
                    "",
                    l["replays"].as_u64().unwrap_or(0),
                    l["replays_short"].as_u64().unwrap_or(0),
                    lag("lag_p50_ms"),
                    lag("lag_p99_ms"),
                    l["silent_for_s"].as_f64().map_or_else(
                        || "no batch yet".to_string(),
                        |t| format!("last batch {t:.1} s before its status")
                    ),
                );
            }
        }
    }
    emit(out, &text)
}

/// Prints what `check` found, and exits 0 when healthy, [`UNHEALTHY`] otherwise.
fn report_check(out: &mut impl Write, json: bool, found: &FileCheck) -> Result<ExitCode, CliError> {
    let problems = found.problems();
    let healthy = problems.is_empty();
    let report = found.invariants.as_ref();
    if json {
        let line = json!({
            "healthy": healthy, "entries": report.map(|r| r.entries),
            "clock_entries": report.map(|r| r.clock_entries),
            "problems": problems,
            "invariant_problems": report.map(|r| &r.problems[..]),
            "integrity": found.integrity,
            "crashed_writer": found.crashed_writer.is_some(), "crashed_writer_pid": found.crashed_writer.flatten(),
            "side_file_missing": found.side_file_missing,
        });
        emit(out, &line.to_string())?;
    } else {
        let mut text = match report {
            Some(r) => format!(
                "{} entries, {} listed live in their generation\n",
                thousands(r.entries),
                thousands(r.clock_entries)
            ),
            None => "tables not walked: the file fails redb's page checksums\n".to_string(),
        };
        text += match found.integrity {
            Some(true) => "redb integrity: ok\n",
            Some(false) => "redb integrity: CORRUPTED\n",
            None => "redb integrity: not checked (a head has the file open)\n",
        };
        if found.crashed_writer.is_some() {
            text += "checked as recovered, on a copy: the file itself was not changed\n";
        }
        for p in &problems {
            text += &format!("problem: {p}\n");
        }
        text += if healthy { "verdict: healthy" } else { "verdict: PROBLEMS FOUND" };
        emit(out, &text)?;
    }
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::from(UNHEALTHY) })
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
fn guard_settings(args: &ReplayArgs, db: &Path) -> Result<(), CliError> {
    let asks = args.capacity.is_some() || (args.node_cache_blocks.is_some() && !args.no_index_cache);
    if !asks || args.resize || std::fs::metadata(db).map_or(true, |m| m.len() == 0) {
        return Ok(());
    }
    let snapshot = match Snapshot::open(db) {
        Ok(snapshot) => snapshot,
        Err(Error::CrashedWriter { pid }) => {
            return Err(CliError::Refused(format!(
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
        return Err(CliError::Refused(format!(
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
        return Err(CliError::Refused(format!(
            "{} records {}; --node-cache-blocks {asked} would record a new size for every node (a smaller one \
             forgets what no longer fits): add --resize to change it, or leave it out",
            db.display(),
            recorded.map_or_else(|| "no node cache size".to_string(), |b| format!("node caches of {b} blocks"))
        )));
    }
    Ok(())
}

/// Dynamo's KV router applying block events in memory, not durably, on the shared trace on
/// these machines (issue 26's figure), for scale beside ours.
const DYNAMO_BLOCK_OPS_PER_S: f64 = 11.8e6;

fn engines_text(r: &EngineReport, e: &Engines, source: &str) -> String {
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let ms = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{:.1} ms", v * 1000.0));
    let lag50 =
        r.listen.iter().filter_map(|l| l.lag_p50).fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    let lag99 =
        r.listen.iter().filter_map(|l| l.lag_p99).fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    let replays: u64 = r.listen.iter().map(|l| l.replays).sum();
    let mut text = format!(
        "{} requests of {source} over {} engines ({}-token blocks, {} blocks each), publishing vLLM's KV events over ZMQ\n",
        thousands(r.requests as u64),
        r.load.len(),
        e.block,
        thousands(e.cache_blocks as u64)
    );
    text += &format!(
        "warm share claimed by the index   {} of prompt tokens\ncached share (engines held)       {} in blocks of 64 ({} at the engine's block size)\n",
        pct(r.claimed_share()),
        pct(r.cached_share()),
        pct(r.cached_engine_share())
    );
    text += &format!(
        "claimed - cached                  {:+.3} points\nsent warm to a node holding less  {} requests\nload max/min                      {:.3}\n",
        100.0 * (r.claimed_share() - r.cached_share()),
        thousands(r.warm_not_cached as u64),
        r.imbalance()
    );
    if e.offload_blocks > 0 {
        text += &format!(
            "by tier (offload tier of {} blocks, weighed {}): in GPU memory claimed {}, cached {} ({:+.3} points); only offloaded claimed {}, cached {} ({:+.3} points)\n",
            thousands(e.offload_blocks as u64),
            e.offload_weight,
            pct(r.claimed_gpu_share()),
            pct(r.cached_gpu_share()),
            100.0 * (r.claimed_gpu_share() - r.cached_gpu_share()),
            pct(r.claimed_offload_share()),
            pct(r.cached_offload_share()),
            100.0 * (r.claimed_offload_share() - r.cached_offload_share()),
        );
    }
    if r.restarts > 0 {
        text += &format!(
            "engine restarts                   {} (tokens routed warm that only a restarted engine's old process held: {} once the restart was seen, {} before)\n",
            r.restarts,
            thousands(r.warm_to_restarted_seen),
            thousands(r.warm_to_restarted_unseen)
        );
    }
    text += &format!(
        "lag publish -> applied            {} p50, {} p99 (worst engine); {} replays\nhead's calls per request          {:.1} us p50, {:.1} us p99\n",
        ms(lag50),
        ms(lag99),
        replays,
        r.index.p50.as_secs_f64() * 1e6,
        r.index.p99.as_secs_f64() * 1e6
    );
    text += &format!(
        "ingest, back to back, durable     {} block events in {:.2} s: {} events/s (Dynamo's router, in memory, not durable: ~{:.1}M/s)",
        thousands(r.block_events),
        r.ingest.as_secs_f64(),
        thousands(r.ingest_rate() as u64),
        DYNAMO_BLOCK_OPS_PER_S / 1e6
    );
    text
}

fn engines_json(r: &EngineReport, e: &Engines, source: &str) -> String {
    json!({
        "source": source, "requests": r.requests, "engines": r.load.len(), "engine_block": e.block,
        "engine_cache_blocks": e.cache_blocks, "claimed_share": r.claimed_share(), "cached_share": r.cached_share(),
        "cached_engine_share": r.cached_engine_share(), "warm_not_cached": r.warm_not_cached,
        "offload_blocks": e.offload_blocks, "offload_weight": e.offload_weight,
        "claimed_gpu_share": r.claimed_gpu_share(), "cached_gpu_share": r.cached_gpu_share(),
        "claimed_offload_share": r.claimed_offload_share(), "cached_offload_share": r.cached_offload_share(),
        "load_max_over_min": r.imbalance(), "restarts": r.restarts,
        "warm_to_restarted_seen": r.warm_to_restarted_seen, "warm_to_restarted_unseen": r.warm_to_restarted_unseen,
        "lag_p50_s": r.listen.iter().filter_map(|l| l.lag_p50).fold(0.0, f64::max),
        "lag_p99_s": r.listen.iter().filter_map(|l| l.lag_p99).fold(0.0, f64::max),
        "replays": r.listen.iter().map(|l| l.replays).sum::<u64>(),
        "index_p50_us": r.index.p50.as_secs_f64() * 1e6, "index_p99_us": r.index.p99.as_secs_f64() * 1e6,
        "block_events": r.block_events, "ingest_s": r.ingest.as_secs_f64(), "ingest_events_per_s": r.ingest_rate(),
    })
    .to_string()
}

fn replay_cmd(out: &mut impl Write, args: &ReplayArgs) -> Result<ExitCode, CliError> {
    if let Some(addr) = args.metrics {
        serve_metrics(addr).map_err(CliError::Refused)?;
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
        return Err(CliError::Refused(format!("{source} holds no request: nothing to replay")));
    }
    // Without --db, the index lives in a temporary directory, removed with it.
    let (path, _temporary) = match &args.db {
        Some(db) => {
            guard_settings(args, db)?;
            (db.clone(), None)
        }
        None => {
            let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
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
    let engines = Engines {
        block: args.engine_block as usize,
        cache_blocks: usize::try_from(args.engine_cache_blocks).unwrap_or(usize::MAX),
        restart_every: config.restart_every,
        offload_blocks: usize::try_from(args.offload_blocks).unwrap_or(usize::MAX),
        offload_weight: args.offload_weight,
        port: args.engine_port,
    };
    if let Some(port) = args.engine_port {
        let nodes = args.nodes as usize;
        let Some(specs) = (0..nodes).map(|i| engines.ports(i)).collect::<Option<Vec<_>>>() else {
            let last = u64::from(port) + 2 * u64::from(args.nodes) - 1;
            return Err(CliError::Refused(format!(
                "--engine-port {port}: {} nodes need ports {port} to {last}, past 65535",
                args.nodes
            )));
        };
        if args.heads.is_some() {
            return Err(CliError::Refused(
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
        eprintln!("superfluid-warm: the engines publish where `listen` can follow them:\n  {}", specs.join(" "));
    }
    if let (Some(heads), Some(url), true) = (args.heads, args.nats.as_deref(), args.engine_events) {
        let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
        let r = engine_heads::run(&builder, dir.path(), url, &workload, &config, &engines, heads as usize)?;
        return emit(out, &engine_heads_report(&r, &source, args.json));
    }
    if let (Some(heads), Some(url)) = (args.heads, args.nats.as_deref()) {
        let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
        let r = run_heads(&builder, dir.path(), url, &workload, &config, heads as usize)?;
        return emit(out, &if args.json { heads_json(&r, &config, &source) } else { heads_text(&r, &config, &source) });
    }
    if args.engine_events {
        let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
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
            .map_err(CliError::TempDir)?;
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

/// `replay --heads H --nats URL --engine-events`: sharing heads against heads alone, each side
/// over engines of its own.
fn engine_heads_report(r: &EngineHeadsReport, source: &str, json: bool) -> String {
    let side = |s: &engine_heads::Side| {
        json!({
            "claimed_share": r.share(s.claimed_tokens), "cached_share": r.share(s.cached_tokens),
            "settled_requests": s.settled_requests, "settled_claimed_share": r.share(s.settled_claimed_tokens),
            "settled_cached_share": r.share(s.settled_cached_tokens),
            "load_max_over_min": s.imbalance(), "engine_lag_p50_s": s.engine_lag.0, "engine_lag_p99_s": s.engine_lag.1,
            "stream_lag_p50_ms": s.stream_lag_ms.0, "stream_lag_p99_ms": s.stream_lag_ms.1,
            "batches_published": s.published, "batches_applied_per_head": s.applied,
        })
    };
    if json {
        return json!({
            "source": source, "heads": r.heads, "requests": r.requests,
            "shared": side(&r.shared), "unshared": side(&r.alone),
        })
        .to_string();
    }
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let ms = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
    let mut text = format!(
        "{} requests of {source} over {} heads, round-robin; every head subscribed to every engine\n",
        thousands(r.requests as u64),
        r.heads
    );
    for (what, s) in [("sharing one view", &r.shared), ("each alone", &r.alone)] {
        text += &format!(
            "{what:<18} claimed warm {}, cached {} ({:+.3} points), max/min load {:.3}; engine lag {} p50, {} p99{}; {} batches, {} applied by each head\n",
            pct(r.share(s.claimed_tokens)),
            pct(r.share(s.cached_tokens)),
            100.0 * (r.share(s.claimed_tokens) - r.share(s.cached_tokens)),
            s.imbalance(),
            ms(s.engine_lag.0.map(|v| v * 1000.0)),
            ms(s.engine_lag.1.map(|v| v * 1000.0)),
            match s.stream_lag_ms {
                (Some(p50), Some(p99)) => format!("; stream lag {p50:.1} ms p50, {p99:.1} ms p99"),
                _ => String::new(),
            },
            thousands(s.published),
            thousands(s.applied)
        );
    }
    text
}

fn heads_json(r: &HeadsReport, c: &Config, source: &str) -> String {
    json!({
        "source": source,
        "requests": r.requests,
        "heads": r.heads,
        "nodes": c.nodes,
        "policy": policy_name(c.policy),
        "warm_share": r.warm_share(),
        "warm_share_unshared": r.warm_share_unshared(),
        "imbalance": r.imbalance,
        "imbalance_unshared": r.imbalance_unshared,
        "lag_p50_ms": r.lag_ms(0.5),
        "lag_p99_ms": r.lag_ms(0.99),
        "lag_samples": r.lags_ns.len(),
        "waited": r.waited,
        "waited_ms": r.waited_for.as_secs_f64() * 1e3,
        "events": r.events,
        "wall_s": r.wall.as_secs_f64(),
    })
    .to_string()
}

fn heads_text(r: &HeadsReport, c: &Config, source: &str) -> String {
    let ms = |q| r.lag_ms(q).map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
    format!(
        "replay: {source}, {} requests round-robin over {} heads, {} nodes, policy {}\n\
         warm share          {:.2}% with the heads sharing one view (NATS JetStream), {:.2}% with {} heads that do not share\n\
         load max/min        {:.3} sharing, {:.3} not\n\
         lag                 publish to applied on the other heads: p50 {} ms, p99 {} ms ({} events)\n\
         turns that waited   {} for their previous turn to reach their head ({:.1} ms in all; the trace's turns are seconds apart)\n\
         stream              {} events, applied by every head in {:.2} s{}",
        r.requests,
        r.heads,
        c.nodes,
        policy_name(c.policy),
        100.0 * r.warm_share(),
        100.0 * r.warm_share_unshared(),
        r.heads,
        r.imbalance,
        r.imbalance_unshared,
        ms(0.5),
        ms(0.99),
        r.lags_ns.len(),
        r.waited,
        r.waited_for.as_secs_f64() * 1e3,
        r.events,
        r.wall.as_secs_f64(),
        r.errors.iter().map(|e| format!("\nretried             {e}")).collect::<String>(),
    )
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn policy_name(p: Policy) -> String {
    clap::ValueEnum::to_possible_value(&p).map_or_else(|| format!("{p:?}"), |v| v.get_name().to_string())
}

fn replay_json(r: &Report, c: &Config, source: &str, threaded: Option<&Threaded>, back: Option<&BackToBack>) -> String {
    let timing =
        |t: &Timing| json!({"p50_us": micros(t.p50), "p99_us": micros(t.p99), "total_ms": t.total.as_secs_f64() * 1e3});
    let mut value = json!({
        "source": source, "policy": policy_name(c.policy), "nodes": c.nodes, "requests": r.requests,
        "prompt_tokens": r.prompt_tokens, "warm_tokens": r.warm_tokens, "warm_share": r.warm_share(),
        "answered_warm_tokens": r.answered_warm_tokens,
        "warm_requests": r.warm_requests, "load": r.load, "imbalance": r.imbalance(),
        "index": timing(&r.index), "baseline_0_1_7": r.baseline.as_ref().map(timing),
        "final_sync_ms": r.final_sync.as_secs_f64() * 1e3, "entries": r.entries, "wall_ms": r.wall.as_secs_f64() * 1e3,
        "paced_ratio": r.paced().map(|(_, ratio)| ratio),
        "warm_share_cached": r.warm_share_cached(), "warm_requests_not_cached": r.warm_not_cached,
        "warm_tokens_cached": r.warm_tokens_cached, "chosen_node_cached_share": r.chosen_cached_share(),
        "node_cache_blocks": c.node_cache_blocks, "index_told_cache": c.index_told_cache,
        "restart_every": c.restart_every, "forget": c.forget, "restarts": r.restarts,
        "warm_tokens_to_restarted": r.warm_tokens_to_restarted,
        "bytes_per_request": r.bytes_written.map(|b| b as f64 / r.requests.max(1) as f64),
        "baseline_bytes_per_request": r.baseline_bytes_written.map(|b| b as f64 / r.requests.max(1) as f64),
    });
    if let (Some(t), Some(map)) = (threaded, value.as_object_mut()) {
        map.insert("threads".into(), json!(t.threads));
        map.insert("requests_per_s".into(), json!(t.requests_per_s));
        map.insert("baseline_requests_per_s".into(), json!(t.baseline_requests_per_s));
    }
    if let (Some(b), Some(map)) = (back, value.as_object_mut()) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let per_request = |bytes: u64| bytes as f64 / b.requests.max(1) as f64;
        map.insert(
            "back_to_back".into(),
            json!({
                "calls_ms": ms(b.calls), "final_sync_ms": ms(b.final_sync), "ours_ms": ms(b.ours()),
                "baseline_ms": b.baseline.map(ms), "ratio": b.ratio(), "warm_tokens": b.warm_tokens,
                "entries": b.entries, "requests_per_s": b.requests_per_s(),
                "baseline_requests_per_s": b.baseline_requests_per_s(),
                "bytes_per_request": b.bytes_written.map(per_request),
                "baseline_bytes_per_request": b.baseline_bytes_written.map(per_request),
            }),
        );
    }
    value.to_string()
}

/// The index's bytes written per request, and 0.1.7's beside them where it was measured.
fn bytes_per_request(ours: Option<u64>, theirs: Option<u64>, requests: usize) -> Option<String> {
    let per_request = |bytes: u64| bytes as f64 / requests.max(1) as f64 / 1024.0;
    let mut line = format!("{:.1} KiB/request", per_request(ours?));
    if let Some(theirs) = theirs {
        line += &format!(
            " (0.1.7 saving every {} ms of its time: {:.1} KiB/request; ours {:.2}x)",
            DEFAULT_SYNC_WINDOW.as_millis(),
            per_request(theirs),
            ours? as f64 / theirs.max(1) as f64
        );
    }
    Some(line)
}

fn replay_text(
    r: &Report,
    c: &Config,
    source: &str,
    kept: Option<&Path>,
    threaded: Option<&Threaded>,
    back: Option<&BackToBack>,
) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-12);
    let pct = |share: f64| format!("{:.1}%", 100.0 * share);
    // The one-line summary first: what routing found, and how fast against 0.1.7.
    let mut summary = format!(
        "{} of prompt tokens routed to a node that already held them warm; busiest node {:.2}x the least busy",
        pct(r.warm_share()),
        r.imbalance()
    );
    if let Some((_, paced)) = back.and_then(|b| b.ratio().map(|x| (b, x))) {
        summary += &format!("; {paced:.2}x 0.1.7's time back to back, everything durable");
    }
    let mut t = format!("{summary}.\n\n");
    t += &format!(
        "Replayed {} requests of {source} over {} nodes (policy {}, load window {} requests){}.\n",
        thousands(r.requests as u64),
        c.nodes,
        policy_name(c.policy),
        c.window,
        c.vocab.map(|v| format!(", tokens mapped into a vocabulary of {v}")).unwrap_or_default()
    );
    t += "\nWhat the index found\n";
    t += &format!(
        "  routed warm      {} of {} prompt tokens ({}), {} of {} requests\n",
        thousands(r.warm_tokens),
        thousands(r.prompt_tokens),
        pct(r.warm_share()),
        thousands(r.warm_requests as u64),
        thousands(r.requests as u64)
    );
    t += &format!(
        "  answered warm    {} prompt tokens: the longest warm prefix of each request, whichever node it chose\n",
        thousands(r.answered_warm_tokens)
    );
    if let (Some(cached), Some(any), Some(missed), Some(blocks)) =
        (r.warm_share_cached(), r.chosen_cached_share(), r.warm_not_cached, c.node_cache_blocks)
    {
        t += &format!(
            "  really cached    {} of prompt tokens were routed warm and still in the chosen node's cache (an LRU of {} blocks a node, {told}); {} counting what it held unannounced; {} requests sent as warm to a node that no longer held the prefix\n",
            pct(cached),
            thousands(blocks as u64),
            pct(any),
            thousands(missed as u64),
            told = if c.index_told_cache { "the index told its size" } else { "the index not told" },
        );
    }
    if let (Some(restarts), Some(wrong), Some(every)) = (r.restarts, r.warm_tokens_to_restarted, c.restart_every) {
        let told = if c.forget { "each forgotten in the index" } else { "the index not told" };
        t += &format!(
            "  restarts         {restarts} (a node every {every} requests, {told}); {} prompt tokens routed as warm to a node that had restarted since it ran them\n",
            thousands(wrong)
        );
    }
    t += &format!("  load per node    prompt tokens; most / least loaded {:.2}\n", r.imbalance());
    let max = r.load.iter().copied().max().unwrap_or(1).max(1);
    for (i, l) in r.load.iter().enumerate() {
        let bar = "#".repeat((40 * l / max) as usize);
        t += &format!("    {:<8} {:>14}  {bar}\n", replay::node_name(i), thousands(*l));
    }
    t += &format!("  entries          {} at the end\n", thousands(r.entries));
    t += "\nHow fast (0.1.7 = superfluid 0.1.7's design: a HashMap in memory, saved whole as JSON, nothing durable between saves)\n";
    t += &format!(
        "  index time/request  p50 {:.1} µs, p99 {:.1} µs (hash, warmest, ran; durable within {} ms)\n",
        micros(r.index.p50),
        micros(r.index.p99),
        DEFAULT_SYNC_WINDOW.as_millis()
    );
    if let Some(b) = &r.baseline {
        t += &format!(
            "  0.1.7 time/request  p50 {:.1} µs, p99 {:.1} µs: ratio (ours/0.1.7) p50 {:.2}x, p99 {:.2}x\n",
            micros(b.p50),
            micros(b.p99),
            ratio(r.index.p50, b.p50),
            ratio(r.index.p99, b.p99)
        );
    }
    if let (Some((ours, paced)), Some(b)) = (r.paced(), &r.baseline) {
        t += &format!(
            "  paced               {:.1} ms (the index's calls, each between 0.1.7's, plus the final sync) against 0.1.7's {:.1} ms: {paced:.2}x\n",
            ms(ours),
            ms(b.total)
        );
    }
    if let Some(b) = back {
        t += &format!(
            "  back to back        {:.1} ms, {} requests/s (a fresh index fed one request after another, then synced)",
            ms(b.ours()),
            thousands(b.requests_per_s() as u64)
        );
        if let (Some(theirs), Some(x)) = (b.baseline, b.ratio()) {
            t += &format!(
                " against 0.1.7 alone {:.1} ms, {} requests/s: {x:.2}x",
                ms(theirs),
                thousands(b.baseline_requests_per_s().unwrap_or(0.0) as u64)
            );
        }
        t += "\n";
    }
    if let Some(th) = threaded {
        t += &format!(
            "  {} head threads      {} requests/s (final sync included)",
            th.threads,
            thousands(th.requests_per_s as u64)
        );
        if let Some(b) = th.baseline_requests_per_s {
            t += &format!(
                " against 0.1.7 behind one mutex {} requests/s: {:.2}x",
                thousands(b as u64),
                th.requests_per_s / b.max(1e-9)
            );
        }
        t += "\n";
    }
    let written = back
        .and_then(|b| bytes_per_request(b.bytes_written, b.baseline_bytes_written, b.requests))
        .or_else(|| bytes_per_request(r.bytes_written, r.baseline_bytes_written, r.requests));
    if let Some(bytes) = written {
        t += &format!("  bytes written       {bytes}\n");
    }
    t += &format!("\nWall time {:.2} s. Every figure: --json.", r.wall.as_secs_f64());
    if let Some(path) = kept {
        t += &format!(" Index kept in {}.", path.display());
    }
    t
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use std::sync::Arc;

    use super::*;

    /// A full disk is told in the command line's words: what to do, not the library's advice to
    /// reopen a handle.
    #[test]
    fn a_full_disk_is_told_in_the_command_lines_words() {
        let full = std::io::Error::new(std::io::ErrorKind::StorageFull, "No space left on device");
        let storage = Error::Storage { context: "committing", source: Arc::new(redb::Error::Io(full)) };
        assert!(storage.needs_reopen(), "the error this is about");
        for e in [storage.clone(), Error::CommitFailed { source: Box::new(storage) }] {
            let said = CliError::Index(e).to_string();
            assert!(said.contains("No space left on device"), "{said}");
            assert!(said.contains("free space") && said.contains("run the command again"), "{said}");
            assert!(!said.contains("reopen") && !said.contains("handle"), "{said}");
        }
    }

    #[test]
    fn thousands_are_separated() {
        let shown: Vec<String> = [0, 999, 1_000, 144_793_823].into_iter().map(thousands).collect();
        assert_eq!(shown, ["0", "999", "1,000", "144,793,823"]);
    }
}
