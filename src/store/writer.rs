//! The writer's side of a file: the open batch (one redb write transaction), the in-memory
//! copies of the cold records, and every change to the tables. Only the holder of the writer
//! lock (see `index/warm.rs`) writes to redb.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::codec;
use super::records::{
    DEFAULT_CAPACITY, LEGACY_NAMESPACE, META_KEY, Meta, NamespaceRecord, NodeRecord, OpenBy, read_meta, read_nodes,
};
use super::tables::{
    Entry, GENERATIONS, LIVE, META, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES, generation_keys, table_key,
};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BlockKey, MAX_NODE_BYTES, Namespace, check_len, is_legacy};

/// One `ran`, as queued for the writer.
pub(crate) struct Ran {
    pub namespace: Namespace,
    pub blocks: Arc<[BlockKey]>,
    pub node: Arc<str>,
    pub clock: u64,
    /// Every entry with a clock up to this one is evicted once this `ran` is applied (the
    /// callers decide eviction, by 0.1.7's rule, as each `ran` returns: `index/horizon.rs`).
    pub floor: u64,
    /// When the caller made it (for the sync window).
    pub at: Instant,
}

/// Node names by id and ids by name: nodes are few, so all of them are kept in memory.
#[derive(Default)]
pub(crate) struct Nodes {
    pub names: Vec<String>,
    pub ids: HashMap<String, u32>,
}

/// A batch that was rolled back: the error, and the `ran`s it held.
pub(crate) struct RolledBack {
    pub error: Error,
    pub rans: Vec<Ran>,
}

/// What the commit thread keeps: the batch and the cold records as of the batch.
pub(crate) struct Writer {
    /// The batch: every change since the last commit.
    pub txn: Option<WriteTransaction>,
    /// The meta record as of the batch (committed with it).
    pub meta: Meta,
    pub nodes: Nodes,
    pub namespaces: HashMap<[u8; 8], u32>,
    /// The `ran`s in the batch (pushed by whoever applied them), to be forgotten by the overlay
    /// once committed.
    pub applied: Vec<Ran>,
    /// Whether the committed meta record names a writer (this one, or one that crashed).
    marked: bool,
    /// The newest floor applied in the batch (0 after a reload: applying a floor twice removes
    /// nothing the second time).
    floor: u64,
}

/// One write to the prefix table.
struct Write {
    key: u128,
    entry: Entry,
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
            marked: false,
            floor: 0,
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
        self.floor = 0;
        // The clock never goes back, whatever the meta record says.
        let generations = read.open_table(GENERATIONS).map_err(redb_err("reading the generations"))?;
        if let Some((last, _)) = generations.last().map_err(redb_err("reading the generations"))? {
            self.meta.clock = self.meta.clock.max(last.value());
        }
        let names = read_nodes(&read.open_table(NODES).map_err(redb_err("reading nodes"))?)?;
        let ids = names.iter().zip(0..).map(|(name, id)| (name.clone(), id)).collect();
        self.nodes = Nodes { names, ids };
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

    /// Writes `rans` (oldest first) into the batch, then evicts through the newest floor they
    /// carry. The same as applying them one by one, each followed by its own eviction: a later
    /// write has a clock past every earlier floor, so evicting "every entry up to the floor"
    /// commutes with it. On error the caller rolls the whole batch back
    /// ([`Writer::roll_back`]), so no `ran` is ever half there.
    pub(crate) fn apply(&mut self, db: &Database, rans: &[Ran]) -> Result<()> {
        self.apply_merged(db, rans)?;
        let floor = rans.iter().map(|r| r.floor).max().unwrap_or(0);
        if floor > self.floor {
            let (n, legacy) = remove_through(self.batch(db)?, floor)?;
            self.meta.entries = self.meta.entries.saturating_sub(n);
            self.meta.legacy_entries = self.meta.legacy_entries.saturating_sub(legacy);
            self.floor = floor;
        }
        Ok(())
    }

