//! The command line. The only module that knows clap and how output is formatted.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use serde_json::json;
use superfluid_warm::tools::heads::{HeadsReport, run_heads};
use superfluid_warm::tools::replay::{self, BackToBack, Config, Policy, Report, Threaded, Timing};
use superfluid_warm::tools::trace::{self, TraceError};
use superfluid_warm::{DEFAULT_SYNC_WINDOW, DumpEntry, Error, FileCheck, Snapshot, Warm, check_file, seal_path};

#[derive(Parser)]
#[command(name = "superfluid-warm", version, about = "Which node last ran each prompt prefix: inspect, import, replay")]
struct Cli {
    #[command(subcommand)]
    command: Command,
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
    },
    /// Checks the invariants and, where no head has the file open, redb's integrity (on a copy).
    /// Exit code 0: healthy; 2: a problem was found.
    Check {
        /// The index file.
        path: PathBuf,
        /// As one JSON object.
        #[arg(long)]
        json: bool,
        /// Recover a file left by a crashed head first (opens it as a head, which repairs it).
        #[arg(long)]
        repair: bool,
    },
    /// Gives a closed index's free pages back to the filesystem (entries unchanged).
    Compact {
        /// The index file (no head may have it open).
        path: PathBuf,
    },
    /// Imports a superfluid 0.1.7 warm.json into an index (the JSON file is only read).
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
}

#[derive(Args)]
struct ReplayArgs {
    /// A Mooncake JSONL trace; without it, a built-in synthetic conversation workload.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Only the first N requests.
    #[arg(long)]
    requests: Option<usize>,
    /// Nodes in the cluster (at least 1).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..))]
    nodes: u32,
    /// Routing policy.
    #[arg(long, value_enum, default_value_t = Policy::Balanced)]
    policy: Policy,
    /// Load window, in requests.
    #[arg(long, default_value_t = Config::default().window)]
    window: usize,
    /// Share of the prompt the warm prefix must cover (balanced).
    #[arg(long, default_value_t = Config::default().min_share)]
    min_share: f64,
    /// Tokens of load difference that count as imbalance (balanced).
    #[arg(long, default_value_t = Config::default().balance_abs)]
    balance_abs: u64,
    /// Keep the index in this file (default: a temporary file, removed after).
    #[arg(long)]
    db: Option<PathBuf>,
    /// Index capacity in blocks.
    #[arg(long)]
    capacity: Option<u64>,
    /// Skip the 0.1.7 baseline.
    #[arg(long)]
    no_baseline: bool,
    /// Map tokens into a vocabulary of this size (e.g. 151936), as a tokenizer's ids are.
    #[arg(long)]
    vocab: Option<u32>,
    /// Drive the index from this many head threads (each conversation on one), and report
    /// requests/s beside 0.1.7's behind one mutex.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    threads: Option<u32>,
    /// Give every simulated node an LRU KV cache of this many 64-token blocks, and report the
    /// share of prompt tokens the chosen node really still held. The index is told the size too
    /// (`Builder::node_cache_blocks`), unless --no-index-cache.
    #[arg(long, conflicts_with = "threads", value_parser = clap::value_parser!(u64).range(1..))]
    node_cache_blocks: Option<u64>,
    /// With --node-cache-blocks: do not tell the index the node size (what an index without node
    /// caches routes).
    #[arg(long, requires = "node_cache_blocks")]
    no_index_cache: bool,
    /// Nodes each block remembers (default: the library's).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=superfluid_warm::MAX_NODES_PER_PREFIX as u64))]
    nodes_per_prefix: Option<u64>,
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
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    heads: Option<u32>,
    /// With --heads: the NATS server (JetStream on) they share through, e.g. nats://127.0.0.1:4222.
    #[arg(long, requires = "heads")]
    nats: Option<String>,
    /// Skip the second, back-to-back pass (a fresh index fed one request after another with
    /// nothing between its calls, then 0.1.7 alone on the same choices; not run with --threads
    /// or --restart-every).
    #[arg(long)]
    no_back_to_back: bool,
    /// As one JSON object.
    #[arg(long)]
    json: bool,
}

