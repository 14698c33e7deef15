//! Replaying a workload through the index as a head would: for each request, ask `warmest`,
//! choose a node by a routing policy, record the `ran`. The 0.1.7 design is driven with the same
//! decisions in the same run, so the two index times compare.

use std::collections::VecDeque;
use std::time::{Duration, Instant};
use superfluid_warm::ReadIndex;

use crate::baseline::{Baseline, MAX_0_1_7, fnv_chain};
use crate::trace::Request;
use superfluid_warm::{BLOCK_TOKENS, DEFAULT_SYNC_WINDOW, Error, Namespace, Result, Warm};

/// How the head picks a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Policy {
    /// Weigh warmth against load (the default, as cache-aware routers do).
    Balanced,
    /// The naive rule: the warm node whenever it has at least two blocks.
    Warmest,
}

/// The settings of a replay.
#[derive(Clone, Debug)]
pub struct Config {
    /// Nodes in the cluster.
    pub nodes: usize,
    /// Routing policy.
    pub policy: Policy,
    /// A node's load is the prompt tokens it was given over the last `window` requests.
    pub window: usize,
    /// `Balanced`: the warm prefix must cover at least this share of the prompt.
    pub min_share: f64,
    /// `Balanced`: the cluster is imbalanced when max − min load exceeds this many tokens (and
    /// max > 1.5 × min).
    pub balance_abs: u64,
    /// `Balanced`: the bound on the tokens given to each node over the whole replay. A warm
    /// node is taken only while its total stays within this many times the least total, and
    /// otherwise the least total node is, so by construction the most loaded node's total
    /// never exceeds this many times the least one's plus one prompt, whatever the workload.
    pub max_imbalance: f64,
    /// The model the requests are for.
    pub model: String,
    /// Also drive the 0.1.7 design with the same decisions and time it.
    pub baseline: bool,
    /// Map every token into a vocabulary of this size (`token % vocab`), as a real tokenizer's
    /// ids are; `None` keeps the trace's 32-bit tokens.
    pub vocab: Option<u32>,
    /// Give every simulated node an LRU cache of this many 64-token blocks, touched by every
    /// request it is given, and measure what the chosen node really still held.
    pub node_cache_blocks: Option<usize>,
    /// Whether the index was told the node caches' size (`Builder::node_cache_blocks`): for the
    /// report only, the caller opens the index.
    pub index_told_cache: bool,
    /// Restart a pseudo-random node every this many requests (its KV cache is gone).
    pub restart_every: Option<usize>,
    /// Tell the index of each restart (`forget_node`); off, measure what a head that cannot be
    /// told routes wrongly.
    pub forget: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nodes: 8,
            policy: Policy::Balanced,
            window: 256,
            min_share: 0.4,
            balance_abs: 65_536,
            max_imbalance: 1.1,
            model: "mooncake-conversation".into(),
            baseline: true,
            vocab: None,
            node_cache_blocks: None,
            index_told_cache: false,
            restart_every: None,
            forget: true,
        }
    }
}

/// Per-request times, summarised.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timing {
    /// Median.
    pub p50: Duration,
    /// 99th percentile.
    pub p99: Duration,
    /// Sum.
    pub total: Duration,
}

