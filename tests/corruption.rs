//! Bit flips: a writer opening a damaged file refuses it or answers exactly as before, never
//! panics and never answers wrongly.

mod common;

use std::panic::{AssertUnwindSafe, catch_unwind};
use superfluid_warm::ReadIndex;

use common::backend::Disk;
use common::{Conversations, Rng, db_path, tempdir};
use superfluid_warm::{Error, Hit, IndexFile, OpenCheck, Warm};

fn seal_path(path: &std::path::Path) -> std::path::PathBuf {
    IndexFile::new(path).seal_path()
}

/// How the opens of flipped files ended.
#[derive(Default)]
struct Tally {
    refused: usize,
    harmless: usize,
    panics: usize,
}

impl Tally {
    /// Counts one open; `check` asserts what an open that was not refused gave.
    fn count<T>(&mut self, outcome: std::thread::Result<Result<T, Error>>, check: impl FnOnce(T)) {
        match outcome {
            Err(_) => self.panics += 1,
            Ok(Err(_)) => self.refused += 1,
            Ok(Ok(got)) => {
                check(got);
                self.harmless += 1;
            }
        }
    }

    /// Nothing panicked, and flips in live pages were caught.
    fn assert_safe(&self) {
        assert_eq!(self.panics, 0);
        assert!(self.refused > 0, "flips in live pages are caught");
    }
}

impl std::fmt::Display for Tally {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} refused, {} harmless, {} panics", self.refused, self.harmless, self.panics)
    }
}

#[test]
fn a_thousand_single_bit_flips_are_refused_or_harmless() -> Result<(), Error> {
    let disk = Disk::default();
    let mut rng = Rng(99);
    let mut conversations = Conversations::new(12);
    let mut prompts = Vec::new();
    {
        let warm = Warm::builder().open_with_backend(disk.backend())?;
        for i in 0..60 {
            let (m, p) = conversations.turn(&mut rng);
            warm.ran(m, &p, ["a", "b", "c"][i % 3])?;
            prompts.push((m, p));
        }
        warm.close()?;
    }
    let clean = disk.state().durable.clone();
    let answers =
        |warm: &Warm| -> Result<Vec<Option<Hit>>, Error> { prompts.iter().map(|(m, p)| warm.warmest(m, p)).collect() };
    let expected = answers(&Warm::builder().open_with_backend(Disk::with_image(clean.clone()).backend())?)?;
    assert!(expected.iter().filter(|a| a.is_some()).count() > 30);
    let mut tally = Tally::default();
    let flips = 1000;
    for _ in 0..flips {
        let mut image = clean.clone();
        let bit = rng.below(image.len() as u64 * 8);
        image[(bit / 8) as usize] ^= 1 << (bit % 8);
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<Vec<Option<Hit>>, Error> {
            let warm = Warm::builder().open_with_backend(Disk::with_image(image).backend())?;
            answers(&warm)
        }));
        tally
            .count(outcome, |got| assert_eq!(got, expected, "a flip of bit {bit} was opened and answered differently"));
    }
    println!("{flips} bit flips over a {} byte file: {tally}", clean.len());
    tally.assert_safe();
    Ok(())
}

/// A file closed cleanly is sealed, and opens by its seal; the same file with one bit flipped, its
/// length, time and seal put back as they were, is never trusted by the seal: it is verified page
/// by page (refused, or answering exactly as before), and nothing panics.
#[test]
fn a_sealed_file_with_a_flipped_bit_is_not_trusted() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut rng = Rng(7);
    let mut conversations = Conversations::new(12);
    let mut prompts = Vec::new();
    {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.open_check, OpenCheck::Pages, "a new file has no seal");
        for i in 0..60 {
            let (m, p) = conversations.turn(&mut rng);
            warm.ran(m, &p, ["a", "b", "c"][i % 3])?;
            prompts.push((m, p));
        }
        warm.close()?;
    }
    let answers =
        |warm: &Warm| -> Result<Vec<Option<Hit>>, Error> { prompts.iter().map(|(m, p)| warm.warmest(m, p)).collect() };
    let expected = {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.open_check, OpenCheck::Seal, "closed cleanly, so sealed");
        let expected = answers(&warm)?;
        warm.close()?;
        expected
    };
    assert!(expected.iter().filter(|a| a.is_some()).count() > 30);
    let read = |p: &std::path::Path| std::fs::read(p).expect("read");
    let (clean, seal) = (read(&path), read(&seal_path(&path)));
    let modified = std::fs::metadata(&path).and_then(|m| m.modified()).expect("mtime");
    let put = |image: &[u8]| {
        std::fs::write(&path, image).expect("write the image");
        std::fs::File::options().write(true).open(&path).and_then(|f| f.set_modified(modified)).expect("time");
        std::fs::write(seal_path(&path), &seal).expect("put the seal back");
    };
    put(&clean);
    {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.open_check, OpenCheck::Seal, "the same bytes, time and seal");
        warm.close()?;
    }
    let mut tally = Tally::default();
    let flips = 150;
    for _ in 0..flips {
        let mut image = clean.clone();
        let bit = rng.below(image.len() as u64 * 8);
        image[(bit / 8) as usize] ^= 1 << (bit % 8);
        put(&image);
        let outcome = catch_unwind(AssertUnwindSafe(|| -> Result<(OpenCheck, Vec<Option<Hit>>), Error> {
            let warm = Warm::open(&path)?;
            let check = warm.stats()?.open_check;
            let got = answers(&warm)?;
            warm.close()?;
            Ok((check, got))
        }));
        tally.count(outcome, |(check, got)| {
            assert_eq!(check, OpenCheck::Pages, "a flip of bit {bit} was trusted by the seal");
            assert_eq!(got, expected, "a flip of bit {bit} was opened and answered differently");
        });
    }
    println!("{flips} bit flips in a sealed {} byte file, seal and time put back: {tally}", clean.len());
    tally.assert_safe();
    // A head that opened the file without verifying it does not seal it at close: the next open
    // verifies every page.
    put(&clean);
    Warm::builder().check_integrity_on_open(false).open(&path)?.close()?;
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.open_check, OpenCheck::Pages, "an unverified open left a seal");
    assert_eq!(answers(&warm)?, expected);
    Ok(())
}

