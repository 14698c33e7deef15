//! Several heads replaying one workload: requests spread round-robin over `H` heads that share
//! one view through a NATS JetStream stream, beside the same requests over `H` heads that do
//! not share (each knows only what it routed).

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use superfluid_warm::ReadIndex;

use crate::replay::{
    Config, Load, Policy, choose_among, conversations, imbalance, node_name, nth, nth_mut, prompt, share,
};
use crate::trace::Request;
use superfluid_warm::{Builder, Error, Hit, Namespace, Result, SharedWarm, Sharing, Ticket, Warm};

/// How long a head waits for a conversation's previous turn to reach it before it routes the
/// next one without it.
const TURN_WAIT: Duration = Duration::from_secs(5);
/// How long each head may take to connect and open the stream before the replay gives up:
/// a server that is down, or has no JetStream, fails the replay in seconds, with the reason.
const READY_WAIT: Duration = Duration::from_secs(5);

/// What a replay over several heads found.
#[derive(Clone, Debug, Default)]
pub struct HeadsReport {
    /// Heads.
    pub heads: usize,
    /// Requests replayed.
    pub requests: usize,
    /// Prompt tokens in all.
    pub prompt_tokens: u64,
    /// Prompt tokens routed warm by the sharing heads.
    pub warm_tokens: u64,
    /// Prompt tokens routed warm by the heads that do not share.
    pub warm_tokens_unshared: u64,
    /// Most loaded node's tokens over the least loaded's, sharing and not.
    pub imbalance: f64,
    /// The same, not sharing.
    pub imbalance_unshared: f64,
    /// Publish-to-applied lags of every event on every other head, in ns, sorted.
    pub lags_ns: Vec<u64>,
    /// Requests whose head had not yet applied the conversation's previous turn (made on
    /// another head) when it came, and waited for it.
    pub waited: usize,
    /// Their waits in all.
    pub waited_for: Duration,
    /// Events every head applied (the fewest of any head).
    pub events: u64,
    /// Wall time of the sharing replay, until every head applied every event.
    pub wall: Duration,
    /// The last transient error of each head that had one (the link retried it).
    pub errors: Vec<String>,
}

impl HeadsReport {
    /// Share of prompt tokens routed warm by the sharing heads.
    pub fn warm_share(&self) -> f64 {
        self.share(self.warm_tokens)
    }

    /// Share of prompt tokens routed warm by the heads that do not share.
    pub fn warm_share_unshared(&self) -> f64 {
        self.share(self.warm_tokens_unshared)
    }

    fn share(&self, tokens: u64) -> f64 {
        share(tokens, self.prompt_tokens)
    }

    /// The `q` quantile of the lags, in ms.
    pub fn lag_ms(&self, q: f64) -> Option<f64> {
        let i = ((self.lags_ns.len() as f64 - 1.0) * q).round() as usize;
        self.lags_ns.get(i).map(|&ns| ns as f64 / 1e6)
    }
}

/// One routing decision: the warm nodes the head knows, the node chosen, the tokens it has warm.
fn route(config: &Config, load: &Load, names: &[String], hits: Vec<Hit>, tokens: usize) -> (usize, usize) {
    let found: Vec<(usize, usize)> =
        hits.into_iter().filter_map(|h| names.iter().position(|n| *n == h.node).map(|n| (n, h.tokens))).collect();
    choose_among(config, load, &found, tokens)
}

