//! `Builder`: the settings of a `Warm`, and opening one.

use std::path::{Path, PathBuf};
use std::time::Duration;

use redb::{ConcurrencyMode, Database};

use super::front::DEFAULT_ENGINE_GRACE;
use super::warm::{OpenCheck, Opened, Warm};
use crate::error::{Error, Result, open_error};
use crate::file::lock::{HeadLock, retry_while_held};
use crate::file::seal;
use crate::store::import::{LegacyJson, read_json};
use crate::store::load::named_pairs;
use crate::store::records::MAX_CAPACITY;
use crate::store::schema;
use crate::store::writer::{DEFAULT_NODES_PER_PREFIX, MAX_NODES_PER_PREFIX, Writer};

/// Page cache of the file by default: the commit thread's working set at the default capacity
/// (1M entries, a 136 MiB file) fits, and a head filling 10M entries stays under 256 MiB
/// resident (the cache is most of what it holds).
pub const DEFAULT_CACHE_BYTES: usize = 128 << 20;
/// Longest a `ran` waits to be made durable by default: on power loss, the `ran`s of about this
/// window plus one commit's write and fsync are lost.
pub const DEFAULT_SYNC_WINDOW: Duration = Duration::from_millis(50);

/// The settings of a [`Warm`]: `Warm::builder().capacity(1 << 16).open(path)`.
#[derive(Clone, Debug)]
pub struct Builder {
    capacity: Option<u64>,
    cache_bytes: usize,
    sync_window: Duration,
    check_integrity: bool,
    import: Option<PathBuf>,
    nodes_per_prefix: usize,
    compact_on_close: bool,
    node_cache_blocks: Option<u64>,
    engine_grace: Duration,
    attention_chunk: Option<usize>,
}

impl Default for Builder {
    fn default() -> Self {
        Self::new()
    }
}

impl Builder {
    /// The defaults: the file's capacity ([`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY) for a new file),
    /// [`DEFAULT_CACHE_BYTES`], [`DEFAULT_SYNC_WINDOW`], integrity checked on open.
    pub fn new() -> Builder {
        Builder {
            capacity: None,
            cache_bytes: DEFAULT_CACHE_BYTES,
            sync_window: DEFAULT_SYNC_WINDOW,
            check_integrity: true,
            import: None,
            nodes_per_prefix: DEFAULT_NODES_PER_PREFIX,
            compact_on_close: true,
            node_cache_blocks: None,
            engine_grace: DEFAULT_ENGINE_GRACE,
            attention_chunk: None,
        }
    }

    /// Most entries (blocks) kept; past it the oldest eighth is evicted. 1 to [`MAX_CAPACITY`].
    /// Unset, an existing file keeps the capacity it has and a new one gets [`DEFAULT_CAPACITY`](crate::DEFAULT_CAPACITY);
    /// set, it is recorded in the file (a smaller one evicts on open).
    pub fn capacity(&mut self, blocks: u64) -> &mut Self {
        self.capacity = Some(blocks);
        self
    }

    /// Bytes of the file kept in memory.
    pub fn cache_size(&mut self, bytes: usize) -> &mut Self {
        self.cache_bytes = bytes;
        self
    }

    /// Longest a `ran` waits before a background commit makes it durable (group commit).
    /// `Duration::ZERO` commits every `ran` before it returns. At most 60 s.
    pub fn sync_window(&mut self, window: Duration) -> &mut Self {
        self.sync_window = window;
        self
    }

    /// Whether the writer verifies the file when it opens it (default on: a bit-flipped file is
    /// refused with [`Error::Corrupted`] instead of answering wrongly or panicking in redb). A file
    /// whose seal (a digest of the whole file written beside it, `<file>.seal`, at its last clean
    /// close) matches is verified by that digest; any other by redb, page by page. Off, neither
    /// runs: only for storage that checksums itself.
    pub fn check_integrity_on_open(&mut self, check: bool) -> &mut Self {
        self.check_integrity = check;
        self
    }

    /// Whether a clean close compacts the file when it is sparse (default on): at least a
    /// quarter of it free pages, at most 128 MiB of them in use and at most 512 MiB in all
    /// (a bigger file would hold the close for seconds: use [`crate::IndexFile::compact`]). A head's
    /// commits leave the file several times its live data, and the next open's seal check reads
    /// every byte of it; compacting costs the close about what a durable write of the live pages
    /// costs. Skipped while a reader holds a transaction on the file.
    pub fn compact_on_close(&mut self, compact: bool) -> &mut Self {
        self.compact_on_close = compact;
        self
    }

