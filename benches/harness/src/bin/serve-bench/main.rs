//! `serve-bench`: what `superfluid-warm serve` adds to a request, and how many it proxies, beside
//! `vllm-router --policy round_robin` in the same run.
//!
//! - **Overhead**: from the client's last byte to the engine's first, one request at a time
//!   (the first byte's time is when it reached the engine's socket, the kernel's receive time;
//!   when the engine's thread, woken, read it is given too),
//!   for chats of about 1k and 8k tokens (the Llama 3 template and a real BPE tokenizer), and for
//!   the same lengths as token ids (no tokenizing: the index's answer, the choice and the proxy).
//!   Each chat's own tokenizing time in the head (its answer's `server-timing`) is taken off to
//!   give the rest, and is set beside `Renderer::chat` run in this process (a renderer that
//!   never saw the chat) just before each request. Then the chat's next turn (one exchange
//!   more) goes to `/v1/route`, whose `took_us` is the head's tokenizing of a turn whose history
//!   it kept in pieces.
//! - **The anchor**: the same chats through `vllm-router --policy round_robin` in the same run,
//!   request by request beside the head's, first and second in turns: a Rust proxy that reads
//!   and writes the body and decides nothing, so the transport and wake-ups any head pays,
//!   measured the same way. Each router's p50 is also given by its place in the pair: the first
//!   comes just after this process's own render (the other core idle for its length), the second
//!   just after the other router's request.
//! - **Throughput**: concurrent clients on kept-alive connections send 256-token id prompts for a
//!   few seconds through each router to two engines that answer at once, each router's seconds
//!   in two halves, the head's around the peer's.
//!
//! Every figure is a median over `--runs` runs, with the range. The engines and the clients run
//! in this process; the routers are processes of their own.

mod client;
mod engine;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Parser;
use client::{Client, Sent};
use engine::{Arrival, InstantEngine};
use serde_json::{Value, json};
use superfluid_warm::Renderer;

#[derive(Parser)]
#[command(name = "serve-bench", about = "serve's overhead and throughput, beside vllm-router")]
struct Args {
    /// Runs (figures are medians over them, with their range).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Requests a size for the overhead.
    #[arg(long, default_value_t = 200)]
    requests: usize,
    /// Seconds of load for the throughput.
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// Concurrent clients for the throughput.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// `vllm-router` (PyPI's vllm-router==0.1.17); without it, serve alone is measured.
    #[arg(long, default_value = "vllm-router")]
    vllm_router: String,
    /// Chat sizes (tokens) for the overhead.
    #[arg(long, value_delimiter = ',', default_values_t = [1024usize, 8192])]
    sizes: Vec<usize>,
    /// One JSON object at the end.
    #[arg(long)]
    json: bool,
}

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/render/llama3"))
}

/// A router process, killed when dropped.
struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `superfluid-warm serve` (built beside this binary) in front of `engines`.
fn start_serve(dir: &std::path::Path, engines: &[&InstantEngine]) -> (Router, SocketAddr) {
    let exe = std::env::current_exe().expect("this binary").with_file_name("superfluid-warm");
    let mut command = Command::new(&exe);
    command
        .args(["serve", &dir.join("bench.redb").display().to_string(), "--listen", "127.0.0.1:0", "--model", "m"])
        .args(["--tokenizer", &tokenizer_dir().display().to_string()])
        // The whole prompt tokenized before the choice: the overhead splits a request's time
        // into its tokenizing and the rest, and a prompt routed on its start (the default) is
        // still being tokenized, on the same cores, while it is proxied.
        .arg("--no-route-on-start");
    for (i, e) in engines.iter().enumerate() {
        command.args(["--engine", &format!("e{i}={}", e.url())]);
    }
    let mut child =
        command.stderr(Stdio::piped()).stdout(Stdio::null()).spawn().unwrap_or_else(|e| {
            panic!("{} does not start ({e}): build it with `cargo build --release`", exe.display())
        });
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines.next().and_then(Result::ok).expect("serve says where it serves");
        if let Some(rest) = line.split(" on http://").nth(1) {
            break rest.split_whitespace().next().and_then(|a| a.parse().ok()).expect("an address");
        }
    };
    // Its log goes on; nobody reads it.
    std::thread::spawn(move || for _ in lines {});
    (Router(child), addr)
}

