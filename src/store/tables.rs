//! The redb tables and their fixed-width layouts (see `docs/design.md`).

use redb::TableDefinition;

use crate::keys::BlockKey;

/// Block key (its 16 bytes read as a big-endian `u128`, so the integer order is the byte order and
/// a comparison is one instruction) → (node id, namespace id, depth in blocks, clock). 16-byte
/// key, 20-byte value.
pub(crate) const PREFIXES: TableDefinition<u128, (u32, u32, u32, u64)> = TableDefinition::new("prefixes/v2");
/// Clock → the keys one `ran` (or one clock of an import) wrote, 16 bytes each, each once: the
/// clock-ordered table eviction scans. A key listed here is live at this clock only while the
/// prefix table still gives it this clock (later `ran`s leave stale listings, dropped on eviction).
pub(crate) const GENERATIONS: TableDefinition<u64, &[u8]> = TableDefinition::new("generations/v2");
/// Clock → how many keys of that generation are still live (never 0: the row goes with its last
/// live key). Eviction sums these oldest first to find its cut.
pub(crate) const LIVE: TableDefinition<u64, u32> = TableDefinition::new("live/v2");
/// Block key → the other nodes that ran the block (besides the one the prefix table names), at
/// most `nodes_per_prefix - 1`, newest first: 12 bytes each, `u32` node id and `u64` clock, little
/// endian. The row is absent when there are none; it goes with its block. Schema 4.
pub(crate) const OTHERS: TableDefinition<u128, &[u8]> = TableDefinition::new("others/v4");
/// Node id → the clock at which it was forgotten: an incarnation of a node that restarted. Its
/// entries are answered as absent and reclaimed by eviction. Schema 4.
pub(crate) const RETIRED: TableDefinition<u32, u64> = TableDefinition::new("retired/v4");
/// Node id → how many blocks name it (in the prefix table or among a block's others); no row at
/// 0. Schema 4.
pub(crate) const HELD: TableDefinition<u32, u64> = TableDefinition::new("held/v4");
/// Counters of the writer's that must survive a restart: [`FLOOR_KEY`] → every entry (and every
/// node of a block) seen at or below this clock is evicted. Schema 4.
pub(crate) const STATE: TableDefinition<&str, u64> = TableDefinition::new("state/v4");
/// The key of the eviction floor in [`STATE`].
pub(crate) const FLOOR_KEY: &str = "floor";
/// The key in [`STATE`] of the stream sequence of the last shared event applied (a head sharing
/// through NATS JetStream); absent for a file that never shared.
pub(crate) const POSITION_KEY: &str = "stream";
/// The key in [`STATE`] of the default capacity of a node's cache in blocks
/// (`Builder::node_cache_blocks`); absent: no limit. Schema 5.
pub(crate) const NODE_CACHE_KEY: &str = "node_cache";
/// (node id, clock) → how many blocks the node last ran at that clock and still holds in its
/// cache (no row at 0; none at or below the node's floor or the eviction floor). Schema 5.
pub(crate) const NODE_CLOCKS: TableDefinition<(u32, u64), u64> = TableDefinition::new("node_clocks/v5");
/// Node id → its cache's floor: every block it last ran at or below this clock has left its
/// cache, and is not answered for it (no row at 0). Schema 5.
pub(crate) const NODE_FLOORS: TableDefinition<u32, u64> = TableDefinition::new("node_floors/v5");
/// Node name → the capacity of its cache in blocks, where set for it (`Warm::set_node_capacity`;
/// every incarnation of the name). Schema 5.
pub(crate) const NODE_CAPACITY: TableDefinition<&str, u64> = TableDefinition::new("node_capacity/v5");
/// (node id, clock of its store, engine hash) → one block the node's engine holds, as its KV
/// events said (layout in `decided/engines/row.rs`): its parent's hash, its copies stored and not yet
/// removed (and of those, the offloaded ones), its tokens, and for a prompt's first block its
/// namespace. Schema 7.
pub(crate) const ENGINE_BLOCKS: TableDefinition<(u32, u64, u64), &[u8]> = TableDefinition::new("engine_blocks/v7");
/// Schema 6's engine blocks: (node id, engine hash) → the same, with the clock in the row and
/// every copy on the GPU. Read from schema 6 files, and rewritten into [`ENGINE_BLOCKS`] by the
/// upgrade to schema 7.
pub(crate) const ENGINE_BLOCKS_V6: TableDefinition<(u32, u64), &[u8]> = TableDefinition::new("engine_blocks/v6");
/// (node id, clock of its first store, engine hash) → one block a hybrid engine holds (layout
/// in `decided/engines/row.rs`): its newest store, its copies by KV cache group, and where the
/// prompt stands after it. Schema 8.
pub(crate) const ENGINE_GROUP_BLOCKS: TableDefinition<(u32, u64, u64), &[u8]> =
    TableDefinition::new("engine_group_blocks/v8");