impl Timing {
    /// The median, 99th percentile (an HDR histogram of nanoseconds, 3 significant digits) and
    /// sum of `samples`.
    pub fn of(samples: &[Duration]) -> Timing {
        let total = samples.iter().sum();
        // Up to an hour, to 3 significant digits: always valid bounds. (A histogram made by
        // `new` would only grow on `record`, and `saturating_record` would clip every sample.)
        let Ok(mut histogram) = hdrhistogram::Histogram::<u64>::new_with_max(MAX_SAMPLE_NANOS, 3) else {
            return Timing { total, ..Timing::default() };
        };
        for d in samples {
            histogram.saturating_record(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        }
        let at = |q: f64| Duration::from_nanos(histogram.value_at_quantile(q));
        Timing { p50: at(0.5), p99: at(0.99), total }
    }
}

/// The longest sample [`Timing::of`] tells apart: an hour; longer ones count as an hour.
const MAX_SAMPLE_NANOS: u64 = 3_600_000_000_000;

/// What a replay found.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Requests replayed.
    pub requests: usize,
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Prompt tokens sent to a node that had them warm.
    pub warm_tokens: u64,
    /// Tokens of the longest warm prefix the index answered, summed over the requests (what
    /// `superfluid_warm_warm_tokens_total` counts), whatever node the policy then chose.
    pub answered_warm_tokens: u64,
    /// Requests sent to their warm node.
    pub warm_requests: usize,
    /// Prompt tokens given to each node over the whole replay.
    pub load: Vec<u64>,
    /// Index time per request (hash, `warmest`, `ran`).
    pub index: Timing,
    /// The same for the 0.1.7 design, given the same decisions.
    pub baseline: Option<Timing>,
    /// Time to make everything durable at the end (`sync`).
    pub final_sync: Duration,
    /// Entries in the index at the end.
    pub entries: u64,
    /// Bytes the index wrote to its file (the process's `write` calls, final `sync` included;
    /// Linux only).
    pub bytes_written: Option<u64>,
    /// Bytes 0.1.7's `save` wrote, saving every sync window of its own time and at the end.
    pub baseline_bytes_written: Option<u64>,
    /// With node caches: prompt tokens the chosen node still held (its cached prefix), whether
    /// or not the index said so.
    pub cached_tokens: Option<u64>,
    /// With node caches: of the tokens routed warm, those the chosen node really still held.
    pub warm_tokens_cached: Option<u64>,
    /// With node caches: requests sent as warm to a node that no longer held all of the prefix
    /// the index named.
    pub warm_not_cached: Option<usize>,
    /// With restarts: node restarts made.
    pub restarts: Option<usize>,
    /// With restarts: prompt tokens routed as warm to a node that had restarted since it ran
    /// them (its cache had lost them).
    pub warm_tokens_to_restarted: Option<u64>,
    /// Wall time of the whole replay.
    pub wall: Duration,
}

impl Report {
    /// The index's time per request summed plus the final `sync` that drains the commit
    /// thread's backlog, over 0.1.7's total (`None` without the baseline). Paced: 0.1.7's calls
    /// and the routing run between the index's calls, and the commit thread works through them
    /// too; [`back_to_back`] gives the saturated figure.
    pub fn paced(&self) -> Option<(Duration, f64)> {
        let ours = self.index.total + self.final_sync;
        self.baseline.map(|b| (ours, ours.as_secs_f64() / b.total.as_secs_f64().max(1e-12)))
    }

    /// Share of prompt tokens routed warm.
    pub fn warm_share(&self) -> f64 {
        if self.prompt_tokens == 0 { 0.0 } else { self.warm_tokens as f64 / self.prompt_tokens as f64 }
    }

    /// With node caches: share of prompt tokens routed warm that the chosen node really still
    /// held (the warm share, measured against the caches).
    pub fn warm_share_cached(&self) -> Option<f64> {
        self.warm_tokens_cached.map(|c| self.share(c))
    }

    /// With node caches: share of prompt tokens the chosen node held, whether or not the index
    /// said so (a system prompt every node holds counts here).
    pub fn chosen_cached_share(&self) -> Option<f64> {
        self.cached_tokens.map(|c| self.share(c))
    }

    fn share(&self, tokens: u64) -> f64 {
        share(tokens, self.prompt_tokens)
    }

    /// Most loaded node's tokens over the least loaded's (infinite if one got nothing).
    pub fn imbalance(&self) -> f64 {
        imbalance(&self.load)
    }
}

/// `tokens` as a share of `of` (0 of nothing).
pub(super) fn share(tokens: u64, of: u64) -> f64 {
    if of == 0 { 0.0 } else { tokens as f64 / of as f64 }
}

/// The most loaded node's tokens over the least loaded's (infinite if one got nothing).
pub(super) fn imbalance(load: &[u64]) -> f64 {
    let max = load.iter().copied().max().unwrap_or(0) as f64;
    let min = load.iter().copied().min().unwrap_or(0) as f64;
    if min == 0.0 { f64::INFINITY } else { max / min }
}

/// Node names used by replays: `node-0` …
pub fn node_name(i: usize) -> String {
    format!("node-{i}")
}

/// Node `i` of a replay's per-node `items` (names, loads, caches). Every node index a replay
/// makes is below its node count; one that is not is an error rather than a panic.
pub(super) fn nth<T>(items: &[T], i: usize) -> Result<&T> {
    items.get(i).ok_or_else(|| no_such_node(i, items.len()))
}

/// [`nth`], to change.
pub(super) fn nth_mut<T>(items: &mut [T], i: usize) -> Result<&mut T> {
    let len = items.len();
    items.get_mut(i).ok_or_else(|| no_such_node(i, len))
}

fn no_such_node(i: usize, nodes: usize) -> Error {
    Error::InvalidConfig { detail: format!("node {i} in a replay of {nodes} nodes") }
}

