//! I/O errors and a full disk: typed errors, what was committed stays answerable and durable.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use superfluid_warm::ReadIndex;

use common::backend::Disk;
use superfluid_warm::{Error, Hit, Warm};

/// Runs `f(thread)` on four threads at once and gathers what they return.
fn on_four_threads(f: impl Fn(u32) -> Vec<u32> + Sync) -> Vec<u32> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..4).map(|th| s.spawn(move || f(th))).collect();
        handles.into_iter().flat_map(|h| h.join().expect("thread")).collect()
    })
}

fn prompt(i: u32) -> Vec<u32> {
    (0..256).map(|t| i * 1000 + t).collect()
}

#[test]
fn a_failing_write_or_sync_is_a_typed_error_and_loses_nothing_committed() -> Result<(), Error> {
    for fail_syncs in [false, true] {
        let disk = Disk::default();
        let warm = Warm::builder().sync_window(Duration::from_secs(30)).open_with_backend(disk.backend())?;
        for i in 0..10 {
            warm.ran("m", &prompt(i), "a")?;
        }
        warm.sync()?;
        {
            let mut state = disk.state();
            state.fail_syncs = fail_syncs;
            state.fail_writes = !fail_syncs;
        }
        warm.ran("m", &prompt(100), "b")?;
        let err = warm.sync().expect_err("the commit cannot succeed");
        assert!(matches!(err, Error::Storage { .. }), "{err}");
        assert!(err.to_string().contains("committed before is intact"), "{err}");
        // The head keeps routing on what was committed.
        for i in 0..10 {
            assert_eq!(warm.warmest("m", &prompt(i))?, Some(Hit::new("a", 256)), "fail_syncs {fail_syncs}");
        }
        assert_eq!(
            warm.warmest("m", &prompt(100))?,
            Some(Hit::new("b", 256)),
            "the ran of the failed commit is kept (answered, retried), not lost"
        );
        assert!(warm.sync().is_err(), "while the disk fails, every sync says so");
        drop(warm);
        let durable = disk.state().durable.clone();
        let reopened = Warm::open_image(durable)?;
        for i in 0..10 {
            assert_eq!(reopened.warmest("m", &prompt(i))?, Some(Hit::new("a", 256)));
        }
        assert_eq!(reopened.warmest("m", &prompt(100))?, None, "never durable, and not half there");
    }
    Ok(())
}

#[test]
fn a_full_disk_is_a_typed_error_and_leaves_a_consistent_file() -> Result<(), Error> {
    let disk = Disk::default();
    let warm = Warm::builder().sync_window(Duration::ZERO).open_with_backend(disk.backend())?;
    let limit = disk.state().live.len() as u64 + 4 * 1024 * 1024;
    disk.state().limit = Some(limit);
    let mut acked = 0;
    let err = loop {
        match warm.ran("m", &prompt(acked), "a") {
            Ok(()) => acked += 1,
            Err(e) => break e,
        }
        assert!(acked < 100_000, "the disk never filled");
    };
    println!("disk full after {acked} durable rans: {err}");
    assert!(matches!(err, Error::Storage { .. }), "{err}");
    assert!(err.to_string().contains("No space left") || err.to_string().contains("no space left"), "{err}");
    assert!(acked > 10);
    for i in (0..acked).step_by(7) {
        assert!(warm.warmest("m", &prompt(i))?.is_some(), "ran {i} was committed before the disk filled");
    }
    drop(warm);
    let image = disk.state().durable.clone();
    let reopened = Warm::open_image(image)?;
    for i in 0..acked {
        assert_eq!(reopened.warmest("m", &prompt(i))?.map(|h| h.tokens), Some(256), "durable ran {i}");
    }
    Ok(())
}

trait OpenImage {
    fn open_image(image: Vec<u8>) -> Result<Warm, Error>;
}

impl OpenImage for Warm {
    /// Reopens a disk image, as after a restart.
    fn open_image(image: Vec<u8>) -> Result<Warm, Error> {
        Warm::builder().open_with_backend(Disk::with_image(image).backend())
    }
}

/// Four threads `ran` with no sync window (each `ran` durable before it returns) while the disk
/// starts failing its syncs: every `ran` that returned `Ok` is in the durable image, and none is
/// acknowledged for another thread's failed commit.
#[test]
fn with_no_window_every_acknowledged_ran_is_durable_even_when_commits_fail() -> Result<(), Error> {
    let disk = Disk::default();
    let warm = Warm::builder().sync_window(Duration::ZERO).open_with_backend(disk.backend())?;
    let total = AtomicU32::new(0);
    let acked = on_four_threads(|th| {
        let mut acked = Vec::new();
        for i in 0..60u32 {
            let id = th * 1000 + i;
            // The disk fails once 80 rans are in, all threads running.
            if total.load(Ordering::SeqCst) >= 80 {
                disk.state().fail_syncs = true;
            }
            if warm.ran("m", &prompt(id), "a").is_ok() {
                acked.push(id);
                total.fetch_add(1, Ordering::SeqCst);
            }
        }
        acked
    });
    assert!(acked.len() >= 80, "{} acknowledged", acked.len());
    assert!(acked.len() < 240, "the failing disk refused some");
    drop(warm);
    assert_durable(&disk, &acked)
}

/// Every prompt of `ids` is answered by the disk's durable image, reopened.
fn assert_durable(disk: &Disk, ids: &[u32]) -> Result<(), Error> {
    let reopened = Warm::open_image(disk.state().durable.clone())?;
    for id in ids {
        assert_eq!(reopened.warmest("m", &prompt(*id))?.map(|h| h.tokens), Some(256), "ran {id} is not durable");
    }
    Ok(())
}

