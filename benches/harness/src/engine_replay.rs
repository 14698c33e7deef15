//! A replay whose nodes are simulated engines that publish vLLM's KV cache events over loopback
//! ZMQ to the index's listener: the head asks `warm_nodes`, routes, records its `ran` (a claim),
//! and the chosen engine runs the request through its LRU and publishes what it stored and
//! evicted. What the index claims is then compared with what the engines really hold.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine_sim::{Publisher, SimEngine};
use crate::replay::{Config, Load, Policy, Timing, choose_among, imbalance, node_name, nth, nth_mut, prompt, share};
use crate::trace::{Request, splitmix64};
use superfluid_warm::{
    BLOCK_TOKENS, EngineBatch, EngineEndpoint, EngineEvent, ListenStats, Listener, MIN_BLOCKS, Namespace, ReadIndex,
    Result, Warm, decode_engine_batch,
};

/// The engines of a replay.
#[derive(Clone, Debug)]
pub struct ReplayEngines {
    /// Tokens per engine block (vLLM's default 16).
    pub block: usize,
    /// Engine blocks each engine's cache holds.
    pub cache_blocks: usize,
    /// Restart a pseudo-random engine every this many requests (its process: an empty cache,
    /// numbers from 0, nothing to replay). Nobody tells the index: it sees the restart in the
    /// engine's next batch.
    pub restart_every: Option<usize>,
    /// Engine blocks of each engine's offload tier in CPU memory (0: none): blocks evicted from
    /// the GPU move there, as vLLM's offloading connector keeps them.
    pub offload_blocks: usize,
    /// How much a token warm only in the offload tier counts against one warm in GPU memory when
    /// `balanced` weighs a node's warm prefix (1: tiers ignored).
    pub offload_weight: f64,
    /// Engine `i` publishes on loopback port `port + 2i` and answers replays on `port + 2i + 1`
    /// (`None`: ports of the system's choice), so that a `listen` can follow the same engines.
    pub port: Option<u16>,
    /// Each engine's KV cache groups, as a hybrid-attention model's vLLM keeps them (full
    /// attention, sliding windows: [`crate::hybrid_sim::HybridCache`]); empty: one group.
    pub groups: Vec<superfluid_warm::GroupKind>,
}

impl ReplayEngines {
    /// Engine `i`'s fixed ports (events, replays), if [`ReplayEngines::port`] is set and they fit.
    pub fn ports(&self, i: usize) -> Option<(u16, u16)> {
        let base = u32::from(self.port?) + 2 * u32::try_from(i).ok()?;
        Some((u16::try_from(base).ok()?, u16::try_from(base + 1).ok()?))
    }
}

impl Default for ReplayEngines {
    fn default() -> Self {
        ReplayEngines {
            block: 16,
            cache_blocks: 65_536,
            restart_every: None,
            offload_blocks: 0,
            offload_weight: 0.5,
            port: None,
            groups: Vec::new(),
        }
    }
}

/// What a replay over engines found.
#[derive(Clone, Debug, Default)]
pub struct EngineReport {
    /// Requests replayed.
    pub requests: usize,
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Tokens the index named warm on the node each request went to.
    pub claimed_tokens: u64,
    /// Tokens that node's engine held of the prompt when the request came, in the index's
    /// unit: whole blocks of 64 from the first, counted from two.
    pub cached_tokens: u64,
    /// The same at the engine's own block size (a partial block of 64 included).
    pub cached_engine_tokens: u64,
    /// Of `claimed_tokens`, those the index named warm in GPU memory.
    pub claimed_gpu_tokens: u64,
    /// Of `cached_tokens`, those the engine held in GPU memory (the rest, in its offload tier).
    pub cached_gpu_tokens: u64,
    /// Requests sent as warm to a node whose engine held less than the index named.
    pub warm_not_cached: usize,
    /// Prompt tokens given to each node.
    pub load: Vec<u64>,
    /// Engine restarts made.
    pub restarts: usize,
    /// Tokens routed warm to a restarted engine beyond what it held, that only its process
    /// before the restart had stored, after the index had seen the restart (the index must
    /// never do this).
    pub warm_to_restarted_seen: u64,
    /// The same before the index had seen it (the engine had not published since).
    pub warm_to_restarted_unseen: u64,
    /// Block events the engines published (stored and removed hashes).
    pub block_events: u64,
    /// The same batches applied again back to back into a new file (decoded from vLLM's wire
    /// form, applied, made durable): how long it took.
    pub ingest: Duration,
    /// Time per request of the head's calls (`warm_nodes`, `ran`).
    pub index: Timing,
    /// What each engine's listening thread saw (replays, lag).
    pub listen: Vec<ListenStats>,
    /// Wall time of the whole replay.
    pub wall: Duration,
}

