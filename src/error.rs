//! The one error type of the library.

use std::fmt;
use std::path::PathBuf;

/// Everything that can go wrong in `superfluid-warm`. Each message says what to do about it.
#[derive(Debug)]
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
        source: redb::Error,
    },
    /// The commit thread's last commit failed and none has succeeded since: the call that reports
    /// it did nothing; the `ran`s before it are kept (answered) and retried, and what was
    /// committed before is intact.
    CommitFailed {
        /// The error of the failed commit.
        detail: String,
    },
    /// A line of a request trace is not valid.
    Trace {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        detail: String,
    },
    /// An I/O error outside redb (reading a JSON file, a file's size).
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A cold record (meta, node, namespace) failed to encode or decode.
    Codec {
        /// Which record.
        record: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// A thread using this index panicked while holding its lock; reopen the index.
    Poisoned,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::AlreadyOpen { path } => write!(
                f,
                "{} is already open for writing by another head; stop it, or open the file read-only (dump, stats, check)",
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
            Error::UnknownFormat { detail } => write!(
                f,
                "not an index this build can open ({detail}); check the path, or start a new index in another file"
            ),
            Error::ForeignPrefix { prefix, file } => write!(
                f,
                "this prefix was hashed with {prefix} but the index file uses {file}; make it with this index's `Warm::prefix`"
            ),
            Error::LegacyJson { path, detail } => write!(
                f,
                "cannot import 0.1.7 file {}: {detail}; the file was left as it is, fix or remove it and retry",
                path.display()
            ),
            Error::InvalidName { what, len, max } => {
                if *len == 0 {
                    write!(f, "the {what} name is empty; give a name of 1 to {max} bytes")
                } else {
                    write!(f, "the {what} name is {len} bytes, over the limit of {max}; use a shorter name")
                }
            }
            Error::InvalidConfig { detail } => write!(f, "invalid setting: {detail}"),
            Error::Corrupted { detail } => write!(
                f,
                "the index file is corrupted ({detail}); restore it from a copy or start a new index (routing only gets colder)"
            ),
            Error::CrashedWriter { pid } => write!(
                f,
                "the index was left open by a writer{} that is no longer running; open it with the head (or `superfluid-warm check --repair`) to recover it first",
                pid.map(|p| format!(" (process {p})")).unwrap_or_default()
            ),
            Error::Storage { context, source } => write!(
                f,
                "storage failed while {context}: {source}; what was committed before is intact, retry or reopen the index"
            ),
            Error::CommitFailed { detail } => write!(
                f,
                "the last background commit failed ({detail}) and none has succeeded since; this call did nothing, the rans before it are kept and retried; check the disk, and reopen the index if it persists"
            ),
            Error::Trace { line, detail } => {
                write!(f, "trace line {line}: {detail}; each line must be a Mooncake request object")
            }
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Codec { record, detail } => {
                write!(f, "the {record} record cannot be read ({detail}); the file is damaged or from another program")
            }
            Error::Poisoned => {
                write!(f, "a thread panicked while holding the index lock; drop this handle and reopen the index")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Storage { source, .. } => Some(source),
            Error::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

fn classify(context: &'static str, source: redb::Error) -> Error {
    match source {
        redb::Error::Corrupted(detail) => Error::Corrupted { detail },
        redb::Error::UpgradeRequired(v) => {
            Error::UnknownFormat { detail: format!("redb file format {v}, older than redb 4") }
        }
        source => Error::Storage { context, source },
    }
}

/// Turns any redb error into `Error`, sorting corruption from other storage failures.
pub(crate) fn redb_err<E: Into<redb::Error>>(context: &'static str) -> impl Fn(E) -> Error {
    move |e| classify(context, e.into())
}

/// The result type of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
