//! What a hybrid-attention engine holds: its KV cache groups (one per kind of attention layer),
//! each group's copies of each engine block, and what the engine reuses of a prompt by vLLM's
//! rule ([`super::reuse`]).
//!
//! vLLM stores each block once per group, under one hash, and a sliding-window group keeps only
//! the last few blocks of a request: its stores list only the blocks it keeps, whose places are
//! known from the store of the same step that lists them all (same parent, same tokens), or from
//! an earlier store. A block is placed by its fine key ([`crate::keys::FinePosition`]), so that a
//! prompt's blocks at the engine's granularity are found from the prompt's tokens. Copies are
//! counted per group and hash: a full group stores the same hash again while a copy is live, and
//! each copy is removed on its own.
//!
//! An offloading connector's copies in CPU memory (vLLM 0.33's `OffloadingConnector`) are
//! counted the same way, under their group's index marked as offloaded ([`cpu_copy`]); the
//! connector loads what it holds past the GPU hit by its own rule ([`super::offload`]). Its
//! default stores name only a block's hash: they are placed where the block's GPU copy was.
//!
//! Each block held is a row (`engine_group_blocks/v8`, [`super::row`]): its copies by group and
//! where the prompt stands after it, so that it is placed again at an open even when its parent
//! has gone. The fine keys' copies and clocks are derived from the rows. Holdings of a block
//! size that does not divide 64, or of several sizes, are not modelled: such an engine is
//! claimed to hold nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::event::{EngineStored, GroupKind};
use super::offload::{Offloaded, Reach, loaded};
use super::reuse::{Need, Spec, reuse};
use super::row::{GroupedRow, encode_grouped};
use crate::decided::Effect;
use crate::error::{Error, Result};
use crate::keys::{BLOCK_TOKENS, BlockKey, FinePosition, KeyMap, Scheme};

/// A copy in the offloading connector's CPU memory is counted under its group's index with this
/// bit set, and the connector's chunk (in engine blocks) in bits 16-30: one row layout for both
/// tiers. A build that does not know the mark reads such copies as groups it does not have.
const CPU_COPY: u32 = 1 << 31;

/// The bits of [`CPU_COPY`]'s group field that hold the connector's chunk.
const CHUNK_BITS: u32 = 0x7fff << 16;

/// The copy count's group field for an offloaded copy in group `group`, in chunks of
/// `chunk_blocks` engine blocks.
pub(crate) fn cpu_copy(group: u32, chunk_blocks: usize) -> u32 {
    let chunk = u32::try_from(chunk_blocks).unwrap_or(u32::MAX).min(0x7fff);
    CPU_COPY | (chunk << 16) | (group & 0xffff)
}

/// Whether group field `field` counts offloaded copies in group `group` (whatever the chunk it
/// was stored with).
fn offloaded_in(field: u32, group: u32) -> bool {
    field & !CHUNK_BITS == CPU_COPY | (group & 0xffff)
}

/// What a hybrid engine reuses of a prompt.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Reused {
    /// Tokens, in all.
    pub(crate) tokens: usize,
    /// Of which in GPU memory (the rest is loaded from CPU memory).
    pub(crate) gpu_tokens: usize,
    /// The clock of the newest copy of the hit's last block.
    pub(crate) clock: u64,
}

/// One engine block a hybrid engine holds in some group.
#[derive(Clone, Debug)]
struct Known {
    /// Where the chain stands after it (its key, and its children's start).
    at: FinePosition,
    /// Its fine key.
    key: BlockKey,
    /// Copies by group: (group index, copies).
    copies: Vec<(u32, u32)>,
    /// The clock of its first store (its row's key) and of its newest.
    since: u64,
    clock: u64,
}

impl Known {
    /// Its row, for an engine of blocks of `size` tokens.
    fn row(&self, size: usize) -> Arc<[u8]> {
        encode_grouped(self.clock, size, &self.copies, &self.at)
    }
}

/// A hybrid engine's holdings (see the module docs).
#[derive(Clone, Debug, Default)]
pub(crate) struct Hybrid {
    /// Its blocks' size in tokens (the first store's).
    block_size: Option<usize>,
    blocks: KeyMap<u64, Known>,
    /// Derived: copies by group of each fine key, and the clock of the newest store of it.
    held: KeyMap<BlockKey, (Vec<(u32, u32)>, u64)>,
    /// Blocks its events did not place (memory only): a parent not held, a sparse store with no
    /// store listing all of its blocks, a block size not modelled (not dividing 64, or not the
    /// engine's size), an offloaded block whose GPU copy is gone.
    pub(crate) unplaced: u64,
    /// The offloading connector's chunk, in engine blocks: learned from its self-describing
    /// stores, and from the copies read at an open; 1 (its default) until then.
    chunk_blocks: Option<usize>,
    /// Where the last [`GONE_KEPT`] blocks whose every copy left were (memory only), oldest
    /// first: the connector announces a store when it completes, a step or more after it began,
    /// and the GPU copy may have left by then.
    gone: std::collections::VecDeque<u64>,
    gone_at: KeyMap<u64, (FinePosition, BlockKey)>,
}

