//! The caller's side of a `Warm`: the clock, the `ran`s not yet committed (an overlay `warmest`
//! answers from before redb has them) and the queue the commit thread drains. Callers only ever
//! hold this lock for a few microseconds; redb's writer is the commit thread's (see `warm.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::horizon::Horizon;
use super::others::OthersCache;
use super::overlay::{Map, Overlay};
use super::presence::Presence;
use crate::error::Error;
use crate::keys::BlockKey;
use crate::store::caches::NodeCaches;
use crate::store::writer::{Change, Nodes};

/// The prefix table as of the last commit, shared with the callers.
pub(crate) type Committed = redb::ReadOnlyTable<u128, (u32, u32, u32, u64)>;
/// The others of each block as of the last commit.
pub(crate) type CommittedOthers = redb::ReadOnlyTable<u128, &'static [u8]>;

/// Blocks queued and not yet taken by the commit thread above which `ran` waits for it.
pub(crate) const MAX_QUEUED_BLOCKS: usize = 1 << 18;

/// Blocks in one batch above which it is committed without waiting for the window: bounds the
/// dirty pages a write transaction holds in memory when the commit thread is saturated.
pub(crate) const MAX_BATCH_BLOCKS: usize = 1 << 16;

/// A search's result, for the chain whose last key and length it names.
#[derive(Clone, Copy)]
pub(crate) struct Searched {
    pub last: BlockKey,
    pub len: usize,
    pub found: Option<((u32, u64), usize)>,
}

/// What the commit thread last told the callers about the file.
#[derive(Clone, Copy, Default)]
pub(crate) struct Published {
    pub entries: u64,
    pub legacy_entries: u64,
    pub capacity: u64,
    /// Nodes named by blocks besides the prefix table's.
    pub others: u64,
    /// Blocks and others naming a forgotten incarnation.
    pub reclaimable: u64,
    /// The file's eviction floor.
    pub floor: u64,
}

/// The caller's side.
pub(crate) struct Front {
    /// The clock of the last `ran` (the next gets one more).
    pub clock: u64,
    /// Every `ran` not yet committed.
    pub overlay: Overlay,
    /// The prefix table as of the last commit: replaced, with the overlay entries that commit
    /// made redundant removed, under this lock, so every `ran` is always in one or the other.
    pub committed: Committed,
    /// The others table of the same commit.
    pub committed_others: CommittedOthers,
    /// Changes the commit thread has not taken yet, oldest first.
    pub queue: Vec<Change>,
    pub queued_blocks: usize,
    /// When the oldest `ran` not yet committed was made.
    pub oldest_pending: Option<Instant>,
    /// Node names by id: the callers hand ids out (the commit thread writes them as queued), so
    /// the overlay and the file name a node alike.
    pub nodes: Vec<Arc<str>>,
    /// The current (not forgotten) id of each name.
    ids: HashMap<Arc<str>, u32>,
    /// By id: whether that incarnation was forgotten.
    pub retired: Vec<bool>,
    /// Nodes a block keeps.
    pub nodes_per_prefix: usize,
    /// Each node's cache, as of the last change queued: what `warmest` answers for a node.
    pub caches: NodeCaches,
    /// What the callers know of `committed_others`.
    pub others: OthersCache,
    /// A filter of the keys `committed` holds (and more), once the commit thread has built
    /// one: a key it does not hold is not read from the file.
    pub presence: Option<Arc<Presence>>,
    /// The last search's result (`lookup::searched`), while nothing it read has changed: a
    /// `ran` that follows the `warmest` or `warm_nodes` of its prompt does not search again.
    pub searched: Option<Searched>,
    pub published: Published,
    /// What is live by 0.1.7's eviction rule, as of the last `ran` that returned; read from the
    /// file before the first `ran` (until then the file's entries are exactly what is live).
    pub horizon: Option<Horizon>,
    /// Set while an import rewrites the file's counts: `ran`s wait for it.
    pub importing: bool,
    /// The error of the last commit, while none has succeeded since.
    pub failed: Option<Error>,
    /// Set when the handle is closing: the commit thread stops.
    pub closing: bool,
}

