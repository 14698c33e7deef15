//! The command line. The only module that knows clap and how output is formatted.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::json;
use superfluid_warm::replay::{self, Config, Policy, Report, Timing};
use superfluid_warm::{Check, DumpEntry, Error, Snapshot, Warm, hex, integrity_check_copy, recovered_copy, trace};

#[derive(Parser)]
#[command(name = "superfluid-warm", version, about = "Which node last ran each prompt prefix: inspect, import, replay")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Every entry, newest first; reads the file live while a head writes it.
    Dump {
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
    },
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
        /// Recover a file left by a crashed head (opens it as a writer, which repairs it).
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
        /// The index file (created if absent).
        path: PathBuf,
    },
    /// Replays a conversation workload through the index and reports what routing found.
    Replay {
        /// A Mooncake JSONL trace; without it, a built-in synthetic conversation workload.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Only the first N requests.
        #[arg(long)]
        requests: Option<usize>,
        /// Nodes in the cluster.
        #[arg(long, default_value_t = 8)]
        nodes: usize,
        /// Routing policy.
        #[arg(long, value_enum, default_value_t = PolicyArg::Balanced)]
        policy: PolicyArg,
        /// Load window, in requests.
        #[arg(long, default_value_t = 256)]
        window: usize,
        /// Share of the prompt the warm prefix must cover (balanced).
        #[arg(long, default_value_t = 0.5)]
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
        /// As one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Test support: runs `ran`s in a loop, printing `durable N` after each sync returns.
    #[command(hide = true)]
    TortureWriter {
        /// The index file.
        #[arg(long)]
        db: PathBuf,
        /// Seed of the workload.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Index capacity (small, to exercise eviction).
        #[arg(long, default_value_t = 4096)]
        capacity: u64,
        /// Stop after this many rans (0: never).
        #[arg(long, default_value_t = 0)]
        rans: u64,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum PolicyArg {
    Balanced,
    Warmest,
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

fn run(command: Command) -> Result<ExitCode, Error> {
    let out = &mut std::io::stdout().lock();
    match command {
        Command::Dump { path, json, node, limit, oldest_first } => dump(out, &path, json, node, limit, oldest_first),
        Command::Stats { path, json } => stats(out, &path, json),
        Command::Check { path, json, repair } => check(out, &path, json, repair),
        Command::Compact { path } => {
            let done = superfluid_warm::compact(&path)?;
            emit(out, &format!("compacted {}: {} -> {} bytes", path.display(), done.bytes_before, done.bytes_after))
        }
        Command::Import { old, path } => {
            let warm = Warm::open(&path)?;
            let report = warm.import_json(&old)?;
            warm.close()?;
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
        Command::Replay {
            trace,
            requests,
            nodes,
            policy,
            window,
            min_share,
            balance_abs,
            db,
            capacity,
            no_baseline,
            vocab,
            json,
        } => {
            let config = Config {
                nodes,
                policy: match policy {
                    PolicyArg::Balanced => Policy::Balanced,
                    PolicyArg::Warmest => Policy::Warmest,
                },
                window,
                min_share,
                balance_abs,
                baseline: !no_baseline,
                vocab,
                ..Config::default()
            };
            replay_cmd(out, trace.as_deref(), requests, &config, db, capacity, json)
        }
        Command::TortureWriter { db, seed, capacity, rans } => torture_writer(out, &db, seed, capacity, rans),
    }
}

fn emit(out: &mut impl Write, text: &str) -> Result<ExitCode, Error> {
    writeln!(out, "{text}").map_err(stdout_error)?;
    Ok(ExitCode::SUCCESS)
}

fn stdout_error(source: std::io::Error) -> Error {
    Error::Io { path: "<stdout>".into(), source }
}

fn dump(
    out: &mut impl Write,
    path: &Path,
    json: bool,
    node: Option<String>,
    limit: Option<usize>,
    oldest_first: bool,
) -> Result<ExitCode, Error> {
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
                "model": e.model, "tenant": e.tenant, "legacy": e.tokens.is_none(),
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
        return Err(stdout_error(err));
    }
    if json {
        return Ok(ExitCode::SUCCESS);
    }
    let node_w = rows.iter().map(|e| e.node.len()).max().unwrap_or(4).max(4);
    let mut text = format!("{:<32}  {:<node_w$}  {:>12}  {:>8}  model\n", "hash", "node", "clock", "tokens");
    for e in &rows {
        let tokens = e.tokens.map_or("0.1.7".to_string(), |t| t.to_string());
        let model = match (&e.model, e.tenant) {
            (Some(m), true) => format!("{m} (tenant)"),
            (Some(m), false) => m.clone(),
            (None, _) => "(0.1.7 import)".into(),
        };
        text += &format!("{:<32}  {:<node_w$}  {:>12}  {:>8}  {model}\n", hex(&e.key), e.node, e.clock, tokens);
    }
    text += &format!("{} entries shown", rows.len());
    emit(out, &text)
}

fn stats(out: &mut impl Write, path: &Path, json: bool) -> Result<ExitCode, Error> {
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
    text += &format!("file           {} bytes\nschema         {} ({})\n", s.file_bytes, s.schema, s.hash_scheme);
    text += &match s.writer {
        Some(pid) => format!("writer         pid {pid}\n"),
        None => "writer         none (closed cleanly)\n".into(),
    };
    text += "per node:";
    for (node, n) in &s.per_node {
        text += &format!("\n  {node:<20} {n}");
    }
    emit(out, &text)
}

fn check(out: &mut impl Write, path: &Path, json: bool, repair: bool) -> Result<ExitCode, Error> {
    if repair {
        Warm::open(path)?.close()?;
    }
    // A file left by a crashed head is checked as the head would find it: on a recovered copy.
    let (snapshot, crashed, copy) = match Snapshot::open_even_if_crashed(path) {
        Ok(snapshot) => {
            let crashed = snapshot.crashed_writer();
            (snapshot, crashed.map(Some), None)
        }
        Err(Error::CrashedWriter { pid }) => {
            let copy = recovered_copy(path)?;
            (Snapshot::open_even_if_crashed(&copy)?, Some(pid), Some(copy))
        }
        // No head has it open and it fails verification: nothing of it is read.
        Err(Error::Corrupted { .. }) => return report_check(out, json, None, Some(false), None),
        Err(e) => return Err(e),
    };
    let checked = copy.as_deref().unwrap_or(path);
    // redb's own check writes (it repairs), so it runs on a copy, and only when no head is
    // writing the file (a copy taken mid-commit would not be a state redb ever left). It runs
    // first: the invariants walk every table, which redb may not survive on a corrupted file.
    // Opening the snapshot may have run it already.
    let integrity = if snapshot.pages_verified() {
        Ok(Some(true))
    } else if snapshot.writer().is_none() || crashed.is_some() || copy.is_some() {
        integrity_check_copy(checked).map(Some)
    } else {
        Ok(None)
    };
    let report = match integrity {
        Ok(Some(false)) => None,
        _ => Some(snapshot.check()),
    };
    drop(snapshot);
    if let Some(copy) = &copy {
        let _ = std::fs::remove_file(copy);
    }
    let (report, integrity) = (report.transpose()?, integrity?);
    report_check(out, json, report.as_ref(), integrity, crashed)
}

/// Prints what `check` found: the invariants (`None`: the tables were not walked), redb's
/// integrity (`None`: not checked) and whether a crashed writer left the file.
fn report_check(
    out: &mut impl Write,
    json: bool,
    report: Option<&Check>,
    integrity: Option<bool>,
    crashed: Option<Option<u32>>,
) -> Result<ExitCode, Error> {
    let healthy = integrity != Some(false) && report.is_some_and(|r| r.problems.is_empty());
    if json {
        let line = json!({
            "healthy": healthy, "entries": report.map(|r| r.entries),
            "clock_entries": report.map(|r| r.clock_entries),
            "problems": report.map_or(&[][..], |r| &r.problems[..]), "integrity": integrity,
            "crashed_writer": crashed.is_some(), "crashed_writer_pid": crashed.flatten(),
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
        text += match integrity {
            Some(true) => "redb integrity: ok\n",
            Some(false) => "redb integrity: CORRUPTED\n",
            None => "redb integrity: not checked (a head has the file open)\n",
        };
        if crashed.is_some() {
            text += "left open by a writer that crashed (checked on a recovered copy): run `check --repair` or open it with the head\n";
        }
        text += if healthy { "verdict: healthy" } else { "verdict: PROBLEMS FOUND" };
        emit(out, &text)?;
    }
    Ok(if healthy { ExitCode::SUCCESS } else { ExitCode::from(UNHEALTHY) })
}

fn replay_cmd(
    out: &mut impl Write,
    trace_path: Option<&Path>,
    requests: Option<usize>,
    config: &Config,
    db: Option<PathBuf>,
    capacity: Option<u64>,
    json: bool,
) -> Result<ExitCode, Error> {
    let (mut workload, source) = match trace_path {
        Some(p) => (trace::read(p)?, p.display().to_string()),
        None => {
            (trace::synthetic(3000, 120, 42), "built-in synthetic conversations (3000 requests, 120 sessions)".into())
        }
    };
    if let Some(n) = requests {
        workload.truncate(n);
    }
    let temporary = db.is_none();
    let path =
        db.unwrap_or_else(|| std::env::temp_dir().join(format!("superfluid-warm-replay-{}.redb", std::process::id())));
    if temporary {
        let _ = std::fs::remove_file(&path);
    }
    let mut builder = Warm::builder();
    if let Some(c) = capacity {
        builder.capacity(c);
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
    let report = replay::run(&warm, &workload, config, |i| bar.set_position(i as u64));
    bar.finish_and_clear();
    let closed = warm.close();
    if temporary {
        let _ = std::fs::remove_file(&path);
    }
    let report = report?;
    closed?;
    let text = if json {
        replay_json(&report, config, &source)
    } else {
        replay_text(&report, config, &source, &path, temporary)
    };
    emit(out, &text)
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn policy_name(p: Policy) -> &'static str {
    match p {
        Policy::Balanced => "balanced",
        Policy::Warmest => "warmest",
    }
}

fn replay_json(r: &Report, c: &Config, source: &str) -> String {
    let timing =
        |t: &Timing| json!({"p50_us": micros(t.p50), "p99_us": micros(t.p99), "total_ms": t.total.as_secs_f64() * 1e3});
    json!({
        "source": source, "policy": policy_name(c.policy), "nodes": c.nodes, "requests": r.requests,
        "prompt_tokens": r.prompt_tokens, "warm_tokens": r.warm_tokens, "warm_share": r.warm_share(),
        "warm_requests": r.warm_requests, "load": r.load, "imbalance": r.imbalance(),
        "index": timing(&r.index), "baseline_0_1_7": r.baseline.as_ref().map(timing),
        "final_sync_ms": r.final_sync.as_secs_f64() * 1e3, "entries": r.entries, "wall_ms": r.wall.as_secs_f64() * 1e3,
    })
    .to_string()
}

fn replay_text(r: &Report, c: &Config, source: &str, path: &Path, temporary: bool) -> String {
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
    t += &format!("wall                {:.2} s", r.wall.as_secs_f64());
    if !temporary {
        t += &format!("\nindex kept in {}", path.display());
    }
    t
}

fn torture_writer(out: &mut impl Write, db: &Path, seed: u64, capacity: u64, rans: u64) -> Result<ExitCode, Error> {
    let warm = Warm::builder().capacity(capacity).sync_window(Duration::from_millis(2)).open(db)?;
    let workload = trace::synthetic(TORTURE_CYCLE, 16, seed);
    let mut i = 0u64;
    while rans == 0 || i < rans {
        let request = &workload[(i % TORTURE_CYCLE as u64) as usize];
        warm.ran("torture", &torture_tokens(request), &replay::node_name(i as usize % 5))?;
        if i.is_multiple_of(3) {
            warm.sync()?;
            writeln!(out, "durable {i} {}", warm.stats()?.clock).map_err(stdout_error)?;
            out.flush().map_err(stdout_error)?;
        }
        i += 1;
    }
    warm.close()?;
    Ok(ExitCode::SUCCESS)
}

/// Requests the torture writer cycles through (`trace::synthetic(TORTURE_CYCLE, 16, seed)`).
const TORTURE_CYCLE: usize = 5000;

/// The torture writer's prompt for a request: its first 24 blocks.
fn torture_tokens(request: &trace::Request) -> Vec<u32> {
    let mut tokens = request.tokens();
    tokens.truncate(64 * 24);
    tokens
}
