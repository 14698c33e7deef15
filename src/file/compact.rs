//! Compaction: giving a closed file's free pages back to the filesystem. redb reuses freed pages
//! but never shrinks the file, so after heavy churn it can be about twice its live data.

use std::path::Path;

use redb::ConcurrencyMode;

use super::lock::{HeadLock, retry_while_held};
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
    /// The process id of the head that had left the file open (it crashed, or was killed):
    /// opening it recovered it to that head's last commit before compacting.
    pub recovered_from: Option<u32>,
}

fn size(path: &Path) -> Result<u64> {
    std::fs::metadata(path).map(|m| m.len()).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => super::lock::no_index_file(path),
        _ => Error::io(path.to_path_buf(), source),
    })
}

/// [`super::index_file::IndexFile::compact`] of the file at `path`.
///
/// # Errors
/// As that.
pub(crate) fn compact(path: impl AsRef<Path>) -> Result<Compacted> {
    let path = path.as_ref();
    let bytes_before = size(path)?;
    // Compacting writes the file: it is this file's head meanwhile.
    let lock = HeadLock::acquire(path)?;
    let mut redb = redb::Builder::new();
    redb.set_concurrency_mode(ConcurrencyMode::SingleWriter).set_check_integrity_on_open(true);
    let mut db = retry_while_held(|| redb.open(path).map_err(|e| open_error(path, e)))?;
    let recovered_from = {
        let txn = db.begin_write().map_err(redb_err("starting the compaction"))?;
        let mut meta =
            schema::read_file_meta(&txn)?.ok_or_else(|| Error::unknown_format("an empty redb file, not an index"))?;
        schema::check(&meta)?;
        // A meta that names a writer, read while this holds the head's lock: it left the file
        // open, and redb's open has just recovered its last commit. The file is closed now.
        let recovered_from = meta.writer.take().map(|w| w.pid);
        if recovered_from.is_some() {
            schema::write_file_meta(&txn, &meta)?;
            txn.commit().map_err(redb_err("recording the recovery"))?;
        } else {
            txn.abort().map_err(redb_err("starting the compaction"))?;
        }
        recovered_from
    };
    while db.compact().map_err(redb_err("compacting"))? {}
    db.close().map_err(redb_err("closing the compacted file"))?;
    // Verified on open and closed cleanly: the next open may trust it by its seal.
    let _ = seal::write_sealed(lock.side_file(), path);
    Ok(Compacted { bytes_before, bytes_after: size(path)?, recovered_from })
}

/// The least free space, in bytes, that makes [`compact_if_sparse`] compact.
const SPARSE_MIN_FREE: u64 = 256 << 10;
/// The largest file [`compact_if_sparse`] measures (redb's count of pages in use walks every
/// tree: about 80 ms for 285 MB here).
const SPARSE_MAX_BYTES: u64 = 512 << 20;
/// The most pages in use, in bytes, [`compact_if_sparse`] moves: compaction runs at about the
/// speed of a durable write (a second for 100 MiB here), and a bigger file would hold the close
/// for seconds (use `compact`).
const SPARSE_MAX_USED: u64 = 128 << 20;

/// What [`compact_if_sparse`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compaction {
    /// Nothing to do: not sparse enough, or too big to compact on close.
    NotSparse,
    /// Nothing done although it was sparse: a reader holds a transaction, or it could not be
    /// read.
    Skipped,
    /// Compacted and closed cleanly.
    Compacted,
    /// A compaction or its close failed once it had begun: redb's two-phase commits leave a
    /// consistent file, but it must not be sealed (its next open checks every page).
    Failed,
}

/// Compacts the file at `path`, which its head (the caller, holding its lock) has just closed
/// cleanly, when at least a quarter of it and [`SPARSE_MIN_FREE`] bytes are free pages, at most
/// [`SPARSE_MAX_USED`] are in use and it is at most [`SPARSE_MAX_BYTES`] long. A head's group
/// commits leave the file several times its live data (redb reuses freed pages but never shrinks
/// the file), and the next open's seal check reads every byte.
pub(crate) fn compact_if_sparse(path: &Path) -> Compaction {
    let Ok(len) = size(path) else { return Compaction::Skipped };
    if !(2 * SPARSE_MIN_FREE..=SPARSE_MAX_BYTES).contains(&len) {
        return Compaction::NotSparse;
    }
    // The head verified this file at open and has just closed it: no check is needed again.
    let Ok(mut db) = redb::Builder::new()
        .set_concurrency_mode(ConcurrencyMode::SingleWriter)
        .set_check_integrity_on_open(false)
        .open(path)
    else {
        return Compaction::Failed;
    };
    let used = db.begin_write().ok().and_then(|txn| {
        let stats = txn.stats().ok();
        let _ = txn.abort();
        stats.map(|s| s.allocated_pages() * s.page_size() as u64)
    });
    let Some(used) = used else { return Compaction::Failed };
    let free = len.saturating_sub(used);
    if free < SPARSE_MIN_FREE || free < len / 4 || used > SPARSE_MAX_USED {
        return Compaction::NotSparse;
    }
    let mut compacted = false;
    loop {
        match db.compact() {
            Ok(true) => compacted = true,
            Ok(false) => break,
            // Refused before anything moved: a reader (in any process) holds a transaction.
            Err(redb::CompactionError::TransactionInProgress) if !compacted => return Compaction::Skipped,
            Err(_) => return Compaction::Failed,
        }
    }
    match (db.close(), compacted) {
        (Err(_), _) => Compaction::Failed,
        (Ok(()), true) => Compaction::Compacted,
        (Ok(()), false) => Compaction::NotSparse,
    }
}