/// Blocks whose places are kept after their last copy left (see [`Hybrid::gone`]).
const GONE_KEPT: usize = 4096;

/// Counts one copy more (`up`) or less in group `group` of `copies`, dropping a count that
/// reaches 0.
fn add(copies: &mut Vec<(u32, u32)>, group: u32, up: bool) {
    match copies.iter().position(|c| c.0 == group) {
        Some(i) => {
            if let Some(c) = copies.get_mut(i) {
                c.1 = if up { c.1.saturating_add(1) } else { c.1.saturating_sub(1) };
                if c.1 == 0 {
                    copies.swap_remove(i);
                }
            }
        }
        None if up => copies.push((group, 1)),
        None => {}
    }
}

impl Hybrid {
    /// Engine blocks held in any group.
    pub(crate) fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Engine blocks held only by the offloading connector (in CPU memory).
    pub(crate) fn offloaded_only(&self) -> usize {
        self.blocks.values().filter(|k| k.copies.iter().all(|c| c.0 & CPU_COPY != 0)).count()
    }

    /// The block size the engine's holdings are in, if modelled.
    pub(crate) fn block_size(&self) -> Option<usize> {
        self.block_size
    }

    /// Stores `stored`'s blocks in group `group`, at `clock`, the rows they change into `out`
    /// (as node `node`'s). `dense`: a store of the same batch that lists every block of the
    /// same range (for a store that lists some only). Returns the blocks stored.
    pub(crate) fn store(
        &mut self,
        scheme: Scheme,
        stored: &EngineStored,
        (group, clock): (u32, u64),
        dense: Option<&EngineStored>,
        (node, out): (u32, &mut Vec<Effect>),
    ) -> usize {
        let size = stored.block_size as usize;
        if size == 0 || !BLOCK_TOKENS.is_multiple_of(size) || self.block_size.is_some_and(|s| s != size) {
            self.unplaced += stored.hashes.len() as u64;
            return 0;
        }
        self.block_size = Some(size);
        let start = match (stored.parent, &stored.namespace) {
            (Some(parent), _) => self.blocks.get(&parent).map(|k| k.at.clone()),
            (None, Some(ns)) => Some(FinePosition::start(ns.key())),
            (None, None) => None,
        };
        let range = stored.tokens.len() / size;
        // Each listed block's place in the range.
        let places: Option<Vec<usize>> = if stored.hashes.len() == range {
            Some((0..range).collect())
        } else {
            dense.map(|d| stored.hashes.iter().filter_map(|h| d.hashes.iter().position(|x| x == h)).collect())
        };
        let (Some(mut at), Some(places)) = (start, places) else {
            // Blocks already placed by an earlier store are counted still.
            return stored.hashes.iter().filter(|&&h| self.copy(h, None, (group, clock), (node, out))).count();
        };
        if places.len() != stored.hashes.len()
            || !places.is_sorted_by(|a, b| a < b)
            || !stored.tokens.len().is_multiple_of(size)
        {
            self.unplaced += stored.hashes.len() as u64;
            return 0;
        }
        let mut done = 0;
        let mut listed = stored.hashes.iter().zip(&places).peekable();
        for (j, tokens) in stored.tokens.chunks_exact(size).enumerate() {
            at.advance(scheme, tokens);
            while let Some((&hash, _)) = listed.next_if(|(_, p)| **p == j) {
                done += usize::from(self.copy(hash, Some(&at), (group, clock), (node, &mut *out)));
            }
        }
        done
    }

    /// The connector's chunk, in engine blocks.
    fn chunk_blocks(&self) -> usize {
        self.chunk_blocks.unwrap_or(1)
    }

