//! Every failure as a Python exception: a subclass of `superfluid_warm.WarmError` carrying the
//! Rust error's kind (its variant's name), message and `needs_reopen`. The classes, and which
//! kind raises which, are in `superfluid_warm/_errors.py`.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::exceptions::{PyOverflowError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use superfluid_warm::Error;

/// What went wrong in a call, turned into a Python exception attached to the interpreter.
#[derive(Debug)]
pub enum Failure {
    /// The library's error.
    Warm(Error),
    /// The index (or reader, or head) was closed.
    Closed(&'static str),
    /// A setting or argument the binding refuses before the library sees it (kind, message).
    Invalid(&'static str, String),
    /// A panic in Rust, caught before it reached Python.
    Panic(String),
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::Warm(e)
    }
}

pub type Result<T> = std::result::Result<T, Failure>;

/// The name of `e`'s variant: what `WarmError.kind` holds.
pub fn kind(e: &Error) -> &'static str {
    match e {
        Error::AlreadyOpen { .. } => "AlreadyOpen",
        Error::NewerSchema { .. } => "NewerSchema",
        Error::RetiredSchema { .. } => "RetiredSchema",
        Error::UnknownFormat { .. } => "UnknownFormat",
        Error::ForeignPrefix { .. } => "ForeignPrefix",
        Error::LegacyJson { .. } => "LegacyJson",
        Error::InvalidName { .. } => "InvalidName",
        Error::NulInName { .. } => "NulInName",
        Error::InvalidConfig { .. } => "InvalidConfig",
        Error::Corrupted { .. } => "Corrupted",
        Error::FileLost { .. } => "FileLost",
        Error::BeingCreated { .. } => "BeingCreated",
        Error::NotWritable { .. } => "NotWritable",
        Error::CrashedWriter { .. } => "CrashedWriter",
        Error::Storage { .. } => "Storage",
        Error::CommitFailed { .. } => "CommitFailed",
        Error::Thread { .. } => "Thread",
        Error::Io { .. } => "Io",
        Error::Codec { .. } => "Codec",
        Error::Poisoned => "Poisoned",
        Error::Forked { .. } => "Forked",
        Error::Unpublished { .. } => "Unpublished",
        Error::Engine { .. } => "Engine",
        Error::Sharing { .. } => "Sharing",
        // A variant added after this binding was written.
        _ => "Error",
    }
}

/// `superfluid_warm._errors._from_rust(kind, message, needs_reopen)`, once per interpreter.
static FROM_RUST: PyOnceLock<Py<PyAny>> = PyOnceLock::new();

impl Failure {
    /// The Python exception: `WarmError` or one of its subclasses (see `_errors.py`).
    pub fn into_py(self, py: Python<'_>) -> PyErr {
        let (kind, message, needs_reopen) = match self {
            Failure::Warm(e) => (kind(&e), e.to_string(), e.needs_reopen()),
            Failure::Closed(what) => ("Closed", format!("this {what} is closed; open the file again"), false),
            Failure::Invalid(kind, message) => (kind, message, false),
            Failure::Panic(message) => (
                "Panic",
                format!("superfluid-warm panicked ({message}): please report it; reopen the index to go on"),
                false,
            ),
        };
        let made = FROM_RUST
            .import(py, "superfluid_warm._errors", "_from_rust")
            .and_then(|from_rust| from_rust.call1((kind, message.as_str(), needs_reopen)));
        match made {
            Ok(exception) => PyErr::from_value(exception),
            // Only if the package's own module cannot be imported (a broken install).
            Err(e) => PyRuntimeError::new_err(format!("{kind}: {message} (and superfluid_warm._errors: {e})")),
        }
    }
}

/// Runs `f` (detached from the interpreter by the caller), a panic caught as [`Failure::Panic`].
pub fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| Err(Failure::Panic(panic_message(&*payload))))
}

fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}

/// Runs `f` with the interpreter released (other Python threads run meanwhile), panics caught,
/// and raises what it failed with.
pub fn detached<T: Send>(py: Python<'_>, f: impl FnOnce() -> Result<T> + Send) -> PyResult<T> {
    py.detach(|| guarded(f)).map_err(|e| e.into_py(py))
}

/// A Python int as an argument takes it: of any size, so that one out of range is refused by
/// the binding's or the library's check (an `InvalidInputError` saying the range), never by the
/// conversion (`OverflowError`). Beyond 128 bits it saturates, which is out of every range.
#[derive(Clone, Copy, Debug)]
pub struct Int(pub i128);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Int> {
        match obj.extract::<i128>() {
            Ok(v) => Ok(Int(v)),
            Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
                Ok(Int(if obj.gt(0)? { i128::MAX } else { i128::MIN }))
            }
            Err(e) => Err(e),
        }
    }
}

impl std::fmt::Display for Int {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            i128::MAX => f.write_str("over 2**127"),
            i128::MIN => f.write_str("under -2**127"),
            v => write!(f, "{v}"),
        }
    }
}

/// A count a setting takes: a negative one is refused as the library refuses one out of range;
/// one over `u64` is given as `u64::MAX`, which the library refuses with its own range.
pub fn count(what: &'static str, value: Int) -> Result<u64> {
    if value.0 < 0 {
        return Err(Failure::Invalid("InvalidConfig", format!("invalid setting: {what} {value} (at least 1)")));
    }
    Ok(u64::try_from(value.0).unwrap_or(u64::MAX))
}

/// A batch number (a message's second frame): 0 to 2**64 - 1.
pub fn seq(value: Int) -> Result<u64> {
    u64::try_from(value.0).map_err(|_| {
        Failure::Invalid("Engine", format!("engine events: batch number {value} is not one (0 to 2**64 - 1)"))
    })
}

/// Milliseconds as a duration: finite and not negative.
pub fn millis(what: &'static str, ms: f64) -> Result<std::time::Duration> {
    if !ms.is_finite() || ms < 0.0 {
        return Err(Failure::Invalid("InvalidConfig", format!("invalid setting: {what} {ms} ms (0 or more)")));
    }
    std::time::Duration::try_from_secs_f64(ms / 1000.0)
        .map_err(|e| Failure::Invalid("InvalidConfig", format!("invalid setting: {what} {ms} ms ({e})")))
}
