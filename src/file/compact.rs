//! Compaction: giving a closed file's free pages back to the filesystem. redb reuses freed pages
//! but never shrinks the file, so after heavy churn it can be about twice its live data.

use std::path::Path;

use redb::ConcurrencyMode;

use super::lock::HeadLock;
use super::seal;
use crate::error::{Error, Result, open_error, redb_err};
use crate::store::schema;

/// What a compaction did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Compacted {
    /// File size before.
    pub bytes_before: u64,
    /// File size after.
    pub bytes_after: u64,
}

fn size(path: &Path) -> Result<u64> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|source| Error::io(path.to_path_buf(), source))
}

/// Compacts the index at `path`, which no head may have open. Its entries are unchanged; every
/// page is verified first, and the compacted file is sealed (see
/// [`crate::Builder::check_integrity_on_open`]).
///
/// # Errors
/// [`Error::AlreadyOpen`] while a head has it open; [`Error::Io`] if it does not exist;
/// [`Error::NewerSchema`], [`Error::RetiredSchema`] or [`Error::UnknownFormat`] for a file this
/// build does not write (left as it is); [`Error::Corrupted`]; [`Error::Storage`].
pub fn compact(path: impl AsRef<Path>) -> Result<Compacted> {
    let path = path.as_ref();
    let bytes_before = size(path)?;
    // Compacting writes the file: it is this file's head meanwhile.
    let lock = HeadLock::acquire(path)?;
    let mut db = redb::Builder::new()
        .set_concurrency_mode(ConcurrencyMode::SingleWriter)
        .set_check_integrity_on_open(true)
        .open(path)
        .map_err(|e| open_error(path, e))?;
    {
        let txn = db.begin_write().map_err(redb_err("starting the compaction"))?;
        let meta =
            schema::read_file_meta(&txn)?.ok_or_else(|| Error::unknown_format("an empty redb file, not an index"))?;
        schema::check(&meta)?;
        txn.abort().map_err(redb_err("starting the compaction"))?;
    }
    while db.compact().map_err(redb_err("compacting"))? {}
    db.close().map_err(redb_err("closing the compacted file"))?;
    // Verified on open and closed cleanly: the next open may trust it by its seal.
    let _ = seal::write_sealed(lock.side_file(), path);
    Ok(Compacted { bytes_before, bytes_after: size(path)? })
}
