//! `Warm`: the index a head links. Shared by reference (`&self`), `Send + Sync`.
//!
//! Its locks and their order: the table on `commit::Inner`. `back` (redb's writer) is held by
//! the commit thread, `sync`, `stats`, `import_json`, and `ran` when the sync window is zero;
//! `front` (the decided state, the memtable of uncommitted changes, the queue, the committed
//! view) by every call. With a commit thread, `warmest` and `ran` take only `front`, for microseconds; they
//! never wait for redb's writer, a commit or an fsync (only for back-pressure, when the commit
//! thread is far behind).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use redb::Database;

use super::answer;
use super::builder::Builder;
use super::commit::{
    Back, Flush, Inner, Sealer, committed, flush, flush_locked, flush_loop, mark_open, published, record_opened,
    record_queue,
};
use super::front::{Front, MAX_QUEUED_BLOCKS, MAX_UNCOMMITTED_BYTES, View};
use super::layer::{Layer, Layers};
use super::lookup;
use super::others::OthersCache;
use super::presence::Filters;
use super::queue::Queued;
use super::read_index::ReadIndex;
use crate::decided::Decided;
use crate::decided::caches::NodeCacheStats;
use crate::decided::effect::Effect;
use crate::decided::engines::Medium;
use crate::error::{Error, Result};
use crate::file::lock::HeadLock;
use crate::file::owner::Owner;
use crate::keys::{BlockKey, Namespace, Prefix, Scheme, check_node, legacy_key};
use crate::store::import::{ImportReport, LegacyJson, read_json};
use crate::store::load::named_pairs;
use crate::store::records::MAX_CAPACITY;
use crate::store::writer::Writer;
use crate::telemetry;

/// Whether a change may wait before it is made: for room while the commit thread is behind
/// (back-pressure), for an import to end, or, without a commit thread, for its own commit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Waits {
    /// It waits (every change but a head's claim on its request's thread).
    Yes,
    /// It is not made where it would wait ([`Changed::WouldWait`]).
    No,
}

/// What [`Warm::change`] did.
pub(crate) enum Changed<T> {
    /// Decided and queued: what the decision returned.
    Done(T),
    /// Not decided: what it read with no lock held is out of date (read again and retry).
    Stale,
    /// Not made: it would have waited, and the caller may not ([`Waits::No`]).
    WouldWait,
}

/// The node that ran the longest remembered prefix of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hit {
    /// The node's name.
    pub node: String,
    /// How many tokens of the prompt that prefix is (a multiple of 64, at least 128).
    pub tokens: usize,
    /// The slowest tier the node keeps that prefix in, by its engine's events: [`Medium::Gpu`]
    /// when all of it is in GPU memory, [`Medium::Cpu`] or [`Medium::Storage`] when an
    /// offloading connector keeps part of it there. `Gpu` for a node known by its `ran`s.
    pub tier: Medium,
    /// Of `tokens`, how many from the prompt's start are in GPU memory (all of them when
    /// `tier` is `Gpu`).
    pub gpu_tokens: usize,
}

impl Hit {
    /// A hit of `tokens` tokens on `node`, all of them in GPU memory.
    pub fn new(node: impl Into<String>, tokens: usize) -> Hit {
        Hit { node: node.into(), tokens, tier: Medium::Gpu, gpu_tokens: tokens }
    }
}

impl Prefix {
    /// Whether `hits`, the index's answer for this prompt (the start of a longer one, perhaps),
    /// is its answer for every prompt that starts with it: each node's warm prefix ends at least
    /// two whole blocks before this one's end, so a block the node does not hold lies inside it
    /// (one block short could be the last-token cap, not a missing block). Never while the index
    /// follows hybrid engines: what those reuse depends on the whole prompt. A head can route a
    /// long prompt on the answer for its start, and tokenize the rest after.
    pub fn settles(&self, hits: &[Hit]) -> bool {
        let whole = self.blocks.len() * crate::keys::BLOCK_TOKENS;
        self.fine.is_empty() && hits.iter().all(|h| h.tokens + 2 * crate::keys::BLOCK_TOKENS <= whole)
    }
}

/// What the index holds, as of the last `ran` (committed or not).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Entries (block hashes) held.
    pub entries: u64,
    /// Of those, imported from 0.1.7 and not yet evicted.
    pub legacy_entries: u64,
    /// Most entries kept.
    pub capacity: u64,
    /// The clock of the last `ran`.
    pub clock: u64,
    /// Every node ever seen, by id: one id per incarnation (a forgotten node's name gets a new
    /// id at its next `ran`).
    pub nodes: Vec<NodeStats>,
    /// Nodes named by blocks besides the last one to run them (the others), as last written
    /// into the batch.
    pub others: u64,
    /// Blocks (or others) that name a forgotten incarnation: answered as absent, their space
    /// reclaimed as they are evicted (as last written into the batch).
    pub reclaimable: u64,
    /// Whether changes are waiting for a commit.
    pub pending: bool,
    /// How the file was verified when it was opened.
    pub open_check: OpenCheck,
    /// The schema the file was upgraded from when it was opened, if it was.
    pub upgraded_from: Option<u32>,
    /// The process id of the head that left the file open (it crashed, or was killed) when this
    /// one opened it, and so recovered it to that head's last commit.
    pub recovered_from: Option<u32>,
    /// The cache of each current node incarnation: blocks held against its capacity, as of the
    /// last change.
    pub node_caches: Vec<NodeCacheStats>,
}

/// One node incarnation of [`Stats::nodes`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeStats {
    /// The node's name.
    pub name: String,
    /// Whether this incarnation was forgotten ([`Warm::forget_node`]): nothing it ran is
    /// answered, and its name's next `ran` is a new incarnation.
    pub forgotten: bool,
}

