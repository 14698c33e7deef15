//! The engine blocks of one stream, laid out for memory: a slab of fixed-size slots, an index
//! from engine hash to slot, the tokens of each slot in one arena (slab and arena in chunks
//! allocated once each, `Chunked`), and each block's children as an intrusive list through the
//! slots (a block whose parent is not held waits in `orphans` under its parent's hash, and is
//! adopted when the parent is stored). A head following 8 engines of 65,536 blocks holds half a
//! million of these.

use std::collections::HashMap;

use crate::keys::{BlockKey, ChainState, KeyMap};

/// No slot.
pub(crate) const NIL: u32 = u32::MAX;

/// Slots a chunk of the slab holds (80 KiB).
const SLOT_CHUNK: usize = 1024;
/// Tokens a chunk of the arena holds (64 KiB), or one block's if more.
const TOKEN_CHUNK: usize = 16 * 1024;

/// A vector kept in chunks of `chunk` elements, each allocated once at its full size: it grows a
/// chunk at a time and never moves what it holds. The slab and the token arena are held this
/// way, not in one vector: a vector that doubles leaves a full engine (65,536 blocks, a power of
/// two, and a batch's stores come before its evictions) at twice its size, and one that grows
/// by less reallocates often, each move leaving megabytes of holes in the allocator's heap.
#[derive(Clone, Debug)]
struct Chunked<T> {
    chunk: usize,
    chunks: Vec<Vec<T>>,
    len: usize,
}

impl<T> Chunked<T> {
    fn new(chunk: usize) -> Chunked<T> {
        Chunked { chunk: chunk.max(1), chunks: Vec::new(), len: 0 }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, i: usize) -> Option<&T> {
        self.chunks.get(i / self.chunk)?.get(i % self.chunk)
    }

    fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.chunks.get_mut(i / self.chunk)?.get_mut(i % self.chunk)
    }

    /// `len` elements from `start`, if they are held and in one chunk.
    fn slice(&self, start: usize, len: usize) -> Option<&[T]> {
        let at = start % self.chunk;
        self.chunks.get(start / self.chunk)?.get(at..at.checked_add(len)?)
    }

    fn slice_mut(&mut self, start: usize, len: usize) -> Option<&mut [T]> {
        let at = start % self.chunk;
        self.chunks.get_mut(start / self.chunk)?.get_mut(at..at.checked_add(len)?)
    }

    fn push(&mut self, value: T) {
        if self.len.is_multiple_of(self.chunk) {
            self.chunks.push(Vec::with_capacity(self.chunk));
        }
        if let Some(last) = self.chunks.last_mut() {
            // A clone's chunks are only as long as what they held.
            if last.len() == last.capacity() {
                last.reserve_exact(self.chunk - last.len());
            }
            last.push(value);
            self.len += 1;
        }
    }

    /// Elements allocated room for.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.chunks.iter().map(Vec::capacity).sum()
    }
}

/// What an attached block keys: where its chain stands after the last block of ours that ends
/// inside it, and those blocks (only for blocks where one ends, and first blocks).
#[derive(Clone, Debug)]
pub(crate) struct Completed {
    /// The chain after its last block of ours (for a first block with none: the chain's start).
    pub state: ChainState,
    /// The blocks of ours that end inside it.
    pub keys: Box<[BlockKey]>,
}

/// One engine block.
#[derive(Clone, Debug)]
pub(crate) struct Slot {
    /// Its engine hash.
    pub hash: u64,
    /// Its parent's hash (`None`: a prompt's first block).
    pub parent: Option<u64>,
    /// The clock of the batch that first stored it.
    pub clock: u64,
    /// Derived once it was first attached: tokens from the prompt's first to its last.
    pub end: u64,
    /// Derived once it was first attached: what it keys (the same at every later attachment:
    /// an engine hash names its whole prefix).
    pub completed: Option<Box<Completed>>,
    /// Copies stored and not yet removed, in any medium (0: a free slot).
    pub refs: u32,
    /// Of those, the copies an offloading connector keeps in CPU memory, and on storage.
    pub offload: [u32; 2],
    /// Derived while attached: the slowest tier along its chain, from the prompt's first block
    /// (0 GPU, 1 CPU, 2 storage): where the engine can load the whole prefix from.
    pub tier: u8,
    first_child: u32,
    next_sibling: u32,
    /// For a first block: its namespace's index in the stream's list (`None`: unkeyed).
    pub root: Option<Option<u16>>,
    /// Derived once it was first attached: the namespace its chain is keyed in (`None`:
    /// unkeyed, or not yet attached).
    pub ns: Option<u16>,
    /// Whether it hashes more than its tokens (an image, prompt embeddings): it keys nothing,
    /// nor does anything below it.
    pub opaque: bool,
    /// Whether what it keys was derived.
    pub derived: bool,
    /// Whether it is attached now: its parent is (back to a prompt's first block).
    pub attached: bool,
}

