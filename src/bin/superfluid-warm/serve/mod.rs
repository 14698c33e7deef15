//! `serve`: an OpenAI-compatible head in front of the engines. It renders each request's prompt
//! into the engine's tokens, asks the index which engine holds the longest prefix, prices the
//! engines by warmth and load (`superfluid_warm::choose`), claims the prefix for the chosen one
//! at once, and proxies the request there, streams passed through as they come. What the engine
//! then reports as `cached_tokens` is counted against what the head predicted.
//!
//! One tokio runtime carries the HTTP (hyper, HTTP/1.1, both sides; each engine connection driven
//! by the request using it, `upstream.rs`). A prompt is rendered and looked up on its request's
//! own thread (a hand-over to another thread costs more than the lookup), or, when it may be
//! routed on its start, on the blocking pool, the answer awaited under a deadline; once a lookup
//! runs past the deadline, lookups go to the blocking pool under it for a while. A claim is made
//! on its request's thread where the index takes it without waiting (the commit thread writes
//! it to the file), else by a thread of its own: the commit thread's back-pressure never holds
//! a request, and once a read (a lookup's or a claim's) runs past the deadline, claims go to
//! that thread too for a while.

mod api;
mod engines;
mod flights;
mod gather;
mod prompt;
mod proxy;
mod turns;
mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::time::{Duration, Instant};

use clap::Args;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use superfluid_warm::{
    Costs, EngineEndpoint, IndexFile, ListenStatus, Listener, Prefix, Renderer, RouteTally, Sharing,
};

