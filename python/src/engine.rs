//! Engines' KV cache events (vLLM's, SGLang's): a batch decoded from its ZMQ payload, for
//! `Warm.engine_batch` / `Warm.engine_resync`.

use pyo3::prelude::*;
use pyo3::pybacked::{PyBackedBytes, PyBackedStr};
use pyo3::types::PyBytes;
use superfluid_warm as sw;

use crate::errors::{Int, detached};

/// One batch of an engine's KV cache events, decoded by ``decode_engine_batch``: its sequence
/// number, its publish time and its events (``len(batch)``).
#[pyclass(frozen, module = "superfluid_warm", name = "EngineBatch")]
pub struct EngineBatch {
    pub inner: sw::EngineBatch,
}

#[pymethods]
impl EngineBatch {
    /// The engine's sequence number: from 0 per engine process, one more per batch.
    #[getter]
    fn seq(&self) -> u64 {
        self.inner.seq
    }

    /// When the engine published it (seconds since the Unix epoch).
    #[getter]
    fn ts(&self) -> f64 {
        self.inner.ts
    }

    /// Events in the batch.
    fn __len__(&self) -> usize {
        self.inner.events.len()
    }

    fn __repr__(&self) -> String {
        format!("EngineBatch(seq={}, ts={}, events={})", self.inner.seq, self.inner.ts, self.inner.events.len())
    }
}

/// The bytes of a payload: `bytes` as they are, anything else exporting a buffer (a
/// `bytearray`, a `memoryview`, a pyzmq `Frame`) copied once.
pub fn payload_bytes(payload: &Bound<'_, PyAny>) -> PyResult<PyBackedBytes> {
    if let Ok(bytes) = payload.cast::<PyBytes>() {
        return Ok(bytes.clone().into());
    }
    let copied = payload.py().import("builtins")?.getattr("bytes")?.call1((payload,))?;
    Ok(copied.cast_into::<PyBytes>()?.into())
}

/// Decodes one ZMQ message of vLLM's (or SGLang's) KV cache events: ``seq`` is its second
/// frame as an int (8 bytes big-endian: ``int.from_bytes(frame, "big")``), ``payload`` its
/// third (msgpack), ``model`` the model the engine serves (a store is keyed under its LoRA's
/// name if it has one, with its cache salt as the tenant). Raises ``EngineError`` for a
/// payload that is not a well-formed batch.
#[pyfunction]
pub fn decode_engine_batch(
    py: Python<'_>,
    seq: Int,
    payload: &Bound<'_, PyAny>,
    model: PyBackedStr,
) -> PyResult<EngineBatch> {
    let seq = crate::errors::seq(seq).map_err(|e| e.into_py(py))?;
    let payload = payload_bytes(payload)?;
    let (bytes, model): (&[u8], &str) = (&payload, &model);
    let inner = detached(py, || Ok(sw::decode_engine_batch(seq, bytes, model)?))?;
    Ok(EngineBatch { inner })
}
