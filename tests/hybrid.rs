//! Hybrid-attention engines (several KV cache groups: sliding window, Mamba, chunked local
//! beside full attention) against vLLM's own answers: the events its `KVCacheManager` published
//! and the tokens it reused of each probe prompt (`tests/fixtures/hybrid`, written by
//! `make_fixtures.py` there from vLLM 0.33.0's code), through the library as a head uses it:
//! decoded from the wire, applied, and asked.

mod common;

use std::path::{Path, PathBuf};

use serde_json::Value;
use superfluid_warm::{BLOCK_TOKENS, MIN_BLOCKS, Namespace, ReadIndex, Reader, Warm, decode_engine_batch};

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
    /// Times the head was closed and opened again.
    reopens: usize,
    /// Probes warm on the engine once every batch is applied (as a head and a reader answer).
    warm_at_end: usize,
    /// Probes (with an offloading connector) whose answer's GPU part was not vLLM's GPU hit, in
    /// whole blocks of ours; and those answered with a part loaded from CPU memory.
    gpu_differs: Vec<String>,
    from_cpu: usize,
    /// The engine's blocks by tier at the end (GPU, CPU only, storage only).
    by_tier: [usize; 3],
}

/// Replays one case into a new index as engine `e0`'s stream and asks every probe; with
/// `reopen_every`, the head is closed and opened again after every so many batches; with
/// `chunk`, the model's attention chunk is given (and with `import`, 0.1.7's fixture file is
/// imported at the first open, which reads the decided state again).
fn replay(case: &Path, reopen_every: Option<usize>, chunk: Option<usize>, import: bool) -> Tally {
    let dir = common::tempdir();
    let path = dir.path().join("warm.redb");
    let open = |import: bool| {
        let mut builder = Warm::builder();
        if let Some(tokens) = chunk {
            builder.attention_chunk(tokens);
        }
        if import {
            builder
                .import_json(Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0001-from-0.1.7-json/warm.json"));
        }
        builder.open(&path).expect("an index")
    };
    let mut warm = open(import);
    let ns = Namespace::new("m").expect("a namespace");
    let mut tally = Tally::default();
    let text = std::fs::read_to_string(case).expect("a fixture");
    let (mut batches, mut probes) = (0, Vec::new());
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).expect("a JSON line");
        if let Some(batch) = v.get("batch") {
            let payload = hex(batch["payload"].as_str().expect("payload"));
            let batch = decode_engine_batch(batch["seq"].as_u64().expect("seq"), &payload, "m").expect("decodes");
            warm.engine_batch("e0", &batch).expect("applied");
            batches += 1;
            if reopen_every.is_some_and(|n| batches % n == 0) {
                warm.close().expect("closes");
                warm = open(false);
                tally.reopens += 1;
            }
        } else if let Some(probe) = v.get("probe") {
            let tokens: Vec<u32> = probe["tokens"]
                .as_array()
                .expect("tokens")
                .iter()
                .map(|t| t.as_u64().expect("a token") as u32)
                .collect();
            probes.push(tokens.clone());
            let reused = probe["cached_tokens"].as_u64().expect("cached_tokens") as usize;
            // What vLLM reused, in our whole blocks, and nothing under the least a head routes on.
            let want = Some(reused / BLOCK_TOKENS * BLOCK_TOKENS).filter(|&t| t >= MIN_BLOCKS * BLOCK_TOKENS);
            let hits = warm.warm_nodes_prefix(&warm.prefix(&ns, &tokens)).expect("an answer");
            let got = hits.iter().find(|h| h.node == "e0").map(|h| h.tokens);
            tally.probes += 1;
            let what = || format!("{} ({} tokens): vLLM {reused}, answered {got:?}", probe["label"], tokens.len());
            if let (Some(gpu), Some(hit)) =
                (probe.get("gpu_cached_tokens").and_then(Value::as_u64), hits.iter().find(|h| h.node == "e0"))
            {
                let want_gpu = (gpu as usize / BLOCK_TOKENS * BLOCK_TOKENS).min(hit.tokens);
                if hit.gpu_tokens != want_gpu {
                    tally.gpu_differs.push(format!("{}: GPU {gpu}, answered {}", probe["label"], hit.gpu_tokens));
                }
                tally.from_cpu += usize::from(hit.gpu_tokens < hit.tokens);
            }
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
    tally.by_tier = e0.by_tier;
    // A process that only asks (`ask`) reads the same holdings from the file.
    let last: Vec<_> =
        probes.iter().map(|t| warm.warm_nodes_prefix(&warm.prefix(&ns, t)).expect("an answer")).collect();
    warm.close().expect("closes");
    let reader = Reader::open(&path).expect("a reader");
    if let Some(tokens) = chunk {
        reader.set_attention_chunk(tokens);
    }
    for (tokens, want) in probes.iter().zip(&last) {
        assert_eq!(&reader.warm_nodes_prefix(&reader.prefix(&ns, tokens)).expect("an answer"), want);
    }
    tally.warm_at_end = last.iter().filter(|h| !h.is_empty()).count();
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
        let tally = replay(&case(name), None, None, false);
        assert!(tally.probes >= 90, "{name}: {} probes", tally.probes);
        assert!(tally.above.is_empty() && tally.below.is_empty(), "{name}: {tally:#?}");
        assert!(tally.groups >= 2 && tally.unplaced == 0 && tally.unknown_removals == 0, "{name}: {tally:#?}");
    }
}

