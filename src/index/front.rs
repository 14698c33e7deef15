//! The caller's side of a `Warm`: the decided state, the memtable of changes not yet committed
//! (answered before redb has them), the committed view, and the queue the commit thread drains.
//! Callers only ever hold this lock for a few microseconds, and it never reads a table whole:
//! everything the callers decide from is loaded by `open` (see `warm.rs`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::memtable::{Map, Memtable};
use super::presence::Presence;
use super::queue::{Queue, Queued};
use super::view_read::ViewRead;
use crate::decided::Decided;
use crate::decided::effect::Effect;
use crate::error::Error;
use crate::keys::BlockKey;

/// The prefix table as of a commit.
pub(crate) type Committed = redb::ReadOnlyTable<u128, (u32, u32, u32, u64)>;
/// The others of each block as of a commit.
pub(crate) type CommittedOthers = redb::ReadOnlyTable<u128, &'static [u8]>;

/// Blocks queued and not yet taken by the commit thread above which `ran` waits for it.
pub(crate) const MAX_QUEUED_BLOCKS: usize = 1 << 19;

/// Bytes of changes not yet committed (the memtable, and the keys and effects the queue and the
/// batch hold) above which `ran` waits for the commit thread: memory stays bounded in bytes,
/// whatever the prompts' lengths. Sized with [`DEFAULT_CACHE_BYTES`](crate::DEFAULT_CACHE_BYTES):
/// the two together keep a head filling 10M entries from one thread under 256 MiB resident,
/// while the commit thread still gets batches large enough to keep up back to back.
pub(crate) const MAX_UNCOMMITTED_BYTES: usize = 44 << 20;

/// Bytes of engine rows not yet committed above which an engine batch waits for the commit
/// thread. Lower than [`MAX_UNCOMMITTED_BYTES`]: a head following full engines holds their
/// blocks in memory as well (`decided/engines/`), and a commit of this many rows already
/// amortises its sync.
pub(crate) const MAX_UNCOMMITTED_ENGINE_BYTES: usize = 16 << 20;

/// Blocks in one batch above which it is committed without waiting for the window: bounds the
/// dirty pages a write transaction holds in memory when the commit thread is saturated.
pub(crate) const MAX_BATCH_BLOCKS: usize = 1 << 16;

/// How long a `ran` on a node whose engine reports what it holds is answered before the engine's
/// events confirm it (`Builder::engine_grace`): vLLM publishes a store within one scheduler step
/// of the request's start, so a few seconds cover a loaded engine and a slow link.
pub const DEFAULT_ENGINE_GRACE: Duration = Duration::from_secs(3);

/// The file's figures as of the last flush (what `stats` reports).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Published {
    pub entries: u64,
    pub legacy_entries: u64,
    pub capacity: u64,
    /// Blocks that name each node id (the prefix table's and the others), by id.
    pub held: Arc<[u64]>,
}

/// The committed view: one immutable value, built outside the front lock and swapped whole.
/// Its version changes with every swap, and keys the callers' memos.
pub(crate) struct View {
    pub version: u64,
    /// The tables as of the last commit.
    pub tables: Arc<(Committed, CommittedOthers)>,
    /// A filter of the keys the prefix table holds (and more), once one is built: a key it does
    /// not hold is not read from the file.
    pub presence: Option<Arc<Presence>>,
    pub published: Published,
}

impl View {
    /// This view with `change` made, as the next version (the tables are shared).
    pub(crate) fn next(&self, change: impl FnOnce(&mut View)) -> View {
        let mut next = self.with_published(self.published.clone());
        next.version += 1;
        change(&mut next);
        next
    }

    /// This view with other figures: the same answers, so the same version.
    pub(crate) fn with_published(&self, published: Published) -> View {
        View { version: self.version, tables: Arc::clone(&self.tables), presence: self.presence.clone(), published }
    }

    pub(crate) fn prefixes(&self) -> &Committed {
        &self.tables.0
    }

    pub(crate) fn others(&self) -> &CommittedOthers {
        &self.tables.1
    }
}

