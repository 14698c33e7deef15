//! The one error type of the library.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use redb::{DatabaseError, StorageError};

/// Everything that can go wrong in `superfluid-warm`. Each message says what to do about it,
/// and the error underneath is its [`source`](std::error::Error::source). Cheap to clone (the
/// sources are shared), so that a failure can be both reported and kept.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Error {
    /// Another process (a head) has the index open for writing.
    AlreadyOpen {
        /// The index file.
        path: PathBuf,
    },
    /// The file was written by a newer `superfluid-warm` whose format this build does not know.
    NewerSchema {
        /// Schema version found in the file.
        found: u32,
        /// Newest schema version this build reads.
        supported: u32,
    },
    /// The file was written by a pre-release build in a schema that cannot be upgraded (its keys
    /// cannot be turned into this build's keys without the prompts).
    RetiredSchema {
        /// Schema version found in the file.
        found: u32,
    },
    /// The file holds a schema this build never wrote (not a superfluid-warm index, or a foreign
    /// hash scheme or block size).
    UnknownFormat {
        /// What was found.
        detail: String,
        /// What refused it underneath (redb, reading the file), if anything did.
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// A head is creating the file and has not finished making it an index: a reader that came
    /// too soon. Retry in a moment.
    BeingCreated {
        /// The file.
        path: PathBuf,
    },
    /// A head cannot write the index's folder or its side file (`<file>.seal`): a read-only disk
    /// or folder, or a file of another user. A head writes both; a [`crate::Reader`] reads the
    /// file without writing.
    NotWritable {
        /// The index file.
        path: PathBuf,
        /// Its side file.
        side: PathBuf,
        /// What the system said.
        source: Arc<std::io::Error>,
    },
    /// A [`crate::Prefix`] hashed in another scheme than the index file's (made by
    /// [`crate::Prefix::new`] or by another `Warm`): its keys could never match.
    ForeignPrefix {
        /// The prefix's hash scheme.
        prefix: &'static str,
        /// The file's.
        file: &'static str,
    },
    /// A 0.1.7 `warm.json` could not be read or parsed. The JSON file was not modified.
    LegacyJson {
        /// The JSON file.
        path: PathBuf,
        /// What is wrong with it.
        detail: String,
        /// The parser's error, for a file that is not valid JSON of that shape.
        source: Option<Arc<serde_json::Error>>,
    },
    /// A name (model, node or tenant) is empty or longer than its documented limit.
    InvalidName {
        /// Which kind of name.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A name (model or node) holds a NUL byte.
    NulInName {
        /// Which kind of name.
        what: &'static str,
        /// Where, in bytes.
        at: usize,
    },
    /// A builder setting is out of range.
    InvalidConfig {
        /// Which setting, and why.
        detail: String,
    },
    /// The file failed redb's integrity check or one of the index's own invariants.
    Corrupted {
        /// What was found.
        detail: String,
    },
    /// The side file (`<file>.seal`) says a head wrote the index file, but the index file is
    /// gone or empty: it was lost (deleted, truncated, or never restored with its seal). Nothing
    /// is created in its place.
    FileLost {
        /// The index file.
        path: PathBuf,
        /// What was found instead.
        detail: &'static str,
    },
    /// The file was left by a writer that did not close it and is no longer running.
    CrashedWriter {
        /// Process id of the writer that left it, where the file still says.
        pid: Option<u32>,
    },
    /// The storage underneath failed (I/O error, disk full, …). What was committed before the
    /// failure is still there; what the failed commit held was not made durable.
    Storage {
        /// What was being done.
        context: &'static str,
        /// The error redb reported.
        source: Arc<redb::Error>,
    },
    /// The commit thread's last commit failed and none has succeeded since: the call that reports
    /// it did nothing; the `ran`s before it are kept (answered) and retried, and what was
    /// committed before is intact. After an I/O error no retry can succeed through this handle
    /// ([`Error::needs_reopen`]).
    CommitFailed {
        /// The error of the failed commit.
        source: Box<Error>,
    },
    /// The commit thread could not be started.
    Thread {
        /// The error of the operating system.
        source: Arc<std::io::Error>,
    },
    /// An I/O error outside redb (reading a JSON file, a file's size, a side file).
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: Arc<std::io::Error>,
    },
    /// A cold record (meta, node, namespace) failed to encode or decode.
    Codec {
        /// Which record.
        record: &'static str,
        /// What went wrong (bincode's error, or trailing bytes).
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
    /// A thread using this index panicked while holding its lock; reopen the index.
    Poisoned,
    /// The handle was opened by another process: this one is a child made by `fork`, where the
    /// handle's threads do not run and its file belongs to the parent. The call did nothing, and
    /// nothing the parent holds was touched.
    Forked {
        /// The process that opened the handle.
        opened_by: u32,
        /// The process that called.
        used_by: u32,
    },
    /// A sharing head's own events are not yet all in the stream (the NATS server is
    /// unreachable, or slow): they stay buffered, answered locally, and are published when it
    /// answers again.
    #[non_exhaustive]
    Unpublished {
        /// Events still buffered.
        events: u64,
        /// How long the call waited.
        waited: std::time::Duration,
        /// What the head's link found wrong meanwhile (the server refusing connections, no
        /// JetStream on it, ...), if anything.
        reason: Option<String>,
    },
    /// An engine's KV cache event stream cannot be used: a batch that does not decode, or an
    /// endpoint ZMQ refuses (malformed, or it cannot be bound).
    Engine {
        /// What is wrong and what to do.
        detail: String,
        /// The decoder's or ZMQ's error underneath, if any.
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// A sharing head cannot go on applying the stream (its position was dropped by the
    /// stream's retention, the file is ahead of the stream, or a setting is refused).
    Sharing {
        /// What is wrong and what to do.
        detail: String,
        /// The NATS client's error underneath, if any.
        source: Option<Arc<dyn std::error::Error + Send + Sync>>,
    },
    /// A request's prompt cannot be rendered into the model's tokens (a chat template that fails
    /// or uses what this renderer does not run, content that is not text). The request can
    /// still be routed on load alone.
    Render {
        /// What could not be rendered, and why.
        detail: String,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::AlreadyOpen { path } => write!(
                f,
                "{} is already open for writing by another head; stop it, or read the file without writing it (a Reader, or the `ask` and `dump` commands)",
                path.display()
            ),
            Error::NewerSchema { found, supported } => write!(
                f,
                "the index has schema version {found}, newer than the {supported} this build reads; upgrade superfluid-warm"
            ),
            Error::RetiredSchema { found } => write!(
                f,
                "the index has schema version {found}, written by a pre-release build and not upgradable; \
                 move it aside and start a new index (import the 0.1.7 warm.json again if it came from one)"
            ),
            Error::BeingCreated { path } => write!(
                f,
                "{} is being created by a head that has not finished making it an index; retry in a moment",
                path.display()
            ),
            Error::NotWritable { path, side, source } => write!(
                f,
                "{} cannot be opened for writing: its side file {} cannot be written ({source}); a head writes \
                 the index and its side file in the same folder: make them writable, or read the index with a \
                 `Reader`",
                path.display(),
                side.display()
            ),
            Error::UnknownFormat { detail, .. } => write!(
                f,
                "not an index this build can open ({detail}); check the path, or start a new index in another file"
            ),
            Error::ForeignPrefix { prefix, file } => write!(
                f,
                "this prefix was hashed with {prefix} but the index file uses {file}; make it with this index's `prefix` (`ReadIndex::prefix`)"
            ),
            Error::LegacyJson { path, detail, source } => write!(
                f,
                "cannot import 0.1.7 file {}: {detail}{}; the file was left as it is, fix or remove it and retry",
                path.display(),
                source.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
            ),
            Error::InvalidName { what, len, max } => {
                if *len == 0 {
                    write!(f, "the {what} name is empty; give a name of 1 to {max} bytes")
                } else {
                    write!(f, "the {what} name is {len} bytes, over the limit of {max}; use a shorter name")
                }
            }
            Error::NulInName { what, at } => {
                write!(f, "the {what} name has a NUL byte at byte {at}; give a name without one")
            }
            Error::InvalidConfig { detail } => write!(f, "invalid setting: {detail}"),
            Error::Corrupted { detail } => write!(
                f,
                "the index file is corrupted ({detail}); restore it from a copy or start a new index (routing only gets colder)"
            ),
            Error::FileLost { path, detail } => write!(
                f,
                "{path} {detail}, but its side file {path}.seal says a head wrote it: the index was lost; \
                 restore it from a copy, or remove {path}.seal to start a new, empty index there",
                path = path.display(),
            ),
            Error::CrashedWriter { pid } => write!(
                f,
                "the index was left open by a writer{} that is no longer running; open it for writing (`Builder::open`) once to recover it",
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            ),
            Error::Storage { context, source } if latches(source) => write!(
                f,
                "storage failed while {context}: {source}; what was committed before is intact, and redb takes no \
                 more writes through this handle after an I/O error: reopen the index (the rans not yet committed \
                 are lost with the handle)"
            ),
            Error::Storage { context, source } => write!(
                f,
                "storage failed while {context}: {source}; what was committed before is intact, retry or reopen the index"
            ),
            Error::Unpublished { events, waited, reason } => write!(
                f,
                "{events} events of this head are not yet in the NATS stream after {waited:?} ({}); \
                 they stay buffered and answered here, and are published when it answers",
                reason.as_deref().unwrap_or("the server is slow to acknowledge them")
            ),
            Error::Engine { detail, .. } => write!(f, "engine events: {detail}"),
            Error::Render { detail } => {
                write!(f, "cannot render the prompt into the model's tokens: {detail} (route it on load alone)")
            }
            Error::Sharing { detail, source } => write!(
                f,
                "sharing through NATS: {detail}{}",
                source.as_ref().map(|e| format!(" ({e})")).unwrap_or_default()
            ),
            Error::CommitFailed { source } if source.needs_reopen() => write!(
                f,
                "the last background commit failed and none can succeed through this handle; this call did nothing ({source})"
            ),
            Error::CommitFailed { source } => write!(
                f,
                "the last background commit failed ({source}) and none has succeeded since; this call did nothing, the rans before it are kept and retried; check the disk, and reopen the index if it persists"
            ),
            Error::Thread { source } => {
                write!(
                    f,
                    "cannot start the commit thread: {source}; free some threads or memory, or use a zero sync window"
                )
            }
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Codec { record, source } => {
                write!(f, "the {record} record cannot be read ({source}); the file is damaged or from another program")
            }
            Error::Poisoned => {
                write!(f, "a thread panicked while holding the index lock; drop this handle and reopen the index")
            }
            Error::Forked { opened_by, used_by } => write!(
                f,
                "this handle was opened by process {opened_by} and cannot be used in process {used_by}, a fork of it; \
                 open the index in the child itself (a reader can read it while the parent writes), or fork before opening it"
            ),
        }
    }
}

impl Error {
    /// Whether this handle can write no more: redb refuses every write after an I/O error (a
    /// failed write or sync, a full disk) until the file is reopened, however the disk is doing
    /// since. Then drop the [`crate::Warm`] and open the file again: what was committed is there,
    /// the `ran`s not yet committed are lost with the handle.
    pub fn needs_reopen(&self) -> bool {
        match self {
            Error::Storage { source, .. } => latches(source),
            Error::CommitFailed { source } => source.needs_reopen(),
            _ => false,
        }
    }

    /// [`Error::Io`] on the file at `path`.
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Error {
        Error::Io { path: path.into(), source: Arc::new(source) }
    }

    /// [`Error::UnknownFormat`] with nothing underneath.
    pub(crate) fn unknown_format(detail: impl Into<String>) -> Error {
        Error::UnknownFormat { detail: detail.into(), source: None }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Storage { source, .. } => Some(source.as_ref()),
            Error::Io { source, .. } | Error::Thread { source } | Error::NotWritable { source, .. } => {
                Some(source.as_ref())
            }
            Error::CommitFailed { source } => Some(source.as_ref()),
            Error::Codec { source, .. } => Some(source.as_ref()),
            Error::UnknownFormat { source, .. } => source.as_deref().map(|e| e as &(dyn std::error::Error + 'static)),
            Error::LegacyJson { source, .. } => source.as_deref().map(|e| e as &(dyn std::error::Error + 'static)),
            Error::Sharing { source, .. } | Error::Engine { source, .. } => {
                source.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
            }
            _ => None,
        }
    }
}

/// Whether redb latches on `source`: after an I/O error of its backend (a file's, or a custom
/// backend's) it fails every later operation (`PreviousIo`) until the database is reopened.
fn latches(source: &redb::Error) -> bool {
    matches!(source, redb::Error::Io(_) | redb::Error::Backend(_) | redb::Error::PreviousIo)
}

fn classify(context: &'static str, source: redb::Error) -> Error {
    match source {
        redb::Error::Corrupted(detail) => Error::Corrupted { detail },
        redb::Error::UpgradeRequired(v) => Error::UnknownFormat {
            detail: format!("redb file format {v}, older than redb 4"),
            source: Some(Arc::new(redb::Error::UpgradeRequired(v))),
        },
        source => Error::Storage { context, source: Arc::new(source) },
    }
}

/// Turns any redb error into `Error`, sorting corruption from other storage failures.
pub(crate) fn redb_err<E: Into<redb::Error>>(context: &'static str) -> impl Fn(E) -> Error {
    move |e| classify(context, e.into())
}

/// Sorts the errors of opening the file at `path` into what a user can act on.
pub(crate) fn open_error(path: &Path, e: DatabaseError) -> Error {
    match e {
        DatabaseError::DatabaseAlreadyOpen => Error::AlreadyOpen { path: path.to_path_buf() },
        DatabaseError::Storage(StorageError::Io(io)) if io.kind() == std::io::ErrorKind::InvalidData => {
            Error::UnknownFormat { detail: format!("{}: not a redb file", path.display()), source: Some(Arc::new(io)) }
        }
        DatabaseError::Storage(StorageError::Io(io)) => Error::Io { path: path.to_path_buf(), source: Arc::new(io) },
        e => redb_err("opening the index")(e),
    }
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