/// The same with group commit: a `sync` that returns `Ok` means every `ran` its thread made
/// before it is durable, even when the commit thread's own commit failed in between.
#[test]
fn with_group_commit_a_successful_sync_covers_every_earlier_ran() -> Result<(), Error> {
    let disk = Disk::default();
    let warm = Warm::builder().sync_window(Duration::from_millis(1)).open_with_backend(disk.backend())?;
    let total = AtomicU32::new(0);
    let covered = on_four_threads(|th| {
        let (mut made, mut covered) = (Vec::new(), Vec::new());
        for i in 0..80u32 {
            let id = th * 1000 + i;
            if total.fetch_add(1, Ordering::SeqCst) >= 150 {
                disk.state().fail_syncs = true;
            }
            if warm.ran("m", &prompt(id), "a").is_ok() {
                made.push(id);
            }
            if i % 5 == 4 && warm.sync().is_ok() {
                covered.append(&mut made);
            }
        }
        covered
    });
    assert!(covered.len() >= 40, "{} covered by a successful sync", covered.len());
    drop(warm);
    assert_durable(&disk, &covered)
}

/// An import while the disk fails is a typed error, and the `ran`s queued before it are kept
/// (answered, retried), not dropped with the import's batch.
#[test]
fn a_failed_import_keeps_the_rans_before_it() -> Result<(), Error> {
    let disk = Disk::default();
    let warm = Warm::builder().sync_window(Duration::from_secs(30)).open_with_backend(disk.backend())?;
    for i in 0..5 {
        warm.ran("m", &prompt(i), "a")?;
    }
    disk.state().fail_writes = true;
    let json = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/0001-from-0.1.7-json/warm.json");
    let err = warm.import_json(&json).expect_err("the disk fails");
    assert!(matches!(err, Error::Storage { .. }), "{err}");
    for i in 0..5 {
        assert_eq!(warm.warmest("m", &prompt(i))?, Some(Hit::new("a", 256)), "ran {i} kept");
    }
    Ok(())
}

/// A `forget_node` whose commit fails is a typed error, and answers leave the node out at once;
/// like a `ran` of a failed commit it is not durable (redb refuses writes after an I/O error
/// until the file is opened again), so the head forgets again after reopening.
#[test]
fn a_forget_whose_commit_fails_is_a_typed_error_and_answers_leave_the_node_out() -> Result<(), Error> {
    for window in [Duration::ZERO, Duration::from_secs(30)] {
        let disk = Disk::default();
        let warm = Warm::builder().sync_window(window).open_with_backend(disk.backend())?;
        warm.ran("m", &prompt(1)[..128], "a")?;
        warm.ran("m", &prompt(1), "b")?;
        warm.sync()?;
        disk.state().fail_syncs = true;
        let err = warm.forget_node("b").expect_err("the commit cannot succeed");
        assert!(matches!(err, Error::Storage { .. }), "{err}");
        assert_eq!(warm.warmest("m", &prompt(1))?, Some(Hit::new("a", 128)), "window {window:?}");
        drop(warm);
        disk.state().fail_syncs = false;
        let reopened = Warm::open_image(disk.state().durable.clone())?;
        assert_eq!(reopened.warmest("m", &prompt(1))?.map(|h| h.node), Some("b".into()), "never acknowledged");
        reopened.forget_node("b")?;
        assert_eq!(reopened.warmest("m", &prompt(1))?, Some(Hit::new("a", 128)));
    }
    Ok(())
}

/// After an I/O error redb refuses every later write until the file is reopened, even once the
/// disk is healthy again: a head's commits keep failing, and the error says to reopen. A reopen
/// finds everything committed before the failure, and writes again.
#[test]
fn after_an_io_error_commits_fail_until_a_reopen_and_the_error_says_so() -> Result<(), Error> {
    let disk = Disk::default();
    let warm = Warm::builder().sync_window(Duration::from_secs(30)).open_with_backend(disk.backend())?;
    warm.ran("m", &prompt(1), "a")?;
    warm.sync()?;
    disk.state().fail_syncs = true;
    warm.ran("m", &prompt(2), "a")?;
    let first = warm.sync().expect_err("the sync fails");
    assert!(first.needs_reopen() && first.to_string().contains("reopen the index"), "{first}");
    disk.state().fail_syncs = false;
    // The disk is healthy again; the handle is not: every call that writes says so, and the
    // head still answers what it had.
    let later = warm.ran("m", &prompt(3), "a").expect_err("redb refuses writes after the failure");
    assert!(later.needs_reopen(), "{later}");
    assert!(later.to_string().contains("reopen the index") && !later.to_string().contains("retried"), "{later}");
    assert!(warm.sync().is_err_and(|e| e.needs_reopen()));
    // A forget too: refused before it is decided, as every change is (it would only wait in a
    // queue no commit empties), so answers still name the node.
    let forget = warm.forget_node("a").expect_err("refused while commits fail");
    assert!(matches!(forget, Error::CommitFailed { .. }) && forget.needs_reopen(), "{forget}");
    assert_eq!(warm.warmest("m", &prompt(1))?.map(|h| h.tokens), Some(256));
    drop(warm);
    let reopened = Warm::builder().open_with_backend(disk.backend())?;
    assert_eq!(reopened.warmest("m", &prompt(1))?.map(|h| h.tokens), Some(256), "committed before the failure");
    let invalid = reopened.ran("", &prompt(5), "b").expect_err("an empty model name");
    assert!(!invalid.needs_reopen(), "bad input leaves the handle writable: {invalid}");
    reopened.ran("m", &prompt(4), "b")?;
    reopened.sync()?;
    drop(reopened);
    let image = Warm::open_image(disk.state().durable.clone())?;
    assert_eq!(image.warmest("m", &prompt(4))?.map(|h| h.tokens), Some(256), "durable after the reopen");
    Ok(())
}