/// Sliding-window load per node, and the tokens each was given in all.
pub(super) struct Load {
    per_node: Vec<u64>,
    recent: VecDeque<(usize, u64)>,
    window: usize,
    total: Vec<u64>,
}

impl Load {
    pub(super) fn new(config: &Config) -> Load {
        Load {
            per_node: vec![0; config.nodes],
            recent: VecDeque::new(),
            window: config.window.max(1),
            total: vec![0; config.nodes],
        }
    }

    /// Adds `tokens` run on `node`; the oldest addition leaves the window.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a node not in the cluster (nothing is added).
    pub(super) fn add(&mut self, node: usize, tokens: u64) -> Result<()> {
        *nth_mut(&mut self.per_node, node)? += tokens;
        *nth_mut(&mut self.total, node)? += tokens;
        self.recent.push_back((node, tokens));
        if self.recent.len() > self.window
            && let Some((n, t)) = self.recent.pop_front()
            // Always there: `add` took it.
            && let Some(load) = self.per_node.get_mut(n)
        {
            *load -= t;
        }
        Ok(())
    }

    fn least(&self) -> usize {
        self.per_node.iter().enumerate().min_by_key(|&(n, &load)| (load, n)).map_or(0, |(n, _)| n)
    }

    /// Whether giving `node` a prompt of `tokens` keeps its total within `max_imbalance` times
    /// the least total.
    fn within(&self, node: usize, tokens: usize, max_imbalance: f64) -> bool {
        let least = self.total.iter().copied().min().unwrap_or(0) as f64;
        self.total.get(node).is_some_and(|&t| (t + tokens as u64) as f64 <= max_imbalance * least)
    }

    /// The node with the least recent load among those [`Load::within`] the bound; if none is,
    /// the node with the least total. Either way the bound holds after the prompt: the node
    /// stays within it, or the least total grows by one prompt.
    fn least_within(&self, tokens: usize, max_imbalance: f64) -> usize {
        (0..self.per_node.len())
            .filter(|&n| self.within(n, tokens, max_imbalance))
            .filter_map(|n| self.per_node.get(n).map(|&l| (l, n)))
            .min()
            .map_or_else(
                || self.total.iter().enumerate().min_by_key(|&(n, &t)| (t, n)).map_or(0, |(n, _)| n),
                |(_, n)| n,
            )
    }

    fn imbalanced(&self, abs: u64) -> bool {
        let max = self.per_node.iter().copied().max().unwrap_or(0);
        let min = self.per_node.iter().copied().min().unwrap_or(0);
        max - min > abs && max as f64 > 1.5 * min as f64
    }
}

/// A node's KV cache as a prefix-caching engine keeps it: an LRU of blocks (by their chained
/// hash), a prompt's cached prefix ending at its first block not held.
#[derive(Debug, Default)]
struct NodeCache {
    capacity: usize,
    last_use: std::collections::HashMap<u64, u64>,
    by_use: std::collections::BTreeMap<u64, u64>,
    tick: u64,
}

impl NodeCache {
    fn new(capacity: usize) -> NodeCache {
        NodeCache { capacity, ..NodeCache::default() }
    }

    /// Blocks of `blocks` held, from the first on.
    fn cached_prefix(&self, blocks: &[u64]) -> usize {
        blocks.iter().take_while(|b| self.last_use.contains_key(b)).count()
    }

    /// Runs a prompt: every block becomes the most recent (in order), the oldest go past
    /// capacity.
    fn run(&mut self, blocks: &[u64]) {
        for &block in blocks {
            self.tick += 1;
            if let Some(old) = self.last_use.insert(block, self.tick) {
                self.by_use.remove(&old);
            }
            self.by_use.insert(self.tick, block);
        }
        while self.last_use.len() > self.capacity {
            let Some((_, oldest)) = self.by_use.pop_first() else { break };
            self.last_use.remove(&oldest);
        }
    }
}

/// Bytes this process has passed to `write` calls (`wchar` of `/proc/self/io`), where the
/// system tells.
fn written_bytes() -> Option<u64> {
    let io = std::fs::read_to_string("/proc/self/io").ok()?;
    io.lines().find_map(|l| l.strip_prefix("wchar:")).and_then(|v| v.trim().parse().ok())
}

/// A request's prompt as the replay gives it (mapped into the vocabulary, if one is set).
pub(super) fn prompt(config: &Config, request: &Request) -> Vec<u32> {
    let mut tokens = request.tokens();
    if let Some(vocab) = config.vocab.filter(|&v| v > 0) {
        tokens.iter_mut().for_each(|t| *t %= vocab);
    }
    tokens
}