    /// Stores the offloading connector's copies in CPU memory of `stored`'s blocks in group
    /// `group`: a self-describing store lists a chunk's blocks with their tokens (and gives the
    /// chunk's size); a default one names only the chunk's last block, placed where its GPU copy
    /// is. Returns the blocks stored.
    pub(crate) fn offload(
        &mut self,
        scheme: Scheme,
        stored: &EngineStored,
        (group, clock): (u32, u64),
        (node, out): (u32, &mut Vec<Effect>),
    ) -> usize {
        let size = stored.block_size as usize;
        if size > 0 && !stored.hashes.is_empty() && stored.tokens.len() == stored.hashes.len() * size {
            self.chunk_blocks = Some(stored.hashes.len());
            let code = cpu_copy(group, self.chunk_blocks());
            return self.store(scheme, stored, (code, clock), None, (node, out));
        }
        let code = cpu_copy(group, self.chunk_blocks());
        stored.hashes.iter().filter(|&&h| self.copy(h, None, (code, clock), (node, &mut *out))).count()
    }

    /// Removes the connector's copy of block `hash` in group `group`. Whether there was one.
    pub(crate) fn unload(&mut self, hash: u64, group: u32, (node, out): (u32, &mut Vec<Effect>)) -> bool {
        let code = self.blocks.get(&hash).and_then(|k| k.copies.iter().find(|c| offloaded_in(c.0, group)));
        match code {
            Some(&(code, _)) => self.remove(hash, code, (node, out)),
            None => false,
        }
    }

    /// Adds a copy of block `hash` in `group` at `clock`, placed at `at` if it is new, its row
    /// into `out`. Whether it was placed.
    fn copy(
        &mut self,
        hash: u64,
        at: Option<&FinePosition>,
        (group, clock): (u32, u64),
        (node, out): (u32, &mut Vec<Effect>),
    ) -> bool {
        let known = match self.blocks.get_mut(&hash) {
            Some(known) => {
                add(&mut known.copies, group, true);
                known.clock = known.clock.max(clock);
                known
            }
            None => {
                let placed = match at {
                    Some(at) => at.key().map(|key| (at.clone(), key)),
                    None => self.gone_at.get(&hash).cloned(),
                };
                let Some((at, key)) = placed else {
                    self.unplaced += 1;
                    return false;
                };
                let known = Known { at, key, copies: vec![(group, 1)], since: clock, clock };
                self.blocks.entry(hash).or_insert(known)
            }
        };
        let row = known.row(self.block_size.unwrap_or_default());
        out.push(Effect::HybridBlock { node, clock: known.since, hash, row: Some(row) });
        let held = self.held.entry(known.key).or_default();
        add(&mut held.0, group, true);
        held.1 = held.1.max(clock);
        true
    }

    /// Removes a copy of block `hash` from `group`, its row's change into `out` (as node
    /// `node`'s). Whether there was one.
    pub(crate) fn remove(&mut self, hash: u64, group: u32, (node, out): (u32, &mut Vec<Effect>)) -> bool {
        let Some(known) = self.blocks.get_mut(&hash) else { return false };
        if !known.copies.iter().any(|c| c.0 == group) {
            return false;
        }
        add(&mut known.copies, group, false);
        let (key, since) = (known.key, known.since);
        let row = match known.copies.is_empty() {
            true => {
                if let Some(gone) = self.blocks.remove(&hash) {
                    self.keep_gone(hash, gone);
                }
                None
            }
            false => Some(known.row(self.block_size.unwrap_or_default())),
        };
        out.push(Effect::HybridBlock { node, clock: since, hash, row });
        if let Some((copies, _)) = self.held.get_mut(&key) {
            add(copies, group, false);
            if copies.is_empty() {
                self.held.remove(&key);
            }
        }
        true
    }

    /// Takes in a block row read from the file: block `hash`, first stored at `since`.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for a row of another block size than the engine's others, or a
    /// position that keys nothing.
    pub(crate) fn load(&mut self, hash: u64, since: u64, row: GroupedRow) -> Result<()> {
        let corrupt = |detail: &str| Error::Corrupted { detail: format!("a hybrid engine's block row: {detail}") };
        let size = row.block_size();
        if self.block_size.is_some_and(|s| s != size) || !BLOCK_TOKENS.is_multiple_of(size) {
            return Err(corrupt("its block size is not the engine's"));
        }
        self.block_size = Some(size);
        let key = row.at.key().ok_or_else(|| corrupt("its position is a chain's start"))?;
        let held = self.held.entry(key).or_default();
        for &(group, n) in &row.copies {
            match held.0.iter_mut().find(|c| c.0 == group) {
                Some(c) => c.1 = c.1.saturating_add(n),
                None => held.0.push((group, n)),
            }
        }
        let clock = row.clock();
        held.1 = held.1.max(clock);
        if let Some(&(code, _)) = row.copies.iter().find(|c| c.0 & CPU_COPY != 0) {
            self.chunk_blocks = Some(((code >> 16) & 0x7fff) as usize);
        }
        self.blocks.insert(hash, Known { at: row.at, key, copies: row.copies, since, clock });
        Ok(())
    }