/// How a file was found when it was opened.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Opened {
    pub check: OpenCheck,
    pub upgraded_from: Option<u32>,
    /// The head that had left the file open, whose last commit this open recovered.
    pub recovered_from: Option<u32>,
}

/// How a file was verified when it was opened (see [`Builder::check_integrity_on_open`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OpenCheck {
    /// Its seal matched: the file is, byte for byte, what this index left at a clean close.
    Seal,
    /// redb verified every page's checksum (no seal, or one that did not match; a new file).
    Pages,
    /// Not verified: the check was turned off.
    Skipped,
}

/// Which node last ran each prompt prefix, kept in a redb file.
///
/// ```no_run
/// # fn main() -> Result<(), superfluid_warm::Error> {
/// use superfluid_warm::ReadIndex; // warmest, warm_nodes, prefix
/// let warm = superfluid_warm::Warm::open("warm.redb")?;
/// let prompt: Vec<u32> = (0..300).collect();
/// warm.ran("llama-3-8b", &prompt, "node-a")?;
/// let hit = warm.warmest("llama-3-8b", &prompt)?;
/// assert_eq!(hit.map(|h| h.tokens), Some(256));
/// warm.sync()?; // durable now; otherwise within the sync window
/// # Ok(()) }
/// ```
pub struct Warm {
    inner: Arc<Inner>,
    flusher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Warm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warm").field("window", &self.inner.window).finish_non_exhaustive()
    }
}