impl ReplayArgs {
    fn config(&self) -> Config {
        Config {
            nodes: self.nodes as usize,
            policy: self.policy,
            window: self.window,
            min_share: self.min_share,
            balance_abs: self.balance_abs,
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

/// What can stop a command: the index's errors, a trace's, or the output going away.
#[derive(Debug)]
enum CliError {
    Index(Error),
    Trace(TraceError),
    Output(std::io::Error),
    TempDir(std::io::Error),
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
            CliError::Index(e @ Error::CrashedWriter { .. }) => {
                write!(f, "{e}: run `superfluid-warm check --repair` on it, or open it with the head")
            }
            CliError::Index(e) => write!(f, "{e}"),
            CliError::Trace(e) => write!(f, "{e}"),
            CliError::Output(e) => write!(f, "writing the output: {e}"),
            CliError::TempDir(e) => write!(f, "cannot make a temporary directory for the index: {e}; pass --db PATH"),
        }
    }
}

/// Exit code of `check` when it finds a problem.
const UNHEALTHY: u8 = 2;

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("superfluid-warm: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command) -> Result<ExitCode, CliError> {
    let out = &mut std::io::stdout().lock();
    match command {
        Command::Dump(args) => dump(out, &args),
        Command::Stats { path, json } => stats(out, &path, json),
        Command::Check { path, json, repair } => {
            if repair {
                Warm::open(&path)?.close()?;
            }
            report_check(out, json, &check_file(&path)?)
        }
        Command::Compact { path } => {
            let done = superfluid_warm::compact(&path)?;
            emit(out, &format!("compacted {}: {} -> {} bytes", path.display(), done.bytes_before, done.bytes_after))
        }
        Command::Import { old, path } => import(out, &old, &path),
        Command::Forget { path, node } => {
            // An existing index only (a typo must not create a file): the reader says if not.
            drop(Snapshot::open(&path)?);
            let warm = Warm::open(&path)?;
            let known = warm.stats()?.nodes.iter().zip(warm.stats()?.forgotten).any(|(n, gone)| *n == node && !gone);
            warm.forget_node(&node)?;
            warm.close()?;
            let what = if known { "forgotten" } else { "not known (nothing to forget)" };
            emit(out, &format!("node {node} of {}: {what}", path.display()))
        }
        Command::Replay(args) => replay_cmd(out, &args),
    }
}

fn emit(out: &mut impl Write, text: &str) -> Result<ExitCode, CliError> {
    writeln!(out, "{text}").map_err(CliError::Output)?;
    Ok(ExitCode::SUCCESS)
}

/// Lower-case hex of a key.
fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

fn import(out: &mut impl Write, old: &Path, path: &Path) -> Result<ExitCode, CliError> {
    let existed = path.exists();
    let imported = Warm::open(path).and_then(|warm| {
        let report = warm.import_json(old);
        // Closed either way; the import's error is the one that matters.
        let closed = warm.close();
        let report = report?;
        closed.map(|()| report)
    });
    let report = match imported {
        Ok(report) => report,
        Err(e) => {
            if !existed {
                // A failed import into a new file leaves nothing behind.
                let _ = std::fs::remove_file(path);
                let _ = std::fs::remove_file(seal_path(path));
            }
            return Err(e.into());
        }
    };
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

fn dump(out: &mut impl Write, args: &DumpArgs) -> Result<ExitCode, CliError> {
    let DumpArgs { path, json, node, limit, oldest_first } = args;
    let (json, oldest_first) = (*json, *oldest_first);
    let snapshot = Snapshot::open(path)?;
    // JSON lines stream out as they are read; the table needs every row for its widths.
    let mut rows: Vec<DumpEntry> = Vec::new();
    let mut shown = 0;
    let limit = limit.unwrap_or(usize::MAX);
    let mut failed = None;
    snapshot.visit(!oldest_first, |e| {
        if node.as_ref().is_some_and(|n| *n != e.node) {
            return true;
        }
        if json {
            let line = json!({
                "hash": hex(&e.key), "node": e.node, "clock": e.clock, "tokens": e.tokens,
                "model": e.model, "tenant": e.tenant, "legacy": e.tokens.is_none(), "forgotten": e.forgotten,
                "others": e.others.iter().map(|(n, c, f)| json!({"node": n, "clock": c, "forgotten": f})).collect::<Vec<_>>(),
            });
            if let Err(err) = writeln!(out, "{line}") {
                failed = Some(err);
                return false;
            }
        } else {
            rows.push(e);
        }
        shown += 1;
        shown < limit
    })?;
    if let Some(err) = failed {
        return Err(CliError::Output(err));
    }
    if json {
        return Ok(ExitCode::SUCCESS);
    }
    let node_w = rows.iter().map(|e| e.node.len()).max().unwrap_or(4).max(4);
    let mut text =
        format!("{:<32}  {:<node_w$}  {:>12}  {:>8}  model; other nodes\n", "hash", "node", "clock", "tokens");
    for e in &rows {
        let mark = |n: &str, forgotten: bool| if forgotten { format!("{n} (forgotten)") } else { n.to_string() };
        let tokens = e.tokens.map_or("0.1.7".to_string(), |t| t.to_string());
        let model = match (&e.model, e.tenant) {
            (Some(m), true) => format!("{m} (tenant)"),
            (Some(m), false) => m.clone(),
            (None, _) => "(0.1.7 import)".into(),
        };
        let others: Vec<String> = e.others.iter().map(|(n, c, f)| format!("{}@{c}", mark(n, *f))).collect();
        let others = if others.is_empty() { String::new() } else { format!("; {}", others.join(", ")) };
        let node = mark(&e.node, e.forgotten);
        text += &format!("{:<32}  {node:<node_w$}  {:>12}  {:>8}  {model}{others}\n", hex(&e.key), e.clock, tokens);
    }
    text += &format!("{} entries shown", rows.len());
    emit(out, &text)
}

fn stats(out: &mut impl Write, path: &Path, json: bool) -> Result<ExitCode, CliError> {
    let snapshot = Snapshot::open(path)?;
    let s = snapshot.stats()?;
    if json {
        let per_node: serde_json::Map<String, serde_json::Value> =
            s.per_node.iter().map(|(n, c)| (n.clone(), json!(c))).collect();
        let line = json!({
            "entries": s.entries, "legacy_entries": s.legacy_entries, "per_node": per_node,
            "clock_min": s.clock_range.map(|r| r.0), "clock_max": s.clock_range.map(|r| r.1),
            "clock_high_water": s.clock, "capacity": s.capacity, "file_bytes": s.file_bytes,
            "schema": s.schema, "hash_scheme": s.hash_scheme, "writer_pid": s.writer,
            "others": s.others, "reclaimable": s.reclaimable, "forgotten_nodes": s.forgotten_nodes,
            "stream_position": s.stream_position, "node_cache_default": s.node_cache_default,
            "node_caches": s.node_caches.iter().map(|c| json!({
                "node": c.node, "held": c.held, "capacity": c.capacity, "floor": c.floor,
            })).collect::<Vec<_>>(),
        });
        return emit(out, &line.to_string());
    }
    let used = if s.capacity == 0 { 0.0 } else { 100.0 * s.entries as f64 / s.capacity as f64 };
    let mut text = format!(
        "entries        {} ({} from 0.1.7)\ncapacity       {} ({used:.1}% used)\n",
        s.entries, s.legacy_entries, s.capacity
    );
    text += &match s.clock_range {
        Some((lo, hi)) => format!("clock          {lo} .. {hi} (high-water {})\n", s.clock),
        None => format!("clock          empty (high-water {})\n", s.clock),
    };
    text += &format!(
        "other nodes    {} (nodes a block names besides the last to run it)\nreclaimable    {} (blocks and other nodes naming one of {} forgotten node incarnations)\n",
        s.others, s.reclaimable, s.forgotten_nodes
    );
    text += &format!("file           {} bytes\nschema         {} ({})\n", s.file_bytes, s.schema, s.hash_scheme);
    if s.stream_position > 0 {
        text += &format!("shared         applied a NATS stream up to sequence {}\n", s.stream_position);
    }
    text += &match s.writer {
        Some(pid) => format!("writer         pid {pid}\n"),
        None => "writer         none (closed cleanly)\n".into(),
    };
    if let Some(blocks) = s.node_cache_default {
        text += &format!("node caches    {blocks} blocks a node unless set per node\n");
    }
    text += "per node:";
    for (node, n) in &s.per_node {
        text += &format!("\n  {node:<20} {n}");
    }
    let sized: Vec<_> = s.node_caches.iter().filter(|c| c.capacity.is_some()).collect();
    if !sized.is_empty() {
        text += "\nnode caches (blocks held / capacity):";
        for c in sized {
            let capacity = c.capacity.map_or_else(|| "none".to_string(), |b| b.to_string());
            text += &format!("\n  {:<20} {} / {capacity}", c.node, c.held);
        }
    }
    emit(out, &text)
}

/// Prints what `check` found, and exits 0 when healthy, [`UNHEALTHY`] otherwise.
fn report_check(out: &mut impl Write, json: bool, found: &FileCheck) -> Result<ExitCode, CliError> {
    let healthy = found.healthy();
    let report = found.invariants.as_ref();
    if json {
        let line = json!({
            "healthy": healthy, "entries": report.map(|r| r.entries),
            "clock_entries": report.map(|r| r.clock_entries),
            "problems": report.map_or(&[][..], |r| &r.problems[..]), "integrity": found.integrity,
            "crashed_writer": found.crashed_writer.is_some(), "crashed_writer_pid": found.crashed_writer.flatten(),
        });
        emit(out, &line.to_string())?;
    } else {
        let mut text = match report {
            Some(r) => format!("{} entries, {} listed live in their generation\n", r.entries, r.clock_entries),
            None => "tables not walked: the file fails redb's page checksums\n".to_string(),
        };
        for p in report.iter().flat_map(|r| &r.problems) {
            text += &format!("problem: {p}\n");
        }
        text += match found.integrity {
            Some(true) => "redb integrity: ok\n",
            Some(false) => "redb integrity: CORRUPTED\n",
            None => "redb integrity: not checked (a head has the file open)\n",
        };
        if found.crashed_writer.is_some() {
            text += "left open by a writer that crashed (checked on a recovered copy): run `check --repair` or open it with the head\n";
        }
        text += if healthy { "verdict: healthy" } else { "verdict: PROBLEMS FOUND" };
        emit(out, &text)?;
    }
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::from(UNHEALTHY) })
}

