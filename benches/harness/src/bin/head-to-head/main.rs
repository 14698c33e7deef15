//! `head-to-head` (issue 43): `superfluid-warm serve` against `vllm-router` (`kv_aware`,
//! `round_robin`) and the SGLang gateway (`smg`, `cache_aware`), each in turn in front of fresh
//! simulated engines, on the same requests at the same offered times, `--runs` times.
//!
//! - **Engines**: `--engines` simulated vLLM engines (`harness::openai_engine`): 16-token blocks,
//!   an LRU of `--capacity` blocks, KV events over ZMQ with a replay endpoint, `cached_tokens`
//!   in usage, and a time model (a batch limit that queues; prefills one at a time, a constant
//!   plus a time per uncached token; both in arrival order; a time per output token), so the
//!   time to first token depends on the routing.
//! - **Workloads** (`--workloads`): `conversation`, the conversation trace's first
//!   `--requests` requests at their own arrival times, sped up `--speedup` times; prompts are
//!   text in a word-level vocabulary that the engines' `tokenizer.json` (written here) turns
//!   back into the trace's tokens (each token id modulo the vocabulary): every router sees the
//!   same text, and every engine the same ids. `engine-restart`: the same, with engine 0
//!   restarted on its ports halfway, its cache empty, nobody told. `head-restart`: the same,
//!   with the router killed halfway and started again (serve on its index file; the peers
//!   start empty); the cached share of the requests of its first minute back is reported.
//!   `burst`: `--burst` requests at once sharing a new prefix of `--burst-prefix` words, each
//!   with its own 32-word question, `--burst-rounds` times, 2 s apart.
//! - **Figures per router and workload**: time to first token p50 / p99 and end to end p50
//!   (from the client, streamed; a client whose connection is refused tries again for up to
//!   30 s, and the wait counts), the engines' cached share (`cached_tokens` / prompt tokens),
//!   requests per engine max / min, requests refused, and serve's predicted against delivered;
//!   on the trace's workloads, the TTFT p50 of its warm requests (a conversation's next turn:
//!   at most 80% of the tokens new to the trace) and of its cold ones apart. With several runs,
//!   each figure's median and range.

mod client;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use clap::Parser;
use harness::openai_engine::{EngineConfig, OpenAiEngine};
use serde_json::{Value, json};

#[derive(Parser)]
#[command(name = "head-to-head", about = "serve against vllm-router and smg on the same engines and requests")]
struct Args {
    /// The trace.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../traces/mooncake-conversation.jsonl"))]
    trace: PathBuf,
    /// Requests from the trace, from `--skip` on.
    #[arg(long, default_value_t = 600)]
    requests: usize,
    /// Requests of the trace's start left out.
    #[arg(long, default_value_t = 0)]
    skip: usize,
    /// The trace's time divided by this.
    #[arg(long, default_value_t = 20.0)]
    speedup: f64,
    /// Engines.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    /// Blocks each engine's prefix cache holds.
    #[arg(long, default_value_t = 16_384)]
    capacity: usize,
    /// Requests an engine runs at once.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Prefill: microseconds per uncached prompt token.
    #[arg(long, default_value_t = 8.0)]
    prefill_us_per_token: f64,
    /// Output tokens a request (the trace's output length, at most this).
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Words in the vocabulary.
    #[arg(long, default_value_t = 50_000)]
    vocab: u32,
    /// Routers, in turn: serve, vllm-kv, vllm-rr, smg.
    #[arg(long, value_delimiter = ',', default_value = "serve,vllm-kv,vllm-rr,smg")]
    routers: Vec<String>,
    /// Options passed to `serve` (e.g. `--queue-weight 0.5`), space-separated.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    serve_options: String,
    /// The venv's bin folder with `vllm-router` and `smg`.
    #[arg(long, default_value = "")]
    peers: String,
    /// Workloads, in turn: conversation, engine-restart, head-restart, burst.
    #[arg(long, value_delimiter = ',', default_value = "conversation")]
    workloads: Vec<String>,
    /// Runs of every workload and router (figures are medians, with their range).
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// The burst: requests at once.
    #[arg(long, default_value_t = 48)]
    burst: usize,
    /// The burst: words of the shared prefix.
    #[arg(long, default_value_t = 4096)]
    burst_prefix: usize,
    /// The burst: rounds, each with a new prefix.
    #[arg(long, default_value_t = 4)]
    burst_rounds: usize,
    /// One JSON object at the end.
    #[arg(long)]
    json: bool,
    /// Write each request's outcome to this folder, a file per router and run
    /// (`ROUTER-N.tsv`: offered time, TTFT, end to end, prompt and cached tokens), to read where
    /// a tail comes from.
    #[arg(long)]
    requests_out: Option<PathBuf>,
}

