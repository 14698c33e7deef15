//! The writer's state: the open batch (one redb write transaction), the in-memory copies of the
//! cold records, and every change to the tables. `Warm` holds it behind a mutex.

use std::collections::HashMap;
use std::time::Instant;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};

use crate::chain::{BlockKey, Namespace, Prefix, check_len, is_legacy};
use crate::codec;
use crate::error::{Error, Result, redb_err};
use crate::records::{Meta, NamespaceRecord, NodeRecord};
use crate::tables::{
    BY_CLOCK, Entry, LEGACY_NAMESPACE, META, META_KEY, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES,
};

/// Longest node name accepted, in bytes.
pub const MAX_NODE_BYTES: usize = 255;

/// Node names by id and ids by name: nodes are few, so all of them are kept in memory.
#[derive(Default)]
pub(crate) struct Nodes {
    pub names: Vec<String>,
    pub ids: HashMap<String, u32>,
}

impl Nodes {
    pub(crate) fn name(&self, id: u32) -> Option<&str> {
        self.names.get(id as usize).map(String::as_str)
    }
}

/// What a writer keeps between calls.
pub(crate) struct State {
    /// The batch: every change since the last commit, readable by `warmest` (read-your-writes).
    pub txn: Option<WriteTransaction>,
    /// When the oldest uncommitted change was made; `None` when there is none.
    pub dirty_since: Option<Instant>,
    /// The meta record as of the batch (committed with it).
    pub meta: Meta,
    pub nodes: Nodes,
    pub namespaces: HashMap<[u8; 8], u32>,
    /// A background commit that failed, to be reported by the next call that writes.
    pub failed: Option<String>,
    /// Set when the handle is closing: the flusher stops.
    pub closing: bool,
}

/// The longest remembered prefix: its last entry and its length in blocks.
pub(crate) type Found = Option<(Entry, usize)>;

/// Walks `keys` from the first until one is missing, as 0.1.7 did.
pub(crate) fn walk(table: &impl ReadableTable<BlockKey, (u32, u32, u32, u64)>, keys: &[BlockKey]) -> Result<Found> {
    let mut best = None;
    for (i, key) in keys.iter().enumerate() {
        match table.get(key).map_err(redb_err("reading a prefix"))? {
            Some(guard) => best = Some((Entry::from_tuple(guard.value()), i + 1)),
            None => break,
        }
    }
    Ok(best)
}

/// The longer of the two walks; the new chain wins a tie.
pub(crate) fn longer(new: Found, old: Found) -> Found {
    match (new, old) {
        (Some(n), Some(o)) if o.1 > n.1 => Some(o),
        (None, o) => o,
        (n, _) => n,
    }
}

impl State {
    /// Reads the cold records of a committed file into a fresh state.
    pub(crate) fn load(db: &Database) -> Result<State> {
        let mut state = State {
            txn: None,
            dirty_since: None,
            meta: empty_meta(),
            nodes: Nodes::default(),
            namespaces: HashMap::new(),
            failed: None,
            closing: false,
        };
        state.reload(db)?;
        Ok(state)
    }

    /// Drops the batch and reads the committed cold records again (after a failed change).
    pub(crate) fn reload(&mut self, db: &Database) -> Result<()> {
        if let Some(txn) = self.txn.take() {
            // Rolls back; an abort that fails has nothing left to undo.
            let _ = txn.abort();
        }
        self.dirty_since = None;
        let read = db.begin_read().map_err(redb_err("reading the meta record"))?;
        let meta_table = read.open_table(META).map_err(redb_err("reading the meta record"))?;
        let bytes = meta_table
            .get(META_KEY)
            .map_err(redb_err("reading the meta record"))?
            .ok_or_else(|| Error::UnknownFormat { detail: "no meta record".into() })?;
        self.meta = codec::decode("meta", bytes.value())?;
        let mut nodes = Nodes::default();
        let node_table = read.open_table(NODES).map_err(redb_err("reading nodes"))?;
        for item in node_table.iter().map_err(redb_err("reading nodes"))? {
            let (id, bytes) = item.map_err(redb_err("reading nodes"))?;
            let record: NodeRecord = codec::decode("node", bytes.value())?;
            let id = id.value();
            if id as usize != nodes.names.len() {
                return Err(Error::Corrupted { detail: format!("node ids are not dense at {id}") });
            }
            nodes.ids.insert(record.name.clone(), id);
            nodes.names.push(record.name);
        }
        self.nodes = nodes;
        let ns_table = read.open_table(NAMESPACE_IDS).map_err(redb_err("reading namespaces"))?;
        self.namespaces = ns_table
            .iter()
            .map_err(redb_err("reading namespaces"))?
            .map(|item| item.map(|(k, v)| (k.value(), v.value())).map_err(redb_err("reading namespaces")))
            .collect::<Result<_>>()?;
        Ok(())
    }

