//! `Snapshot`: a read-only view of an index file, for tools. Opened in redb's single-writer mode,
//! so it reads a file a head is writing, and never repairs, upgrades or locks out the writer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use redb::{ConcurrencyMode, ReadOnlyDatabase, ReadTransaction, ReadableDatabase, ReadableTable};

use super::lock;
use super::seal;
use super::verify::check_copy;
use crate::decided::caches::{NodeCacheStats, NodeCaches};
use crate::decided::engines::{EngineGauges, EngineStats};
use crate::error::{Error, Result, open_error, redb_err};
use crate::keys::{BLOCK_TOKENS, BlockKey, is_legacy};
use crate::store::codec;
use crate::store::load::read_engines;
use crate::store::load::{each_named_pair, read_caches};
use crate::store::records::{MAX_CLOCK, Meta, NamespaceRecord, NodeRecords, read_meta, read_registry};
use crate::store::schema;
use crate::store::tables::{
    Entry, GENERATIONS, HELD, LIVE, MEMBER_BYTES, META, NAMESPACES, OTHERS, PREFIXES, STATE, generation_keys, members,
};
use crate::store::writer::{count, read_floor, read_position};
use crate::telemetry;

/// One block an engine holds, as its KV events said ([`Snapshot::visit_engine_blocks`]).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineBlockEntry {
    /// The node whose engine holds it.
    pub node: String,
    /// The engine's hash of the block.
    pub hash: u64,
    /// The clock of the batch that stored it.
    pub stored_at: u64,
    /// Its parent's engine hash (`None`: a prompt's first block, or a hybrid engine's block,
    /// whose row keeps where the prompt stands after it instead).
    pub parent: Option<u64>,
    /// Its copies in GPU memory, in CPU memory and on storage (an offloading connector's).
    pub copies: [u32; 3],
    /// Its tokens.
    pub tokens: usize,
    /// For a prompt's first block, the model it is keyed in (`None`: another block, one that
    /// keys nothing, or a hybrid engine's).
    pub model: Option<String>,
    /// A hybrid engine's block: its GPU copies by KV cache group, (group index, copies); empty
    /// for an engine of one full-attention group.
    pub groups: Vec<(u32, u32)>,
}

/// One entry of the index, as `dump` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DumpEntry {
    /// The block key (16 bytes of its chained hash).
    pub key: [u8; 16],
    /// The node that last ran it.
    pub node: String,
    /// Its clock.
    pub clock: u64,
    /// Length of the prefix it ends, in tokens; `None` for an entry imported from 0.1.7.
    pub tokens: Option<usize>,
    /// The model; `None` for an entry imported from 0.1.7 (its hash hides the model).
    pub model: Option<String>,
    /// Whether it is in a tenant's own namespace.
    pub tenant: bool,
    /// Whether `node` is a forgotten incarnation (never answered; its space is reclaimable).
    pub forgotten: bool,
    /// The other nodes that ran it, newest first: (name, clock, forgotten). Those at or below
    /// the file's eviction floor are evicted and not shown.
    pub others: Vec<(String, u64, bool)>,
}

