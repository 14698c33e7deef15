//! `sim-engine`: the simulated OpenAI-compatible engine (`harness::openai_engine`) as a process,
//! for `serve` to stand in front of: vLLM's prefix cache model, its KV events over ZMQ with a
//! replay endpoint, `cached_tokens` in usage, and a time model. Prints one JSON line (its HTTP
//! URL and event endpoints) once it serves, then serves until SIGTERM, SIGINT or stdin closes
//! with `--until-stdin-closes`.

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use harness::openai_engine::{EngineConfig, OpenAiEngine};

#[derive(Parser)]
#[command(name = "sim-engine", about = "A simulated vLLM engine: OpenAI API, prefix cache, KV events")]
struct Args {
    /// The model's name.
    #[arg(long, default_value = "sim")]
    model: String,
    /// The model's folder (tokenizer.json, chat template), for text and chat prompts.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// HTTP port on 127.0.0.1 (0: any).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// KV events' PUB port (0: any).
    #[arg(long, default_value_t = 0)]
    events_port: u16,
    /// Replay ROUTER port (0: any).
    #[arg(long, default_value_t = 0)]
    replay_port: u16,
    /// Tokens a KV block holds.
    #[arg(long, default_value_t = 16)]
    block: usize,
    /// Blocks its prefix cache holds.
    #[arg(long, default_value_t = 65_536)]
    capacity: usize,
    /// Requests run at once.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Prefill: a constant, in milliseconds...
    #[arg(long, default_value_t = 0.0)]
    prefill_base_ms: f64,
    /// ...and microseconds per uncached prompt token.
    #[arg(long, default_value_t = 0.0)]
    prefill_us_per_token: f64,
    /// Decode: milliseconds per output token.
    #[arg(long, default_value_t = 0.0)]
    decode_ms_per_token: f64,
    /// Stop when stdin closes (a test's child that must not outlive it).
    #[arg(long)]
    until_stdin_closes: bool,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let time = |ms: f64| Duration::try_from_secs_f64(ms / 1000.0).unwrap_or_default();
    let mut config = EngineConfig::instant(&args.model, args.tokenizer.clone(), args.capacity);
    config.block = args.block;
    config.batch = args.batch;
    config.prefill_base = time(args.prefill_base_ms);
    config.prefill_per_token = time(args.prefill_us_per_token / 1000.0);
    config.decode_per_token = time(args.decode_ms_per_token);
    config.ports = (args.port, args.events_port, args.replay_port);
    let engine = match OpenAiEngine::start(config) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("sim-engine: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    println!("{}", serde_json::json!({"url": engine.url(), "events": engine.events, "replay": engine.replay}));
    if args.until_stdin_closes {
        let mut sink = String::new();
        while std::io::stdin().read_line(&mut sink).is_ok_and(|n| n > 0) {
            sink.clear();
        }
    } else {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
        if let Ok(runtime) = runtime {
            runtime.block_on(async {
                use tokio::signal::unix::{SignalKind, signal};
                if let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
                {
                    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
                }
            });
        }
    }
    drop(engine);
    std::process::ExitCode::SUCCESS
}
