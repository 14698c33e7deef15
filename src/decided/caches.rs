//! Each node's KV cache, as the index keeps it: an LRU of the blocks the node ran, of a capacity
//! the head sets (`Builder::node_cache_blocks`, `Warm::set_node_capacity`).
//!
//! Every `ran` gives all its blocks one clock and names one node, so a node's blocks, by the
//! clock it last ran each at, are its LRU order. Per node the index keeps how many blocks it last
//! ran at each clock (`node_clocks/v5`) and a floor (`node_floors/v5`): when a node holds more
//! blocks than its capacity, its oldest clocks are dropped whole, oldest first, until it holds
//! no more (an engine's LRU would keep the newest blocks of the last clock dropped; the index
//! keeps less, never more). A (block, node) pair at or below the node's floor is not answered,
//! wherever it still is; it is reclaimed with its block, as a forgotten node's are.
//!
//! One copy, in the decided state ([`super::Decided`]): each change is decided there once, and
//! the rows it changes leave as effects (`effect.rs`) for the writer to persist.
//!
//! The counts are of blocks the node ran, whether or not a block still names it: a block that
//! dropped the node (past `nodes_per_prefix`) still takes room in that node's cache, as in an
//! engine's. A `ran` that re-touches blocks the file no longer ties to the node counts them again
//! (the cache then looks fuller than it is: it evicts early, never late).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::effect::Effect;
use crate::error::{Error, Result};

/// A node's cache as the index keeps it (`Stats::node_caches`, `SnapshotStats::node_caches`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NodeCacheStats {
    /// The node's name.
    pub node: String,
    /// Blocks the index counts in its cache.
    pub held: u64,
    /// Most blocks its cache holds (its own, else the default); `None`: no limit.
    pub capacity: Option<u64>,
    /// Every block it last ran at or below this clock has left its cache (0: none yet).
    pub floor: u64,
}

/// One node's cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct NodeCache {
    /// Every block the node last ran at or below this clock has left its cache.
    pub floor: u64,
    /// Blocks held.
    pub held: u64,
    /// Blocks held by the clock the node last ran them at (no zero counts), oldest first.
    by_clock: BTreeMap<u64, u64>,
}

/// Every node's cache, the capacities and the default.
#[derive(Clone, Debug, Default)]
pub(crate) struct NodeCaches {
    /// The capacity of a node with none of its own (`Builder::node_cache_blocks`); `None`: no
    /// limit (0.1.7's behaviour).
    pub default: Option<u64>,
    /// Capacities set per node, by name (a restarted node keeps its size).
    capacity: HashMap<Arc<str>, u64>,
    /// By node id.
    nodes: Vec<NodeCache>,
    /// The global floor last applied.
    global_floor: u64,
    /// The effects of the changes since they were last taken, in order.
    effects: Vec<Effect>,
}

impl NodeCaches {
    /// The caches of a file as committed, from its rows (read by `store/load.rs`): per (node,
    /// clock) the blocks held, each node's floor, the capacities by name, and the default size.
    ///
    /// # Errors
    /// The first error of the rows; [`Error::Corrupted`] for a count of 0 or a node id the file
    /// never handed out.
    pub(crate) fn from_rows(
        clocks: impl IntoIterator<Item = Result<((u32, u64), u64)>>,
        floors: impl IntoIterator<Item = Result<(u32, u64)>>,
        capacity: impl IntoIterator<Item = Result<(Arc<str>, u64)>>,
        default: Option<u64>,
        (global_floor, next_node): (u64, u32),
    ) -> Result<NodeCaches> {
        // A node id the file never handed out is a damaged row, refused before it sizes a Vec.
        let known = |node: u32| match node < next_node {
            true => Ok(node),
            false => Err(Error::Corrupted {
                detail: format!("a node cache names node id {node}, and the file has handed out {next_node}"),
            }),
        };
        let mut caches = NodeCaches { global_floor, ..NodeCaches::default() };
        for item in clocks {
            let ((node, clock), count) = item?;
            if count == 0 {
                return Err(Error::Corrupted { detail: format!("node {node} holds 0 blocks of clock {clock}") });
            }
            let cache = caches.cache_mut(known(node)?);
            cache.by_clock.insert(clock, count);
            cache.held += count;
        }
        for item in floors {
            let (node, floor) = item?;
            caches.cache_mut(known(node)?).floor = floor;
        }
        for item in capacity {
            let (name, blocks) = item?;
            caches.capacity.insert(name, blocks);
        }
        caches.default = default.filter(|&b| b > 0);
        Ok(caches)
    }