/// (node id, group index) → the kind of one KV cache group its engine's events named (layout in
/// `decided/engines/row.rs`). Schema 8.
pub(crate) const ENGINE_GROUPS: TableDefinition<(u32, u32), &[u8]> = TableDefinition::new("engine_groups/v8");
/// Node id → bincode `StreamRecord` (`decided/engines/stream.rs`): where its engine's event
/// stream stands (the last batch applied, its publish time) and its counts. Schema 6.
pub(crate) const ENGINE_STREAMS: TableDefinition<u32, &[u8]> = TableDefinition::new("engine_streams/v6");
/// Node id → bincode [`super::records::NodeRecord`].
pub(crate) const NODES: TableDefinition<u32, &[u8]> = TableDefinition::new("nodes/v1");
/// Node name → node id.
pub(crate) const NODE_IDS: TableDefinition<&str, u32> = TableDefinition::new("node_ids/v1");
/// Namespace id → bincode [`super::records::NamespaceRecord`].
pub(crate) const NAMESPACES: TableDefinition<u32, &[u8]> = TableDefinition::new("namespaces/v1");
/// Namespace public id (8 bytes) → namespace id.
pub(crate) const NAMESPACE_IDS: TableDefinition<[u8; 8], u32> = TableDefinition::new("namespace_ids/v1");
/// [`super::records::META_KEY`] → bincode [`super::records::Meta`].
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");

/// The prefix table's key for a block key.
pub(crate) fn table_key(key: &BlockKey) -> u128 {
    u128::from_be_bytes(*key)
}

/// The keys a generation row lists, in the order listed (a trailing partial key is ignored;
/// `check` reports it).
pub(crate) fn generation_keys(row: &[u8]) -> impl Iterator<Item = u128> + '_ {
    row.chunks_exact(16).map(|k| {
        let mut key = [0u8; 16];
        key.copy_from_slice(k);
        u128::from_be_bytes(key)
    })
}

/// Bytes of one member of an [`OTHERS`] row.
pub(crate) const MEMBER_BYTES: usize = 12;

/// The (node id, clock) members of an [`OTHERS`] row, in the order stored (a trailing partial
/// member is ignored; `check` reports it).
pub(crate) fn members(row: &[u8]) -> impl Iterator<Item = (u32, u64)> + '_ {
    row.chunks_exact(MEMBER_BYTES).map(|m| {
        let (node, clock) = m.split_at(4);
        let mut n = [0u8; 4];
        n.copy_from_slice(node);
        let mut c = [0u8; 8];
        c.copy_from_slice(clock);
        (u32::from_le_bytes(n), u64::from_le_bytes(c))
    })
}

/// An [`OTHERS`] row of `members`.
pub(crate) fn members_row(members: &[(u32, u64)]) -> Vec<u8> {
    let mut row = Vec::with_capacity(members.len() * MEMBER_BYTES);
    for (node, clock) in members {
        row.extend_from_slice(&node.to_le_bytes());
        row.extend_from_slice(&clock.to_le_bytes());
    }
    row
}

/// One entry of the prefix table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub node: u32,
    pub namespace: u32,
    pub depth: u32,
    pub clock: u64,
}

impl Entry {
    pub(crate) fn from_tuple((node, namespace, depth, clock): (u32, u32, u32, u64)) -> Entry {
        Entry { node, namespace, depth, clock }
    }

    pub(crate) fn tuple(self) -> (u32, u32, u32, u64) {
        (self.node, self.namespace, self.depth, self.clock)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    #[test]
    fn an_others_row_holds_its_members() {
        let row = members_row(&[(7, 1 << 40), (u32::MAX, 3)]);
        assert_eq!(row.len(), 2 * MEMBER_BYTES);
        assert_eq!(members(&row).collect::<Vec<_>>(), vec![(7, 1 << 40), (u32::MAX, 3)]);
    }
}