/// What `stats` shows.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct SnapshotStats {
    /// Entries, counted.
    pub entries: u64,
    /// Entries imported from 0.1.7.
    pub legacy_entries: u64,
    /// Entries per node, by node name, most first (a forgotten incarnation's apart, with
    /// `(forgotten)` after its name).
    pub per_node: Vec<(String, u64)>,
    /// Blocks naming each current node, as the last writer or among the others, by name.
    pub named: Vec<(String, u64)>,
    /// Nodes named by blocks besides the one that ran each last (as stored: those a block names
    /// from at or below the eviction floor go when the block is rewritten or evicted).
    pub others: u64,
    /// Blocks and others that name a forgotten incarnation: answered as absent, reclaimed as
    /// they are evicted.
    pub reclaimable: u64,
    /// Node incarnations forgotten so far.
    pub forgotten_nodes: u64,
    /// Oldest and newest clock among the entries.
    pub clock_range: Option<(u64, u64)>,
    /// The clock high-water mark.
    pub clock: u64,
    /// Most entries kept.
    pub capacity: u64,
    /// Size of the file in bytes.
    pub file_bytes: u64,
    /// Schema version.
    pub schema: u32,
    /// Hash scheme.
    pub hash_scheme: String,
    /// Process id of a writer that has the file open.
    pub writer: Option<u32>,
    /// For a file a sharing head writes: the stream sequence of the last shared event it
    /// applied (0 if it never shared).
    pub stream_position: u64,
    /// The cache of each current node incarnation, by id (empty before schema 5).
    pub node_caches: Vec<NodeCacheStats>,
    /// The capacity of a node's cache with none of its own (`Builder::node_cache_blocks`).
    pub node_cache_default: Option<u64>,
    /// The engine event streams: where each stands, what each node's engine holds, the counts.
    pub engines: Vec<EngineStats>,
}

impl SnapshotStats {
    /// Records these figures through the `metrics` facade, under the names a head records
    /// ([`crate::METRICS`]): the file's entries, capacity and size, each current node's blocks
    /// and cache, and each engine stream's counts (as absolute counters). For a textfile of a
    /// file no process exports (`stats --prometheus`): install or scope a recorder first. Only
    /// the file's figures are recorded (no process's counters at 0).
    pub fn record_metrics(&self) {
        telemetry::describe();
        telemetry::figures(self.entries, self.legacy_entries, self.capacity, Some(self.file_bytes));
        for (node, held) in &self.named {
            let cache = self.node_caches.iter().find(|c| &c.node == node).map(|c| (c.held, c.capacity));
            let cache = cache.filter(|&(held, capacity)| held > 0 || capacity.is_some());
            telemetry::node(&telemetry::NodeFigures { name: node.clone(), held: *held, cache });
        }
        for engine in &self.engines {
            let gauges = EngineGauges { engine_blocks: engine.engine_blocks, groups: engine.groups.len() };
            telemetry::engine_totals(&engine.node, &engine.counts, gauges);
        }
    }
}

/// The verdict on the invariants of a file's tables.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Check {
    /// Entries of the prefix table looked at.
    pub entries: u64,
    /// Entries found live in the generation of their clock (equal to `entries` when healthy).
    pub clock_entries: u64,
    /// Every invariant that does not hold (empty: all hold), the first [`MAX_PROBLEMS`].
    pub problems: Vec<String>,
}

/// Most problems a [`Check`] lists.
pub const MAX_PROBLEMS: usize = 20;

impl Check {
    fn note(&mut self, problem: String) {
        if self.problems.len() < MAX_PROBLEMS {
            self.problems.push(problem);
        }
    }
}

/// A read-only view of an index file.
pub struct Snapshot {
    path: PathBuf,
    txn: ReadTransaction,
    meta: Meta,
    /// Node names by id.
    nodes: Vec<String>,
    /// By id: whether that incarnation was forgotten.
    retired: Vec<bool>,
    /// The eviction floor (0 before schema 4).
    floor: u64,
    /// The stream position of the last shared event applied (0 if it never shared).
    position: u64,
    namespaces: HashMap<u32, NamespaceRecord>,
    /// Whether opening it ran redb's full check (on a copy), and it passed.
    pages_verified: bool,
    /// Whether a live head had the file open when it was opened.
    head_live: bool,
    /// Whether the file had no side file although the writer it names is running: someone
    /// deleted the side file of a live head, whose lock readers and heads can then no longer see.
    side_file_missing: bool,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot").field("path", &self.path).finish_non_exhaustive()
    }
}

fn hex(key: &[u8]) -> String {
    crate::keys::hex(key)
}

/// A table that a schema 2 or 3 file does not have: `None` there.
fn optional<T>(table: std::result::Result<T, redb::TableError>) -> Result<Option<T>> {
    match table {
        Ok(t) => Ok(Some(t)),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(None),
        Err(e) => Err(redb_err("opening a table")(e)),
    }
}

