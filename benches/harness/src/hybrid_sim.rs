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
//!
//! With an offload tier ([`HybridCache::with_offload`]): vLLM 0.33's `OffloadingConnector` with
//! its CPU backend, one engine block a chunk (`blocks_per_chunk` 1), default events
//! (`tests/fixtures/hybrid/offload/RULE.md` has the rule, read from vLLM's code):
//!
//! - It keeps chunks under (group, hash of the chunk's block), in one LRU of `M` chunks for all
//!   groups. A request offers the whole blocks of its prompt (`offload_prompt_only`): a full
//!   attention group every one, a sliding window the blocks its GPU group keeps (the
//!   `cdiv(w - 1, block)` blocks ending at the last whole block before the prompt's last
//!   token, retention interval 0). A chunk it holds already is not stored again.
//! - Each new chunk is one `BlockStored` (medium CPU, its hash alone, no parent, no tokens,
//!   block size 0, its group's index but no kind: the placeholder). They are published in the
//!   request's own batch, after its GPU events (vLLM publishes a step's GPU events, then the
//!   connector's; its store completes a step later, a simplification here). Chunks the LRU
//!   evicts follow: one `BlockRemoved` (medium CPU) a group, listing them.
//! - The engine reuses the GPU hit, then what the connector loads past it
//!   ([`HybridCache::loaded`], vLLM's `_lookup_complete_chunks`). Loaded blocks are on the GPU
//!   again: the request's GPU stores are those of a GPU hit alone, as without the tier.
//! - The LRU order: a request touches what it loads and what it offers and holds, and puts what
//!   it stores, its prompt's last block first (its first block ends most recent).

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
    /// The offload tier's capacity in chunks (0: none), its chunks by (group, hash) with their
    /// place in its LRU, and that order.
    offload_capacity: usize,
    offloaded: HashMap<(u32, u64), u64>,
    offload_by_tick: BTreeMap<u64, (u32, u64)>,
}

impl HybridCache {
    /// A cache of `groups` (full attention and sliding windows only).
    pub fn new(groups: Vec<GroupKind>) -> HybridCache {
        HybridCache { groups, ..HybridCache::default() }
    }

    /// The same cache with an offload tier (vLLM's `OffloadingConnector`, CPU memory) of
    /// `chunks` chunks of one block (0: none).
    pub fn with_offload(mut self, chunks: usize) -> HybridCache {
        self.offload_capacity = chunks;
        self
    }

    /// Whether the offload tier holds `hash` in `group`.
    fn offloads(&self, group: usize, hash: Option<&u64>) -> bool {
        hash.is_some_and(|&h| self.offloaded.contains_key(&(group as u32, h)))
    }

    /// The window in chunks of group `g` (`None`: full attention): vLLM's
    /// `sliding_window_size_in_chunks`, `cdiv(w, chunk)` with no extra tokens retained.
    fn window_chunks(&self, g: usize, chunk: usize) -> Option<usize> {
        match self.groups.get(g) {
            Some(GroupKind::SlidingWindow { window }) => Some((*window as usize).div_ceil(chunk)),
            _ => None,
        }
    }