/// The seal record of 0.3.0 (seal version 1: a blake3 of per-chunk XXH64s), encoded as that
/// build wrote it: bincode 2 `standard()` over serde.
#[derive(serde::Serialize)]
struct SealV1 {
    version: u32,
    state: SealV1State,
}

#[derive(serde::Serialize)]
enum SealV1State {
    Sealed { len: u64, modified: u128, digest: [u8; 32] },
}

#[test]
fn a_seal_of_the_previous_format_costs_one_full_check_and_is_written_anew() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    let mut rng = Rng(11);
    let mut conversations = Conversations::new(6);
    let mut prompts = Vec::new();
    let warm = Warm::open(&path)?;
    for i in 0..40 {
        let (m, p) = conversations.turn(&mut rng);
        warm.ran(m, &p, ["a", "b"][i % 2])?;
        prompts.push((m, p));
    }
    let expected: Vec<Option<Hit>> = prompts.iter().map(|(m, p)| warm.warmest(m, p)).collect::<Result<_, _>>()?;
    warm.close()?;
    // The side file as 0.3.0 left it for this very file (its length and time; its digest is of
    // the old scheme, which this build does not compute).
    let meta = std::fs::metadata(&path).expect("stat");
    let modified = meta.modified().expect("mtime").duration_since(std::time::UNIX_EPOCH).expect("after 1970");
    let old = SealV1 {
        version: 1,
        state: SealV1State::Sealed { len: meta.len(), modified: modified.as_nanos(), digest: [0x5a; 32] },
    };
    let bytes = bincode::serde::encode_to_vec(&old, bincode::config::standard()).expect("encode");
    std::fs::write(seal_path(&path), &bytes).expect("write the old seal");
    for (open, want) in [(1, OpenCheck::Pages), (2, OpenCheck::Seal)] {
        let warm = Warm::open(&path)?;
        assert_eq!(warm.stats()?.open_check, want, "open {open}");
        let got: Vec<Option<Hit>> = prompts.iter().map(|(m, p)| warm.warmest(m, p)).collect::<Result<_, _>>()?;
        assert_eq!(got, expected, "open {open} answers as before");
        warm.close()?;
        if open == 1 {
            assert_ne!(std::fs::read(seal_path(&path)).expect("seal"), bytes, "sealed anew at close");
        }
    }
    assert!(expected.iter().filter(|a| a.is_some()).count() > 20);
    Ok(())
}

/// A node cache row that names a node id the file never handed out (a damaged or hand-edited
/// file; redb's checksums hold) is a typed error, for a head and for a reader, before it sizes
/// anything by that id.
#[test]
fn a_node_cache_row_naming_an_unknown_node_is_refused() -> Result<(), Error> {
    const NODE_CLOCKS: redb::TableDefinition<(u32, u64), u64> = redb::TableDefinition::new("node_clocks/v5");
    const NODE_FLOORS: redb::TableDefinition<u32, u64> = redb::TableDefinition::new("node_floors/v5");
    let dir = tempdir();
    let path = db_path(&dir);
    let warm = Warm::builder().node_cache_blocks(64).open(&path)?;
    let prompt: Vec<u32> = (0..256).collect();
    warm.ran("m", &prompt, "a")?;
    warm.close()?;
    // Node "a" is id 0: the file has handed out 1; the first id past it and a huge one.
    for (table, id) in [("clocks", 1), ("floors", 1), ("clocks", u32::MAX - 1), ("floors", u32::MAX - 1)] {
        let copy = dir.path().join(format!("{table}-{id}.redb"));
        std::fs::copy(&path, &copy).expect("copy");
        {
            let db = redb::Database::open(&copy).expect("redb opens the copy");
            let txn = db.begin_write().expect("write");
            match table {
                "clocks" => drop(txn.open_table(NODE_CLOCKS).expect("table").insert((id, 9), 1).expect("row")),
                _ => drop(txn.open_table(NODE_FLOORS).expect("table").insert(id, 9).expect("row")),
            }
            txn.commit().expect("commit");
        }
        match Warm::open(&copy) {
            Err(Error::Corrupted { detail }) => assert!(detail.contains("node id"), "{detail}"),
            other => panic!("a head opened a node cache of node id {id}: {:?}", other.map(|_| ())),
        }
        let snapshot = superfluid_warm::Snapshot::open(&copy)?;
        assert!(matches!(snapshot.check(), Err(Error::Corrupted { .. })), "{table} {id}: check");
        assert!(matches!(snapshot.stats(), Err(Error::Corrupted { .. })), "{table} {id}: stats");
    }
    // The file itself, untouched, opens with its cache.
    let warm = Warm::open(&path)?;
    assert_eq!(warm.stats()?.node_caches.iter().map(|c| c.held).sum::<u64>(), 4);
    Ok(())
}
