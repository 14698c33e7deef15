//! Schema 3 → 4 (`migrations/0004-node-sets-and-forget`): a file written by the schema 3 build is
//! upgraded in place on open, gives every answer that build gave, and a crash at any write of
//! the upgrade leaves a file that opens and answers the same.

mod common;

use std::path::{Path, PathBuf};
use superfluid_warm::ReadIndex;

use common::fixtures::{Query, queries};
use common::upgrade::crash_every_write_of_the_upgrade;
use superfluid_warm::{Error, Hit, Snapshot, Warm};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0004-node-sets-and-forget");

/// Asserts every recorded answer; returns how many were warm.
fn check_answers(warm: &Warm, queries: &[Query], what: &str) -> Result<usize, Error> {
    let mut warm_answers = 0;
    for (i, q) in queries.iter().enumerate() {
        let prefix = warm.prefix(&q.namespace, &q.tokens);
        assert_eq!(warm.warmest_prefix(&prefix)?, q.warmest, "{what}: query {i}");
        // With one node a block (all a schema 3 file has), the warm nodes start with it.
        assert_eq!(warm.warm_nodes_prefix(&prefix)?.first(), q.warmest.as_ref(), "{what}: query {i}");
        warm_answers += usize::from(q.warmest.is_some());
    }
    Ok(warm_answers)
}

fn fixture_copy(dir: &Path) -> PathBuf {
    common::upgrade::fixture_copy(DIR, "warm-v3.redb", dir)
}

#[test]
fn a_schema_3_file_is_upgraded_in_place_and_gives_every_answer_it_gave() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries(Path::new(DIR));
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
    assert_eq!(snapshot.stats()?.schema, 8, "upgraded through schemas 4 to 7, then 8");
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    drop(snapshot);
    // Once upgraded it opens as it is, and keeps learning: a conversation moved to a new node
    // stays warm on the old one too.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen")?;
    let (ns, old) = (&queries[0].namespace, queries[0].warmest.clone().expect("request 0 is warm"));
    let mut next = queries[0].tokens.clone();
    next.extend(0..128);
    warm.ran_prefix(&warm.prefix(ns, &next), "node-new")?;
    let listed = warm.warm_nodes_prefix(&warm.prefix(ns, &next))?;
    assert_eq!(listed[..2], [Hit::new("node-new", next.len()), old]);
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
    let queries = queries(Path::new(DIR));
    let answers = |warm: &Warm, what: &str| check_answers(warm, &queries, what);
    crash_every_write_of_the_upgrade(&Path::new(DIR).join("warm-v3.redb"), 3, dir.path(), answers)?;
    Ok(())
}
