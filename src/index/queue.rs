//! The queue of decided changes the commit thread drains, and the figures it keeps of them:
//! blocks, engine rows' bytes (queued, and taken into the batch being committed), when its
//! oldest change was made. Its own counters, changed only by its named operations, under the
//! callers' lock (`Front`).

use std::time::Instant;

use crate::decided::effect::Effect;
use crate::keys::BlockKey;

/// What an engine effect costs in the queue besides its row's bytes: the effect, and the row's
/// shared header and allocation.
const ENGINE_EFFECT_BYTES: usize = std::mem::size_of::<Effect>() + 32;

/// A decided change, queued for the commit thread.
pub(crate) struct Queued {
    pub effects: Vec<Effect>,
    /// When it was decided (for the sync window).
    pub at: Instant,
    /// For a head sharing through a stream: the stream sequence of the event it applies (written
    /// with the batch that persists it); 0 for a head's own change.
    pub position: u64,
}

impl Queued {
    /// Blocks it writes.
    pub(crate) fn blocks(&self) -> usize {
        self.effects.iter().map(Effect::blocks).sum()
    }

    /// Bytes its engine rows hold (what the memtable does not count).
    pub(crate) fn engine_bytes(&self) -> usize {
        self.effects
            .iter()
            .map(|e| match e {
                Effect::EngineBlock { row, .. } | Effect::HybridBlock { row, .. } => {
                    ENGINE_EFFECT_BYTES + row.as_ref().map_or(0, |r| r.len())
                }
                Effect::EngineStream { .. } | Effect::EngineClear { .. } | Effect::EngineGroups { .. } => {
                    ENGINE_EFFECT_BYTES
                }
                _ => 0,
            })
            .sum()
    }

    /// The keys it writes.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &[BlockKey]> {
        self.effects.iter().filter_map(|e| match e {
            Effect::Put { blocks, .. } => Some(&blocks[..]),
            _ => None,
        })
    }
}

/// Changes the commit thread has not taken yet, oldest first, and their figures.
#[derive(Default)]
pub(crate) struct Queue {
    changes: Vec<Queued>,
    blocks: usize,
    /// Bytes of engine rows in the queue, and in the batch being committed (the memtable holds
    /// none of them).
    engine_bytes: usize,
    taken_engine_bytes: usize,
    /// When the oldest change not yet committed was made.
    oldest: Option<Instant>,
    /// Numbers the figures as they are taken, so that an older reading recorded late never
    /// replaces a newer one.
    reading: u64,
}

impl Queue {
    /// Adds a change.
    pub(crate) fn push(&mut self, queued: Queued) {
        self.blocks += queued.blocks();
        self.engine_bytes += queued.engine_bytes();
        self.oldest.get_or_insert(queued.at);
        self.changes.push(queued);
    }

    /// Takes every change for the commit thread (their engine rows counted as taken until the
    /// commit is installed).
    pub(crate) fn take(&mut self) -> Vec<Queued> {
        self.blocks = 0;
        self.taken_engine_bytes += std::mem::take(&mut self.engine_bytes);
        std::mem::take(&mut self.changes)
    }

    /// Puts back `changes` (from a failed commit, oldest first) ahead of what was queued since.
    pub(crate) fn requeue(&mut self, mut changes: Vec<Queued>) {
        self.blocks += changes.iter().map(Queued::blocks).sum::<usize>();
        let bytes = changes.iter().map(Queued::engine_bytes).sum::<usize>();
        self.engine_bytes += bytes;
        self.taken_engine_bytes = self.taken_engine_bytes.saturating_sub(bytes);
        changes.append(&mut self.changes);
        self.changes = changes;
        self.oldest = self.changes.first().map(|q| q.at);
    }

    /// What was taken is committed: only what was queued since is pending.
    pub(crate) fn committed(&mut self) {
        self.taken_engine_bytes = 0;
        self.oldest = self.changes.first().map(|q| q.at);
    }

    /// What was taken is not installed yet: pending from the oldest change queued since, or
    /// from now, so that the commit thread tries again a window from then.
    pub(crate) fn retry_later(&mut self) {
        self.oldest = Some(self.changes.first().map_or_else(Instant::now, |q| q.at));
    }

    /// Whether no change waits.
    pub(crate) fn is_empty(&self) -> bool {
        self.changes.is_empty()
    }

    /// Blocks the waiting changes write.
    pub(crate) fn blocks(&self) -> usize {
        self.blocks
    }

    /// Bytes of engine rows not yet committed: queued, and in the batch being committed.
    pub(crate) fn engine_bytes(&self) -> usize {
        self.engine_bytes + self.taken_engine_bytes
    }

    /// When the oldest change not yet committed was made (`None`: nothing is pending).
    pub(crate) fn oldest(&self) -> Option<Instant> {
        self.oldest
    }

    /// Its figures, numbered: (reading, blocks queued, `uncommitted` bytes).
    pub(crate) fn figures(&mut self, uncommitted: usize) -> (u64, usize, usize) {
        self.reading += 1;
        (self.reading, self.blocks, uncommitted)
    }
}