    /// The open batch, begun if there is none.
    pub(crate) fn batch(&mut self, db: &Database) -> Result<&mut WriteTransaction> {
        if self.txn.is_none() {
            self.txn = Some(db.begin_write().map_err(redb_err("starting a batch"))?);
        }
        self.txn.as_mut().ok_or(Error::Poisoned)
    }

    /// The longest remembered prefix of `prefix`, including uncommitted changes.
    pub(crate) fn lookup(&self, db: &Database, prefix: &Prefix) -> Result<Found> {
        let legacy = if self.meta.legacy_entries > 0 { prefix.legacy.as_slice() } else { &[] };
        if let Some(txn) = &self.txn {
            let table = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            return Ok(longer(walk(&table, &prefix.blocks)?, walk(&table, legacy)?));
        }
        let read = db.begin_read().map_err(redb_err("starting a read"))?;
        let table = read.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        Ok(longer(walk(&table, &prefix.blocks)?, walk(&table, legacy)?))
    }

    /// Records that `node` ran `prefix`: every block gets `node` and a fresh clock, except blocks
    /// already on `node` whose clock is in the newer half of the live range (see
    /// ARCHITECTURE.md, "write only what changed"). Then evicts if over capacity. On error the
    /// batch is rolled back whole, so no `ran` is ever half there.
    pub(crate) fn ran(&mut self, db: &Database, prefix: &Prefix, node: &str) -> Result<()> {
        check_len("node", node.len(), MAX_NODE_BYTES)?;
        if prefix.blocks.is_empty() {
            return Ok(());
        }
        let result = self.ran_in_batch(db, prefix, node);
        if result.is_err() {
            self.reload(db)?;
        }
        result
    }

    fn ran_in_batch(&mut self, db: &Database, prefix: &Prefix, node: &str) -> Result<()> {
        let node = self.intern_node(db, node)?;
        let namespace = self.intern_namespace(db, &prefix.namespace)?;
        self.meta.clock += 1;
        let clock = self.meta.clock;
        let mut added = 0u64;
        {
            let txn = self.batch(db)?;
            let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            let mut by_clock = txn.open_table(BY_CLOCK).map_err(redb_err("opening the clock table"))?;
            let oldest = match by_clock.first().map_err(redb_err("reading the clock table"))? {
                Some((k, _)) => k.value().0,
                None => clock,
            };
            let keep_from = oldest + (clock - oldest) / 2;
            for (i, key) in prefix.blocks.iter().enumerate() {
                let depth = u32::try_from(i + 1).unwrap_or(u32::MAX);
                let old = primary.get(key).map_err(redb_err("reading a prefix"))?.map(|g| Entry::from_tuple(g.value()));
                match old {
                    Some(old) if old.node == node && old.clock >= keep_from => continue,
                    Some(old) => {
                        by_clock.remove((old.clock, *key)).map_err(redb_err("writing the clock table"))?;
                    }
                    None => added += 1,
                }
                primary
                    .insert(key, Entry { node, namespace, depth, clock }.tuple())
                    .map_err(redb_err("writing a prefix"))?;
                by_clock.insert((clock, *key), ()).map_err(redb_err("writing the clock table"))?;
            }
        }
        self.meta.entries += added;
        self.evict(db)?;
        self.touch();
        Ok(())
    }

    /// Marks the batch dirty.
    pub(crate) fn touch(&mut self) {
        self.dirty_since.get_or_insert_with(Instant::now);
    }

    /// While over capacity, removes the oldest eighth: every entry whose clock is at most the
    /// clock of the `capacity / 8`-th oldest (0.1.7's rule), by a range scan of the clock table.
    pub(crate) fn evict(&mut self, db: &Database) -> Result<u64> {
        let mut evicted = 0;
        while self.meta.entries > self.meta.capacity {
            let skip = usize::try_from(self.meta.capacity / 8).unwrap_or(usize::MAX);
            let (n, legacy) = {
                let txn = self.batch(db)?;
                let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
                let mut by_clock = txn.open_table(BY_CLOCK).map_err(redb_err("opening the clock table"))?;
                let cut = match by_clock.iter().map_err(redb_err("reading the clock table"))?.nth(skip) {
                    Some(item) => item.map_err(redb_err("reading the clock table"))?.0.value().0,
                    None => {
                        return Err(Error::Corrupted {
                            detail: "the clock table has fewer entries than the meta record counts".into(),
                        });
                    }
                };
                let victims = by_clock
                    .range(..=(cut, [0xFF; 16]))
                    .map_err(redb_err("reading the clock table"))?
                    .map(|item| item.map(|(k, _)| k.value()).map_err(redb_err("reading the clock table")))
                    .collect::<Result<Vec<_>>>()?;
                let mut legacy = 0;
                for (clock, key) in &victims {
                    by_clock.remove((*clock, *key)).map_err(redb_err("evicting"))?;
                    if primary.remove(key).map_err(redb_err("evicting"))?.is_none() {
                        return Err(Error::Corrupted { detail: "a clock entry has no prefix entry".into() });
                    }
                    legacy += u64::from(is_legacy(key));
                }
                (victims.len() as u64, legacy)
            };
            self.meta.entries = self.meta.entries.saturating_sub(n);
            self.meta.legacy_entries = self.meta.legacy_entries.saturating_sub(legacy);
            evicted += n;
        }
        if evicted > 0 {
            self.touch();
        }
        Ok(evicted)
    }