/// `vllm-router --policy round_robin` in front of `engines`, once it answers.
fn start_vllm_router(program: &str, engines: &[&InstantEngine]) -> Option<(Router, SocketAddr)> {
    let free = || Some(std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port());
    let (port, metrics) = (free()?, free()?);
    let mut command = Command::new(program);
    command.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", "round_robin", "--worker-urls"]);
    command.args(engines.iter().map(|e| e.url()));
    command.args(["--log-level", "warning", "--prometheus-port", &metrics.to_string()]);
    command.args(["--worker-startup-check-interval", "1"]);
    let child = command.stdout(Stdio::null()).stderr(Stdio::null()).spawn().ok()?;
    let router = Router(child);
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let started = Instant::now();
    let body = json!({"model": "m", "prompt": [1, 2, 3], "max_tokens": 1}).to_string();
    while started.elapsed() < Duration::from_secs(60) {
        if Client::new(addr).post("/v1/completions", &body, "").is_ok_and(|(s, _, _)| s == 200) {
            return Some((router, addr));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    None
}

/// A deterministic stream of words.
struct Words(u64);

impl Words {
    fn next(&mut self) -> String {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        let syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "pe", "do", "ga", "fu"];
        let n = 1 + (self.0 >> 60) as usize % 3;
        (0..n).map(|i| syllables[((self.0 >> (8 * i + 8)) % 12) as usize]).collect()
    }
}

/// A chat of about `tokens` tokens (by the renderer), distinct per `seed`.
fn chat_of(renderer: &Renderer, tokens: usize, seed: u64) -> (Value, usize) {
    let mut words = Words(seed);
    let mut text = String::new();
    loop {
        for _ in 0..64 {
            text.push_str(&words.next());
            text.push(' ');
        }
        let messages = json!([{"role": "user", "content": text}]);
        let n = renderer.chat(&messages.to_string(), None, true).map_or(0, |t| t.len());
        if n >= tokens {
            return (messages, n);
        }
    }
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted.get(i).copied().unwrap_or(f64::NAN)
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

/// From a request's last byte to its first byte at the engine, µs: into the engine's socket (the
/// kernel's stamp; without one, as read), and as the engine's thread read it.
fn took(sent: &Sent, came: &Arrival) -> (f64, f64) {
    let read = came.read.saturating_duration_since(sent.at).as_secs_f64() * 1e6;
    let socket = came.socket.and_then(|s| s.duration_since(sent.wall).ok()).map(|d| d.as_secs_f64() * 1e6);
    (socket.unwrap_or(read), read)
}

/// One run's overhead figures for one prompt size, in µs: (chat p50, chat p99, ids p50, ids
/// p99, head tokenizing p50, in-process render p50, rest p50, rest p99, index p50, the head's
/// decision less its tokenizing p50, the same body straight to an engine p50, the next turn's
/// tokenizing p50, the rest p50 and the same body straight p50 to the engine thread's read, the
/// same body through `vllm-router` p50 and p99; NaN without it; the rest p50 and `vllm-router`'s
/// p50 when first of the pair, then when second).
fn overhead(
    addr: SocketAddr,
    peer: Option<SocketAddr>,
    engines: &[&InstantEngine],
    renderer: &Renderer,
    size: usize,
    n: usize,
    run: u64,
) -> [f64; FIGURES] {
    let mut client = Client::new(addr);
    // The anchor: the same body through `vllm-router`, before or after the head's.
    let mut peer_client = peer.map(Client::new);
    let mut through_peer = Vec::new();
    // The same body straight to an engine: the transport's own share (loopback, and the wake-up
    // of a thread waiting on a socket), which any head pays once more.
    let mut direct_client = Client::new(engines.first().expect("an engine").addr);
    let (mut chat, mut ids, mut head_tok, mut local, mut rest) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut next_tok = Vec::new();
    let (mut index, mut decision, mut direct) = (Vec::new(), Vec::new(), Vec::new());
    let (mut rest_read, mut direct_read) = (Vec::new(), Vec::new());
    // The prompts first (growing one renders the same text many times: a renderer of its own,
    // so that `renderer` keeps no piece of them); then, request by request, `Renderer::chat`
    // here on the chat just before the head gets it, so that both run in the same conditions
    // (caches as cold, the same neighbours on the cores).
    let sizer = Renderer::open(tokenizer_dir()).expect("the Llama 3 tokenizer fixture");
    let prompts: Vec<(u64, Value)> = (0..n as u64)
        .map(|i| {
            let id = run * 1_000_000 + size as u64 * 1000 + i;
            (id, chat_of(&sizer, size, id).0)
        })
        .collect();
    // By the place in the pair (first: just after this process's own render, the cores' state
    // after it; second: just after the other router's request).
    let (mut rest_at, mut peer_at) = ([Vec::new(), Vec::new()], [Vec::new(), Vec::new()]);
    for (k, (id, messages)) in prompts.into_iter().enumerate() {
        let started = Instant::now();
        let tokens = renderer.chat(&messages.to_string(), None, true).expect("render");
        local.push(started.elapsed().as_secs_f64() * 1e6);
        let arrived = |id: u64| engines.iter().find_map(|e| e.arrivals.lock().ok()?.remove(&id));
        let body = json!({"model": "m", "messages": messages, "max_tokens": 1}).to_string();
        // Each request's `x-bench-id`: the chat's own id, four to a chat.
        let tag = |k: u64| id * 4 + k;
        // The anchor: the same body through `vllm-router`, before the head's or after it, in
        // turns, so that neither router always comes first.
        let head_first = k % 2 == 0;
        let mut via_peer = |place: usize| {
            let Some(peer_client) = peer_client.as_mut() else { return };
            let via = tag(1);
            let (status, _, sent) =
                peer_client.post("/v1/chat/completions", &body, &format!("x-bench-id: {via}\r\n")).expect("peer");
            assert_eq!(status, 200);
            if let Some(came) = arrived(via) {
                let took = took(&sent, &came).0;
                through_peer.push(took);
                if let Some(at) = peer_at.get_mut(place) {
                    at.push(took);
                }
            }
        };
        if !head_first {
            via_peer(0);
        }
        let (status, _, sent) =
            client.post("/v1/chat/completions", &body, &format!("x-bench-id: {}\r\n", tag(0))).expect("chat");
        assert_eq!(status, 200);
        if let Some(came) = arrived(tag(0)) {
            let (total, read) = took(&sent, &came);
            chat.push(total);
            // The head's own tokenizing time for this request (`server-timing`, ms): the rest is
            // what the decision and the proxy add.
            let timing = |name: &str| {
                client
                    .server_timing
                    .as_deref()
                    .and_then(|t| t.split(',').find_map(|part| part.trim().strip_prefix(name)?.parse::<f64>().ok()))
            };
            if let Some(t) = timing("tokenize;dur=") {
                // New to the head: it kept no piece of it.
                head_tok.push(t * 1e3);
                rest.push(total - t * 1e3);
                if let Some(at) = rest_at.get_mut(usize::from(!head_first)) {
                    at.push(total - t * 1e3);
                }
                rest_read.push(read - t * 1e3);
                if let (Some(i), Some(d)) = (timing("index;dur="), timing("decision;dur=")) {
                    index.push(i * 1e3);
                    decision.push((d - t) * 1e3);
                }
            }
        }
        if head_first {
            via_peer(1);
        }
        let hop = tag(2);
        let (status, _, sent) =
            direct_client.post("/v1/chat/completions", &body, &format!("x-bench-id: {hop}\r\n")).expect("direct");
        assert_eq!(status, 200);
        if let Some(came) = arrived(hop) {
            let (socket, read) = took(&sent, &came);
            direct.push(socket);
            direct_read.push(read);
        }
        // The same tokens as ids: no tokenizing.
        let body = json!({"model": "m", "prompt": tokens, "max_tokens": 1}).to_string();
        let (status, _, sent) =
            client.post("/v1/completions", &body, &format!("x-bench-id: {}\r\n", tag(3))).expect("ids");
        assert_eq!(status, 200);
        if let Some(came) = arrived(tag(3)) {
            ids.push(took(&sent, &came).0);
        }
        // The head's own tokenizing time for this chat's next turn (one exchange more): the
        // pieces it kept of this one are not tokenized again.
        let mut next = messages.as_array().cloned().unwrap_or_default();
        next.push(json!({"role": "assistant", "content": "the engine holds the block"}));
        next.push(json!({"role": "user", "content": "and the next window?"}));
        let body = json!({"model": "m", "messages": next}).to_string();
        let (status, answer, _) = client.post("/v1/route", &body, "").expect("route");
        assert_eq!(status, 200, "{answer}");
        let answer: Value = serde_json::from_str(&answer).expect("JSON");
        if let Some(t) = answer["took_us"]["tokenize"].as_f64() {
            next_tok.push(t);
        }
        let _ = client.post("/v1/route/done", &json!({"ticket": answer["ticket"]}).to_string(), "");
    }
    let (chat, ids, head_tok, local, rest) = (sorted(chat), sorted(ids), sorted(head_tok), sorted(local), sorted(rest));
    let (index, decision, direct, next_tok) = (sorted(index), sorted(decision), sorted(direct), sorted(next_tok));
    let (rest_read, direct_read, through_peer) = (sorted(rest_read), sorted(direct_read), sorted(through_peer));
    [
        quantile(&chat, 0.5),
        quantile(&chat, 0.99),
        quantile(&ids, 0.5),
        quantile(&ids, 0.99),
        quantile(&head_tok, 0.5),
        quantile(&local, 0.5),
        quantile(&rest, 0.5),
        quantile(&rest, 0.99),
        quantile(&index, 0.5),
        quantile(&decision, 0.5),
        quantile(&direct, 0.5),
        quantile(&next_tok, 0.5),
        quantile(&rest_read, 0.5),
        quantile(&direct_read, 0.5),
        quantile(&through_peer, 0.5),
        quantile(&through_peer, 0.99),
        quantile(&sorted(std::mem::take(&mut rest_at[0])), 0.5),
        quantile(&sorted(std::mem::take(&mut rest_at[1])), 0.5),
        quantile(&sorted(std::mem::take(&mut peer_at[0])), 0.5),
        quantile(&sorted(std::mem::take(&mut peer_at[1])), 0.5),
    ]
}

/// Figures [`overhead`] gives a run.
const FIGURES: usize = 20;

/// Requests answered through the router at `addr` from `clients` kept-alive clients in about
/// `seconds`, and the seconds they took.
fn throughput(addr: SocketAddr, clients: usize, seconds: f64) -> (u64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let threads: Vec<_> = (0..clients as u32)
        .map(|c| {
            let (stop, done, failed) = (Arc::clone(&stop), Arc::clone(&done), Arc::clone(&failed));
            std::thread::spawn(move || {
                let mut client = Client::new(addr);
                let mut i = 0u32;
                while !stop.load(Ordering::Relaxed) {
                    let prompt: Vec<u32> = (0..256).map(|t| c * 1_000_000 + i * 300 + t).collect();
                    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 1}).to_string();
                    match client.post("/v1/completions", &body, "") {
                        Ok((200, _, _)) => done.fetch_add(1, Ordering::Relaxed),
                        _ => failed.fetch_add(1, Ordering::Relaxed),
                    };
                    i += 1;
                }
            })
        })
        .collect();
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(seconds));
    let counted = done.load(Ordering::Relaxed);
    let took = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    if failed.load(Ordering::Relaxed) > 0 {
        eprintln!("serve-bench: {} requests failed", failed.load(Ordering::Relaxed));
    }
    (counted, took)
}