/// The caller's side. Its state changes only through its named methods (the decided state
/// through [`Decided`]'s): the memtable and the queue with a change pushed, taken, requeued or
/// installed; the view swapped whole; a commit's failure and success; an import; the close.
pub(crate) struct Front {
    /// What the callers have decided: the one copy.
    pub decided: Decided,
    /// Every change not yet committed, by block key.
    memtable: Memtable,
    /// The last commit: replaced whole, with the memtable maps that commit made redundant
    /// dropped, under this lock, so every `ran` is always in one or the other.
    view: Arc<View>,
    /// Changes the commit thread has not taken yet, and their figures.
    queue: Queue,
    /// Nodes a block keeps.
    pub nodes_per_prefix: usize,
    /// The committed view's part of the last answer (read with no lock held): a `ran` that
    /// follows the `warmest` or `warm_nodes` of its prompt does not read it again.
    read: Option<Arc<ViewRead>>,
    /// Set while a change is made with the writer held alone (an import, a cache size): changes
    /// wait for it.
    importing: bool,
    /// The error of the last commit, while none has succeeded since.
    failed: Option<Error>,
    /// Set when the handle is closing: the commit thread stops.
    closing: bool,
    /// `ran`s on nodes whose engines report what they hold, oldest first: (node, clock, when).
    /// Each is answered as a claim until `engine_grace` has passed (or the engine removed
    /// something since).
    claims: VecDeque<(u32, u64, Instant)>,
    /// How long a `ran` on such a node is answered before its engine's events confirm it.
    engine_grace: Duration,
}

impl Front {
    /// Takes `decided`, read again from the file, in place of the decided state, keeping the
    /// handle's settings the state carries (the attention chunk).
    pub(crate) fn replace_decided(&mut self, mut decided: Decided) {
        decided.engines.set_attention_chunk(self.decided.engines.attention_chunk());
        self.decided = decided;
    }

    pub(crate) fn new(decided: Decided, view: View, nodes_per_prefix: usize, engine_grace: Duration) -> Front {
        Front {
            decided,
            memtable: Memtable::default(),
            view: Arc::new(view),
            queue: Queue::default(),
            nodes_per_prefix,
            read: None,
            importing: false,
            failed: None,
            closing: false,
            claims: VecDeque::new(),
            engine_grace,
        }
    }

    /// The committed view answers read.
    pub(crate) fn view(&self) -> &Arc<View> {
        &self.view
    }

    /// Gives the callers the view with `change` made, as its next version (a presence filter
    /// built or dropped: what answers read changes).
    pub(crate) fn change_view(&mut self, change: impl FnOnce(&mut View)) {
        self.view = Arc::new(self.view.next(change));
    }

    /// Gives the callers the file's figures as of the last flush (the same answers: the same
    /// version).
    pub(crate) fn refigure(&mut self, published: Published) {
        if self.view.published != published {
            self.view = Arc::new(self.view.with_published(published));
        }
    }

    /// The changes not yet committed (read-only: they change through [`Front::push`],
    /// [`Front::take`] and [`Front::install`]).
    pub(crate) fn memtable(&self) -> &Memtable {
        &self.memtable
    }

    /// Gives back a map [`Front::install`] dropped, emptied outside the lock (`used`: the keys it
    /// held), as the next open map; returns it if it is not wanted.
    pub(crate) fn reuse_map(&mut self, map: Map, used: usize) -> Option<Map> {
        self.memtable.reuse(map, used)
    }

    /// The committed view's part of the last answer, if it answers for `prefix` on the view now
    /// (the whole view, if `whole`).
    pub(crate) fn last_read(&self, prefix: &crate::keys::Prefix, whole: bool) -> Option<Arc<ViewRead>> {
        self.read.clone().filter(|r| r.is_for(self.view.version, prefix, whole))
    }

    /// Keeps `read`, the committed view's part of an answer, for the `ran` that follows it.
    pub(crate) fn keep_read(&mut self, read: Arc<ViewRead>) {
        self.read = Some(read);
    }

    /// The error of the last commit, while none has succeeded since.
    pub(crate) fn failed(&self) -> Option<&Error> {
        self.failed.as_ref()
    }

    /// A commit failed with `error`: changes are refused until one succeeds.
    pub(crate) fn commit_failed(&mut self, error: Error) {
        self.failed = Some(error);
    }

    /// A commit succeeded: changes are taken again.
    pub(crate) fn commit_succeeded(&mut self) {
        self.failed = None;
    }

