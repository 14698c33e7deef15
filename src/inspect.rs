//! `Snapshot`: a read-only view of an index file, for tools. Opened in redb's single-writer mode,
//! so it reads a file a head is writing, and never repairs, upgrades or locks out the writer.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use redb::{ConcurrencyMode, ReadOnlyDatabase, ReadTransaction, ReadableDatabase, ReadableTable};

use crate::builder::open_error;
use crate::chain::{BLOCK_TOKENS, BlockKey, is_legacy};
use crate::codec;
use crate::error::{Error, Result, redb_err};
use crate::records::{Meta, NamespaceRecord, NodeRecord};
use crate::schema;
use crate::seal::{self, Found};
use crate::state::count;
use crate::tables::{Entry, GENERATIONS, LIVE, META, META_KEY, NAMESPACES, NODES, PREFIXES, stored};

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
}

/// What `stats` shows.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SnapshotStats {
    /// Entries, counted.
    pub entries: u64,
    /// Entries imported from 0.1.7.
    pub legacy_entries: u64,
    /// Entries per node, by node name, most first.
    pub per_node: Vec<(String, u64)>,
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
}

/// The verdict of `check`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Check {
    /// Entries of the prefix table looked at.
    pub entries: u64,
    /// Entries found live in the generation of their clock (equal to `entries` when healthy).
    pub clock_entries: u64,
    /// Every invariant that does not hold (empty: all hold).
    pub problems: Vec<String>,
}

/// A read-only view of an index file.
pub struct Snapshot {
    path: PathBuf,
    txn: ReadTransaction,
    meta: Meta,
    nodes: HashMap<u32, String>,
    namespaces: HashMap<u32, NamespaceRecord>,
    /// Whether opening it ran redb's full check (on a copy), and it passed.
    pages_verified: bool,
}

impl std::fmt::Debug for Snapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Snapshot").field("path", &self.path).finish_non_exhaustive()
    }
}

/// Whether process `pid` is running (Linux: `/proc`; elsewhere it is assumed to be).
fn alive(pid: u32) -> bool {
    if cfg!(target_os = "linux") { Path::new(&format!("/proc/{pid}")).exists() } else { true }
}

impl Snapshot {
    /// Opens `path` read-only at its last commit. A file no head has open is verified first, by
    /// its seal or else by redb's full check on a copy (a read of the whole file).
    ///
    /// # Errors
    /// [`Error::CrashedWriter`] if the writer that had it open died without closing it (open it
    /// with a head to recover it); [`Error::UnknownFormat`], [`Error::NewerSchema`],
    /// [`Error::Corrupted`], [`Error::Io`] or [`Error::Storage`] otherwise.
    pub fn open(path: impl AsRef<Path>) -> Result<Snapshot> {
        let snapshot = Self::open_even_if_crashed(path)?;
        match snapshot.crashed_writer() {
            Some(pid) => Err(Error::CrashedWriter { pid: Some(pid) }),
            None => Ok(snapshot),
        }
    }