    /// Takes the effects of the changes made since the last take, in order.
    pub(crate) fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Clock rows dropped whole (`(clock, blocks)` as they were) from node `node`'s cache.
    fn note_dropped(&mut self, node: u32, dropped: impl IntoIterator<Item = (u64, u64)>) {
        self.effects.extend(dropped.into_iter().map(|(clock, was)| Effect::CacheClock { node, clock, blocks: 0, was }));
    }

    // Resized first: `node` is in bounds.
    #[allow(clippy::indexing_slicing)]
    fn cache_mut(&mut self, node: u32) -> &mut NodeCache {
        let i = node as usize;
        if self.nodes.len() <= i {
            self.nodes.resize_with(i + 1, NodeCache::default);
        }
        &mut self.nodes[i]
    }

    /// Node `node`'s cache (empty if it has none).
    pub(crate) fn cache(&self, node: u32) -> Option<&NodeCache> {
        self.nodes.get(node as usize)
    }

    /// Every block node `node` ran at or below this clock has left its cache.
    pub(crate) fn floor(&self, node: u32) -> u64 {
        self.nodes.get(node as usize).map_or(0, |c| c.floor)
    }

    /// The capacity of node `name`: its own, else the default; `None`: no limit.
    pub(crate) fn capacity_of(&self, name: &str) -> Option<u64> {
        self.capacity.get(name).copied().or(self.default)
    }

    /// Whether node `name`'s cache is kept (it has a capacity): only then are its blocks
    /// counted, so a head that sets no size pays nothing for caches.
    pub(crate) fn tracks(&self, name: &str) -> bool {
        self.capacity_of(name).is_some()
    }

    /// Starts keeping node `node`'s cache from `clocks` (blocks by clock: what the file names of
    /// it, for a node whose cache was not kept).
    fn seed(&mut self, node: u32, clocks: BTreeMap<u64, u64>) {
        for (&clock, &blocks) in &clocks {
            self.effects.push(Effect::CacheClock { node, clock, blocks, was: 0 });
        }
        let cache = self.cache_mut(node);
        cache.held = clocks.values().sum();
        cache.by_clock = clocks;
    }

    /// Stops keeping node `node`'s cache (it has no capacity now): its counts go, its floor
    /// stays (what left its cache does not come back).
    fn untrack(&mut self, node: u32) {
        let Some(cache) = self.nodes.get_mut(node as usize) else { return };
        cache.held = 0;
        let gone = std::mem::take(&mut cache.by_clock);
        self.note_dropped(node, gone);
    }

    fn set_count(&mut self, node: u32, clock: u64, blocks: u64) {
        let cache = self.cache_mut(node);
        let was = if blocks == 0 { cache.by_clock.remove(&clock) } else { cache.by_clock.insert(clock, blocks) };
        self.effects.push(Effect::CacheClock { node, clock, blocks, was: was.unwrap_or(0) });
    }

