//! `head-to-head` (issue 43, first version): `superfluid-warm serve` against `vllm-router`
//! (`kv_aware`, `round_robin`) and the SGLang gateway (`smg`, `cache_aware`), each in turn in
//! front of fresh simulated engines, on the same requests at the same offered times.
//!
//! - **Engines**: `--engines` simulated vLLM engines (`harness::openai_engine`): 16-token blocks,
//!   an LRU of `--capacity` blocks, KV events over ZMQ with a replay endpoint, `cached_tokens`
//!   in usage, and a time model (a batch limit that queues; prefill a constant plus a time per
//!   uncached token; a time per output token), so the time to first token depends on the
//!   routing.
//! - **Workload**: the conversation trace's first `--requests` requests at their own arrival
//!   times, sped up `--speedup` times. Prompts are text in a word-level vocabulary that the
//!   engines' `tokenizer.json` (written here) turns back into the trace's tokens (each token id
//!   modulo the vocabulary): every router sees the same text, and every engine the same ids.
//! - **Figures per router**: time to first token p50 / p99 and end to end p50 (from the
//!   client, streamed), the engines' cached share (`cached_tokens` / prompt tokens), requests
//!   per engine max / min, requests refused.

mod client;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use harness::openai_engine::{EngineConfig, OpenAiEngine};
use serde_json::json;

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
    /// One JSON object at the end.
    #[arg(long)]
    json: bool,
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
    let port = free_port();
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
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
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).ok()?;
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

fn main() {
    let args = Args::parse();
    let requests = harness::trace::read(&args.trace).expect("the trace");
    let requests: Vec<_> = requests.into_iter().skip(args.skip).take(args.requests).collect();
    let start_ms = requests.first().map_or(0, |r| r.timestamp);
    let prompts: Vec<(f64, String, usize)> = requests
        .iter()
        .map(|r| {
            let words: Vec<String> = r.tokens().iter().map(|t| format!("w{}", t % args.vocab)).collect();
            let offset = (r.timestamp - start_ms) as f64 / 1000.0 / args.speedup;
            (offset, words.join(" "), r.output_length.clamp(1, args.max_tokens))
        })
        .collect();
    let span = prompts.last().map_or(0.0, |p| p.0);
    eprintln!("head-to-head: {} requests over {span:.1} s", prompts.len());
    let mut report = json!({"requests": prompts.len(), "span_s": span, "engines": args.engines});
    let mut table = Vec::new();
    for name in &args.routers {
        let dir = tempfile::tempdir().expect("a temporary directory");
        write_tokenizer(dir.path(), args.vocab);
        let engines: Vec<OpenAiEngine> = (0..args.engines)
            .map(|_| {
                let mut config = EngineConfig::instant("m", Some(dir.path().to_path_buf()), args.capacity);
                config.batch = args.batch;
                config.prefill_base = Duration::from_millis(2);
                config.prefill_per_token = Duration::from_secs_f64(args.prefill_us_per_token / 1e6);
                config.decode_per_token = Duration::from_millis(5);
                config.word_level = Some(args.vocab);
                OpenAiEngine::start(config).expect("an engine")
            })
            .collect();
        let Some((router, addr)) = start_router(name, &args, &engines, dir.path()) else {
            table.push(format!("  {name:<8} did not start"));
            report[name] = json!("did not start");
            continue;
        };
        let outcomes = run(addr, &prompts);
        drop(router);
        if name == "serve" {
            // Its own count of predicted against delivered, from its status file.
            let status = std::fs::read_to_string(dir.path().join("serve.redb.listen.json")).unwrap_or_default();
            let status: serde_json::Value = serde_json::from_str(&status).unwrap_or_default();
            let sum = |k: &str| {
                status["routes"].as_array().map_or(0, |r| r.iter().filter_map(|e| e[k].as_u64()).sum::<u64>())
            };
            let (p, d, a, m) = (sum("predicted_tokens"), sum("delivered_tokens"), sum("answered"), sum("mispredicted"));
            report["serve_predicted"] =
                json!({"predicted_tokens": p, "delivered_tokens": d, "answered": a, "mispredicted": m});
            eprintln!(
                "head-to-head: serve predicted {p} tokens warm, the engines delivered {d} ({a} answers, {m} off by more than 64)"
            );
        }
        let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.ok).collect();
        let ttft: Vec<f64> = ok.iter().map(|o| o.ttft * 1e3).collect();
        let e2e: Vec<f64> = ok.iter().map(|o| o.e2e * 1e3).collect();
        let prompt: u64 = ok.iter().map(|o| o.prompt).sum();
        let cached: u64 = ok.iter().map(|o| o.cached).sum();
        let share = if prompt == 0 { 0.0 } else { 100.0 * cached as f64 / prompt as f64 };
        let served: Vec<usize> = engines.iter().map(OpenAiEngine::served).collect();
        let (max, min) = (served.iter().max().copied().unwrap_or(0), served.iter().min().copied().unwrap_or(0));
        let refused = outcomes.len() - ok.len();
        table.push(format!(
            "  {name:<8} TTFT p50 {:.0} ms, p99 {:.0} ms; end to end p50 {:.0} ms; cached {share:.1}%; requests per engine max/min {max}/{min}; refused {refused}",
            quantile(&ttft, 0.5), quantile(&ttft, 0.99), quantile(&e2e, 0.5)
        ));
        report[name] = json!({
            "ttft_p50_ms": quantile(&ttft, 0.5), "ttft_p99_ms": quantile(&ttft, 0.99),
            "e2e_p50_ms": quantile(&e2e, 0.5), "cached_share": share, "served": served, "refused": refused,
        });
        eprintln!("{}", table.last().map_or("", String::as_str));
    }
    println!(
        "head-to-head: {} requests of the conversation trace over {span:.1} s, {} engines",
        prompts.len(),
        args.engines
    );
    for line in &table {
        println!("{line}");
    }
    if args.json {
        println!("{report}");
    }
}