    /// Opens `path` read-only at its last commit, also when the file names a writer that is gone
    /// but redb found it clean (for `check`).
    ///
    /// # Errors
    /// As [`Snapshot::open`]; [`Error::CrashedWriter`] only when redb refuses the file.
    pub fn open_even_if_crashed(path: impl AsRef<Path>) -> Result<Snapshot> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no index file here"),
            });
        }
        // A file no head is writing is verified before any of it is read (redb may not survive
        // reading a corrupted file): by its seal, or by redb's check on a copy. A head's file is
        // redb's own writes, verified when the head opened it.
        let (verified, pages_verified) = match seal::found(path) {
            Found::Sealed => (true, false),
            Found::Open(pid) if alive(pid) => (true, false),
            Found::Open(_) | Found::Unknown => {
                let passed = check_copy(path)?;
                (passed, passed)
            }
        };
        if !verified {
            return Err(Error::Corrupted { detail: "it fails redb's page checksums".into() });
        }
        let db: ReadOnlyDatabase = redb::Builder::new()
            .set_concurrency_mode(ConcurrencyMode::SingleWriter)
            .set_cache_size(16 << 20)
            .open_read_only(path)
            .map_err(|e| match e {
                // redb refuses a file left unclean when no writer holds it: a crash.
                redb::DatabaseError::RepairAborted => Error::CrashedWriter { pid: None },
                e => open_error(path, e),
            })?;
        let txn = db.begin_read().map_err(redb_err("starting a read"))?;
        let meta_table = txn.open_table(META).map_err(|e| match e {
            redb::TableError::TableDoesNotExist(_) => Error::UnknownFormat { detail: "no meta table".into() },
            e => redb_err("opening the meta table")(e),
        })?;
        let bytes = meta_table
            .get(META_KEY)
            .map_err(redb_err("reading the meta record"))?
            .ok_or_else(|| Error::UnknownFormat { detail: "no meta record".into() })?;
        let meta: Meta = codec::decode("meta", bytes.value())?;
        schema::check(&meta)?;
        let mut nodes = HashMap::new();
        for item in
            txn.open_table(NODES).map_err(redb_err("opening nodes"))?.iter().map_err(redb_err("reading nodes"))?
        {
            let (id, bytes) = item.map_err(redb_err("reading nodes"))?;
            let record: NodeRecord = codec::decode("node", bytes.value())?;
            nodes.insert(id.value(), record.name);
        }
        let mut namespaces = HashMap::new();
        let table = txn.open_table(NAMESPACES).map_err(redb_err("opening namespaces"))?;
        for item in table.iter().map_err(redb_err("reading namespaces"))? {
            let (id, bytes) = item.map_err(redb_err("reading namespaces"))?;
            namespaces.insert(id.value(), codec::decode("namespace", bytes.value())?);
        }
        drop(meta_table);
        Ok(Snapshot { path: path.to_path_buf(), txn, meta, nodes, namespaces, pages_verified })
    }

    /// Whether opening it ran redb's full integrity check (on a copy of the file, which passed):
    /// the file had no matching seal and no live head.
    pub fn pages_verified(&self) -> bool {
        self.pages_verified
    }

    /// Process id of the writer that has (or had, if it crashed) the file open.
    pub fn writer(&self) -> Option<u32> {
        self.meta.writer.as_ref().map(|w| w.pid)
    }

    /// The writer the file names, if that process is no longer running.
    pub fn crashed_writer(&self) -> Option<u32> {
        self.writer().filter(|&pid| !alive(pid))
    }

    fn describe(&self, key: BlockKey, entry: Entry) -> DumpEntry {
        let namespace = self.namespaces.get(&entry.namespace);
        DumpEntry {
            key,
            node: self.nodes.get(&entry.node).cloned().unwrap_or_else(|| format!("#{}", entry.node)),
            clock: entry.clock,
            tokens: (!is_legacy(&key)).then_some(entry.depth as usize * BLOCK_TOKENS),
            model: namespace.map(|n| n.model.clone()),
            tenant: namespace.is_some_and(|n| n.tenant),
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
        let all = generations.iter().map_err(redb_err("reading the generations"))?;
        let all: Box<dyn Iterator<Item = _>> = if newest_first { Box::new(all.rev()) } else { Box::new(all) };
        for item in all {
            let (clock, keys) = item.map_err(redb_err("reading the generations"))?;
            let clock = clock.value();
            for chunk in keys.value().chunks_exact(16) {
                let mut key = [0u8; 16];
                key.copy_from_slice(chunk);
                let entry = primary
                    .get(stored(&key))
                    .map_err(redb_err("reading a prefix"))?
                    .map(|g| Entry::from_tuple(g.value()));
                if let Some(entry) = entry.filter(|e| e.clock == clock)
                    && !visit(self.describe(key, entry))
                {
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Counts, per node, and the settings.
    ///
    /// # Errors
    /// [`Error::Storage`] if the file cannot be read.
    pub fn stats(&self) -> Result<SnapshotStats> {
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let live = self.txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
        let mut per_node: HashMap<u32, u64> = HashMap::new();
        let (mut entries, mut legacy) = (0, 0);
        for item in primary.iter().map_err(redb_err("reading the prefix table"))? {
            let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
            *per_node.entry(Entry::from_tuple(value.value()).node).or_default() += 1;
            entries += 1;
            legacy += u64::from(is_legacy(&key.value().to_be_bytes()));
        }
        let first = live.first().map_err(redb_err("reading the live counts"))?.map(|(k, _)| k.value());
        let last = live.last().map_err(redb_err("reading the live counts"))?.map(|(k, _)| k.value());
        let mut per_node: Vec<(String, u64)> = per_node
            .into_iter()
            .map(|(id, n)| (self.nodes.get(&id).cloned().unwrap_or_else(|| format!("#{id}")), n))
            .collect();
        per_node.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        let file_bytes =
            std::fs::metadata(&self.path).map_err(|source| Error::Io { path: self.path.clone(), source })?.len();
        Ok(SnapshotStats {
            entries,
            legacy_entries: legacy,
            per_node,
            clock_range: first.zip(last),
            clock: self.meta.clock,
            capacity: self.meta.capacity,
            file_bytes,
            schema: self.meta.schema,
            hash_scheme: self.meta.hash_scheme.clone(),
            writer: self.writer(),
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
        let primary = self.txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let generations = self.txn.open_table(GENERATIONS).map_err(redb_err("opening the generations"))?;
        let live = self.txn.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
        let mut check = Check::default();
        let mut legacy = 0;
        let note = |problems: &mut Vec<String>, p: String| {
            if problems.len() < 20 {
                problems.push(p);
            }
        };
        for item in primary.iter().map_err(redb_err("reading the prefix table"))? {
            let (key, value) = item.map_err(redb_err("reading the prefix table"))?;
            let (key, entry) = (key.value().to_be_bytes(), Entry::from_tuple(value.value()));
            check.entries += 1;
            legacy += u64::from(is_legacy(&key));
            if entry.clock > self.meta.clock {
                note(
                    &mut check.problems,
                    format!("prefix {} has clock {} > high-water mark {}", hex(&key), entry.clock, self.meta.clock),
                );
            }
            if !self.nodes.contains_key(&entry.node) {
                note(&mut check.problems, format!("prefix {} names unknown node id {}", hex(&key), entry.node));
            }
            if !is_legacy(&key) && !self.namespaces.contains_key(&entry.namespace) {
                note(
                    &mut check.problems,
                    format!("prefix {} names unknown namespace id {}", hex(&key), entry.namespace),
                );
            }
        }
        // Each entry is counted at most once (a generation lists a key once, and an entry has one
        // clock), so if the counts add up to the entries, every entry is listed in its generation.
        let mut generation_count = 0u64;
        for item in generations.iter().map_err(redb_err("reading the generations"))? {
            let (clock, keys) = item.map_err(redb_err("reading the generations"))?;
            let (clock, keys) = (clock.value(), keys.value());
            generation_count += 1;
            if keys.len() % 16 != 0 {
                note(&mut check.problems, format!("generation {clock} lists {} bytes, not 16 per key", keys.len()));
            }
            let mut here = 0u32;
            let mut seen = std::collections::HashSet::new();
            for chunk in keys.chunks_exact(16) {
                let mut key = [0u8; 16];
                key.copy_from_slice(chunk);
                if !seen.insert(key) {
                    note(&mut check.problems, format!("generation {clock} lists {} twice", hex(&key)));
                    continue;
                }
                let entry = primary
                    .get(stored(&key))
                    .map_err(redb_err("reading a prefix"))?
                    .map(|g| Entry::from_tuple(g.value()));
                here += u32::from(entry.is_some_and(|e| e.clock == clock));
            }
            let counted = live.get(clock).map_err(redb_err("reading the live counts"))?.map(|g| g.value());
            if counted != Some(here).filter(|&n| n > 0) {
                note(
                    &mut check.problems,
                    format!("generation {clock} has {here} live keys but its count says {counted:?}"),
                );
            }
            check.clock_entries += u64::from(here);
        }
        if count(&live)? != generation_count {
            note(&mut check.problems, format!("{} live counts for {generation_count} generations", count(&live)?));
        }
        if check.entries != check.clock_entries {
            note(
                &mut check.problems,
                format!("{} prefixes but {} listed live in their generation", check.entries, check.clock_entries),
            );
        }
        if count(&primary)? != check.entries {
            note(&mut check.problems, "the prefix table's length disagrees with its entries".into());
        }
        if self.meta.entries != check.entries || self.meta.legacy_entries != legacy {
            note(
                &mut check.problems,
                format!(
                    "meta counts {} entries ({} from 0.1.7), the tables hold {} ({legacy})",
                    self.meta.entries, self.meta.legacy_entries, check.entries
                ),
            );
        }
        Ok(check)
    }
}

/// Runs redb's full integrity check (every page checksum) on a copy of `path`, so that the file
/// itself is never repaired or written. Returns `Ok(false)` for a corrupted file.
///
/// # Errors
/// [`Error::Io`] if the copy cannot be made; [`Error::Storage`].
pub fn integrity_check_copy(path: &Path) -> Result<bool> {
    match check_copy(path) {
        Err(Error::UnknownFormat { .. }) => Ok(false),
        verdict => verdict,
    }
}

/// [`integrity_check_copy`], with a file redb does not recognise at all as
/// [`Error::UnknownFormat`].
fn check_copy(path: &Path) -> Result<bool> {
    let copy = std::env::temp_dir().join(format!("superfluid-warm-check-{}-{}.redb", std::process::id(), unique()));
    std::fs::copy(path, &copy).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let result = redb::Builder::new().set_check_integrity_on_open(true).open(&copy);
    let verdict = match result {
        Ok(mut db) => match db.check_integrity() {
            Ok(ok) => Ok(ok),
            Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))) => Ok(false),
            Err(e) => Err(redb_err("checking integrity")(e)),
        },
        Err(redb::DatabaseError::Storage(redb::StorageError::Corrupted(_))) => Ok(false),
        Err(redb::DatabaseError::Storage(redb::StorageError::Io(io)))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Err(Error::UnknownFormat { detail: format!("{}: {io}", path.display()) })
        }
        Err(e) => Err(redb_err("checking integrity")(e)),
    };
    let _ = std::fs::remove_file(&copy);
    verdict
}

/// Copies `path` beside the temporary directory and recovers the copy as a writer would (redb's
/// repair), so that a file left by a crashed head can be checked without touching it. Returns the
/// copy's path; the caller removes it.
///
/// # Errors
/// [`Error::Io`] if the copy cannot be made; [`Error::Corrupted`] or [`Error::Storage`] if it
/// cannot be recovered.
pub fn recovered_copy(path: &Path) -> Result<PathBuf> {
    let copy = std::env::temp_dir().join(format!("superfluid-warm-recover-{}-{}.redb", std::process::id(), unique()));
    std::fs::copy(path, &copy).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    match redb::Builder::new().open(&copy) {
        Ok(db) => {
            drop(db);
            Ok(copy)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&copy);
            Err(open_error(path, e))
        }
    }
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Lower-case hex of a key.
pub fn hex(key: &[u8]) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}
