//! The one module with `unsafe` code: borrowing a Python buffer of `uint32` token ids (a numpy
//! `uint32` array, an `array('I')`) as a `&[u32]` without copying it.
//!
//! Why not PyO3's `PyBuffer`: it is compiled only for `any(Py_3_11, not(Py_LIMITED_API))`, and
//! this module is built for the stable ABI of CPython 3.9 (one abi3 wheel for every version).
//! `PyObject_GetBuffer` and `PyBuffer_Release` have been exported by every CPython 3.x, and the
//! layout of `Py_buffer` has not changed since 3.3 (3.11 froze it into the stable ABI as it
//! was), so this module declares them itself. On Linux and macOS an extension module's
//! undefined symbols are resolved against the running interpreter, so this links against
//! whatever CPython >= 3.9 loads it. (Windows' `python3.dll` exports these two only from 3.11 on:
//! there the buffer is read through `memoryview` and copied instead.) CPython only: PyPy's
//! exports have other names (and maturin builds abi3 wheels for CPython alone).
//!
//! The contract kept here:
//! - the buffer is requested with `PyBUF_FORMAT | PyBUF_ND`: C-contiguous (an exporter that
//!   cannot give that fails the request), with its format and shape, read-only access;
//! - a view is accepted only as one dimension of 4-byte unsigned integers in native byte order
//!   (`I`, `=I`, `<I` on a little-endian machine, `@I`, and the same with `L` when it is 4 bytes);
//! - the view is released (`PyBuffer_Release`) exactly once, when the guard drops, which is
//!   always attached to the interpreter: the guard holds a `Python<'py>` token, which cannot be
//!   sent into `Python::detach`; the `&[u32]` it lends can, and the exporter keeps the memory
//!   alive and unresized while a view is held (numpy refuses to resize, `array` raises
//!   `BufferError`), whether or not this thread holds the GIL;
//! - the Rust side only reads the tokens. Another Python thread writing into the same array
//!   while a call reads it is a data race, as for any extension that releases the GIL while it
//!   reads an array (numpy's own functions included): the package documents that a token array
//!   must not be written during a call.

#![allow(unsafe_code)]

use pyo3::prelude::*;

#[cfg(not(windows))]
mod ffi {
    use std::os::raw::{c_char, c_int, c_void};

    use pyo3::ffi::{Py_ssize_t, PyObject};

    /// CPython's `Py_buffer`, as `Include/pybuffer.h` (3.11+) and `Include/object.h` (3.3 to
    /// 3.10) define it: unchanged since 3.3.
    #[repr(C)]
    pub struct PyBufferView {
        pub buf: *mut c_void,
        pub obj: *mut PyObject,
        pub len: Py_ssize_t,
        pub itemsize: Py_ssize_t,
        pub readonly: c_int,
        pub ndim: c_int,
        pub format: *mut c_char,
        pub shape: *mut Py_ssize_t,
        pub strides: *mut Py_ssize_t,
        pub suboffsets: *mut Py_ssize_t,
        pub internal: *mut c_void,
    }

    /// `PyBUF_ND`: the exporter fills `shape`, and the memory is C-contiguous (no strides).
    pub const PYBUF_ND: c_int = 0x0008;
    /// `PyBUF_FORMAT`: the exporter fills `format`.
    pub const PYBUF_FORMAT: c_int = 0x0004;

    unsafe extern "C" {
        /// Fills `view` and returns 0, or sets an exception and returns -1.
        pub fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
        /// Releases a view filled by `PyObject_GetBuffer` (once).
        pub fn PyBuffer_Release(view: *mut PyBufferView);
    }
}

/// Borrowed token ids of a Python buffer, released when dropped (attached to the interpreter).
#[cfg(not(windows))]
pub struct U32Buffer<'py> {
    /// Boxed so that its address is stable: exporters may keep a pointer to the view.
    view: Box<ffi::PyBufferView>,
    /// The exporter's memory as token ids: a view checked as a 1-D, C-contiguous, aligned
    /// buffer of `len` 4-byte native unsigned integers, alive until `view` is released.
    data: *const u32,
    len: usize,
    _py: Python<'py>,
}

/// What the exporter of a buffer said it holds.
pub enum Refused {
    /// The object does not support the buffer protocol (a list, a tuple, a generator...).
    NotABuffer,
    /// It does, but not as 1-D C-contiguous uint32: the message says what it is.
    Wrong(String),
}

