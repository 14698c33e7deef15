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
//! Each block held is a row (`engine_group_blocks/v8`, [`super::row`]): its copies by group and
//! where the prompt stands after it, so that it is placed again at an open even when its parent
//! has gone. The fine keys' copies and clocks are derived from the rows. Holdings of a block
//! size that does not divide 64, or of several sizes, are not modelled: such an engine is
//! claimed to hold nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::event::{EngineStored, GroupKind};
use super::reuse::{Need, Spec, reuse};
use super::row::{GroupedRow, encode_grouped};
use crate::decided::Effect;
use crate::error::{Error, Result};
use crate::keys::{BLOCK_TOKENS, BlockKey, FinePosition, KeyMap, Scheme};

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
    /// engine's size).
    pub(crate) unplaced: u64,
}

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
                let Some((at, key)) = at.and_then(|at| Some((at.clone(), at.key()?))) else {
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
                self.blocks.remove(&hash);
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
        self.blocks.insert(hash, Known { at: row.at, key, copies: row.copies, since, clock });
        Ok(())
    }

    /// Everything is gone; the next store sets the block size again (as after an open).
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
        self.block_size = None;
    }

    /// The tokens the engine reuses of a prompt whose fine keys at its block size, up to its
    /// length less one token, are `fine`, by vLLM's rule over `groups` (chunked local ones of
    /// `chunk` tokens), with the clock of the newest block of the hit. 0 for groups the rule
    /// does not model (a chunked-local group with no chunk given: the events do not carry it; a
    /// kind this build does not know).
    pub(crate) fn reused(
        &self,
        groups: &BTreeMap<u32, GroupKind>,
        chunk: Option<usize>,
        fine: &[BlockKey],
    ) -> (usize, u64) {
        let Some(size) = self.block_size else { return (0, 0) };
        let mut specs: Vec<(Spec, Vec<u32>)> = Vec::new();
        for (&index, &kind) in groups {
            let need = match kind {
                GroupKind::Full => Need::All,
                GroupKind::SlidingWindow { window } => Need::Window { window: window as usize },
                GroupKind::Mamba => Need::State,
                GroupKind::ChunkedLocal => match chunk {
                    Some(chunk) => Need::Chunk { chunk },
                    None => return (0, 0),
                },
                _ => return (0, 0),
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
        let tokens = reuse(&only, fine.len() * size + 1, holds).unwrap_or(0);
        let clock =
            (tokens / size).checked_sub(1).and_then(|n| fine.get(n)).and_then(|k| self.held.get(k)).map_or(0, |h| h.1);
        (tokens, clock)
    }
}
