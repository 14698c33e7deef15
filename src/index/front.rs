//! The caller's side of a `Warm`: the clock, the `ran`s not yet committed (an overlay `warmest`
//! answers from before redb has them) and the queue the commit thread drains. Callers only ever
//! hold this lock for a few microseconds; redb's writer is the commit thread's (see `warm.rs`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use super::horizon::Horizon;
use super::overlay::{Map, Overlay};
use crate::error::Error;
use crate::store::writer::Ran;

/// The prefix table as of the last commit, shared with the callers.
pub(crate) type Committed = redb::ReadOnlyTable<u128, (u32, u32, u32, u64)>;

/// Blocks queued and not yet taken by the commit thread above which `ran` waits for it.
pub(crate) const MAX_QUEUED_BLOCKS: usize = 1 << 18;

/// Blocks in one batch above which it is committed without waiting for the window: bounds the
/// dirty pages a write transaction holds in memory when the commit thread is saturated.
pub(crate) const MAX_BATCH_BLOCKS: usize = 1 << 16;

/// What the commit thread last told the callers about the file.
#[derive(Clone, Copy, Default)]
pub(crate) struct Published {
    pub entries: u64,
    pub legacy_entries: u64,
    pub capacity: u64,
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
    /// `ran`s the commit thread has not taken yet, oldest first.
    pub queue: Vec<Ran>,
    pub queued_blocks: usize,
    /// When the oldest `ran` not yet committed was made.
    pub oldest_pending: Option<Instant>,
    /// Node names by id, as the commit thread assigned them (committed or about to be).
    pub nodes: Vec<String>,
    /// Every node name a `ran` gave, by the index the overlay uses (not the file's node ids).
    pub pending_names: Vec<Arc<str>>,
    name_ids: HashMap<String, u32>,
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
    pub(crate) fn new(clock: u64, nodes: Vec<String>, published: Published, committed: Committed) -> Front {
        Front {
            clock,
            overlay: Overlay::default(),
            committed,
            queue: Vec::new(),
            queued_blocks: 0,
            oldest_pending: None,
            nodes,
            pending_names: Vec::new(),
            name_ids: HashMap::new(),
            published,
            horizon: None,
            importing: false,
            failed: None,
            closing: false,
        }
    }

    /// Whether an entry of `clock` is live (not yet evicted by 0.1.7's rule).
    pub(crate) fn holds(&self, clock: u64) -> bool {
        self.horizon.as_ref().is_none_or(|h| h.holds(clock))
    }

    /// The overlay's index of a node name, and a shared copy of it.
    pub(crate) fn name(&mut self, node: &str) -> (u32, Arc<str>) {
        if let Some(&id) = self.name_ids.get(node)
            && let Some(name) = self.pending_names.get(id as usize)
        {
            return (id, Arc::clone(name));
        }
        let id = u32::try_from(self.pending_names.len()).unwrap_or(u32::MAX);
        let name: Arc<str> = Arc::from(node);
        self.pending_names.push(Arc::clone(&name));
        self.name_ids.insert(node.to_string(), id);
        (id, name)
    }

    /// Queues a `ran` and makes it visible to `warmest` at once.
    pub(crate) fn push(&mut self, ran: Ran, node: u32) {
        self.overlay.push(ran.clock, &ran.blocks, node);
        self.queued_blocks += ran.blocks.len();
        self.oldest_pending.get_or_insert(ran.at);
        self.queue.push(ran);
    }

    /// Takes the queue for the commit thread.
    pub(crate) fn take(&mut self) -> Vec<Ran> {
        self.queued_blocks = 0;
        self.overlay.seal();
        std::mem::take(&mut self.queue)
    }

    /// Puts back `rans` (from a failed commit, oldest first) ahead of what was queued since: they
    /// are still in the overlay and will be retried.
    pub(crate) fn requeue(&mut self, mut rans: Vec<Ran>) {
        self.queued_blocks += rans.iter().map(|r| r.blocks.len()).sum::<usize>();
        rans.append(&mut self.queue);
        self.queue = rans;
        self.oldest_pending = self.queue.first().map(|r| r.at);
    }

    /// Drops from the overlay the `ran`s up to the newest of `rans`, now committed: every `ran`
    /// with a clock up to it was taken with them. Returns the maps to drop outside the lock.
    pub(crate) fn drop_committed(&mut self, rans: &[Ran]) -> Vec<Map> {
        let gone = match rans.iter().map(|r| r.clock).max() {
            Some(newest) => self.overlay.forget_through(newest),
            None => Vec::new(),
        };
        self.oldest_pending = self.queue.first().map(|r| r.at);
        gone
    }
}
