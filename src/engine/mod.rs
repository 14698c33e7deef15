//! The engine layer (features `kv-events`: the decoder; `engines`: the ZMQ listener): vLLM's and SGLang's KV cache events over ZMQ, decoded
//! and applied to a `Warm` as engine batches. The only code that knows ZMQ and msgpack; the
//! index knows only the engine-agnostic batches (`decided/engines/event.rs`).

pub(crate) mod decode;
#[cfg(feature = "engines")]
pub(crate) mod listener;
#[cfg(feature = "engines")]
pub(crate) mod subscriber;
pub(crate) mod vllm;