impl Front {
    pub(crate) fn new(
        clock: u64,
        nodes: &Nodes,
        published: Published,
        (committed, committed_others): (Committed, CommittedOthers),
        nodes_per_prefix: usize,
        caches: NodeCaches,
    ) -> Front {
        let mut front = Front {
            clock,
            overlay: Overlay::default(),
            committed,
            committed_others,
            queue: Vec::new(),
            queued_blocks: 0,
            oldest_pending: None,
            nodes: Vec::new(),
            ids: HashMap::new(),
            retired: Vec::new(),
            nodes_per_prefix,
            caches,
            others: OthersCache::default(),
            searched: None,
            presence: None,
            published,
            horizon: None,
            importing: false,
            failed: None,
            closing: false,
        };
        front.adopt(nodes);
        front
    }

    /// Takes the nodes the writer knows and the callers do not yet (an import's, or all of
    /// them at the start).
    pub(crate) fn adopt(&mut self, nodes: &Nodes) {
        for id in self.nodes.len()..nodes.names.len() {
            let name: Arc<str> = Arc::from(nodes.names[id].as_str());
            let retired = nodes.retired[id].is_some();
            if !retired {
                self.ids.insert(Arc::clone(&name), id as u32);
            }
            self.nodes.push(name);
            self.retired.push(retired);
        }
    }

    /// Whether an entry of `clock` is live (not yet evicted by 0.1.7's rule).
    pub(crate) fn holds(&self, clock: u64) -> bool {
        match &self.horizon {
            Some(h) => h.holds(clock),
            // Not read yet: nothing was evicted since the file's own floor.
            None => clock > self.published.floor,
        }
    }

    /// Whether node id `node` was forgotten.
    pub(crate) fn is_retired(&self, node: u32) -> bool {
        self.retired.get(node as usize).copied().unwrap_or(false)
    }

    /// The name of node id `node`.
    pub(crate) fn node_name(&self, node: u32) -> String {
        self.nodes.get(node as usize).map_or_else(|| format!("#{node}"), |n| n.to_string())
    }

    /// The current id of node `name`, if it has one.
    pub(crate) fn current_id(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// The current id of node `name` (a new one if it has none), and a shared copy of the name.
    pub(crate) fn name(&mut self, name: &str) -> (u32, Arc<str>) {
        if let Some(&id) = self.ids.get(name)
            && let Some(known) = self.nodes.get(id as usize)
        {
            return (id, Arc::clone(known));
        }
        let id = u32::try_from(self.nodes.len()).unwrap_or(u32::MAX);
        let shared: Arc<str> = Arc::from(name);
        self.nodes.push(Arc::clone(&shared));
        self.retired.push(false);
        self.ids.insert(Arc::clone(&shared), id);
        (id, shared)
    }

    /// Forgets node `name`'s current incarnation: from now on nothing it ran before is
    /// answered. Returns its id, `None` if it has none.
    pub(crate) fn forget(&mut self, name: &str) -> Option<u32> {
        let id = self.ids.remove(name)?;
        if let Some(r) = self.retired.get_mut(id as usize) {
            *r = true;
        }
        Some(id)
    }

    /// Queues a change; a `ran` is visible to `warmest` at once.
    pub(crate) fn push(&mut self, change: Change) {
        self.searched = None;
        if let Change::Ran(ran) = &change {
            self.overlay.push(ran.clock, &ran.blocks, ran.node, self.nodes_per_prefix > 1);
        }
        self.queued_blocks += change.blocks();
        self.oldest_pending.get_or_insert(change.at());
        self.queue.push(change);
    }

    /// Takes the queue for the commit thread.
    pub(crate) fn take(&mut self) -> Vec<Change> {
        self.queued_blocks = 0;
        self.overlay.seal(self.nodes_per_prefix > 1);
        std::mem::take(&mut self.queue)
    }

    /// Puts back `changes` (from a failed commit, oldest first) ahead of what was queued since:
    /// they are still in the overlay and will be retried.
    pub(crate) fn requeue(&mut self, mut changes: Vec<Change>) {
        self.queued_blocks += changes.iter().map(Change::blocks).sum::<usize>();
        changes.append(&mut self.queue);
        self.queue = changes;
        self.oldest_pending = self.queue.first().map(Change::at);
    }

    /// Drops from the overlay the `ran`s up to the newest of `rans`, now committed: every `ran`
    /// with a clock up to it was taken with them. Returns the maps to drop outside the lock.
    pub(crate) fn drop_committed(&mut self, changes: &[Change]) -> Vec<Map> {
        self.searched = None;
        let gone = match changes.iter().map(Change::clock).max() {
            Some(newest) => self.overlay.forget_through(newest),
            None => Vec::new(),
        };
        self.oldest_pending = self.queue.first().map(Change::at);
        gone
    }
}
