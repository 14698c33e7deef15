//! The cold records kept beside the hot tables (meta, node and namespace records), the schema
//! versions, and the reads every user of a file shares.

use redb::ReadableTable;
use serde::{Deserialize, Serialize};

use super::codec;
use crate::error::{Error, Result, redb_err};
use crate::keys::{BLOCK_TOKENS, HASH_SCHEME};

/// Schema 1: pre-release builds only; refused (`migrations/0002-segment-keys-and-generations`).
pub(crate) const SCHEMA_V1: u32 = 1;
/// Schema 2: segment-local keys and generation lists, keys from the keyed chain. Still read and
/// written as it is (`migrations/0003-tree-chain`).
pub(crate) const SCHEMA_V2: u32 = 2;
/// Schema 3: the tables of schema 2, keys from the tree chain.
pub(crate) const SCHEMA_V3: u32 = 3;
/// Schema 4: schema 3's tables plus the other nodes of each block, retired node incarnations and
/// per-node counts (`migrations/0004-node-sets-and-forget`). Keys from either chain: a schema 2
/// file keeps its keyed chain when upgraded.
pub(crate) const SCHEMA_V4: u32 = 4;
/// Schema 5: schema 4's tables plus each node's cache: blocks per clock it last ran them at, its
/// floor, capacities (`migrations/0005-node-caches`).
pub(crate) const SCHEMA_V5: u32 = 5;
/// Schema 6: schema 5's tables plus what each engine holds by its KV events: its blocks and its
/// stream's position (`migrations/0006-engine-events`).
pub(crate) const SCHEMA_V6: u32 = 6;
/// Schema 7: schema 6's tables, with `engine_blocks/v7` (keyed by store, offloaded copies
/// counted) in place of `engine_blocks/v6` (`migrations/0007-tiers`).
pub(crate) const SCHEMA_V7: u32 = 7;
/// Schema 8: schema 7's tables plus what each hybrid engine holds: its KV cache groups and its
/// blocks' copies by group (`migrations/0008-hybrid-engines`).
pub(crate) const SCHEMA_V8: u32 = 8;
/// Schema version of the files this build creates and upgrades to. 0.1.7's JSON file is
/// imported, not opened (`migrations/0001-from-0.1.7-json`).
pub const SCHEMA_VERSION: u32 = SCHEMA_V8;

/// Entries (blocks) a new file keeps by default: 2^20, 64 Mi tokens of prefixes.
pub const DEFAULT_CAPACITY: u64 = 1 << 20;
/// Most entries a file may be set to keep.
pub const MAX_CAPACITY: u64 = 1 << 40;
pub use crate::decided::MAX_CLOCK;

/// The key of the meta record in the meta table.
pub(crate) const META_KEY: &str = "meta";

pub(crate) use crate::decided::namespaces::LEGACY_NAMESPACE;

/// The meta record: what the file is, and the counters that must survive a restart.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Meta {
    /// [`SCHEMA_VERSION`] of the writer that last committed.
    pub schema: u32,
    /// The hash scheme of the file's keys ([`HASH_SCHEME`] for schema 3).
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
    /// The head that has the file open, if it has not closed it.
    pub writer: Option<OpenBy>,
}

impl Meta {
    /// The meta record of a new file.
    pub(crate) fn new_file(capacity: u64) -> Meta {
        Meta {
            schema: SCHEMA_VERSION,
            hash_scheme: HASH_SCHEME.to_string(),
            block_tokens: BLOCK_TOKENS as u32,
            capacity,
            clock: 0,
            entries: 0,
            legacy_entries: 0,
            next_node: 0,
            next_namespace: LEGACY_NAMESPACE + 1,
            imports: Vec::new(),
            writer: None,
        }
    }
}

/// A 0.1.7 file that was imported.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Import {
    /// blake3 of the file's bytes.
    pub source: [u8; 32],
    /// Entries it brought in.
    pub entries: u64,
}

/// The head process that holds the file open (committed with every batch, cleared at a clean
/// close: a file that names one and has no live head was left by a crash).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct OpenBy {
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

/// The meta record in `table` (the meta table), `None` if there is none.
///
/// # Errors
/// [`Error::Codec`] for a record that does not decode; [`Error::Storage`].
pub(crate) fn read_meta(table: &impl ReadableTable<&'static str, &'static [u8]>) -> Result<Option<Meta>> {
    let found = table.get(META_KEY).map_err(redb_err("reading the meta record"))?;
    found.map(|bytes| codec::decode("meta", bytes.value())).transpose()
}

/// Every node name in `table` (the node table), by id.
///
/// # Errors
/// [`Error::Corrupted`] if the ids are not dense from 0; [`Error::Codec`]; [`Error::Storage`].
pub(crate) fn read_nodes(table: &impl ReadableTable<u32, &'static [u8]>) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for item in table.iter().map_err(redb_err("reading nodes"))? {
        let (id, bytes) = item.map_err(redb_err("reading nodes"))?;
        let record: NodeRecord = codec::decode("node", bytes.value())?;
        let id = id.value();
        if id as usize != names.len() {
            return Err(Error::Corrupted { detail: format!("node ids are not dense at {id}") });
        }
        names.push(record.name);
    }
    Ok(names)
}

/// The node registry as the file keeps it: each id's name (the node table), whether that
/// incarnation is retired (forgotten), and the ids of retired rows the node table does not hold
/// (none in a sound file: a head refuses a file with any, a snapshot reads past them). A file
/// without a retired table (schema 2 and 3) retires none. One reading for a head's decided state
/// and a snapshot alike.
///
/// # Errors
/// [`Error::Corrupted`] if the ids are not dense from 0; [`Error::Codec`]; [`Error::Storage`].
pub(crate) fn read_registry(read: &redb::ReadTransaction) -> Result<NodeRecords> {
    let names = read_nodes(&read.open_table(super::tables::NODES).map_err(redb_err("reading nodes"))?)?;
    let mut retired = vec![false; names.len()];
    let mut stray = Vec::new();
    match read.open_table(super::tables::RETIRED) {
        Ok(table) => {
            for item in table.iter().map_err(redb_err("reading retired nodes"))? {
                let (id, _) = item.map_err(redb_err("reading retired nodes"))?;
                match retired.get_mut(id.value() as usize) {
                    Some(r) => *r = true,
                    None => stray.push(id.value()),
                }
            }
        }
        Err(redb::TableError::TableDoesNotExist(_)) => {}
        Err(e) => return Err(redb_err("reading retired nodes")(e)),
    }
    Ok(NodeRecords { names, retired, stray })
}

/// The node registry as [`read_registry`] reads it.
pub(crate) struct NodeRecords {
    /// Each id's name.
    pub names: Vec<String>,
    /// Whether each id's incarnation is retired.
    pub retired: Vec<bool>,
    /// Retired rows of ids the node table does not hold.
    pub stray: Vec<u32>,
}
