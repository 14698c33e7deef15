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
//! Memory only: a hybrid engine's holdings are not written to the file (the engine's later
//! events fill them again after a restart of the head; until then the engine is claimed to hold
//! nothing). Holdings of a block size that does not divide 64, or of several sizes, are not
//! modelled: such an engine is claimed to hold nothing.

use std::collections::BTreeMap;

use super::event::{EngineStored, GroupKind};
use super::reuse::{Need, Spec, reuse};
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
}

/// A hybrid engine's holdings (see the module docs).
#[derive(Clone, Debug, Default)]
pub(crate) struct Hybrid {
    /// Its blocks' size in tokens (the first store's).
    block_size: Option<usize>,
    blocks: KeyMap<u64, Known>,
    /// Copies by group of each fine key, and the clock of the newest store of it.
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

    /// Stores `stored`'s blocks in group `group`, at `clock`. `dense`: a store of the same
    /// batch that lists every block of the same range (for a store that lists some only).
    /// Returns the blocks stored.
    pub(crate) fn store(
        &mut self,
        scheme: Scheme,
        stored: &EngineStored,
        group: u32,
        clock: u64,
        dense: Option<&EngineStored>,
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
            return stored.hashes.iter().filter(|&&h| self.copy(h, None, group, clock)).count();
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
                done += usize::from(self.copy(hash, Some(&at), group, clock));
            }
        }
        done
    }

    /// Adds a copy of block `hash` in `group`, placed at `at` if it is new. Whether it was
    /// placed.
    fn copy(&mut self, hash: u64, at: Option<&FinePosition>, group: u32, clock: u64) -> bool {
        let key = match self.blocks.get_mut(&hash) {
            Some(known) => {
                add(&mut known.copies, group, true);
                known.key
            }
            None => {
                let Some((at, key)) = at.and_then(|at| Some((at.clone(), at.key()?))) else {
                    self.unplaced += 1;
                    return false;
                };
                self.blocks.insert(hash, Known { at, key, copies: vec![(group, 1)] });
                key
            }
        };
        let held = self.held.entry(key).or_default();
        add(&mut held.0, group, true);
        held.1 = held.1.max(clock);
        true
    }

    /// Removes a copy of block `hash` from `group`. Whether there was one.
    pub(crate) fn remove(&mut self, hash: u64, group: u32) -> bool {
        let Some(known) = self.blocks.get_mut(&hash) else { return false };
        if !known.copies.iter().any(|c| c.0 == group) {
            return false;
        }
        add(&mut known.copies, group, false);
        let key = known.key;
        if known.copies.is_empty() {
            self.blocks.remove(&hash);
        }
        if let Some((copies, _)) = self.held.get_mut(&key) {
            add(copies, group, false);
            if copies.is_empty() {
                self.held.remove(&key);
            }
        }
        true
    }

    /// Everything is gone.
    pub(crate) fn clear(&mut self) {
        self.blocks.clear();
        self.held.clear();
    }

    /// The tokens the engine reuses of a prompt whose fine keys at its block size, up to its
    /// length less one token, are `fine`, by vLLM's rule over `groups`, with the clock of the
    /// newest block of the hit. 0 for groups the rule does not model (a chunked-local group,
    /// whose chunk the events do not give; a kind this build does not know).
    pub(crate) fn reused(&self, groups: &BTreeMap<u32, GroupKind>, fine: &[BlockKey]) -> (usize, u64) {
        let Some(size) = self.block_size else { return (0, 0) };
        let mut specs: Vec<(Spec, Vec<u32>)> = Vec::new();
        for (&index, &kind) in groups {
            let need = match kind {
                GroupKind::Full => Need::All,
                GroupKind::SlidingWindow { window } => Need::Window { window: window as usize },
                GroupKind::Mamba => Need::State,
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
