//! Several heads over engines that publish their KV cache events: requests round-robin over `H`
//! heads that share one view through a NATS JetStream stream (each head subscribed to every
//! engine, its listener publishing the batches to the stream, where they are stored once), beside
//! the same workload over `H` heads that do not share (each subscribed to every engine, applying
//! the batches to its own file). Each side drives engines of its own, so that each is compared
//! with what its engines really held.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::engine_replay::{BACKLOG, ReplayEngines, simulated, wait_connected};
use crate::engine_sim::{Publisher, SimEngine};
use crate::replay::{Config, Load, choose_among, imbalance, node_name, nth, nth_mut, prompt, share};
use crate::trace::Request;
use superfluid_warm::{
    BLOCK_TOKENS, Builder, Error, Listener, MIN_BLOCKS, Namespace, ReadIndex, Result, SharedWarm, Sharing, Warm,
};

/// How long the replay waits for a head to catch up before it goes on.
const CATCH_UP: Duration = Duration::from_secs(10);

/// The page cache each replay head opens its file with: `listen`'s (`--cache-mb 32`), what keeps
/// a head following 8 full engines under 256 MiB resident. redb's default (128 MiB) is for a
/// head answering from a large file; these heads mostly apply engine batches.
pub const HEAD_CACHE_BYTES: usize = 32 << 20;

/// One side of the replay: what its heads claimed and what its engines held.
#[derive(Clone, Debug, Default)]
pub struct Side {
    /// Tokens the head named warm on the node each request went to.
    pub claimed_tokens: u64,
    /// Tokens that node's engine held of the prompt (whole blocks of 64, from two).
    pub cached_tokens: u64,
    /// Requests asked of a head that had applied every batch the chosen node's engine had
    /// published: their claims are the index's own, not what lag hides from it.
    pub settled_requests: usize,
    /// Of `claimed_tokens`, those of the settled requests.
    pub settled_claimed_tokens: u64,
    /// Of `cached_tokens`, those of the settled requests.
    pub settled_cached_tokens: u64,
    /// Prompt tokens given to each node.
    pub load: Vec<u64>,
    /// Lag from an engine's publish to a head's listener having it (applied, or for the
    /// sharing side published to the stream), worst engine: p50 and p99, in seconds.
    pub engine_lag: (Option<f64>, Option<f64>),
    /// For the sharing side: lags of events from publish to applied on another head, in ms, p50
    /// and p99.
    pub stream_lag_ms: (Option<f64>, Option<f64>),
    /// Engine batches each head applied (the fewest of any head), and the batches published.
    pub applied: u64,
    /// Batches the engines published.
    pub published: u64,
    /// Peak resident memory of the process while this side ran, in bytes (`VmHWM`, reset when
    /// the side starts where Linux allows; `None` without `/proc`).
    pub peak_rss: Option<u64>,
    /// What this side's simulated engines held when it ended, in bytes, by their own accounting
    /// (caches, replay buffers): the harness's part of `peak_rss`.
    pub engines_bytes: u64,
}

/// What a replay over several heads and engines found.
#[derive(Clone, Debug, Default)]
pub struct EngineHeadsReport {
    /// Heads a side.
    pub heads: usize,
    /// Requests replayed.
    pub requests: usize,
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Heads sharing one view.
    pub shared: Side,
    /// Heads each alone.
    pub alone: Side,
    /// Resident memory of the process before any head opened, in bytes (the binary, the trace,
    /// the runtimes; `None` without `/proc`).
    pub base_rss: Option<u64>,
}

impl EngineHeadsReport {
    /// A side's share of prompt tokens.
    pub fn share(&self, tokens: u64) -> f64 {
        share(tokens, self.prompt_tokens)
    }

    /// A side's resident memory per head, in bytes: its peak, less what the process held before
    /// any head opened and what its simulated engines account for, over the heads. Each head's
    /// page cache, engine blocks, listener and link, and the allocator's slack with them: what a
    /// production head holds, or a little more. For the side that runs second, what the first
    /// side's heads freed and the allocator kept counts too: an upper bound.
    pub fn per_head_bytes(&self, side: &Side) -> Option<u64> {
        let heads = u64::try_from(self.heads.max(1)).unwrap_or(u64::MAX);
        let used = side.peak_rss?.saturating_sub(self.base_rss?).saturating_sub(side.engines_bytes);
        Some(used / heads)
    }
}

/// A field of `/proc/self/status` in bytes (`VmRSS`, `VmHWM`), `None` where there is none.
fn status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib.saturating_mul(1024))
}

/// Starts the process's peak resident memory again from what it holds now (Linux: `5` to
/// `/proc/self/clear_refs`), so that a side's peak is its own. Where that is refused, the peak
/// stays the process's (what came before counts against the side).
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