/// The blocks of one stream.
#[derive(Clone, Debug)]
pub(crate) struct Blocks {
    slots: Chunked<Slot>,
    index: KeyMap<u64, u32>,
    free: Vec<u32>,
    /// Tokens: slot `i`'s at `i * stride ..`, for blocks of `stride` tokens (a chunk holds
    /// whole blocks).
    arena: Chunked<u32>,
    stride: usize,
    /// Tokens of blocks of another size, by slot.
    odd: HashMap<u32, Box<[u32]>>,
    /// First waiting child (by slot), by the hash of its parent that is not held.
    orphans: KeyMap<u64, u32>,
}

impl Default for Blocks {
    fn default() -> Self {
        Blocks {
            slots: Chunked::new(SLOT_CHUNK),
            index: KeyMap::default(),
            free: Vec::new(),
            arena: Chunked::new(TOKEN_CHUNK),
            stride: 0,
            odd: HashMap::new(),
            orphans: KeyMap::default(),
        }
    }
}

impl Slot {
    /// The fastest tier holding a copy: 0 GPU, 1 CPU, 2 storage.
    pub(crate) fn own_tier(&self) -> u8 {
        if super::gpu_copies(self.refs, self.offload) > 0 {
            0
        } else if self.offload[0] > 0 {
            1
        } else {
            2
        }
    }
}

impl Blocks {
    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// The slot of the block of hash `hash`.
    pub(crate) fn find(&self, hash: u64) -> Option<u32> {
        self.index.get(&hash).copied()
    }

    /// Slot `i`.
    pub(crate) fn get(&self, i: u32) -> Option<&Slot> {
        self.slots.get(i as usize).filter(|s| s.refs > 0)
    }

    /// Slot `i`, to change.
    pub(crate) fn get_mut(&mut self, i: u32) -> Option<&mut Slot> {
        self.slots.get_mut(i as usize).filter(|s| s.refs > 0)
    }

    /// The tokens of slot `i`.
    pub(crate) fn tokens(&self, i: u32) -> &[u32] {
        match self.odd.get(&i) {
            Some(t) => t,
            None => self.arena.slice((i as usize).saturating_mul(self.stride), self.stride).unwrap_or(&[]),
        }
    }

