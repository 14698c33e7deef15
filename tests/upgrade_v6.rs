//! Schema 5 → 6 (`migrations/0006-engine-events`): a file written by the schema 5 build (node
//! caches set, a forgotten node, 0.1.7's entries) is upgraded in place on open, gives every
//! answer that build gave (`warmest` and the whole `warm_nodes`), then takes engine events for
//! one of its nodes, and a crash at any write of the upgrade leaves a file that opens and
//! answers the same.

mod common;

use std::path::{Path, PathBuf};

use common::fixtures::queries;
use common::upgrade::{check_answers, crash_every_write_of_the_upgrade};
use superfluid_warm::{EngineBatch, EngineOutcome, Error, Hit, Snapshot, Warm};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/migrations/0006-engine-events");

fn fixture_copy(dir: &Path) -> PathBuf {
    common::upgrade::fixture_copy(DIR, "warm-v5.redb", dir)
}

#[test]
fn a_schema_5_file_is_upgraded_in_place_and_gives_every_answer_it_gave() -> Result<(), Error> {
    let dir = common::tempdir();
    let path = fixture_copy(dir.path());
    let queries = queries(Path::new(DIR));
    assert_eq!(queries.len(), 640);
    assert_eq!(Snapshot::open(&path)?.stats()?.schema, 5, "readers do not upgrade");
    {
        let warm = Warm::open(&path)?;
        let stats = warm.stats()?;
        assert_eq!(stats.upgraded_from, Some(5));
        assert_eq!((stats.entries, stats.legacy_entries, stats.others, stats.reclaimable), (1191, 240, 190, 140));
        let node_1 = stats.node_caches.iter().find(|c| c.node == "node-1").expect("node-1's cache");
        assert_eq!((node_1.capacity, node_1.floor), (Some(150), 131), "the node caches came through");
        assert!(warm.engine_stats()?.is_empty(), "no node has an event stream");
        let warm_answers = check_answers(&warm, &queries, "after the upgrade", |_| true)?;
        assert!(warm_answers > 400, "the fixture has warm answers to check ({warm_answers})");
        warm.close()?;
    }
    let snapshot = Snapshot::open(&path)?;
    assert_eq!(snapshot.stats()?.schema, 8);
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    drop(snapshot);
    // Once upgraded it opens as it is. node-2's engine starts a stream that holds nothing: its
    // `ran`s from before are no longer answered (the engine is the truth), the rest stay.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.upgraded_from, None);
    check_answers(&warm, &queries, "after a reopen", |_| true)?;
    let first = EngineBatch { seq: 0, ts: 1.0, events: Vec::new() };
    assert_eq!(warm.engine_batch("node-2", &first)?, EngineOutcome::Applied);
    let not_node_2 = |h: &Hit| h.node != "node-2";
    check_answers(&warm, &queries, "node-2 with an empty engine", not_node_2)?;
    warm.close()?;
    let check = Snapshot::open(&path)?.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    let warm = Warm::open(&path)?;
    check_answers(&warm, &queries, "the same after a reopen", not_node_2)?;
    assert_eq!(warm.engine_stats()?.first().map(|s| s.last_seq), Some(Some(0)), "its position is kept");
    Ok(())
}

/// A crash at every write the upgrade (and the close after it) makes, in every way the page
/// cache can leave it: the file opens (upgraded then, if it was not), every answer is what the
/// schema 5 build gave, and the invariants hold.
#[test]
fn a_crash_at_any_write_of_the_upgrade_leaves_a_file_that_answers_the_same() -> Result<(), Error> {
    let dir = common::tempdir();
    let queries = queries(Path::new(DIR));
    let answers = |warm: &Warm, what: &str| check_answers(warm, &queries, what, |_| true);
    crash_every_write_of_the_upgrade(&Path::new(DIR).join("warm-v5.redb"), 5, dir.path(), answers)?;
    Ok(())
}
