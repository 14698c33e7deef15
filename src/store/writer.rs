//! The writer's side of a file: the open batch (one redb write transaction), the in-memory
//! copies of the cold records, and every change to the tables. Only the holder of the writer
//! lock (see `index/warm.rs`) writes to redb.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::caches::{NodeCaches, each_named_pair};
use super::codec;
use super::records::{
    DEFAULT_CAPACITY, LEGACY_NAMESPACE, META_KEY, Meta, NamespaceRecord, NodeRecord, OpenBy, read_meta, read_nodes,
};
use super::tables::{
    Entry, FLOOR_KEY, GENERATIONS, HELD, LIVE, META, NAMESPACE_IDS, NAMESPACES, NODE_CAPACITY, NODE_CLOCKS,
    NODE_FLOORS, NODE_IDS, NODES, OTHERS, POSITION_KEY, PREFIXES, RETIRED, STATE, add_member, members, members_row,
    newest_members, table_key,
};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BlockKey, MAX_NODE_BYTES, Namespace, check_len, is_legacy};

/// One `ran`, as queued for the writer.
pub(crate) struct Ran {
    pub namespace: Namespace,
    pub blocks: Arc<[BlockKey]>,
    /// The node's id (the callers hand ids out, in the order they queue them) and name.
    pub node: u32,
    pub name: Arc<str>,
    pub clock: u64,
    /// Every entry with a clock up to this one is evicted once this `ran` is applied (the
    /// callers decide eviction, by 0.1.7's rule, as each `ran` returns: `index/horizon.rs`).
    pub floor: u64,
    /// The blocks of its prompt the node held already, by the clock it last ran them at
    /// (`(clock, blocks)`, from the first block on), for its cache (`store/caches.rs`).
    pub held: Vec<(u64, u64)>,
    /// When the caller made it (for the sync window).
    pub at: Instant,
    /// For a head sharing through a stream: the stream sequence of the event this is (written
    /// with the batch that applies it); 0 for a head's own `ran`.
    pub position: u64,
}

/// A change queued for the writer, in the callers' order.
pub(crate) enum Change {
    Ran(Ran),
    /// `forget_node`: node id `node` (an incarnation) is retired at `clock`.
    Forget {
        node: u32,
        clock: u64,
        at: Instant,
        /// As [`Ran::position`].
        position: u64,
    },
}

impl Change {
    pub(crate) fn clock(&self) -> u64 {
        match self {
            Change::Ran(r) => r.clock,
            Change::Forget { clock, .. } => *clock,
        }
    }

    /// The stream sequence it applies, 0 if none ([`Ran::position`]).
    pub(crate) fn position(&self) -> u64 {
        match self {
            Change::Ran(r) => r.position,
            Change::Forget { position, .. } => *position,
        }
    }

    pub(crate) fn at(&self) -> Instant {
        match self {
            Change::Ran(r) => r.at,
            Change::Forget { at, .. } => *at,
        }
    }

    /// Blocks it writes.
    pub(crate) fn blocks(&self) -> usize {
        match self {
            Change::Ran(r) => r.blocks.len(),
            Change::Forget { .. } => 0,
        }
    }
}

/// Every node incarnation by id (nodes are few, so all of them are kept in memory): its name,
/// whether it was forgotten, and how many blocks name it.
#[derive(Default)]
pub(crate) struct Nodes {
    pub names: Vec<String>,
    /// The current (not retired) id of each name.
    pub ids: HashMap<String, u32>,
    /// By id: the clock it was forgotten at.
    pub retired: Vec<Option<u64>>,
    /// By id: blocks that name it (in the prefix table or among a block's others).
    pub held: Vec<u64>,
    /// Ids whose `held` changed in the batch.
    dirty: BTreeSet<u32>,
    /// Keys whose others row the batch wrote or removed, for the callers' copy of the rows
    /// (`index/others.rs`), dropped once a commit holding them is the callers' view (kept
    /// across a roll back: a superset only costs a read).
    pub others_changed: Vec<u128>,
}

impl Nodes {
    fn add_held(&mut self, node: u32, delta: i64) {
        if let Some(h) = self.held.get_mut(node as usize) {
            *h = h.saturating_add_signed(delta);
            self.dirty.insert(node);
        }
    }
}

/// A batch that was rolled back: the error, and the changes it held.
pub(crate) struct RolledBack {
    pub error: Error,
    pub rans: Vec<Change>,
}

/// Nodes a block keeps by default: the one that ran it last and up to three others.
pub const DEFAULT_NODES_PER_PREFIX: usize = 4;
/// Most nodes a block may be set to keep.
pub const MAX_NODES_PER_PREFIX: usize = 64;