    /// Every held block's slot.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.index.values().copied()
    }

    /// Slot `i`'s children (held, attached or not).
    pub(crate) fn children(&self, i: u32) -> impl Iterator<Item = u32> + '_ {
        let mut c = self.slots.get(i as usize).map_or(NIL, |s| s.first_child);
        std::iter::from_fn(move || {
            let at = c;
            c = self.slots.get(at as usize)?.next_sibling;
            Some(at)
        })
    }

    /// Adds a block (one copy), linked under its parent (or waiting for it), adopting the
    /// children that were waiting for it. Returns its slot.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        parent: Option<u64>,
        tokens: &[u32],
        clock: u64,
        root: Option<Option<u16>>,
    ) -> u32 {
        if self.stride == 0 && !tokens.is_empty() {
            self.stride = tokens.len();
            self.arena = Chunked::new(self.stride * (TOKEN_CHUNK / self.stride).max(1));
        }
        let slot = Slot {
            hash,
            parent,
            clock,
            end: 0,
            completed: None,
            refs: 1,
            offload: [0; 2],
            tier: 0,
            first_child: self.orphans.remove(&hash).unwrap_or(NIL),
            next_sibling: NIL,
            root,
            ns: None,
            opaque: false,
            derived: false,
            attached: false,
        };
        let i = match self.free.pop() {
            Some(i) => {
                if let Some(s) = self.slots.get_mut(i as usize) {
                    *s = slot;
                }
                i
            }
            None => {
                self.slots.push(slot);
                u32::try_from(self.slots.len() - 1).unwrap_or(NIL)
            }
        };
        self.set_tokens(i, tokens);
        self.index.insert(hash, i);
        if let Some(p) = parent.filter(|&p| p != hash) {
            let head = match self.find(p) {
                Some(ps) => self.slots.get_mut(ps as usize).map(|s| &mut s.first_child),
                None => Some(self.orphans.entry(p).or_insert(NIL)),
            };
            if let Some(head) = head {
                let next = std::mem::replace(head, i);
                if let Some(s) = self.slots.get_mut(i as usize) {
                    s.next_sibling = next;
                }
            }
        }
        i
    }

    fn set_tokens(&mut self, i: u32, tokens: &[u32]) {
        if tokens.len() != self.stride {
            self.odd.insert(i, tokens.into());
            return;
        }
        self.odd.remove(&i);
        let start = (i as usize).saturating_mul(self.stride);
        while self.arena.len() < start + self.stride {
            self.arena.push(0);
        }
        if let Some(place) = self.arena.slice_mut(start, self.stride) {
            place.copy_from_slice(tokens);
        }
    }

    /// Removes slot `i` (its last copy): unlinked from its parent's children, its own children
    /// left waiting for its hash. Returns it.
    pub(crate) fn remove(&mut self, i: u32) -> Option<Slot> {
        let slot = self.get(i)?.clone();
        self.index.remove(&slot.hash);
        if let Some(p) = slot.parent {
            let parent_slot = self.find(p);
            self.unlink(parent_slot, p, i, slot.next_sibling);
        }
        if slot.first_child != NIL && slot.first_child != i {
            self.orphans.insert(slot.hash, slot.first_child);
        }
        if let Some(s) = self.slots.get_mut(i as usize) {
            s.refs = 0;
            s.completed = None;
            s.first_child = NIL;
        }
        self.odd.remove(&i);
        self.free.push(i);
        Some(slot)
    }

    /// Takes `i` out of the children of `parent` (its slot, else the orphans waiting for it).
    fn unlink(&mut self, parent: Option<u32>, parent_hash: u64, i: u32, next: u32) {
        let first = match parent {
            Some(ps) => self.slots.get(ps as usize).map_or(NIL, |s| s.first_child),
            None => self.orphans.get(&parent_hash).copied().unwrap_or(NIL),
        };
        if first == i {
            match parent {
                Some(ps) => {
                    if let Some(s) = self.slots.get_mut(ps as usize) {
                        s.first_child = next;
                    }
                }
                None if next == NIL => {
                    self.orphans.remove(&parent_hash);
                }
                None => {
                    self.orphans.insert(parent_hash, next);
                }
            }
            return;
        }
        let mut c = first;
        while let Some(s) = self.slots.get(c as usize) {
            if s.next_sibling == i {
                if let Some(s) = self.slots.get_mut(c as usize) {
                    s.next_sibling = next;
                }
                return;
            }
            c = s.next_sibling;
        }
    }

    /// Drops every block.
    pub(crate) fn clear(&mut self) {
        *self = Blocks::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn children_follow_their_parent_out_and_back() {
        let mut b = Blocks::default();
        let root = b.insert(1, None, &[1, 2], 1, Some(None));
        let x = b.insert(2, Some(1), &[3, 4], 1, None);
        let y = b.insert(3, Some(1), &[5, 6, 7], 1, None);
        assert_eq!(b.tokens(y), [5, 6, 7], "a block of another size");
        assert_eq!(b.tokens(x), [3, 4]);
        let mut kids: Vec<u32> = b.children(root).collect();
        kids.sort_unstable();
        assert_eq!(kids, vec![x, y]);
        // The parent goes: its children wait for its hash, and come back with it.
        b.remove(root);
        assert_eq!(b.find(1), None);
        let again = b.insert(1, None, &[1, 2], 2, Some(None));
        let mut kids: Vec<u32> = b.children(again).collect();
        kids.sort_unstable();
        assert_eq!(kids, vec![x, y]);
        // A child stored before its parent waits for it too.
        let z = b.insert(9, Some(8), &[0, 0], 3, None);
        let p = b.insert(8, Some(1), &[0, 1], 3, None);
        assert_eq!(b.children(p).collect::<Vec<_>>(), vec![z]);
        b.remove(x);
        let mut kids: Vec<u32> = b.children(again).collect();
        kids.sort_unstable();
        assert_eq!(kids, vec![y, p]);
        assert_eq!(b.len(), 4);
        assert_eq!(b.insert(10, None, &[4, 4], 4, Some(None)), x, "a freed slot is used again");
    }

    /// A full engine of 65,536 blocks and a batch's stores over it before its evictions: the
    /// slab and the arena hold a chunk more than that at most (a vector that doubles held twice
    /// the engine's size), and a block's tokens read back whatever its slot.
    #[test]
    fn slab_and_arena_hold_a_chunk_more_than_the_blocks_at_most() {
        let mut b = Blocks::default();
        let held = 65_536 + 700;
        for h in 0..held as u64 {
            let tokens: Vec<u32> = (0..16).map(|t| (h as u32) ^ t).collect();
            b.insert(h + 1, (h > 0).then_some(h), &tokens, 1, (h == 0).then_some(None));
        }
        assert_eq!(b.slots.len(), held);
        assert!(b.slots.capacity() <= held + SLOT_CHUNK, "{} slots for {held}", b.slots.capacity());
        assert!(b.arena.capacity() <= 16 * held + TOKEN_CHUNK, "{} tokens for {held}", b.arena.capacity());
        for h in [0u64, 1023, 1024, 4095, 4096, 40_000, held as u64 - 1] {
            let slot = b.find(h + 1).expect("held");
            assert_eq!(b.tokens(slot), (0..16).map(|t| (h as u32) ^ t).collect::<Vec<_>>());
        }
    }

    /// A block size that does not divide a chunk's tokens: every block's tokens still sit in one
    /// chunk.
    #[test]
    fn blocks_of_an_odd_size_never_straddle_chunks() {
        let mut b = Blocks::default();
        let size = 4099;
        for h in 0..40u32 {
            b.insert(u64::from(h) + 1, None, &vec![h; size], 1, Some(None));
        }
        for h in 0..40u32 {
            let slot = b.find(u64::from(h) + 1).expect("held");
            assert_eq!(b.tokens(slot), vec![h; size]);
        }
    }
}