impl Warm {
    /// Opens (or creates) the index at `path` with the default settings.
    ///
    /// # Errors
    /// See [`Builder::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Warm> {
        Builder::new().open(path)
    }

    /// A builder for the settings.
    pub fn builder() -> Builder {
        Builder::new()
    }

    /// Starts a `Warm` on a prepared file: the callers' side, and the commit thread unless the
    /// window is zero. `lock` is the head's lock of the file at its path (none for a custom
    /// backend).
    pub(crate) fn start(
        db: Database,
        (writer, decided): (Writer, Decided),
        (window, engine_grace): (Duration, Duration),
        opened: Opened,
        scheme: Scheme,
        lock: Option<(HeadLock, PathBuf)>,
        compact_on_close: bool,
    ) -> Result<Warm> {
        let view = View {
            version: 0,
            tables: Arc::new(committed(&db)?),
            presence: None,
            published: published(&writer, writer.node_counts(&db)?.into()),
        };
        let others = Mutex::new(OthersCache::of(&view.tables));
        // A hybrid engine's holdings read from the file are answered from the first prompt.
        let hybrid_sizes = AtomicU64::new(sizes_mask(&decided.engines.hybrid_sizes()));
        let front = Front::new(decided, view, writer.nodes_per_prefix, engine_grace);
        let inner = Arc::new(Inner {
            others,
            durable_position: AtomicU64::new(writer.position),
            queue_recorded: Mutex::new(0),
            scheme,
            legacy: AtomicBool::new(writer.meta.legacy_entries > 0),
            hybrid_sizes,
            presence: Mutex::default(),
            back: Mutex::new(Back { writer, batch: Vec::new() }),
            front: Mutex::new(front),
            wake: Condvar::new(),
            drained: Condvar::new(),
            window,
            opened,
            db,
            owner: Owner::current(),
            // Only a file verified at open may be sealed: a seal vouches for every byte.
            sealer: Sealer {
                lock,
                sealable: opened.check != OpenCheck::Skipped,
                compact: compact_on_close,
                clean: AtomicBool::new(false),
            },
        });
        // The file's figures as opened, before anything can commit.
        record_opened(&inner);
        let flusher = if window.is_zero() {
            mark_open(&inner);
            None
        } else {
            let for_thread = Arc::clone(&inner);
            let handle = std::thread::Builder::new()
                .name("superfluid-warm-commit".into())
                .spawn(move || flush_loop(&for_thread))
                .map_err(|source| Error::Thread { source: Arc::new(source) })?;
            Some(handle)
        };
        Ok(Warm { inner, flusher })
    }

    /// A prefix must be hashed in this file's scheme: another scheme's keys would never match.
    fn same_scheme(&self, prefix: &Prefix) -> Result<()> {
        answer::same_scheme(self.inner.scheme, prefix)
    }

    /// `Ok` in the process that opened the index: every public call checks it before it takes
    /// a lock (a fork's child would find them as the parent's threads left them).
    ///
    /// # Errors
    /// [`Error::Forked`] in a child made by `fork`.
    pub(crate) fn in_owner(&self) -> Result<()> {
        self.inner.owner.check()
    }

    pub(super) fn front(&self) -> Result<MutexGuard<'_, Front>> {
        self.inner.front.lock().map_err(|_| Error::Poisoned)
    }

    fn back(&self) -> Result<MutexGuard<'_, Back>> {
        self.inner.back.lock().map_err(|_| Error::Poisoned)
    }

    /// Records that `node` ran `tokens` for `model`: every whole block of it now points at
    /// `node`. Atomic: after any crash either all of its blocks are there or none. Durable after
    /// the next [`Warm::sync`], or about the sync window after it returns.
    ///
    /// A failed commit loses nothing in memory: its `ran`s stay answered and are retried by the
    /// next commit; only a crash or a close that cannot commit loses them. After an I/O error
    /// (a failed write or sync, a full disk) redb takes no more writes through this handle, so
    /// no retry succeeds: the error says so ([`Error::needs_reopen`]), and the head reopens the
    /// file (what was committed is there; what was not is lost with the handle).
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long model or node name;
    /// [`Error::CommitFailed`] while the commit thread's last commit failed and none has
    /// succeeded since (this call did nothing; the `ran`s before it are kept and retried);
    /// with a zero sync window, [`Error::Storage`] if the commit fails (this `ran` is kept and
    /// retried with the next, but is not durable).
    pub fn ran(&self, model: &str, tokens: &[u32], node: &str) -> Result<()> {
        let prefix = self.prefix(&Namespace::new(model)?, tokens);
        self.ran_prefix(&prefix, node)
    }

    /// [`Warm::ran`] for a prefix hashed by [`ReadIndex::prefix`]. Costs the caller a hash-map insert
    /// per block; the commit thread writes it to the file.
    ///
    /// # Errors
    /// As [`Warm::ran`].
    pub fn ran_prefix(&self, prefix: &Prefix, node: &str) -> Result<()> {
        self.ran_at(prefix, node, 0, Waits::Yes).map(drop)
    }

    /// [`Warm::ran_prefix`] for a thread that must not wait on the writer (a request's):
    /// `Ok(false)`, recording nothing, where the `ran` would wait: the commit thread is behind
    /// (back-pressure), an import is in progress, or there is no commit thread (a zero sync
    /// window: the `ran` would commit and sync itself). The caller then hands the `ran` to a
    /// thread that may wait. It looks under the callers' lock whether it would; then, like
    /// `ran_prefix`, it reads the prompt's blocks from the last commit (from the file when they
    /// are not in redb's cache) with no lock held, and takes the callers' lock for the change.
    ///
    /// # Errors
    /// As [`Warm::ran`].
    #[must_use = "`Ok(false)` recorded nothing: hand the `ran` to a thread that may wait"]
    pub fn try_ran_prefix(&self, prefix: &Prefix, node: &str) -> Result<bool> {
        self.ran_at(prefix, node, 0, Waits::No)
    }

    /// [`Warm::ran_prefix`], applying a shared event at stream sequence `position` (0: a head's
    /// own `ran`); the position is committed with it. `false`: not recorded, as it would have
    /// waited and `waits` is [`Waits::No`].
    pub(crate) fn ran_at(&self, prefix: &Prefix, node: &str, position: u64, waits: Waits) -> Result<bool> {
        self.in_owner()?;
        check_node(node)?;
        self.same_scheme(prefix)?;
        if prefix.blocks.is_empty() {
            return Ok(true);
        }
        // Not worth the read of the view if it would wait now (`change` looks again).
        if waits == Waits::No && (self.flusher.is_none() || self.held_back(&*self.front()?)) {
            return Ok(false);
        }
        let blocks: Arc<[BlockKey]> = prefix.blocks.as_slice().into();
        // The committed view's part, read with no lock held: the whole view only if what the
        // node's cache held is read from what each block names.
        let mut whole = false;
        loop {
            let read = answer::view_read(&self.inner.front, &self.inner.others, prefix, whole)?;
            let decided = self.change(
                position,
                waits,
                |front| {
                    if !read.fits(front) {
                        return Ok(None);
                    }
                    // Decided now, once: the blocks this `ran` keeps live (a prefix of its chain, in
                    // runs of equal clocks), for 0.1.7's eviction; and, if its node's cache is kept,
                    // the blocks of the prompt it held, by the clock it last ran them at.
                    let by_writer = lookup::remembered_runs(front, &prefix.blocks, &read);
                    let runs: Vec<(u64, u64)> = by_writer.iter().map(|&((_, clock), n)| (clock, n)).collect();
                    let held = match front.decided.caches.tracks(node) {
                        true => {
                            let id = front.decided.nodes.current(node);
                            match lookup::node_runs(front, id, &prefix.blocks, &by_writer, &read) {
                                Some(held) => held,
                                None => {
                                    whole = true;
                                    return Ok(None);
                                }
                            }
                        }
                        false => Vec::new(),
                    };
                    let effects = front.decided.ran(&prefix.namespace, &blocks, node, &runs, &held)?;
                    // A `ran` on a node whose engine reports what it holds is a claim until its
                    // grace window passes.
                    if let Some(id) = front.decided.nodes.current(node).filter(|&id| front.decided.engines.streams(id))
                    {
                        front.claim(id);
                    }
                    Ok(Some(((), effects)))
                },
                |()| telemetry::ran(),
            )?;
            match decided {
                Changed::Done(()) => return Ok(true),
                Changed::WouldWait => return Ok(false),
                Changed::Stale => {}
            }
        }
    }

    /// Decides a change under the front lock (once the back-pressure lets it) with `decide`,
    /// and queues its effects with stream position `position`; without a commit thread, commits
    /// it before returning. `decided` gets what `decide` returned once the change is queued and
    /// the callers' lock released, before that commit (which keeps the change if it fails):
    /// what the change reports is recorded once, whatever the commit does. `decide` may decide
    /// nothing (`None`: what it read with no lock held is out of date): then nothing is queued,
    /// and this returns [`Changed::Stale`]. With [`Waits::No`], a change that would wait (for
    /// room, an import, or its own commit) is not made: [`Changed::WouldWait`].
    ///
    /// # Errors
    /// `decide`'s; [`Error::CommitFailed`] while commits fail; without a commit thread, the
    /// commit's.
    pub(super) fn change<T>(
        &self,
        position: u64,
        waits: Waits,
        decide: impl FnOnce(&mut Front) -> Result<Option<(T, Vec<Effect>)>>,
        decided: impl FnOnce(&T),
    ) -> Result<Changed<T>> {
        // Without a commit thread, this change is committed by this call alone: the writer is
        // held from before it is queued, so no other caller's commit (or failure) takes it.
        let back = match (self.flusher.is_some(), waits) {
            (true, _) => None,
            (false, Waits::No) => return Ok(Changed::WouldWait),
            (false, Waits::Yes) => Some(self.back()?),
        };
        let (out, waited, queued) = {
            let mut front = self.front()?;
            // Back-pressure: the commit thread is behind (queue) or a commit is (memtable). And
            // an import in progress (with a commit thread; without one, it holds the writer).
            let mut waiting: Option<Instant> = None;
            while self.held_back(&front) {
                if waits == Waits::No {
                    return Ok(Changed::WouldWait);
                }
                waiting.get_or_insert_with(Instant::now);
                front = self.inner.drained.wait(front).map_err(|_| Error::Poisoned)?;
            }
            let waited = waiting.map(|since| since.elapsed());
            // While commits fail, the queue is not added to (it would only grow): with a commit
            // thread at all, without one past the back-pressure bound (each change retries).
            let full = self.flusher.is_some() || front.queue().blocks() > MAX_QUEUED_BLOCKS;
            if let Some(failed) = front.failed().filter(|_| full) {
                return Err(Error::CommitFailed { source: Box::new(failed.clone()) });
            }
            front.expire_claims();
            #[cfg(test)]
            let _held = super::view_read::probe::held();
            let Some((out, effects)) = decide(&mut front)? else { return Ok(Changed::Stale) };
            // A change that decided no effects and acknowledges no stream position has nothing
            // to commit.
            if !effects.is_empty() || position > 0 {
                let was_idle = front.queue().oldest().is_none();
                front.push(Queued { effects, at: Instant::now(), position });
                if self.flusher.is_some() && was_idle {
                    self.inner.wake.notify_one();
                }
            }
            (out, waited, front.queue_figures())
        };
        // Recorded with the callers' lock released.
        if let Some(waited) = waited {
            telemetry::backpressure(waited);
        }
        record_queue(&self.inner, queued);
        decided(&out);
        match back {
            Some(mut back) => flush_locked(&self.inner, &mut back, Flush::Commit).map(|()| Changed::Done(out)),
            None => Ok(Changed::Done(out)),
        }
    }

    /// Whether a change must wait before it is decided: an import is in progress, or the commit
    /// thread is behind (the queue or the uncommitted bytes past their bound; not while commits
    /// fail, when the change is refused instead).
    fn held_back(&self, front: &Front) -> bool {
        front.importing()
            || (front.queue().blocks() > MAX_QUEUED_BLOCKS || front.uncommitted_bytes() > MAX_UNCOMMITTED_BYTES)
                && self.flusher.is_some()
                && front.failed().is_none()
    }

    /// [`Warm::change`] for a change that is always decided (it reads nothing with no lock held).
    ///
    /// # Errors
    /// As [`Warm::change`].
    pub(super) fn change_now<T>(
        &self,
        position: u64,
        decide: impl Fn(&mut Front) -> Result<(T, Vec<Effect>)>,
        decided: impl Fn(&T),
    ) -> Result<T> {
        loop {
            if let Changed::Done(out) = self.change(position, Waits::Yes, |front| decide(front).map(Some), &decided)? {
                return Ok(out);
            }
        }
    }

    /// Forgets node `name` (it restarted or left: its KV cache is gone). When this returns, no
    /// answer names it for anything it ran before, and that is durable: across a reopen and a
    /// crash. Its next `ran` starts afresh, as a new incarnation. It costs O(1) in the node's
    /// entries: they are answered as absent at once, and their space is reclaimed as they are
    /// evicted ([`Stats::reclaimable`]). A node never seen is nothing to forget (still `Ok`).
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long name; [`Error::CommitFailed`] while the
    /// commit thread's last commit failed and none has succeeded since (nothing was forgotten);
    /// [`Error::Storage`] if the commit fails (answers already leave the node out, and the
    /// forget is retried with the next commit, but it is not durable).
    pub fn forget_node(&self, name: &str) -> Result<()> {
        self.forget_at(name, 0)?;
        self.sync()
    }

    /// Queues a forget of `name` (answers leave it out at once), applying a shared event at
    /// stream sequence `position` (0: a head's own); durable with the next commit.
    pub(crate) fn forget_at(&self, name: &str, position: u64) -> Result<()> {
        self.in_owner()?;
        check_node(name)?;
        // A node never seen is nothing to forget: no effects (a shared event's position is
        // still queued, so that the stream's last event is acknowledged whatever it was).
        self.change_now(position, |front| Ok(((), front.decided.forget(name).unwrap_or_default())), |()| {})
    }

    /// Sets the size of node `name`'s KV cache, in 64-token blocks (`None`: the default of
    /// [`Builder::node_cache_blocks`] again), for nodes of different sizes. From then on the
    /// index keeps for it only what its LRU cache can hold: a smaller size drops its oldest
    /// blocks at once, in O(dropped clocks). Kept in the file, for every incarnation of the name.
    /// Returns once that is durable. A node not seen yet is added.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long name; [`Error::InvalidConfig`] for 0
    /// blocks or more than [`MAX_CAPACITY`]; [`Error::Storage`] if a commit fails (the change is
    /// not made: answers keep the size before, and the caller may call again).
    pub fn set_node_capacity(&self, name: &str, blocks: Option<u64>) -> Result<()> {
        self.set_node_capacity_at(name, blocks, 0)
    }

    /// [`Warm::set_node_capacity`] as the shared event at stream sequence `position` (written
    /// with the change, as a `ran`'s is).
    pub(crate) fn set_node_capacity_at(&self, name: &str, blocks: Option<u64>, position: u64) -> Result<()> {
        check_node_capacity(name, blocks)?;
        self.change_caches(Some(name), blocks, position)
    }

    /// Sets (or with `None` removes) the default size of a node's KV cache, as
    /// [`Builder::node_cache_blocks`] does at open: every node without a size of its own then
    /// has that one (`None`: is not kept, and answered by what it ran, as without caches; what
    /// its cache had lost stays unanswered). Kept in the file. Returns once that is durable.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for 0 blocks or more than [`MAX_CAPACITY`]; [`Error::Storage`]
    /// if a commit fails (the change is not made).
    pub fn set_node_cache_default(&self, blocks: Option<u64>) -> Result<()> {
        check_cache_size(blocks)?;
        self.change_caches(None, blocks, 0)
    }

    /// Sets node `name`'s cache size (`Some`), or the default (`None`), as an import is made:
    /// with the writer held and changes waiting, everything before is committed, then the
    /// change is decided (a cache kept from now on starts from a scan of the file, which then
    /// holds every change decided before) and committed on its own.
    fn change_caches(&self, name: Option<&str>, blocks: Option<u64>, position: u64) -> Result<()> {
        self.in_owner()?;
        let mut back = self.back()?;
        self.front()?.set_importing(true);
        let mut decided = false;
        let changed = self.change_caches_locked(&mut back, (name, blocks, position), &mut decided);
        self.end_alone(changed.is_err() && decided)?;
        changed
    }

    /// [`Warm::change_caches`] with the writer held; `decided` is set once the change is.
    fn change_caches_locked(
        &self,
        back: &mut Back,
        (name, blocks, position): (Option<&str>, Option<u64>, u64),
        decided: &mut bool,
    ) -> Result<()> {
        flush_locked(&self.inner, back, Flush::Commit)?;
        *decided = true;
        // The nodes to seed and what each has lost (its floor, and the eviction's), taken under
        // the lock; the file is scanned outside it.
        let (ids, above): (Vec<u32>, Vec<u64>) = {
            let front = self.front()?;
            let decided = &front.decided;
            let ids = decided.caches_to_seed(name, blocks);
            ids.into_iter().map(|id| (id, decided.horizon.floor.max(decided.caches.floor(id)))).unzip()
        };
        let above = |node: u32| ids.iter().zip(&above).find(|p| *p.0 == node).map_or(0, |p| *p.1);
        let seeds = named_pairs(&self.inner.db, &ids, above)?;
        let effects = {
            let mut front = self.front()?;
            match name {
                Some(name) => front.decided.set_capacity(name, blocks, seeds)?,
                None => front.decided.set_cache_default(blocks, seeds),
            }
        };
        self.persist_alone(back, &effects, position)
    }

    /// Gives `effects`, decided with the writer held alone, to the batch and commits it.
    fn persist_alone(&self, back: &mut Back, effects: &[Effect], position: u64) -> Result<()> {
        if let Err(e) = back.writer.apply(&self.inner.db, effects, position) {
            return Err(back.writer.roll_back(&self.inner.db, e).error);
        }
        flush_locked(&self.inner, back, Flush::Commit)
    }

    /// Ends a change made with the writer held alone (and every change before it committed):
    /// if it was decided and then failed, what was decided goes back to what the file holds;
    /// then the callers' changes go on.
    fn end_alone(&self, undo: bool) -> Result<()> {
        let reloaded =
            if undo { Some(crate::store::load::load_decided(&self.inner.db, self.inner.scheme)) } else { None };
        let mut front = self.front()?;
        front.set_importing(false);
        match reloaded {
            Some(Ok(decided)) => front.replace_decided(decided),
            // What was decided is ahead of the file and cannot be read back: changes are refused
            // (`CommitFailed`, saying to reopen) rather than decided from it.
            Some(Err(e)) => front.commit_failed(e),
            None => {}
        }
        drop(front);
        self.inner.drained.notify_all();
        Ok(())
    }

    #[cfg(feature = "nats")]
    /// The stream sequence of the last shared event committed durably (0 if none).
    pub(crate) fn durable_position(&self) -> u64 {
        self.inner.durable_position.load(Ordering::Acquire)
    }

    #[cfg(feature = "nats")]
    /// The hash scheme of the file's keys.
    pub(crate) fn scheme(&self) -> Scheme {
        self.inner.scheme
    }

    /// Waits while the engine rows not yet committed fill their bound (with a commit thread
    /// that is not failing): engine batches wait for the commit thread, `ran`s do not.
    pub(super) fn wait_for_engine_room(&self) -> Result<()> {
        if !self.threaded() {
            return Ok(());
        }
        let mut front = self.front()?;
        let mut waiting: Option<Instant> = None;
        while front.engine_rows_full() && front.failed().is_none() {
            waiting.get_or_insert_with(Instant::now);
            front = self.inner.drained.wait(front).map_err(|_| Error::Poisoned)?;
        }
        drop(front);
        if let Some(since) = waiting {
            telemetry::backpressure(since.elapsed());
        }
        Ok(())
    }

    /// Whether a commit thread writes the file (the sync window is not zero).
    pub(crate) fn threaded(&self) -> bool {
        self.flusher.is_some()
    }

    /// Makes every `ran` so far durable (0.1.7's `save`): `Ok` means every `ran` that returned
    /// before this call is durable, whoever made it. Cheap when nothing changed.
    ///
    /// # Errors
    /// [`Error::Storage`] if the commit fails: what was committed before is intact, and the
    /// `ran`s since stay answered and are retried by the next commit.
    pub fn sync(&self) -> Result<()> {
        self.in_owner()?;
        flush(&self.inner, Flush::Commit)
    }

    /// Imports a 0.1.7 `warm.json` in one transaction, committed before it returns: its prefixes
    /// are answered (through the 0.1.7 hash) until they age out. Importing the same file twice
    /// does nothing the second time. The JSON file is only read.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::LegacyJson`] for a file that cannot be read or parsed (the
    /// index is unchanged); [`Error::Storage`] if the commit fails.
    pub fn import_json(&self, path: impl AsRef<Path>) -> Result<ImportReport> {
        self.import(&read_json(path.as_ref())?)
    }

    /// [`Warm::import_json`] of a file read by [`LegacyJson::read`]: read it first, and a bad
    /// file is refused before the index is opened at all.
    ///
    /// # Errors
    /// [`Error::Storage`] if the commit fails.
    pub fn import(&self, file: &LegacyJson) -> Result<ImportReport> {
        self.in_owner()?;
        let mut back = self.back()?;
        // Changes wait for the import; after it, what was decided is read again from the file
        // as the import committed it (with everything before it).
        self.front()?.set_importing(true);
        // The import writes keys no batch carries: the callers read the file until a filter
        // is rebuilt from it.
        *self.inner.presence.lock().map_err(|_| Error::Poisoned)? = Filters::default();
        {
            let mut front = self.front()?;
            front.change_view(|v| v.presence = None);
        }
        let mut decided = false;
        let imported = self.import_locked(&mut back, file, &mut decided);
        self.end_alone(imported.is_err() && decided)?;
        imported
    }

    /// The import, with the writer held and the callers' changes waiting; `decided` is set once
    /// it decides anything.
    fn import_locked(&self, back: &mut Back, file: &LegacyJson, decided: &mut bool) -> Result<ImportReport> {
        let db = &self.inner.db;
        // Everything before is committed first, under the same hold of the writer: the import's
        // batch then holds no `ran`, and a failure of it loses none.
        flush_locked(&self.inner, back, Flush::Commit)?;
        *decided = true;
        let mut report = ImportReport { in_file: file.len() as u64, imported: 0, already_imported: false, evicted: 0 };
        if back.writer.imported(&file.source()) {
            report.already_imported = true;
            return Ok(report);
        }
        let (ids, effects) = {
            let mut front = self.front()?;
            let (ids, mut effects) = front.decided.import_nodes(file.entries().iter().map(|(_, n, _)| n.as_str()))?;
            effects.extend(front.decided.start_import());
            (ids, effects)
        };
        let written = (|| {
            back.writer.apply(db, &effects, 0)?;
            let mut entries = Vec::with_capacity(file.len());
            for (hash, node, at) in file.entries() {
                let id = ids.get(node).copied().ok_or(Error::Poisoned)?;
                entries.push((legacy_key(*hash), id, *at));
            }
            let written = back.writer.write_legacy(db, &entries)?;
            let effects = self.front()?.decided.import_entries(&written);
            back.writer.apply(db, &effects, 0)?;
            back.writer.note_import(file.source(), written.len() as u64);
            Ok(written.len() as u64)
        })();
        report.imported = written.map_err(|e| back.writer.roll_back(db, e).error)?;
        flush_locked(&self.inner, back, Flush::Commit)?;
        // What is live now is the file's: decided again from it, then 0.1.7's eviction to the
        // capacity.
        let loaded = crate::store::load::load_decided(db, self.inner.scheme)?;
        let before = back.writer.meta.entries;
        let effects = {
            let mut front = self.front()?;
            front.replace_decided(loaded);
            front.decided.evict_to_capacity()
        };
        if !effects.is_empty() {
            self.persist_alone(back, &effects, 0)?;
        }
        report.evicted = before.saturating_sub(back.writer.meta.entries);
        Ok(report)
    }

    /// Counts and settings, as of every `ran` that returned (the queue is written into the batch
    /// first, so this may wait for a commit in progress).
    ///
    /// # Errors
    /// [`Error::Storage`] if writing the queue fails (those `ran`s are kept and retried).
    pub fn stats(&self) -> Result<Stats> {
        self.in_owner()?;
        flush(&self.inner, Flush::Write)?;
        let front = self.front()?;
        let (published, nodes) = (&front.view().published, &front.decided.nodes);
        let named: u64 = published.held.iter().sum();
        let reclaimable = published.held.iter().zip(nodes.all()).filter(|(_, (_, gone))| *gone).map(|(h, _)| h).sum();
        Ok(Stats {
            entries: published.entries,
            legacy_entries: published.legacy_entries,
            capacity: published.capacity,
            clock: front.decided.clock,
            nodes: nodes.all().map(|(name, forgotten)| NodeStats { name: name.to_string(), forgotten }).collect(),
            others: named.saturating_sub(published.entries),
            reclaimable,
            pending: front.queue().oldest().is_some(),
            open_check: self.inner.opened.check,
            upgraded_from: self.inner.opened.upgraded_from,
            recovered_from: self.inner.opened.recovered_from,
            node_caches: front.decided.caches.stats(nodes.all()),
        })
    }

    /// Commits what is pending, marks the file cleanly closed and closes it.
    ///
    /// # Errors
    /// As [`Warm::sync`].
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        self.in_owner()?;
        if let Ok(mut front) = self.inner.front.lock() {
            front.close();
        }
        self.inner.wake.notify_all();
        if let Some(handle) = self.flusher.take() {
            // A flusher that panicked has nothing left to commit for us.
            let _ = handle.join();
        }
        flush(&self.inner, Flush::Close)?;
        self.inner.sealer.clean.store(true, Ordering::Release);
        Ok(())
    }
}

