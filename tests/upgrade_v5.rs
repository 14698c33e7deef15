//! Schema 4 → 5 (`migrations/0005-node-caches`): a file written by the schema 4 build is upgraded
//! in place on open, gives every answer that build gave (`warmest` and the whole `warm_nodes`),
//! keeps a node's cache once it is given a size, and a crash at any write of the upgrade leaves
//! a file that opens and answers the same.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::queries;
use common::upgrade::{check_answers, crash_every_write_of_the_upgrade};
use superfluid_warm::{Error, Hit, Snapshot, Warm};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0005-node-caches");

fn fixture_copy(dir: &Path) -> PathBuf {
    common::upgrade::fixture_copy(DIR, "warm-v4.redb", dir)
}

#[test]
fn a_schema_4_file_is_upgraded_in_place_and_gives_every_answer_it_gave() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries(Path::new(DIR));
    assert_eq!(queries.len(), 640);
    assert_eq!(Snapshot::open(&path)?.stats()?.schema, 4, "readers do not upgrade");
    {
        let warm = Warm::open(&path)?;
        let stats = warm.stats()?;
        assert_eq!(stats.upgraded_from, Some(4));
        assert_eq!((stats.entries, stats.legacy_entries, stats.others, stats.reclaimable), (1191, 240, 190, 140));
        assert_eq!(stats.nodes.iter().filter(|n| n.forgotten).count(), 1);
        assert!(stats.node_caches.iter().all(|c| c.capacity.is_none() && c.held == 0), "no sizes: no caches kept");
        let warm_answers = check_answers(&warm, &queries, "after the upgrade", |_| true)?;
        assert!(warm_answers > 400, "the fixture has warm answers to check ({warm_answers})");
        warm.close()?;
    }
    let snapshot = Snapshot::open(&path)?;
    assert_eq!(snapshot.stats()?.schema, 8, "upgraded through schemas 5, 6 and 7 to 8");
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    drop(snapshot);
    // Once upgraded it opens as it is. A node given a cache of one block keeps nothing of its
    // two-block and longer prompts: it leaves every answer, and the rest stay.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen", |_| true)?;
    warm.set_node_capacity("node-0", Some(1))?;
    let not_node_0 = |h: &Hit| h.node != "node-0";
    check_answers(&warm, &queries, "node-0 with a cache of one block", not_node_0)?;
    let stats = warm.stats()?;
    let cache = stats.node_caches.iter().find(|c| c.node == "node-0").expect("node-0's cache");
    assert_eq!((cache.held, cache.capacity), (0, Some(1)));
    assert!(cache.floor > 0, "its blocks left its cache");
    warm.close()?;
    let check = Snapshot::open(&path)?.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    let warm = Warm::open(&path)?;
    check_answers(&warm, &queries, "the same after a reopen", not_node_0)?;
    Ok(())
}

/// A crash at every write the upgrade (and the close after it) makes, in every way the page
/// cache can leave it: the file opens (upgraded then, if it was not), every answer is what the
/// schema 4 build gave, and the invariants hold.
#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_a_file_that_answers_the_same() -> Result<(), Error> {
    let dir = common::tempdir();
    let queries = queries(Path::new(DIR));
    let answers = |warm: &Warm, what: &str| check_answers(warm, &queries, what, |_| true);
    crash_every_write_of_the_upgrade(&Path::new(DIR).join("warm-v4.redb"), 4, dir.path(), answers)?;
    Ok(())
}