    /// Tokens the offload tier loads past a GPU hit of `gpu` blocks, for a prompt of `tokens`
    /// tokens (`hashes` its whole blocks'): vLLM 0.33's `_lookup_complete_chunks` with chunks of
    /// one block. The hit may then end at the prompt's last token less one, inside a block.
    pub fn loaded(&self, hashes: &[u64], tokens: usize, block: usize, gpu: usize) -> usize {
        let t = block.max(1);
        if self.offload_capacity == 0 || self.offloaded.is_empty() {
            return 0;
        }
        let start = gpu;
        let c = gpu * t;
        let keys = hashes.len().min(tokens / t);
        // Full attention first in group order, then the windows, widest first (a stable sort).
        let full: Vec<usize> = (0..self.groups.len()).filter(|&g| self.window_chunks(g, t).is_none()).collect();
        let mut windows: Vec<usize> = (0..self.groups.len()).filter(|&g| self.window_chunks(g, t).is_some()).collect();
        windows.sort_by_key(|&g| std::cmp::Reverse(self.window_chunks(g, t).unwrap_or(0)));
        // The prompt's last token is computed whenever a group is not full attention.
        let mut max_hit = if windows.is_empty() { tokens } else { tokens.saturating_sub(1) };
        let mut hit = 0;
        let mut lookup: Vec<usize> = full.iter().chain(&windows).copied().collect();
        while !lookup.is_empty() {
            let mut looked_window = false;
            for g in std::mem::take(&mut lookup) {
                max_hit = max_hit.min(keys * t);
                if max_hit < c + t {
                    return 0;
                }
                let chunks = max_hit.div_ceil(t).min(keys);
                let found = match self.window_chunks(g, t) {
                    None => (start..chunks).take_while(|&i| self.offloads(g, hashes.get(i))).count(),
                    Some(w) => {
                        // The first run, ending at the last chunk, may need one more when the
                        // candidate end is inside a chunk; any later one `w` chunks.
                        let end = max_hit.min(chunks * t);
                        let window = match self.groups.get(g) {
                            Some(GroupKind::SlidingWindow { window }) => *window as usize,
                            _ => 0,
                        };
                        let mut need = w.max((window.saturating_sub(1) + (t - end % t) % t).div_ceil(t));
                        let mut run = 0;
                        let mut found = None;
                        for i in (start..chunks).rev() {
                            if self.offloads(g, hashes.get(i)) {
                                run += 1;
                            } else {
                                run = 0;
                                need = w;
                            }
                            if run == need {
                                found = Some(i - start + need);
                                break;
                            }
                        }
                        // Else a run from the GPU hit's end (the GPU holds the window before it).
                        found.unwrap_or(run)
                    }
                };
                if found == 0 {
                    return 0;
                }
                max_hit = max_hit.min(t * (start + found));
                let new = max_hit.saturating_sub(c);
                if new < t {
                    return 0;
                }
                // A window shortening the hit after another window was asked: the windows are
                // all asked again at the new length.
                if new < hit && looked_window && lookup.is_empty() {
                    lookup.clone_from(&windows);
                }
                looked_window |= self.window_chunks(g, t).is_some();
                hit = new;
            }
        }
        hit
    }

    /// Tokens of a prompt of `tokens` tokens (`hashes` its blocks') the engine reuses: (its GPU
    /// hit, that and what the offload tier loads past it).
    pub fn reused(&self, hashes: &[u64], tokens: usize, block: usize) -> (usize, usize) {
        let gpu = self.hit(hashes, tokens, block);
        let loaded = self.loaded(hashes, tokens, block, gpu);
        (gpu * block, gpu * block + loaded)
    }

    /// Puts (or touches) (`group`, `hash`) in the offload tier's LRU; whether it was not there.
    fn offload(&mut self, group: u32, hash: u64) -> bool {
        self.tick += 1;
        let fresh = match self.offloaded.insert((group, hash), self.tick) {
            Some(old) => {
                self.offload_by_tick.remove(&old);
                false
            }
            None => true,
        };
        self.offload_by_tick.insert(self.tick, (group, hash));
        fresh
    }

