//! The writer's state: the open batch (one redb write transaction), the in-memory copies of the
//! cold records, and every change to the tables. Only the holder of the writer lock (see
//! `warm.rs`) writes to redb.

use std::collections::HashMap;

use redb::{Database, ReadableDatabase, ReadableTable, ReadableTableMetadata, WriteTransaction};

use crate::chain::{Namespace, check_len, is_legacy};
use crate::codec;
use crate::error::{Error, Result, redb_err};
use crate::front::Ran;
use crate::records::{Meta, NamespaceRecord, NodeRecord, Writer};
use crate::tables::{
    Entry, GENERATIONS, LEGACY_NAMESPACE, LIVE, META, META_KEY, NAMESPACE_IDS, NAMESPACES, NODE_IDS, NODES, PREFIXES,
    stored,
};

/// Longest node name accepted, in bytes.
pub const MAX_NODE_BYTES: usize = 255;

/// Node names by id and ids by name: nodes are few, so all of them are kept in memory.
#[derive(Default)]
pub(crate) struct Nodes {
    pub names: Vec<String>,
    pub ids: HashMap<String, u32>,
}

/// A failed change: the error, and the `ran`s whose batch it dropped.
pub(crate) struct Lost {
    pub error: Error,
    pub rans: Vec<Ran>,
}

/// What the commit thread keeps: the batch and the cold records as of the batch.
pub(crate) struct State {
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
}

