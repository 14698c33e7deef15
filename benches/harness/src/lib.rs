//! The harness of superfluid-warm: what the `replay` binary, the tests and the benches run
//! around the index. The faithful 0.1.7 design (the model the index is compared with), request
//! traces, the replay (one head, heads sharing through NATS, simulated engines that publish
//! vLLM's KV events over ZMQ), and a Prometheus recorder with the library's buckets. Not
//! published: it uses the library's public API only, as a user's code would.
#![forbid(unsafe_code)]
#![deny(missing_docs, clippy::unwrap_used, clippy::indexing_slicing)]

pub mod baseline;
pub mod engine_heads;
pub mod engine_replay;
pub mod engine_sim;
pub mod heads;
pub mod hybrid_sim;
pub mod openai_engine;
pub mod prometheus;
pub mod replay;
pub mod trace;
