//! redb's own integrity check, run on temporary copies so that the file itself is never
//! repaired or written: for readers of a file no head has open, and for `check_file`.

use std::io::Write;
use std::path::Path;

use tempfile::{NamedTempFile, TempPath};

use crate::error::{Error, Result, open_error, redb_err};

/// A temporary copy of the file at `path`, removed when dropped.
fn copy_of(path: &Path, purpose: &str) -> Result<TempPath> {
    let io = |source| Error::io(path.to_path_buf(), source);
    let mut copy: NamedTempFile = tempfile::Builder::new()
        .prefix(&format!("superfluid-warm-{purpose}-"))
        .suffix(".redb")
        .tempfile()
        .map_err(io)?;
    let mut source = std::fs::File::open(path).map_err(io)?;
    std::io::copy(&mut source, copy.as_file_mut()).map_err(io)?;
    copy.as_file_mut().flush().map_err(io)?;
    Ok(copy.into_temp_path())
}

/// [`super::index_file::IndexFile::integrity_check_copy`] of the file at `path`.
///
/// # Errors
/// As that.
pub(crate) fn integrity_check_copy(path: &Path) -> Result<bool> {
    match check_copy(path) {
        Err(Error::UnknownFormat { .. }) => Ok(false),
        verdict => verdict,
    }
}

/// [`integrity_check_copy`], with a file redb does not recognise at all as
/// [`Error::UnknownFormat`].
pub(crate) fn check_copy(path: &Path) -> Result<bool> {
    let copy = copy_of(path, "check")?;
    match redb::Builder::new().set_check_integrity_on_open(true).open(&copy) {
        Ok(mut db) => match db.check_integrity() {
            Ok(ok) => Ok(ok),
            Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))) => Ok(false),
            Err(e) => Err(redb_err("checking integrity")(e)),
        },
        Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))) => Ok(false),
        // A file redb does not recognise is `UnknownFormat`, as when it is opened.
        Err(e @ redb::DatabaseError::Storage(redb::StorageError::Io(_))) => Err(open_error(path, e)),
        Err(e) => Err(redb_err("checking integrity")(e)),
    }
}

/// A copy of `path` recovered as a writer would recover it (redb's repair), so that a file left
/// by a crashed head can be checked without touching it. Removed when dropped.
///
/// # Errors
/// [`Error::Io`] if the copy cannot be made; [`Error::Corrupted`] or [`Error::Storage`] if it
/// cannot be recovered.
pub(crate) fn recovered_copy(path: &Path) -> Result<TempPath> {
    let copy = copy_of(path, "recover")?;
    let db = redb::Builder::new().open(&copy).map_err(|e| open_error(path, e))?;
    drop(db);
    Ok(copy)
}