    /// Keeps where block `hash` was, its last copy gone, dropping the oldest such place past
    /// [`GONE_KEPT`].
    fn keep_gone(&mut self, hash: u64, gone: Known) {
        if self.gone_at.insert(hash, (gone.at, gone.key)).is_none() {
            self.gone.push_back(hash);
        }
        while self.gone.len() > GONE_KEPT {
            if let Some(old) = self.gone.pop_front() {
                self.gone_at.remove(&old);
            }
        }
    }

    /// Everything is gone; the next store sets the block size again (as after an open).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
        self.gone.clear();
        self.gone_at.clear();
        self.block_size = None;
    }

    /// What the engine reuses of a prompt of `prompt` tokens whose fine keys at its block size
    /// (one per whole engine block) are `fine`: its GPU hit by vLLM's rule over `groups`
    /// (chunked local ones of `chunk` tokens), and what its offloading connector loads past it.
    /// Nothing for groups the rule does not model (a chunked-local group with no chunk given:
    /// the events do not carry it; a kind this build does not know).
    pub(crate) fn reused(
        &self,
        groups: &BTreeMap<u32, GroupKind>,
        chunk: Option<usize>,
        fine: &[BlockKey],
        prompt: usize,
    ) -> Reused {
        let Some(size) = self.block_size else { return Reused::default() };
        let mut specs: Vec<(Spec, Vec<u32>)> = Vec::new();
        for (&index, &kind) in groups {
            let need = match kind {
                GroupKind::Full => Need::All,
                GroupKind::SlidingWindow { window } => Need::Window { window: window as usize },
                GroupKind::Mamba => Need::State,
                GroupKind::ChunkedLocal => match chunk {
                    Some(chunk) => Need::Chunk { chunk },
                    None => return Reused::default(),
                },
                _ => return Reused::default(),
            };
            let spec = Spec { need, block_size: size };
            match specs.iter_mut().find(|(s, _)| *s == spec) {
                Some((_, indices)) => indices.push(index),
                None => specs.push((spec, vec![index])),
            }
        }
        let only: Vec<Spec> = specs.iter().map(|(s, _)| *s).collect();
        let holds = |s: usize, i: usize| {
            let (Some((_, indices)), Some((copies, _))) = (specs.get(s), fine.get(i).and_then(|k| self.held.get(k)))
            else {
                return false;
            };
            indices.iter().all(|g| copies.iter().any(|c| c.0 == *g))
        };
        let gpu = reuse(&only, prompt, holds).unwrap_or(0);
        // The connector, past the GPU hit: each group's chunks, keyed by their last block (the
        // kinds are all modelled here: any other answered nothing above).
        let blocks = self.chunk_blocks();
        let mut offloaded: Vec<(Offloaded, u32)> = Vec::with_capacity(groups.len());
        let chunk_tokens = size * blocks;
        for (&index, &kind) in groups {
            let reach = match kind {
                GroupKind::SlidingWindow { window } => {
                    let w = window as usize;
                    Reach::Window { chunks: w.div_ceil(chunk_tokens), tokens: Some(w) }
                }
                GroupKind::Mamba => Reach::Window { chunks: 1, tokens: None },
                GroupKind::ChunkedLocal => {
                    Reach::Window { chunks: chunk.unwrap_or_default().div_ceil(chunk_tokens), tokens: None }
                }
                _ => Reach::All,
            };
            offloaded.push((Offloaded { reach, mamba: kind == GroupKind::Mamba }, index));
        }
        let only: Vec<Offloaded> = offloaded.iter().map(|(o, _)| *o).collect();
        let held = |g: usize, c: usize| {
            let last = (c + 1) * blocks - 1;
            let (Some((_, group)), Some((copies, _))) =
                (offloaded.get(g), fine.get(last).and_then(|k| self.held.get(k)))
            else {
                return false;
            };
            copies.iter().any(|x| offloaded_in(x.0, *group))
        };
        let tokens = gpu + loaded(&only, chunk_tokens, prompt, gpu, held);
        let clock =
            (tokens / size).checked_sub(1).and_then(|n| fine.get(n)).and_then(|k| self.held.get(k)).map_or(0, |h| h.1);
        Reused { tokens, gpu_tokens: gpu, clock }
    }
}