/// What the commit thread keeps: the batch and the cold records as of the batch.
pub(crate) struct Writer {
    /// The batch: every change since the last commit.
    pub txn: Option<WriteTransaction>,
    /// The meta record as of the batch (committed with it).
    pub meta: Meta,
    pub nodes: Nodes,
    pub namespaces: HashMap<[u8; 8], u32>,
    /// The changes in the batch (pushed by whoever applied them), to be forgotten by the overlay
    /// once committed.
    pub applied: Vec<Change>,
    /// Nodes a block keeps (`Builder::nodes_per_prefix`; at least 1).
    pub nodes_per_prefix: usize,
    /// Whether the committed meta record names a writer (this one, or one that crashed).
    marked: bool,
    /// The eviction floor as of the batch: every entry, and every node of a block, seen at or
    /// below it is evicted (kept in the file, so that the others a block still lists from before
    /// it stay evicted across a restart).
    pub floor: u64,
    /// The stream sequence of the last shared event applied, as of the batch (0 for a file that
    /// never shared): written in the same transaction as the event's effects.
    pub position: u64,
    /// `position` as of the last commit (what a failed batch goes back to, even if reading
    /// the file again fails too).
    committed_position: u64,
    /// Each node's cache as of the batch, with the changes the batch has not written yet.
    pub caches: NodeCaches,
}

/// One write to the prefix table.
struct Write {
    key: u128,
    entry: Entry,
    /// Other nodes that wrote the key earlier in the same batch (node id, clock), for its others.
    earlier: Vec<(u32, u64)>,
}

/// What [`write_entries`] did.
#[derive(Default)]
struct Written {
    /// Keys that were not in the table.
    added: u64,
    /// Entries written (all of them, less those kept for a newer clock).
    written: u64,
    /// The newest clock written.
    newest: u64,
}

impl Writer {
    /// Reads the cold records of a committed file into a fresh writer.
    ///
    /// # Errors
    /// As [`Writer::reload`].
    pub(crate) fn load(db: &Database) -> Result<Writer> {
        let mut writer = Writer {
            txn: None,
            meta: Meta::new_file(DEFAULT_CAPACITY),
            nodes: Nodes::default(),
            namespaces: HashMap::new(),
            applied: Vec::new(),
            nodes_per_prefix: DEFAULT_NODES_PER_PREFIX,
            marked: false,
            floor: 0,
            position: 0,
            committed_position: 0,
            caches: NodeCaches::default(),
        };
        writer.reload(db)?;
        Ok(writer)
    }