impl Snapshot {
    /// Opens `path` read-only at its last commit. A file no head has open is verified first, by
    /// its seal or else by redb's full check on a copy (a read of the whole file); meanwhile no
    /// head can open it.
    ///
    /// # Errors
    /// [`Error::CrashedWriter`] if the writer that had it open died without closing it (open it
    /// for writing once to recover it); [`Error::BeingCreated`] if a head is creating the file
    /// and has not made it an index yet (retry); [`Error::UnknownFormat`], [`Error::NewerSchema`],
    /// [`Error::RetiredSchema`], [`Error::Corrupted`], [`Error::Io`] or [`Error::Storage`]
    /// otherwise.
    pub fn open(path: impl AsRef<Path>) -> Result<Snapshot> {
        let snapshot = Self::open_even_if_crashed(path)?;
        match snapshot.crashed_writer() {
            Some(pid) => Err(Error::CrashedWriter { pid: Some(pid) }),
            None => Ok(snapshot),
        }
    }

    /// Opens `path` read-only at its last commit, also when the file names a writer that is gone
    /// but redb found it clean (for checks).
    ///
    /// # Errors
    /// As [`Snapshot::open`]; [`Error::CrashedWriter`] only when redb refuses the file.
    pub fn open_even_if_crashed(path: impl AsRef<Path>) -> Result<Snapshot> {
        let path = path.as_ref();
        match std::fs::metadata(path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => return Err(lock::not_a_file(path)),
            Err(_) => return Err(lock::no_index_file(path)),
        }
        // A file no head is writing is verified before any of it is read (redb may not survive
        // reading a corrupted file): by its seal, or by redb's check on a copy; the guard keeps a
        // head from opening it until it is open here. A head's file is redb's own writes,
        // verified when the head opened it.
        let closed = lock::no_head(path)?;
        let (head_live, pages_verified) = match &closed {
            None => (true, false),
            Some(_) if seal::matches(path) => (false, false),
            Some(_) => {
                if !check_copy(path)? {
                    return Err(Error::Corrupted { detail: "it fails redb's page checksums".into() });
                }
                (false, true)
            }
        };
        // A head holds the file but it is not an index (yet): a head that is creating it, and
        // has not made its tables. (One refusing a foreign file holds it as briefly: a retry
        // then gets the real answer.)
        let being_created = |e: Error| match e {
            Error::UnknownFormat { .. } if head_live => Error::BeingCreated { path: path.to_path_buf() },
            e => e,
        };
        let db: ReadOnlyDatabase = redb::Builder::new()
            .set_concurrency_mode(ConcurrencyMode::SingleWriter)
            .set_cache_size(16 << 20)
            .open_read_only(path)
            .map_err(|e| match e {
                // redb refuses a file left unclean when no writer holds it: a crash.
                redb::DatabaseError::RepairAborted => Error::CrashedWriter { pid: None },
                e => being_created(open_error(path, e)),
            })?;
        let txn = db.begin_read().map_err(redb_err("starting a read"))?;
        let meta_table = txn.open_table(META).map_err(|e| match e {
            redb::TableError::TableDoesNotExist(_) => being_created(Error::unknown_format("no meta table")),
            e => redb_err("opening the meta table")(e),
        })?;
        let meta = read_meta(&meta_table)?.ok_or_else(|| being_created(Error::unknown_format("no meta record")))?;
        schema::check(&meta)?;
        // Retired rows of unknown ids are read past here; a head refuses them.
        let NodeRecords { names: nodes, retired, .. } = read_registry(&txn)?;
        let (floor, position) = match optional(txn.open_table(STATE))? {
            Some(table) => (read_floor(&table)?, read_position(&table)?),
            None => (0, 0),
        };
        let mut namespaces = HashMap::new();
        let table = txn.open_table(NAMESPACES).map_err(redb_err("opening namespaces"))?;
        for item in table.iter().map_err(redb_err("reading namespaces"))? {
            let (id, bytes) = item.map_err(redb_err("reading namespaces"))?;
            namespaces.insert(id.value(), codec::decode("namespace", bytes.value())?);
        }
        // No side file, but the writer the file names has this very file open: its side file was
        // deleted under it (its pages were verified above, as for a closed file).
        let side_file_missing = closed.as_ref().is_some_and(|guard| !guard.has_side_file())
            && meta.writer.as_ref().is_some_and(|w| lock::process_has_open(w.pid, path));
        let head_live = head_live || side_file_missing;
        drop((meta_table, closed));
        Ok(Snapshot {
            path: path.to_path_buf(),
            txn,
            meta,
            nodes,
            retired,
            floor,
            position,
            namespaces,
            pages_verified,
            head_live,
            side_file_missing,
        })
    }