/// The word-level model: `tokenizer.json` of `vocab` words `w0` .. and `[UNK]`.
fn write_tokenizer(dir: &Path, vocab: u32) {
    let mut words = serde_json::Map::new();
    for i in 0..vocab {
        words.insert(format!("w{i}"), json!(i));
    }
    words.insert("[UNK]".into(), json!(vocab));
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": words, "unk_token": "[UNK]"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("tokenizer.json");
    std::fs::write(dir.join("tokenizer_config.json"), "{}").expect("tokenizer_config.json");
}

/// A router process, killed when dropped.
struct Router(Child);

impl Router {
    /// SIGTERM, and up to 30 s to finish (serve then writes its last status); killed after.
    fn stop(mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if self.0.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("a free port")
}

/// Starts router `name` in front of `engines`; its address once it answers.
fn start_router(name: &str, args: &Args, engines: &[OpenAiEngine], dir: &Path) -> Option<(Router, SocketAddr)> {
    start_router_on(name, args, engines, dir, ([127, 0, 0, 1], free_port()).into())
}

/// Starts router `name` at `addr` in front of `engines`; its address once it answers.
fn start_router_on(
    name: &str,
    args: &Args,
    engines: &[OpenAiEngine],
    dir: &Path,
    addr: SocketAddr,
) -> Option<(Router, SocketAddr)> {
    let port = addr.port();
    let peer = |bin: &str| if args.peers.is_empty() { bin.to_string() } else { format!("{}/{bin}", args.peers) };
    let urls: Vec<String> = engines.iter().map(OpenAiEngine::url).collect();
    let mut command = match name {
        "serve" => {
            let exe = std::env::current_exe().ok()?.with_file_name("superfluid-warm");
            let mut c = Command::new(exe);
            c.args(["serve", &dir.join("serve.redb").display().to_string(), "--listen", &addr.to_string()]);
            c.args(["--model", "m", "--tokenizer", &dir.display().to_string()]);
            for (i, e) in engines.iter().enumerate() {
                c.args(["--engine", &format!("e{i}={},events={},replay={}", e.url(), e.events, e.replay)]);
            }
            c.args(args.serve_options.split_whitespace());
            c
        }
        "vllm-kv" | "vllm-rr" => {
            let mut c = Command::new(peer("vllm-router"));
            c.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--worker-urls"]).args(&urls);
            c.args(["--prometheus-port", &free_port().to_string(), "--worker-startup-check-interval", "1"]);
            c.args(["--log-level", "warning"]);
            if name == "vllm-kv" {
                c.args(["--policy", "kv_aware", "--kv-event-block-size", "16", "--kv-event-model", "m"]);
                for e in engines {
                    c.args(["--kv-event-source", &format!("{}={}", e.url(), e.events)]);
                    c.args(["--kv-event-replay-source", &format!("{}={}", e.url(), e.replay)]);
                }
            } else {
                c.args(["--policy", "round_robin"]);
            }
            c
        }
        "smg" => {
            let mut c = Command::new(peer("smg"));
            c.args(["launch", "--host", "127.0.0.1", "--port", &port.to_string(), "--policy", "cache_aware"]);
            c.args(["--prometheus-port", &free_port().to_string(), "--worker-startup-check-interval", "1"]);
            c.arg("--worker-urls").args(&urls);
            c
        }
        _ => return None,
    };
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{name}.log"))).ok()?;
    let child = command.stdout(Stdio::null()).stderr(log).spawn().ok()?;
    let router = Router(child);
    let started = Instant::now();
    let body = json!({"model": "m", "prompt": "w1 w2 w3", "max_tokens": 1}).to_string();
    while started.elapsed() < Duration::from_secs(90) {
        if client::stream(addr, "/v1/completions", &body).is_ok_and(|r| r.status == 200) {
            return Some((router, addr));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    eprintln!(
        "head-to-head: {name} did not answer within 90 s (its log: {})",
        dir.join(format!("{name}.log")).display()
    );
    None
}

/// One request's outcome.
#[derive(Clone, Debug, Default)]
struct Outcome {
    ok: bool,
    /// When it was sent, seconds after the workload's start.
    at: f64,
    ttft: f64,
    e2e: f64,
    prompt: u64,
    cached: u64,
}

fn quantile(v: &[f64], q: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((s.len() as f64 - 1.0) * q).round() as usize;
    s.get(i).copied().unwrap_or(f64::NAN)
}

/// What happens halfway through a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Midway {
    Nothing,
    /// Engine 0 restarts on its ports, its cache empty; nobody tells the router.
    EngineRestart,
    /// The router is killed and started again.
    HeadRestart,
}

/// How long after a restart the cached share is reported on its own.
const AFTER_RESTART: f64 = 60.0;

/// One router's figures on one workload in one run.
#[derive(Clone, Debug, Default)]
struct Figures {
    ttft_p50: f64,
    ttft_p99: f64,
    e2e_p50: f64,
    cached: f64,
    max: usize,
    min: usize,
    refused: usize,
    /// The cached share of the requests sent in the first minute after a restart.
    after_restart: Option<f64>,
    /// serve's own count: tokens predicted warm, tokens the engines delivered.
    predicted: Option<(u64, u64)>,
    /// Prompt tokens of the requests answered.
    prompt_tokens: u64,
    /// TTFT p50 of the requests the trace makes warm and of those it makes cold (see
    /// [`trace_warm`]), on the conversation trace.
    warm_cold_p50: Option<(f64, f64)>,
}

/// A prompt: when it is sent (seconds after the start), its text, its output tokens.
type Prompt = (f64, String, usize);

/// The prompts of the trace's `requests` (from `--skip`, `--requests` of them).
fn trace_prompts(args: &Args, requests: &[harness::trace::Request]) -> Vec<Prompt> {
    let start_ms = requests.first().map_or(0, |r| r.timestamp);
    requests
        .iter()
        .map(|r| {
            let words: Vec<String> = r.tokens().iter().map(|t| format!("w{}", t % args.vocab)).collect();
            let offset = (r.timestamp - start_ms) as f64 / 1000.0 / args.speedup;
            (offset, words.join(" "), r.output_length.clamp(1, args.max_tokens))
        })
        .collect()
}

/// Which of the trace's requests are warm: at most 80% of their tokens new to the trace (past
/// the longest start of their blocks that an earlier request had), as a conversation's next
/// turn is; the others are cold, new prompts whatever the router does.
fn trace_warm(requests: &[harness::trace::Request]) -> Vec<bool> {
    let mut seen = std::collections::HashSet::new();
    requests
        .iter()
        .map(|r| {
            let known = r.hash_ids.iter().take_while(|h| seen.contains(*h)).count();
            let new = r.input_length.saturating_sub(known * harness::trace::TOKENS_PER_HASH_ID);
            seen.extend(r.hash_ids.iter().copied());
            new as f64 <= 0.8 * r.input_length as f64
        })
        .collect()
}

/// The burst's prompts: rounds 2 s apart, each of `--burst` requests at once sharing a new
/// prefix, each with its own 32-word question.
fn burst_prompts(args: &Args) -> Vec<Prompt> {
    let word = |n: u64| format!("w{}", n.wrapping_mul(2_654_435_761) % u64::from(args.vocab));
    let mut prompts = Vec::new();
    for round in 0..args.burst_rounds as u64 {
        let prefix: Vec<String> = (0..args.burst_prefix as u64).map(|i| word(round * 10_000_000 + i)).collect();
        for j in 0..args.burst as u64 {
            let question: Vec<String> = (0..32).map(|k| word(round * 10_000_000 + 5_000_000 + j * 32 + k)).collect();
            let text = format!("{} {}", prefix.join(" "), question.join(" "));
            prompts.push((round as f64 * 2.0, text, args.max_tokens));
        }
    }
    prompts
}

/// An engine as the benchmark runs them, on `ports` (0: any); ports just given up by an
/// engine that stopped are tried again for up to 10 s.
fn engine(args: &Args, dir: &Path, ports: (u16, u16, u16)) -> OpenAiEngine {
    let started = Instant::now();
    loop {
        match try_engine(args, dir, ports) {
            Ok(engine) => return engine,
            Err(e) if started.elapsed() < Duration::from_secs(10) => {
                eprintln!("head-to-head: an engine on {ports:?} did not start ({e}); again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("an engine on {ports:?} did not start: {e}"),
        }
    }
}

fn try_engine(args: &Args, dir: &Path, ports: (u16, u16, u16)) -> std::io::Result<OpenAiEngine> {
    let mut config = EngineConfig::instant("m", Some(dir.to_path_buf()), args.capacity);
    config.batch = args.batch;
    config.prefill_base = Duration::from_millis(2);
    config.prefill_per_token = Duration::from_secs_f64(args.prefill_us_per_token / 1e6);
    config.decode_per_token = Duration::from_millis(5);
    config.word_level = Some(args.vocab);
    config.ports = ports;
    OpenAiEngine::start(config).map_err(std::io::Error::other)
}

/// An endpoint's port.
fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
}

/// Router `name` on `workload`: fresh engines, the prompts at their times, what happens
/// halfway. `None` if the router did not start.
fn measure(name: &str, args: &Args, prompts: &[Prompt], warm: Option<&[bool]>, midway: Midway) -> Option<Figures> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    write_tokenizer(dir.path(), args.vocab);
    let engines: Mutex<Vec<OpenAiEngine>> =
        Mutex::new((0..args.engines).map(|_| engine(args, dir.path(), (0, 0, 0))).collect());
    let first = {
        let engines = engines.lock().ok()?;
        start_router(name, args, &engines, dir.path())?
    };
    let router = Mutex::new(Some(first.0));
    let addr = first.1;
    let halfway = prompts.get(prompts.len() / 2).map_or(0.0, |p| p.0);
    let action = || match midway {
        Midway::Nothing => {}
        Midway::EngineRestart => {
            if let Ok(mut engines) = engines.lock() {
                let old = engines.remove(0);
                let ports = (old.addr.port(), port_of(&old.events), port_of(&old.replay));
                drop(old);
                engines.insert(0, engine(args, dir.path(), ports));
            }
        }
        Midway::HeadRestart => {
            if let Ok(mut router) = router.lock() {
                // Killed, as a crash would.
                drop(router.take());
                let engines = engines.lock().expect("the engines");
                // On the same port, so that the clients find it again.
                *router = start_router_on(name, args, &engines, dir.path(), addr).map(|r| r.0);
            }
        }
    };
    let (outcomes, restarted) = run(addr, prompts, (midway != Midway::Nothing).then_some((halfway, &action)));
    if let Some(router) = router.lock().ok()?.take() {
        router.stop();
    }
    let mut figures = Figures::default();
    if name == "serve" {
        // Its own count of predicted against delivered, from its status file.
        let status = std::fs::read_to_string(dir.path().join("serve.redb.listen.json")).unwrap_or_default();
        let status: Value = serde_json::from_str(&status).unwrap_or_default();
        let sum =
            |k: &str| status["routes"].as_array().map_or(0, |r| r.iter().filter_map(|e| e[k].as_u64()).sum::<u64>());
        figures.predicted = Some((sum("predicted_tokens"), sum("delivered_tokens")));
    }
    if let Some(out) = &args.requests_out {
        write_outcomes(out, name, &outcomes);
    }
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
    let share = |o: &[&Outcome]| {
        let prompt: u64 = o.iter().map(|o| o.prompt).sum();
        let cached: u64 = o.iter().map(|o| o.cached).sum();
        if prompt == 0 { 0.0 } else { 100.0 * cached as f64 / prompt as f64 }
    };
    let ttft: Vec<f64> = ok.iter().map(|o| o.ttft * 1e3).collect();
    let e2e: Vec<f64> = ok.iter().map(|o| o.e2e * 1e3).collect();
    (figures.ttft_p50, figures.ttft_p99, figures.e2e_p50) =
        (quantile(&ttft, 0.5), quantile(&ttft, 0.99), quantile(&e2e, 0.5));
    figures.warm_cold_p50 = warm.map(|warm| {
        let p50 = |want: bool| {
            let ttft: Vec<f64> =
                outcomes.iter().zip(warm).filter(|(o, w)| o.ok && **w == want).map(|(o, _)| o.ttft * 1e3).collect();
            quantile(&ttft, 0.5)
        };
        (p50(true), p50(false))
    });
    figures.cached = share(&ok);
    figures.prompt_tokens = ok.iter().map(|o| o.prompt).sum();
    figures.after_restart = restarted.map(|at| {
        let after: Vec<&Outcome> = ok.iter().copied().filter(|o| o.at >= at && o.at < at + AFTER_RESTART).collect();
        share(&after)
    });
    let served: Vec<usize> = engines.lock().map(|e| e.iter().map(OpenAiEngine::served).collect()).unwrap_or_default();
    figures.max = served.iter().max().copied().unwrap_or(0);
    figures.min = served.iter().min().copied().unwrap_or(0);
    figures.refused = outcomes.len() - ok.len();
    Some(figures)
}

/// Writes `outcomes` to `dir/NAME-N.tsv`, N the first number not taken.
fn write_outcomes(dir: &Path, name: &str, outcomes: &[Outcome]) {
    use std::fmt::Write as _;
    let mut text = String::from("request\tat_s\tok\tttft_ms\te2e_ms\tprompt\tcached\n");
    for (i, o) in outcomes.iter().enumerate() {
        let _ = writeln!(
            text,
            "{i}\t{:.4}\t{}\t{:.2}\t{:.2}\t{}\t{}",
            o.at,
            u8::from(o.ok),
            o.ttft * 1e3,
            o.e2e * 1e3,
            o.prompt,
            o.cached
        );
    }
    let _ = std::fs::create_dir_all(dir);
    let path = (1..).map(|n| dir.join(format!("{name}-{n}.tsv"))).find(|p| !p.exists());
    if let Some(path) = path
        && let Err(e) = std::fs::write(&path, text)
    {
        eprintln!("head-to-head: could not write {}: {e}", path.display());
    }
}

/// The median of `v` and its range, as text with `unit`.
fn spread(v: &[f64], digits: usize, unit: &str) -> String {
    let (lo, hi) =
        (v.iter().copied().fold(f64::INFINITY, f64::min), v.iter().copied().fold(f64::NEG_INFINITY, f64::max));
    match v.len() {
        0 => "-".into(),
        1 => format!("{:.digits$}{unit}", lo),
        _ => format!("{:.digits$}{unit} [{lo:.digits$}-{hi:.digits$}]", quantile(v, 0.5)),
    }
}

fn main() {
    let args = Args::parse();
    let workloads: Vec<(String, Midway)> = args
        .workloads
        .iter()
        .map(|w| match w.as_str() {
            "conversation" => (w.clone(), Midway::Nothing),
            "engine-restart" => (w.clone(), Midway::EngineRestart),
            "head-restart" => (w.clone(), Midway::HeadRestart),
            "burst" => (w.clone(), Midway::Nothing),
            other => {
                eprintln!("head-to-head: no workload {other} (conversation, engine-restart, head-restart, burst)");
                std::process::exit(2)
            }
        })
        .collect();
    let requests = harness::trace::read(&args.trace).expect("the trace");
    let requests: Vec<_> = requests.into_iter().skip(args.skip).take(args.requests).collect();
    let conversation = trace_prompts(&args, &requests);
    let span = conversation.last().map_or(0.0, |p| p.0);
    eprintln!("head-to-head: {} requests of the trace over {span:.1} s", conversation.len());
    let burst = burst_prompts(&args);
    let warm = trace_warm(&requests);
    let mut figures: BTreeMap<(usize, usize), Vec<Figures>> = BTreeMap::new();
    let mut missing: BTreeMap<usize, String> = BTreeMap::new();
    for run in 0..args.runs {
        for (w, (workload, midway)) in workloads.iter().enumerate() {
            let (prompts, warm) =
                if workload == "burst" { (&burst, None) } else { (&conversation, Some(warm.as_slice())) };
            for (r, name) in args.routers.iter().enumerate() {
                match measure(name, &args, prompts, warm, *midway) {
                    Some(f) => {
                        eprintln!("head-to-head: run {} {workload} {name}: {f:?}", run + 1);
                        figures.entry((w, r)).or_default().push(f);
                    }
                    None => {
                        missing.insert(r, format!("{name} did not start"));
                    }
                }
            }
        }
    }
    println!(
        "head-to-head: {} engines; conversation: {} requests of the trace over {span:.1} s; {} run(s): medians [min-max]",
        args.engines,
        conversation.len(),
        args.runs
    );
    let mut report =
        json!({"engines": args.engines, "requests": conversation.len(), "span_s": span, "runs": args.runs});
    for (w, (workload, _)) in workloads.iter().enumerate() {
        println!("  {workload}:");
        for (r, name) in args.routers.iter().enumerate() {
            let Some(runs) = figures.get(&(w, r)) else {
                println!("    {name:<8} {}", missing.get(&r).map_or("no figures", String::as_str));
                report[workload][name] = json!(missing.get(&r));
                continue;
            };
            let col = |f: fn(&Figures) -> f64| runs.iter().map(f).collect::<Vec<f64>>();
            let mut line = format!(
                "    {name:<8} TTFT p50 {}, p99 {}; end to end p50 {}; cached {}; requests per engine max/min {}; refused {}",
                spread(&col(|f| f.ttft_p50), 0, " ms"),
                spread(&col(|f| f.ttft_p99), 0, " ms"),
                spread(&col(|f| f.e2e_p50), 0, " ms"),
                spread(&col(|f| f.cached), 1, "%"),
                spread(&col(|f| f.max as f64 / f.min.max(1) as f64), 2, ""),
                spread(&col(|f| f.refused as f64), 0, ""),
            );
            if runs.iter().any(|f| f.warm_cold_p50.is_some()) {
                line += &format!(
                    "; TTFT p50 of the trace's warm requests {}, of its cold {}",
                    spread(&col(|f| f.warm_cold_p50.map_or(f64::NAN, |w| w.0)), 0, " ms"),
                    spread(&col(|f| f.warm_cold_p50.map_or(f64::NAN, |w| w.1)), 0, " ms")
                );
            }
            if runs.iter().any(|f| f.after_restart.is_some()) {
                line += &format!(
                    "; cached in the first minute after the restart {}",
                    spread(&col(|f| f.after_restart.unwrap_or(f64::NAN)), 1, "%")
                );
            }
            if runs.iter().any(|f| f.predicted.is_some()) {
                // Points of the cached share: (predicted - delivered) / prompt tokens.
                let gap = |f: &Figures| {
                    f.predicted.map_or(f64::NAN, |(p, d)| 100.0 * (p as f64 - d as f64) / f.prompt_tokens.max(1) as f64)
                };
                line += &format!("; predicted - delivered {} points", spread(&col(gap), 2, ""));
            }
            println!("{line}");
            report[workload][name] =
                json!(runs.iter().map(|f| json!({
                "ttft_p50_ms": f.ttft_p50, "ttft_p99_ms": f.ttft_p99, "e2e_p50_ms": f.e2e_p50,
                "cached_share": f.cached, "requests_max": f.max, "requests_min": f.min, "refused": f.refused,
                "after_restart_cached_share": f.after_restart, "predicted_delivered": f.predicted,
                "warm_cold_ttft_p50_ms": f.warm_cold_p50,
            })).collect::<Vec<_>>());
        }
    }
    if args.json {
        println!("{report}");
    }
}

/// Sends every prompt at its offered time (each on a thread of its own), with `midway`'s
/// action at its time; every outcome, and when the action was done (seconds after the start).
fn run(addr: SocketAddr, prompts: &[Prompt], midway: Option<(f64, &(dyn Fn() + Sync))>) -> (Vec<Outcome>, Option<f64>) {
    let outcomes = Mutex::new(vec![Outcome::default(); prompts.len()]);
    let started = Instant::now();
    let mut done = None;
    std::thread::scope(|scope| {
        let action = midway.map(|(at, action)| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_secs_f64(at).saturating_sub(started.elapsed()));
                action();
                started.elapsed().as_secs_f64()
            })
        });
        for (i, (at, text, max_tokens)) in prompts.iter().enumerate() {
            std::thread::sleep(Duration::from_secs_f64(*at).saturating_sub(started.elapsed()));
            let body = json!({
                "model": "m", "prompt": text, "max_tokens": max_tokens, "stream": true,
                "stream_options": {"include_usage": true},
            })
            .to_string();
            let outcomes = &outcomes;
            scope.spawn(move || {
                let sent = Instant::now();
                let at = started.elapsed().as_secs_f64();
                // A router that is down (restarting) refuses connections: the client tries
                // again for a while, as clients do, and the wait counts.
                let answer = loop {
                    match client::stream(addr, "/v1/completions", &body) {
                        Err(e)
                            if e.kind() == std::io::ErrorKind::ConnectionRefused
                                && sent.elapsed() < Duration::from_secs(30) =>
                        {
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        other => break other,
                    }
                };
                let outcome = match answer {
                    Ok(s) if s.status == 200 => Outcome {
                        ok: s.first.is_some(),
                        at,
                        ttft: s.first.map_or(0.0, |f| f.duration_since(sent).as_secs_f64()),
                        e2e: sent.elapsed().as_secs_f64(),
                        prompt: s.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()).unwrap_or(0),
                        cached: s
                            .usage
                            .as_ref()
                            .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
                            .unwrap_or(0),
                    },
                    _ => Outcome { at, ..Outcome::default() },
                };
                if let Ok(mut o) = outcomes.lock()
                    && let Some(slot) = o.get_mut(i)
                {
                    *slot = outcome;
                }
            });
        }
        done = action.and_then(|a| a.join().ok());
    });
    (outcomes.into_inner().unwrap_or_default(), done)
}
