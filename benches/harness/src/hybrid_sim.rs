//! A simulated hybrid-attention vLLM engine's cache: several KV cache groups (full attention,
//! sliding windows) sharing one pool of blocks, as vLLM's `HybridKVCacheCoordinator` keeps them
//! (`tests/fixtures/hybrid/README.md` has the rules, read from vLLM 0.33.0 and checked there
//! against its own code). Independent of the library's model on purpose: it is the engine the
//! index is measured against.
//!
//! - A request reuses what every group serves (full attention: every block from the first; a
//!   sliding window of `w` tokens: the `cdiv(w - 1, block)` blocks before the hit's end, else a
//!   run from the first block), at most the prompt less one token. Every block from the hit on is
//!   computed again and stored.
//! - Each group publishes one `BlockStored` a request, in group order, over the same range of
//!   tokens under the same parent: full attention lists every block of it; a sliding window only
//!   the blocks it keeps, the window's worth ending at the prompt's last whole block before its
//!   last token (vLLM's default `prefix_cache_retention_interval` 0).
//! - A block stored again while held is a second copy; one `BlockRemoved` a copy, naming its
//!   group, when the pool (least recent first) reuses it. A block falling out of a window
//!   publishes nothing.

use std::collections::{BTreeMap, HashMap};

use superfluid_warm::{CacheGroup, EngineEvent, EngineStored, GroupKind, Medium, Namespace};

use crate::engine_sim::engine_hash;

/// A hybrid engine's groups and what they hold.
#[derive(Clone, Debug, Default)]
pub struct HybridCache {
    /// The groups, in index order: full attention, or a sliding window of so many tokens.
    pub groups: Vec<GroupKind>,
    /// Copies held of each (group, hash), and its place in the LRU.
    held: HashMap<(u32, u64), (u32, u64)>,
    by_tick: BTreeMap<u64, (u32, u64)>,
    tick: u64,
}

impl HybridCache {
    /// A cache of `groups` (full attention and sliding windows only).
    pub fn new(groups: Vec<GroupKind>) -> HybridCache {
        HybridCache { groups, ..HybridCache::default() }
    }

    fn holds(&self, group: usize, hash: Option<&u64>) -> bool {
        hash.is_some_and(|&h| self.held.contains_key(&(group as u32, h)))
    }

    /// Engine blocks of the prompt (`hashes`, of `tokens` tokens) the engine reuses.
    pub fn hit(&self, hashes: &[u64], tokens: usize, block: usize) -> usize {
        let max = (tokens.saturating_sub(1) / block.max(1)).min(hashes.len());
        let mut hit = max;
        for (g, kind) in self.groups.iter().enumerate() {
            if *kind == GroupKind::Full {
                hit = hit.min((0..max).take_while(|&i| self.holds(g, hashes.get(i))).count());
            }
        }
        // Then each window (groups of one window together: a block counts if all hold it),
        // asked again until the length stops shrinking.
        let mut windows: Vec<u32> = self
            .groups
            .iter()
            .filter_map(|k| if let GroupKind::SlidingWindow { window } = k { Some(*window) } else { None })
            .collect();
        windows.sort_unstable();
        windows.dedup();
        loop {
            let before = hit;
            for &window in &windows {
                let groups: Vec<usize> = (0..self.groups.len())
                    .filter(|&g| self.groups.get(g) == Some(&GroupKind::SlidingWindow { window }))
                    .collect();
                let needed = (window as usize).saturating_sub(1).div_ceil(block.max(1));
                let mut run = 0;
                let mut found = None;
                for i in (0..hit).rev() {
                    if groups.iter().all(|&g| self.holds(g, hashes.get(i))) {
                        run += 1;
                        if run >= needed {
                            found = Some(i + run);
                            break;
                        }
                    } else {
                        run = 0;
                    }
                }
                hit = found.unwrap_or(run);
            }
            if hit >= before {
                return hit;
            }
        }
    }

    /// Runs a prompt of `tokens` (`hashes` its blocks' hashes) on an engine of `capacity`
    /// blocks: the events it publishes, stores then removals.
    pub fn run(
        &mut self,
        tokens: &[u32],
        hashes: &[u64],
        block: usize,
        capacity: usize,
        namespace: &Namespace,
    ) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        let hit = self.hit(hashes, tokens.len(), block);
        let n = hashes.len();
        let last = tokens.len().saturating_sub(1) / block.max(1);
        if hit < n {
            let parent = hit.checked_sub(1).and_then(|i| hashes.get(i)).copied();
            let range = tokens.get(hit * block..n * block).unwrap_or_default().to_vec();
            for (g, kind) in self.groups.clone().into_iter().enumerate() {
                let kept: Vec<usize> = match kind {
                    GroupKind::SlidingWindow { window } => {
                        let needed = (window as usize).saturating_sub(1).div_ceil(block.max(1));
                        (last.saturating_sub(needed).max(hit)..last.min(n)).collect()
                    }
                    _ => (hit..n).collect(),
                };
                let listed: Vec<u64> = kept.iter().filter_map(|&i| hashes.get(i).copied()).collect();
                for &hash in &listed {
                    self.held.entry((g as u32, hash)).or_insert((0, 0)).0 += 1;
                }
                events.push(EngineEvent::Stored(EngineStored {
                    parent,
                    hashes: listed,
                    tokens: range.clone(),
                    block_size: u32::try_from(block).unwrap_or(u32::MAX),
                    medium: Medium::Gpu,
                    namespace: Some(namespace.clone()),
                    group: Some(CacheGroup { index: g as u32, kind }),
                }));
            }
        }
        // Freed last block first: the tail is the least recent of the request's.
        for &hash in hashes.iter().rev() {
            for g in 0..self.groups.len() as u32 {
                if let Some(entry) = self.held.get_mut(&(g, hash)) {
                    self.tick += 1;
                    self.by_tick.remove(&entry.1);
                    entry.1 = self.tick;
                    self.by_tick.insert(self.tick, (g, hash));
                }
            }
        }
        while self.by_tick.len() > capacity {
            let Some((_, (g, victim))) = self.by_tick.pop_first() else { break };
            let copies = self.held.remove(&(g, victim)).map_or(1, |h| h.0);
            for _ in 0..copies {
                events.push(EngineEvent::Removed { hashes: vec![victim], medium: Medium::Gpu, group: Some(g) });
            }
        }
        events
    }

    /// Blocks held, copies of a block in several groups counted once each.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Everything gone (a restart).
    pub fn clear(&mut self) {
        self.held.clear();
        self.by_tick.clear();
    }
}

/// The engine hashes of `tokens`' whole blocks of `block` tokens.
pub fn hashes(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut parent = None;
    tokens
        .chunks_exact(block.max(1))
        .map(|b| {
            let h = engine_hash(parent, b);
            parent = Some(h);
            h
        })
        .collect()
}