use crate::exporter::serve_metrics;
use crate::listen::{Sink, Watched, open_sink, seconds};
use crate::{CliError, emit};
use engines::Engine;

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// The index file (created if absent).
    path: PathBuf,
    /// Where to serve the OpenAI API, e.g. 0.0.0.0:8000.
    #[arg(long)]
    listen: SocketAddr,
    /// The model the engines serve (requests for another are refused with 404).
    #[arg(long)]
    model: String,
    /// The model's folder (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`):
    /// prompts are rendered and tokenized here, as vLLM does. Without it, an engine's
    /// `/tokenize` is asked.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// An engine: NAME=http://HOST:PORT[,events=tcp://HOST:PORT][,replay=tcp://HOST:PORT]
    /// [,topic=T]. NAME is its node in the index; without events= the index knows it by the
    /// requests this head sends it. Once per engine.
    #[arg(long = "engine", required = true)]
    engines: Vec<String>,
    /// Milliseconds the index's answer may take on another thread; past it the request is
    /// routed on load alone (counted). A prompt of ids is looked up on its request's own thread
    /// while the index answers within this, on another for 10 s after one does not. The default
    /// leaves room for the lookup of a 100k-token prompt (a few ms) on cores the head shares,
    /// and is small beside the prefill a warm route saves.
    #[arg(long, default_value_t = 25.0)]
    deadline_ms: f64,
    /// Route a long text or chat as soon as the start tokenized so far settles the index's
    /// answer (every engine's warm prefix ends two blocks before it), and tokenize the rest
    /// after it was sent, for the claim. The default.
    #[arg(long, overrides_with = "no_route_on_start")]
    route_on_start: bool,
    /// Route a text or chat only once all of it is tokenized.
    #[arg(long)]
    no_route_on_start: bool,
    /// Prefill tokens that one decoding stream on an engine is worth in the cost.
    #[arg(long, default_value_t = Costs::default().decode_tokens)]
    decode_cost: f64,
    /// The weight of the work queued on an engine against the prompt tokens it holds (1: the
    /// time to first token as it stands; lower keeps conversations on their warm engine
    /// through longer queues, and their caches whole).
    #[arg(long, default_value_t = Costs::default().queue_weight)]
    queue_weight: f64,
    /// Queued work past this many tokens weighs fully, whatever --queue-weight: a request
    /// waits for its warm engine through a short queue, not through a long prefill (0, the
    /// default: the weight throughout).
    #[arg(long, default_value_t = 0)]
    queue_knee: u64,
    /// A request whose own prefill on its engine is at least --gather-tokens is sent once the
    /// requests that came with it are decided, at most this many milliseconds after it
    /// arrived, so that an engine prefills a burst's short prompts first (0: sent at once).
    #[arg(long, default_value_t = 20.0)]
    gather_ms: f64,
    /// See --gather-ms.
    #[arg(long, default_value_t = 16_384)]
    gather_tokens: usize,
    /// The balance guard: an engine with more than this many requests in flight beyond the
    /// least busy engine's (and more than --balance-ratio times its count) is not chosen,
    /// however warm. 0 turns the guard off.
    #[arg(long, default_value_t = Costs::default().balance_in_flight)]
    balance_in_flight: u32,
    /// The balance guard's ratio to the least busy engine's requests in flight.
    #[arg(long, default_value_t = Costs::default().balance_ratio)]
    balance_ratio: f64,
    /// Engines a request is tried on before it is refused (a refused connection, a reset or a
    /// 5xx before the client had a byte move it to the next; never twice the same).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    attempts: u32,
    /// Failures in a row after which an engine leaves the choice until its `/health` answers.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    eject_after: u32,
    /// Seconds a replay of an engine's events may take before its gap is taken as lost.
    #[arg(long, default_value_t = 5.0)]
    replay_timeout: f64,
    /// Seconds between writes of the status file (`stats` reads it).
    #[arg(long, default_value_t = 2.0)]
    status_every: f64,
    /// Seconds in-flight requests get to finish after SIGTERM or SIGINT.
    #[arg(long, default_value_t = 30.0)]
    drain: f64,
    /// Stop after this many seconds, as on SIGTERM.
    #[arg(long)]
    duration: Option<f64>,
    /// redb's page cache in MiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=65536))]
    cache_mb: u64,
    /// The served model's attention chunk in tokens (as `listen --attention-chunk`).
    #[arg(long)]
    attention_chunk: Option<usize>,
    /// Share the index through this NATS JetStream server (e.g. nats://127.0.0.1:4222), as
    /// `listen --nats` does: heads behind one load balancer see each other's choices and the
    /// engines' events, and route alike.
    #[arg(long)]
    nats: Option<String>,
    /// With --nats: the stream's name.
    #[arg(long, requires = "nats", default_value = "warm")]
    stream: String,
    /// With --nats: this head's name in the stream (unique among the heads).
    #[arg(long, requires = "nats", default_value = "serve")]
    head: String,
    /// Serve the metrics at http://ADDR/metrics in Prometheus' text format.
    #[arg(long, value_name = "ADDR")]
    metrics: Option<SocketAddr>,
}

/// What every connection shares.
pub(crate) struct Head {
    pub(crate) model: String,
    pub(crate) namespace: superfluid_warm::Namespace,
    pub(crate) index: Sink,
    pub(crate) renderer: Option<Renderer>,
    /// The cores renders take in turns, shortest remaining first.
    pub(crate) turns: turns::Turns,
    /// Long prompts sent after the short ones of their burst.
    pub(crate) gather: gather::Gather,
    pub(crate) engines: Vec<Engine>,
    pub(crate) tally: RouteTally,
    pub(crate) costs: Costs,
    pub(crate) deadline: Duration,
    /// Whether a long prompt may be routed on its start (`--route-on-start`).
    pub(crate) route_on_start: bool,
    /// When the head started (the clock of `hand_over_until`).
    pub(crate) born: Instant,
    /// Until when (µs after `born`) lookups go to the blocking pool: set when one on a
    /// request's own thread ran past the deadline.
    pub(crate) hand_over_until: AtomicU64,
    pub(crate) attempts: u32,
    pub(crate) eject_after: u32,
    /// Spreads equal engines round-robin.
    pub(crate) turn: AtomicUsize,
    /// Claims (`ran`) for the claim thread.
    claims: SyncSender<(Prefix, usize)>,
    /// Claims sent to the claim thread and not yet made there.
    claims_queued: Arc<AtomicUsize>,
    /// Claims handed to the claim thread (made there, or dropped when it was behind).
    pub(crate) claims_handed: AtomicU64,
    /// Claims dropped because the claim thread was behind.
    pub(crate) claims_dropped: AtomicU64,
    /// Requests sent to an engine so far (each one's number in its engine's `Flights`).
    pub(crate) flights: AtomicU64,
    /// `/v1/route`'s open decisions.
    pub(crate) tickets: api::Tickets,
    /// Set once the head stops taking requests.
    pub(crate) stopping: AtomicBool,
}