impl Side {
    /// Most loaded node's tokens over the least loaded's.
    pub fn imbalance(&self) -> f64 {
        imbalance(&self.load)
    }
}

/// A head of either side.
enum Head {
    Shared(Arc<SharedWarm>),
    Alone(Arc<Warm>),
}

impl Head {
    fn read(&self) -> &dyn ReadIndex {
        match self {
            Head::Shared(h) => h.as_ref(),
            Head::Alone(h) => h.as_ref(),
        }
    }

    fn ran(&self, prefix: &superfluid_warm::Prefix, node: &str) -> Result<()> {
        match self {
            Head::Shared(h) => h.ran_prefix(prefix, node).map(drop),
            Head::Alone(h) => h.ran_prefix(prefix, node),
        }
    }

    /// Batches applied to its file, by node.
    fn applied(&self, node: &str) -> Result<Option<u64>> {
        match self {
            Head::Shared(h) => h.engine_position(node),
            Head::Alone(h) => h.engine_position(node),
        }
        .map(|p| p.map(|(seq, _)| seq))
    }

    fn batches(&self) -> Result<u64> {
        let stats = match self {
            Head::Shared(h) => h.engine_stats()?,
            Head::Alone(h) => h.engine_stats()?,
        };
        Ok(stats.iter().map(|s| s.counts.batches).sum())
    }
}

/// Replays `requests` over `heads` sharing heads (stream on the NATS server at `url`) and `heads`
/// heads alone, each side with `config.nodes` simulated engines of its own; files in `dir`.
///
/// # Errors
/// [`Error::InvalidConfig`] for no nodes or no heads; [`Error::Sharing`] if a head cannot reach
/// the server; any error of the index, the listeners or the simulated engines' sockets.
pub fn run(
    builder: &Builder,
    dir: &Path,
    url: &str,
    requests: &[Request],
    config: &Config,
    engines: &ReplayEngines,
    heads: usize,
) -> Result<EngineHeadsReport> {
    if config.nodes == 0 || heads == 0 {
        return Err(Error::InvalidConfig { detail: "a replay needs at least one node and one head".into() });
    }
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let stream = format!("replay-engines-{}-{nanos}", std::process::id());
    let mut builder = builder.clone();
    builder.compact_on_close(false).cache_size(HEAD_CACHE_BYTES);
    let base_rss = status_bytes("VmRSS");
    reset_peak();
    let shared: Vec<Head> = (0..heads)
        .map(|h| {
            let sharing = Sharing::nats(url, &stream, &format!("h{h}")).max_age(Duration::from_secs(3600));
            let head = SharedWarm::open(&builder, dir.join(format!("shared-{h}.redb")), sharing)?;
            head.wait_ready(Duration::from_secs(5))?;
            Ok(Head::Shared(Arc::new(head)))
        })
        .collect::<Result<_>>()?;
    let mut report = EngineHeadsReport { heads, requests: requests.len(), base_rss, ..EngineHeadsReport::default() };
    report.shared = side(&shared, requests, config, engines, &mut report.prompt_tokens)?;
    report.shared.peak_rss = status_bytes("VmHWM");
    for head in &shared {
        if let Head::Shared(h) = head {
            let lags: Vec<u64> = {
                let mut l = h.lags_ns();
                l.sort_unstable();
                l
            };
            let at = |q: f64| lags.get(((lags.len() as f64 - 1.0) * q).round() as usize).map(|&ns| ns as f64 / 1e6);
            let worst = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            report.shared.stream_lag_ms =
                (worst(report.shared.stream_lag_ms.0, at(0.5)), worst(report.shared.stream_lag_ms.1, at(0.99)));
        }
    }
    // The sharing heads are closed before the other side opens its own: each side's peak holds
    // its heads and engines alone.
    close(shared)?;
    reset_peak();
    let alone: Vec<Head> = (0..heads)
        .map(|h| builder.open(dir.join(format!("alone-{h}.redb"))).map(|w| Head::Alone(Arc::new(w))))
        .collect::<Result<_>>()?;
    let mut tokens = 0;
    report.alone = side(&alone, requests, config, engines, &mut tokens)?;
    report.alone.peak_rss = status_bytes("VmHWM");
    close(alone)?;
    Ok(report)
}

/// Closes every head (one still shared elsewhere is dropped).
fn close(heads: Vec<Head>) -> Result<()> {
    for head in heads {
        match head {
            Head::Shared(h) => Arc::try_unwrap(h).map_or(Ok(()), SharedWarm::close)?,
            Head::Alone(h) => Arc::try_unwrap(h).map_or(Ok(()), Warm::close)?,
        }
    }
    Ok(())
}

