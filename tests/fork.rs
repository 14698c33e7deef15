//! A fork after open (a Rust program's `fork`, Python's `multiprocessing`): the child's copy of a
//! handle refuses every call with `Error::Forked` and touches nothing of the parent's, which goes
//! on writing; the file stays healthy and keeps every write the parent acknowledged.
// fork(2), waitpid(2), kill(2) and _exit(2) have no safe wrapper in std; nothing else here is
// unsafe, and the library forbids unsafe code.
#![allow(unsafe_code)]

mod common;

use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{db_path, tempdir};
use superfluid_warm::{Error, IndexFile, ReadIndex, Reader, Snapshot, Warm};

const MODEL: &str = "fork";
const ROUNDS: u32 = 20;

/// A prompt of four blocks no other write uses.
fn prompt(id: u32) -> Vec<u32> {
    (0..256).map(|i| id.wrapping_mul(7919).wrapping_add(i) ^ (id << 12)).collect()
}

fn fork() -> libc::pid_t {
    // SAFETY: the child only calls the index (which checks its process before any lock) and
    // `_exit`s; it never returns into the test harness.
    unsafe { libc::fork() }
}

fn exit_child(code: i32) -> ! {
    // SAFETY: `_exit` ends the child at once, running no destructor or atexit handler of the
    // parent's copy.
    unsafe { libc::_exit(code) }
}

/// Waits for the child (at most 60 s, then kills it); its exit code.
fn wait_child(pid: libc::pid_t) -> i32 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut status = 0;
        // SAFETY: `status` is a valid place for waitpid to write.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        assert!(done >= 0, "waitpid failed");
        if done == pid {
            assert!(libc::WIFEXITED(status), "the child did not exit normally (status {status:#x})");
            return libc::WEXITSTATUS(status);
        }
        if Instant::now() > deadline {
            // SAFETY: `pid` is our own child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the child hung on its copy of the index (a lock held by the parent's threads)");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether `result` is the refusal a fork's child must get.
fn refused<T>(result: Result<T, Error>) -> bool {
    matches!(result, Err(Error::Forked { .. }))
}

/// In the child: every kind of call on the parent's handle, each refused; the exit code says
/// which was not (0: all were).
fn child_calls(warm: &Warm, tokens: &[u32]) -> i32 {
    for _ in 0..20 {
        let checks = [
            refused(warm.ran(MODEL, tokens, "child")),
            refused(warm.sync()),
            refused(warm.warmest(MODEL, tokens)),
            refused(warm.warm_nodes(MODEL, tokens)),
            refused(warm.stats()),
            refused(warm.forget_node("child")),
            refused(warm.set_node_capacity("child", Some(16))),
            refused(warm.set_node_cache_default(Some(16))),
            refused(warm.engine_stats()),
        ];
        if let Some(which) = checks.iter().position(|ok| !ok) {
            return 10 + which as i32;
        }
    }
    0
}

/// The parent's writes, each recorded once a `sync` after it returned `Ok`.
struct Writes {
    acked: Mutex<Vec<(u32, String)>>,
}

impl Writes {
    /// `count` writes by `node`, from id `first`, synced every 4.
    fn write(&self, warm: &Warm, node: &str, first: u32, count: u32) -> Result<(), Error> {
        let mut unsynced = Vec::new();
        for id in first..first + count {
            warm.ran(MODEL, &prompt(id), node)?;
            unsynced.push((id, node.to_string()));
            if unsynced.len() == 4 {
                warm.sync()?;
                self.acked.lock().expect("acked").append(&mut unsynced);
            }
        }
        warm.sync()?;
        self.acked.lock().expect("acked").append(&mut unsynced);
        Ok(())
    }
}

/// The closed file: healthy by redb and by the index's invariants, and every acknowledged
/// write answered with its node.
fn check_file(path: &Path, acked: &[(u32, String)]) -> Result<(), Error> {
    let check = Snapshot::open(path)?.check()?;
    assert!(check.problems.is_empty(), "invariants: {:?}", check.problems);
    assert!(IndexFile::new(path).integrity_check_copy()?, "redb's integrity check");
    let reader = Reader::open(path)?;
    for (id, node) in acked {
        let hit = reader.warmest(MODEL, &prompt(*id))?;
        assert_eq!(hit.map(|h| (h.node, h.tokens)), Some((node.clone(), 256)), "write {id}");
    }
    Ok(())
}

/// Sets its flag when dropped.
struct Stop<'a>(&'a AtomicBool);

impl Drop for Stop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

#[test]
fn a_forked_child_is_refused_and_the_parents_file_is_kept() -> Result<(), Error> {
    let dir = tempdir();
    let path = db_path(&dir);
    // A short window: the commit thread is busy (holding the index's locks) when it forks.
    let warm = Warm::builder().sync_window(Duration::from_millis(1)).open(&path)?;
    let writes = Writes { acked: Mutex::new(Vec::new()) };
    let stop = AtomicBool::new(false);
    let child_tokens = prompt(u32::MAX);
    // Writers on both sides: a thread of the parent writes through every fork, the parent's
    // main thread writes while each child calls.
    std::thread::scope(|scope| -> Result<(), Error> {
        let background = scope.spawn(|| -> Result<(), Error> {
            let mut next = 1_000_000;
            while !stop.load(Ordering::Acquire) {
                writes.write(&warm, "parent-thread", next, 8)?;
                next += 8;
            }
            Ok(())
        });
        // The writer stops however this ends (a failed assertion included).
        let _stop = Stop(&stop);
        for round in 0..ROUNDS {
            match fork() {
                0 => exit_child(child_calls(&warm, &child_tokens)),
                pid => {
                    assert!(pid > 0, "fork failed");
                    writes.write(&warm, &format!("parent-{round}"), round * 100, 40)?;
                    assert_eq!(wait_child(pid), 0, "round {round}: a call in the child was not refused");
                }
            }
        }
        drop(_stop);
        background.join().expect("the parent's writer")
    })?;
    // A child that closes or drops its copy leaves the parent's handle, lock and file as they are.
    for round in 0..4u32 {
        match fork() {
            0 => {
                let closed = refused(warm.close());
                exit_child(if closed { 0 } else { 1 })
            }
            pid => {
                assert!(pid > 0, "fork failed");
                assert_eq!(wait_child(pid), 0, "close in the child was not refused");
                writes.write(&warm, &format!("after-close-{round}"), 50_000 + round * 100, 20)?;
            }
        }
    }
    assert_eq!(warm.stats()?.nodes.iter().filter(|n| n.name == "child").count(), 0, "the child wrote nothing");
    warm.close()?;
    let acked = writes.acked.into_inner().expect("acked");
    assert!(acked.len() > (ROUNDS as usize) * 40, "{} writes acknowledged", acked.len());
    check_file(&path, &acked)?;
    // Opened again as a head: cleanly closed (sealed), no recovery.
    let again = Warm::open(&path)?;
    assert_eq!(again.stats()?.recovered_from, None, "the file was closed cleanly");
    again.close()
}
