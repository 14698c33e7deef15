//! Schema 3 → 4 (`migrations/0004-node-sets-and-forget`): a file written by the schema 3 build is
//! upgraded in place on open, gives every answer that build gave, and a crash at any write of
//! the upgrade leaves a file that opens and answers the same.

mod common;

use std::path::{Path, PathBuf};

use common::backend::{Disk, crash_images};
use serde::Deserialize;
use superfluid_warm::{Error, Hit, Namespace, Snapshot, Warm};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0004-node-sets-and-forget");

#[derive(Deserialize)]
struct Answer {
    node: String,
    tokens: usize,
}

#[derive(Deserialize)]
struct Recorded {
    request: usize,
    variant: String,
    answer: Option<Answer>,
}

#[derive(Deserialize)]
struct LegacyRecorded {
    query: usize,
    answer: Option<Answer>,
}

#[derive(Deserialize)]
struct LegacyQuery {
    model: String,
    tokens: Vec<u32>,
}

/// Every query the fixture's NOTE.md lists, with the answer the schema 3 build gave:
/// (namespace, tokens, answer).
fn queries() -> Vec<(Namespace, Vec<u32>, Option<Hit>)> {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("traces/mooncake-conversation.jsonl");
    let requests = superfluid_warm::tools::trace::read(&trace).expect("the trace");
    let shared = Namespace::new("fixture-model").expect("namespace");
    let tenant = Namespace::with_tenant("fixture-model", b"tenant-a").expect("namespace");
    let hit = |a: Option<Answer>| a.map(|a| Hit { node: a.node, tokens: a.tokens });
    let mut out = Vec::new();
    let text = std::fs::read_to_string(Path::new(DIR).join("answers.jsonl")).expect("answers");
    for line in text.lines() {
        let r: Recorded = serde_json::from_str(line).expect("an answer line");
        let mut tokens = requests[r.request].tokens();
        tokens.truncate(64 * 20);
        if r.request % 4 == 1 {
            tokens.iter_mut().for_each(|t| *t %= 151_936);
        }
        match r.variant.as_str() {
            "whole" => {}
            "cut7" => tokens.truncate(7 * 64),
            "changed5" if tokens.len() > 5 * 64 => tokens[5 * 64] ^= 1,
            "changed5" => {}
            other => panic!("unknown variant {other}"),
        }
        let ns = if r.request % 5 == 2 { tenant.clone() } else { shared.clone() };
        out.push((ns, tokens, hit(r.answer)));
    }
    let legacy = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0001-from-0.1.7-json/queries.jsonl"),
    )
    .expect("0.1.7 queries");
    let legacy: Vec<LegacyQuery> = legacy.lines().map(|l| serde_json::from_str(l).expect("a query")).collect();
    let text = std::fs::read_to_string(Path::new(DIR).join("legacy-answers.jsonl")).expect("legacy answers");
    for line in text.lines() {
        let r: LegacyRecorded = serde_json::from_str(line).expect("a legacy answer line");
        let q = &legacy[r.query];
        out.push((Namespace::new(&q.model).expect("namespace"), q.tokens.clone(), hit(r.answer)));
    }
    out
}

/// Asserts every recorded answer; returns how many were warm.
fn check_answers(warm: &Warm, queries: &[(Namespace, Vec<u32>, Option<Hit>)], what: &str) -> Result<usize, Error> {
    let mut warm_answers = 0;
    for (i, (ns, tokens, want)) in queries.iter().enumerate() {
        let prefix = warm.prefix(ns, tokens)?;
        assert_eq!(&warm.warmest_prefix(&prefix)?, want, "{what}: query {i}");
        // With one node a block (all a schema 3 file has), the warm nodes start with it.
        assert_eq!(warm.warm_nodes_prefix(&prefix)?.first(), want.as_ref(), "{what}: query {i}");
        warm_answers += usize::from(want.is_some());
    }
    Ok(warm_answers)
}

fn fixture_copy(dir: &Path) -> PathBuf {
    let path = dir.join("warm-v3.redb");
    std::fs::copy(Path::new(DIR).join("warm-v3.redb"), &path).expect("copy the fixture");
    path
}

#[test]
fn a_schema_3_file_is_upgraded_in_place_and_gives_every_answer_it_gave() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries();
    assert_eq!(queries.len(), 580);
    let before = Snapshot::open(&path)?.stats()?;
    assert_eq!(before.schema, 3, "readers do not upgrade");
    {
        let warm = Warm::open(&path)?;
        let stats = warm.stats()?;
        assert_eq!(stats.upgraded_from, Some(3));
        assert_eq!((stats.entries, stats.legacy_entries, stats.others, stats.reclaimable), (963, 240, 0, 0));
        let warm_answers = check_answers(&warm, &queries, "after the upgrade")?;
        assert!(warm_answers > 400, "the fixture has warm answers to check ({warm_answers})");
        warm.close()?;
    }
    let snapshot = Snapshot::open(&path)?;
    assert_eq!(snapshot.stats()?.schema, 5, "upgraded through schema 4 to 5");
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    drop(snapshot);
    // Once upgraded it opens as it is, and keeps learning: a conversation moved to a new node
    // stays warm on the old one too.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen")?;
    let (ns, tokens, old) = &queries[0];
    let old = old.clone().expect("request 0 is warm");
    let mut next = tokens.clone();
    next.extend(0..128);
    warm.ran_prefix(&warm.prefix(ns, &next)?, "node-new")?;
    let listed = warm.warm_nodes_prefix(&warm.prefix(ns, &next)?)?;
    assert_eq!(listed[..2], [Hit { node: "node-new".into(), tokens: next.len() }, old]);
    // Deeper in, the nodes the schema 3 file named on the prompt's shorter prefixes.
    assert!(listed[2..].iter().all(|h| h.tokens < 1280 && h.node.starts_with("node-")), "{listed:?}");
    Ok(())
}

/// A crash at every write the upgrade (and the close after it) makes, in every way the page
/// cache can leave it: the file opens (upgraded then, if it was not), every answer is what the
/// schema 3 build gave, and the invariants hold.
#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_a_file_that_answers_the_same() -> Result<(), Error> {
    let dir = common::tempdir();
    let start = std::fs::read(Path::new(DIR).join("warm-v3.redb")).expect("the fixture");
    let queries = queries();
    let disk = Disk::with_image(start.clone());
    disk.state().record = true;
    Warm::builder().open_with_backend(disk.backend())?.close()?;
    let ops = disk.state().ops.clone();
    let (mut images, mut upgraded_again) = (0, 0);
    for k in 0..=ops.len() {
        for (which, image) in crash_images(&start, &ops, k).into_iter().enumerate() {
            if which > 0 && k % 2 == 1 {
                continue;
            }
            images += 1;
            let path = dir.path().join(format!("crash-{k}-{which}.redb"));
            std::fs::write(&path, &image).expect("write image");
            let warm = Warm::open(&path)?;
            upgraded_again += usize::from(warm.stats()?.upgraded_from == Some(3));
            check_answers(&warm, &queries, &format!("crash at op {k} ({which})"))?;
            warm.close()?;
            let check = Snapshot::open(&path)?.check()?;
            assert!(check.problems.is_empty(), "crash at op {k} ({which}): {:?}", check.problems);
            std::fs::remove_file(&path).expect("remove");
        }
    }
    assert!(upgraded_again > 0 && upgraded_again < images, "both sides of the upgrade's commit were crashed into");
    println!("{images} crash images over {} storage operations; {upgraded_again} still schema 3", ops.len());
    Ok(())
}