/// Replays `requests` over `heads` heads sharing stream `stream` of the NATS server at `url`
/// (files in `dir`, opened with `builder`'s settings), round-robin, each turn of a conversation waiting until its head has
/// applied the previous turn (a trace's turns are seconds apart; the lag is reported), then
/// over `heads` heads that do not share.
///
/// # Errors
/// [`Error::InvalidConfig`] for no nodes or no heads; [`Error::Sharing`] within seconds if a
/// head cannot connect to the server or open the stream (with the reason: nothing listening at
/// the URL, no JetStream), or if a head halts (the stream deleted under it); any error of the
/// index or the sharing.
pub fn run_heads(
    builder: &Builder,
    dir: &Path,
    url: &str,
    requests: &[Request],
    config: &Config,
    heads: usize,
) -> Result<HeadsReport> {
    if config.nodes == 0 || heads == 0 {
        return Err(Error::InvalidConfig { detail: "a replay needs at least one node and one head".into() });
    }
    let names: Vec<String> = (0..config.nodes).map(node_name).collect();
    let namespace = Namespace::new(&config.model)?;
    let conversation = conversations(requests);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let stream = format!("replay-{}-{nanos}", std::process::id());
    let mut builder = builder.clone();
    builder.compact_on_close(false);
    let shared: Vec<SharedWarm> = (0..heads)
        .map(|h| {
            SharedWarm::open(
                &builder,
                dir.join(format!("shared-{h}.redb")),
                Sharing::nats(url, &stream, &format!("h{h}")).max_age(Duration::from_secs(3600)),
            )
        })
        .collect::<Result<_>>()?;
    for head in &shared {
        head.wait_ready(READY_WAIT)?;
    }
    let alone: Vec<Warm> =
        (0..heads).map(|h| builder.open(dir.join(format!("alone-{h}.redb")))).collect::<Result<_>>()?;
    let mut report = HeadsReport { heads, requests: requests.len(), ..HeadsReport::default() };
    let (mut load, mut load_alone) = (Load::new(config), Load::new(config));
    let (mut per_node, mut per_node_alone) = (vec![0u64; config.nodes], vec![0u64; config.nodes]);
    let mut last_turn: HashMap<usize, (usize, Ticket)> = HashMap::new();
    let started = Instant::now();
    // Request `i` goes to head `i % heads`: its sharing head and the head that does not share.
    let round_robin = shared.iter().zip(&alone).enumerate().cycle();
    for ((request, &conv), (h, (head, lone))) in requests.iter().zip(&conversation).zip(round_robin) {
        let tokens = prompt(config, request);
        if let Some((made_on, ticket)) = last_turn.get(&conv)
            && *made_on != h
        {
            let t = Instant::now();
            if !head.wait_for(ticket, Duration::ZERO) {
                report.waited += 1;
                head.wait_for(ticket, TURN_WAIT);
                report.waited_for += t.elapsed();
            }
        }
        let prefix = head.prefix(&namespace, &tokens);
        let hits = match config.policy {
            Policy::Balanced => head.warm_nodes_prefix(&prefix)?,
            Policy::Warmest => head.warmest_prefix(&prefix)?.into_iter().collect(),
        };
        let (chosen, warm) = route(config, &load, &names, hits, tokens.len());
        report.warm_tokens += warm as u64;
        let ticket = head.ran_prefix(&prefix, nth(&names, chosen)?)?;
        last_turn.insert(conv, (h, ticket));
        load.add(chosen, tokens.len() as u64)?;
        *nth_mut(&mut per_node, chosen)? += tokens.len() as u64;

        let prefix = lone.prefix(&namespace, &tokens);
        let hits = match config.policy {
            Policy::Balanced => lone.warm_nodes_prefix(&prefix)?,
            Policy::Warmest => lone.warmest_prefix(&prefix)?.into_iter().collect(),
        };
        let (chosen, warm) = route(config, &load_alone, &names, hits, tokens.len());
        report.warm_tokens_unshared += warm as u64;
        lone.ran_prefix(&prefix, nth(&names, chosen)?)?;
        load_alone.add(chosen, tokens.len() as u64)?;
        *nth_mut(&mut per_node_alone, chosen)? += tokens.len() as u64;
        report.prompt_tokens += tokens.len() as u64;
    }
    for head in &shared {
        published(head)?;
    }
    // Every head applies every event (the stream holds one per `ran`).
    for head in &shared {
        if !head.wait_applied(requests.len() as u64, Duration::from_secs(60)) {
            let stats = head.share_stats();
            let detail = match &stats.halted {
                Some(halted) => halted.clone(),
                None => format!("a head did not apply the whole stream within 60 s: {stats:?}"),
            };
            return Err(Error::Sharing { detail, source: None });
        }
    }
    report.wall = started.elapsed();
    report.events = shared.iter().map(|h| h.share_stats().applied_events).min().unwrap_or(0);
    report.imbalance = imbalance(&per_node);
    report.imbalance_unshared = imbalance(&per_node_alone);
    report.lags_ns = shared.iter().flat_map(SharedWarm::lags_ns).collect();
    report.errors = shared.iter().filter_map(|h| h.share_stats().error).collect();
    report.lags_ns.sort_unstable();
    for head in shared {
        head.close()?;
    }
    for lone in alone {
        lone.close()?;
    }
    Ok(report)
}

/// Waits until every event of `head` is in the stream: `sync`, again while the server is only
/// slow to acknowledge (`Unpublished`, the events buffered), for up to two minutes.
fn published(head: &SharedWarm) -> Result<()> {
    let started = Instant::now();
    loop {
        match head.sync() {
            Err(Error::Unpublished { .. }) if started.elapsed() < Duration::from_secs(120) => {}
            done => return done,
        }
    }
}
