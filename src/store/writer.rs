//! The writer: the open batch (one redb write transaction) and the one write sequence that
//! persists effects (`decided/effect.rs`). The callers decided every change and state its
//! results; the writer keeps the file's own bookkeeping in step (generations, live counts,
//! others rows by the one node-set rule, node counts, the meta record's counts). Only the holder
//! of the writer lock (see `index/warm.rs`) writes to redb.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::codec;
use super::records::{
    DEFAULT_CAPACITY, Import, LEGACY_NAMESPACE, META_KEY, Meta, NamespaceRecord, NodeRecord, OpenBy, read_meta,
};
use super::tables::{
    ENGINE_BLOCKS, ENGINE_GROUP_BLOCKS, ENGINE_GROUPS, ENGINE_STREAMS, Entry, FLOOR_KEY, GENERATIONS, HELD, LIVE, META,
    NAMESPACE_IDS, NAMESPACES, NODE_CACHE_KEY, NODE_CAPACITY, NODE_CLOCKS, NODE_FLOORS, NODE_IDS, NODES, OTHERS,
    POSITION_KEY, PREFIXES, RETIRED, STATE, members, members_row, table_key,
};
use crate::decided::effect::Effect;
use crate::decided::engines::{BlockRowKey, GroupKind, StreamRecord, encode_kind};
use crate::decided::import_keeps;
use crate::decided::node_set::{add_member, leaves_others, names_only_its_own, rewrite};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BlockKey, Namespace};

/// Nodes a block keeps by default: the one that ran it last and up to three others.
pub const DEFAULT_NODES_PER_PREFIX: usize = 4;
/// Most nodes a block may be set to keep.
pub const MAX_NODES_PER_PREFIX: usize = 64;

/// What the batch's rows change in how many blocks name each node id: added to the file's
/// `held/v4` counts at the commit (the file keeps the counts; the batch only their changes).
#[derive(Default)]
pub(crate) struct Held {
    /// By id: blocks the batch made name it, less those it made stop.
    delta: Vec<i64>,
    /// Ids whose count the batch changed.
    dirty: BTreeSet<u32>,
    /// Keys whose others row the batch wrote or removed, for the callers' copy of the rows
    /// (`index/others.rs`), taken by whoever installs the commit that holds them (kept across
    /// a roll back: a superset only costs a read).
    pub others_changed: Vec<u128>,
}

impl Held {
    fn add(&mut self, node: u32, delta: i64) {
        let i = node as usize;
        if self.delta.len() <= i {
            self.delta.resize(i + 1, 0);
        }
        if let Some(d) = self.delta.get_mut(i) {
            *d += delta;
            self.dirty.insert(node);
        }
    }

    /// Node `id`'s count after the batch, of `stored` in the file (never below 0: a count a
    /// damaged file got wrong is a figure `check` reports, not a reason to stop writing).
    fn after(&self, id: u32, stored: u64) -> u64 {
        stored.saturating_add_signed(self.delta.get(id as usize).copied().unwrap_or(0))
    }
}

/// The node cache rows the batch has changed, coalesced: a row is written once, with its last
/// value, and not at all if the batch made and dropped it.
#[derive(Default)]
struct CacheRows {
    /// (node, clock) → (the row before the batch, its value now).
    clocks: BTreeMap<(u32, u64), (u64, u64)>,
    floors: BTreeMap<u32, u64>,
    capacity: BTreeMap<Arc<str>, Option<u64>>,
    default: Option<Option<u64>>,
}

impl CacheRows {
    fn is_empty(&self) -> bool {
        self.clocks.is_empty() && self.floors.is_empty() && self.capacity.is_empty() && self.default.is_none()
    }
}

/// The engine rows the batch has changed, coalesced: each written once, with its last value.
#[derive(Default)]
struct EngineRows {
    /// Nodes whose engine blocks all went, hybrid or not (before the rows below, which came
    /// after).
    clears: BTreeSet<u32>,
    /// (node, store clock, engine hash) and the row (`None`: removed), in the order written:
    /// sorted and coalesced (the last write of a key wins) when the batch is written.
    blocks: Vec<(BlockRowKey, Option<Arc<[u8]>>)>,
    /// A hybrid engine's block rows, as `blocks`.
    hybrid: Vec<(BlockRowKey, Option<Arc<[u8]>>)>,
    /// Node → all its KV cache groups (none: the node was forgotten).
    groups: BTreeMap<u32, Arc<[(u32, GroupKind)]>>,
    /// Node → its stream row (`None`: removed).
    streams: BTreeMap<u32, Option<Arc<StreamRecord>>>,
}

impl EngineRows {
    fn is_empty(&self) -> bool {
        self.clears.is_empty()
            && self.blocks.is_empty()
            && self.hybrid.is_empty()
            && self.groups.is_empty()
            && self.streams.is_empty()
    }
}