/// Block sizes (powers of two up to 64) as bits: bit `2^n` set for size `2^n`.
fn sizes_mask(sizes: &[usize]) -> u64 {
    sizes.iter().filter(|s| s.is_power_of_two() && **s <= 64).fold(0u64, |m, s| m | *s as u64)
}

impl ReadIndex for Warm {
    fn prefix(&self, namespace: &Namespace, tokens: &[u32]) -> Prefix {
        // Bit `2^n` set: size `2^n` (see `note_hybrid_sizes`).
        let mask = self.inner.hybrid_sizes.load(Ordering::Relaxed);
        let sizes: Vec<usize> = (0..=6).map(|n| 1usize << n).filter(|&s| mask & s as u64 != 0).collect();
        answer::prefix(self.inner.scheme, self.inner.legacy.load(Ordering::Relaxed), &sizes, namespace, tokens)
    }

    /// About log2(blocks) lookups: a binary search over the uncommitted `ran`s and the last
    /// commit.
    fn warmest_prefix(&self, prefix: &Prefix) -> Result<Option<Hit>> {
        self.warmest_with(prefix, None)
    }

    /// A few reads a run of blocks one `ran` wrote, a read of each block's others, and a look at
    /// the uncommitted `ran`s per block (costlier than [`ReadIndex::warmest_prefix`]).
    fn warm_nodes_prefix(&self, prefix: &Prefix) -> Result<Vec<Hit>> {
        self.warm_nodes_with(prefix, None)
    }
}

