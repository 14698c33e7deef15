//! `check_file`: everything that can be checked of an index file, in an order that never reads
//! a corrupted file through redb's tables and never writes the file.

use std::path::Path;

use super::snapshot::{Check, Snapshot};
use super::verify::{integrity_check_copy, recovered_copy};
use crate::error::{Error, Result};

/// What [`crate::IndexFile::check`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileCheck {
    /// The invariants of the tables; `None` when the tables were not walked (the file fails
    /// redb's page checksums).
    pub invariants: Option<Check>,
    /// redb's page checksums: `None` when not checked (a head has the file open, so a copy
    /// would not be a state redb ever left).
    pub integrity: Option<bool>,
    /// `Some` when the file was left open by a head that ended without closing it (with its
    /// process id where the file says), and was checked as a head would find it: on a recovered
    /// copy.
    pub crashed_writer: Option<Option<u32>>,
    /// Whether a running head's side file (`<file>.seal`, which holds its lock) was deleted:
    /// readers and other heads can no longer see that it has the file open.
    pub side_file_missing: bool,
}

impl FileCheck {
    /// Whether nothing is wrong: redb's integrity did not fail, every invariant holds, and the
    /// file needs no recovery.
    pub fn healthy(&self) -> bool {
        self.problems().is_empty()
    }

    /// Every problem found, each a sentence that says what to do: the page checksums, a crashed
    /// head's file (it needs recovery before a reader may read it), a running head's lost side
    /// file, then the invariants' problems.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.integrity == Some(false) {
            problems.push("the file fails redb's page checksums: restore it from a copy or start a new index".into());
        }
        if let Some(pid) = self.crashed_writer {
            problems.push(format!(
                "left open by a head{} that crashed: it needs recovery (to its last commit, which was checked on a copy) \
                 before it is read; open it with a head, or repair it with the command line's `check --repair`",
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            ));
        }
        if self.side_file_missing {
            problems.push(
                "the side file (<file>.seal) of the running head was deleted: readers and other heads cannot see \
                 that it has the file open; restart that head to recreate it"
                    .into(),
            );
        }
        problems.extend(self.invariants.iter().flat_map(|c| c.problems.iter().cloned()));
        problems
    }
}

/// [`super::index_file::IndexFile::check`] of the file at `path`.
///
/// # Errors
/// As that.
pub(crate) fn check_file(path: impl AsRef<Path>) -> Result<FileCheck> {
    let path = path.as_ref();
    let (snapshot, crashed, copy) = match Snapshot::open_even_if_crashed(path) {
        Ok(snapshot) => {
            let crashed = snapshot.crashed_writer().map(Some);
            (snapshot, crashed, None)
        }
        Err(Error::CrashedWriter { pid }) => {
            let copy = recovered_copy(path)?;
            (Snapshot::open_even_if_crashed(&copy)?, Some(pid), Some(copy))
        }
        // No head has it open and it fails verification: nothing of it is read.
        Err(Error::Corrupted { .. }) => {
            return Ok(FileCheck { invariants: None, integrity: Some(false), ..FileCheck::default() });
        }
        Err(e) => return Err(e),
    };
    // redb's check runs first: the invariants walk every table, which redb may not survive on a
    // corrupted file. Opening the snapshot may have run it already.
    let integrity = if snapshot.pages_verified() {
        Some(true)
    } else if !snapshot.head_live() || copy.is_some() {
        Some(integrity_check_copy(copy.as_deref().unwrap_or(path))?)
    } else {
        None
    };
    let invariants = if integrity == Some(false) { None } else { Some(snapshot.check()?) };
    Ok(FileCheck { invariants, integrity, crashed_writer: crashed, side_file_missing: snapshot.side_file_missing() })
}