/// The effects of a batch not yet written into its transaction: puts are merged (each key
/// once, its newest write) and written with the eviction they meet, at the commit, so that a
/// key written and evicted within one batch is never inserted.
#[derive(Default)]
struct Unwritten {
    puts: Vec<(u32, Arc<[BlockKey]>, u32, u64)>,
    /// The newest floor of the batch's evictions.
    floor: u64,
    /// Each clock's live count as last stated (written after the eviction: a clock it takes
    /// is not written).
    live: BTreeMap<u64, u64>,
}

/// A batch that was rolled back: the error (the effects it held are the caller's to retry).
pub(crate) struct RolledBack {
    pub error: Error,
}

/// What the commit thread keeps: the batch and the file's records as of the batch.
pub(crate) struct Writer {
    /// The batch: every effect written since the last commit.
    txn: Option<WriteTransaction>,
    /// The meta record as of the batch (committed with it).
    pub meta: Meta,
    pub held: Held,
    /// Nodes a block keeps (`Builder::nodes_per_prefix`; at least 1).
    pub nodes_per_prefix: usize,
    /// Whether the committed meta record names a writer (this one, or one that crashed).
    marked: bool,
    /// The stream sequence of the last shared event applied, as of the batch (0 for a file that
    /// never shared): written in the same transaction as the event's effects.
    pub position: u64,
    /// `position` as of the last commit (what a failed batch goes back to, even if reading
    /// the file again fails too).
    committed_position: u64,
    unwritten: Unwritten,
    /// The buffer a batch's puts are sorted in, kept for the next (a large allocation made
    /// again at every commit leaves the allocator's heap fragmented).
    order: Vec<[u64; 3]>,
    rows: CacheRows,
    engines: EngineRows,
}

/// One write to the prefix table.
#[derive(Clone)]
struct Write {
    key: u128,
    entry: Entry,
}

/// The other nodes that wrote a key earlier in the batch (node id, clock), for its others: only
/// keys whose node changed within the batch have a list.
type Earlier = HashMap<u128, Vec<(u32, u64)>>;

/// What [`write_entries`] did.
#[derive(Default)]
struct Written {
    /// With `keep_newer`, each write's fate: `None` if kept out by a newer clock, else the
    /// clock of the entry it replaced (`Some(None)`: a new key). Empty without: all were written.
    fates: Vec<Option<Option<u64>>>,
}

impl Writer {
    /// Reads the records of a committed file into a fresh writer.
    ///
    /// # Errors
    /// As [`Writer::reload`].
    pub(crate) fn load(db: &Database, nodes_per_prefix: usize) -> Result<Writer> {
        let mut writer = Writer {
            txn: None,
            meta: Meta::new_file(DEFAULT_CAPACITY),
            held: Held::default(),
            nodes_per_prefix,
            marked: false,
            position: 0,
            committed_position: 0,
            unwritten: Unwritten::default(),
            order: Vec::new(),
            rows: CacheRows::default(),
            engines: EngineRows::default(),
        };
        writer.reload(db)?;
        Ok(writer)
    }

    /// Drops the batch and reads the committed records again (after a failed change).
    ///
    /// # Errors
    /// [`Error::UnknownFormat`] without a meta record; [`Error::Corrupted`], [`Error::Codec`] or
    /// [`Error::Storage`] for records that cannot be read.
    pub(crate) fn reload(&mut self, db: &Database) -> Result<()> {
        if let Some(txn) = self.txn.take() {
            // Rolls back; an abort that fails has nothing left to undo.
            let _ = txn.abort();
        }
        self.unwritten = Unwritten::default();
        self.rows = CacheRows::default();
        self.engines = EngineRows::default();
        let read = db.begin_read().map_err(redb_err("reading the meta record"))?;
        let meta = read_meta(&read.open_table(META).map_err(redb_err("reading the meta record"))?)?;
        self.meta = meta.ok_or_else(|| Error::unknown_format("no meta record"))?;
        self.marked = self.meta.writer.is_some();
        let state = read.open_table(STATE).map_err(redb_err("reading the stream position"))?;
        self.position = read_position(&state)?;
        self.committed_position = self.position;
        self.held = Held { others_changed: std::mem::take(&mut self.held.others_changed), ..Held::default() };
        Ok(())
    }

    /// The open batch, begun if there is none.
    fn batch(&mut self, db: &Database) -> Result<&WriteTransaction> {
        if self.txn.is_none() {
            self.txn = Some(db.begin_write().map_err(redb_err("starting a batch"))?);
        }
        self.txn.as_ref().ok_or(Error::Poisoned)
    }