    /// Whether a change is being made with the writer held alone (an import, a cache size):
    /// other changes wait for it.
    pub(crate) fn importing(&self) -> bool {
        self.importing
    }

    /// Starts (`true`) or ends (`false`) a change made with the writer held alone.
    pub(crate) fn set_importing(&mut self, importing: bool) {
        self.importing = importing;
    }

    /// Whether the handle is closing (the commit thread stops).
    pub(crate) fn closing(&self) -> bool {
        self.closing
    }

    /// Marks the handle closing.
    pub(crate) fn close(&mut self) {
        self.closing = true;
    }

    /// Answers the `ran` just decided on `node`, whose engine reports what it holds, as a claim
    /// until the engine grace has passed.
    pub(crate) fn claim(&mut self, node: u32) {
        self.claims.push_back((node, self.decided.clock, Instant::now()));
    }

    /// Ends the claims whose grace window has passed.
    pub(crate) fn expire_claims(&mut self) {
        let now = Instant::now();
        while let Some(&(node, clock, at)) = self.claims.front() {
            if now.saturating_duration_since(at) < self.engine_grace {
                break;
            }
            self.decided.engines.expire_claims(node, clock);
            self.claims.pop_front();
        }
    }

    /// Bytes of the changes not yet committed: the memtable's maps, and each uncommitted block's
    /// key (held once, shared by the queue or the batch and the writer).
    pub(crate) fn uncommitted_bytes(&self) -> usize {
        self.memtable.bytes() + self.memtable.blocks() * std::mem::size_of::<BlockKey>() + self.queue.engine_bytes()
    }

    /// Whether engine batches must wait for the commit thread: their uncommitted rows passed
    /// [`MAX_UNCOMMITTED_ENGINE_BYTES`].
    pub(crate) fn engine_rows_full(&self) -> bool {
        self.queue.engine_bytes() > MAX_UNCOMMITTED_ENGINE_BYTES
    }

    /// Whether an entry of `clock` is live (not yet evicted by 0.1.7's rule).
    pub(crate) fn holds(&self, clock: u64) -> bool {
        self.decided.holds(clock)
    }

    /// Queues a decided change; its puts are answered at once.
    pub(crate) fn push(&mut self, queued: Queued) {
        for effect in &queued.effects {
            if let Effect::Put { blocks, node, clock, .. } = effect {
                self.memtable.push(*clock, blocks, *node, self.nodes_per_prefix > 1);
            }
        }
        self.queue.push(queued);
    }

    /// The queue: what the commit thread has not taken yet (read-only; it changes through
    /// [`Front::push`], [`Front::take`], [`Front::requeue`], [`Front::install`] and
    /// [`Front::retry_later`]).
    pub(crate) fn queue(&self) -> &Queue {
        &self.queue
    }

    /// The queue's figures now, numbered: (reading, blocks queued, bytes uncommitted).
    pub(crate) fn queue_figures(&mut self) -> (u64, usize, usize) {
        let bytes = self.uncommitted_bytes();
        self.queue.figures(bytes)
    }

    /// Takes the queue for the commit thread, freezing the memtable's open map with it.
    pub(crate) fn take(&mut self) -> Vec<Queued> {
        self.memtable.freeze(self.nodes_per_prefix > 1);
        self.queue.take()
    }

    /// Puts back `changes` (from a failed commit, oldest first) ahead of what was queued since:
    /// they are still in the memtable and will be retried.
    pub(crate) fn requeue(&mut self, changes: Vec<Queued>) {
        self.queue.requeue(changes);
    }

    /// A commit wrote nothing new to install (its changes stay answered from the memtable): the
    /// commit thread tries again a window from now.
    pub(crate) fn retry_later(&mut self) {
        self.queue.retry_later();
    }

    /// Installs `view`, a commit of everything the commit thread had taken, and drops the
    /// memtable's frozen map: every change in it was taken before that commit (a take freezes
    /// the open map, and both happen with the writer held). Returns what is replaced, to drop
    /// outside the lock.
    pub(crate) fn install(&mut self, view: View) -> (Arc<View>, Option<Map>) {
        let old = std::mem::replace(&mut self.view, Arc::new(view));
        let gone = self.memtable.drop_frozen();
        self.queue.committed();
        (old, gone)
    }
}