impl Warm {
    /// Keeps the hybrid engines' block sizes (each a power of two: they divide 64) beside the
    /// decided state, for [`ReadIndex::prefix`] to read without its lock.
    pub(crate) fn note_hybrid_sizes(&self, sizes: &[usize]) {
        self.inner.hybrid_sizes.store(sizes_mask(sizes), Ordering::Relaxed);
    }

    /// [`ReadIndex::warmest_prefix`] over `own`'s writes first (a sharing head's own events not
    /// yet back from the stream), then the memtable and the last commit: one read path.
    pub(crate) fn warmest_with(&self, prefix: &Prefix, own: Option<&dyn Layer>) -> Result<Option<Hit>> {
        self.in_owner()?;
        self.same_scheme(prefix)?;
        let (front, others) = (&self.inner.front, &self.inner.others);
        let hit = answer::answer_with(front, others, prefix, false, |front, read| {
            answer::warmest(front, &Layers::new(front, own), prefix, read)
        })?;
        telemetry::answered(prefix.tokens(), hit.as_ref().map_or(0, |h| h.tokens));
        Ok(hit)
    }

    /// [`ReadIndex::warm_nodes_prefix`] over `own`'s writes first, as [`Warm::warmest_with`].
    pub(crate) fn warm_nodes_with(&self, prefix: &Prefix, own: Option<&dyn Layer>) -> Result<Vec<Hit>> {
        self.in_owner()?;
        self.same_scheme(prefix)?;
        let (front, others) = (&self.inner.front, &self.inner.others);
        let hits = answer::answer_with(front, others, prefix, true, |front, read| {
            answer::warm_nodes(front, &Layers::new(front, own), prefix, read)
        })?;
        telemetry::answered(prefix.tokens(), hits.first().map_or(0, |h| h.tokens));
        Ok(hits)
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        if !self.inner.owner.is_current() {
            // A fork's copy: the file, its locks and the commit thread are the parent's. Closing
            // redb here would write the parent's file from a stale state, so nothing is dropped.
            std::mem::forget(Arc::clone(&self.inner));
            std::mem::forget(self.flusher.take());
            return;
        }
        // Best effort: a caller who needs to know uses `close`.
        let _ = self.shutdown();
    }
}