    /// Blocks that name each node id, by id, as of the batch: the file's counts as last
    /// committed and what the batch changes in them.
    ///
    /// # Errors
    /// [`Error::Storage`]; [`Error::Corrupted`] for a count of a node id the file never handed
    /// out.
    pub(crate) fn node_counts(&self, db: &Database) -> Result<Vec<u64>> {
        const READ: &str = "reading node counts";
        let read = db.begin_read().map_err(redb_err(READ))?;
        let stored = by_node(&read.open_table(HELD).map_err(redb_err(READ))?, self.meta.next_node)?;
        let mut counts = vec![0; self.meta.next_node as usize];
        for (id, n) in stored {
            if let Some(c) = counts.get_mut(id) {
                *c = n;
            }
        }
        for (id, c) in (0u32..).zip(counts.iter_mut()) {
            *c = self.held.after(id, *c);
        }
        Ok(counts)
    }

    /// Whether the 0.1.7 file of digest `source` was imported before.
    pub(crate) fn imported(&self, source: &[u8; 32]) -> bool {
        self.meta.imports.iter().any(|i| i.source == *source)
    }

    /// Records in the batch that the 0.1.7 file of digest `source` was imported, `entries`
    /// written.
    pub(crate) fn note_import(&mut self, source: [u8; 32], entries: u64) {
        self.meta.imports.push(Import { source, entries });
    }

    /// Whether the batch holds effects.
    pub(crate) fn dirty(&self) -> bool {
        self.txn.is_some()
            || !self.unwritten.puts.is_empty()
            || self.unwritten.floor > 0
            || !self.unwritten.live.is_empty()
            || !self.rows.is_empty()
            || !self.engines.is_empty()
    }

    /// Takes `effects` (in the order they were decided) into the batch, with the stream
    /// sequence of the newest shared event they carry out (`position`, 0 for none). Puts and
    /// the eviction wait for [`Writer::write`] (at the latest, the commit); the rest is written
    /// now. On error the caller rolls the whole batch back ([`Writer::roll_back`]), so no
    /// change is ever half there.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for a node id that is not the next or a known one;
    /// [`Error::Storage`].
    pub(crate) fn apply(&mut self, db: &Database, effects: &[Effect], position: u64) -> Result<()> {
        for effect in effects {
            match effect {
                Effect::Put { namespace, blocks, node, clock } => {
                    self.meta.clock = *clock;
                    self.unwritten.puts.push((*namespace, Arc::clone(blocks), *node, *clock));
                }
                Effect::Namespace { id, namespace } => self.add_namespace(db, *id, namespace)?,
                Effect::Live { counts, entries, legacy_entries } => {
                    self.unwritten.live.extend(counts.iter().copied());
                    (self.meta.entries, self.meta.legacy_entries) = (*entries, *legacy_entries);
                }
                Effect::Clock { clock } => self.meta.clock = *clock,
                Effect::LowerFloor => self.lower_floor(db)?,
                Effect::Evict { floor, entries, legacy_entries, clock } => {
                    self.unwritten.floor = self.unwritten.floor.max(*floor);
                    (self.meta.entries, self.meta.legacy_entries, self.meta.clock) =
                        (*entries, *legacy_entries, *clock);
                }
                Effect::Node { id, name } => self.add_node(db, *id, name)?,
                Effect::Retire { node, name, clock } => self.retire(db, *node, name, *clock)?,
                Effect::CacheClock { node, clock, blocks, was } => {
                    self.rows.clocks.entry((*node, *clock)).or_insert((*was, 0)).1 = *blocks;
                }
                Effect::CacheFloor { node, floor } => {
                    self.rows.floors.insert(*node, *floor);
                }
                Effect::Capacity { name, blocks } => {
                    self.rows.capacity.insert(Arc::clone(name), *blocks);
                }
                Effect::CacheDefault { blocks } => self.rows.default = Some(*blocks),
                Effect::EngineBlock { node, clock, hash, row } => {
                    self.engines.blocks.push(((*node, *clock, *hash), row.clone()));
                }
                Effect::EngineStream { node, row, clock } => {
                    self.meta.clock = *clock;
                    self.engines.streams.insert(*node, Some(Arc::clone(row)));
                }
                Effect::EngineClear { node, stream } => {
                    self.engines.blocks.retain(|&((n, _, _), _)| n != *node);
                    self.engines.hybrid.retain(|&((n, _, _), _)| n != *node);
                    self.engines.clears.insert(*node);
                    self.engines.streams.insert(*node, stream.clone());
                    if stream.is_none() {
                        self.engines.groups.insert(*node, Arc::from([]));
                    }
                }
                Effect::HybridBlock { node, clock, hash, row } => {
                    self.engines.hybrid.push(((*node, *clock, *hash), row.clone()));
                }
                Effect::EngineGroups { node, kinds } => {
                    self.engines.groups.insert(*node, Arc::clone(kinds));
                }
            }
        }
        if position > self.position {
            self.put_state(db, POSITION_KEY, position, "writing the stream position")?;
            self.position = position;
        }
        Ok(())
    }

