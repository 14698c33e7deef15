//! Hybrid-attention engines (several KV cache groups: sliding window, Mamba, chunked local
//! beside full attention) against vLLM's own answers: the events its `KVCacheManager` published
//! and the tokens it reused of each probe prompt (`tests/fixtures/hybrid`, written by
//! `make_fixtures.py` there from vLLM 0.33.0's code), through the library as a head uses it:
//! decoded from the wire, applied, and asked.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use superfluid_warm::{BLOCK_TOKENS, MIN_BLOCKS, Namespace, ReadIndex, Warm, decode_engine_batch};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/hybrid");

/// What a case's probes gave: probes, those answered as vLLM reused, above it, below it.
#[derive(Debug, Default, PartialEq, Eq)]
struct Tally {
    probes: usize,
    exact: usize,
    above: Vec<String>,
    below: Vec<String>,
    /// The engine's groups, its blocks not placed, and its removals of copies not held.
    groups: usize,
    unplaced: u64,
    unknown_removals: u64,
}

/// Replays one case into a new index as engine `e0`'s stream and asks every probe.
fn replay(case: &Path) -> Tally {
    let dir = common::tempdir();
    let warm = Warm::open(dir.path().join("warm.redb")).expect("an index");
    let ns = Namespace::new("m").expect("a namespace");
    let mut tally = Tally::default();
    let text = std::fs::read_to_string(case).expect("a fixture");
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).expect("a JSON line");
        if let Some(batch) = v.get("batch") {
            let payload = hex(batch["payload"].as_str().expect("payload"));
            let batch = decode_engine_batch(batch["seq"].as_u64().expect("seq"), &payload, "m").expect("decodes");
            warm.engine_batch("e0", &batch).expect("applied");
        } else if let Some(probe) = v.get("probe") {
            let tokens: Vec<u32> = probe["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| t.as_u64().expect("a token") as u32)
                .collect();
            let reused = probe["cached_tokens"].as_u64().expect("cached_tokens") as usize;
            // What vLLM reused, in our whole blocks, and nothing under the least a head routes on.
            let want = Some(reused / BLOCK_TOKENS * BLOCK_TOKENS).filter(|&t| t >= MIN_BLOCKS * BLOCK_TOKENS);
            let hits = warm.warm_nodes_prefix(&warm.prefix(&ns, &tokens)).expect("an answer");
            let got = hits.iter().find(|h| h.node == "e0").map(|h| h.tokens);
            tally.probes += 1;
            let what = || format!("{} ({} tokens): vLLM {reused}, answered {got:?}", probe["label"], tokens.len());
            match got.cmp(&want) {
                std::cmp::Ordering::Equal => tally.exact += 1,
                std::cmp::Ordering::Greater => tally.above.push(what()),
                std::cmp::Ordering::Less => tally.below.push(what()),
            }
        }
    }
    let stats = warm.engine_stats().expect("stats");
    let e0 = stats.first().expect("e0's stream");
    (tally.unplaced, tally.unknown_removals) = (e0.unplaced_blocks, e0.counts.unknown_removals);
    tally.groups = e0.groups.len();
    warm.close().expect("closes");
    tally
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn case(name: &str) -> PathBuf {
    Path::new(DIR).join(format!("{name}.jsonl"))
}

/// Full attention beside sliding windows (gpt-oss: 128, 1:1; Gemma 3: 512, 5:1; blocks of 16
/// and 32), beside Mamba states, and beside both: every probe answered exactly what vLLM reused,
/// in whole blocks of ours.
#[test]
fn hybrid_engines_are_answered_what_vllm_reuses() {
    for name in ["gptoss", "gptoss_bs32", "gemma3", "mamba", "three_types"] {
        let tally = replay(&case(name));
        assert!(tally.probes >= 90, "{name}: {} probes", tally.probes);
        assert!(tally.above.is_empty() && tally.below.is_empty(), "{name}: {tally:#?}");
        assert!(tally.groups >= 2 && tally.unplaced == 0 && tally.unknown_removals == 0, "{name}: {tally:#?}");
    }
}

/// What the index does not model is never claimed above what vLLM reuses: chunked local
/// attention (its chunk is not in the events), hits finer than a block (Mamba blocks of 64
/// over hash blocks of 16).
#[test]
fn layouts_not_modelled_are_never_claimed_above_what_vllm_reuses() {
    for name in ["chunked", "mamba64"] {
        let tally = replay(&case(name));
        assert!(tally.probes >= 90, "{name}: {} probes", tally.probes);
        assert!(tally.above.is_empty(), "{name}: {tally:#?}");
        eprintln!("{name}: {} probes, {} exact, {} below", tally.probes, tally.exact, tally.below.len());
    }
}