    /// The offload tier's part of a request (its GPU hit `gpu` blocks, `loaded` tokens loaded
    /// past it): touches what it loads, stores what it offers and does not hold, evicts past
    /// capacity. Its events: stores, then removals (one a group).
    fn offload_request(
        &mut self,
        hashes: &[u64],
        tokens: usize,
        block: usize,
        gpu: usize,
        loaded: usize,
    ) -> Vec<EngineEvent> {
        let mut events = Vec::new();
        if self.offload_capacity == 0 {
            return events;
        }
        let t = block.max(1);
        let n = hashes.len().min(tokens / t);
        let last = tokens.saturating_sub(1) / t;
        let end = (gpu * t + loaded).div_ceil(t).min(n);
        // Per group, the chunks it loads (full attention: all from the GPU hit; a window: its
        // window before the end) and the chunks it offers.
        let mut chunks: Vec<(Vec<bool>, Vec<bool>)> = Vec::with_capacity(self.groups.len());
        for g in 0..self.groups.len() {
            let mut loads = vec![false; n];
            let mut offers = vec![false; n];
            let (from, kept) = match self.groups.get(g) {
                Some(GroupKind::SlidingWindow { window }) => {
                    let w = self.window_chunks(g, t).unwrap_or(0);
                    let needed = (*window as usize).saturating_sub(1).div_ceil(t);
                    (end.saturating_sub(w).max(gpu), last.saturating_sub(needed)..last.min(n))
                }
                _ => (gpu, 0..n),
            };
            if loaded > 0 {
                for i in from..end {
                    if let Some(x) = loads.get_mut(i) {
                        *x = true;
                    }
                }
            }
            for i in kept {
                if let Some(x) = offers.get_mut(i) {
                    *x = true;
                }
            }
            chunks.push((loads, offers));
        }
        // Last block first: the prompt's first block ends most recent.
        for i in (0..n).rev() {
            let Some(&hash) = hashes.get(i) else { continue };
            for (g, (loads, offers)) in chunks.iter().enumerate() {
                let g32 = g as u32;
                let held = self.offloaded.contains_key(&(g32, hash));
                let touched = held && (loads.get(i) == Some(&true) || offers.get(i) == Some(&true));
                let stored = !held && offers.get(i) == Some(&true);
                if touched || stored {
                    self.offload(g32, hash);
                }
                if stored {
                    events.push(EngineEvent::Stored(EngineStored {
                        parent: None,
                        hashes: vec![hash],
                        tokens: Vec::new(),
                        block_size: 0,
                        medium: Medium::Cpu,
                        namespace: None,
                        group: Some(CacheGroup { index: g32, kind: GroupKind::Other }),
                    }));
                }
            }
        }
        let mut evicted: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
        while self.offload_by_tick.len() > self.offload_capacity {
            let Some((_, (g, victim))) = self.offload_by_tick.pop_first() else { break };
            self.offloaded.remove(&(g, victim));
            evicted.entry(g).or_default().push(victim);
        }
        for (g, hashes) in evicted {
            events.push(EngineEvent::Removed { hashes, medium: Medium::Cpu, group: Some(g) });
        }
        events
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
        // What the offload tier loads, asked before anything of the request changes a tier.
        let loaded = self.loaded(hashes, tokens.len(), block, hit);
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
        // Then the connector's events, as vLLM publishes a step's.
        let offloaded = self.offload_request(hashes, tokens.len(), block, hit, loaded);
        events.extend(offloaded);
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
        self.offloaded.clear();
        self.offload_by_tick.clear();
    }

    /// Chunks the offload tier holds (each group's counted).
    pub fn offloaded_len(&self) -> usize {
        self.offloaded.len()
    }