    /// Writes `value` under `key` in the batch's state table.
    fn put_state(&mut self, db: &Database, key: &str, value: u64, what: &'static str) -> Result<()> {
        self.batch(db)?
            .open_table(STATE)
            .and_then(|mut t| t.insert(key, value).map(drop).map_err(Into::into))
            .map_err(redb_err(what))
    }

    /// Writes what the batch holds unwritten: its puts as one merge (each key once, its newest
    /// write, in key order, so each leaf page is visited once; a key the batch's eviction takes
    /// is not written at all), then the eviction, then the node cache rows. The same file as
    /// writing each change and its eviction one by one: a later put has a clock past every
    /// earlier floor, so "remove everything up to the floor" commutes with it.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for counts the file contradicts; [`Error::Storage`].
    pub(crate) fn write(&mut self, db: &Database) -> Result<()> {
        let Unwritten { puts, floor: evict, live } = std::mem::take(&mut self.unwritten);
        if !puts.is_empty() || evict > 0 || !live.is_empty() {
            // The floor is the file's (an eviction effect states a new one): none kept beside it.
            let committed = self.floor(db)?;
            let floor = evict.max(committed);
            self.write_puts(db, &puts, floor)?;
            if floor > committed {
                let (txn, held) = self.txn_and_held(db)?;
                remove_through((txn, held), floor)?;
                self.put_state(db, FLOOR_KEY, floor, "writing the floor")?;
            }
            write_live(self.batch(db)?, live.range(floor + 1..))?;
        }
        let rows = std::mem::take(&mut self.rows);
        if !rows.is_empty() {
            let txn = self.batch(db)?;
            write_cache_rows(txn, rows)?;
        }
        let engines = std::mem::take(&mut self.engines);
        if !engines.is_empty() {
            let txn = self.batch(db)?;
            write_engine_rows(txn, engines)?;
        }
        Ok(())
    }

    /// Writes `puts` (oldest first) merged: each key once, with its newest write (the earlier
    /// writers of another node join its others), those at or below `floor` not at all. Each
    /// put's written keys are listed under its clock, in depth order.
    fn write_puts(&mut self, db: &Database, puts: &[(u32, Arc<[BlockKey]>, u32, u64)], floor: u64) -> Result<()> {
        let puts: Vec<_> = puts.iter().filter(|p| p.3 > floor).collect();
        if puts.is_empty() {
            return Ok(());
        }
        // Each block a (key, rank) pair, its put and place in the chain in the rank: sorted,
        // a key's newest write comes first (a put writes a key once, and puts come in clock
        // order). Small pairs sort fast; the entries are made for the writes kept.
        let mut firsts = Vec::with_capacity(puts.len());
        let total = puts.iter().fold(0, |at, p| {
            firsts.push(at);
            at + p.1.len()
        });
        // [key's high half, low half, rank]: 24 bytes, in the buffer of the batch before.
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        order.reserve(total);
        for (put, (_, blocks, _, _)) in (0u64..).zip(&puts) {
            order.extend((0u64..).zip(blocks.iter()).map(|(i, k)| {
                let key = table_key(k);
                [(key >> 64) as u64, key as u64, !(put << 32 | i)]
            }));
        }
        order.sort_unstable();
        let place = |rank: u64| -> (usize, usize) { ((!rank >> 32) as usize, (!rank & 0xFFFF_FFFF) as usize) };
        let write = |&[hi, lo, rank]: &[u64; 3]| -> Option<Write> {
            let key = u128::from(hi) << 64 | u128::from(lo);
            let (put, i) = place(rank);
            let (namespace, _, node, clock) = puts.get(put)?;
            let entry = Entry { node: *node, namespace: *namespace, depth: i as u32 + 1, clock: *clock };
            Some(Write { key, entry })
        };
        // The other nodes that wrote a key before its newest write join its earlier writers,
        // each once with its newest clock.
        let mut earlier = Earlier::default();
        let same_key = |a: &[u64; 3], b: &[u64; 3]| a[..2] == b[..2];
        for group in order.chunk_by(same_key).filter(|g| g.len() > 1) {
            let mut writes = group.iter().filter_map(write);
            let Some(newest) = writes.next() else { continue };
            for w in writes.filter(|w| w.entry.node != newest.entry.node) {
                add_member(earlier.entry(newest.key).or_default(), (w.entry.node, w.entry.clock));
            }
        }
        order.dedup_by(|a, b| same_key(a, b));
        let k = self.nodes_per_prefix;
        let (txn, held) = self.txn_and_held(db)?;
        write_entries(txn, held, order.iter().filter_map(write), &earlier, false, (k, floor))?;
        // Each put's keys that were written (a bit a block, at the put's first block plus its
        // place in the chain), listed under its clock in depth order.
        let mut kept = vec![false; total];
        for &[_, _, rank] in &order {
            let (put, i) = place(rank);
            if let Some(bit) = firsts.get(put).and_then(|first| kept.get_mut(first + i)) {
                *bit = true;
            }
        }
        let mut bits = kept.as_slice();
        for same_clock in puts.chunk_by(|a, b| a.3 == b.3) {
            let mut listed: Vec<(u32, u128)> = Vec::new();
            for (_, blocks, _, _) in same_clock {
                let (these, rest) = bits.split_at(blocks.len().min(bits.len()));
                bits = rest;
                let written = blocks.iter().zip(these).zip(1..).filter(|((_, bit), _)| **bit);
                listed.extend(written.map(|((key, _), depth)| (depth, table_key(key))));
            }
            if same_clock.len() > 1 {
                listed.sort_unstable();
            }
            let clock = same_clock.first().map_or(0, |p| p.3);
            let bytes: Vec<u8> = listed.iter().flat_map(|(_, key)| key.to_be_bytes()).collect();
            list_in_generation(txn, clock, &bytes)?;
        }
        self.order = order;
        Ok(())
    }

