//! # superfluid-warm
//!
//! Tells the head of an LLM inference cluster which node last ran each prompt prefix, so that a
//! conversation's next turn goes where its KV cache is warm. Prefixes are matched in 64-token
//! blocks whose hashes are chained from a seed made of the model (and tenant); each block hash is
//! a key in a [redb](https://docs.rs/redb) table mapping to the node that last ran it and a
//! clock. See `ARCHITECTURE.md` and `docs/design.md`.
//!
//! ```no_run
//! # fn main() -> Result<(), superfluid_warm::Error> {
//! use superfluid_warm::{ReadIndex, Warm};
//! let warm = Warm::builder().capacity(1 << 20).open("warm.redb")?;
//! let turn: Vec<u32> = (0..300).collect();
//! if let Some(hit) = warm.warmest("qwen-2.5-7b", &turn)? {
//!     println!("{} has {} tokens warm", hit.node, hit.tokens);
//! }
//! warm.ran("qwen-2.5-7b", &turn, "node-3")?;
//! # Ok(()) }
//! ```
//!
//! # Features
//! None is on by default: a head that links the library gets the index alone.
//! - `nats`: [`SharedWarm`], several heads sharing one view through a NATS JetStream stream
//!   (async-nats, on a tokio runtime of its own thread).
//! - `kv-events`: [`decode_engine_batch`], vLLM's and SGLang's KV event payloads decoded into
//!   [`EngineBatch`]es (rmp), for a caller that receives them itself.
//! - `engines`: with `kv-events`, the ZMQ [`Listener`] that subscribes to engines, replays their
//!   gaps and applies their batches (libzmq, built by the `zmq` crate).
//! - `render`: prompts into the model's tokens as vLLM makes them ([`Renderer`]: its
//!   `tokenizer.json` and chat template).
//! - `cli`: the `superfluid-warm` binary (with `nats` and `engines`). Built from the
//!   repository's root, the workspace turns it on.
#![forbid(unsafe_code)]
#![deny(missing_docs, clippy::unwrap_used, clippy::indexing_slicing)]

mod decided;
#[cfg(feature = "kv-events")]
mod engine;
mod error;
mod file;
mod index;
mod keys;
#[cfg(feature = "render")]
mod render;
mod route;
#[cfg(feature = "nats")]
mod share;
mod store;
mod telemetry;

pub use decided::caches::NodeCacheStats;
pub use decided::engines::{
    CacheGroup, EngineBatch, EngineCounts, EngineEvent, EngineOutcome, EngineStats, EngineStored, GroupKind, Medium,
};
#[cfg(feature = "engines")]
pub use engine::listener::{DEFAULT_REPLAY_TIMEOUT, EngineEndpoint, ListenStats, Listener};
#[cfg(feature = "kv-events")]
pub use engine::vllm::decode_engine_batch;
pub use error::{Error, Result};
pub use file::check::FileCheck;
pub use file::compact::Compacted;
pub use file::index_file::IndexFile;
pub use file::listen_status::{EngineStatus, LinkStatus, ListenStatus};
pub use file::snapshot::{Check, DumpEntry, EngineBlockEntry, MAX_PROBLEMS, Snapshot, SnapshotStats};
pub use index::builder::{Builder, DEFAULT_CACHE_BYTES, DEFAULT_SYNC_WINDOW};
pub use index::engine_events::EngineSink;
pub use index::front::DEFAULT_ENGINE_GRACE;
pub use index::read_index::ReadIndex;
pub use index::reader::Reader;
pub use index::warm::{Hit, NodeStats, OpenCheck, Stats, Warm};
pub use keys::{
    BLOCK_TOKENS, HASH_SCHEME, MAX_MODEL_BYTES, MAX_NODE_BYTES, MAX_TENANT_BYTES, MIN_BLOCKS, Namespace, Prefix,
};
#[cfg(feature = "render")]
pub use render::Renderer;
pub use route::choice::{Candidate, Costs, Priced, choose};
pub use route::load::Load;
pub use route::tally::{PREDICTION_SLACK, RouteStats, RouteTally, record_decision, record_gathered, record_load_only};
#[cfg(feature = "nats")]
pub use share::{DEFAULT_BUFFER_EVENTS, ShareStats, SharedWarm, Sharing, Ticket};
pub use store::import::{ImportReport, LegacyJson};
pub use store::records::{DEFAULT_CAPACITY, MAX_CAPACITY, MAX_CLOCK, SCHEMA_VERSION};
pub use store::writer::{DEFAULT_NODES_PER_PREFIX, MAX_NODES_PER_PREFIX};
pub use telemetry::{METRICS, Metric, MetricKind, describe_metrics};