impl State {
    /// Reads the cold records of a committed file into a fresh state.
    pub(crate) fn load(db: &Database) -> Result<State> {
        let mut state = State {
            txn: None,
            meta: empty_meta(),
            nodes: Nodes::default(),
            namespaces: HashMap::new(),
            applied: Vec::new(),
            marked: false,
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
        let read = db.begin_read().map_err(redb_err("reading the meta record"))?;
        let meta_table = read.open_table(META).map_err(redb_err("reading the meta record"))?;
        let bytes = meta_table
            .get(META_KEY)
            .map_err(redb_err("reading the meta record"))?
            .ok_or_else(|| Error::UnknownFormat { detail: "no meta record".into() })?;
        self.meta = codec::decode("meta", bytes.value())?;
        self.marked = self.meta.writer.is_some();
        // The clock never goes back, whatever the meta record says.
        let generations = read.open_table(GENERATIONS).map_err(redb_err("reading the generations"))?;
        if let Some((last, _)) = generations.last().map_err(redb_err("reading the generations"))? {
            self.meta.clock = self.meta.clock.max(last.value());
        }
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

    /// Whether the batch holds changes.
    pub(crate) fn dirty(&self) -> bool {
        self.txn.is_some()
    }

    /// Writes one `ran` into the batch: every block gets its node and clock, the keys are listed
    /// under the clock, and the generations they leave lose a live key each. Then evicts if over
    /// capacity. On error the caller drops the whole batch ([`State::lose`]), so no `ran` is ever
    /// half there.
    pub(crate) fn apply(&mut self, db: &Database, ran: &Ran) -> Result<()> {
        self.apply_merged(db, std::slice::from_ref(ran))?;
        self.evict(db)?;
        Ok(())
    }

    /// Whether `blocks` more can be written without any eviction, so that a batch of `ran`s may
    /// be merged ([`State::apply_merged`]) with exactly the result of applying them one by one.
    pub(crate) fn fits(&self, blocks: usize) -> bool {
        self.meta.entries.saturating_add(blocks as u64) <= self.meta.capacity
    }

    /// Writes `rans` (oldest first; more than one only when no eviction is possible, see
    /// [`State::fits`]) as one merge: each key once, with its newest write, in key order, so each
    /// leaf page is visited once and a block several of them wrote is written once. The result is what applying them one by one
    /// gives, except that a key is listed only in the generation that still holds it.
    pub(crate) fn apply_merged(&mut self, db: &Database, rans: &[Ran]) -> Result<()> {
        let mut writes: Vec<(u128, u32, u32)> = Vec::with_capacity(rans.iter().map(|r| r.blocks.len()).sum());
        let mut ids = Vec::with_capacity(rans.len());
        for (r, ran) in rans.iter().enumerate() {
            ids.push((self.intern_node(db, &ran.node)?, self.intern_namespace(db, &ran.namespace)?));
            let r = u32::try_from(r).unwrap_or(u32::MAX);
            writes.extend(
                ran.blocks.iter().enumerate().map(|(i, k)| (stored(k), r, u32::try_from(i + 1).unwrap_or(u32::MAX))),
            );
        }
        // Newest write last within a key, then keep it.
        writes.sort_unstable_by_key(|&(key, r, _)| (key, r));
        writes.dedup_by(|later, earlier| {
            if later.0 == earlier.0 {
                *earlier = *later;
                true
            } else {
                false
            }
        });
        let mut added = 0u64;
        let mut listed: Vec<Vec<(u32, u128)>> = vec![Vec::new(); rans.len()];
        {
            let txn = self.batch(db)?;
            let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            let mut left: HashMap<u64, u32> = HashMap::new();
            for &(key, r, depth) in &writes {
                let (ran, (node, namespace)) = (&rans[r as usize], ids[r as usize]);
                let entry = Entry { node, namespace, depth, clock: ran.clock };
                let old = primary.insert(key, entry.tuple()).map_err(redb_err("writing a prefix"))?;
                match old.map(|g| Entry::from_tuple(g.value()).clock) {
                    Some(old) => *left.entry(old).or_default() += 1,
                    None => added += 1,
                }
                listed[r as usize].push((depth, key));
            }
            drop(primary);
            leave(txn, &left)?;
            for (ran, keys) in rans.iter().zip(&mut listed) {
                // Listed in prompt order, so a dump shows a generation as its prompt ran.
                keys.sort_unstable();
                let bytes: Vec<u8> = keys.iter().flat_map(|(_, key)| key.to_be_bytes()).collect();
                list(txn, ran.clock, &bytes)?;
            }
        }
        if let Some(last) = rans.last() {
            self.meta.clock = self.meta.clock.max(last.clock);
        }
        self.meta.entries += added;
        Ok(())
    }

    /// While over capacity, removes the oldest eighth: every entry whose clock is at most the
    /// clock of the `capacity / 8`-th oldest entry (0.1.7's rule). The cut is found by summing
    /// live counts oldest first; the entries go by a range scan of the generations up to it.
    pub(crate) fn evict(&mut self, db: &Database) -> Result<u64> {
        let mut evicted = 0;
        while self.meta.entries > self.meta.capacity {
            let skip = self.meta.capacity / 8;
            let (n, legacy) = {
                let txn = self.batch(db)?;
                let mut live = txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
                let mut seen = 0u64;
                let mut cut = None;
                for item in live.iter().map_err(redb_err("reading the live counts"))? {
                    let (clock, count) = item.map_err(redb_err("reading the live counts"))?;
                    seen += u64::from(count.value());
                    if seen > skip {
                        cut = Some(clock.value());
                        break;
                    }
                }
                let cut = cut.ok_or_else(|| Error::Corrupted {
                    detail: "the live counts add up to fewer entries than the meta record counts".into(),
                })?;
                let mut generations = txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
                let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
                let (mut n, mut legacy) = (0u64, 0u64);
                // Every generation up to the cut goes; a listed key goes if its clock is at most the
                // cut (a later write keeps it). Keys are removed in key order: neighbours share
                // leaf pages, so each page is copied once per eviction, not once per key.
                let mut victims = Vec::new();
                let mut gone = Vec::new();
                for item in generations.extract_from_if(..=cut, |_, _| true).map_err(redb_err("evicting"))? {
                    let (clock, keys) = item.map_err(redb_err("evicting"))?;
                    gone.push(clock.value());
                    victims.extend(keys.value().chunks_exact(16).map(|k| {
                        let mut key = [0u8; 16];
                        key.copy_from_slice(k);
                        stored(&key)
                    }));
                }
                victims.sort_unstable();
                victims.dedup();
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
                (n, legacy)
            };
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
    /// no writer when `closing`). Nothing to commit is not an error. On failure the batch is gone,
    /// the state is what was committed before, and the lost `ran`s are returned with the error.
    pub(crate) fn commit(&mut self, db: &Database, closing: bool) -> std::result::Result<Vec<Ran>, Box<Lost>> {
        if !(self.dirty() || closing && self.marked) {
            return Ok(std::mem::take(&mut self.applied));
        }
        match self.commit_batch(db, closing) {
            Ok(()) => Ok(std::mem::take(&mut self.applied)),
            Err(e) => Err(self.lose(db, e)),
        }
    }

    /// Drops the batch after `error`, returning it with the `ran`s it lost.
    pub(crate) fn lose(&mut self, db: &Database, error: Error) -> Box<Lost> {
        let rans = std::mem::take(&mut self.applied);
        match self.reload(db) {
            Ok(()) => Box::new(Lost { error, rans }),
            Err(reload) => Box::new(Lost { error: reload, rans }),
        }
    }

    fn commit_batch(&mut self, db: &Database, closing: bool) -> Result<()> {
        let mut meta = self.meta.clone();
        meta.writer = if closing { None } else { Some(Writer { pid: std::process::id() }) };
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

/// Takes one live key per count from each generation in `left` (keys rewritten at a newer clock);
/// a generation left with none goes.
pub(crate) fn leave(txn: &WriteTransaction, left: &HashMap<u64, u32>) -> Result<()> {
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
pub(crate) fn list(txn: &WriteTransaction, clock: u64, keys: &[u8]) -> Result<()> {
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