    /// The eviction floor as of the batch (in the file, so that the others a block still lists
    /// from before it stay evicted across a restart).
    fn floor(&mut self, db: &Database) -> Result<u64> {
        let state = self.batch(db)?.open_table(STATE).map_err(redb_err("reading the floor"))?;
        read_floor(&state)
    }

    /// Lowers the floor to 0 ([`Effect::LowerFloor`]), first removing from every block's others
    /// the nodes seen at or below it, which the floor kept evicted. A scan of the others table:
    /// imports are rare and read a whole file anyway.
    ///
    /// # Errors
    /// [`Error::Storage`].
    fn lower_floor(&mut self, db: &Database) -> Result<()> {
        self.write(db)?;
        let floor = self.floor(db)?;
        if floor == 0 {
            return Ok(());
        }
        let (txn, held) = self.txn_and_held(db)?;
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
            held.others_changed.push(key);
            let (keep, gone): (Vec<_>, Vec<_>) = all.into_iter().partition(|&(_, c)| c > floor);
            for (node, _) in gone {
                held.add(node, -1);
            }
            if keep.is_empty() {
                others.remove(key).map_err(redb_err("writing the others"))?;
            } else {
                others.insert(key, members_row(&keep).as_slice()).map_err(redb_err("writing the others"))?;
            }
        }
        drop(others);
        self.put_state(db, FLOOR_KEY, 0, "writing the floor")
    }

    /// The batch and the node counts, for the writes that change both.
    fn txn_and_held(&mut self, db: &Database) -> Result<(&WriteTransaction, &mut Held)> {
        self.batch(db)?;
        match self.txn.as_ref() {
            Some(txn) => Ok((txn, &mut self.held)),
            None => Err(Error::Poisoned),
        }
    }

    /// Writes 0.1.7 entries (key, node id, clock) into the batch; an entry already there with a
    /// clock at least as new is kept. Returns each entry written: the clock of the entry it
    /// replaced (`None`: a new key) and its own, for the decided state to count
    /// ([`crate::decided::Decided::import_entries`], whose effects set the live counts).
    ///
    /// # Errors
    /// [`Error::Storage`].
    pub(crate) fn write_legacy(
        &mut self,
        db: &Database,
        entries: &[(BlockKey, u32, u64)],
    ) -> Result<Vec<(Option<u64>, u64)>> {
        self.write(db)?;
        let writes: Vec<Write> = entries
            .iter()
            .map(|&(key, node, clock)| Write {
                key: table_key(&key),
                entry: Entry { node, namespace: LEGACY_NAMESPACE, depth: 0, clock },
            })
            .collect();
        let (k, floor) = (self.nodes_per_prefix, self.floor(db)?);
        let (txn, held) = self.txn_and_held(db)?;
        let written = write_entries(txn, held, writes.iter().map(Write::clone), &Earlier::default(), true, (k, floor))?;
        // Listed under their clocks, each generation in the order written.
        let mut listed: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
        let mut done = Vec::new();
        for (w, fate) in writes.iter().zip(&written.fates) {
            if let Some(replaced) = fate {
                listed.entry(w.entry.clock).or_default().extend_from_slice(&w.key.to_be_bytes());
                done.push((*replaced, w.entry.clock));
            }
        }
        for (clock, bytes) in listed {
            list_in_generation(txn, clock, &bytes)?;
        }
        Ok(done)
    }

    /// Writes node record `id` = `name`: the next id.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for an id that is not the next; [`Error::InvalidConfig`] past 2^32
    /// nodes; [`Error::Storage`].
    fn add_node(&mut self, db: &Database, id: u32, name: &str) -> Result<()> {
        if id != self.meta.next_node {
            return Err(Error::Corrupted {
                detail: format!("a change adds node id {id}, and the file's next is {}", self.meta.next_node),
            });
        }
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
        Ok(())
    }

    /// Records that node id `node`, the current incarnation of `name`, was forgotten at
    /// `clock`. O(1) in its entries: they stay until evicted, counted by `held` as reclaimable.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for an id the file never handed out; [`Error::Storage`].
    fn retire(&mut self, db: &Database, node: u32, name: &str, clock: u64) -> Result<()> {
        if node >= self.meta.next_node {
            return Err(Error::Corrupted { detail: format!("forgetting node id {node}, which is unknown") });
        }
        let txn = self.batch(db)?;
        txn.open_table(RETIRED)
            .and_then(|mut t| t.insert(node, clock).map(drop).map_err(Into::into))
            .map_err(redb_err("retiring a node"))?;
        txn.open_table(NODE_IDS)
            .and_then(|mut t| t.remove(name).map(drop).map_err(Into::into))
            .map_err(redb_err("retiring a node"))?;
        self.meta.clock = clock;
        Ok(())
    }

    /// Writes namespace record `id` = `namespace`: the next id.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for an id that is not the next; [`Error::InvalidConfig`] past 2^32
    /// namespaces; [`Error::Storage`].
    fn add_namespace(&mut self, db: &Database, id: u32, namespace: &Namespace) -> Result<()> {
        let next = self.meta.next_namespace.max(LEGACY_NAMESPACE + 1);
        if id != next {
            return Err(Error::Corrupted {
                detail: format!("a change adds namespace id {id}, and the file's next is {next}"),
            });
        }
        self.meta.next_namespace =
            id.checked_add(1).ok_or_else(|| Error::InvalidConfig { detail: "more than 2^32 namespaces".into() })?;
        let public = namespace.id();
        let record =
            NamespaceRecord { model: namespace.model().to_string(), tenant: namespace.has_tenant(), id: public };
        let bytes = codec::encode("namespace", &record)?;
        let txn = self.batch(db)?;
        txn.open_table(NAMESPACES)
            .and_then(|mut t| t.insert(id, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a namespace"))?;
        txn.open_table(NAMESPACE_IDS)
            .and_then(|mut t| t.insert(public, id).map(drop).map_err(Into::into))
            .map_err(redb_err("writing a namespace"))?;
        Ok(())
    }

    /// Writes what is unwritten and commits the batch with the meta record, durably, naming
    /// this process as the writer (or no writer when `closing`). Nothing to commit is not an
    /// error. On failure the batch is rolled back and the writer is as of the commit before
    /// (the caller retries the effects).
    ///
    /// # Errors
    /// The commit's error, with the batch rolled back.
    pub(crate) fn commit(&mut self, db: &Database, closing: bool) -> std::result::Result<(), Box<RolledBack>> {
        if !(self.dirty() || closing && self.marked) {
            return Ok(());
        }
        match self.write(db).and_then(|()| self.commit_batch(db, closing)) {
            Ok(()) => Ok(()),
            Err(e) => Err(self.roll_back(db, e)),
        }
    }

    /// Rolls the batch back after `error`.
    pub(crate) fn roll_back(&mut self, db: &Database, error: Error) -> Box<RolledBack> {
        self.position = self.committed_position;
        match self.reload(db) {
            Ok(()) => Box::new(RolledBack { error }),
            // After an I/O error redb fails the reload too (`PreviousIo`): the first error is the
            // one that says what happened.
            Err(reload) if reload.needs_reopen() && error.needs_reopen() => Box::new(RolledBack { error }),
            Err(reload) => Box::new(RolledBack { error: reload }),
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
        {
            let mut held = txn.open_table(HELD).map_err(redb_err("writing node counts"))?;
            for &id in &self.held.dirty {
                let stored = held.get(id).map_err(redb_err("reading node counts"))?.map_or(0, |g| g.value());
                match self.held.after(id, stored) {
                    n if n == stored => Ok(()),
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
        self.held = Held { others_changed: std::mem::take(&mut self.held.others_changed), ..Held::default() };
        self.meta = meta;
        self.marked = !closing;
        self.committed_position = self.position;
        Ok(())
    }
}

/// Writes the engine rows a batch changed: the clears, then each row once with its last value.
fn write_engine_rows(txn: &WriteTransaction, rows: EngineRows) -> Result<()> {
    const WRITE: &str = "writing the engine rows";
    let EngineRows { clears, blocks, hybrid, groups, streams } = rows;
    for (table, mut written) in [(ENGINE_BLOCKS, blocks), (ENGINE_GROUP_BLOCKS, hybrid)] {
        let mut blocks = txn.open_table(table).map_err(redb_err(WRITE))?;
        for &node in &clears {
            blocks.retain_in((node, 0, 0)..=(node, u64::MAX, u64::MAX), |_, _| false).map_err(redb_err(WRITE))?;
        }
        // Stable: a key's writes keep their order, and the last of each run is the one kept.
        written.sort_by_key(|&(key, _)| key);
        let mut written = written.into_iter().peekable();
        while let Some((key, row)) = written.next() {
            if written.peek().is_some_and(|(next, _)| *next == key) {
                continue;
            }
            match row {
                Some(bytes) => blocks.insert(key, bytes.as_ref()).map(drop),
                None => blocks.remove(key).map(drop),
            }
            .map_err(redb_err(WRITE))?;
        }
    }
    if !groups.is_empty() {
        let mut table = txn.open_table(ENGINE_GROUPS).map_err(redb_err(WRITE))?;
        for (node, kinds) in groups {
            table.retain_in((node, 0)..=(node, u32::MAX), |_, _| false).map_err(redb_err(WRITE))?;
            for &(index, kind) in kinds.iter() {
                table.insert((node, index), encode_kind(kind).as_slice()).map_err(redb_err(WRITE))?;
            }
        }
    }
    let mut table = txn.open_table(ENGINE_STREAMS).map_err(redb_err(WRITE))?;
    for (node, row) in streams {
        match row {
            Some(record) => {
                let bytes = codec::encode("engine stream", record.as_ref())?;
                table.insert(node, bytes.as_slice()).map(drop)
            }
            None => table.remove(node).map(drop),
        }
        .map_err(redb_err(WRITE))?;
    }
    Ok(())
}

/// Writes the node cache rows a batch changed, each once with its last value.
fn write_cache_rows(txn: &WriteTransaction, rows: CacheRows) -> Result<()> {
    const WRITE: &str = "writing the node caches";
    if !rows.clocks.is_empty() {
        let mut clocks = txn.open_table(NODE_CLOCKS).map_err(redb_err(WRITE))?;
        for ((node, clock), (was, blocks)) in rows.clocks {
            match blocks {
                _ if blocks == was => Ok(()),
                0 => clocks.remove((node, clock)).map(drop),
                n => clocks.insert((node, clock), n).map(drop),
            }
            .map_err(redb_err(WRITE))?;
        }
    }
    if !rows.floors.is_empty() {
        let mut floors = txn.open_table(NODE_FLOORS).map_err(redb_err(WRITE))?;
        for (node, floor) in rows.floors {
            match floor {
                0 => floors.remove(node).map(drop),
                f => floors.insert(node, f).map(drop),
            }
            .map_err(redb_err(WRITE))?;
        }
    }
    if !rows.capacity.is_empty() {
        let mut capacity = txn.open_table(NODE_CAPACITY).map_err(redb_err(WRITE))?;
        for (name, blocks) in rows.capacity {
            match blocks {
                Some(b) => capacity.insert(name.as_ref(), b).map(drop),
                None => capacity.remove(name.as_ref()).map(drop),
            }
            .map_err(redb_err(WRITE))?;
        }
    }
    if let Some(default) = rows.default {
        let mut state = txn.open_table(STATE).map_err(redb_err(WRITE))?;
        match default {
            Some(b) => state.insert(NODE_CACHE_KEY, b).map(drop),
            None => state.remove(NODE_CACHE_KEY).map(drop),
        }
        .map_err(redb_err(WRITE))?;
    }
    Ok(())
}

/// Writes `writes` (each key once) into the prefix table (the caller lists them under their
/// clocks; the live counts are the decided state's). A block whose node changes keeps the nodes
/// before in its others (at most `k - 1`, newest first; `earlier`: the batch's earlier writers
/// of a key), and the node counts follow. With `keep_newer`, an entry already there with a clock
/// at least as new is kept.
fn write_entries(
    txn: &WriteTransaction,
    held: &mut Held,
    writes: impl IntoIterator<Item = Write>,
    earlier: &Earlier,
    keep_newer: bool,
    (k, floor): (usize, u64),
) -> Result<Written> {
    let mut written = Written::default();
    {
        let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let mut others = txn.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        for w in writes {
            let w = &w;
            if keep_newer {
                let old = primary.get(w.key).map_err(redb_err("reading a prefix"))?;
                let newer = old.is_some_and(|g| import_keeps(Entry::from_tuple(g.value()).clock, w.entry.clock));
                if newer {
                    written.fates.push(None);
                    continue;
                }
            }
            let old = primary.insert(w.key, w.entry.tuple()).map_err(redb_err("writing a prefix"))?;
            let old = old.map(|g| Entry::from_tuple(g.value()));
            if keep_newer {
                written.fates.push(Some(old.map(|o| o.clock)));
            }
            let before: &[(u32, u64)] =
                if earlier.is_empty() { &[] } else { earlier.get(&w.key).map_or(&[], Vec::as_slice) };
            if names_only_its_own(old.is_some(), before) {
                held.add(w.entry.node, 1);
            } else if !leaves_others(old.map(|o| o.node), w.entry.node, before) {
                change_others(&mut others, held, (w, before), old, (k, floor))?;
            }
        }
    }
    Ok(written)
}

/// Writes a block's others after `w` replaced `old` (`earlier`: the batch's earlier writers of
/// it) as the node-set rule has them ([`rewrite`]), and the node counts follow. A new key has no
/// others row to read (rows go with their entries).
fn change_others(
    others: &mut redb::Table<u128, &[u8]>,
    held: &mut Held,
    (w, earlier): (&Write, &[(u32, u64)]),
    old: Option<Entry>,
    (k, floor): (usize, u64),
) -> Result<()> {
    let before: Vec<(u32, u64)> = match old {
        None => Vec::new(),
        Some(_) => {
            let row = others.get(w.key).map_err(redb_err("reading the others"))?;
            row.map(|g| members(g.value()).collect()).unwrap_or_default()
        }
    };
    let new = (w.entry.node, w.entry.clock);
    let after = rewrite(&before, old.map(|o| (o.node, o.clock)), new, earlier, |clock| clock > floor, k);
    for &gone in &after.gone {
        held.add(gone, -1);
    }
    for &added in &after.added {
        held.add(added, 1);
    }
    if after.others != before {
        match after.others.is_empty() {
            true => others.remove(w.key).map(drop),
            false => others.insert(w.key, members_row(&after.others).as_slice()).map(drop),
        }
        .map_err(redb_err("writing the others"))?;
        held.others_changed.push(w.key);
    }
    Ok(())
}

/// Removes every entry with a clock up to `cut`, with its block's others, and every generation
/// and live count up to it. 0.1.7's rule removes an eighth of the entries at a time, from nearly
/// every leaf page of the prefix table: one pass over the table (redb's `retain`, which rewrites
/// each page once) costs a few comparisons an entry, where a lookup and a removal per victim
/// walked the tree twice each.
fn remove_through((txn, held): (&WriteTransaction, &mut Held), cut: u64) -> Result<()> {
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
    for &(_, node) in &removed {
        held.add(node, -1);
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
            held.add(node, -1);
        }
        held.others_changed.extend(changed);
    }
    Ok(())
}

/// Writes each clock's live count as stated (`counts`); a generation left with none goes.
fn write_live<'a>(txn: &WriteTransaction, counts: impl Iterator<Item = (&'a u64, &'a u64)>) -> Result<()> {
    let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let mut generations = txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
    for (&clock, &count) in counts {
        match u32::try_from(count) {
            Ok(0) => {
                live.remove(clock).map_err(redb_err("writing the live counts"))?;
                generations.remove(clock).map_err(redb_err("writing the generations"))?;
            }
            Ok(n) => {
                live.insert(clock, n).map_err(redb_err("writing the live counts"))?;
            }
            Err(_) => {
                return Err(Error::Corrupted { detail: format!("generation {clock} counts {count} live keys") });
            }
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
    let before = generations.get(clock).map_err(redb_err("reading the generations"))?.map(|g| g.value().to_vec());
    match before {
        Some(mut all) => {
            all.extend_from_slice(keys);
            generations.insert(clock, all.as_slice()).map_err(redb_err("writing the generations"))?;
        }
        None => {
            generations.insert(clock, keys).map_err(redb_err("writing the generations"))?;
        }
    }
    Ok(())
}

/// The rows of a table keyed by node id (retired nodes, node counts), each id checked against
/// the ids the file has handed out (`next_node`).
///
/// # Errors
/// [`Error::Corrupted`] for an id with no node record; [`Error::Storage`].
pub(crate) fn by_node(table: &impl ReadableTable<u32, u64>, next_node: u32) -> Result<Vec<(usize, u64)>> {
    let mut rows = Vec::new();
    for item in table.iter().map_err(redb_err("reading a node table"))? {
        let (id, value) = item.map_err(redb_err("reading a node table"))?;
        let id = id.value() as usize;
        if id >= next_node as usize {
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
