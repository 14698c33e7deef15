//! What `replay` reports, as text or as one JSON object: a paced replay beside 0.1.7 (with its
//! back-to-back and threaded passes), sharing heads, engines that publish their KV events.

use std::path::Path;
use std::time::Duration;

use crate::format::thousands;
use harness::engine_heads::{self, EngineHeadsReport};
use harness::engine_replay::{EngineReport, ReplayEngines};
use harness::heads::HeadsReport;
use harness::replay::{self, BackToBack, Config, Policy, Report, Threaded, Timing};
use serde_json::json;
use superfluid_warm::DEFAULT_SYNC_WINDOW;

/// Dynamo's KV router applying block events in memory, not durably, on the shared trace on
/// these machines (issue 26's figure), for scale beside ours.
const DYNAMO_BLOCK_OPS_PER_S: f64 = 11.8e6;

pub(crate) fn engines_text(r: &EngineReport, e: &ReplayEngines, source: &str) -> String {
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let ms = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{:.1} ms", v * 1000.0));
    let lag50 =
        r.listen.iter().filter_map(|l| l.lag_p50).fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    let lag99 =
        r.listen.iter().filter_map(|l| l.lag_p99).fold(None, |a: Option<f64>, v| Some(a.map_or(v, |a| a.max(v))));
    let replays: u64 = r.listen.iter().map(|l| l.replays).sum();
    let mut text = format!(
        "{} requests of {source} over {} engines ({}-token blocks, {} blocks each), publishing vLLM's KV events over ZMQ\n",
        thousands(r.requests as u64),
        r.load.len(),
        e.block,
        thousands(e.cache_blocks as u64)
    );
    text += &format!(
        "warm share claimed by the index   {} of prompt tokens\ncached share (engines held)       {} in blocks of 64 ({} at the engine's block size)\n",
        pct(r.claimed_share()),
        pct(r.cached_share()),
        pct(r.cached_engine_share())
    );
    text += &format!(
        "claimed - cached                  {:+.3} points\nsent warm to a node holding less  {} requests\nload max/min                      {:.3}\n",
        100.0 * (r.claimed_share() - r.cached_share()),
        thousands(r.warm_not_cached as u64),
        r.imbalance()
    );
    if !e.groups.is_empty() {
        let groups: Vec<String> = e
            .groups
            .iter()
            .map(|g| match g {
                superfluid_warm::GroupKind::SlidingWindow { window } => format!("sliding window {window}"),
                _ => "full attention".to_string(),
            })
            .collect();
        text += &format!("engines' KV cache groups          {}\n", groups.join(", "));
    }
    if e.offload_blocks > 0 {
        text += &format!(
            "by tier (offload tier of {} blocks, weighed {}): in GPU memory claimed {}, cached {} ({:+.3} points); only offloaded claimed {}, cached {} ({:+.3} points)\n",
            thousands(e.offload_blocks as u64),
            e.offload_weight,
            pct(r.claimed_gpu_share()),
            pct(r.cached_gpu_share()),
            100.0 * (r.claimed_gpu_share() - r.cached_gpu_share()),
            pct(r.claimed_offload_share()),
            pct(r.cached_offload_share()),
            100.0 * (r.claimed_offload_share() - r.cached_offload_share()),
        );
    }
    if r.restarts > 0 {
        text += &format!(
            "engine restarts                   {} (tokens routed warm that only a restarted engine's old process held: {} once the restart was seen, {} before)\n",
            r.restarts,
            thousands(r.warm_to_restarted_seen),
            thousands(r.warm_to_restarted_unseen)
        );
    }
    text += &format!(
        "lag publish -> applied            {} p50, {} p99 (worst engine); {} replays\nhead's calls per request          {:.1} us p50, {:.1} us p99\n",
        ms(lag50),
        ms(lag99),
        replays,
        r.index.p50.as_secs_f64() * 1e6,
        r.index.p99.as_secs_f64() * 1e6
    );
    text += &format!(
        "ingest, back to back, durable     {} block events in {:.2} s: {} events/s (Dynamo's router, in memory, not durable: ~{:.1}M/s)",
        thousands(r.block_events),
        r.ingest.as_secs_f64(),
        thousands(r.ingest_rate() as u64),
        DYNAMO_BLOCK_OPS_PER_S / 1e6
    );
    text
}

