//! Who has a file open: a head holds an exclusive lock on the file's side file
//! (`<file>.seal`) for as long as it has the file open; a reader that finds no head holds a
//! shared lock while it verifies the closed file, so that no head starts writing under it.
//! The operating system releases a lock when its process ends, however it ends, so a crashed
//! head never looks alive, and a reused process id means nothing while the side file is there.
//! Only a file without one has its writer's process id consulted ([`process_has_open`]): a
//! deleted side file takes its head's lock out of sight.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::seal::{self, seal_path};
use crate::error::{Error, Result};

/// Longest a head waits for readers that are verifying the closed file to finish.
const READERS_WAIT: Duration = Duration::from_secs(30);
/// Longest a head retries a lock that is held exclusively before it reports the file open
/// elsewhere. A lock is held by an open file description, which a child process forked by any
/// thread of this process shares until it execs (`O_CLOEXEC`): a head closed while another
/// thread spawns a process can find its own lock, or redb's, still held for a few milliseconds
/// (much longer on a loaded machine). A real second head holds it for good.
pub(crate) const HELD_RETRY: Duration = Duration::from_secs(2);

/// The exclusive lock of the head that has a file open; released when dropped.
#[derive(Debug)]
pub(crate) struct HeadLock {
    side: File,
    /// The side file's path, if this lock created it (and then took it): dropped while still
    /// empty (the head never marked the file, so its open failed), it is removed, so that a failed
    /// command leaves no side file behind.
    created: Option<PathBuf>,
}