/// Mamba states in blocks of 64 over hash blocks of 16 (the Mamba group's stores are of a size
/// the index does not place, and counted so): every probe is still answered exactly.
#[test]
fn mamba_blocks_of_another_size_are_answered_exactly() {
    let tally = replay(&case("mamba64"), None, None, false);
    assert!(tally.probes >= 90 && tally.unplaced > 0, "{tally:#?}");
    assert!(tally.above.is_empty() && tally.below.is_empty(), "{tally:#?}");
}

/// Chunked local attention (3 groups of chunks of 256 tokens beside full attention): given the
/// model's chunk, every probe is answered exactly what vLLM reused, across restarts of the head
/// too, and after an import (the setting outlives the decided state read again); without it
/// (the events do not carry it), never above.
#[test]
fn chunked_local_attention_is_answered_exactly_given_the_models_chunk() {
    for (reopen, import) in [(None, false), (Some(3), false), (None, true)] {
        let tally = replay(&case("chunked"), reopen, Some(256), import);
        assert!(tally.probes >= 90 && tally.groups == 4, "{tally:#?}");
        assert!(tally.above.is_empty() && tally.below.is_empty(), "{tally:#?}");
    }
    let tally = replay(&case("chunked"), None, None, false);
    assert!(tally.above.is_empty() && tally.exact > 0 && !tally.below.is_empty(), "{tally:#?}");
}

/// What a hybrid engine holds is in the file: a head closed and opened again between batches
/// (every 5th, and every 2nd) answers every probe exactly as vLLM reused, as one that never
/// closed; its groups are read back with it, and a reader (`ask`) answers as the head.
#[test]
fn hybrid_holdings_survive_a_restart_of_the_head() {
    let mut warm_at_end = 0;
    for (name, every) in [("gptoss", 5), ("gemma3", 2), ("mamba", 5), ("three_types", 2)] {
        let tally = replay(&case(name), Some(every), None, false);
        assert!(tally.probes >= 90 && tally.reopens >= 10, "{name}: {tally:#?}");
        warm_at_end += tally.warm_at_end;
        assert!(tally.above.is_empty() && tally.below.is_empty(), "{name}: {tally:#?}");
        assert!(tally.groups >= 2 && tally.unknown_removals == 0, "{name}: {tally:#?}");
    }
    assert!(warm_at_end >= 100, "a reader compared on warm answers ({warm_at_end})");
}

/// Hybrid engines that offload to CPU memory (vLLM 0.33's `OffloadingConnector`; events and
/// answers from its own scheduler-side code, `fixtures/hybrid/offload`): gpt-oss's layout with
/// the connector's default events (a chunk's last hash only) and with self-describing events in
/// chunks of two blocks, Mamba beside full attention, and all three kinds. Every probe is
/// answered what vLLM reused (its GPU hit and what the connector loads past it), the GPU part
/// as vLLM's GPU hit, across restarts of the head too.
#[test]
fn offloading_hybrid_engines_are_answered_what_vllm_reuses_and_loads() {
    for (name, reopen) in [
        ("gptoss_off", None),
        ("gptoss_off_bpc2", None),
        ("mamba_off", None),
        ("three_types_off", None),
        ("gptoss_off", Some(7)),
        ("three_types_off", Some(5)),
    ] {
        let tally = replay(&Path::new(DIR).join("offload").join(format!("{name}.jsonl")), reopen, None, false);
        assert!(tally.probes >= 150, "{name}: {} probes", tally.probes);
        assert!(tally.above.is_empty() && tally.below.is_empty(), "{name}: {tally:#?}");
        assert!(tally.gpu_differs.is_empty(), "{name}: {tally:#?}");
        assert!(tally.from_cpu >= 20 && tally.by_tier[1] > 0, "{name}: {tally:#?}");
        assert!(tally.unknown_removals == 0, "{name}: {tally:#?}");
    }
}