/// Sends every prompt at its offered time (each on a thread of its own); every outcome.
fn run(addr: SocketAddr, prompts: &[(f64, String, usize)]) -> Vec<Outcome> {
    let outcomes = Arc::new(Mutex::new(vec![Outcome::default(); prompts.len()]));
    let started = Instant::now();
    let mut threads = Vec::new();
    for (i, (at, text, max_tokens)) in prompts.iter().enumerate() {
        let wait = Duration::from_secs_f64(*at).saturating_sub(started.elapsed());
        std::thread::sleep(wait);
        let body = json!({
            "model": "m", "prompt": text, "max_tokens": max_tokens, "stream": true,
            "stream_options": {"include_usage": true},
        })
        .to_string();
        let outcomes = Arc::clone(&outcomes);
        threads.push(std::thread::spawn(move || {
            let sent = Instant::now();
            let outcome = match client::stream(addr, "/v1/completions", &body) {
                Ok(s) if s.status == 200 => Outcome {
                    ok: s.first.is_some(),
                    ttft: s.first.map_or(0.0, |f| f.duration_since(sent).as_secs_f64()),
                    e2e: sent.elapsed().as_secs_f64(),
                    prompt: s.usage.as_ref().and_then(|u| u["prompt_tokens"].as_u64()).unwrap_or(0),
                    cached: s
                        .usage
                        .as_ref()
                        .and_then(|u| u["prompt_tokens_details"]["cached_tokens"].as_u64())
                        .unwrap_or(0),
                },
                _ => Outcome::default(),
            };
            if let Ok(mut o) = outcomes.lock()
                && let Some(slot) = o.get_mut(i)
            {
                *slot = outcome;
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    Arc::try_unwrap(outcomes).ok().and_then(|m| m.into_inner().ok()).unwrap_or_default()
}