pub(crate) fn engines_json(r: &EngineReport, e: &ReplayEngines, source: &str) -> String {
    json!({
        "source": source, "requests": r.requests, "engines": r.load.len(), "engine_block": e.block,
        "engine_cache_blocks": e.cache_blocks, "claimed_share": r.claimed_share(), "cached_share": r.cached_share(),
        "cached_engine_share": r.cached_engine_share(), "warm_not_cached": r.warm_not_cached,
        "offload_blocks": e.offload_blocks, "offload_weight": e.offload_weight,
        "engine_groups": e.groups.iter().map(|g| match g {
            superfluid_warm::GroupKind::SlidingWindow { window } => format!("sliding:{window}"),
            _ => "full".to_string(),
        }).collect::<Vec<_>>(),
        "claimed_gpu_share": r.claimed_gpu_share(), "cached_gpu_share": r.cached_gpu_share(),
        "claimed_offload_share": r.claimed_offload_share(), "cached_offload_share": r.cached_offload_share(),
        "load_max_over_min": r.imbalance(), "restarts": r.restarts,
        "warm_to_restarted_seen": r.warm_to_restarted_seen, "warm_to_restarted_unseen": r.warm_to_restarted_unseen,
        "lag_p50_s": r.listen.iter().filter_map(|l| l.lag_p50).fold(0.0, f64::max),
        "lag_p99_s": r.listen.iter().filter_map(|l| l.lag_p99).fold(0.0, f64::max),
        "replays": r.listen.iter().map(|l| l.replays).sum::<u64>(),
        "index_p50_us": r.index.p50.as_secs_f64() * 1e6, "index_p99_us": r.index.p99.as_secs_f64() * 1e6,
        "block_events": r.block_events, "ingest_s": r.ingest.as_secs_f64(), "ingest_events_per_s": r.ingest_rate(),
    })
    .to_string()
}

/// `replay --heads H --nats URL --engine-events`: sharing heads against heads alone, each side
/// over engines of its own.
pub(crate) fn engine_heads_report(r: &EngineHeadsReport, source: &str, json: bool) -> String {
    let mib = |bytes: u64| bytes as f64 / f64::from(1 << 20);
    let side = |s: &engine_heads::Side| {
        json!({
            "peak_rss_mib": s.peak_rss.map(mib), "engines_mib": mib(s.engines_bytes),
            "per_head_mib": r.per_head_bytes(s).map(mib),
            "claimed_share": r.share(s.claimed_tokens), "cached_share": r.share(s.cached_tokens),
            "settled_requests": s.settled_requests, "settled_claimed_share": r.share(s.settled_claimed_tokens),
            "settled_cached_share": r.share(s.settled_cached_tokens),
            "load_max_over_min": s.imbalance(), "engine_lag_p50_s": s.engine_lag.0, "engine_lag_p99_s": s.engine_lag.1,
            "stream_lag_p50_ms": s.stream_lag_ms.0, "stream_lag_p99_ms": s.stream_lag_ms.1,
            "batches_published": s.published, "batches_applied_per_head": s.applied,
        })
    };
    if json {
        let worst = |f: &dyn Fn(&engine_heads::Side) -> Option<u64>| f(&r.shared).max(f(&r.alone)).map(mib);
        return json!({
            "source": source, "heads": r.heads, "requests": r.requests,
            "base_rss_mib": r.base_rss.map(mib), "peak_rss_mib": worst(&|s| s.peak_rss),
            "per_head_mib": worst(&|s| r.per_head_bytes(s)), "head_cache_mib": mib(engine_heads::HEAD_CACHE_BYTES as u64),
            "shared": side(&r.shared), "unshared": side(&r.alone),
        })
        .to_string();
    }
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let ms = |x: Option<f64>| x.map_or_else(|| "-".to_string(), |v| format!("{v:.1} ms"));
    let mut text = format!(
        "{} requests of {source} over {} heads, round-robin; every head subscribed to every engine\n",
        thousands(r.requests as u64),
        r.heads
    );
    for (what, s) in [("sharing one view", &r.shared), ("each alone", &r.alone)] {
        text += &format!(
            "{what:<18} claimed warm {}, cached {} ({:+.3} points), max/min load {:.3}; engine lag {} p50, {} p99{}; {} batches, {} applied by each head\n",
            pct(r.share(s.claimed_tokens)),
            pct(r.share(s.cached_tokens)),
            100.0 * (r.share(s.claimed_tokens) - r.share(s.cached_tokens)),
            s.imbalance(),
            ms(s.engine_lag.0.map(|v| v * 1000.0)),
            ms(s.engine_lag.1.map(|v| v * 1000.0)),
            match s.stream_lag_ms {
                (Some(p50), Some(p99)) => format!("; stream lag {p50:.1} ms p50, {p99:.1} ms p99"),
                _ => String::new(),
            },
            thousands(s.published),
            thousands(s.applied)
        );
    }
    for (what, s) in [("sharing one view", &r.shared), ("each alone", &r.alone)] {
        let Some(peak) = s.peak_rss else { continue };
        text += &format!(
            "{what:<18} peak resident {:.0} MiB: {:.0} MiB before the heads opened, {:.0} MiB the simulated engines', {} per head ({} MiB page cache each)\n",
            mib(peak),
            r.base_rss.map_or(0.0, mib),
            mib(s.engines_bytes),
            r.per_head_bytes(s).map_or_else(|| "-".to_string(), |b| format!("{:.0} MiB", mib(b))),
            engine_heads::HEAD_CACHE_BYTES >> 20
        );
    }
    text
}