    /// Node `node` (named `name`) ran `blocks` blocks at `clock`, of which the first ones it held
    /// already, last run at the clocks `runs` gives (`(clock, blocks)`, oldest last); the global
    /// eviction floor after it is `global_floor`. Applies the global floor, then the node's
    /// capacity (if it has none, only the global floor). Returns the node's floor after it.
    pub(crate) fn ran(
        &mut self,
        (node, name): (u32, &str),
        clock: u64,
        blocks: u64,
        runs: &[(u64, u64)],
        global_floor: u64,
    ) -> u64 {
        if !self.tracks(name) {
            self.drop_through(global_floor);
            return self.floor(node);
        }
        let floor = self.floor(node).max(self.global_floor).max(global_floor);
        let mut moved = 0;
        for &(old, n) in runs.iter().filter(|&&(old, _)| old > floor) {
            let Some(&count) = self.cache(node).and_then(|c| c.by_clock.get(&old)) else { continue };
            let n = n.min(count);
            moved += n;
            self.set_count(node, old, count - n);
        }
        let at = self.cache(node).and_then(|c| c.by_clock.get(&clock)).copied().unwrap_or(0);
        self.set_count(node, clock, at + blocks);
        let cache = self.cache_mut(node);
        cache.held = cache.held.saturating_sub(moved) + blocks;
        // After the count: the eviction may have taken this `ran` too (a file smaller than it).
        self.drop_through(global_floor);
        self.enforce((node, name));
        self.floor(node)
    }

    /// Sets node `name`'s own capacity (`None`: the default again), then evicts to it. `seeds`:
    /// what the file names of it by clock, if its cache was not kept before.
    pub(crate) fn set_capacity(
        &mut self,
        (node, name): (u32, &str),
        blocks: Option<u64>,
        mut seeds: BTreeMap<u32, BTreeMap<u64, u64>>,
    ) {
        let was = self.tracks(name);
        let name: Arc<str> = Arc::from(name);
        match blocks {
            Some(b) => self.capacity.insert(Arc::clone(&name), b),
            None => self.capacity.remove(&name),
        };
        self.effects.push(Effect::Capacity { name: Arc::clone(&name), blocks });
        match (was, self.tracks(&name)) {
            (false, true) => self.seed(node, seeds.remove(&node).unwrap_or_default()),
            (true, false) => self.untrack(node),
            _ => {}
        }
        self.enforce((node, &name));
    }

    /// Sets the default capacity, then evicts every node in `nodes` (id, name; the current
    /// incarnations) to its capacity; those whose cache was not kept start from `seeds`.
    pub(crate) fn set_default<'a>(
        &mut self,
        blocks: Option<u64>,
        nodes: impl Iterator<Item = (u32, &'a str)>,
        mut seeds: BTreeMap<u32, BTreeMap<u64, u64>>,
    ) {
        let nodes: Vec<(u32, &str)> = nodes.collect();
        let was: Vec<bool> = nodes.iter().map(|(_, name)| self.tracks(name)).collect();
        self.default = blocks;
        self.effects.push(Effect::CacheDefault { blocks });
        for (&(node, name), was) in nodes.iter().zip(was) {
            match (was, self.tracks(name)) {
                (false, true) => self.seed(node, seeds.remove(&node).unwrap_or_default()),
                (true, false) => self.untrack(node),
                _ => {}
            }
            self.enforce((node, name));
        }
    }

    /// While node `node` holds more than its capacity, its oldest clock leaves its cache.
    fn enforce(&mut self, (node, name): (u32, &str)) {
        let Some(capacity) = self.capacity_of(name) else { return };
        let cache = self.cache_mut(node);
        let mut floor = cache.floor;
        let mut gone = Vec::new();
        while cache.held > capacity {
            let Some((clock, n)) = cache.by_clock.pop_first() else { break };
            cache.held = cache.held.saturating_sub(n);
            floor = floor.max(clock);
            gone.push((clock, n));
        }
        if floor > cache.floor {
            cache.floor = floor;
            self.note_dropped(node, gone);
            self.effects.push(Effect::CacheFloor { node, floor });
        }
    }

