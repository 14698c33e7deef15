//! An index handle shared by Python threads: the Rust object behind a lock, taken out by
//! `close`, and every call made with the interpreter released. A handle belongs to the process
//! that opened it: in a child made by `fork` (`multiprocessing`'s default on Linux) every call
//! is refused before its lock is taken, and nothing of the parent's is closed or dropped.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{PoisonError, RwLock};

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedStr;
use pyo3::types::{PyBytes, PyString};
use superfluid_warm::{self as sw, Namespace, ReadIndex};

use crate::errors::{Failure, Result, detached};
use crate::records::{Hit, Prefix};
use crate::tokens::Tokens;

/// This process's id as of the last fork the interpreter made (`after_in_child`, registered by
/// the package's `__init__`) or handle opened: a handle opened in another process is a fork's
/// copy. Read by every call, without a system call; a fork the interpreter does not see (one
/// made in C) is still refused by the library's own check, after the handle's lock.
static PROCESS: AtomicU32 = AtomicU32::new(0);

/// Called in the child after every `os.fork`: registered by the module itself
/// (`os.register_at_fork(after_in_child=...)`), and not one of its names.
#[pyfunction]
pub fn after_fork_in_child() {
    PROCESS.store(std::process::id(), Ordering::Relaxed);
}

/// A Rust index (`Warm`, `Reader`, `SharedWarm`) shared by every Python thread: calls read it
/// under a shared lock, with the interpreter released; `close` takes it out under the exclusive
/// lock, once the calls in progress are done.
pub struct Handle<T> {
    inner: RwLock<Option<T>>,
    what: &'static str,
    /// The process that opened it.
    pid: u32,
}

impl<T: Send + Sync> Handle<T> {
    pub fn new(index: T, what: &'static str) -> Handle<T> {
        let pid = std::process::id();
        PROCESS.store(pid, Ordering::Relaxed);
        Handle { inner: RwLock::new(Some(index)), what, pid }
    }

    /// `Ok` in the process that opened the handle; the library's `Forked` in a fork's child,
    /// whose copy of the lock may be held forever by a thread that does not exist there.
    fn in_owner(&self) -> Result<()> {
        let here = PROCESS.load(Ordering::Relaxed);
        if here == self.pid {
            Ok(())
        } else {
            Err(Failure::Warm(sw::Error::Forked { opened_by: self.pid, used_by: here }))
        }
    }

    /// `f` on the index, the interpreter released; [`Failure::Closed`] once it is closed.
    pub fn with<R: Send>(&self, py: Python<'_>, f: impl FnOnce(&T) -> Result<R> + Send) -> PyResult<R> {
        detached(py, || {
            self.in_owner()?;
            // A panic is caught inside the lock's scope (and reported), so the lock is never
            // poisoned by this binding; the index has its own poisoning.
            let guard = self.inner.read().unwrap_or_else(PoisonError::into_inner);
            match guard.as_ref() {
                Some(index) => f(index),
                None => Err(Failure::Closed(self.what)),
            }
        })
    }

    /// Takes the index out and gives it to `close` (the interpreter released); nothing if it was
    /// closed already.
    pub fn close(&self, py: Python<'_>, close: impl FnOnce(T) -> Result<()> + Send) -> PyResult<()> {
        detached(py, || {
            self.in_owner()?;
            let taken = self.inner.write().unwrap_or_else(PoisonError::into_inner).take();
            match taken {
                Some(index) => close(index),
                None => Ok(()),
            }
        })
    }

    /// Closed, or a fork's copy (which can do nothing either).
    pub fn is_closed(&self) -> bool {
        self.in_owner().is_err() || self.inner.read().unwrap_or_else(PoisonError::into_inner).is_none()
    }
}

impl<T> Drop for Handle<T> {
    fn drop(&mut self) {
        if PROCESS.load(Ordering::Relaxed) != self.pid {
            // A fork's copy, collected in the child: the index is the parent's to close.
            let index = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner).take();
            std::mem::forget(index);
        }
    }
}