    /// About the bytes its maps hold (hash tables at their capacity, an ordered map at about 32
    /// bytes an entry).
    pub fn heap_bytes(&self) -> usize {
        let table = |capacity: usize, entry: usize| capacity.saturating_mul(entry + 1).saturating_mul(8) / 7;
        table(self.held.capacity(), size_of::<((u32, u64), (u32, u64))>())
            + self.by_tick.len().saturating_mul(32)
            + table(self.offloaded.capacity(), size_of::<((u32, u64), u64)>())
            + self.offload_by_tick.len().saturating_mul(32)
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

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    /// The offload tier's events: stores (group, hash), removals (group, hashes).
    type CpuEvents = (Vec<(u32, u64)>, Vec<(u32, Vec<u64>)>);

    fn cpu_events(events: &[EngineEvent]) -> CpuEvents {
        let mut stored = Vec::new();
        let mut removed = Vec::new();
        for e in events {
            match e {
                EngineEvent::Stored(s) if s.medium == Medium::Cpu => {
                    assert_eq!((s.parent, s.tokens.len(), s.block_size, s.hashes.len()), (None, 0, 0, 1));
                    let group = s.group.expect("a placeholder names its group");
                    assert_eq!(group.kind, GroupKind::Other, "a placeholder names no kind");
                    stored.push((group.index, s.hashes[0]));
                }
                EngineEvent::Removed { hashes, medium: Medium::Cpu, group } => {
                    removed.push((group.expect("one removal a group"), hashes.clone()));
                }
                _ => {}
            }
        }
        (stored, removed)
    }

    /// A sliding window of 32 tokens (2 blocks of 16) and full attention; a GPU pool of 12
    /// (group, block) copies and an offload tier of `chunks` chunks. Prompt A (10 blocks) runs,
    /// then prompt B of as many blocks pushes A out of the GPU.
    fn after_two(chunks: usize) -> (HybridCache, Vec<u32>, Vec<EngineEvent>, Vec<EngineEvent>) {
        let ns = Namespace::new("m").expect("name");
        let mut cache =
            HybridCache::new(vec![GroupKind::SlidingWindow { window: 32 }, GroupKind::Full]).with_offload(chunks);
        let a: Vec<u32> = (0..160).collect();
        let b: Vec<u32> = (1000..1160).collect();
        let first = cache.run(&a, &hashes(&a, 16), 16, 12, &ns);
        let second = cache.run(&b, &hashes(&b, 16), 16, 12, &ns);
        (cache, a, first, second)
    }

    /// A's continuation is gone from the GPU, yet the engine reuses 144 tokens of it through
    /// the offload tier alone: full attention's 10 chunks from the first, then the window's 2
    /// chunks before block 9 (the window A's GPU group kept, so the one it offloaded).
    #[test]
    fn a_prompt_evicted_from_the_gpu_hits_through_the_offload_tier() {
        let (mut cache, a, first, _) = after_two(1000);
        let h = hashes(&a, 16);
        let (stored, removed) = cpu_events(&first);
        // Every block of A in full attention, blocks 7 and 8 in the window.
        let mut expected: Vec<(u32, u64)> = (0..10).rev().map(|i| (1, h[i])).collect();
        expected.extend([(0, h[8]), (0, h[7])]);
        let mut sorted = stored.clone();
        sorted.sort_unstable();
        expected.sort_unstable();
        assert_eq!(sorted, expected);
        assert!(removed.is_empty());
        // The connector's events follow the GPU's.
        let first_cpu = first.iter().position(|e| matches!(e, EngineEvent::Stored(s) if s.medium == Medium::Cpu));
        assert!(
            first
                .iter()
                .skip(first_cpu.expect("stores"))
                .all(|e| !matches!(e, EngineEvent::Stored(s) if s.medium == Medium::Gpu))
        );
        let mut next = a.clone();
        next.extend(2000..2040);
        let nh = hashes(&next, 16);
        assert_eq!(cache.hit(&nh, next.len(), 16), 0, "nothing of A left on the GPU");
        assert_eq!(cache.reused(&nh, next.len(), 16), (0, 144));
        // Running it loads those chunks (stored nothing again) and stores its new ones.
        let ns = Namespace::new("m").expect("name");
        let events = cache.run(&next, &nh, 16, 1000, &ns);
        let (stored, _) = cpu_events(&events);
        assert!(stored.iter().all(|&(g, x)| !(g == 1 && h.contains(&x))), "A's full chunks are held already");
        assert_eq!(stored.iter().filter(|&&(g, _)| g == 1).count(), 2, "blocks 10 and 11");
        assert_eq!(cache.reused(&nh, next.len(), 16), (192, 192), "on the GPU again");
        // A restart empties both tiers.
        cache.clear();
        assert_eq!((cache.reused(&nh, next.len(), 16), cache.offloaded_len()), ((0, 0), 0));
    }

    /// A small tier evicts least recent first, A's last blocks first: one removal a group. The
    /// window then has nothing before full attention's end and the engine reuses nothing.
    #[test]
    fn the_offload_tier_evicts_by_group_and_a_window_without_its_chunks_loads_nothing() {
        let (cache, a, _, second) = after_two(20);
        let h = hashes(&a, 16);
        let (_, removed) = cpu_events(&second);
        assert_eq!(removed, vec![(0, vec![h[8], h[7]]), (1, vec![h[9], h[8]])]);
        assert_eq!(cache.offloaded_len(), 20);
        let mut next = a.clone();
        next.extend(2000..2040);
        let nh = hashes(&next, 16);
        // Full attention holds chunks 0-7, but the window none of the 2 before 128.
        assert_eq!(cache.reused(&nh, next.len(), 16), (0, 0));
    }
}
