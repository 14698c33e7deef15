//! What every in-place upgrade test checks: a migration's recorded answers, and a crash at
//! every write of the upgrade.

use std::path::Path;

use super::backend::{Disk, crash_images};
use super::fixtures::Query;
use superfluid_warm::{Error, Hit, ReadIndex, Snapshot, Warm};

/// Asserts every recorded answer, with the warm nodes `keep` lets through (of the new chain's);
/// returns how many were warm.
pub fn check_answers(warm: &Warm, queries: &[Query], what: &str, keep: impl Fn(&Hit) -> bool) -> Result<usize, Error> {
    let mut warm_answers = 0;
    for (i, q) in queries.iter().enumerate() {
        let prefix = warm.prefix(&q.namespace, &q.tokens);
        let nodes = warm.warm_nodes_prefix(&prefix)?;
        match &q.warm_nodes {
            Some(want) => {
                let want: Vec<Hit> = want.iter().filter(|h| keep(h)).cloned().collect();
                assert_eq!(nodes, want, "{what}: query {i}, warm nodes");
                assert_eq!(warm.warmest_prefix(&prefix)?, want.first().cloned(), "{what}: query {i}");
            }
            // 0.1.7's imported entries are not counted in a node's cache: they stay until they
            // age out.
            None => assert_eq!(warm.warmest_prefix(&prefix)?, q.warmest, "{what}: query {i} (0.1.7's)"),
        }
        warm_answers += usize::from(q.warmest.is_some());
    }
    Ok(warm_answers)
}

/// Asserts the closed file at `path` is of schema `schema` and passes `check`.
pub fn assert_upgraded_and_healthy(path: &Path, schema: u32) -> Result<(), Error> {
    let snapshot = Snapshot::open(path)?;
    assert_eq!(snapshot.stats()?.schema, schema);
    let check = snapshot.check()?;
    assert!(check.problems.is_empty(), "{:?}", check.problems);
    Ok(())
}

/// A copy of migration folder `migration`'s fixture `name` in `dir`.
pub fn fixture_copy(migration: &str, name: &str, dir: &Path) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::copy(Path::new(migration).join(name), &path).expect("copy the fixture");
    path
}

/// A crash at every write the upgrade of `fixture` (and the close after it) makes, in every
/// way the page cache can leave it: the file opens (upgraded then, if it was not), `answers`
/// holds of it (every answer the build that wrote it gave), and the invariants hold. Returns
/// (images, images still of schema `from`).
pub fn crash_every_write_of_the_upgrade(
    fixture: &Path,
    from: u32,
    dir: &Path,
    answers: impl Fn(&Warm, &str) -> Result<usize, Error>,
) -> Result<(usize, usize), Error> {
    let start = std::fs::read(fixture).expect("the fixture");
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
            let path = dir.join(format!("crash-{k}-{which}.redb"));
            std::fs::write(&path, &image).expect("write image");
            let warm = Warm::open(&path)?;
            upgraded_again += usize::from(warm.stats()?.upgraded_from == Some(from));
            answers(&warm, &format!("crash at op {k} ({which})"))?;
            warm.close()?;
            let check = Snapshot::open(&path)?.check()?;
            assert!(check.problems.is_empty(), "crash at op {k} ({which}): {:?}", check.problems);
            std::fs::remove_file(&path).expect("remove");
        }
    }
    assert!(upgraded_again > 0 && upgraded_again < images, "both sides of the upgrade's commit were crashed into");
    println!("{images} crash images over {} storage operations; {upgraded_again} still schema {from}", ops.len());
    Ok((images, upgraded_again))
}