#[cfg(not(windows))]
impl<'py> U32Buffer<'py> {
    /// Borrows `obj`'s buffer as token ids.
    ///
    /// # Errors
    /// [`Refused::NotABuffer`] if `obj` exports no buffer (the error is cleared);
    /// [`Refused::Wrong`] if it exports one that is not C-contiguous, 1-D `uint32` (released).
    pub fn borrow(obj: &Bound<'py, PyAny>) -> Result<U32Buffer<'py>, Refused> {
        let py = obj.py();
        let mut view = Box::new(ffi::PyBufferView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (borrowed for 'py, attached), `view` a writable
        // `Py_buffer` of CPython's layout; on failure nothing is held.
        let got = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, ffi::PYBUF_FORMAT | ffi::PYBUF_ND) };
        if got != 0 {
            let err = PyErr::fetch(py);
            return Err(match err.is_instance_of::<pyo3::exceptions::PyTypeError>(py) {
                // "a bytes-like object is required": no buffer at all.
                true => Refused::NotABuffer,
                // A buffer that cannot be given C-contiguous (a strided numpy view...).
                false => Refused::Wrong(format!("a buffer that cannot be read C-contiguous ({err})")),
            });
        }
        let (buf, len, itemsize, ndim, format) = (view.buf, view.len, view.itemsize, view.ndim, view.format);
        // From here the view is held: `held` releases it on every path, including the refusals.
        let mut held = U32Buffer { view, data: std::ptr::null(), len: 0, _py: py };
        // SAFETY: a non-null `format` is a NUL-terminated string owned by the exporter while the
        // view is held (it is); NULL means unsigned bytes ("B").
        let format = match format.is_null() {
            true => "B".to_string(),
            false => unsafe { std::ffi::CStr::from_ptr(format) }.to_string_lossy().into_owned(),
        };
        if !u32_format(&format) || itemsize != 4 {
            return Err(Refused::Wrong(format!("a buffer of format '{format}' (item size {itemsize})")));
        }
        if ndim != 1 {
            return Err(Refused::Wrong(format!("a buffer of {ndim} dimensions")));
        }
        let len = usize::try_from(len).unwrap_or(0) / 4;
        if len > 0 && (buf.is_null() || !(buf as usize).is_multiple_of(std::mem::align_of::<u32>())) {
            return Err(Refused::Wrong("a buffer whose memory is not aligned for uint32".to_string()));
        }
        held.data = buf as *const u32;
        held.len = len;
        Ok(held)
    }

    /// The token ids, read in place.
    pub fn as_slice(&self) -> &[u32] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `data` is non-null and aligned, and points to `len` u32s (the view's `len`
        // bytes, checked 1-D C-contiguous of item size 4) that the exporter keeps alive and in
        // place until the view is released in `drop`, which needs `&mut self`: after every
        // borrow of this slice has ended.
        unsafe { std::slice::from_raw_parts(self.data, self.len) }
    }
}

#[cfg(not(windows))]
impl Drop for U32Buffer<'_> {
    fn drop(&mut self) {
        // SAFETY: the view was filled by a successful `PyObject_GetBuffer` and is released once,
        // here; the `Python<'py>` this guard holds proves the interpreter is attached.
        unsafe { ffi::PyBuffer_Release(&mut *self.view) }
    }
}

/// Whether a struct-module format string is a native-order 4-byte unsigned integer (the item
/// size is checked apart).
fn u32_format(format: &str) -> bool {
    let code = match format.as_bytes() {
        [c] | [b'@' | b'=', c] => *c,
        [b'<', c] if cfg!(target_endian = "little") => *c,
        [b'>' | b'!', c] if cfg!(target_endian = "big") => *c,
        _ => return false,
    };
    matches!(code, b'I' | b'L')
}

/// Where the buffer functions are not declared here (Windows' abi3 before 3.11), token
/// buffers are read through `memoryview` and copied: correct everywhere, not zero-copy.
#[cfg(windows)]
pub struct U32Buffer<'py> {
    tokens: Vec<u32>,
    _py: Python<'py>,
}

#[cfg(windows)]
impl<'py> U32Buffer<'py> {
    /// Copies `obj`'s buffer as token ids (see the other `borrow`).
    pub fn borrow(obj: &Bound<'py, PyAny>) -> Result<U32Buffer<'py>, Refused> {
        let py = obj.py();
        let view = match py.import("builtins").and_then(|b| b.getattr("memoryview")).and_then(|m| m.call1((obj,))) {
            Ok(view) => view,
            Err(_) => return Err(Refused::NotABuffer),
        };
        let get = |name: &str| view.getattr(name).ok();
        let format: String = get("format").and_then(|f| f.extract().ok()).unwrap_or_default();
        let itemsize: usize = get("itemsize").and_then(|f| f.extract().ok()).unwrap_or(0);
        let ndim: usize = get("ndim").and_then(|f| f.extract().ok()).unwrap_or(0);
        let contiguous: bool = get("c_contiguous").and_then(|f| f.extract().ok()).unwrap_or(false);
        if !u32_format(&format) || itemsize != 4 {
            return Err(Refused::Wrong(format!("a buffer of format '{format}' (item size {itemsize})")));
        }
        if ndim != 1 {
            return Err(Refused::Wrong(format!("a buffer of {ndim} dimensions")));
        }
        if !contiguous {
            return Err(Refused::Wrong("a buffer that is not C-contiguous".to_string()));
        }
        let bytes: Vec<u8> =
            view.call_method0("tobytes").and_then(|b| b.extract()).map_err(|e| Refused::Wrong(e.to_string()))?;
        let tokens = bytes.chunks_exact(4).map(|c| u32::from_ne_bytes(c.try_into().unwrap_or([0; 4]))).collect();
        Ok(U32Buffer { tokens, _py: py })
    }

    /// The token ids (a copy).
    pub fn as_slice(&self) -> &[u32] {
        &self.tokens
    }
}
