//! `superfluid_warm._native`: the Python bindings of the `superfluid-warm` index (PyO3, the
//! stable ABI of CPython 3.9+). The package `superfluid_warm` re-exports it with its exceptions
//! and records; see `python/README.md`.
//!
//! Every call releases the interpreter while the library hashes, searches, commits or waits;
//! a panic is caught and raised as `WarmError` (kind `"Panic"`); the only `unsafe` code is in
//! `buffer.rs` (token ids read in place from numpy arrays).

use pyo3::prelude::*;

mod buffer;
mod engine;
mod errors;
mod handle;
mod records;
#[cfg(feature = "nats")]
mod shared;
mod tokens;
mod warm;

/// The native part of ``superfluid_warm``: import the package, which re-exports it with its
/// exceptions and records.
/// Test hook (feature `test-hooks`, which `ci.sh` builds and a user's build has not): panics in Rust, with the interpreter released as every call is, to show
/// that a panic reaches Python as a ``WarmError`` of kind ``"Panic"``.
#[cfg(feature = "test-hooks")]
#[pyfunction]
fn _panic(py: Python<'_>, message: String) -> PyResult<()> {
    errors::detached(py, || -> errors::Result<()> { std::panic::panic_any(message) })
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<warm::Warm>()?;
    m.add_class::<warm::Reader>()?;
    m.add_class::<records::Hit>()?;
    m.add_class::<records::Prefix>()?;
    m.add_class::<engine::EngineBatch>()?;
    m.add_function(wrap_pyfunction!(engine::decode_engine_batch, m)?)?;
    m.add_function(wrap_pyfunction!(warm::check_file, m)?)?;
    m.add_function(wrap_pyfunction!(warm::listen_status, m)?)?;
    #[cfg(feature = "test-hooks")]
    {
        m.add_function(wrap_pyfunction!(warm::_replay_rust, m)?)?;
        m.add_function(wrap_pyfunction!(_panic, m)?)?;
    }
    // A handle belongs to the process that opened it: in a fork's child (`multiprocessing`'s
    // default start method on Linux) every call raises `ForkedError`, and nothing of the
    // parent's is touched. The hook keeps the process id handles compare with.
    let hook = wrap_pyfunction!(handle::after_fork_in_child, m)?;
    let kwargs = pyo3::types::PyDict::new(m.py());
    kwargs.set_item("after_in_child", hook)?;
    m.py().import("os")?.call_method("register_at_fork", (), Some(&kwargs))?;
    #[cfg(feature = "nats")]
    {
        m.add_class::<shared::SharedWarm>()?;
        m.add_class::<shared::Ticket>()?;
    }
    m.add("HAS_NATS", cfg!(feature = "nats"))?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("BLOCK_TOKENS", superfluid_warm::BLOCK_TOKENS)?;
    m.add("MIN_BLOCKS", superfluid_warm::MIN_BLOCKS)?;
    m.add("HASH_SCHEME", superfluid_warm::HASH_SCHEME)?;
    m.add("SCHEMA_VERSION", superfluid_warm::SCHEMA_VERSION)?;
    m.add("DEFAULT_CAPACITY", superfluid_warm::DEFAULT_CAPACITY)?;
    m.add("MAX_CAPACITY", superfluid_warm::MAX_CAPACITY)?;
    m.add("DEFAULT_NODES_PER_PREFIX", superfluid_warm::DEFAULT_NODES_PER_PREFIX)?;
    m.add("MAX_NODES_PER_PREFIX", superfluid_warm::MAX_NODES_PER_PREFIX)?;
    m.add("MAX_MODEL_BYTES", superfluid_warm::MAX_MODEL_BYTES)?;
    m.add("MAX_NODE_BYTES", superfluid_warm::MAX_NODE_BYTES)?;
    m.add("MAX_TENANT_BYTES", superfluid_warm::MAX_TENANT_BYTES)?;
    Ok(())
}
