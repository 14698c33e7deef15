//! The cold records kept beside the hot tables: meta, node and namespace records.

use serde::{Deserialize, Serialize};

/// Schema version of the files this build creates. History: 1, the first redb format
/// (pre-release builds only; refused, see `migrations/0002-segment-keys-and-generations`); 2
/// (0.2.0), segment-local keys and generation lists; 3, the same tables with keys from the tree
/// chain (`migrations/0003-tree-chain`; schema 2 files are still read and written as schema 2).
/// 0.1.7's JSON file is imported, not opened (`migrations/0001-from-0.1.7-json`).
pub const SCHEMA_VERSION: u32 = 3;

/// The meta record: what the file is, and the counters that must survive a restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Meta {
    /// [`SCHEMA_VERSION`] of the writer that last committed.
    pub schema: u32,
    /// [`crate::chain::HASH_SCHEME`].
    pub hash_scheme: String,
    /// Tokens per block.
    pub block_tokens: u32,
    /// Most entries kept before the oldest eighth is evicted.
    pub capacity: u64,
    /// High-water mark of the clock: the clock of the last `ran`. Never goes back.
    pub clock: u64,
    /// Entries in the prefix table.
    pub entries: u64,
    /// Of those, entries imported from 0.1.7 (FNV keys) not yet evicted.
    pub legacy_entries: u64,
    /// Next node id to hand out.
    pub next_node: u32,
    /// Next namespace id to hand out.
    pub next_namespace: u32,
    /// 0.1.7 files imported so far, by the blake3 hash of their bytes.
    pub imports: Vec<Import>,
    /// The writer that has the file open, if it has not closed it.
    pub writer: Option<Writer>,
}

/// A 0.1.7 file that was imported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Import {
    /// blake3 of the file's bytes.
    pub source: [u8; 32],
    /// Entries it brought in.
    pub entries: u64,
}

/// The writer process that holds the file open.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Writer {
    /// Its process id.
    pub pid: u32,
}

/// A node's record (the node table maps its small id to this).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeRecord {
    /// The node's name, as the head gave it.
    pub name: String,
}

/// A namespace's record: what can be shown of it (never a tenant's salt).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NamespaceRecord {
    /// The model name.
    pub model: String,
    /// Whether it is a tenant's own namespace.
    pub tenant: bool,
    /// [`crate::Namespace::id`].
    pub id: [u8; 8],
}
