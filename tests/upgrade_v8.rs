//! Schema 7 → 8 (`migrations/0008-hybrid-engines`): a file written by the schema 7 build (two
//! engines of one group, a hybrid engine of a sliding window and full attention, `ran`s on
//! nodes without a stream, 0.1.7's entries) is upgraded in place on open and gives every answer
//! that build gave (`warmest` and the whole `warm_nodes`); its engines keep their positions and
//! counts. A hybrid engine's holdings then outlive a restart of the head, as `ask`, `stats` and
//! `dump --engines` show; a crash at any write of the upgrade leaves a file that opens and
//! answers the same.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::queries;
use common::upgrade::{assert_upgraded_and_healthy, check_answers, crash_every_write_of_the_upgrade};
use harness::engine_sim::SimEngine;
use harness::trace;
use superfluid_warm::{
    BLOCK_TOKENS, CacheGroup, EngineOutcome, Error, GroupKind, Hit, MIN_BLOCKS, Namespace, ReadIndex, Snapshot, Warm,
};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0008-hybrid-engines");

fn fixture_copy(dir: &Path) -> PathBuf {
    common::upgrade::fixture_copy(DIR, "warm-v7.redb", dir)
}

/// The hybrid engine's warm answer for `tokens`, if any.
fn on_gpu_2(warm: &Warm, ns: &Namespace, tokens: &[u32]) -> Result<Option<Hit>, Error> {
    Ok(warm.warm_nodes_prefix(&warm.prefix(ns, tokens))?.into_iter().find(|h| h.node == "gpu-2"))
}

