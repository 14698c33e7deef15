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
//! use superfluid_warm::Warm;
//! let warm = Warm::builder().capacity(1 << 20).open("warm.redb")?;
//! let turn: Vec<u32> = (0..300).collect();
//! if let Some(hit) = warm.warmest("qwen-2.5-7b", &turn)? {
//!     println!("{} has {} tokens warm", hit.node, hit.tokens);
//! }
//! warm.ran("qwen-2.5-7b", &turn, "node-3")?;
//! # Ok(()) }
//! ```
#![deny(missing_docs, clippy::unwrap_used)]

mod builder;
mod chain;
mod checksum;
mod codec;
mod compact;
mod error;
mod front;
mod inspect;
mod legacy;
mod lookup;
mod overlay;
mod records;
mod schema;
mod seal;
mod state;
mod tables;
mod warm;

pub mod baseline;
pub mod replay;
pub mod trace;

pub use builder::{Builder, DEFAULT_CACHE_BYTES, DEFAULT_CAPACITY, DEFAULT_SYNC_WINDOW, MAX_CAPACITY};
pub use chain::{BLOCK_TOKENS, HASH_SCHEME, MAX_MODEL_BYTES, MAX_TENANT_BYTES, MIN_BLOCKS, Namespace, Prefix};
pub use compact::{Compacted, compact};
pub use error::{Error, Result};
pub use inspect::{Check, DumpEntry, Snapshot, SnapshotStats, hex, integrity_check_copy, recovered_copy};
pub use legacy::ImportReport;
pub use records::SCHEMA_VERSION;
pub use seal::seal_path;
pub use state::MAX_NODE_BYTES;
pub use warm::{Hit, OpenCheck, Stats, Warm};