    /// The read transaction of the snapshot, and its meta record (for a reader's answers).
    pub(crate) fn read(&self) -> (&ReadTransaction, &Meta) {
        (&self.txn, &self.meta)
    }

    /// Whether the head that has the file open lost its side file (`<file>.seal`, which holds its
    /// lock) to a deletion: readers and other heads can no longer see that it has the file
    /// open. Restart that head to recreate it.
    pub fn side_file_missing(&self) -> bool {
        self.side_file_missing
    }

    /// Whether opening it ran redb's full integrity check (on a copy of the file, which passed):
    /// the file had no matching seal and no live head.
    pub fn pages_verified(&self) -> bool {
        self.pages_verified
    }

    /// Whether a live head had the file open when this snapshot was taken.
    pub fn head_live(&self) -> bool {
        self.head_live
    }

    /// Process id of the writer that has (or had, if it crashed) the file open.
    pub fn writer(&self) -> Option<u32> {
        self.meta.writer.as_ref().map(|w| w.pid)
    }

    /// The writer the file names, if no head had it open when this snapshot was taken: it
    /// ended without closing the file.
    pub fn crashed_writer(&self) -> Option<u32> {
        self.writer().filter(|_| !self.head_live)
    }

    /// Most entries kept (the capacity recorded in the file).
    pub fn capacity(&self) -> u64 {
        self.meta.capacity
    }

    /// Entries, as the meta record counts them.
    pub fn entries(&self) -> u64 {
        self.meta.entries
    }

    /// The node cache size recorded for nodes without one of their own, if any.
    ///
    /// # Errors
    /// [`Error::Storage`] or [`Error::Codec`] if the file cannot be read.
    pub fn node_cache_default(&self) -> Result<Option<u64>> {
        Ok(self.caches()?.and_then(|c| c.default))
    }