impl EngineReport {
    /// Share of prompt tokens the index named warm on the chosen node.
    pub fn claimed_share(&self) -> f64 {
        self.share(self.claimed_tokens)
    }

    /// Share of prompt tokens the chosen engine held (the index's unit).
    pub fn cached_share(&self) -> f64 {
        self.share(self.cached_tokens)
    }

    /// Share of prompt tokens the index named warm in GPU memory on the chosen node.
    pub fn claimed_gpu_share(&self) -> f64 {
        self.share(self.claimed_gpu_tokens)
    }

    /// Share of prompt tokens the chosen engine held in GPU memory (the index's unit).
    pub fn cached_gpu_share(&self) -> f64 {
        self.share(self.cached_gpu_tokens)
    }

    /// Share of prompt tokens the index named warm only in the offload tier.
    pub fn claimed_offload_share(&self) -> f64 {
        self.share(self.claimed_tokens.saturating_sub(self.claimed_gpu_tokens))
    }

    /// Share of prompt tokens the chosen engine held only in its offload tier.
    pub fn cached_offload_share(&self) -> f64 {
        self.share(self.cached_tokens.saturating_sub(self.cached_gpu_tokens))
    }

    /// Share of prompt tokens the chosen engine held (its own unit).
    pub fn cached_engine_share(&self) -> f64 {
        self.share(self.cached_engine_tokens)
    }

    fn share(&self, tokens: u64) -> f64 {
        share(tokens, self.prompt_tokens)
    }

    /// Most loaded node's tokens over the least loaded's.
    pub fn imbalance(&self) -> f64 {
        imbalance(&self.load)
    }

    /// Block events applied durably per second, back to back.
    pub fn ingest_rate(&self) -> f64 {
        self.block_events as f64 / self.ingest.as_secs_f64().max(1e-9)
    }
}

/// A warm node by index into the replay's names: (node, tokens warm, of those in GPU memory).
type TieredHit = (usize, usize, usize);

/// The prompt's prefix and its warm nodes by index into `names`, each with the tokens it has
/// warm and, of those, the tokens in GPU memory (longest first): balanced weighs every warm
/// node, warmest needs only the first.
fn ask(
    warm: &Warm,
    namespace: &Namespace,
    names: &[String],
    policy: Policy,
    tokens: &[u32],
) -> Result<(superfluid_warm::Prefix, Vec<TieredHit>)> {
    let prefix = warm.prefix(namespace, tokens);
    let found = match policy {
        Policy::Balanced => warm.warm_nodes_prefix(&prefix)?,
        Policy::Warmest => warm.warmest_prefix(&prefix)?.into_iter().collect(),
    }
    .into_iter()
    .filter_map(|h| names.iter().position(|n| *n == h.node).map(|n| (n, h.tokens, h.gpu_tokens)))
    .collect();
    Ok((prefix, found))
}

/// The simulated engines of a replay, one a node of `names`: each with its publisher on loopback
/// and the endpoint a listener subscribes to.
///
/// # Errors
/// As [`SimEngine::new`] and [`Publisher::new`].
pub(super) fn simulated(
    config: &Config,
    engines: &ReplayEngines,
    names: &[String],
) -> Result<(Vec<SimEngine>, Vec<Publisher>, Vec<EngineEndpoint>)> {
    let sims = names
        .iter()
        .map(|_| {
            SimEngine::new(engines.block, engines.cache_blocks, &config.model, None).map(|e| {
                // The publishers answer replays; the replay reads an engine's last batch only.
                let e = e.with_offload(engines.offload_blocks).with_groups(&engines.groups).without_replays();
                // Only a replay that restarts engines asks what a process stored before.
                if engines.restart_every.is_some() { e } else { e.without_stored() }
            })
        })
        .collect::<Result<_>>()?;
    let publishers: Vec<Publisher> =
        (0..names.len()).map(|i| Publisher::at(Duration::ZERO, engines.ports(i))).collect::<Result<_>>()?;
    let endpoints = names
        .iter()
        .zip(&publishers)
        .map(|(n, p)| EngineEndpoint::parse(&format!("{n}={},replay={}", p.events, p.replay), Some(&config.model)))
        .collect::<Result<_>>()?;
    Ok((sims, publishers, endpoints))
}