    /// Node `node` was forgotten: its cache is gone (its id is never answered again).
    pub(crate) fn forget(&mut self, node: u32) {
        let Some(cache) = self.nodes.get_mut(node as usize) else { return };
        let gone = std::mem::take(cache);
        self.note_dropped(node, gone.by_clock);
        if gone.floor > 0 {
            self.effects.push(Effect::CacheFloor { node, floor: 0 });
        }
    }

    /// Every block last run at or below `floor` is evicted (0.1.7's rule, for the whole file).
    pub(crate) fn drop_through(&mut self, floor: u64) {
        if floor <= self.global_floor {
            return;
        }
        self.global_floor = floor;
        let effects = &mut self.effects;
        for (node, cache) in (0u32..).zip(self.nodes.iter_mut()) {
            while let Some(entry) = cache.by_clock.first_entry().filter(|e| *e.key() <= floor) {
                let (clock, n) = entry.remove_entry();
                cache.held = cache.held.saturating_sub(n);
                effects.push(Effect::CacheClock { node, clock, blocks: 0, was: n });
            }
        }
    }

    /// The cache of each current incarnation in `nodes` (by id: name, whether forgotten).
    pub(crate) fn stats<'a>(&self, nodes: impl Iterator<Item = (&'a str, bool)>) -> Vec<NodeCacheStats> {
        nodes
            .zip(0u32..)
            .filter(|((_, forgotten), _)| !forgotten)
            .map(|((name, _), id)| NodeCacheStats {
                node: name.to_string(),
                held: self.cache(id).map_or(0, |c| c.held),
                capacity: self.capacity_of(name),
                floor: self.floor(id),
            })
            .collect()
    }

    /// Blocks node `node` holds, by the clock it last ran them at, oldest first.
    pub(crate) fn clocks(&self, node: u32) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.cache(node).into_iter().flat_map(|c| c.by_clock.iter().map(|(&k, &v)| (k, v)))
    }

    /// Node ids with a cache.
    pub(crate) fn len(&self) -> usize {
        self.nodes.len()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    /// An engine's LRU of whole `ran`s: the blocks of each node by the clock it last ran them
    /// at, the oldest clocks dropped while it holds more than its capacity.
    #[test]
    fn a_node_keeps_its_newest_clocks_within_its_capacity() {
        let mut caches = NodeCaches { default: Some(10), ..NodeCaches::default() };
        let a = (0, "a");
        assert_eq!(caches.ran(a, 1, 4, &[], 0), 0);
        assert_eq!(caches.ran(a, 2, 4, &[], 0), 0);
        // Re-runs clock 1's four blocks and two more: clock 1 is empty, 2 holds 4, 3 holds 6.
        assert_eq!(caches.ran(a, 3, 6, &[(1, 4)], 0), 0);
        assert_eq!(caches.cache(0).map(|c| c.held), Some(10));
        // Three new blocks: clock 2 goes (the oldest held), then 3 + 3 fit.
        assert_eq!(caches.ran(a, 4, 3, &[], 0), 2);
        assert_eq!(caches.cache(0).map(|c| (c.held, c.floor)), Some((9, 2)));
        // Another node is not touched; the global floor drops what is at or below it.
        assert_eq!(caches.ran((1, "b"), 5, 2, &[], 3), 0);
        assert_eq!(caches.cache(0).map(|c| c.held), Some(3));
        // A smaller capacity of its own evicts at once; a bigger prompt than fits leaves nothing.
        caches.set_capacity(a, Some(2), BTreeMap::new());
        assert_eq!(caches.floor(0), 4);
        assert_eq!(caches.ran(a, 6, 5, &[], 3), 6);
        assert_eq!(caches.cache(0).map(|c| c.held), Some(0));
        caches.forget(1);
        assert_eq!(caches.cache(1).map(|c| c.held), Some(0));
        assert!(!caches.take_effects().is_empty());
    }
}