pub(crate) fn heads_json(r: &HeadsReport, c: &Config, source: &str) -> String {
    json!({
        "source": source,
        "requests": r.requests,
        "heads": r.heads,
        "nodes": c.nodes,
        "policy": policy_name(c.policy),
        "warm_share": r.warm_share(),
        "warm_share_unshared": r.warm_share_unshared(),
        "imbalance": r.imbalance,
        "imbalance_unshared": r.imbalance_unshared,
        "lag_p50_ms": r.lag_ms(0.5),
        "lag_p99_ms": r.lag_ms(0.99),
        "lag_samples": r.lags_ns.len(),
        "waited": r.waited,
        "waited_ms": r.waited_for.as_secs_f64() * 1e3,
        "events": r.events,
        "wall_s": r.wall.as_secs_f64(),
    })
    .to_string()
}

pub(crate) fn heads_text(r: &HeadsReport, c: &Config, source: &str) -> String {
    let ms = |q| r.lag_ms(q).map_or_else(|| "-".to_string(), |v| format!("{v:.2}"));
    format!(
        "replay: {source}, {} requests round-robin over {} heads, {} nodes, policy {}\n\
         warm share          {:.2}% with the heads sharing one view (NATS JetStream), {:.2}% with {} heads that do not share\n\
         load max/min        {:.3} sharing, {:.3} not\n\
         lag                 publish to applied on the other heads: p50 {} ms, p99 {} ms ({} events)\n\
         turns that waited   {} for their previous turn to reach their head ({:.1} ms in all; the trace's turns are seconds apart)\n\
         stream              {} events, applied by every head in {:.2} s{}",
        r.requests,
        r.heads,
        c.nodes,
        policy_name(c.policy),
        100.0 * r.warm_share(),
        100.0 * r.warm_share_unshared(),
        r.heads,
        r.imbalance,
        r.imbalance_unshared,
        ms(0.5),
        ms(0.99),
        r.lags_ns.len(),
        r.waited,
        r.waited_for.as_secs_f64() * 1e3,
        r.events,
        r.wall.as_secs_f64(),
        r.errors.iter().map(|e| format!("\nretried             {e}")).collect::<String>(),
    )
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn policy_name(p: Policy) -> String {
    clap::ValueEnum::to_possible_value(&p).map_or_else(|| format!("{p:?}"), |v| v.get_name().to_string())
}

pub(crate) fn replay_json(
    r: &Report,
    c: &Config,
    source: &str,
    threaded: Option<&Threaded>,
    back: Option<&BackToBack>,
) -> String {
    let timing =
        |t: &Timing| json!({"p50_us": micros(t.p50), "p99_us": micros(t.p99), "total_ms": t.total.as_secs_f64() * 1e3});
    let mut value = json!({
        "source": source, "policy": policy_name(c.policy), "nodes": c.nodes, "requests": r.requests,
        "prompt_tokens": r.prompt_tokens, "warm_tokens": r.warm_tokens, "warm_share": r.warm_share(),
        "answered_warm_tokens": r.answered_warm_tokens,
        "warm_requests": r.warm_requests, "load": r.load, "imbalance": r.imbalance(),
        "index": timing(&r.index), "baseline_0_1_7": r.baseline.as_ref().map(timing),
        "final_sync_ms": r.final_sync.as_secs_f64() * 1e3, "entries": r.entries, "wall_ms": r.wall.as_secs_f64() * 1e3,
        "paced_ratio": r.paced().map(|(_, ratio)| ratio),
        "warm_share_cached": r.warm_share_cached(), "warm_requests_not_cached": r.warm_not_cached,
        "warm_tokens_cached": r.warm_tokens_cached, "chosen_node_cached_share": r.chosen_cached_share(),
        "node_cache_blocks": c.node_cache_blocks, "index_told_cache": c.index_told_cache,
        "restart_every": c.restart_every, "forget": c.forget, "restarts": r.restarts,
        "warm_tokens_to_restarted": r.warm_tokens_to_restarted,
        "bytes_per_request": r.bytes_written.map(|b| b as f64 / r.requests.max(1) as f64),
        "baseline_bytes_per_request": r.baseline_bytes_written.map(|b| b as f64 / r.requests.max(1) as f64),
    });
    if let (Some(t), Some(map)) = (threaded, value.as_object_mut()) {
        map.insert("threads".into(), json!(t.threads));
        map.insert("requests_per_s".into(), json!(t.requests_per_s));
        map.insert("baseline_requests_per_s".into(), json!(t.baseline_requests_per_s));
    }
    if let (Some(b), Some(map)) = (back, value.as_object_mut()) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let per_request = |bytes: u64| bytes as f64 / b.requests.max(1) as f64;
        map.insert(
            "back_to_back".into(),
            json!({
                "calls_ms": ms(b.calls), "final_sync_ms": ms(b.final_sync), "ours_ms": ms(b.ours()),
                "baseline_ms": b.baseline.map(ms), "ratio": b.ratio(), "warm_tokens": b.warm_tokens,
                "entries": b.entries, "requests_per_s": b.requests_per_s(),
                "baseline_requests_per_s": b.baseline_requests_per_s(),
                "bytes_per_request": b.bytes_written.map(per_request),
                "baseline_bytes_per_request": b.baseline_bytes_written.map(per_request),
            }),
        );
    }
    value.to_string()
}