impl HeadLock {
    /// Takes the head's lock of the index file at `path`, creating its side file if absent.
    /// Waits while readers verify the closed file (at most [`READERS_WAIT`]).
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another head (in this process or another) has it;
    /// [`Error::FileLost`] if the side file says a head wrote the file but it is missing or
    /// empty; [`Error::NotWritable`] if the system will not let this process write the side
    /// file; [`Error::Io`] if `path` is not a regular file, its folder does not exist, or the
    /// side file cannot be opened or locked.
    pub(crate) fn acquire(path: &Path) -> Result<HeadLock> {
        let side_path = seal_path(path);
        if std::fs::metadata(path).is_ok_and(|meta| !meta.is_file()) {
            return Err(not_a_file(path));
        }
        let io = |source| Error::io(side_path.clone(), source);
        let open = |create_new: bool| {
            let mut options = OpenOptions::new();
            options.read(true).write(true);
            if create_new {
                options.create_new(true)
            } else {
                options.create(true).truncate(false)
            };
            options.open(&side_path)
        };
        // Made here, or found: only the process that made it may remove it (once it holds it).
        let (side, made) = match open(true) {
            Ok(side) => (side, true),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                (open(false).map_err(|e| cannot_write(path, &side_path, e))?, false)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(no_folder(path, e)),
            Err(e) => return Err(cannot_write(path, &side_path, e)),
        };
        let mut lock = HeadLock { side, created: None };
        let started = Instant::now();
        loop {
            match lock.side.try_lock() {
                Ok(()) => break,
                Err(TryLockError::Error(e)) => return Err(io(e)),
                Err(TryLockError::WouldBlock) => {}
            }
            // Held exclusively: a head. Held shared only: readers, who let go once verified.
            let limit = match lock.side.try_lock_shared() {
                Err(TryLockError::WouldBlock) => HELD_RETRY,
                Err(TryLockError::Error(e)) => return Err(io(e)),
                Ok(()) => {
                    lock.side.unlock().map_err(io)?;
                    READERS_WAIT
                }
            };
            if started.elapsed() > limit {
                return Err(Error::AlreadyOpen { path: path.to_path_buf() });
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        lock.created = made.then_some(side_path);
        // A side file that says a head wrote the file, beside no file or an empty one (looked at
        // now that no other head can be writing it): the file was lost. A new index there would
        // silently start cold.
        let index = std::fs::metadata(path);
        if index.as_ref().map_or(true, |meta| meta.len() == 0) && seal::claims_a_file(&lock.side) {
            let detail = if index.is_ok() { "is empty" } else { "does not exist" };
            return Err(Error::FileLost { path: path.to_path_buf(), detail });
        }
        Ok(lock)
    }

    /// The side file, for the head to write its mark and, at a clean close, the seal.
    pub(crate) fn side_file(&self) -> &File {
        &self.side
    }
}

impl Drop for HeadLock {
    fn drop(&mut self) {
        // Still locked: no other head can be using the side file being removed.
        if let Some(side_path) = &self.created
            && self.side.metadata().is_ok_and(|m| m.len() == 0)
        {
            let _ = std::fs::remove_file(side_path);
        }
    }
}

/// Runs `attempt` (an open of the file by redb, whose own locks are open file descriptions too)
/// again while it fails with [`Error::AlreadyOpen`], for at most [`HELD_RETRY`].
///
/// # Errors
/// `attempt`'s last error.
pub(crate) fn retry_while_held<T>(mut attempt: impl FnMut() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    loop {
        match attempt() {
            Err(Error::AlreadyOpen { .. }) if started.elapsed() < HELD_RETRY => {
                std::thread::sleep(Duration::from_millis(5));
            }
            done => return done,
        }
    }
}

/// `path` exists but is not a regular file (a folder, a fifo, a device).
pub(crate) fn not_a_file(path: &Path) -> Error {
    let detail = "not a regular file (an index is one; give the path of a file, or of one to create)";
    Error::io(path, std::io::Error::new(std::io::ErrorKind::InvalidInput, detail))
}

/// No file at `path` (for the commands that read or change an existing index).
pub(crate) fn no_index_file(path: &Path) -> Error {
    Error::io(path, std::io::Error::new(std::io::ErrorKind::NotFound, "no index file here"))
}

/// The folder that would hold `path` does not exist.
fn no_folder(path: &Path, e: std::io::Error) -> Error {
    Error::io(path, std::io::Error::new(e.kind(), "its folder does not exist"))
}

/// A reader's shared lock of a closed file's side file (none if it has no side file): while it
/// lives, the file stays closed.
#[derive(Debug)]
pub(crate) struct ReadGuard {
    side: Option<File>,
}

impl ReadGuard {
    /// Whether the file has a side file (no side file: no head ever opened it, or its side
    /// file was deleted).
    pub(crate) fn has_side_file(&self) -> bool {
        self.side.is_some()
    }
}

/// Whether process `pid` has the file at `path` open (one of its descriptors is that very
/// file, by device and inode), where the system says (Linux's `/proc`, readable for the
/// process's user); elsewhere `false`, as before this was asked. Only consulted where the lock
/// cannot answer (the side file is gone): a copy of a file, or one a process of a reused id has
/// no descriptor of, is never taken for a live head's.
pub(crate) fn process_has_open(pid: u32, path: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::MetadataExt;
        if pid == std::process::id() {
            // A head of this process (this reader has the file open too, so its descriptors say
            // nothing): this process is running.
            return true;
        }
        let Ok(file) = std::fs::metadata(path) else { return false };
        let Ok(fds) = std::fs::read_dir(Path::new("/proc").join(pid.to_string()).join("fd")) else { return false };
        fds.flatten()
            .any(|fd| std::fs::metadata(fd.path()).is_ok_and(|m| m.dev() == file.dev() && m.ino() == file.ino()))
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (pid, path);
        false
    }
}

/// `None` if a live head has the index file at `path` open (its contents are redb's own
/// writes); else a guard that keeps a head from opening it until dropped (the file is closed,
/// cleanly or not).
///
/// # Errors
/// [`Error::NotWritable`] for a side file the system will not let this process write (a
/// read-only disk or folder, another user's file); [`Error::Io`] for any other failure.
fn cannot_write(path: &Path, side: &Path, e: std::io::Error) -> Error {
    match e.kind() {
        std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::ReadOnlyFilesystem => {
            Error::NotWritable { path: path.to_path_buf(), side: side.to_path_buf(), source: std::sync::Arc::new(e) }
        }
        _ => Error::io(side.to_path_buf(), e),
    }
}

/// [`Error::Io`] if the side file exists but cannot be read or locked.
pub(crate) fn no_head(path: &Path) -> Result<Option<ReadGuard>> {
    let side_path = seal_path(path);
    let io = |source| Error::io(side_path.clone(), source);
    let side = match File::open(&side_path) {
        Ok(side) => side,
        // No side file: no head ever opened this path (a copy, or a file from elsewhere).
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Some(ReadGuard { side: None })),
        Err(e) => return Err(io(e)),
    };
    match side.try_lock_shared() {
        Ok(()) => Ok(Some(ReadGuard { side: Some(side) })),
        Err(TryLockError::WouldBlock) => Ok(None),
        Err(TryLockError::Error(e)) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    /// A side file the system refuses (a read-only disk, another user's folder) is named with
    /// the index, and says what a head needs and how to read it instead.
    #[test]
    fn a_side_file_that_cannot_be_written_names_the_index_too() {
        let (path, side) = (Path::new("/data/warm.redb"), Path::new("/data/warm.redb.seal"));
        for kind in [std::io::ErrorKind::PermissionDenied, std::io::ErrorKind::ReadOnlyFilesystem] {
            let e = cannot_write(path, side, std::io::Error::from(kind));
            let message = e.to_string();
            assert!(matches!(e, Error::NotWritable { .. }), "{kind:?}: {e:?}");
            assert!(message.starts_with("/data/warm.redb cannot be opened for writing"), "{message}");
            assert!(message.contains("/data/warm.redb.seal") && message.contains("Reader"), "{message}");
        }
        let other = cannot_write(path, side, std::io::Error::from(std::io::ErrorKind::Interrupted));
        assert!(matches!(other, Error::Io { .. }), "{other:?}");
        // Where the system refuses even root (sysfs), a head's open says so.
        if Path::new("/sys/kernel").is_dir() {
            let refused = HeadLock::acquire(Path::new("/sys/superfluid-warm-test.redb"));
            assert!(matches!(refused, Err(Error::NotWritable { .. })), "{:?}", refused.err());
        }
    }

    #[test]
    fn a_head_excludes_other_heads_and_readers_see_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("warm.redb");
        assert!(matches!(no_head(&path), Ok(Some(ReadGuard { side: None }))), "no side file yet");
        let head = HeadLock::acquire(&path).expect("first head");
        assert!(matches!(HeadLock::acquire(&path), Err(Error::AlreadyOpen { .. })), "a second head is refused");
        assert!(matches!(no_head(&path), Ok(None)), "readers see the head");
        // A head that marked its file (and wrote it) keeps the side file it created.
        seal::write_open(head.side_file());
        std::fs::write(&path, b"an index").expect("the head's file");
        drop(head);
        let reader = no_head(&path).expect("no head");
        assert!(matches!(reader, Some(ReadGuard { side: Some(_) })));
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

    #[test]
    fn a_side_file_made_by_a_head_that_never_marked_it_is_removed_and_no_other() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("warm.redb");
        drop(HeadLock::acquire(&path).expect("a head"));
        assert!(!seal_path(&path).exists(), "an open that failed leaves no side file");
        std::fs::write(seal_path(&path), b"").expect("an empty side file of someone else's");
        drop(HeadLock::acquire(&path).expect("a head"));
        assert!(seal_path(&path).exists(), "one it did not create is kept");
    }
}