    /// Drops the batch and reads the committed cold records again (after a failed change).
    ///
    /// # Errors
    /// [`Error::UnknownFormat`] without a meta record; [`Error::Corrupted`], [`Error::Codec`] or
    /// [`Error::Storage`] for records that cannot be read.
    pub(crate) fn reload(&mut self, db: &Database) -> Result<()> {
        if let Some(txn) = self.txn.take() {
            // Rolls back; an abort that fails has nothing left to undo.
            let _ = txn.abort();
        }
        let read = db.begin_read().map_err(redb_err("reading the meta record"))?;
        let meta = read_meta(&read.open_table(META).map_err(redb_err("reading the meta record"))?)?;
        self.meta = meta.ok_or_else(|| Error::unknown_format("no meta record"))?;
        self.marked = self.meta.writer.is_some();
        let state = read.open_table(STATE).map_err(redb_err("reading the floor"))?;
        self.floor = read_floor(&state)?;
        self.position = read_position(&state)?;
        self.committed_position = self.position;
        self.caches = NodeCaches::load(
            &read.open_table(NODE_CLOCKS).map_err(redb_err("reading the node caches"))?,
            &read.open_table(NODE_FLOORS).map_err(redb_err("reading the node caches"))?,
            &read.open_table(NODE_CAPACITY).map_err(redb_err("reading the node caches"))?,
            &state,
            (self.floor, self.meta.next_node),
        )?;
        drop(state);
        // The clock never goes back, whatever the meta record says.
        let generations = read.open_table(GENERATIONS).map_err(redb_err("reading the generations"))?;
        if let Some((last, _)) = generations.last().map_err(redb_err("reading the generations"))? {
            self.meta.clock = self.meta.clock.max(last.value());
        }
        let names = read_nodes(&read.open_table(NODES).map_err(redb_err("reading nodes"))?)?;
        let mut retired = vec![None; names.len()];
        for (id, clock) in by_node(&read.open_table(RETIRED).map_err(redb_err("reading retired nodes"))?, &names)? {
            retired[id] = Some(clock);
        }
        let mut held = vec![0; names.len()];
        for (id, n) in by_node(&read.open_table(HELD).map_err(redb_err("reading node counts"))?, &names)? {
            held[id] = n;
        }
        // The newest live incarnation of each name is its current id.
        let ids = names
            .iter()
            .zip(0..)
            .filter(|&(_, id)| retired[id as usize].is_none())
            .map(|(n, id)| (n.clone(), id))
            .collect();
        self.nodes = Nodes {
            names,
            ids,
            retired,
            held,
            dirty: BTreeSet::new(),
            others_changed: std::mem::take(&mut self.nodes.others_changed),
        };
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

    /// Whether the batch holds changes.
    pub(crate) fn dirty(&self) -> bool {
        self.txn.is_some()
    }

    /// Writes `changes` (oldest first) into the batch, then evicts through the newest floor
    /// they carry. The same as applying them one by one, each `ran` followed by its own
    /// eviction: a later write has a clock past every earlier floor, so evicting "every entry up
    /// to the floor" commutes with it (and a retired node's entries are evicted like any
    /// other). On error the caller rolls the whole batch back ([`Writer::roll_back`]), so no
    /// change is ever half there.
    pub(crate) fn apply(&mut self, db: &Database, changes: &[Change]) -> Result<()> {
        let floor = changes.iter().map(|c| if let Change::Ran(r) = c { r.floor } else { 0 }).max().unwrap_or(0);
        let mut rans: Vec<&Ran> = Vec::new();
        for change in changes {
            match change {
                Change::Ran(ran) => {
                    let blocks = ran.blocks.len() as u64;
                    self.caches.ran((ran.node, &ran.name), ran.clock, blocks, &ran.held, ran.floor);
                    rans.push(ran);
                }
                Change::Forget { node, clock, .. } => {
                    self.apply_merged(db, &std::mem::take(&mut rans), floor)?;
                    self.retire(db, *node, *clock)?;
                    self.caches.forget(*node);
                }
            }
        }
        self.apply_merged(db, &rans, floor)?;
        self.advance_position(db, changes.iter().map(Change::position).max().unwrap_or(0))?;
        if floor > self.floor {
            let (n, legacy) = remove_through(self.txn_and_nodes(db)?, floor)?;
            self.meta.entries = self.meta.entries.saturating_sub(n);
            self.meta.legacy_entries = self.meta.legacy_entries.saturating_sub(legacy);
            self.set_floor(db, floor)?;
        }
        self.caches.drop_through(floor);
        if self.caches.dirty() {
            self.batch(db)?;
        }
        Ok(())
    }

    /// Records the eviction floor in the batch.
    fn set_floor(&mut self, db: &Database, floor: u64) -> Result<()> {
        self.batch(db)?
            .open_table(STATE)
            .and_then(|mut t| t.insert(FLOOR_KEY, floor).map(drop).map_err(Into::into))
            .map_err(redb_err("writing the floor"))?;
        self.floor = floor;
        Ok(())
    }

    /// Lowers the floor to 0 (an import brings 0.1.7's own clocks, which may be older), first
    /// removing from every block's others the nodes seen at or below it, which the floor kept
    /// evicted. A scan of the others table: imports are rare and read a whole file anyway.
    ///
    /// # Errors
    /// [`Error::Storage`].
    pub(crate) fn reset_floor(&mut self, db: &Database) -> Result<()> {
        if self.floor == 0 {
            return Ok(());
        }
        let floor = self.floor;
        let (txn, nodes) = self.txn_and_nodes(db)?;
        let mut others = txn.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        let mut stale = Vec::new();
        for item in others.iter().map_err(redb_err("reading the others"))? {
            let (key, row) = item.map_err(redb_err("reading the others"))?;
            let all: Vec<(u32, u64)> = members(row.value()).collect();
            if all.iter().any(|&(_, c)| c <= floor) {
                stale.push((key.value(), all));
            }
        }
        for (key, all) in stale {
            nodes.others_changed.push(key);
            let (keep, gone): (Vec<_>, Vec<_>) = all.into_iter().partition(|&(_, c)| c > floor);
            for (node, _) in gone {
                nodes.add_held(node, -1);
            }
            if keep.is_empty() {
                others.remove(key).map_err(redb_err("writing the others"))?;
            } else {
                others.insert(key, members_row(&keep).as_slice()).map_err(redb_err("writing the others"))?;
            }
        }
        drop(others);
        self.caches.reset_floor();
        self.set_floor(db, 0)
    }

    /// The batch and the node counts, for the writes that change both.
    fn txn_and_nodes(&mut self, db: &Database) -> Result<(&WriteTransaction, &mut Nodes)> {
        self.batch(db)?;
        match self.txn.as_ref() {
            Some(txn) => Ok((txn, &mut self.nodes)),
            None => Err(Error::Poisoned),
        }
    }

    /// Writes `rans` (oldest first) as one merge: each key once, with its newest write, in key
    /// order, so each leaf page is visited once and a block several of them wrote is written
    /// once (the earlier writers of another node join its others). The result is what applying
    /// them one by one gives, except that a key is listed only in the generation that still
    /// holds it.
    fn apply_merged(&mut self, db: &Database, rans: &[&Ran], floor: u64) -> Result<()> {
        if rans.is_empty() {
            return Ok(());
        }
        let mut namespaces = Vec::with_capacity(rans.len());
        for ran in rans {
            self.ensure_node(db, ran.node, &ran.name)?;
            namespaces.push(self.intern_namespace(db, &ran.namespace)?);
        }
        let mut writes: Vec<Write> = Vec::with_capacity(rans.iter().map(|r| r.blocks.len()).sum());
        for (ran, &namespace) in rans.iter().zip(&namespaces) {
            writes.extend(ran.blocks.iter().zip(1..).map(|(k, depth)| Write {
                key: table_key(k),
                entry: Entry { node: ran.node, namespace, depth, clock: ran.clock },
                earlier: Vec::new(),
            }));
        }
        // Newest write last within a key (a stable sort keeps the order of the `ran`s), then
        // keep it, with the other nodes that wrote the key before it.
        writes.sort_by_key(|w| w.key);
        writes.dedup_by(|later, earlier| {
            if later.key == earlier.key {
                std::mem::swap(later, earlier);
                // Each other node once, with its newest clock (the list stays as short as the
                // nodes are few, however often the batch moved the key).
                let (node, clock) = (later.entry.node, later.entry.clock);
                let keep = earlier.entry.node;
                for member in later.earlier.drain(..).chain([(node, clock)]).filter(|m| m.0 != keep) {
                    add_member(&mut earlier.earlier, member);
                }
                true
            } else {
                false
            }
        });
        let k = self.nodes_per_prefix;
        let (txn, nodes) = self.txn_and_nodes(db)?;
        let written = write_entries(txn, nodes, &writes, false, (k, floor))?;
        self.meta.clock = self.meta.clock.max(written.newest);
        self.meta.entries += written.added;
        Ok(())
    }

    /// Writes 0.1.7 entries (key, node id, clock) into the batch; an entry already there with a
    /// clock at least as new is kept. Returns (entries added, entries written).
    pub(crate) fn apply_legacy(&mut self, db: &Database, entries: &[(BlockKey, u32, u64)]) -> Result<(u64, u64)> {
        let writes: Vec<Write> = entries
            .iter()
            .map(|&(key, node, clock)| Write {
                key: table_key(&key),
                entry: Entry { node, namespace: LEGACY_NAMESPACE, depth: 0, clock },
                earlier: Vec::new(),
            })
            .collect();
        let (k, floor) = (self.nodes_per_prefix, self.floor);
        let (txn, nodes) = self.txn_and_nodes(db)?;
        let written = write_entries(txn, nodes, &writes, true, (k, floor))?;
        self.meta.clock = self.meta.clock.max(written.newest);
        self.meta.entries += written.added;
        self.meta.legacy_entries += written.added;
        Ok((written.added, written.written))
    }

    /// While over capacity, removes the oldest eighth: every entry whose clock is at most the
    /// clock of the `capacity / 8`-th oldest entry (0.1.7's rule). Returns the entries removed.
    ///
    /// # Errors
    /// [`Error::Corrupted`] if the live counts disagree with the meta record; [`Error::Storage`].
    pub(crate) fn evict(&mut self, db: &Database) -> Result<u64> {
        let mut evicted = 0;
        while self.meta.entries > self.meta.capacity {
            let skip = self.meta.capacity / 8;
            let (txn, nodes) = self.txn_and_nodes(db)?;
            let cut = eviction_cut(txn, skip)?;
            let (n, legacy) = remove_through((txn, nodes), cut)?;
            if n == 0 {
                return Err(Error::Corrupted { detail: "eviction found no live entry to remove".into() });
            }
            if cut > self.floor {
                self.set_floor(db, cut)?;
            }
            self.caches.drop_through(cut);
            self.meta.entries = self.meta.entries.saturating_sub(n);
            self.meta.legacy_entries = self.meta.legacy_entries.saturating_sub(legacy);
            evicted += n;
        }
        Ok(evicted)
    }

    /// Sets (or with `None` removes) the default capacity of a node's cache
    /// (`Builder::node_cache_blocks`) in the batch, evicting every current node to its capacity.
    ///
    /// # Errors
    /// [`Error::Storage`].
    pub(crate) fn set_node_cache_default(&mut self, db: &Database, blocks: Option<u64>) -> Result<()> {
        let nodes = &self.nodes;
        let current: Vec<(u32, String)> = nodes
            .names
            .iter()
            .zip(0u32..)
            .filter(|&(_, id)| nodes.retired[id as usize].is_none())
            .map(|(name, id)| (id, name.clone()))
            .collect();
        // Nodes whose cache was not kept (no size) start from what the file names of them (none
        // start without a default).
        let new: Vec<u32> = match blocks {
            Some(_) => current.iter().filter(|(_, name)| !self.caches.tracks(name)).map(|&(id, _)| id).collect(),
            None => Vec::new(),
        };
        let seeds = self.scan_pairs(db, &new)?;
        self.caches.set_default(blocks, current.iter().map(|(id, name)| (*id, name.as_str())), seeds);
        self.batch(db)?;
        Ok(())
    }

    /// Sets the size of node `name`'s cache (`None`: the default again) in the batch, adding the
    /// node if new; a node whose cache was not kept starts from what the file names of it. A
    /// shared event's stream sequence `position` goes with it (0 for a head's own).
    ///
    /// # Errors
    /// As [`Writer::intern_node`]; [`Error::Storage`].
    pub(crate) fn set_node_capacity(
        &mut self,
        db: &Database,
        name: &str,
        blocks: Option<u64>,
        position: u64,
    ) -> Result<()> {
        let id = self.intern_node(db, name)?;
        let seeds = match self.caches.tracks(name) {
            true => Default::default(),
            false => self.scan_pairs(db, &[id])?,
        };
        self.caches.set_capacity((id, name), blocks, seeds);
        self.batch(db)?;
        self.advance_position(db, position)
    }

    /// Records in the batch the stream sequence of the newest shared event it applies (a head's
    /// own changes carry 0).
    fn advance_position(&mut self, db: &Database, position: u64) -> Result<()> {
        if position > self.position {
            self.batch(db)?
                .open_table(STATE)
                .and_then(|mut t| t.insert(POSITION_KEY, position).map(drop).map_err(Into::into))
                .map_err(redb_err("writing the stream position"))?;
            self.position = position;
        }
        Ok(())
    }

    /// Per node of `ids`, the blocks the batch names it on (prefix table or others), by clock,
    /// above the eviction floor and the node's own; 0.1.7's entries are not counted. One scan of
    /// each table (nothing to scan for no ids).
    fn scan_pairs(&mut self, db: &Database, ids: &[u32]) -> Result<BTreeMap<u32, BTreeMap<u64, u64>>> {
        let mut counts: BTreeMap<u32, BTreeMap<u64, u64>> = BTreeMap::new();
        if ids.is_empty() {
            return Ok(counts);
        }
        self.batch(db)?;
        let (floor, caches, Some(txn)) = (self.floor, &self.caches, self.txn.as_ref()) else {
            return Err(Error::Poisoned);
        };
        let mut see = |node: u32, clock: u64| {
            if ids.contains(&node) && clock > floor && clock > caches.floor(node) {
                *counts.entry(node).or_default().entry(clock).or_default() += 1;
            }
        };
        let primary = txn.open_table(PREFIXES).map_err(redb_err("reading the prefix table"))?;
        let others = txn.open_table(OTHERS).map_err(redb_err("reading the others"))?;
        each_named_pair(&primary, Some(&others), &mut see)?;
        Ok(counts)
    }

    /// The current id of node `name`, added to the node tables if new (for imports: `ran`s
    /// come with their ids).
    ///
    /// # Errors
    /// As [`Writer::ensure_node`].
    pub(crate) fn intern_node(&mut self, db: &Database, name: &str) -> Result<u32> {
        if let Some(&id) = self.nodes.ids.get(name) {
            return Ok(id);
        }
        let id = u32::try_from(self.nodes.names.len())
            .map_err(|_| Error::InvalidConfig { detail: "more than 2^32 nodes".into() })?;
        self.ensure_node(db, id, name)?;
        Ok(id)
    }

    /// Makes sure node id `id` is `name`, adding it to the node tables if it is the next id.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Corrupted`] for an id that is another node's or skips
    /// ids; [`Error::InvalidConfig`] past 2^32 nodes; [`Error::Storage`].
    pub(crate) fn ensure_node(&mut self, db: &Database, id: u32, name: &str) -> Result<()> {
        match self.nodes.names.get(id as usize) {
            Some(known) if known == name => return Ok(()),
            Some(known) => {
                return Err(Error::Corrupted { detail: format!("node id {id} is {known:?}, a change names {name:?}") });
            }
            None if id as usize != self.nodes.names.len() => {
                return Err(Error::Corrupted {
                    detail: format!("node id {id} skips ids: {} nodes known", self.nodes.names.len()),
                });
            }
            None => {}
        }
        check_len("node", name.len(), MAX_NODE_BYTES)?;
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
        self.nodes.retired.push(None);
        self.nodes.held.push(0);
        Ok(())
    }

    /// Retires node id `node` at `clock` (`forget_node`): its entries are answered as absent
    /// from now on, and its name gets a new id at its next `ran`. O(1) in its entries: they
    /// stay until evicted, counted by `held` as reclaimable.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for an unknown id; [`Error::Storage`].
    fn retire(&mut self, db: &Database, node: u32, clock: u64) -> Result<()> {
        let Some(name) = self.nodes.names.get(node as usize).cloned() else {
            return Err(Error::Corrupted { detail: format!("forgetting node id {node}, which is unknown") });
        };
        if self.nodes.retired[node as usize].is_some() {
            return Ok(());
        }
        let current = self.nodes.ids.get(&name) == Some(&node);
        let txn = self.batch(db)?;
        txn.open_table(RETIRED)
            .and_then(|mut t| t.insert(node, clock).map(drop).map_err(Into::into))
            .map_err(redb_err("retiring a node"))?;
        if current {
            txn.open_table(NODE_IDS)
                .and_then(|mut t| t.remove(name.as_str()).map(drop).map_err(Into::into))
                .map_err(redb_err("retiring a node"))?;
            self.nodes.ids.remove(&name);
        }
        self.nodes.retired[node as usize] = Some(clock);
        self.meta.clock = self.meta.clock.max(clock);
        Ok(())
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
        Ok(id)
    }

    /// Commits the batch with the meta record, durably, naming this process as the writer (or
    /// no writer when `closing`). Nothing to commit is not an error. On failure the batch is
    /// rolled back, the state is what was committed before, and its `ran`s are returned with the
    /// error.
    pub(crate) fn commit(&mut self, db: &Database, closing: bool) -> std::result::Result<Vec<Change>, Box<RolledBack>> {
        if !(self.dirty() || closing && self.marked) {
            return Ok(std::mem::take(&mut self.applied));
        }
        match self.commit_batch(db, closing) {
            Ok(()) => Ok(std::mem::take(&mut self.applied)),
            Err(e) => Err(self.roll_back(db, e)),
        }
    }

    /// Rolls the batch back after `error`, returning it with the changes the batch held.
    pub(crate) fn roll_back(&mut self, db: &Database, error: Error) -> Box<RolledBack> {
        let rans = std::mem::take(&mut self.applied);
        self.position = self.committed_position;
        match self.reload(db) {
            Ok(()) => Box::new(RolledBack { error, rans }),
            // After an I/O error redb fails the reload too (`PreviousIo`): the first error is the
            // one that says what happened.
            Err(reload) if reload.needs_reopen() && error.needs_reopen() => Box::new(RolledBack { error, rans }),
            Err(reload) => Box::new(RolledBack { error: reload, rans }),
        }
    }

    fn commit_batch(&mut self, db: &Database, closing: bool) -> Result<()> {
        let mut meta = self.meta.clone();
        meta.writer = if closing { None } else { Some(OpenBy { pid: std::process::id() }) };
        let bytes = codec::encode("meta", &meta)?;
        let mut txn = match self.txn.take() {
            Some(txn) => txn,
            None => db.begin_write().map_err(redb_err("starting a batch"))?,
        };
        txn.set_durability(redb::Durability::Immediate).map_err(redb_err("setting durability"))?;
        self.caches.write(&txn)?;
        {
            let mut held = txn.open_table(HELD).map_err(redb_err("writing node counts"))?;
            for &id in &self.nodes.dirty {
                match self.nodes.held.get(id as usize).copied().unwrap_or(0) {
                    0 => held.remove(id).map(drop),
                    n => held.insert(id, n).map(drop),
                }
                .map_err(redb_err("writing node counts"))?;
            }
        }
        txn.open_table(META)
            .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing the meta record"))?;
        txn.commit().map_err(redb_err("committing"))?;
        self.nodes.dirty.clear();
        self.meta = meta;
        self.marked = !closing;
        self.committed_position = self.position;
        Ok(())
    }
}

/// Writes `writes` (each key once) into the prefix table and keeps the clock-ordered tables in
/// step: each write is listed under its clock (in depth order, so a dump shows a generation as
/// its prompt ran), and each generation an overwritten entry leaves loses a live key. A block
/// whose node changes keeps the nodes before in its others (at most `k - 1`, newest first), and
/// the node counts follow. With `keep_newer`, an entry already there with a clock at least as
/// new is kept.
fn write_entries(
    txn: &WriteTransaction,
    nodes: &mut Nodes,
    writes: &[Write],
    keep_newer: bool,
    (k, floor): (usize, u64),
) -> Result<Written> {
    let mut written = Written::default();
    let mut left: HashMap<u64, u32> = HashMap::new();
    let mut listed: BTreeMap<u64, Vec<(u32, u128)>> = BTreeMap::new();
    {
        let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let mut others = txn.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        for w in writes {
            if keep_newer {
                let old = primary.get(w.key).map_err(redb_err("reading a prefix"))?;
                if old.is_some_and(|g| Entry::from_tuple(g.value()).clock >= w.entry.clock) {
                    continue;
                }
            }
            let old = primary.insert(w.key, w.entry.tuple()).map_err(redb_err("writing a prefix"))?;
            let old = old.map(|g| Entry::from_tuple(g.value()));
            match old {
                Some(old) => *left.entry(old.clock).or_default() += 1,
                None => written.added += 1,
            }
            match old {
                // The usual turn: the same node again, so its others (which never include the
                // node of the prefix table) are as they were.
                Some(old) if old.node == w.entry.node && w.earlier.is_empty() => {}
                None if w.earlier.is_empty() => nodes.add_held(w.entry.node, 1),
                _ => change_others(&mut others, nodes, w, old, k, floor)?,
            }
            written.written += 1;
            written.newest = written.newest.max(w.entry.clock);
            listed.entry(w.entry.clock).or_default().push((w.entry.depth, w.key));
        }
    }
    take_live(txn, &left)?;
    for (clock, mut keys) in listed {
        keys.sort_by_key(|&(depth, _)| depth);
        let bytes: Vec<u8> = keys.iter().flat_map(|(_, key)| key.to_be_bytes()).collect();
        list_in_generation(txn, clock, &bytes)?;
    }
    Ok(written)
}

/// A block's others after `w` replaced `old`: the others before, the node it replaced and the
/// batch's earlier writers, less the new node and any seen at or before `floor` (evicted: each
/// node of a block ages out by its own clock), each node once with its newest clock, the `k - 1`
/// newest kept. Which nodes a block names is the same whatever order the writes came in.
fn change_others(
    others: &mut redb::Table<u128, &[u8]>,
    nodes: &mut Nodes,
    w: &Write,
    old: Option<Entry>,
    k: usize,
    floor: u64,
) -> Result<()> {
    let before: Vec<(u32, u64)> = others
        .get(w.key)
        .map_err(redb_err("reading the others"))?
        .map(|g| members(g.value()).collect())
        .unwrap_or_default();
    let mut after: Vec<(u32, u64)> = before.clone();
    after.extend(old.map(|o| (o.node, o.clock)));
    after.extend_from_slice(&w.earlier);
    after.retain(|&(node, clock)| node != w.entry.node && clock > floor);
    newest_members(&mut after, k.saturating_sub(1));
    let named_before: BTreeSet<u32> = before.iter().map(|m| m.0).chain(old.map(|o| o.node)).collect();
    let named_after: BTreeSet<u32> = after.iter().map(|m| m.0).chain([w.entry.node]).collect();
    for &gone in named_before.difference(&named_after) {
        nodes.add_held(gone, -1);
    }
    for &new in named_after.difference(&named_before) {
        nodes.add_held(new, 1);
    }
    if after.is_empty() {
        if !before.is_empty() {
            others.remove(w.key).map_err(redb_err("writing the others"))?;
        }
    } else if after != before {
        others.insert(w.key, members_row(&after).as_slice()).map_err(redb_err("writing the others"))?;
    }
    if after != before {
        nodes.others_changed.push(w.key);
    }
    Ok(())
}

/// The clock of the entry after the `skip` oldest live ones: every entry up to it goes. Found by
/// summing live counts oldest first.
fn eviction_cut(txn: &WriteTransaction, skip: u64) -> Result<u64> {
    let live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let mut seen = 0u64;
    for item in live.iter().map_err(redb_err("reading the live counts"))? {
        let (clock, count) = item.map_err(redb_err("reading the live counts"))?;
        seen += u64::from(count.value());
        if seen > skip {
            return Ok(clock.value());
        }
    }
    Err(Error::Corrupted { detail: "the live counts add up to fewer entries than the meta record counts".into() })
}

/// Removes every entry with a clock up to `cut`, with its block's others, and every generation
/// and live count up to it. 0.1.7's rule removes an eighth of the entries at a time, from nearly
/// every leaf page of the prefix table: one pass over the table (redb's `retain`, which rewrites
/// each page once) costs a few comparisons an entry, where a lookup and a removal per victim
/// walked the tree twice each. Returns (entries removed, of which 0.1.7's).
fn remove_through((txn, nodes): (&WriteTransaction, &mut Nodes), cut: u64) -> Result<(u64, u64)> {
    let mut generations = txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
    let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
    let mut others = txn.open_table(OTHERS).map_err(redb_err("opening the others"))?;
    generations.retain_in(..=cut, |_, _| false).map_err(redb_err("evicting"))?;
    live.retain_in(..=cut, |_, _| false).map_err(redb_err("evicting"))?;
    let mut removed: Vec<(u128, u32)> = Vec::new();
    primary
        .retain(|key, (node, _, _, clock)| {
            let keep = clock > cut;
            if !keep {
                removed.push((key, node));
            }
            keep
        })
        .map_err(redb_err("evicting"))?;
    let mut legacy = 0u64;
    for &(key, node) in &removed {
        nodes.add_held(node, -1);
        legacy += u64::from(is_legacy(&key.to_be_bytes()));
    }
    if others.first().map_err(redb_err("evicting"))?.is_some() {
        let gone: HashSet<u128> = removed.iter().map(|&(key, _)| key).collect();
        let mut members_gone: Vec<u32> = Vec::new();
        let mut changed: Vec<u128> = Vec::new();
        others
            .retain(|key, row| {
                let keep = !gone.contains(&key);
                if !keep {
                    members_gone.extend(members(row).map(|(node, _)| node));
                    changed.push(key);
                }
                keep
            })
            .map_err(redb_err("evicting"))?;
        for node in members_gone {
            nodes.add_held(node, -1);
        }
        nodes.others_changed.extend(changed);
    }
    Ok((removed.len() as u64, legacy))
}

/// Takes `n` live keys from each generation in `left` (their keys were rewritten at a newer
/// clock); a generation left with none goes.
fn take_live(txn: &WriteTransaction, left: &HashMap<u64, u32>) -> Result<()> {
    if left.is_empty() {
        return Ok(());
    }
    let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    for (&clock, &n) in left {
        let count = live.get(clock).map_err(redb_err("reading the live counts"))?.map(|g| g.value());
        let Some(count) = count.filter(|&c| c >= n) else {
            return Err(Error::Corrupted {
                detail: format!("generation {clock} has fewer live keys than were rewritten"),
            });
        };
        if count == n {
            live.remove(clock).map_err(redb_err("writing the live counts"))?;
            txn.open_table(GENERATIONS)
                .and_then(|mut t| t.remove(clock).map(drop).map_err(Into::into))
                .map_err(redb_err("writing the generations"))?;
        } else {
            live.insert(clock, count - n).map_err(redb_err("writing the live counts"))?;
        }
    }
    Ok(())
}

/// Lists `keys` (16 bytes each, each once) under `clock`, after any already listed there.
fn list_in_generation(txn: &WriteTransaction, clock: u64, keys: &[u8]) -> Result<()> {
    if keys.is_empty() {
        return Ok(());
    }
    let mut generations = txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
    let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let before = generations.get(clock).map_err(redb_err("reading the generations"))?.map(|g| g.value().to_vec());
    let count = live.get(clock).map_err(redb_err("reading the live counts"))?.map_or(0, |g| g.value());
    let added = u32::try_from(keys.len() / 16).unwrap_or(u32::MAX);
    match before {
        Some(mut all) => {
            all.extend_from_slice(keys);
            generations.insert(clock, all.as_slice()).map_err(redb_err("writing the generations"))?;
        }
        None => {
            generations.insert(clock, keys).map_err(redb_err("writing the generations"))?;
        }
    }
    live.insert(clock, count.saturating_add(added)).map_err(redb_err("writing the live counts"))?;
    Ok(())
}

/// The rows of a table keyed by node id (retired nodes, node counts), each id checked against
/// the node records `names`.
///
/// # Errors
/// [`Error::Corrupted`] for an id with no node record; [`Error::Storage`].
fn by_node(table: &impl ReadableTable<u32, u64>, names: &[String]) -> Result<Vec<(usize, u64)>> {
    let mut rows = Vec::new();
    for item in table.iter().map_err(redb_err("reading a node table"))? {
        let (id, value) = item.map_err(redb_err("reading a node table"))?;
        let id = id.value() as usize;
        if id >= names.len() {
            return Err(Error::Corrupted { detail: format!("node id {id} has a row and no node record") });
        }
        rows.push((id, value.value()));
    }
    Ok(rows)
}

/// The eviction floor in `table` (the state table), 0 if none was written.
///
/// # Errors
/// [`Error::Storage`].
pub(crate) fn read_floor(table: &impl ReadableTable<&'static str, u64>) -> Result<u64> {
    Ok(table.get(FLOOR_KEY).map_err(redb_err("reading the floor"))?.map_or(0, |g| g.value()))
}

/// The stream sequence of the last shared event a file applied (0 if it never shared).
///
/// # Errors
/// [`Error::Storage`].
pub(crate) fn read_position(table: &impl ReadableTable<&'static str, u64>) -> Result<u64> {
    Ok(table.get(POSITION_KEY).map_err(redb_err("reading the stream position"))?.map_or(0, |g| g.value()))
}

/// Entries in a table, for checks (redb counts by walking the tree).
///
/// # Errors
/// [`Error::Storage`].
pub(crate) fn count(table: &impl ReadableTableMetadata) -> Result<u64> {
    table.len().map_err(redb_err("counting entries"))
}
