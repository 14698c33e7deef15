//! Who has a file open: a head holds an exclusive lock on the file's side file
//! (`<file>.seal`) for as long as it has the file open; a reader that finds no head holds a
//! shared lock while it verifies the closed file, so that no head starts writing under it.
//! The operating system releases a lock when its process ends, however it ends, so a crashed
//! head never looks alive, and a reused process id means nothing.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::Path;
use std::time::{Duration, Instant};

use super::seal::seal_path;
use crate::error::{Error, Result};

/// Longest a head waits for readers that are verifying the closed file to finish.
const READERS_WAIT: Duration = Duration::from_secs(30);

/// The exclusive lock of the head that has a file open; released when dropped.
#[derive(Debug)]
pub(crate) struct HeadLock {
    side: File,
}

impl HeadLock {
    /// Takes the head's lock of the index file at `path`, creating its side file if absent.
    /// Waits while readers verify the closed file (at most [`READERS_WAIT`]).
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another head (in this process or another) has it;
    /// [`Error::Io`] if the side file cannot be opened or locked.
    pub(crate) fn acquire(path: &Path) -> Result<HeadLock> {
        let side_path = seal_path(path);
        let io = |source| Error::io(side_path.clone(), source);
        let side =
            OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&side_path).map_err(io)?;
        let started = Instant::now();
        loop {
            match side.try_lock() {
                Ok(()) => return Ok(HeadLock { side }),
                Err(TryLockError::Error(e)) => return Err(io(e)),
                Err(TryLockError::WouldBlock) => {}
            }
            // Held exclusively: a head. Held shared only: readers, who let go once verified.
            match side.try_lock_shared() {
                Err(TryLockError::WouldBlock) => return Err(Error::AlreadyOpen { path: path.to_path_buf() }),
                Err(TryLockError::Error(e)) => return Err(io(e)),
                Ok(()) => side.unlock().map_err(io)?,
            }
            if started.elapsed() > READERS_WAIT {
                return Err(Error::AlreadyOpen { path: path.to_path_buf() });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The side file, for the head to write its mark and, at a clean close, the seal.
    pub(crate) fn side_file(&self) -> &File {
        &self.side
    }
}

/// A reader's shared lock of a closed file's side file (none if it has no side file): while it
/// lives, the file stays closed.
#[derive(Debug)]
pub(crate) struct ReadGuard {
    _side: Option<File>,
}

/// `None` if a live head has the index file at `path` open (its contents are redb's own
/// writes); else a guard that keeps a head from opening it until dropped (the file is closed,
/// cleanly or not).
///
/// # Errors
/// [`Error::Io`] if the side file exists but cannot be read or locked.
pub(crate) fn no_head(path: &Path) -> Result<Option<ReadGuard>> {
    let side_path = seal_path(path);
    let io = |source| Error::io(side_path.clone(), source);
    let side = match File::open(&side_path) {
        Ok(side) => side,
        // No side file: no head ever opened this path (a copy, or a file from elsewhere).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(ReadGuard { _side: None })),
        Err(e) => return Err(io(e)),
    };
    match side.try_lock_shared() {
        Ok(()) => Ok(Some(ReadGuard { _side: Some(side) })),
        Err(TryLockError::WouldBlock) => Ok(None),
        Err(TryLockError::Error(e)) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_head_excludes_other_heads_and_readers_see_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("warm.redb");
        assert!(matches!(no_head(&path), Ok(Some(ReadGuard { _side: None }))), "no side file yet");
        let head = HeadLock::acquire(&path).expect("first head");
        assert!(matches!(HeadLock::acquire(&path), Err(Error::AlreadyOpen { .. })), "a second head is refused");
        assert!(matches!(no_head(&path), Ok(None)), "readers see the head");
        drop(head);
        let reader = no_head(&path).expect("no head");
        assert!(matches!(reader, Some(ReadGuard { _side: Some(_) })));
        // A reader verifying the closed file holds the head back; it goes once the reader is done.
        let waiting = std::thread::spawn({
            let path = path.clone();
            move || HeadLock::acquire(&path).map(drop)
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!waiting.is_finished(), "the head waits for the reader");
        drop(reader);
        assert!(waiting.join().expect("joined").is_ok(), "then opens");
    }
}
