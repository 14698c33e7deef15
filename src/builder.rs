//! `Builder`: the settings of a `Warm`, and opening one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use redb::{ConcurrencyMode, Database, DatabaseError, StorageError};

use crate::error::{Error, Result, redb_err};
use crate::legacy;
use crate::schema;
use crate::seal;
use crate::state::State;
use crate::warm::{OpenCheck, Warm};

/// Entries (blocks) kept by default: 2^20, 64 Mi tokens of prefixes.
pub const DEFAULT_CAPACITY: u64 = 1 << 20;
/// Page cache of the file by default.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;
/// Longest a `ran` waits to be made durable by default. With a commit's ~4 ms of fsync on top,
/// at most ~54 ms of `ran`s are lost on power loss.
pub const DEFAULT_SYNC_WINDOW: Duration = Duration::from_millis(50);
/// Most entries a file may be set to keep.
pub const MAX_CAPACITY: u64 = 1 << 40;

/// The settings of a [`Warm`]: `Warm::builder().capacity(1 << 16).open(path)`.
#[derive(Clone, Debug)]
pub struct Builder {
    capacity: Option<u64>,
    cache_bytes: usize,
    sync_window: Duration,
    check_integrity: bool,
    import: Option<PathBuf>,
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

impl Builder {
    /// The defaults: the file's capacity ([`DEFAULT_CAPACITY`] for a new file),
    /// [`DEFAULT_CACHE_BYTES`], [`DEFAULT_SYNC_WINDOW`], integrity checked on open.
    pub fn new() -> Builder {
        Builder {
            capacity: None,
            cache_bytes: DEFAULT_CACHE_BYTES,
            sync_window: DEFAULT_SYNC_WINDOW,
            check_integrity: true,
            import: None,
        }
    }

    /// Most entries (blocks) kept; past it the oldest eighth is evicted. 1 to [`MAX_CAPACITY`].
    /// Unset, an existing file keeps the capacity it has and a new one gets [`DEFAULT_CAPACITY`];
    /// set, it is recorded in the file (a smaller one evicts on open).
    pub fn capacity(&mut self, blocks: u64) -> &mut Self {
        self.capacity = Some(blocks);
        self
    }

    /// Bytes of the file kept in memory.
    pub fn cache_size(&mut self, bytes: usize) -> &mut Self {
        self.cache_bytes = bytes;
        self
    }

    /// Longest a `ran` waits before a background commit makes it durable (group commit).
    /// `Duration::ZERO` commits every `ran` before it returns. At most 60 s.
    pub fn sync_window(&mut self, window: Duration) -> &mut Self {
        self.sync_window = window;
        self
    }

    /// Whether the writer verifies the file when it opens it (default on: a bit-flipped file is
    /// refused with [`Error::Corrupted`] instead of answering wrongly or panicking in redb). A file
    /// whose seal (a digest of the whole file written beside it, `<file>.seal`, at its last clean
    /// close) matches is verified by that digest; any other by redb, page by page. Off, neither
    /// runs: only for storage that checksums itself.
    pub fn check_integrity_on_open(&mut self, check: bool) -> &mut Self {
        self.check_integrity = check;
        self
    }

    /// A 0.1.7 `warm.json` to import on open (once: the same file again is skipped).
    pub fn import_json(&mut self, path: impl Into<PathBuf>) -> &mut Self {
        self.import = Some(path.into());
        self
    }

    fn redb(&self, mode: ConcurrencyMode, check: bool) -> redb::Builder {
        let mut builder = redb::Builder::new();
        builder.set_cache_size(self.cache_bytes).set_concurrency_mode(mode).set_check_integrity_on_open(check);
        builder
    }

    fn validate(&self) -> Result<()> {
        if let Some(c) = self.capacity.filter(|&c| c == 0 || c > MAX_CAPACITY) {
            return Err(Error::InvalidConfig { detail: format!("capacity {c} (1 to {MAX_CAPACITY})") });
        }
        if self.sync_window > Duration::from_secs(60) {
            return Err(Error::InvalidConfig { detail: format!("sync window {:?} (at most 60 s)", self.sync_window) });
        }
        Ok(())
    }

    /// Opens the index at `path`, creating it if absent, in redb's single-writer mode: read-only
    /// processes (`superfluid-warm dump`) may read it meanwhile. A file left by a crash is
    /// recovered to its last commit.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another head has it open; [`Error::NewerSchema`] or
    /// [`Error::UnknownFormat`] for a file this build does not write; [`Error::Corrupted`] if it
    /// fails the integrity check; [`Error::LegacyJson`] for a bad import file (the index is not
    /// touched); [`Error::InvalidConfig`]; [`Error::Storage`].
    pub fn open(&self, path: impl AsRef<Path>) -> Result<Warm> {
        let path = path.as_ref();
        self.validate()?;
        let legacy = self.import.as_deref().map(legacy::read).transpose()?;
        let check = if !self.check_integrity {
            OpenCheck::Skipped
        } else if seal::matches(path) {
            OpenCheck::Seal
        } else {
            OpenCheck::Pages
        };
        let db = self
            .redb(ConcurrencyMode::SingleWriter, check == OpenCheck::Pages)
            .create(path)
            .map_err(|e| open_error(path, e))?;
        let warm = self.start(db, legacy, check, Some(path))?;
        // The seal no longer describes the file: readers learn a head writes it. Only now, so
        // that a refused file (a newer schema, say) keeps its side file as it was.
        seal::mark_open(path);
        Ok(warm)
    }

    /// Opens the index on a custom redb storage backend (for fault injection and in-memory use),
    /// in redb's exclusive-writer mode.
    ///
    /// # Errors
    /// As [`Builder::open`].
    pub fn open_with_backend(&self, backend: impl redb::StorageBackend) -> Result<Warm> {
        self.validate()?;
        let legacy = self.import.as_deref().map(legacy::read).transpose()?;
        let check = if self.check_integrity { OpenCheck::Pages } else { OpenCheck::Skipped };
        let db = self
            .redb(ConcurrencyMode::ExclusiveWriter, self.check_integrity)
            .create_with_backend(backend)
            .map_err(|e| open_error(Path::new("<backend>"), e))?;
        self.start(db, legacy, check, None)
    }

    fn start(
        &self,
        db: Database,
        legacy: Option<legacy::LegacyFile>,
        check: OpenCheck,
        path: Option<&Path>,
    ) -> Result<Warm> {
        let scheme = schema::prepare(&db, self.capacity)?;
        let mut state = State::load(&db)?;
        if let Err(e) = state.evict(&db) {
            return Err(state.lose(&db, e).error);
        }
        state.commit(&db, false).map_err(|lost| lost.error)?;
        if let Some(file) = &legacy {
            state.import(&db, file)?;
            state.commit(&db, false).map_err(|lost| lost.error)?;
        }
        Warm::start(db, state, self.sync_window, check, scheme, path.map(Path::to_path_buf))
    }
}

/// Sorts the errors of opening a file into what a user can act on.
pub(crate) fn open_error(path: &Path, e: DatabaseError) -> Error {
    match e {
        DatabaseError::DatabaseAlreadyOpen => Error::AlreadyOpen { path: path.to_path_buf() },
        DatabaseError::Storage(StorageError::Io(io)) if io.kind() == std::io::ErrorKind::InvalidData => {
            Error::UnknownFormat { detail: format!("{}: {io}", path.display()) }
        }
        DatabaseError::Storage(StorageError::Io(io)) => Error::Io { path: path.to_path_buf(), source: io },
        e => redb_err("opening the index")(e),
    }
}