/// The node the policy gives a request of `tokens` tokens whose warm nodes are `warm` (node,
/// tokens; longest first): `Warmest` the first (the least loaded if none); `Balanced`, unless
/// the cluster is imbalanced, the least loaded whose warm prefix covers `min_share` of the
/// prompt, and either way only a node within `max_imbalance` ([`Load::least_within`] if none
/// is). Returns the node and the tokens it has warm.
pub(super) fn choose_among(config: &Config, load: &Load, warm: &[(usize, usize)], tokens: usize) -> (usize, usize) {
    let warm_len = |node: usize| warm.iter().find(|w| w.0 == node).map_or(0, |w| w.1);
    let least = || load.least_within(tokens, config.max_imbalance);
    let chosen = match config.policy {
        Policy::Warmest => warm.first().map_or_else(|| load.least(), |w| w.0),
        Policy::Balanced if load.imbalanced(config.balance_abs) => least(),
        Policy::Balanced => warm
            .iter()
            .filter(|&&(node, len)| {
                len as f64 >= config.min_share * tokens as f64 && load.within(node, tokens, config.max_imbalance)
            })
            // (A node without a load, never given, is not one to route to.)
            .filter_map(|&(node, _)| load.per_node.get(node).map(|&l| (l, node)))
            .min()
            .map_or_else(least, |(_, node)| node),
    };
    (chosen, warm_len(chosen))
}

/// What the index answered of a prompt.
pub(super) struct Answered {
    pub prefix: superfluid_warm::Prefix,
    /// Its warm nodes by index into the replay's names, with the tokens each has warm, longest
    /// first.
    pub found: Vec<(usize, usize)>,
    /// The tokens of the longest warm prefix answered (whatever its node).
    pub longest: usize,
}

/// The prompt's prefix and its warm nodes: balanced weighs every warm node, warmest needs only
/// the first.
pub(super) fn ask(
    warm: &Warm,
    namespace: &Namespace,
    names: &[String],
    policy: Policy,
    tokens: &[u32],
) -> Result<Answered> {
    let prefix = warm.prefix(namespace, tokens);
    let hits: Vec<superfluid_warm::Hit> = match policy {
        Policy::Balanced => warm.warm_nodes_prefix(&prefix)?,
        Policy::Warmest => warm.warmest_prefix(&prefix)?.into_iter().collect(),
    };
    let longest = hits.first().map_or(0, |h| h.tokens);
    let found =
        hits.into_iter().filter_map(|h| names.iter().position(|n| *n == h.node).map(|n| (n, h.tokens))).collect();
    Ok(Answered { prefix, found, longest })
}

/// 0.1.7's durability: its whole file saved every sync window of its own time.
#[derive(Default)]
struct Saves {
    since: Duration,
    bytes: u64,
}

impl Saves {
    /// 0.1.7's `warmest` and `ran` of `tokens` on `node`, timed; then a save if a window of its
    /// time has gone by (not timed: 0.1.7 is measured in memory). Returns the calls' time.
    fn call(&mut self, model: &mut Baseline, name: &str, tokens: &[u32], node: &str) -> Duration {
        let t = Instant::now();
        std::hint::black_box(model.warmest(name, tokens));
        model.ran(name, tokens, node);
        let spent = t.elapsed();
        self.since += spent;
        if self.since >= DEFAULT_SYNC_WINDOW {
            self.bytes += model.save() as u64;
            self.since = Duration::ZERO;
        }
        spent
    }
}

