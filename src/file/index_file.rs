//! `IndexFile`: an index file named by its path, for what is done to the file as a whole (its
//! side file, a check, compaction, redb's integrity check on a copy).

use std::path::{Path, PathBuf};

use super::check::{FileCheck, check_file};
use super::compact::{Compacted, compact};
use super::seal::seal_path;
use super::verify::integrity_check_copy;
use crate::error::Result;

/// An index file at a path, open in a head or not: `IndexFile::new("warm.redb").check()?`.
/// Reading it is [`crate::Snapshot`]'s; writing it, [`crate::Warm`]'s.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexFile {
    path: PathBuf,
}

impl IndexFile {
    /// The index file at `path` (nothing is read until asked).
    pub fn new(path: impl Into<PathBuf>) -> IndexFile {
        IndexFile { path: path.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where its side file is kept: the same name with `.seal` appended. While a head has the
    /// file open, the side file holds its lock; after a clean close, the seal (a digest of the
    /// file). Copy it with the closed file to keep the next open fast; a file without its seal
    /// opens as safely, verified page by page.
    pub fn seal_path(&self) -> PathBuf {
        seal_path(&self.path)
    }

    /// Where a listener keeps its status ([`crate::ListenStatus`]): the same name with
    /// `.listen.json` appended.
    pub fn listen_status_path(&self) -> PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(".listen.json");
        PathBuf::from(name)
    }

    /// The status its listener last wrote ([`crate::ListenStatus::read`]), if there is one.
    ///
    /// # Errors
    /// As [`crate::ListenStatus::read`].
    pub fn listen_status(&self) -> Result<Option<crate::ListenStatus>> {
        crate::ListenStatus::read(self)
    }

    /// Checks the file without writing it: redb's integrity (on a copy, where no head has it
    /// open) and then, if that passed, the invariants ([`crate::Snapshot::check`]). A file left
    /// by a crashed head is checked on a recovered copy, and reported as needing recovery.
    ///
    /// # Errors
    /// [`crate::Error::Io`], [`crate::Error::UnknownFormat`], [`crate::Error::NewerSchema`],
    /// [`crate::Error::RetiredSchema`] or [`crate::Error::Storage`]: the file could not be
    /// checked at all. A corrupted file is a verdict, not an error.
    pub fn check(&self) -> Result<FileCheck> {
        check_file(&self.path)
    }

    /// Compacts the file, which no head may have open: its free pages go back to the
    /// filesystem, its entries are unchanged; every page is verified first, a file a crashed
    /// head left is recovered to its last commit ([`Compacted::recovered_from`]), and the
    /// compacted file is sealed (see [`crate::Builder::check_integrity_on_open`]).
    ///
    /// # Errors
    /// [`crate::Error::AlreadyOpen`] while a head has it open; [`crate::Error::Io`] if it does
    /// not exist or is not a regular file; [`crate::Error::NewerSchema`],
    /// [`crate::Error::RetiredSchema`] or [`crate::Error::UnknownFormat`] for a file this build
    /// does not write (left as it is); [`crate::Error::Corrupted`]; [`crate::Error::Storage`].
    pub fn compact(&self) -> Result<Compacted> {
        compact(&self.path)
    }

    /// Runs redb's full integrity check (every page checksum) on a copy of the file, so that the
    /// file itself is never repaired or written. `Ok(false)` for a corrupted file, or one redb
    /// does not recognise at all.
    ///
    /// # Errors
    /// [`crate::Error::Io`] if the copy cannot be made; [`crate::Error::Storage`].
    pub fn integrity_check_copy(&self) -> Result<bool> {
        integrity_check_copy(&self.path)
    }
}