/// The index's bytes written per request, and 0.1.7's beside them where it was measured.
fn bytes_per_request(ours: Option<u64>, theirs: Option<u64>, requests: usize) -> Option<String> {
    let per_request = |bytes: u64| bytes as f64 / requests.max(1) as f64 / 1024.0;
    let mut line = format!("{:.1} KiB/request", per_request(ours?));
    if let Some(theirs) = theirs {
        line += &format!(
            " (0.1.7 saving every {} ms of its time: {:.1} KiB/request; ours {:.2}x)",
            DEFAULT_SYNC_WINDOW.as_millis(),
            per_request(theirs),
            ours? as f64 / theirs.max(1) as f64
        );
    }
    Some(line)
}

pub(crate) fn replay_text(
    r: &Report,
    c: &Config,
    source: &str,
    kept: Option<&Path>,
    threaded: Option<&Threaded>,
    back: Option<&BackToBack>,
) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64().max(1e-12);
    let pct = |share: f64| format!("{:.1}%", 100.0 * share);
    // The one-line summary first: what routing found, and how fast against 0.1.7.
    let mut summary = format!(
        "{} of prompt tokens routed to a node that already held them warm; busiest node {:.2}x the least busy",
        pct(r.warm_share()),
        r.imbalance()
    );
    if let Some((_, paced)) = back.and_then(|b| b.ratio().map(|x| (b, x))) {
        summary += &format!("; {paced:.2}x 0.1.7's time back to back, everything durable");
    }
    let mut t = format!("{summary}.\n\n");
    t += &format!(
        "Replayed {} requests of {source} over {} nodes (policy {}, load window {} requests){}.\n",
        thousands(r.requests as u64),
        c.nodes,
        policy_name(c.policy),
        c.window,
        c.vocab.map(|v| format!(", tokens mapped into a vocabulary of {v}")).unwrap_or_default()
    );
    t += "\nWhat the index found\n";
    t += &format!(
        "  routed warm      {} of {} prompt tokens ({}), {} of {} requests\n",
        thousands(r.warm_tokens),
        thousands(r.prompt_tokens),
        pct(r.warm_share()),
        thousands(r.warm_requests as u64),
        thousands(r.requests as u64)
    );
    t += &format!(
        "  answered warm    {} prompt tokens: the longest warm prefix of each request, whichever node it chose\n",
        thousands(r.answered_warm_tokens)
    );
    if let (Some(cached), Some(any), Some(missed), Some(blocks)) =
        (r.warm_share_cached(), r.chosen_cached_share(), r.warm_not_cached, c.node_cache_blocks)
    {
        t += &format!(
            "  really cached    {} of prompt tokens were routed warm and still in the chosen node's cache (an LRU of {} blocks a node, {told}); {} counting what it held unannounced; {} requests sent as warm to a node that no longer held the prefix\n",
            pct(cached),
            thousands(blocks as u64),
            pct(any),
            thousands(missed as u64),
            told = if c.index_told_cache { "the index told its size" } else { "the index not told" },
        );
    }
    if let (Some(restarts), Some(wrong), Some(every)) = (r.restarts, r.warm_tokens_to_restarted, c.restart_every) {
        let told = if c.forget { "each forgotten in the index" } else { "the index not told" };
        t += &format!(
            "  restarts         {restarts} (a node every {every} requests, {told}); {} prompt tokens routed as warm to a node that had restarted since it ran them\n",
            thousands(wrong)
        );
    }
    t += &format!("  load per node    prompt tokens; most / least loaded {:.2}\n", r.imbalance());
    let max = r.load.iter().copied().max().unwrap_or(1).max(1);
    for (i, l) in r.load.iter().enumerate() {
        let bar = "#".repeat((40 * l / max) as usize);
        t += &format!("    {:<8} {:>14}  {bar}\n", replay::node_name(i), thousands(*l));
    }
    t += &format!("  entries          {} at the end\n", thousands(r.entries));
    t += "\nHow fast (0.1.7 = superfluid 0.1.7's design: a HashMap in memory, saved whole as JSON, nothing durable between saves)\n";
    t += &format!(
        "  index time/request  p50 {:.1} µs, p99 {:.1} µs (hash, warmest, ran; durable within {} ms)\n",
        micros(r.index.p50),
        micros(r.index.p99),
        DEFAULT_SYNC_WINDOW.as_millis()
    );
    if let Some(b) = &r.baseline {
        t += &format!(
            "  0.1.7 time/request  p50 {:.1} µs, p99 {:.1} µs: ratio (ours/0.1.7) p50 {:.2}x, p99 {:.2}x\n",
            micros(b.p50),
            micros(b.p99),
            ratio(r.index.p50, b.p50),
            ratio(r.index.p99, b.p99)
        );
    }
    if let (Some((ours, paced)), Some(b)) = (r.paced(), &r.baseline) {
        t += &format!(
            "  paced               {:.1} ms (the index's calls, each between 0.1.7's, plus the final sync) against 0.1.7's {:.1} ms: {paced:.2}x\n",
            ms(ours),
            ms(b.total)
        );
    }
    if let Some(b) = back {
        t += &format!(
            "  back to back        {:.1} ms, {} requests/s (a fresh index fed one request after another, then synced)",
            ms(b.ours()),
            thousands(b.requests_per_s() as u64)
        );
        if let (Some(theirs), Some(x)) = (b.baseline, b.ratio()) {
            t += &format!(
                " against 0.1.7 alone {:.1} ms, {} requests/s: {x:.2}x",
                ms(theirs),
                thousands(b.baseline_requests_per_s().unwrap_or(0.0) as u64)
            );
        }
        t += "\n";
    }
    if let Some(th) = threaded {
        t += &format!(
            "  {} head threads      {} requests/s (final sync included)",
            th.threads,
            thousands(th.requests_per_s as u64)
        );
        if let Some(b) = th.baseline_requests_per_s {
            t += &format!(
                " against 0.1.7 behind one mutex {} requests/s: {:.2}x",
                thousands(b as u64),
                th.requests_per_s / b.max(1e-9)
            );
        }
        t += "\n";
    }
    let written = back
        .and_then(|b| bytes_per_request(b.bytes_written, b.baseline_bytes_written, b.requests))
        .or_else(|| bytes_per_request(r.bytes_written, r.baseline_bytes_written, r.requests));
    if let Some(bytes) = written {
        t += &format!("  bytes written       {bytes}\n");
    }
    t += &format!("\nWall time {:.2} s. Every figure: --json.", r.wall.as_secs_f64());
    if let Some(path) = kept {
        t += &format!(" Index kept in {}.", path.display());
    }
    t
}