    /// Writes `rans` (oldest first) as one merge: each key once, with its newest write, in key order, so
    /// each leaf page is visited once and a block several of them wrote is written once. The
    /// result is what applying them one by one gives, except that a key is listed only in the
    /// generation that still holds it.
    fn apply_merged(&mut self, db: &Database, rans: &[Ran]) -> Result<()> {
        let mut ids = Vec::with_capacity(rans.len());
        for ran in rans {
            ids.push((self.intern_node(db, &ran.node)?, self.intern_namespace(db, &ran.namespace)?));
        }
        let mut writes: Vec<Write> = Vec::with_capacity(rans.iter().map(|r| r.blocks.len()).sum());
        for (ran, &(node, namespace)) in rans.iter().zip(&ids) {
            writes.extend(ran.blocks.iter().zip(1..).map(|(k, depth)| Write {
                key: table_key(k),
                entry: Entry { node, namespace, depth, clock: ran.clock },
            }));
        }
        // Newest write last within a key (a stable sort keeps the order of the `ran`s), then
        // keep it.
        writes.sort_by_key(|w| w.key);
        writes.dedup_by(|later, earlier| {
            if later.key == earlier.key {
                std::mem::swap(later, earlier);
                true
            } else {
                false
            }
        });
        let written = write_entries(self.batch(db)?, &writes, false)?;
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
            })
            .collect();
        let written = write_entries(self.batch(db)?, &writes, true)?;
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
            let txn = self.batch(db)?;
            let cut = eviction_cut(txn, skip)?;
            let (n, legacy) = remove_through(txn, cut)?;
            if n == 0 {
                return Err(Error::Corrupted { detail: "eviction found no live entry to remove".into() });
            }
            self.meta.entries = self.meta.entries.saturating_sub(n);
            self.meta.legacy_entries = self.meta.legacy_entries.saturating_sub(legacy);
            evicted += n;
        }
        Ok(evicted)
    }

    /// The id of node `name`, added to the node tables if new.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::InvalidConfig`] past 2^32 nodes; [`Error::Storage`].
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
        Ok(id)
    }

    /// Commits the batch with the meta record, durably, naming this process as the writer (or
    /// no writer when `closing`). Nothing to commit is not an error. On failure the batch is
    /// rolled back, the state is what was committed before, and its `ran`s are returned with the
    /// error.
    pub(crate) fn commit(&mut self, db: &Database, closing: bool) -> std::result::Result<Vec<Ran>, Box<RolledBack>> {
        if !(self.dirty() || closing && self.marked) {
            return Ok(std::mem::take(&mut self.applied));
        }
        match self.commit_batch(db, closing) {
            Ok(()) => Ok(std::mem::take(&mut self.applied)),
            Err(e) => Err(self.roll_back(db, e)),
        }
    }

    /// Rolls the batch back after `error`, returning it with the `ran`s the batch held.
    pub(crate) fn roll_back(&mut self, db: &Database, error: Error) -> Box<RolledBack> {
        let rans = std::mem::take(&mut self.applied);
        match self.reload(db) {
            Ok(()) => Box::new(RolledBack { error, rans }),
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
        txn.open_table(META)
            .and_then(|mut t| t.insert(META_KEY, bytes.as_slice()).map(drop).map_err(Into::into))
            .map_err(redb_err("writing the meta record"))?;
        txn.commit().map_err(redb_err("committing"))?;
        self.meta = meta;
        self.marked = !closing;
        Ok(())
    }
}

/// Writes `writes` (each key once) into the prefix table and keeps the clock-ordered tables in
/// step: each write is listed under its clock (in depth order, so a dump shows a generation as
/// its prompt ran), and each generation an overwritten entry leaves loses a live key. With
/// `keep_newer`, an entry already there with a clock at least as new is kept.
fn write_entries(txn: &WriteTransaction, writes: &[Write], keep_newer: bool) -> Result<Written> {
    let mut written = Written::default();
    let mut left: HashMap<u64, u32> = HashMap::new();
    let mut listed: BTreeMap<u64, Vec<(u32, u128)>> = BTreeMap::new();
    {
        let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        for w in writes {
            if keep_newer {
                let old = primary.get(w.key).map_err(redb_err("reading a prefix"))?;
                if old.is_some_and(|g| Entry::from_tuple(g.value()).clock >= w.entry.clock) {
                    continue;
                }
            }
            let old = primary.insert(w.key, w.entry.tuple()).map_err(redb_err("writing a prefix"))?;
            match old.map(|g| Entry::from_tuple(g.value()).clock) {
                Some(old) => *left.entry(old).or_default() += 1,
                None => written.added += 1,
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

/// Removes every generation up to `cut` and each key it lists that still has a clock up to the
/// cut (a later write keeps it). Keys are removed in key order: neighbours share leaf pages, so
/// each page is copied once per eviction, not once per key. Returns (entries removed, of which
/// 0.1.7's).
fn remove_through(txn: &WriteTransaction, cut: u64) -> Result<(u64, u64)> {
    let mut generations = txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
    let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
    let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
    let mut victims = Vec::new();
    let mut gone = Vec::new();
    for item in generations.extract_from_if(..=cut, |_, _| true).map_err(redb_err("evicting"))? {
        let (clock, keys) = item.map_err(redb_err("evicting"))?;
        gone.push(clock.value());
        victims.extend(generation_keys(keys.value()));
    }
    victims.sort_unstable();
    victims.dedup();
    let (mut n, mut legacy) = (0u64, 0u64);
    for key in victims {
        let old = primary.get(key).map_err(redb_err("evicting"))?.map(|g| Entry::from_tuple(g.value()));
        if old.is_some_and(|e| e.clock <= cut) {
            primary.remove(key).map_err(redb_err("evicting"))?;
            n += 1;
            legacy += u64::from(is_legacy(&key.to_be_bytes()));
        }
    }
    for clock in gone {
        live.remove(clock).map_err(redb_err("evicting"))?;
    }
    Ok((n, legacy))
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

/// Entries in a table, for checks (redb counts by walking the tree).
///
/// # Errors
/// [`Error::Storage`].
pub(crate) fn count(table: &impl ReadableTableMetadata) -> Result<u64> {
    table.len().map_err(redb_err("counting entries"))
}