/// Replays `requests` through `warm`, calling `progress` after each.
///
/// # Errors
/// [`Error::InvalidConfig`] for a cluster of no nodes; any error of the index.
pub fn run(warm: &Warm, requests: &[Request], config: &Config, mut progress: impl FnMut(usize)) -> Result<Report> {
    let started = Instant::now();
    let nodes = config.nodes;
    if nodes == 0 {
        return Err(Error::InvalidConfig { detail: "a replay needs at least one node".into() });
    }
    let names: Vec<String> = (0..nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    // 0.1.7 saves its whole file every sync window of its own time (its durability interval
    // matched to ours), into a directory removed after.
    let save_dir = match config.baseline {
        true => Some(tempfile::tempdir().map_err(temp_dir_error)?),
        false => None,
    };
    let mut baseline = save_dir.as_ref().map(|d| Baseline::kept_in(d.path().join("warm.json"), MAX_0_1_7));
    let mut saves = Saves::default();
    let mut load = Load::new(config);
    let mut report = Report { requests: requests.len(), load: vec![0; nodes], ..Report::default() };
    let mut caches: Option<Vec<NodeCache>> =
        config.node_cache_blocks.map(|n| (0..nodes).map(|_| NodeCache::new(n)).collect());
    let (mut cached_tokens, mut claimed_cached, mut warm_not_cached) = (0u64, 0u64, 0usize);
    let written_before = written_bytes();
    let (mut ours, mut theirs) = (Vec::with_capacity(requests.len()), Vec::with_capacity(requests.len()));
    // With restarts: what each node has run since it last restarted (the truth a forget tells).
    let mut since_restart: Option<Vec<std::collections::HashSet<u64>>> =
        config.restart_every.map(|_| vec![std::collections::HashSet::new(); nodes]);
    let (mut restarts, mut to_restarted) = (0usize, 0u64);
    for (i, request) in requests.iter().enumerate() {
        if let (Some(every), Some(ran)) = (config.restart_every.filter(|&n| n > 0), since_restart.as_mut())
            && i > 0
            && i % every == 0
        {
            let node = (crate::trace::splitmix64(i as u64) % nodes as u64) as usize;
            nth_mut(ran, node)?.clear();
            restarts += 1;
            if config.forget {
                warm.forget_node(nth(&names, node)?)?;
            }
        }
        let tokens = prompt(config, request);
        let t0 = Instant::now();
        let Answered { prefix, found, longest } = ask(warm, &namespace, &names, config.policy, &tokens)?;
        let mut elapsed = t0.elapsed();
        report.answered_warm_tokens += longest as u64;
        let (chosen, warm_len) = choose_among(config, &load, &found, tokens.len());
        let name = nth(&names, chosen)?;
        let warm_node = (warm_len > 0).then_some((chosen, warm_len));
        if warm_len > 0 {
            report.warm_tokens += warm_len as u64;
            report.warm_requests += 1;
        }
        if let Some(ran) = since_restart.as_mut() {
            let blocks: Vec<u64> = fnv_chain(&config.model, &tokens).collect();
            let ran = nth_mut(ran, chosen)?;
            let held = blocks.iter().take_while(|b| ran.contains(b)).count() * BLOCK_TOKENS;
            to_restarted += warm_len.saturating_sub(held) as u64;
            ran.extend(blocks);
        }
        let t1 = Instant::now();
        warm.ran_prefix(&prefix, name)?;
        elapsed += t1.elapsed();
        ours.push(elapsed);
        if let Some(b) = baseline.as_mut() {
            theirs.push(saves.call(b, &config.model, &tokens, name));
        }
        if let Some(caches) = caches.as_mut() {
            let blocks: Vec<u64> = fnv_chain(&config.model, &tokens).collect();
            let cache = nth_mut(caches, chosen)?;
            let held = cache.cached_prefix(&blocks);
            cached_tokens += (held * BLOCK_TOKENS) as u64;
            if let Some((_, len)) = warm_node.filter(|&(node, _)| node == chosen) {
                claimed_cached += (held * BLOCK_TOKENS).min(len) as u64;
                warm_not_cached += usize::from(held * BLOCK_TOKENS < len);
            }
            cache.run(&blocks);
        }
        load.add(chosen, tokens.len() as u64)?;
        *nth_mut(&mut report.load, chosen)? += tokens.len() as u64;
        report.prompt_tokens += tokens.len() as u64;
        progress(i + 1);
    }
    let t3 = Instant::now();
    warm.sync()?;
    report.final_sync = t3.elapsed();
    if let Some(b) = baseline.as_mut() {
        saves.bytes += b.save() as u64;
    }
    let saved = saves.bytes;
    // Everything this process wrote, less 0.1.7's saves, is the index's.
    report.bytes_written = written_before.zip(written_bytes()).map(|(a, b)| b.saturating_sub(a).saturating_sub(saved));
    report.baseline_bytes_written = baseline.is_some().then_some(saved);
    if since_restart.is_some() {
        report.restarts = Some(restarts);
        report.warm_tokens_to_restarted = Some(to_restarted);
    }
    if caches.is_some() {
        report.cached_tokens = Some(cached_tokens);
        report.warm_tokens_cached = Some(claimed_cached);
        report.warm_not_cached = Some(warm_not_cached);
    }
    report.index = Timing::of(&ours);
    report.baseline = baseline.map(|_| Timing::of(&theirs));
    report.entries = warm.stats()?.entries;
    report.wall = started.elapsed();
    Ok(report)
}

/// A back-to-back replay: the head calls the index for one request after another with nothing
/// between them (every prompt made beforehand), then `sync`s; the 0.1.7 design is then given
/// the same prompts and the same choices alone. Without 0.1.7's calls in between, the commit
/// thread has no time to catch up but what the head's own calls leave it: this is the
/// throughput a saturated head gets, with everything durable at the end.
#[derive(Clone, Debug, Default)]
pub struct BackToBack {
    /// Requests replayed.
    pub requests: usize,
    /// From the first call until the last `ran` returned (the routing between the calls
    /// included: a few hundred nanoseconds a request).
    pub calls: Duration,
    /// The final `sync` after it: the commit thread's backlog.
    pub final_sync: Duration,
    /// Prompt tokens routed warm (the same as a paced replay's from an empty index: the answers
    /// do not depend on commit timing).
    pub warm_tokens: u64,
    /// Entries at the end.
    pub entries: u64,
    /// Bytes the index wrote to its file (the final `sync` included), where the system tells.
    pub bytes_written: Option<u64>,
    /// 0.1.7's time for the same calls, in memory (`None` without the baseline).
    pub baseline: Option<Duration>,
    /// Bytes 0.1.7's `save` wrote, saving every sync window of its own time and at the end.
    pub baseline_bytes_written: Option<u64>,
}

impl BackToBack {
    /// The calls and the final `sync`: the index's whole time.
    pub fn ours(&self) -> Duration {
        self.calls + self.final_sync
    }

    /// The index's whole time over 0.1.7's (`None` without the baseline).
    pub fn ratio(&self) -> Option<f64> {
        self.baseline.map(|b| self.ours().as_secs_f64() / b.as_secs_f64().max(1e-12))
    }

    /// Requests a second, the index's whole time.
    pub fn requests_per_s(&self) -> f64 {
        self.requests as f64 / self.ours().as_secs_f64().max(1e-9)
    }

    /// Requests a second for 0.1.7 in memory (`None` without the baseline).
    pub fn baseline_requests_per_s(&self) -> Option<f64> {
        self.baseline.map(|b| self.requests as f64 / b.as_secs_f64().max(1e-9))
    }
}

/// Replays `requests` back to back through `warm`, which should be fresh (see [`BackToBack`]),
/// by the policy of `config` (the nodes' caches and restarts are not simulated: `config`'s
/// `node_cache_blocks`, `restart_every` and `forget` are not read); then, with
/// `config.baseline`, the 0.1.7 design alone on the same prompts and choices. Every prompt is
/// made before the clock starts: ~4 bytes a prompt token (the whole Mooncake trace: ~580 MB).
///
/// # Errors
/// [`Error::InvalidConfig`] for a cluster of no nodes; any error of the index.
pub fn back_to_back(
    warm: &Warm,
    requests: &[Request],
    config: &Config,
    mut progress: impl FnMut(usize),
) -> Result<BackToBack> {
    if config.nodes == 0 {
        return Err(Error::InvalidConfig { detail: "a replay needs at least one node".into() });
    }
    let names: Vec<String> = (0..config.nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    let prompts: Vec<Vec<u32>> = requests.iter().map(|r| prompt(config, r)).collect();
    let mut chosen = Vec::with_capacity(prompts.len());
    let mut load = Load::new(config);
    let mut report = BackToBack { requests: requests.len(), ..BackToBack::default() };
    let written_before = written_bytes();
    let started = Instant::now();
    for tokens in &prompts {
        let Answered { prefix, found, .. } = ask(warm, &namespace, &names, config.policy, tokens)?;
        let (node, warm_len) = choose_among(config, &load, &found, tokens.len());
        warm.ran_prefix(&prefix, nth(&names, node)?)?;
        load.add(node, tokens.len() as u64)?;
        report.warm_tokens += warm_len as u64;
        chosen.push(node);
        // Told every 256 requests: a call per request would be timed with the index.
        if chosen.len().is_multiple_of(256) {
            progress(chosen.len());
        }
    }
    report.calls = started.elapsed();
    let synced = Instant::now();
    warm.sync()?;
    report.final_sync = synced.elapsed();
    report.bytes_written = written_before.zip(written_bytes()).map(|(a, b)| b.saturating_sub(a));
    report.entries = warm.stats()?.entries;
    if config.baseline {
        let dir = tempfile::tempdir().map_err(temp_dir_error)?;
        let mut model = Baseline::kept_in(dir.path().join("warm.json"), MAX_0_1_7);
        let (mut total, mut saves) = (Duration::ZERO, Saves::default());
        for (tokens, &node) in prompts.iter().zip(&chosen) {
            total += saves.call(&mut model, &config.model, tokens, nth(&names, node)?);
        }
        report.baseline = Some(total);
        report.baseline_bytes_written = Some(saves.bytes + model.save() as u64);
    }
    Ok(report)
}

/// What a replay by several head threads found: throughput, beside 0.1.7's behind one mutex.
#[derive(Clone, Debug, Default)]
pub struct Threaded {
    /// Head threads.
    pub threads: usize,
    /// The routing and the per-request times, as a one-thread replay reports them.
    pub report: Report,
    /// Requests over the wall time of the whole replay, final `sync` included.
    pub requests_per_s: f64,
    /// The same for the 0.1.7 design, shared by the threads behind one mutex, deciding by its
    /// own answers (`None` without the baseline).
    pub baseline_requests_per_s: Option<f64>,
}

/// Each request's conversation: the conversation of the earlier request that first had the
/// deepest of its blocks an earlier request had (past the first block, which conversations
/// share as their system prompt), or a new one (numbered by its first request).
pub fn conversations(requests: &[Request]) -> Vec<usize> {
    let mut first_seen: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    let mut out = Vec::with_capacity(requests.len());
    for (i, r) in requests.iter().enumerate() {
        let earlier = r.hash_ids.iter().skip(1).rev().find_map(|id| first_seen.get(id).copied());
        // `j` is an earlier request's, so in `out`; a new conversation if not.
        out.push(earlier.and_then(|j: usize| out.get(j).copied()).unwrap_or(i));
        for id in &r.hash_ids {
            first_seen.entry(*id).or_insert(i);
        }
    }
    out
}

/// Replays `requests` with `threads` head threads sharing `warm` (and the routing's load), each
/// conversation on one thread so that its turns stay in order. Then, with `config.baseline`,
/// the same threads over the 0.1.7 design behind one mutex.
///
/// # Errors
/// [`Error::InvalidConfig`] for no nodes or no threads; any error of the index.
pub fn run_threads(warm: &Warm, requests: &[Request], config: &Config, threads: usize) -> Result<Threaded> {
    if config.nodes == 0 || threads == 0 {
        return Err(Error::InvalidConfig { detail: "a replay needs at least one node and one thread".into() });
    }
    if config.node_cache_blocks.is_some() {
        return Err(Error::InvalidConfig { detail: "node caches are simulated by one-thread replays only".into() });
    }
    let names: Vec<String> = (0..config.nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    let conversation = conversations(requests);
    let share: Vec<Vec<&Request>> = (0..threads)
        .map(|t| requests.iter().zip(&conversation).filter(|&(_, c)| c % threads == t).map(|(r, _)| r).collect())
        .collect();
    let shared = std::sync::Mutex::new((
        Load::new(config),
        Report { requests: requests.len(), load: vec![0; config.nodes], ..Report::default() },
    ));
    let started = Instant::now();
    let times = std::thread::scope(|scope| -> Result<Vec<Duration>> {
        let workers: Vec<_> = share
            .iter()
            .map(|mine| {
                let (shared, names, namespace) = (&shared, &names, &namespace);
                scope.spawn(move || -> Result<Vec<Duration>> {
                    let mut times = Vec::with_capacity(mine.len());
                    for request in mine {
                        let tokens = prompt(config, request);
                        let t0 = Instant::now();
                        let prefix = warm.prefix(namespace, &tokens);
                        let hit = warm.warmest_prefix(&prefix)?;
                        let mut elapsed = t0.elapsed();
                        let warm_node =
                            hit.as_ref().and_then(|h| names.iter().position(|n| *n == h.node).map(|n| (n, h.tokens)));
                        let chosen = {
                            let mut guard = shared.lock().map_err(|_| Error::Poisoned)?;
                            let (load, report) = &mut *guard;
                            let chosen = choose_among(config, load, warm_node.as_slice(), tokens.len()).0;
                            if let Some((_, len)) = warm_node.filter(|&(node, _)| node == chosen) {
                                report.warm_tokens += len as u64;
                                report.warm_requests += 1;
                            }
                            load.add(chosen, tokens.len() as u64)?;
                            *nth_mut(&mut report.load, chosen)? += tokens.len() as u64;
                            report.prompt_tokens += tokens.len() as u64;
                            chosen
                        };
                        let t1 = Instant::now();
                        warm.ran_prefix(&prefix, nth(names, chosen)?)?;
                        elapsed += t1.elapsed();
                        times.push(elapsed);
                    }
                    Ok(times)
                })
            })
            .collect();
        let mut all = Vec::with_capacity(requests.len());
        for worker in workers {
            all.extend(worker.join().map_err(|_| Error::Poisoned)??);
        }
        Ok(all)
    })?;
    let t3 = Instant::now();
    warm.sync()?;
    let (_, mut report) = shared.into_inner().map_err(|_| Error::Poisoned)?;
    report.final_sync = t3.elapsed();
    report.wall = started.elapsed();
    report.index = Timing::of(&times);
    report.entries = warm.stats()?.entries;
    let requests_per_s = requests.len() as f64 / report.wall.as_secs_f64().max(1e-9);
    let baseline_requests_per_s = if config.baseline {
        let model = std::sync::Mutex::new(Baseline::in_memory(MAX_0_1_7));
        let load = std::sync::Mutex::new(Load::new(config));
        let started = Instant::now();
        std::thread::scope(|scope| -> Result<()> {
            let workers: Vec<_> = share
                .iter()
                .map(|mine| {
                    let (model, load, names) = (&model, &load, &names);
                    scope.spawn(move || -> Result<()> {
                        for request in mine {
                            let tokens = prompt(config, request);
                            let mut model = model.lock().map_err(|_| Error::Poisoned)?;
                            let warm_node = model
                                .warmest(&config.model, &tokens)
                                .and_then(|(node, len)| names.iter().position(|n| n == node).map(|n| (n, len)));
                            let mut load = load.lock().map_err(|_| Error::Poisoned)?;
                            let chosen = choose_among(config, &load, warm_node.as_slice(), tokens.len()).0;
                            load.add(chosen, tokens.len() as u64)?;
                            drop(load);
                            model.ran(&config.model, &tokens, nth(names, chosen)?);
                        }
                        Ok(())
                    })
                })
                .collect();
            for worker in workers {
                worker.join().map_err(|_| Error::Poisoned)??;
            }
            Ok(())
        })?;
        Some(requests.len() as f64 / started.elapsed().as_secs_f64().max(1e-9))
    } else {
        None
    };
    Ok(Threaded { threads, report, requests_per_s, baseline_requests_per_s })
}

/// A temporary directory that could not be made, as the index's I/O error on the temporary
/// folder.
fn temp_dir_error(e: std::io::Error) -> Error {
    Error::Io { path: std::env::temp_dir(), source: std::sync::Arc::new(e) }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn timing_gives_the_percentiles_of_its_samples_to_three_digits() {
        // 1 µs, 2 µs, ..., 1000 µs, then one sample of two hours.
        let mut samples: Vec<Duration> = (1..=1000).map(Duration::from_micros).collect();
        samples.push(Duration::from_secs(7200));
        let t = Timing::of(&samples);
        let close = |got: Duration, want: Duration| {
            let (g, w) = (got.as_secs_f64(), want.as_secs_f64());
            assert!((g - w).abs() <= w * 2e-3, "{got:?} is not {want:?} to 3 digits");
        };
        close(t.p50, Duration::from_micros(501));
        close(t.p99, Duration::from_micros(991));
        assert_eq!(t.total, Duration::from_secs(7200) + Duration::from_micros(500_500));
        let long = Timing::of(&[Duration::from_secs(7200)]);
        close(long.p50, Duration::from_nanos(MAX_SAMPLE_NANOS));
        assert_eq!(Timing::of(&[]).total, Duration::ZERO);
    }

    #[test]
    fn a_node_cache_keeps_the_most_recent_blocks_and_a_prefix_stops_at_the_first_miss() {
        let mut cache = NodeCache::new(4);
        cache.run(&[1, 2, 3]);
        assert_eq!(cache.cached_prefix(&[1, 2, 3, 9]), 3);
        cache.run(&[7, 8]); // 1 is the oldest: it goes
        assert_eq!(cache.cached_prefix(&[1, 2, 3]), 0, "the first block went, so nothing is a prefix");
        assert_eq!(cache.cached_prefix(&[2, 3, 7]), 3);
        cache.run(&[2]); // 2 is the newest now; 3 the oldest
        cache.run(&[5]);
        assert_eq!(cache.cached_prefix(&[2, 7, 8, 5]), 4);
        assert_eq!(cache.cached_prefix(&[3]), 0);
        assert_eq!(cache.last_use.len(), 4);
        assert_eq!(cache.by_use.len(), 4);
    }

    #[test]
    fn a_conversation_is_the_chain_of_requests_that_extend_each_other() {
        let r = |ids: &[u64]| Request {
            timestamp: 0,
            input_length: ids.len() * 512,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        // Two conversations on one system block 0; the third request continues the first.
        let requests = [r(&[0, 1, 2]), r(&[0, 3]), r(&[0, 1, 2, 4]), r(&[0]), r(&[0, 3, 5]), r(&[0, 1, 6])];
        assert_eq!(conversations(&requests), [0, 1, 0, 3, 1, 0]);
    }
}