/// Median (of an even count, the mean of the middle two) and range of a figure over runs.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let s = sorted(v.to_vec());
    let middle = |i: usize| s.get(i).copied().unwrap_or(f64::NAN);
    let half = s.len() / 2;
    let median = match half.checked_sub(1) {
        Some(below) if s.len().is_multiple_of(2) => (middle(below) + middle(half)) / 2.0,
        _ => middle(half),
    };
    (median, middle(0), s.last().copied().unwrap_or(f64::NAN))
}

fn main() {
    let args = Args::parse();
    let renderer = Renderer::open(tokenizer_dir()).expect("the Llama 3 tokenizer fixture");
    let sizes = args.sizes.clone();
    let mut over: Vec<Vec<[f64; FIGURES]>> = vec![Vec::new(); sizes.len()];
    let (mut serve_rps, mut peer_rps) = (Vec::new(), Vec::new());
    let mut peer_missing = None;
    for run in 0..args.runs {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let engines = [InstantEngine::start().expect("engine"), InstantEngine::start().expect("engine")];
        let refs: Vec<&InstantEngine> = engines.iter().collect();
        // Both routers up (each idle while the other is measured), so that the overhead's chats
        // and the load go through both in turns.
        let peer = start_vllm_router(&args.vllm_router, &refs);
        if peer.is_none() {
            peer_missing = Some(format!(
                "{} did not start (pip install vllm-router==0.1.17, or give --vllm-router PATH)",
                args.vllm_router
            ));
        }
        let peer_addr = peer.as_ref().map(|(_, a)| *a);
        let (serve, addr) = start_serve(dir.path(), &refs);
        for (i, &size) in sizes.iter().enumerate() {
            let n = if size > 4096 { args.requests / 4 } else { args.requests }.max(10);
            over[i].push(overhead(addr, peer_addr, &refs, &renderer, size, n, run as u64));
        }
        // Each router's load in two halves, the head's around the peer's (head, peer, peer,
        // head): a drift of the machine over the run falls on both alike.
        let (mut on_serve, mut on_peer) = ((0, 0.0), (0, 0.0));
        for head_now in [true, false, false, true] {
            match (head_now, peer_addr) {
                (true, _) => {
                    let (n, took) = throughput(addr, args.clients, args.seconds / 2.0);
                    on_serve = (on_serve.0 + n, on_serve.1 + took);
                }
                (false, Some(peer)) => {
                    let (n, took) = throughput(peer, args.clients, args.seconds / 2.0);
                    on_peer = (on_peer.0 + n, on_peer.1 + took);
                }
                (false, None) => {}
            }
        }
        serve_rps.push(on_serve.0 as f64 / on_serve.1);
        if peer_addr.is_some() {
            peer_rps.push(on_peer.0 as f64 / on_peer.1);
        }
        drop(serve);
        drop(peer);
        eprintln!("serve-bench: run {} of {} done", run + 1, args.runs);
    }
    let mut report = json!({"runs": args.runs});
    println!("serve-bench: medians over {} runs [min - max]", args.runs);
    for (i, size) in sizes.iter().enumerate() {
        let col = |k: usize| spread(&over[i].iter().map(|r| r[k]).collect::<Vec<_>>());
        let (names, mut figures) = (
            [
                "chat_p50_us",
                "chat_p99_us",
                "ids_p50_us",
                "ids_p99_us",
                "head_tokenize_p50_us",
                "render_p50_us",
                "rest_p50_us",
                "rest_p99_us",
                "index_p50_us",
                "decision_less_tokenize_p50_us",
                "direct_p50_us",
                "head_tokenize_next_turn_p50_us",
                "rest_to_engine_thread_p50_us",
                "direct_to_engine_thread_p50_us",
                "vllm_router_p50_us",
                "vllm_router_p99_us",
                "rest_first_p50_us",
                "rest_second_p50_us",
                "vllm_router_first_p50_us",
                "vllm_router_second_p50_us",
            ],
            json!({}),
        );
        for (k, name) in names.iter().enumerate() {
            let (m, lo, hi) = col(k);
            figures[*name] = json!({"median": m, "min": lo, "max": hi});
        }
        let ratio = spread(&over[i].iter().map(|r| r[4] / r[5]).collect::<Vec<_>>());
        // The rest against the anchor, run by run (NaN without `vllm-router`).
        let anchor = spread(&over[i].iter().map(|r| r[6] / r[14]).collect::<Vec<_>>());
        figures["rest_to_vllm_router_ratio"] = json!({"median": anchor.0, "min": anchor.1, "max": anchor.2});
        figures["tokenize_ratio"] = json!({"median": ratio.0, "min": ratio.1, "max": ratio.2});
        let f = |k: usize| {
            let (m, lo, hi) = col(k);
            format!("{m:.0} µs [{lo:.0} - {hi:.0}]")
        };
        println!(
            "  {size}-token chat: last byte in to first byte out p50 {}, p99 {}; less its tokenizing (server-timing) p50 {}, p99 {}; the same tokens as ids p50 {}, p99 {}",
            f(0),
            f(1),
            f(6),
            f(7),
            f(2),
            f(3)
        );
        println!(
            "    of the rest, in the head's decision (parse, hash, index) p50 {}, of which the index p50 {}; the same body straight to an engine (no head) p50 {}",
            f(9),
            f(8),
            f(10)
        );
        if peer_missing.is_none() {
            println!(
                "    the same chat through vllm-router round robin (proxies, decides nothing) p50 {}, p99 {}; serve's rest / vllm-router {:.2}x [{:.2} - {:.2}]",
                f(14),
                f(15),
                anchor.0,
                anchor.1,
                anchor.2
            );
            println!(
                "      first of the pair (after this process's own render): serve's rest p50 {}, vllm-router p50 {}; second (after the other's request): {}, {}",
                f(16),
                f(18),
                f(17),
                f(19)
            );
        }
        println!(
            "    to the engine's thread's read (woken) instead of its socket: less its tokenizing p50 {}; the same body straight p50 {}",
            f(12),
            f(13)
        );
        println!(
            "    tokenizing in the head p50 {} against Renderer::chat in-process {}: {:.2}x [{:.2} - {:.2}]; the chat's next turn tokenized in the head p50 {}",
            f(4),
            f(5),
            ratio.0,
            ratio.1,
            ratio.2,
            f(11)
        );
        report[format!("chat_{size}")] = figures;
    }
    let (s, slo, shi) = spread(&serve_rps);
    println!(
        "  throughput ({} clients, 256-token id prompts): serve {s:.0} requests/s [{slo:.0} - {shi:.0}]",
        args.clients
    );
    report["serve_rps"] = json!({"median": s, "min": slo, "max": shi});
    match peer_missing {
        Some(why) => {
            println!("  vllm-router: {why}");
            report["vllm_router"] = json!(why);
        }
        None => {
            let (p, plo, phi) = spread(&peer_rps);
            let ratios: Vec<f64> = serve_rps.iter().zip(&peer_rps).map(|(s, p)| s / p).collect();
            let (r, rlo, rhi) = spread(&ratios);
            println!(
                "  vllm-router --policy round_robin {p:.0} requests/s [{plo:.0} - {phi:.0}]; serve / vllm-router {r:.2}x [{rlo:.2} - {rhi:.2}]"
            );
            report["vllm_router_rps"] = json!({"median": p, "min": plo, "max": phi});
            report["ratio"] = json!({"median": r, "min": rlo, "max": rhi});
        }
    }
    if args.json {
        println!("{report}");
    }
}