/// The most blocks a claim made on its request's thread has (32,768 tokens): a `ran` costs
/// about a microsecond a block, and while a worker makes it no other thread may be polling the
/// sockets, so a longer one goes to the claim thread.
const INLINE_CLAIM_BLOCKS: usize = 512;

impl Head {
    /// Claims `prefix` for engine `engine` in the index; never waits on the writer. On this
    /// thread where the index takes it at once (the claim thread, woken for every request, took
    /// ~10% of the head's time under load, two thirds of it in task switches); else on the
    /// claim thread, which may wait: while reads are slow ([`Head::lookup_inline`]; a claim's
    /// own read counts, as a lookup's), for a prompt of more than [`INLINE_CLAIM_BLOCKS`], while
    /// the index would wait or refuses, and while claims wait there, so that a claim never
    /// overtakes an earlier one.
    pub(crate) fn claim(&self, prefix: Prefix, engine: usize) {
        if self.claims_queued.load(Ordering::Acquire) == 0
            && prefix.blocks() <= INLINE_CLAIM_BLOCKS
            && self.lookup_inline()
            && let Some(name) = self.engines.get(engine).map(|e| e.name.as_str())
        {
            let started = Instant::now();
            let made = self.index.try_ran_prefix(&prefix, name);
            self.read_here(started.elapsed(), "claim");
            if let Ok(true) = made {
                return;
            }
        }
        // Counted before it is sent, so that no claim made meanwhile goes before it.
        self.claims_queued.fetch_add(1, Ordering::AcqRel);
        self.claims_handed.fetch_add(1, Ordering::Relaxed);
        match self.claims.try_send((prefix, engine)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.claims_queued.fetch_sub(1, Ordering::AcqRel);
                self.claims_dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {
                // The claim thread is gone (it panicked): nothing waits there any more, and
                // claims are made here where they can be.
                self.claims_queued.store(0, Ordering::Release);
                self.claims_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// A duration given in milliseconds as option `--what`.
fn milliseconds(what: &str, ms: f64) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(ms / 1000.0)
        .map_err(|_| CliError::Refused(format!("--{what} must be 0 or more (got {ms})")))
}

pub(crate) fn serve(out: &mut impl std::io::Write, args: &ServeArgs) -> Result<ExitCode, CliError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("serve")
        .enable_all()
        .build()
        .map_err(CliError::Output)?;
    // Signals are caught before anything is opened (as `listen` does).
    let (mut term, mut int) = {
        let _entered = runtime.enter();
        use tokio::signal::unix::{SignalKind, signal};
        (
            signal(SignalKind::terminate()).map_err(CliError::Output)?,
            signal(SignalKind::interrupt()).map_err(CliError::Output)?,
        )
    };
    if let Some(addr) = args.metrics {
        serve_metrics(addr).map_err(CliError::Refused)?;
    }
    let specs = args.engines.iter().map(|s| engines::parse(s, &args.model)).collect::<Result<Vec<_>, _>>()?;
    let endpoints: Vec<EngineEndpoint> = specs.iter().filter_map(|(_, e)| e.clone()).collect();
    let names: Vec<String> = specs.iter().map(|(e, _)| e.name.clone()).collect();
    for (i, name) in names.iter().enumerate() {
        if names.iter().skip(i + 1).any(|n| n == name) {
            return Err(CliError::Refused(format!("two --engine options name {name}: give each engine its own name")));
        }
    }
    let renderer = args.tokenizer.as_ref().map(Renderer::open).transpose()?;
    let deadline = milliseconds("deadline-ms", args.deadline_ms)?;
    let gather_most = milliseconds("gather-ms", args.gather_ms)?;
    let (replay_timeout, status_every, drain) = (
        seconds("replay-timeout", args.replay_timeout)?,
        seconds("status-every", args.status_every)?,
        seconds("drain", args.drain)?,
    );
    let until = args.duration.map(|d| seconds("duration", d)).transpose()?;
    if !(args.balance_ratio.is_finite() && args.balance_ratio >= 1.0) {
        return Err(CliError::Refused(format!("--balance-ratio must be 1 or more (got {})", args.balance_ratio)));
    }
    if !(args.queue_weight.is_finite() && args.queue_weight >= 0.0) {
        return Err(CliError::Refused(format!("--queue-weight must be 0 or more (got {})", args.queue_weight)));
    }
    let namespace = superfluid_warm::Namespace::new(&args.model)?;

    let nats = args.nats.as_deref().map(|url| Sharing::nats(url, &args.stream, &args.head));
    let index = open_sink(&args.path, args.cache_mb, args.attention_chunk, nats)?;
    let fatal = Arc::new(std::sync::Mutex::new(None));
    let listener = if endpoints.is_empty() {
        None
    } else {
        let watched = Arc::new(Watched { sink: index.clone(), fatal: Arc::clone(&fatal) });
        Some(Listener::start(watched, &endpoints, replay_timeout)?)
    };
    let (claims, claimed) = std::sync::mpsc::sync_channel(4096);
    let claims_queued = Arc::new(AtomicUsize::new(0));
    let mut costs = Costs::default();
    costs.decode_tokens = args.decode_cost;
    costs.queue_weight = args.queue_weight;
    costs.queue_knee = if args.queue_knee == 0 { u64::MAX } else { args.queue_knee };
    costs.balance_in_flight = if args.balance_in_flight == 0 { u32::MAX } else { args.balance_in_flight };
    costs.balance_ratio = args.balance_ratio;
    let tally = RouteTally::new(&names);
    let head = Arc::new(Head {
        model: args.model.clone(),
        namespace,
        index: index.clone(),
        renderer,
        turns: turns::Turns::new(
            std::thread::available_parallelism().map_or(1, usize::from),
            turns::HOLD,
            turns::LONG_BYTES,
        ),
        gather: gather::Gather::new(args.gather_tokens, gather_most),
        engines: specs.into_iter().map(|(e, _)| e).collect(),
        tally,
        costs,
        deadline,
        route_on_start: args.route_on_start || !args.no_route_on_start,
        born: Instant::now(),
        hand_over_until: AtomicU64::new(0),
        attempts: args.attempts,
        eject_after: args.eject_after,
        turn: AtomicUsize::new(0),
        claims,
        claims_queued: Arc::clone(&claims_queued),
        claims_handed: AtomicU64::new(0),
        claims_dropped: AtomicU64::new(0),
        flights: AtomicU64::new(0),
        tickets: api::Tickets::default(),
        stopping: AtomicBool::new(false),
    });
    let claimer = {
        let (index, names) = (index.clone(), names.clone());
        std::thread::Builder::new()
            .name("serve-claims".into())
            .spawn(move || claim_loop(&index, &names, &claimed, &claims_queued))
            .map_err(CliError::Output)?
    };
    let listener = Arc::new(std::sync::Mutex::new(listener));
    let result = runtime.block_on(async {
        let socket = tokio::net::TcpListener::bind(args.listen)
            .await
            .map_err(|e| CliError::Refused(format!("cannot listen on {}: {e}", args.listen)))?;
        eprintln!(
            "superfluid-warm: serving {} on http://{} in front of {} engine(s), index {}",
            args.model,
            socket.local_addr().map_or(args.listen, |a| a),
            head.engines.len(),
            args.path.display()
        );
        let background = engines::watch(Arc::clone(&head), Arc::clone(&listener), args.path.clone(), status_every);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let mut connections = tokio::task::JoinSet::new();
        let deadline = until.map(|d| tokio::time::Instant::now() + d);
        let why = loop {
            let until_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = term.recv() => break "SIGTERM",
                _ = int.recv() => break "SIGINT",
                () = until_deadline => break "--duration",
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = socket.accept() => {
                    let Ok((stream, _)) = accepted else { continue };
                    let _ = stream.set_nodelay(true);
                    let head = Arc::clone(&head);
                    let mut stopped = stopped.clone();
                    connections.spawn(async move {
                        let service = service_fn(move |request| {
                            let head = Arc::clone(&head);
                            async move { Ok::<_, std::convert::Infallible>(api::handle(head, request).await) }
                        });
                        let connection = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                        tokio::pin!(connection);
                        tokio::select! {
                            _ = connection.as_mut() => {}
                            _ = stopped.changed() => {
                                connection.as_mut().graceful_shutdown();
                                let _ = connection.await;
                            }
                        }
                    });
                }
            }
        };
        // Stop taking connections; let the requests in flight finish, up to --drain.
        drop(socket);
        head.stopping.store(true, Ordering::Relaxed);
        let in_flight = connections.len();
        let _ = stop.send(true);
        let drained = tokio::time::timeout(drain, async { while connections.join_next().await.is_some() {} }).await;
        connections.abort_all();
        background.abort();
        eprintln!(
            "superfluid-warm: stopping on {why}: {in_flight} connection(s) {}",
            if drained.is_ok() { "finished" } else { "cut after --drain" }
        );
        Ok::<(), CliError>(())
    });
    // Every task is dropped with the runtime, and with them their handles on the head; the
    // claim thread ends once the head (the claims' sender) is gone.
    drop(runtime);
    let stats = listener.lock().ok().and_then(|mut l| l.take()).map(Listener::stop).unwrap_or_default();
    let routes = head.tally.stats();
    // Open `/v1/route` decisions hold the head too.
    head.tickets.clear();
    drop(head);
    let _ = claimer.join();
    let mut status = ListenStatus::now(false, status_every);
    status.engines = stats.iter().map(superfluid_warm::EngineStatus::from).collect();
    status.routes = routes;
    if let Err(e) = status.write(&IndexFile::new(&args.path)) {
        eprintln!("superfluid-warm: cannot write the status file: {e}");
    }
    result?;
    if let Some(e) = fatal.lock().ok().and_then(|mut f| f.take()) {
        return Err(e.into());
    }
    match index.close() {
        Some(Err(e)) => Err(e.into()),
        _ => emit(out, &format!("stopped; {} closed cleanly", args.path.display())),
    }
}

/// The claim thread: a choice whose `ran` is not made on its request's thread (`Head::claim`)
/// becomes one here, so that the next request of the same prefix sees it before the engine's
/// events come; `queued` counts the claims sent and not yet made. Ends when the head, which
/// holds the sender, is gone.
fn claim_loop(index: &Sink, names: &[String], claimed: &Receiver<(Prefix, usize)>, queued: &AtomicUsize) {
    while let Ok((prefix, engine)) = claimed.recv() {
        if let Some(name) = names.get(engine)
            && let Err(e) = index.ran_prefix(&prefix, name)
        {
            tracing::warn!(engine = %name, error = %e, "the index did not take a claim");
        }
        queued.fetch_sub(1, Ordering::AcqRel);
    }
}