/// A node name and cache size [`Warm::set_node_capacity`] takes.
///
/// # Errors
/// [`Error::InvalidName`] for an empty or over-long name; [`Error::InvalidConfig`] for a size of
/// 0 blocks or more than [`MAX_CAPACITY`].
pub(crate) fn check_node_capacity(name: &str, blocks: Option<u64>) -> Result<()> {
    check_node(name)?;
    check_cache_size(blocks)
}

/// A node cache size: 1 to [`MAX_CAPACITY`] blocks (or none).
pub(crate) fn check_cache_size(blocks: Option<u64>) -> Result<()> {
    match blocks.filter(|&b| b == 0 || b > MAX_CAPACITY) {
        Some(b) => Err(Error::InvalidConfig { detail: format!("node cache of {b} blocks (1 to {MAX_CAPACITY})") }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod presence_tests {
    #![allow(clippy::indexing_slicing)]

    use std::time::{Duration, Instant};

    use redb::{ReadableDatabase, ReadableTable};

    use super::*;
    use crate::error::redb_err;
    use crate::index::commit::lock_filters;
    use crate::index::presence::Presence;
    use crate::store::tables::PREFIXES;

    /// Gives the callers a view with `filter` instead; returns the one it had.
    fn set_filter(warm: &Warm, filter: Option<Arc<Presence>>) -> Result<Option<Arc<Presence>>> {
        let mut front = warm.front()?;
        let old = front.view().presence.clone();
        front.change_view(|v| v.presence = filter);
        Ok(old)
    }

    /// With the commit thread, a small file whose filter fills and is rebuilt many times: after
    /// every round, once the build is whole, every key of the committed table is in the
    /// callers' filter, and the answers are those of a file read without one.
    #[test]
    fn the_filter_holds_every_committed_key_through_rebuilds() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = std::env::temp_dir().join(format!("sfw-presence-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let warm = Warm::builder().capacity(200).sync_window(Duration::from_millis(2)).open(dir.join("w.redb"))?;
        for round in 0..30u32 {
            // Conversations of this round and the last: half the keys are new each round.
            let prompts: Vec<Vec<u32>> = (0..40u32)
                .map(|c| c + 20 * round)
                .map(|c| (0..(64 * (2 + c % 9))).map(|t| if t < 128 { t } else { t * 31 + c }).collect())
                .collect();
            for (i, tokens) in prompts.iter().enumerate() {
                warm.ran("m", tokens, &format!("node-{}", (i as u32 + round) % 5))?;
            }
            warm.sync()?;
            let started = Instant::now();
            let settling = || {
                lock_filters(&warm.inner).building.is_some() || warm.front().is_ok_and(|f| f.view().presence.is_none())
            };
            while settling() && started.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let front = warm.front()?;
            let Some(filter) = front.view().presence.clone() else { panic!("round {round}: no filter") };
            let read = warm.inner.db.begin_read().map_err(redb_err("read"))?;
            let table = read.open_table(PREFIXES).map_err(redb_err("table"))?;
            for item in table.iter().map_err(redb_err("iter"))? {
                let (key, _) = item.map_err(redb_err("item"))?;
                if !filter.may_hold(&key.value().to_be_bytes()) {
                    let (building, built, same) = {
                        let f = lock_filters(&warm.inner);
                        (f.building.is_some(), f.built, f.live.as_ref().is_some_and(|l| Arc::ptr_eq(l, &filter)))
                    };
                    panic!(
                        "round {round}: a committed key is missing (building {building}, built {built}, the callers' is the live one {same}, settled after {:?})",
                        started.elapsed()
                    );
                }
            }
            drop(front);
            for tokens in &prompts {
                let with = warm.warmest("m", tokens)?;
                let hold = set_filter(&warm, None)?;
                let without = warm.warmest("m", tokens)?;
                // Unless the commit thread gave the callers a rebuilt filter meanwhile (putting
                // the old one back would leave them one that misses the keys written since).
                if warm.front()?.view().presence.is_none() {
                    set_filter(&warm, hold)?;
                }
                assert_eq!(with, without, "round {round}: the filter changed an answer");
            }
        }
        let built = lock_filters(&warm.inner).built;
        assert!(built >= 3, "the filter filled and was rebuilt: {built} builds");
        warm.close()?;
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }
}

#[cfg(test)]
mod settles_tests {
    use super::*;

    #[test]
    fn a_start_settles_when_every_warm_prefix_ends_two_blocks_inside_it() -> Result<()> {
        let ns = Namespace::new("m")?;
        // 10 whole blocks (and a part of one).
        let start = Prefix::new(&ns, &(0..660).collect::<Vec<u32>>());
        assert!(start.settles(&[]), "nothing warm anywhere");
        assert!(start.settles(&[Hit::new("a", 512), Hit::new("b", 128)]));
        // One block short of the end could be the last token's cap on a node holding it all.
        assert!(!start.settles(&[Hit::new("a", 128), Hit::new("b", 576)]));
        assert!(!start.settles(&[Hit::new("a", 640)]));
        // An index that follows hybrid engines: never (their reuse depends on the whole prompt).
        let mut hybrid = start.clone();
        hybrid.fine = vec![(16, Vec::new())];
        assert!(!hybrid.settles(&[]));
        Ok(())
    }
}

#[cfg(test)]
mod waits_tests {
    use std::time::Duration;

    use super::*;

    fn node_of(warm: &Warm, prefix: &Prefix) -> Result<Option<String>> {
        Ok(warm.warmest_prefix(prefix)?.map(|hit| hit.node))
    }

    #[test]
    fn a_ran_that_may_not_wait_records_nothing_where_it_would_wait() -> Result<()> {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let ns = Namespace::new("m")?;
        let (one, two): (Vec<u32>, Vec<u32>) = ((0..256).collect(), (1000..1256).collect());

        // No commit thread: the `ran` would commit and sync itself.
        let alone = Warm::builder().sync_window(Duration::ZERO).open(dir.path().join("zero.redb"))?;
        let first = alone.prefix(&ns, &one);
        assert!(!alone.try_ran_prefix(&first, "a")?);
        assert_eq!(node_of(&alone, &first)?, None);
        alone.ran_prefix(&first, "a")?;
        assert_eq!(node_of(&alone, &first)?.as_deref(), Some("a"));
        drop(alone);

        // With a commit thread, it is taken at once, as `ran_prefix` takes it.
        let warm = Arc::new(Warm::builder().sync_window(Duration::from_millis(20)).open(dir.path().join("w.redb"))?);
        let (first, second) = (warm.prefix(&ns, &one), warm.prefix(&ns, &two));
        assert!(warm.try_ran_prefix(&first, "a")?);
        assert_eq!(node_of(&warm, &first)?.as_deref(), Some("a"));

        // During an import it would wait: nothing is recorded, and a `ran_prefix` waits for
        // the import's end.
        warm.front()?.set_importing(true);
        let tried = {
            let (warm, second) = (Arc::clone(&warm), second.clone());
            std::thread::spawn(move || warm.try_ran_prefix(&second, "b"))
        };
        let since = std::time::Instant::now();
        while !tried.is_finished() && since.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(tried.is_finished(), "try_ran_prefix waited for an import");
        assert!(!tried.join().map_err(|_| Error::Poisoned)??);
        assert_eq!(node_of(&warm, &second)?, None);
        let waiter = {
            let (warm, second) = (Arc::clone(&warm), second.clone());
            std::thread::spawn(move || warm.ran_prefix(&second, "b"))
        };
        std::thread::sleep(Duration::from_millis(30));
        assert!(!waiter.is_finished(), "a ran_prefix went on during an import");
        warm.front()?.set_importing(false);
        warm.inner.drained.notify_all();
        waiter.join().map_err(|_| Error::Poisoned)??;
        assert_eq!(node_of(&warm, &second)?.as_deref(), Some("b"));
        Ok(())
    }
}