fn replay_cmd(out: &mut impl Write, args: &ReplayArgs) -> Result<ExitCode, CliError> {
    let config = args.config();
    let (mut workload, source) = match &args.trace {
        Some(p) => (trace::read(p)?, p.display().to_string()),
        None => {
            (trace::synthetic(3000, 120, 42), "built-in synthetic conversations (3000 requests, 120 sessions)".into())
        }
    };
    if let Some(n) = args.requests {
        workload.truncate(n);
    }
    // Without --db, the index lives in a temporary directory, removed with it.
    let (path, _temporary) = match &args.db {
        Some(db) => (db.clone(), None),
        None => {
            let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
            (dir.path().join("replay.redb"), Some(dir))
        }
    };
    let mut builder = Warm::builder();
    if let Some(c) = args.capacity {
        builder.capacity(c);
    }
    if let Some(k) = args.nodes_per_prefix {
        builder.nodes_per_prefix(usize::try_from(k).unwrap_or(usize::MAX));
    }
    if let Some(blocks) = args.node_cache_blocks.filter(|_| !args.no_index_cache) {
        builder.node_cache_blocks(blocks);
    }
    if let (Some(heads), Some(url)) = (args.heads, args.nats.as_deref()) {
        let dir = tempfile::tempdir().map_err(CliError::TempDir)?;
        let r = run_heads(&builder, dir.path(), url, &workload, &config, heads as usize)?;
        return emit(out, &if args.json { heads_json(&r, &config, &source) } else { heads_text(&r, &config, &source) });
    }
    let warm = builder.open(&path)?;
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(workload.len() as u64),
        if std::io::stderr().is_terminal() {
            indicatif::ProgressDrawTarget::stderr()
        } else {
            indicatif::ProgressDrawTarget::hidden()
        },
    );
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
            let back = replay::back_to_back(&warm, &workload, &config);
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
    let mut t = format!("replay of {source}\n");
    t += &format!("policy {} over {} nodes (load window {} requests)\n", policy_name(c.policy), c.nodes, c.window);
    if let Some(vocab) = c.vocab {
        t += &format!("tokens mapped into a vocabulary of {vocab}\n");
    }
    t += &format!("requests         {}\n", r.requests);
    t += &format!("prompt tokens    {}\n", r.prompt_tokens);
    t += &format!(
        "routed warm      {} tokens ({:.1}% of prompt tokens), {} requests\n",
        r.warm_tokens,
        100.0 * r.warm_share(),
        r.warm_requests
    );
    if let (Some(cached), Some(any), Some(missed), Some(blocks)) =
        (r.warm_share_cached(), r.chosen_cached_share(), r.warm_not_cached, c.node_cache_blocks)
    {
        t += &format!(
            "really cached    {:.1}% of prompt tokens: routed warm and still in the chosen node's cache (an LRU of {blocks} blocks a node, {told}; {:.1}% counting what it held unannounced); {missed} requests sent as warm to a node that no longer held the prefix\n",
            100.0 * cached,
            100.0 * any,
            told = if c.index_told_cache { "the index told its size" } else { "the index not told" },
        );
    }
    if let (Some(restarts), Some(wrong), Some(every)) = (r.restarts, r.warm_tokens_to_restarted, c.restart_every) {
        let told = if c.forget { "each forgotten in the index" } else { "the index not told" };
        t += &format!(
            "restarts         {restarts} (a node every {every} requests, {told}); {wrong} prompt tokens routed as warm to a node that had restarted since it ran them\n"
        );
    }
    t += &format!("imbalance        {:.2} (most / least loaded node)\n", r.imbalance());
    t += "load per node (prompt tokens):\n";
    let max = r.load.iter().copied().max().unwrap_or(1).max(1);
    for (i, l) in r.load.iter().enumerate() {
        let bar = "#".repeat((40 * l / max) as usize);
        t += &format!("  {:<8} {:>12}  {bar}\n", replay::node_name(i), l);
    }
    t += &format!(
        "index time/request  p50 {:.1} µs  p99 {:.1} µs  total {:.1} ms\n",
        micros(r.index.p50),
        micros(r.index.p99),
        r.index.total.as_secs_f64() * 1e3
    );
    if let Some(b) = &r.baseline {
        t += &format!(
            "0.1.7 design        p50 {:.1} µs  p99 {:.1} µs  total {:.1} ms (in memory, nothing durable)\n",
            micros(b.p50),
            micros(b.p99),
            b.total.as_secs_f64() * 1e3
        );
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-12);
        t += &format!(
            "ratio (ours/0.1.7)  p50 {:.2}x  p99 {:.2}x  total {:.2}x\n",
            ratio(r.index.p50, b.p50),
            ratio(r.index.p99, b.p99),
            ratio(r.index.total, b.total)
        );
    }
    t += &format!("final sync          {:.1} ms; {} entries\n", r.final_sync.as_secs_f64() * 1e3, r.entries);
    if let (Some((ours, ratio)), Some(b)) = (r.paced(), &r.baseline) {
        // The commit thread's backlog is part of the index's time; it also worked while 0.1.7 ran.
        t += &format!(
            "paced by 0.1.7      index time + final sync {:.1} ms vs 0.1.7 total {:.1} ms: {ratio:.2}x\n",
            ours.as_secs_f64() * 1e3,
            b.total.as_secs_f64() * 1e3,
        );
    }
    if let Some(bytes) = bytes_per_request(r.bytes_written, r.baseline_bytes_written, r.requests) {
        t += &format!("bytes written       {bytes}\n");
    }
    t += &format!("wall                {:.2} s", r.wall.as_secs_f64());
    if let Some(th) = threaded {
        t += &format!(
            "\n{} head threads     {:.0} requests/s (wall time, final sync included)",
            th.threads, th.requests_per_s
        );
        if let Some(b) = th.baseline_requests_per_s {
            t += &format!(
                "\n0.1.7 design        {b:.0} requests/s ({} threads behind one mutex, in memory, nothing durable); ratio {:.2}x",
                th.threads,
                th.requests_per_s / b.max(1e-9)
            );
        }
    }
    if let Some(b) = back {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        t += &format!(
            "\nback to back        {:.1} ms: calls {:.1} ms + final sync {:.1} ms, {:.0} requests/s (a fresh index, nothing between its calls)",
            ms(b.ours()),
            ms(b.calls),
            ms(b.final_sync),
            b.requests_per_s()
        );
        if let (Some(theirs), Some(ratio)) = (b.baseline, b.ratio()) {
            t += &format!(
                "\n0.1.7 design        {:.1} ms alone, the same choices, {:.0} requests/s (in memory, nothing durable); ratio {ratio:.2}x",
                ms(theirs),
                b.baseline_requests_per_s().unwrap_or(0.0)
            );
        }
        if let Some(bytes) = bytes_per_request(b.bytes_written, b.baseline_bytes_written, b.requests) {
            t += &format!("\n  bytes written     {bytes}");
        }
    }
    if let Some(path) = kept {
        t += &format!("\nindex kept in {}", path.display());
    }
    t
}
