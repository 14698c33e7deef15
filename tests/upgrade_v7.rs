//! Schema 6 → 7 (`migrations/0007-tiers`): a file written by the schema 6 build (engine streams
//! of two engines, 16- and 32-token blocks, `ran`s on nodes without a stream, 0.1.7's entries)
//! is upgraded in place on open, gives every answer that build gave (`warmest` and the whole
//! `warm_nodes`), its engines keep their positions, and an offload then moves a block to CPU
//! memory; a crash at any write of the upgrade leaves a file that opens and answers the same.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::queries;
use common::upgrade::{assert_upgraded_and_healthy, check_answers, crash_every_write_of_the_upgrade};
use harness::engine_sim::engine_hash;
use harness::trace;
use superfluid_warm::{
    EngineBatch, EngineEvent, EngineOutcome, EngineStored, Error, Medium, ReadIndex, Snapshot, Warm,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0007-tiers");

fn fixture_copy(dir: &Path) -> PathBuf {
    common::upgrade::fixture_copy(DIR, "warm-v6.redb", dir)
}

#[test]
fn a_schema_6_file_is_upgraded_in_place_and_gives_every_answer_it_gave() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries(Path::new(DIR));
    assert_eq!(queries.len(), 640);
    assert_eq!(Snapshot::open(&path)?.stats()?.schema, 6, "readers do not upgrade");
    let engines_before = Snapshot::open(&path)?.stats()?.engines;
    assert_eq!(engines_before.len(), 2, "the fixture's two engine streams");
    {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.upgraded_from, Some(6));
        let engines = warm.engine_stats()?;
        for (after, before) in engines.iter().zip(&engines_before) {
            assert_eq!(
                (&after.node, after.last_seq, after.engine_blocks, after.blocks, &after.counts),
                (&before.node, before.last_seq, before.engine_blocks, before.blocks, &before.counts)
            );
            assert_eq!(after.by_tier, [after.engine_blocks, 0, 0], "every block of a schema 6 file is on the GPU");
        }
        let warm_answers = check_answers(&warm, &queries, "after the upgrade", |_| true)?;
        assert!(warm_answers > 300, "the fixture has warm answers to check ({warm_answers})");
        let by_engines = queries
            .iter()
            .filter(|q| q.warm_nodes.as_ref().is_some_and(|n| n.iter().any(|h| h.node.starts_with("gpu-"))))
            .count();
        assert!(by_engines > 50, "answers from the engines' events to check ({by_engines})");
        warm.close()?;
    }
    assert_upgraded_and_healthy(&path, 8)?;

    // Once upgraded it opens as it is, and takes offloads: gpu-0's engine copies the first
    // block of a prompt it holds to CPU memory and frees it on the GPU. The prompt is then warm
    // on gpu-0 as deep as before, all of it up to CPU memory.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen", |_| true)?;
    let requests = trace::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake-conversation.jsonl"))
        .expect("the trace");
    let ns = superfluid_warm::Namespace::new("fixture-model")?;
    // The newest of the fixture's prompts for gpu-0 (every fourth, not under the tenant, not
    // in the smaller vocabulary) that it holds.
    let (prompt, on_gpu_0) = (0..80)
        .rev()
        .filter(|i| i % 4 == 0 && i % 5 != 2)
        .find_map(|i| {
            let mut prompt = requests[i].tokens();
            prompt.truncate(64 * 20);
            let hits = warm.warm_nodes(ns.model(), &prompt).ok()?;
            let hit = hits.into_iter().find(|h| h.node == "gpu-0")?;
            Some((prompt, hit))
        })
        .expect("a prompt warm on gpu-0");
    assert_eq!((on_gpu_0.tier, on_gpu_0.gpu_tokens), (Medium::Gpu, on_gpu_0.tokens));
    let root = engine_hash(None, &prompt[..16]);
    let stream = warm.engine_stats()?.into_iter().find(|s| s.node == "gpu-0").expect("gpu-0's stream");
    let mut events = vec![EngineEvent::Stored(EngineStored {
        parent: None,
        hashes: vec![root],
        tokens: Vec::new(),
        block_size: 0,
        medium: Medium::Cpu,
        namespace: None,
        group: None,
    })];
    // Every GPU copy (the engine stores some blocks twice); a removal past them is counted.
    events.extend((0..3).map(|_| EngineEvent::Removed { hashes: vec![root], medium: Medium::Gpu, group: None }));
    let seq = stream.last_seq.map_or(0, |s| s + 1);
    let batch = EngineBatch { seq, ts: stream.last_ts + 1.0, events };
    assert_eq!(warm.engine_batch("gpu-0", &batch)?, EngineOutcome::Applied);
    let offloaded = |warm: &Warm| -> Result<(), Error> {
        let hits = warm.warm_nodes(ns.model(), &prompt)?;
        let hit = hits.iter().find(|h| h.node == "gpu-0").expect("still warm on gpu-0");
        assert_eq!((hit.tokens, hit.tier, hit.gpu_tokens), (on_gpu_0.tokens, Medium::Cpu, 0));
        Ok(())
    };
    offloaded(&warm)?;
    warm.close()?;
    let warm = Warm::open(&path)?;
    offloaded(&warm)?;
    let stream = warm.engine_stats()?.into_iter().find(|s| s.node == "gpu-0").expect("gpu-0's stream");
    assert_eq!(stream.by_tier[1], 1, "one block only in CPU memory");
    warm.close()?;
    // The CLI shows it: `dump --engines` the block's copies, `ask` the tier, `stats` the count.
    let cli = common::cli_json;
    let file = path.to_str().expect("a UTF-8 path");
    let blocks = cli(&["dump", file, "--engines", "--json", "--node", "gpu-0"]);
    let root_hex = format!("{root:016x}");
    let row =
        blocks.as_array().and_then(|b| b.iter().find(|b| b["engine_hash"] == root_hex.as_str())).expect("the block");
    assert_eq!((row["copies"]["GPU"].as_u64(), row["copies"]["CPU"].as_u64()), (Some(0), Some(1)), "{row}");
    let prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&prompts, serde_json::to_string(&prompt).expect("JSON") + "\n").expect("write prompts");
    let asked = cli(&["ask", file, "--model", ns.model(), "--prompts", prompts.to_str().expect("UTF-8"), "--json"]);
    let hit = asked[0]["warm_nodes"].as_array().and_then(|h| h.iter().find(|h| h["node"] == "gpu-0")).cloned();
    let hit = hit.expect("ask names gpu-0");
    assert_eq!((hit["tier"].as_str(), hit["gpu_tokens"].as_u64()), (Some("CPU"), Some(0)), "{hit}");
    let stats = cli(&["stats", file, "--json"]);
    let gpu_0 = stats[0]["engines"].as_array().and_then(|e| e.iter().find(|e| e["node"] == "gpu-0")).cloned();
    assert_eq!(gpu_0.expect("gpu-0")["engine_blocks_by_tier"]["CPU"].as_u64(), Some(1));
    let check = Snapshot::open(&path)?.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    Ok(())
}

/// A crash at every write the upgrade (and the close after it) makes, in every way the page
/// cache can leave it: the file opens (upgraded then, if it was not), every answer is what the
/// schema 6 build gave, and the invariants hold.
#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_a_file_that_answers_the_same() -> Result<(), Error> {
    let dir = common::tempdir();
    let queries = queries(Path::new(DIR));
    let answers = |warm: &Warm, what: &str| check_answers(warm, &queries, what, |_| true);
    crash_every_write_of_the_upgrade(&Path::new(DIR).join("warm-v6.redb"), 6, dir.path(), answers)?;
    Ok(())
}
