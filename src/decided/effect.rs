//! Effects: what a change, decided once on the callers' side (`decided/mod.rs`), does to the
//! file. Each states its results (a key's new node and clock, a count to set, the new floor),
//! never the inputs to decide again, so the writer decides nothing: it persists effects, in
//! order, and keeps the file's own bookkeeping (generations, live counts, others rows, node
//! counts) in step with them. Applying a rolled-back batch's effects again, from the commit
//! before it, gives the same file.

use std::sync::Arc;

use super::engines::{GroupKind, StreamRecord};
use crate::keys::{BlockKey, Namespace};

/// One effect of a decided change.
#[derive(Clone, Debug)]
pub(crate) enum Effect {
    /// Node id `id` is handed out to `name` (the next id: a new name, or a forgotten node's
    /// next incarnation).
    Node { id: u32, name: Arc<str> },
    /// Namespace id `id` is handed out to `namespace` (the next id).
    Namespace { id: u32, namespace: Namespace },
    /// Every block of `blocks` (a prompt's chain, from its first block), of namespace id
    /// `namespace`, now names `node` at `clock` (the nodes before it join the block's others,
    /// by the one node-set rule, `node_set.rs`).
    Put { namespace: u32, blocks: Arc<[BlockKey]>, node: u32, clock: u64 },
    /// Node id `node`, the current incarnation of `name`, is forgotten at `clock`.
    Retire { node: u32, name: Arc<str>, clock: u64 },
    /// Each clock of `counts` has the live entries its count says (0: none; its generation
    /// goes), and the file holds `entries` live entries in all, `legacy_entries` of them
    /// imported from 0.1.7 (`horizon.rs`).
    Live { counts: Box<[(u64, u64)]>, entries: u64, legacy_entries: u64 },
    /// The floor goes back to 0, for an import (0.1.7's own clocks may be older): the nodes a
    /// block still lists from at or below the old floor, which it kept evicted, go first.
    LowerFloor,
    /// The clock is at `clock` (an import's: 0.1.7's own clocks may be newer).
    Clock { clock: u64 },
    /// Every entry (and every node of a block) seen at or below `floor` is evicted, leaving
    /// `entries` live entries, `legacy_entries` of them 0.1.7's; the clock is at `clock`.
    Evict { floor: u64, entries: u64, legacy_entries: u64, clock: u64 },
    /// A node cache row: node `node` holds `blocks` blocks it last ran at `clock` (0: no row).
    /// `was` is what the row held before this effect, so that a row made and dropped within
    /// one batch is never written.
    CacheClock { node: u32, clock: u64, blocks: u64, was: u64 },
    /// Node `node`'s cache floor is `floor` (0: no row).
    CacheFloor { node: u32, floor: u64 },
    /// Node name `name`'s own cache size (`None`: the default).
    Capacity { name: Arc<str>, blocks: Option<u64> },
    /// The default cache size (`None`: caches are not kept).
    CacheDefault { blocks: Option<u64> },
    /// Node `node`'s engine block `hash`, stored at `clock`, is `row` (`decided/engines/row.rs`'s
    /// layout; `None`: gone).
    EngineBlock { node: u32, clock: u64, hash: u64, row: Option<Arc<[u8]>> },
    /// Node `node`'s engine stream is at `row` (its position and counts), decided at `clock`.
    EngineStream { node: u32, row: Arc<StreamRecord>, clock: u64 },
    /// Every engine block of node `node` is gone; its stream row is `stream` (`None`: gone too,
    /// the node was forgotten, with its groups).
    EngineClear { node: u32, stream: Option<Arc<StreamRecord>> },
    /// Node `node`'s hybrid engine's block `hash`, first stored at `clock`, is `row`
    /// (`decided/engines/row.rs`'s grouped layout; `None`: gone).
    HybridBlock { node: u32, clock: u64, hash: u64, row: Option<Arc<[u8]>> },
    /// Node `node`'s engine's KV cache groups are `kinds` (index, kind), all of them.
    EngineGroups { node: u32, kinds: Arc<[(u32, GroupKind)]> },
}

impl Effect {
    /// Rows it writes into the prefix table or the engine blocks (for batch bounds).
    pub(crate) fn blocks(&self) -> usize {
        match self {
            Effect::Put { blocks, .. } => blocks.len(),
            Effect::EngineBlock { .. } | Effect::HybridBlock { .. } => 1,
            _ => 0,
        }
    }
}