    /// Every node incarnation the file names, by id: its name and whether it was forgotten.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, bool)> {
        self.nodes.iter().enumerate().map(|(id, name)| (name.as_str(), self.is_retired(id as u32)))
    }

    fn node_name(&self, id: u32) -> String {
        self.nodes.get(id as usize).cloned().unwrap_or_else(|| format!("#{id}"))
    }

    fn is_retired(&self, id: u32) -> bool {
        self.retired.get(id as usize).copied().unwrap_or(false)
    }

    /// Each node's cache (`None` before schema 5).
    fn caches(&self) -> Result<Option<NodeCaches>> {
        use crate::store::tables::{NODE_CAPACITY, NODE_CLOCKS, NODE_FLOORS};
        let (Some(_), Some(_), Some(_)) = (
            optional(self.txn.open_table(NODE_CLOCKS))?,
            optional(self.txn.open_table(NODE_FLOORS))?,
            optional(self.txn.open_table(NODE_CAPACITY))?,
        ) else {
            return Ok(None);
        };
        read_caches(&self.txn, self.floor, self.meta.next_node).map(Some)
    }

    fn describe(&self, key: BlockKey, entry: Entry, others: Option<&[u8]>) -> DumpEntry {
        let namespace = self.namespaces.get(&entry.namespace);
        DumpEntry {
            key,
            node: self.node_name(entry.node),
            clock: entry.clock,
            tokens: (!is_legacy(&key)).then_some(entry.depth as usize * BLOCK_TOKENS),
            model: namespace.map(|n| n.model.clone()),
            tenant: namespace.is_some_and(|n| n.tenant),
            forgotten: self.is_retired(entry.node),
            others: others
                .into_iter()
                .flat_map(members)
                .filter(|&(_, clock)| clock > self.floor)
                .map(|(node, clock)| (self.node_name(node), clock, self.is_retired(node)))
                .collect(),
        }
    }

    /// Calls `visit` for each entry in clock order (newest first if `newest_first`) until it
    /// returns false: a range scan of the generations, each listed key looked up and shown if it
    /// still has that generation's clock.
    ///
    /// # Errors
    /// [`Error::Storage`].
    pub fn visit(&self, newest_first: bool, mut visit: impl FnMut(DumpEntry) -> bool) -> Result<()> {
        let generations = self.txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let others = optional(self.txn.open_table(OTHERS))?;
        let all = generations.iter().map_err(redb_err("reading the generations"))?;
        let all: Box<dyn Iterator<Item = _>> = if newest_first { Box::new(all.rev()) } else { Box::new(all) };
        for item in all {
            let (clock, keys) = item.map_err(redb_err("reading the generations"))?;
            let clock = clock.value();
            for key in generation_keys(keys.value()) {
                let entry =
                    primary.get(key).map_err(redb_err("reading a prefix"))?.map(|g| Entry::from_tuple(g.value()));
                let Some(entry) = entry.filter(|e| e.clock == clock) else { continue };
                let row = match &others {
                    Some(t) => t.get(key).map_err(redb_err("reading the others"))?,
                    None => None,
                };
                if !visit(self.describe(key.to_be_bytes(), entry, row.as_ref().map(|g| g.value()))) {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Calls `visit` with each block an engine holds, as its events said, node by node, until
    /// it returns false.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for a row that does not decode; [`Error::Storage`].
    pub fn visit_engine_blocks(&self, mut visit: impl FnMut(EngineBlockEntry) -> bool) -> Result<()> {
        let mut more = true;
        crate::store::load::visit_rows(&self.txn, |node, hash, row| {
            more = visit(EngineBlockEntry {
                node: self.node_name(node),
                hash,
                stored_at: row.clock(),
                parent: row.parent(),
                copies: row.copies(),
                tokens: row.token_count(),
                model: row.model().map(str::to_string),
                groups: Vec::new(),
            });
            more
        })?;
        // Then the hybrid engines' blocks.
        crate::store::load::visit_hybrid_rows(&self.txn, |node, since, hash, row| {
            let gpu = row.copies().iter().fold(0u32, |n, c| n.saturating_add(c.1));
            more = more
                && visit(EngineBlockEntry {
                    node: self.node_name(node),
                    hash,
                    stored_at: since,
                    parent: None,
                    copies: [gpu, 0, 0],
                    tokens: row.block_size(),
                    model: None,
                    groups: row.copies().to_vec(),
                });
            Ok(more)
        })
    }

    /// The models the file holds blocks of: those its entries were keyed in, and those of the
    /// first blocks engines hold.
    ///
    /// # Errors
    /// As [`Snapshot::visit_engine_blocks`].
    pub fn models(&self) -> Result<std::collections::BTreeSet<String>> {
        let mut models: std::collections::BTreeSet<String> =
            self.namespaces.values().map(|n| n.model.clone()).collect();
        self.visit_engine_blocks(|block| {
            models.extend(block.model);
            true
        })?;
        Ok(models)
    }

    /// Counts, per node, and the settings.
    ///
    /// # Errors
    /// [`Error::Storage`] if the file cannot be read.
    pub fn stats(&self) -> Result<SnapshotStats> {
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let live = self.txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
        let (mut per_node, mut named): (HashMap<u32, u64>, HashMap<u32, u64>) = Default::default();
        let (mut entries, mut legacy, mut reclaimable, mut others) = (0, 0, 0, 0);
        for item in primary.iter().map_err(redb_err("reading the prefix table"))? {
            let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
            let node = Entry::from_tuple(value.value()).node;
            *per_node.entry(node).or_default() += 1;
            *named.entry(node).or_default() += 1;
            reclaimable += u64::from(self.is_retired(node));
            entries += 1;
            legacy += u64::from(is_legacy(&key.value().to_be_bytes()));
        }
        if let Some(table) = optional(self.txn.open_table(OTHERS))? {
            for item in table.iter().map_err(redb_err("reading the others"))? {
                let (_, row) = item.map_err(redb_err("reading the others"))?;
                for (node, _) in members(row.value()) {
                    *named.entry(node).or_default() += 1;
                    reclaimable += u64::from(self.is_retired(node));
                    others += 1;
                }
            }
        }
        let first = live.first().map_err(redb_err("reading the live counts"))?.map(|(k, _)| k.value());
        let last = live.last().map_err(redb_err("reading the live counts"))?.map(|(k, _)| k.value());
        let name = |id: u32| {
            if self.is_retired(id) { format!("{} (forgotten)", self.node_name(id)) } else { self.node_name(id) }
        };
        let mut per_node: Vec<(String, u64)> = per_node.into_iter().map(|(id, n)| (name(id), n)).collect();
        per_node.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let mut named: Vec<(String, u64)> =
            named.into_iter().filter(|&(id, _)| !self.is_retired(id)).map(|(id, n)| (self.node_name(id), n)).collect();
        named.sort();
        let file_bytes = std::fs::metadata(&self.path).map_err(|source| Error::io(self.path.clone(), source))?.len();
        let caches = self.caches()?;
        Ok(SnapshotStats {
            entries,
            legacy_entries: legacy,
            per_node,
            named,
            others,
            reclaimable,
            forgotten_nodes: self.retired.iter().filter(|&&r| r).count() as u64,
            clock_range: first.zip(last),
            clock: self.meta.clock,
            capacity: self.meta.capacity,
            file_bytes,
            schema: self.meta.schema,
            hash_scheme: self.meta.hash_scheme.clone(),
            writer: self.writer(),
            stream_position: self.position,
            node_caches: caches
                .as_ref()
                .map(|c| c.stats(self.nodes.iter().map(String::as_str).zip(self.retired.iter().copied())))
                .unwrap_or_default(),
            node_cache_default: caches.and_then(|c| c.default),
            engines: read_engines(&self.txn, schema::check(&self.meta)?, self.meta.clock)?.stats(name),
        })
    }

    /// Checks the invariants: every prefix entry is listed in the generation of its clock, each
    /// generation's live count is the number of its keys that still have its clock, every clock
    /// is at most the high-water mark, every node and namespace id is known, and the meta counts
    /// match.
    ///
    /// # Errors
    /// [`Error::Storage`] if the file cannot be read (a broken invariant is a `problem`, not an
    /// error).
    pub fn check(&self) -> Result<Check> {
        let mut check = Check::default();
        let legacy = self.check_prefixes(&mut check)?;
        self.check_generations(&mut check)?;
        if self.meta.schema >= 4 {
            self.check_nodes(&mut check)?;
        }
        if let Some(caches) = self.caches()? {
            self.check_caches(&mut check, &caches)?;
        }
        if self.meta.clock > MAX_CLOCK {
            check.note(format!(
                "the clock's high-water mark {} is past {MAX_CLOCK}: the clock cannot advance (restore the file from a copy)",
                self.meta.clock
            ));
        }
        if check.entries != check.clock_entries {
            check.note(format!(
                "{} prefixes but {} listed live in their generation",
                check.entries, check.clock_entries
            ));
        }
        if self.meta.entries != check.entries || self.meta.legacy_entries != legacy {
            check.note(format!(
                "meta counts {} entries ({} from 0.1.7), the tables hold {} ({legacy})",
                self.meta.entries, self.meta.legacy_entries, check.entries
            ));
        }
        Ok(check)
    }

    /// Walks the prefix table: clocks under the high-water mark, node and namespace ids known.
    /// Counts the entries into `check`; returns how many are 0.1.7's.
    fn check_prefixes(&self, check: &mut Check) -> Result<u64> {
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let mut legacy = 0;
        for item in primary.iter().map_err(redb_err("reading the prefix table"))? {
            let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
            let (key, entry) = (key.value().to_be_bytes(), Entry::from_tuple(value.value()));
            check.entries += 1;
            legacy += u64::from(is_legacy(&key));
            if entry.clock > self.meta.clock {
                check.note(format!(
                    "prefix {} has clock {} > high-water mark {}",
                    hex(&key),
                    entry.clock,
                    self.meta.clock
                ));
            }
            if entry.node as usize >= self.nodes.len() {
                check.note(format!("prefix {} names unknown node id {}", hex(&key), entry.node));
            }
            if !is_legacy(&key) && !self.namespaces.contains_key(&entry.namespace) {
                check.note(format!("prefix {} names unknown namespace id {}", hex(&key), entry.namespace));
            }
        }
        if count(&primary)? != check.entries {
            check.note("the prefix table's length disagrees with its entries".into());
        }
        Ok(legacy)
    }

    /// Walks the others: each row is whole members, each node once, never the block's own node,
    /// older than it, of known ids, for a block that exists; then every node's count of the
    /// blocks naming it is the stored one (so the reclaimable count `stats` shows is right).
    fn check_nodes(&self, check: &mut Check) -> Result<()> {
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let others = self.txn.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        let held = self.txn.open_table(HELD).map_err(redb_err("opening the node counts"))?;
        let mut counted = vec![0u64; self.nodes.len()];
        let mut count_node = |check: &mut Check, node: u32, key: u128| match counted.get_mut(node as usize) {
            Some(n) => *n += 1,
            None => check.note(format!("block {} names unknown node id {node}", hex(&key.to_be_bytes()))),
        };
        for item in primary.iter().map_err(redb_err("reading the prefix table"))? {
            let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
            count_node(check, Entry::from_tuple(value.value()).node, key.value());
        }
        for item in others.iter().map_err(redb_err("reading the others"))? {
            let (key, row) = item.map_err(redb_err("reading the others"))?;
            let (key, row) = (key.value(), row.value());
            let shown = hex(&key.to_be_bytes());
            if row.is_empty() || row.len() % MEMBER_BYTES != 0 {
                check.note(format!("the others of {shown} are {} bytes, not whole members", row.len()));
            }
            let Some(entry) =
                primary.get(key).map_err(redb_err("reading a prefix"))?.map(|g| Entry::from_tuple(g.value()))
            else {
                check.note(format!("block {shown} has others but no entry"));
                continue;
            };
            let mut seen = std::collections::HashSet::new();
            for (node, clock) in members(row) {
                if node == entry.node || !seen.insert(node) {
                    check.note(format!("block {shown} names node id {node} twice"));
                }
                if clock >= entry.clock {
                    check.note(format!(
                        "block {shown} has another node at clock {clock}, not older than {}",
                        entry.clock
                    ));
                }
                count_node(check, node, key);
            }
        }
        for (id, &n) in counted.iter().enumerate() {
            let stored = held.get(id as u32).map_err(redb_err("reading the node counts"))?.map_or(0, |g| g.value());
            if stored != n {
                check.note(format!("node id {id} is named by {n} blocks, its count says {stored}"));
            }
        }
        if count(&held)? > counted.iter().filter(|&&n| n > 0).count() as u64 {
            check.note("node counts for nodes no block names".into());
        }
        Ok(())
    }

    /// Checks each node's cache (kept only for a node with a capacity): every count is of a
    /// known, current incarnation with a capacity, at a clock above
    /// its floor and the eviction floor and at most the high-water mark; a node holds no more
    /// than its capacity; and every (block, node) pair the file answers for a node is counted at
    /// its clock (the counts may hold more: blocks that no longer name the node still take room
    /// in its cache).
    fn check_caches(&self, check: &mut Check, caches: &NodeCaches) -> Result<()> {
        let mut named: HashMap<(u32, u64), u64> = HashMap::new();
        let tracked = |node: u32| self.nodes.get(node as usize).is_some_and(|name| caches.tracks(name));
        let mut see = |node: u32, clock: u64| {
            if clock > self.floor && clock > caches.floor(node) && !self.is_retired(node) && tracked(node) {
                *named.entry((node, clock)).or_default() += 1;
            }
        };
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        each_named_pair(&primary, optional(self.txn.open_table(OTHERS))?.as_ref(), &mut see)?;
        for id in 0..caches.len().max(self.nodes.len()) as u32 {
            let mut held = 0;
            for (clock, n) in caches.clocks(id) {
                held += n;
                if id as usize >= self.nodes.len() || self.is_retired(id) || !tracked(id) {
                    check.note(format!("node id {id} has a cache count and is unknown, forgotten or of no size"));
                } else if clock <= self.floor || clock <= caches.floor(id) || clock > self.meta.clock {
                    check.note(format!("node id {id} counts blocks at clock {clock}, outside its cache"));
                }
                let answered = named.remove(&(id, clock)).unwrap_or(0);
                if answered > n {
                    check.note(format!(
                        "node id {id} is named by {answered} blocks of clock {clock}, its cache counts {n}"
                    ));
                }
            }
            let capacity = self.nodes.get(id as usize).and_then(|name| caches.capacity_of(name));
            if capacity.is_some_and(|c| held > c) && !self.is_retired(id) {
                check.note(format!("node id {id} holds {held} blocks, over its capacity {capacity:?}"));
            }
        }
        if let Some(((node, clock), n)) = named.into_iter().next() {
            check.note(format!("node id {node} is named by {n} blocks of clock {clock} its cache does not count"));
        }
        Ok(())
    }

    /// Walks the generations: each lists 16-byte keys, each once, and its live count is the
    /// number of them that still have its clock. Each entry is counted at most once (a
    /// generation lists a key once, and an entry has one clock), so if the counts add up to the
    /// entries, every entry is listed in its generation.
    fn check_generations(&self, check: &mut Check) -> Result<()> {
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let generations = self.txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
        let live = self.txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
        let mut generation_count = 0u64;
        for item in generations.iter().map_err(redb_err("reading the generations"))? {
            let (clock, keys) = item.map_err(redb_err("reading the generations"))?;
            let (clock, keys) = (clock.value(), keys.value());
            generation_count += 1;
            if keys.len() % 16 != 0 {
                check.note(format!("generation {clock} lists {} bytes, not 16 per key", keys.len()));
            }
            let mut here = 0u32;
            let mut seen = std::collections::HashSet::new();
            for key in generation_keys(keys) {
                if !seen.insert(key) {
                    check.note(format!("generation {clock} lists {} twice", hex(&key.to_be_bytes())));
                    continue;
                }
                let entry =
                    primary.get(key).map_err(redb_err("reading a prefix"))?.map(|g| Entry::from_tuple(g.value()));
                here += u32::from(entry.is_some_and(|e| e.clock == clock));
            }
            let counted = live.get(clock).map_err(redb_err("reading the live counts"))?.map(|g| g.value());
            if counted != Some(here).filter(|&n| n > 0) {
                check.note(format!("generation {clock} has {here} live keys but its count says {counted:?}"));
            }
            check.clock_entries += u64::from(here);
        }
        let counts = count(&live)?;
        if counts != generation_count {
            check.note(format!("{counts} live counts for {generation_count} generations"));
        }
        Ok(())
    }
}