#[test]
fn a_schema_7_file_is_upgraded_in_place_and_a_hybrid_engine_then_outlives_a_restart() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries(Path::new(DIR));
    assert_eq!(queries.len(), 640);
    assert_eq!(Snapshot::open(&path)?.stats()?.schema, 7, "readers do not upgrade");
    let engines_before = Snapshot::open(&path)?.stats()?.engines;
    assert_eq!(engines_before.len(), 3, "the fixture's three engine streams");
    {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.upgraded_from, Some(7));
        let engines = warm.engine_stats()?;
        for (after, before) in engines.iter().zip(&engines_before) {
            assert_eq!(
                (&after.node, after.last_seq, after.engine_blocks, after.blocks, &after.counts, &after.groups),
                (&before.node, before.last_seq, before.engine_blocks, before.blocks, &before.counts, &before.groups)
            );
        }
        let gpu_2 = engines.iter().find(|e| e.node == "gpu-2").expect("the hybrid engine's stream");
        assert!(gpu_2.counts.stored > 500, "the schema 7 build followed its events ({:?})", gpu_2.counts);
        assert_eq!(gpu_2.engine_blocks, 0, "schema 7 kept its holdings in memory only");
        let warm_answers = check_answers(&warm, &queries, "after the upgrade", |_| true)?;
        assert!(warm_answers > 300, "the fixture has warm answers to check ({warm_answers})");
        warm.close()?;
    }
    assert_upgraded_and_healthy(&path, 8)?;

    // Once upgraded it opens as it is. gpu-2's engine restarts (its numbers start again) and
    // serves some of the trace's prompts: what it holds is answered as its own simulation says
    // it would reuse, and the same after the head restarts.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen", |_| true)?;
    let requests = trace::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake-conversation.jsonl"))
        .expect("the trace");
    let ns = Namespace::new("fixture-model")?;
    let groups = [GroupKind::SlidingWindow { window: 128 }, GroupKind::Full];
    let mut engine = SimEngine::new(16, 4000, ns.model(), None)?.with_groups(&groups);
    let prompts: Vec<Vec<u32>> = (100..130)
        .map(|i| {
            let mut p = requests[i].tokens();
            p.truncate(64 * 24);
            p
        })
        .collect();
    for p in &prompts {
        assert_eq!(warm.engine_batch("gpu-2", &engine.run(p))?, EngineOutcome::Applied);
    }
    let mut answers = Vec::new();
    for p in &prompts {
        let hit = on_gpu_2(&warm, &ns, p)?;
        // What the engine reuses, in whole blocks of ours, never less than a head routes on.
        let held = engine.holds(p) / BLOCK_TOKENS * BLOCK_TOKENS;
        let want = (held >= MIN_BLOCKS * BLOCK_TOKENS).then_some(held);
        assert_eq!(hit.as_ref().map(|h| h.tokens), want, "a prompt of {} tokens", p.len());
        answers.push(hit);
    }
    let warm_on_gpu_2 = answers.iter().flatten().count();
    assert!(warm_on_gpu_2 >= 10, "prompts warm on the hybrid engine ({warm_on_gpu_2})");
    let stats = warm.engine_stats()?.into_iter().find(|e| e.node == "gpu-2").expect("gpu-2");
    assert_eq!(stats.counts.restarts, 1);
    let held_blocks = stats.engine_blocks;
    eprintln!("{warm_on_gpu_2} of {} prompts warm on gpu-2, {held_blocks} engine blocks", prompts.len());
    warm.close()?;

    let warm = Warm::open(&path)?;
    for (p, want) in prompts.iter().zip(&answers) {
        assert_eq!(&on_gpu_2(&warm, &ns, p)?, want, "after the head restarted");
    }
    let stats = warm.engine_stats()?.into_iter().find(|e| e.node == "gpu-2").expect("gpu-2");
    let kinds: Vec<CacheGroup> =
        groups.iter().enumerate().map(|(i, &kind)| CacheGroup { index: i as u32, kind }).collect();
    assert_eq!((stats.engine_blocks, &stats.groups), (held_blocks, &kinds));
    warm.close()?;

    // The CLI shows it: `ask` the hybrid engine's answer, `stats` its groups, `dump --engines`
    // its blocks' copies by group.
    let cli = common::cli_json;
    let file = path.to_str().expect("a UTF-8 path");
    let (i, want) = answers.iter().enumerate().find_map(|(i, a)| a.clone().map(|a| (i, a))).expect("a warm prompt");
    let asked_prompts = dir.path().join("prompts.jsonl");
    std::fs::write(&asked_prompts, serde_json::to_string(&prompts[i]).expect("JSON") + "\n").expect("write prompts");
    let asked =
        cli(&["ask", file, "--model", ns.model(), "--prompts", asked_prompts.to_str().expect("UTF-8"), "--json"]);
    let hit = asked[0]["warm_nodes"].as_array().and_then(|h| h.iter().find(|h| h["node"] == "gpu-2")).cloned();
    assert_eq!(hit.expect("ask names gpu-2")["tokens"].as_u64(), Some(want.tokens as u64));
    let stats = cli(&["stats", file, "--json"]);
    let gpu_2 = stats[0]["engines"].as_array().and_then(|e| e.iter().find(|e| e["node"] == "gpu-2")).cloned();
    let gpu_2 = gpu_2.expect("gpu-2");
    assert_eq!(gpu_2["groups"].as_array().map(Vec::len), Some(2), "{gpu_2}");
    let blocks = cli(&["dump", file, "--engines", "--json", "--node", "gpu-2"]);
    let blocks = blocks.as_array().expect("rows");
    assert_eq!(blocks.len() as u64, held_blocks as u64);
    assert!(blocks.iter().all(|b| b["groups"].as_array().is_some_and(|g| !g.is_empty())), "copies by group");
    assert!(blocks.iter().any(|b| b["groups"].as_array().is_some_and(|g| g.len() == 2)), "blocks held by both groups");
    // And the metrics: the hybrid engine's groups as a gauge.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_superfluid-warm"))
        .args(["stats", file, "--prometheus"])
        .output()
        .expect("run");
    let text = String::from_utf8(out.stdout).expect("UTF-8");
    let gauge = |node: &str| {
        text.lines()
            .find(|l| l.starts_with("superfluid_warm_engine_kv_cache_groups{") && l.contains(&format!("\"{node}\"")))
            .and_then(|l| l.rsplit(' ').next())
            .map(str::to_string)
    };
    assert_eq!((gauge("gpu-2").as_deref(), gauge("gpu-0").as_deref()), (Some("2"), Some("0")), "{text}");
    let check = Snapshot::open(&path)?.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    Ok(())
}

/// A crash at every write the upgrade (and the close after it) makes, in every way the page
/// cache can leave it: the file opens (upgraded then, if it was not), every answer is what the
/// schema 7 build gave, and the invariants hold.
#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_a_file_that_answers_the_same() -> Result<(), Error> {
    let dir = common::tempdir();
    let queries = queries(Path::new(DIR));
    let answers = |warm: &Warm, what: &str| check_answers(warm, &queries, what, |_| true);
    let (images, still_7) =
        crash_every_write_of_the_upgrade(&Path::new(DIR).join("warm-v7.redb"), 7, dir.path(), answers)?;
    assert!(images > 10 && still_7 > 0, "{images} images, {still_7} of schema 7");
    Ok(())
}