    /// Nodes a block remembers: the one that ran it last (what `warmest` reads) and up to
    /// `nodes - 1` others that ran it before, each with its clock, the newest kept. 1 to
    /// [`MAX_NODES_PER_PREFIX`], default [`DEFAULT_NODES_PER_PREFIX`]; 1 keeps one node a block,
    /// as 0.1.7 did. Capacity still counts blocks. Not stored in the file: a file opened with
    /// fewer keeps the others it has until their blocks are rewritten, and answers with the
    /// newest `nodes`.
    pub fn nodes_per_prefix(&mut self, nodes: usize) -> &mut Self {
        self.nodes_per_prefix = nodes;
        self
    }

    /// The size of a node's KV cache, in 64-token blocks, for every node without one of its own
    /// ([`Warm::set_node_capacity`]): the index then keeps, per node, only what that node's LRU
    /// cache can still hold, and answers nothing else for it. 1 to [`MAX_CAPACITY`]. Recorded in
    /// the file (a smaller one evicts on open); unset, a file keeps the one it has, and a new one
    /// has none: every node is remembered for all it ran, as 0.1.7 did. The file's capacity
    /// ([`Builder::capacity`]) still bounds the whole.
    pub fn node_cache_blocks(&mut self, blocks: u64) -> &mut Self {
        self.node_cache_blocks = Some(blocks);
        self
    }

    /// How long a `ran` on a node whose engine reports what it holds ([`Warm::engine_batch`]) is
    /// answered before the engine's own events confirm it ([`DEFAULT_ENGINE_GRACE`]). An engine
    /// stores a request's blocks when it schedules it, so its events follow the routing
    /// decision by a step or more; until then the `ran` is the best guess. A removal or a
    /// clear from the engine ends its node's claims at once.
    pub fn engine_grace(&mut self, grace: Duration) -> &mut Self {
        self.engine_grace = grace;
        self
    }

    /// The attention chunk of the served model's chunked local attention layers, in tokens
    /// (Llama 4: `attention_chunk_size` in its `config.json`, 8,192). vLLM's events name a
    /// chunked local KV cache group but not its chunk; with it, an engine with such a group is
    /// answered what vLLM reuses (only the blocks of the chunk a prompt's hit ends in are
    /// needed there). Unset (or 0), such an engine is answered as holding nothing: never more
    /// than it reuses. A setting of this handle, not stored in the file.
    pub fn attention_chunk(&mut self, tokens: usize) -> &mut Self {
        self.attention_chunk = Some(tokens);
        self
    }

    /// A 0.1.7 `warm.json` to import on open (once: the same file again is skipped).
    pub fn import_json(&mut self, path: impl Into<PathBuf>) -> &mut Self {
        self.import = Some(path.into());
        self
    }

    fn redb(&self, mode: ConcurrencyMode, check: bool) -> redb::Builder {
        let mut builder = redb::Builder::new();
        builder.set_cache_size(self.cache_bytes).set_concurrency_mode(mode).set_check_integrity_on_open(check);
        builder
    }

    fn validate(&self) -> Result<()> {
        if let Some(c) = self.capacity.filter(|&c| c == 0 || c > MAX_CAPACITY) {
            return Err(Error::InvalidConfig { detail: format!("capacity {c} (1 to {MAX_CAPACITY})") });
        }
        super::warm::check_cache_size(self.node_cache_blocks)?;
        if !(1..=MAX_NODES_PER_PREFIX).contains(&self.nodes_per_prefix) {
            return Err(Error::InvalidConfig {
                detail: format!("{} nodes per prefix (1 to {MAX_NODES_PER_PREFIX})", self.nodes_per_prefix),
            });
        }
        if self.sync_window > Duration::from_secs(60) {
            return Err(Error::InvalidConfig { detail: format!("sync window {:?} (at most 60 s)", self.sync_window) });
        }
        Ok(())
    }