    /// The id of node `name`, added to the node tables if new.
    pub(crate) fn intern_node(&mut self, db: &Database, name: &str) -> Result<u32> {
        if let Some(&id) = self.nodes.ids.get(name) {
            return Ok(id);
        }
        check_len("node", name.len(), MAX_NODE_BYTES)?;
        let id = self.meta.next_node;
        self.meta.next_node =
            id.checked_add(1).ok_or_else(|| Error::InvalidConfig { detail: "more than 2^32 nodes".into() })?;
        let bytes = codec::encode("node", &NodeRecord { name: name.to_string() })?;
        let txn = self.batch(db)?;
        txn.open_table(NODES)
            .and_then(|mut t| t.insert(id, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a node"))?;
        txn.open_table(NODE_IDS)
            .and_then(|mut t| t.insert(name, id).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a node"))?;
        self.nodes.ids.insert(name.to_string(), id);
        self.nodes.names.push(name.to_string());
        self.touch();
        Ok(id)
    }

    fn intern_namespace(&mut self, db: &Database, ns: &Namespace) -> Result<u32> {
        let public = ns.id();
        if let Some(&id) = self.namespaces.get(&public) {
            return Ok(id);
        }
        let id = self.meta.next_namespace.max(LEGACY_NAMESPACE + 1);
        self.meta.next_namespace =
            id.checked_add(1).ok_or_else(|| Error::InvalidConfig { detail: "more than 2^32 namespaces".into() })?;
        let record = NamespaceRecord { model: ns.model().to_string(), tenant: ns.has_tenant(), id: public };
        let bytes = codec::encode("namespace", &record)?;
        let txn = self.batch(db)?;
        txn.open_table(NAMESPACES)
            .and_then(|mut t| t.insert(id, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a namespace"))?;
        txn.open_table(NAMESPACE_IDS)
            .and_then(|mut t| t.insert(public, id).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a namespace"))?;
        self.namespaces.insert(public, id);
        self.touch();
        Ok(id)
    }

    /// Commits the batch with the meta record, durably. Nothing to commit is not an error. On
    /// failure the batch is gone and the state is what was committed before.
    pub(crate) fn commit(&mut self, db: &Database) -> Result<()> {
        if self.dirty_since.is_none() {
            return Ok(());
        }
        let result = self.commit_batch(db);
        if result.is_err() {
            self.reload(db)?;
        }
        result
    }

    fn commit_batch(&mut self, db: &Database) -> Result<()> {
        let bytes = codec::encode("meta", &self.meta)?;
        let mut txn = match self.txn.take() {
            Some(txn) => txn,
            None => db.begin_write().map_err(redb_err("starting a batch"))?,
        };
        txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
        txn.open_table(META)
            .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing the meta record"))?;
        txn.commit().map_err(redb_err("committing"))?;
        self.dirty_since = None;
        Ok(())
    }
}

/// The meta record of a new file.
pub(crate) fn empty_meta() -> Meta {
    Meta {
        schema: crate::records::SCHEMA_VERSION,
        hash_scheme: crate::chain::HASH_SCHEME.to_string(),
        block_tokens: crate::chain::BLOCK_TOKENS as u32,
        capacity: crate::builder::DEFAULT_CAPACITY,
        clock: 0,
        entries: 0,
        legacy_entries: 0,
        next_node: 0,
        next_namespace: LEGACY_NAMESPACE + 1,
        imports: Vec::new(),
        writer: None,
    }
}

/// Entries in a table, for checks (redb counts by walking the tree).
pub(crate) fn count(table: &impl ReadableTableMetadata) -> Result<u64> {
    table.len().map_err(redb_err("counting entries"))
}