/// One side: its engines, every head listening to every engine, requests round-robin.
fn side(
    heads: &[Head],
    requests: &[Request],
    config: &Config,
    engines: &ReplayEngines,
    prompt_tokens: &mut u64,
) -> Result<Side> {
    let nodes = config.nodes;
    let names: Vec<String> = (0..nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    let (mut sims, publishers, endpoints) = simulated(config, engines, &names)?;
    let listeners: Vec<Listener> = heads
        .iter()
        .map(|h| match h {
            Head::Shared(s) => Listener::start(Arc::clone(s), &endpoints, Duration::from_secs(30)),
            Head::Alone(w) => Listener::start(Arc::clone(w), &endpoints, Duration::from_secs(30)),
        })
        .collect::<Result<_>>()?;
    // Every listener connected before the engines publish: a batch sent before a subscriber
    // joined is lost to it until the engine's next one shows the gap.
    wait_connected(&listeners);
    let mut out = Side { load: vec![0; nodes], ..Side::default() };
    let mut load = Load::new(config);
    let mut sent: Vec<Option<u64>> = vec![None; nodes];
    for (i, request) in requests.iter().enumerate() {
        let head = nth(heads, i % heads.len())?;
        // The head waits (a while) until it has applied what the engines published: a real
        // engine takes a request's time to run it, the simulated ones almost none.
        let t = Instant::now();
        while t.elapsed() < CATCH_UP && behind(head, &names, &sent)? {
            std::thread::sleep(Duration::from_micros(200));
        }
        let tokens = prompt(config, request);
        let prefix = head.read().prefix(&namespace, &tokens);
        let found: Vec<(usize, usize)> = head
            .read()
            .warm_nodes_prefix(&prefix)?
            .into_iter()
            .filter_map(|h| names.iter().position(|n| *n == h.node).map(|n| (n, h.tokens)))
            .collect();
        let (chosen, claimed) = choose_among(config, &load, &found, tokens.len());
        // Asked after the answer: a batch applied since only makes the head less behind.
        let settled = head.applied(nth(&names, chosen)?)? == *nth(&sent, chosen)?;
        let sim = nth_mut(&mut sims, chosen)?;
        let whole = sim.holds(&tokens) / BLOCK_TOKENS * BLOCK_TOKENS;
        let cached = if whole >= MIN_BLOCKS * BLOCK_TOKENS { whole as u64 } else { 0 };
        out.claimed_tokens += claimed as u64;
        out.cached_tokens += cached;
        if settled {
            out.settled_requests += 1;
            out.settled_claimed_tokens += claimed as u64;
            out.settled_cached_tokens += cached;
        }
        head.ran(&prefix, nth(&names, chosen)?)?;
        let batch = sim.run(&tokens);
        nth(&publishers, chosen)?.publish(&batch, false)?;
        *nth_mut(&mut sent, chosen)? = Some(batch.seq);
        out.published += 1;
        load.add(chosen, tokens.len() as u64)?;
        *nth_mut(&mut out.load, chosen)? += tokens.len() as u64;
        *prompt_tokens += tokens.len() as u64;
    }
    // Every head applies every batch before its listener stops.
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let mut any = false;
        for head in heads {
            any |= behind_at_all(head, &names, &sent)?;
        }
        if !any {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let engines_bytes: usize =
        sims.iter().map(SimEngine::heap_bytes).chain(publishers.iter().map(Publisher::buffered_bytes)).sum();
    out.engines_bytes = engines_bytes as u64;
    let seen: Vec<_> = listeners.into_iter().flat_map(Listener::stop).collect();
    let worst = |f: fn(&superfluid_warm::ListenStats) -> Option<f64>| {
        seen.iter().filter_map(f).fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))))
    };
    out.engine_lag = (worst(|s| s.lag_p50), worst(|s| s.lag_p99));
    let mut applied = u64::MAX;
    for head in heads {
        applied = applied.min(head.batches()?);
    }
    out.applied = applied;
    Ok(out)
}

/// Whether `head` is more than [`BACKLOG`] batches behind an engine.
fn behind(head: &Head, names: &[String], sent: &[Option<u64>]) -> Result<bool> {
    for (name, last) in names.iter().zip(sent) {
        let Some(last) = *last else { continue };
        let applied = head.applied(name)?;
        if applied.is_none_or(|a| last.saturating_sub(a) > BACKLOG) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether `head` has not applied an engine's last batch.
fn behind_at_all(head: &Head, names: &[String], sent: &[Option<u64>]) -> Result<bool> {
    for (name, last) in names.iter().zip(sent) {
        if last.is_some() && head.applied(name)? != *last {
            return Ok(true);
        }
    }
    Ok(false)
}
