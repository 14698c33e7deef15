//! `listen`: a head that keeps the index of what each engine holds from its KV cache events
//! until a signal; the sink it applies them to, what stops it, and its status lines on stderr
//! (its status file is `listen_status`'s).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::emit;
use crate::exporter::serve_metrics;
use crate::format::say_how_opened;
use crate::listen_status::write_listen_status;
use crate::{CliError, storage_cause};
use clap::Args;
use superfluid_warm::{
    EngineBatch, EngineEndpoint, EngineOutcome, EngineSink, Error, LinkStatus, ListenStats, Listener, ReadIndex,
    SharedWarm, Sharing, Warm,
};

#[derive(Args)]
pub(crate) struct ListenArgs {
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
    /// The served model's attention chunk in tokens (Llama 4: 8192), for engines with chunked
    /// local attention layers: without it they are answered as holding nothing.
    #[arg(long)]
    attention_chunk: Option<usize>,
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

/// The index a head that follows engines writes: `path` with a page cache of `cache_mb` MiB
/// (and the model's attention chunk), shared through `nats` if given; says how it opened.
///
/// # Errors
/// The file or the link cannot be opened.
pub(crate) fn open_sink(
    path: &Path,
    cache_mb: u64,
    attention_chunk: Option<usize>,
    nats: Option<Sharing>,
) -> Result<Sink, CliError> {
    let mut builder = Warm::builder();
    builder.cache_size(usize::try_from(cache_mb << 20).unwrap_or(usize::MAX));
    if let Some(tokens) = attention_chunk {
        builder.attention_chunk(tokens);
    }
    Ok(match nats {
        Some(sharing) => {
            let shared = SharedWarm::open(&builder, path, sharing)?;
            say_how_opened(path, &shared.stats()?.0);
            Sink::Shared(Arc::new(shared))
        }
        None => {
            let warm = builder.open(path)?;
            say_how_opened(path, &warm.stats()?);
            Sink::Own(Arc::new(warm))
        }
    })
}

/// Seconds as a `Duration`, refusing what is not a finite, non-negative number.
pub(crate) fn seconds(what: &str, s: f64) -> Result<Duration, CliError> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| CliError::Refused(format!("--{what} must be a number of seconds, 0 or more (got {s})")))
}

pub(crate) fn listen(out: &mut impl Write, args: &ListenArgs) -> Result<ExitCode, CliError> {
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
    let nats = args.nats.as_deref().map(|url| Sharing::nats(url, &args.stream, &args.head));
    let sink = open_sink(&args.path, args.cache_mb, args.attention_chunk, nats)?;
    // The status file is refreshed every --status-every seconds, or every 10 s without lines.
    let refresh = if every.is_zero() { Duration::from_secs(10) } else { every };
    if signals.came(Duration::from_millis(10)) {
        eprintln!("superfluid-warm: stopped while starting (SIGTERM or SIGINT)");
        write_listen_status(&args.path, &[], &ListenHealth::default(), false, refresh);
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
    write_listen_status(&args.path, &listener.stats(), &health, true, refresh);
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
            write_listen_status(&args.path, &stats, &health, true, refresh);
            if !every.is_zero() {
                print(&stats, &health);
            }
        }
    };
    health.error.clone_from(&ended);
    // The file at the path is not the one opened: closing the handle closes the old one.
    let gone = file_identity(&args.path) != opened;
    let stats = listener.stop();
    write_listen_status(&args.path, &stats, &health, false, refresh);
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
pub(crate) struct ListenHealth {
    /// The link has opened the stream (always, without --nats).
    ready: bool,
    /// The link's figures (with --nats).
    sharing: Option<superfluid_warm::ShareStats>,
    /// What the link finds wrong now (not connected, its last error), if anything.
    link_error: Option<String>,
    /// Why `listen` stopped on its own.
    pub(crate) error: Option<String>,
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
    pub(crate) fn link_status(&self, running: bool) -> Option<LinkStatus> {
        let s = self.sharing.as_ref()?;
        let mut link = LinkStatus::default();
        (link.stream, link.head) = (s.stream.clone(), s.head.clone());
        (link.connected, link.ready) = (s.connected && running, self.ready);
        (link.applied, link.unapplied, link.published) = (s.applied, s.unapplied, s.published);
        (link.buffered, link.dropped) = (s.buffered, s.dropped);
        (link.error, link.halted) = (self.link_error.clone(), s.halted.clone());
        Some(link)
    }
}

/// Where `listen` applies the engines' batches: its own file, or the stream it shares.
#[derive(Clone)]
pub(crate) enum Sink {
    Own(Arc<Warm>),
    Shared(Arc<SharedWarm>),
}

impl Sink {
    /// The index's read side.
    pub(crate) fn read(&self) -> &dyn ReadIndex {
        match self {
            Sink::Own(warm) => &**warm,
            Sink::Shared(shared) => &**shared,
        }
    }

    /// Records that `node` ran `prefix` (a head's claim).
    pub(crate) fn ran_prefix(&self, prefix: &superfluid_warm::Prefix, node: &str) -> Result<(), Error> {
        match self {
            Sink::Own(warm) => warm.ran_prefix(prefix, node),
            Sink::Shared(shared) => shared.ran_prefix(prefix, node).map(drop),
        }
    }

    /// [`Sink::ran_prefix`] unless it would wait on the commit thread (`Ok(false)`: nothing
    /// recorded). A shared head's claim never does: it goes to the stream's outbox.
    pub(crate) fn try_ran_prefix(&self, prefix: &superfluid_warm::Prefix, node: &str) -> Result<bool, Error> {
        match self {
            Sink::Own(warm) => warm.try_ran_prefix(prefix, node),
            Sink::Shared(shared) => shared.ran_prefix(prefix, node).map(|_| true),
        }
    }

    /// Closes the file, if this is the last handle on it (`None`: it is not).
    pub(crate) fn close(self) -> Option<Result<(), Error>> {
        match self {
            Sink::Own(warm) => Arc::try_unwrap(warm).ok().map(Warm::close),
            Sink::Shared(shared) => Arc::try_unwrap(shared).ok().map(SharedWarm::close),
        }
    }
}

/// The sink `listen`'s threads apply to: keeps the first error after which the file takes no
/// more writes (an I/O error latched, a full disk), for `listen` to stop on.
pub(crate) struct Watched {
    pub(crate) sink: Sink,
    pub(crate) fatal: Arc<Mutex<Option<Error>>>,
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