/// Waits (up to ten seconds) until every listener is connected to every engine, and a moment
/// for their subscriptions to reach the publishers.
pub(super) fn wait_connected(listeners: &[Listener]) {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) && !listeners.iter().all(|l| l.stats().iter().all(|s| s.connected)) {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
}

/// Batches a listener (or a head) may be behind its engine before a replay waits for it.
pub(super) const BACKLOG: u64 = 4;

/// Block events of a batch: the hashes it stores and removes.
fn block_events(batch: &EngineBatch) -> u64 {
    batch
        .events
        .iter()
        .map(|e| match e {
            EngineEvent::Stored(s) => s.hashes.len() as u64,
            EngineEvent::Removed { hashes, .. } => hashes.len() as u64,
            _ => 0,
        })
        .sum()
}

/// Replays `requests` through the index at `path` (opened here) and `config.nodes` simulated
/// engines, calling `progress` after each request; then applies every batch again back to back
/// into `ingest_path` to time ingestion.
///
/// # Errors
/// Any error of the index, the listener or the simulated engines' sockets.
pub fn run(
    path: &std::path::Path,
    ingest_path: &std::path::Path,
    requests: &[Request],
    config: &Config,
    engines: &ReplayEngines,
    mut progress: impl FnMut(usize),
) -> Result<EngineReport> {
    let started = Instant::now();
    let nodes = config.nodes.max(1);
    let names: Vec<String> = (0..nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    let warm = Arc::new(Warm::open(path)?);
    let (mut sims, publishers, endpoints) = simulated(config, engines, &names)?;
    let listener = Listener::start(Arc::clone(&warm), &endpoints, Duration::from_secs(30))?;
    wait_connected(std::slice::from_ref(&listener));
    let mut report = EngineReport { requests: requests.len(), load: vec![0; nodes], ..EngineReport::default() };
    let mut load = Load::new(config);
    let mut times = Vec::with_capacity(requests.len());
    // Each node's restarts made, and those the index had seen before the request was asked.
    let mut restarted = vec![0u64; nodes];
    let mut seen = vec![0u64; nodes];
    // Every batch as published: (node, seq, vLLM payload), for the ingest run.
    let mut all: Vec<(usize, u64, Vec<u8>)> = Vec::new();
    // Batches published to each engine's listener.
    let mut sent = vec![0u64; nodes];
    for (i, request) in requests.iter().enumerate() {
        // A real engine takes a request's time to run it; the simulated ones take almost none.
        // So that what the index claims is compared with what the engines hold at the index's
        // pace, not at the simulation's, the replay waits while a listener is more than
        // `BACKLOG` batches behind its engine (at most ten seconds, then goes on).
        let t = Instant::now();
        while t.elapsed() < Duration::from_secs(10)
            && listener.received().iter().zip(&sent).any(|(r, s)| s.saturating_sub(*r) > BACKLOG)
        {
            std::thread::sleep(Duration::from_micros(200));
        }
        if let Some(every) = engines.restart_every.filter(|&n| n > 0)
            && i > 0
            && i % every == 0
        {
            let node = (splitmix64(i as u64) % nodes as u64) as usize;
            nth_mut(&mut sims, node)?.restart();
            nth(&publishers, node)?.restart();
            *nth_mut(&mut restarted, node)? += 1;
            report.restarts += 1;
        }
        let tokens = prompt(config, request);
        if restarted.iter().zip(&seen).any(|(r, s)| r > s) {
            let stats = warm.engine_stats()?;
            for (name, s) in names.iter().zip(seen.iter_mut()) {
                *s = stats.iter().find(|e| &e.node == name).map_or(*s, |e| e.counts.restarts);
            }
        }
        let t0 = Instant::now();
        let (prefix, found) = ask(&warm, &namespace, &names, config.policy, &tokens)?;
        let mut spent = t0.elapsed();
        // The policy weighs each warm prefix: its part in GPU memory whole, the rest at the
        // offload weight.
        let weighed: Vec<(usize, usize)> = found
            .iter()
            .map(|&(node, len, gpu)| (node, gpu + ((len - gpu) as f64 * engines.offload_weight) as usize))
            .collect();
        let (chosen, _) = choose_among(config, &load, &weighed, tokens.len());
        let (claimed, claimed_gpu) = found.iter().find(|f| f.0 == chosen).map_or((0, 0), |f| (f.1, f.2));
        let sim = nth_mut(&mut sims, chosen)?;
        let (held_gpu, held) = sim.holds_by_tier(&tokens);
        let whole = held / BLOCK_TOKENS * BLOCK_TOKENS;
        let cached = if whole >= MIN_BLOCKS * BLOCK_TOKENS { whole } else { 0 };
        report.claimed_tokens += claimed as u64;
        report.claimed_gpu_tokens += claimed_gpu as u64;
        report.cached_tokens += cached as u64;
        report.cached_gpu_tokens += (held_gpu / BLOCK_TOKENS * BLOCK_TOKENS).min(cached) as u64;
        report.cached_engine_tokens += held as u64;
        if claimed > held {
            report.warm_not_cached += 1;
            if *nth(&restarted, chosen)? > 0 && !sim.stored_since_restart(&tokens, claimed) {
                let over = (claimed - held) as u64;
                match nth(&seen, chosen)? >= nth(&restarted, chosen)? {
                    true => report.warm_to_restarted_seen += over,
                    false => report.warm_to_restarted_unseen += over,
                }
            }
        }
        let t1 = Instant::now();
        warm.ran_prefix(&prefix, nth(&names, chosen)?)?;
        spent += t1.elapsed();
        times.push(spent);
        let batch = sim.run(&tokens);
        report.block_events += block_events(&batch);
        nth(&publishers, chosen)?.publish(&batch, false)?;
        *nth_mut(&mut sent, chosen)? += 1;
        all.push((chosen, batch.seq, crate::engine_sim::encode(&batch)));
        load.add(chosen, tokens.len() as u64)?;
        *nth_mut(&mut report.load, chosen)? += tokens.len() as u64;
        report.prompt_tokens += tokens.len() as u64;
        progress(i + 1);
    }
    // Every batch applied before the listener stops.
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let stats = warm.engine_stats()?;
        let behind = sims.iter().zip(&names).any(|(sim, name)| {
            let last = sim.published.back().map(|b| b.seq);
            last.is_some() && stats.iter().find(|s| &s.node == name).map(|s| s.last_seq) != Some(last)
        });
        if !behind {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    report.listen = listener.stop();
    report.index = Timing::of(&times);
    match Arc::try_unwrap(warm) {
        Ok(warm) => warm.close()?,
        Err(shared) => drop(shared),
    }
    report.ingest = ingest(ingest_path, &names, &all, &config.model)?;
    report.wall = started.elapsed();
    Ok(report)
}

/// Applies `batches` (node, seq, vLLM payload) back to back into a new file at `path`,
/// decoding each as the listener does, and makes them durable; returns the time.
fn ingest(
    path: &std::path::Path,
    names: &[String],
    batches: &[(usize, u64, Vec<u8>)],
    model: &str,
) -> Result<Duration> {
    let warm = Warm::open(path)?;
    let t = Instant::now();
    for (node, seq, payload) in batches {
        let batch = decode_engine_batch(*seq, payload, model)?;
        warm.engine_batch(nth(names, *node)?, &batch)?;
    }
    warm.sync()?;
    let spent = t.elapsed();
    warm.close()?;
    Ok(spent)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;
    use superfluid_warm::GroupKind;

    /// The replay without its lag: every engine's batch applied before the next request is
    /// asked; for every request and every engine the index names, what it claims (in all, in GPU
    /// memory) against what that engine would reuse. Returns (probes, of those with a part
    /// only in the offload tier, mismatches, the first ones).
    fn synchronous(
        requests: &[Request],
        groups: &[GroupKind],
        block: usize,
        cache_blocks: usize,
        offload: usize,
    ) -> (usize, usize, usize, Vec<String>) {
        let config = Config { nodes: 4, ..Config::default() };
        let dir = tempfile::tempdir().expect("dir");
        let warm = Warm::builder().nodes_per_prefix(8).open(dir.path().join("sync.redb")).expect("open");
        let namespace = Namespace::new(&config.model).expect("name");
        let names: Vec<String> = (0..config.nodes).map(node_name).collect();
        let mut sims: Vec<SimEngine> = names
            .iter()
            .map(|_| {
                SimEngine::new(block, cache_blocks, &config.model, None)
                    .expect("engine")
                    .with_groups(groups)
                    .with_offload(offload)
                    .without_replays()
                    .without_stored()
            })
            .collect();
        let mut load = Load::new(&config);
        let (mut probes, mut offloaded, mut wrong, mut first) = (0, 0, 0, Vec::new());
        for (i, request) in requests.iter().enumerate() {
            let tokens = prompt(&config, request);
            let (prefix, found) = ask(&warm, &namespace, &names, config.policy, &tokens).expect("ask");
            for &(node, claimed, claimed_gpu) in &found {
                let (gpu, held) = sims[node].holds_by_tier(&tokens);
                let unit = |t: usize| if t >= MIN_BLOCKS * BLOCK_TOKENS { t / BLOCK_TOKENS * BLOCK_TOKENS } else { 0 };
                probes += 1;
                offloaded += usize::from(unit(held) > unit(gpu));
                if (claimed, claimed_gpu) != (unit(held), unit(gpu).min(unit(held))) {
                    wrong += 1;
                    if first.len() < 5 {
                        first.push(format!(
                            "request {i} ({} tokens), node {node}: claimed {claimed} (GPU {claimed_gpu}), engine reuses {held} (GPU {gpu})",
                            tokens.len()
                        ));
                    }
                }
            }
            let weighed: Vec<(usize, usize)> = found.iter().map(|&(n, len, _)| (n, len)).collect();
            let (chosen, _) = choose_among(&config, &load, &weighed, tokens.len());
            warm.ran_prefix(&prefix, &names[chosen]).expect("ran");
            let batch = sims[chosen].run(&tokens);
            let wire = crate::engine_sim::encode(&batch);
            let decoded = decode_engine_batch(batch.seq, &wire, &config.model).expect("decode");
            warm.engine_batch(&names[chosen], &decoded).expect("apply");
            load.add(chosen, tokens.len() as u64).expect("load");
        }
        (probes, offloaded, wrong, first)
    }

    /// Hybrid engines with an offload tier, followed without lag: the index names exactly what
    /// each engine reuses, GPU hit and connector's load, over several layouts, block sizes and
    /// tiers (the synthetic conversations; with `REPLAY_TRACE` a Mooncake trace instead, its first
    /// `REPLAY_REQUESTS`, `REPLAY_CACHE_BLOCKS` and `REPLAY_OFFLOAD_BLOCKS` for gpt-oss's layout).
    #[test]
    fn offloading_hybrid_engines_are_claimed_exactly_without_lag() {
        let sw = |window| GroupKind::SlidingWindow { window };
        let var = |name: &str| std::env::var(name).ok().and_then(|n| n.parse::<usize>().ok());
        if let Ok(path) = std::env::var("REPLAY_TRACE") {
            let mut requests = crate::trace::read(std::path::Path::new(&path)).expect("trace");
            requests.truncate(var("REPLAY_REQUESTS").unwrap_or(1000));
            let (cache, offload) =
                (var("REPLAY_CACHE_BLOCKS").unwrap_or(2048), var("REPLAY_OFFLOAD_BLOCKS").unwrap_or(65_536));
            let (probes, offloaded, wrong, first) =
                synchronous(&requests, &[sw(128), GroupKind::Full], 16, cache, offload);
            eprintln!("{path}: {probes} probes, {offloaded} with a part only offloaded, {wrong} wrong");
            assert_eq!(wrong, 0, "{first:#?}");
            return;
        }
        let requests = crate::trace::synthetic(300, 30, 7);
        let cases: [(&[GroupKind], usize, usize, usize); 7] = [
            (&[sw(128), GroupKind::Full], 16, 2048, 8192),
            (&[sw(128), GroupKind::Full], 16, 1024, 1024),
            (&[sw(128), GroupKind::Full], 32, 1024, 4096),
            (&[GroupKind::Full, sw(100)], 16, 2048, 8192),
            // A window of 129 tokens keeps 8 blocks (cdiv(128, 16)) but loads 9 (cdiv(129, 16)):
            // its offloaded chunks never make a window.
            (&[sw(129), GroupKind::Full], 16, 2048, 8192),
            (&[sw(128), sw(256), GroupKind::Full], 16, 2048, 8192),
            (&[sw(512), sw(512), sw(512), sw(512), sw(512), GroupKind::Full], 16, 4096, 16384),
        ];
        for (groups, block, cache, offload) in cases {
            let (probes, offloaded, wrong, first) = synchronous(&requests, groups, block, cache, offload);
            eprintln!(
                "{groups:?} block {block}, {cache} + {offload}: {probes} probes, {offloaded} with a part only offloaded, {wrong} wrong"
            );
            assert!(offloaded > 0 || groups.contains(&sw(129)), "{probes} probes");
            assert_eq!(wrong, 0, "{groups:?}: {first:#?}");
        }
    }
}
