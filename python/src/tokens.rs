//! Token ids from Python: a `list[int]` (or any sequence of ints), copied; or, without copying,
//! anything that exports a buffer of C-contiguous `uint32` (numpy, `array('I')`).

use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyList, PyString, PyTuple};

use crate::buffer::{Refused, U32Buffer};

/// A prompt's token ids, owned or borrowed from a Python buffer (released when this drops,
/// attached to the interpreter). `as_slice` may cross into `Python::detach`.
pub enum Tokens<'py> {
    /// Converted from a sequence of ints.
    Owned(Vec<u32>),
    /// Read in place.
    Borrowed(U32Buffer<'py>),
}

impl Tokens<'_> {
    /// The token ids.
    pub fn as_slice(&self) -> &[u32] {
        match self {
            Tokens::Owned(v) => v,
            Tokens::Borrowed(b) => b.as_slice(),
        }
    }
}

const EXPECTED: &str = "tokens must be a list (or sequence) of ints in 0..2**32, or a C-contiguous 1-D buffer of \
    uint32 (numpy.uint32, array('I'))";

/// Reads `obj` as token ids.
///
/// # Errors
/// `TypeError` for anything else than a sequence of ints or a uint32 buffer (a buffer of another
/// format is named in the message, with what to do); `ValueError` for an int outside 0..2**32.
pub fn tokens<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Tokens<'py>> {
    // The common case first: a list, read item by item.
    if let Ok(list) = obj.cast::<PyList>() {
        return ints(list.iter().enumerate(), list.len()).map(Tokens::Owned);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return ints(tuple.iter().enumerate(), tuple.len()).map(Tokens::Owned);
    }
    // bytes are a sequence of ints and a buffer of "B": neither is what a caller meant.
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyByteArray>() || obj.is_instance_of::<PyString>() {
        let kind = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
        return Err(PyTypeError::new_err(format!("{EXPECTED}; got {kind}")));
    }
    match U32Buffer::borrow(obj) {
        Ok(buffer) => Ok(Tokens::Borrowed(buffer)),
        Err(Refused::Wrong(what)) => Err(PyTypeError::new_err(format!(
            "{EXPECTED}; got {what}: convert it first, e.g. numpy.ascontiguousarray(tokens, dtype=numpy.uint32)"
        ))),
        Err(Refused::NotABuffer) => {
            // Any other iterable of ints (a range, a generator, a numpy-free sequence).
            let iter = obj.try_iter().map_err(|_| {
                let kind = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
                PyTypeError::new_err(format!("{EXPECTED}; got {kind}"))
            })?;
            let items: Vec<Bound<'py, PyAny>> = iter.collect::<PyResult<_>>()?;
            let len = items.len();
            ints(items.into_iter().enumerate(), len).map(Tokens::Owned)
        }
    }
}

/// Each item as a u32.
fn ints<'py>(items: impl Iterator<Item = (usize, Bound<'py, PyAny>)>, len: usize) -> PyResult<Vec<u32>> {
    let mut out = Vec::with_capacity(len);
    for (i, item) in items {
        match item.extract::<u32>() {
            Ok(t) => out.push(t),
            Err(e) => return Err(bad_item(i, &item, &e)),
        }
    }
    Ok(out)
}

/// The error for item `i`: a ValueError for an int out of range (the conversion overflowed), a
/// TypeError otherwise.
fn bad_item(i: usize, item: &Bound<'_, PyAny>, e: &PyErr) -> PyErr {
    if e.is_instance_of::<PyOverflowError>(item.py()) {
        return PyValueError::new_err(format!("tokens[{i}] = {item} is not a token id (0 to 4294967295)"));
    }
    let kind = item.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    PyTypeError::new_err(format!("tokens[{i}] is a {kind}, not an int; {EXPECTED}"))
}