/// A tenant given as `str` (its UTF-8 bytes) or `bytes`.
pub fn tenant(obj: Option<&Bound<'_, PyAny>>) -> PyResult<Option<Vec<u8>>> {
    match obj {
        None => Ok(None),
        Some(o) if o.is_none() => Ok(None),
        Some(o) => {
            if let Ok(s) = o.cast::<PyString>() {
                return Ok(Some(s.to_cow()?.as_bytes().to_vec()));
            }
            if let Ok(b) = o.cast::<PyBytes>() {
                return Ok(Some(b.as_bytes().to_vec()));
            }
            Err(PyTypeError::new_err("tenant must be a str, bytes or None"))
        }
    }
}

/// The read side of every index (`ReadIndex`), with the arguments as Python gives them.
pub fn prefix_of<I: ReadIndex>(index: &I, model: &str, tokens: &[u32], tenant: Option<&[u8]>) -> Result<sw::Prefix> {
    Ok(index.prefix(&Namespace::of(model, tenant)?, tokens))
}

/// The question a head asks before it places a request, for any index: what may cross into
/// `Python::detach` (the tokens borrowed from their Python buffer, which outlives the call).
#[derive(Clone, Copy)]
pub struct Ask<'a> {
    pub model: &'a str,
    pub tokens: &'a [u32],
    pub tenant: Option<&'a [u8]>,
}

impl<'a> Ask<'a> {
    pub fn new(model: &'a PyBackedStr, tokens: &'a Tokens<'_>, tenant: &'a Option<Vec<u8>>) -> Ask<'a> {
        Ask { model, tokens: tokens.as_slice(), tenant: tenant.as_deref() }
    }

    pub fn prefix<I: ReadIndex>(&self, index: &I) -> Result<sw::Prefix> {
        prefix_of(index, self.model, self.tokens, self.tenant)
    }
}

/// `warmest` of any index.
pub fn warmest<I: ReadIndex + Send + Sync>(py: Python<'_>, handle: &Handle<I>, ask: Ask<'_>) -> PyResult<Option<Hit>> {
    let hit = handle.with(py, |index| Ok(index.warmest_prefix(&ask.prefix(index)?)?))?;
    Ok(hit.map(Hit::from))
}

/// `warm_nodes` of any index.
pub fn warm_nodes<I: ReadIndex + Send + Sync>(py: Python<'_>, handle: &Handle<I>, ask: Ask<'_>) -> PyResult<Vec<Hit>> {
    let hits = handle.with(py, |index| Ok(index.warm_nodes_prefix(&ask.prefix(index)?)?))?;
    Ok(hits.into_iter().map(Hit::from).collect())
}

/// `prefix` of any index.
pub fn prefix<I: ReadIndex + Send + Sync>(py: Python<'_>, handle: &Handle<I>, ask: Ask<'_>) -> PyResult<Prefix> {
    let inner = handle.with(py, |index| ask.prefix(index))?;
    Ok(Prefix { inner })
}

/// `warmest_prefix` of any index.
pub fn warmest_prefix<I: ReadIndex + Send + Sync>(
    py: Python<'_>,
    handle: &Handle<I>,
    prefix: &Prefix,
) -> PyResult<Option<Hit>> {
    let p = &prefix.inner;
    Ok(handle.with(py, |index| Ok(index.warmest_prefix(p)?))?.map(Hit::from))
}

/// `warm_nodes_prefix` of any index.
pub fn warm_nodes_prefix<I: ReadIndex + Send + Sync>(
    py: Python<'_>,
    handle: &Handle<I>,
    prefix: &Prefix,
) -> PyResult<Vec<Hit>> {
    let p = &prefix.inner;
    Ok(handle.with(py, |index| Ok(index.warm_nodes_prefix(p)?))?.into_iter().map(Hit::from).collect())
}