    /// Opens the index at `path`, creating it if absent, in redb's single-writer mode: read-only
    /// [`crate::Snapshot`]s may read it meanwhile. A file left by a crash is recovered to its
    /// last commit. The head holds a lock on the side file (`<file>.seal`) while it has the file
    /// open.
    ///
    /// # Errors
    /// [`Error::AlreadyOpen`] if another head has it open; [`Error::NewerSchema`] or
    /// [`Error::UnknownFormat`] for a file this build does not write; [`Error::Corrupted`] if it
    /// fails the integrity check; [`Error::LegacyJson`] for a bad import file (the index is not
    /// touched); [`Error::InvalidConfig`]; [`Error::Storage`].
    pub fn open(&self, path: impl AsRef<Path>) -> Result<Warm> {
        let path = path.as_ref();
        self.validate()?;
        let legacy = self.import.as_deref().map(read_json).transpose()?;
        let lock = HeadLock::acquire(path)?;
        let check = if !self.check_integrity {
            OpenCheck::Skipped
        } else if seal::matches(path) {
            OpenCheck::Seal
        } else {
            OpenCheck::Pages
        };
        let redb = self.redb(ConcurrencyMode::SingleWriter, check == OpenCheck::Pages);
        let db = retry_while_held(|| redb.create(path).map_err(|e| open_error(path, e)))?;
        // The side file is marked open by the started `Warm` (`Warm::start`), so that a refused
        // file (a newer schema, say) keeps its seal.
        self.start(db, legacy, check, Some((lock, path.to_path_buf())))
    }

    /// Opens the index on a custom redb storage backend (for fault injection and in-memory use),
    /// in redb's exclusive-writer mode.
    ///
    /// # Errors
    /// As [`Builder::open`].
    pub fn open_with_backend(&self, backend: impl redb::StorageBackend) -> Result<Warm> {
        self.validate()?;
        let legacy = self.import.as_deref().map(read_json).transpose()?;
        let check = if self.check_integrity { OpenCheck::Pages } else { OpenCheck::Skipped };
        let db = self
            .redb(ConcurrencyMode::ExclusiveWriter, self.check_integrity)
            .create_with_backend(backend)
            .map_err(crate::error::redb_err("opening the index"))?;
        self.start(db, legacy, check, None)
    }

    /// Prepares the opened file (schema, capacity, eviction to it, the import) and starts the
    /// `Warm` on it.
    fn start(
        &self,
        db: Database,
        legacy: Option<LegacyJson>,
        check: OpenCheck,
        lock: Option<(HeadLock, PathBuf)>,
    ) -> Result<Warm> {
        let prepared = schema::prepare(&db, self.capacity)?;
        let (scheme, resized) = (prepared.scheme, prepared.resized);
        let mut writer = Writer::load(&db, self.nodes_per_prefix)?;
        // A file whose meta still names a writer was left open by one (this head holds the lock).
        let recovered_from = writer.meta.writer.as_ref().map(|w| w.pid);
        let check = Opened { check, upgraded_from: prepared.upgraded_from, recovered_from };
        let mut decided = crate::store::load::load_decided(&db, scheme)?;
        decided.engines.set_attention_chunk(self.attention_chunk);
        // A new capacity is applied at once. Otherwise, as 0.1.7 after a load, a file left over
        // its capacity (by a `ran` longer than an eviction makes room for) is evicted at the
        // next `ran`, once.
        let mut effects = match resized {
            true => decided.evict_to_capacity(),
            false => Vec::new(),
        };
        // A new node cache size too: the caches it starts keeping start from what the file
        // names of their nodes, above the floor just decided.
        if let Some(blocks) = self.node_cache_blocks.filter(|&b| decided.caches.default != Some(b)) {
            let ids = decided.caches_to_seed(None, Some(blocks));
            let floor = decided.horizon.floor;
            let caches = &decided.caches;
            let seeds = named_pairs(&db, &ids, |node| floor.max(caches.floor(node)))?;
            effects.extend(decided.set_cache_default(Some(blocks), seeds));
        }
        if let Err(e) = writer.apply(&db, &effects, 0) {
            return Err(writer.roll_back(&db, e).error);
        }
        writer.commit(&db, false).map_err(|rolled_back| rolled_back.error)?;
        let warm = Warm::start(
            db,
            (writer, decided),
            (self.sync_window, self.engine_grace),
            check,
            scheme,
            lock,
            self.compact_on_close,
        )?;
        if let Some(file) = &legacy {
            warm.import(file)?;
        }
        Ok(warm)
    }
}
