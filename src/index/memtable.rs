//! The memtable: every `ran` not yet committed, answerable by block key. One small entry per
//! block: the last 8 bytes of its key (already a uniform hash of everything up to it) → the index
//! of the node that wrote it and the clock of that `ran`. `ran`s go into the open map; when the
//! commit thread takes the queue, the open map joins the frozen one, which holds everything taken
//! and not yet committed; the commit that holds it drops it whole. So inserts go to a small map,
//! and forgetting a batch costs nothing per block.

use crate::decided::node_set::add_member;
use crate::keys::{BlockKey, KeyMap};

/// Most keys an open map is made with room for.
const MAX_ROOM: usize = 1 << 16;

/// A map keyed by block key tails (8 bytes of a uniform hash).
type Tails<V> = KeyMap<u64, V>;

/// One batch's entries: block key tail → (node id, clock) of its newest write, and the other
/// nodes that wrote it earlier in the batch. A different key with the same 8-byte tail would be
/// taken for it: at a million pending blocks, a chance of about 2^-44.
#[derive(Default)]
pub(crate) struct Map {
    newest: Tails<(u32, u64)>,
    /// Written only when a block's node changes within the batch (and blocks keep more than
    /// one node).
    earlier: Tails<Vec<(u32, u64)>>,
}

/// The `ran`s not yet committed.
#[derive(Default)]
pub(crate) struct Memtable {
    /// What the commit thread has taken and not yet committed: (blocks written, map).
    frozen: Option<(usize, Map)>,
    open: Map,
    open_blocks: usize,
    /// A committed batch's map, emptied with its room kept: the next open map. A map a batch,
    /// allocated again at every commit, would leave the allocator's heap fragmented.
    spare: Option<Map>,
}

impl Map {
    /// An empty map with room for `blocks` keys.
    fn with_room(blocks: usize) -> Map {
        Map { newest: Tails::with_capacity_and_hasher(blocks, Default::default()), earlier: Tails::default() }
    }

    /// The newest write of `key` in this batch.
    pub(crate) fn newest(&self, key: &BlockKey) -> Option<(u32, u64)> {
        self.newest.get(&tail(key)).copied()
    }

    /// Writes `blocks` by `node` at `clock` (clocks only grow). With `others`, a block whose
    /// node changes keeps the one before among its earlier writers.
    pub(crate) fn put(&mut self, blocks: &[BlockKey], node: u32, clock: u64, others: bool) {
        self.newest.reserve(blocks.len());
        for key in blocks {
            let t = tail(key);
            if let Some(old) = self.newest.insert(t, (node, clock))
                && others
                && old.0 != node
            {
                add_member(self.earlier.entry(t).or_default(), old);
            }
        }
    }

    /// Takes back the write of `blocks` by `node` at `clock` (it is answered elsewhere now): an
    /// earlier writer of a block, if it has one, is its newest again. A write the same node made
    /// before was folded into this one, and goes with it.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))] // a sharing head's own writes only
    pub(crate) fn remove(&mut self, blocks: &[BlockKey], node: u32, clock: u64) {
        for key in blocks {
            let t = tail(key);
            if self.newest.get(&t) == Some(&(node, clock)) {
                let mut before = self.earlier.remove(&t).unwrap_or_default();
                match before.iter().enumerate().max_by_key(|(_, m)| m.1).map(|(i, _)| i) {
                    Some(i) => {
                        let promoted = before.swap_remove(i);
                        self.newest.insert(t, promoted);
                        if !before.is_empty() {
                            self.earlier.insert(t, before);
                        }
                    }
                    None => {
                        self.newest.remove(&t);
                    }
                }
            } else if let Some(before) = self.earlier.get_mut(&t) {
                before.retain(|&m| m != (node, clock));
                if before.is_empty() {
                    self.earlier.remove(&t);
                }
            }
        }
    }

    /// Writes `blocks` by `node` at `clock` again, older than some writes it holds: where a
    /// block has a newer write it joins the block's earlier writers instead.
    #[cfg_attr(not(feature = "nats"), allow(dead_code))] // a sharing head's own writes only
    pub(crate) fn restore(&mut self, blocks: &[BlockKey], node: u32, clock: u64) {
        for key in blocks {
            let t = tail(key);
            match self.newest.get(&t).copied() {
                Some((n, c)) if c > clock => {
                    if n != node {
                        add_member(self.earlier.entry(t).or_default(), (node, clock));
                    }
                }
                Some(old) => {
                    self.newest.insert(t, (node, clock));
                    if old.0 != node {
                        add_member(self.earlier.entry(t).or_default(), old);
                    }
                }
                None => {
                    self.newest.insert(t, (node, clock));
                }
            }
        }
    }

    /// Whether it holds no write.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.newest.is_empty()
    }

    /// The other nodes that wrote `key` earlier in this batch (each once, its newest clock).
    pub(crate) fn earlier(&self, key: &BlockKey) -> &[(u32, u64)] {
        if self.earlier.is_empty() {
            return &[];
        }
        self.earlier.get(&tail(key)).map_or(&[], Vec::as_slice)
    }

    /// Empties it, keeping its room; returns the keys it held.
    pub(crate) fn clear(&mut self) -> usize {
        let held = self.newest.len();
        self.newest.clear();
        self.earlier = Tails::default();
        held
    }

    /// Bytes it holds (its tables' room; the earlier writers' lists counted at a few each).
    fn bytes(&self) -> usize {
        let slot = std::mem::size_of::<(u64, (u32, u64))>() + 1;
        let earlier = std::mem::size_of::<(u64, Vec<(u32, u64)>)>() + 1 + 4 * std::mem::size_of::<(u32, u64)>();
        self.newest.capacity() * slot + self.earlier.capacity() * earlier
    }

    /// Whether any key of this batch was written by more than one node.
    pub(crate) fn has_earlier(&self) -> bool {
        !self.earlier.is_empty()
    }

    /// Takes in `newer`'s writes: each newer write wins, and (with `others`) the write it
    /// replaces, if of another node, joins the key's earlier writers.
    /// `newer` is left empty, with its room kept for the next batch.
    fn absorb(&mut self, newer: &mut Map, others: bool) {
        let Map { newest, earlier } = newer;
        for (t, write) in newest.drain() {
            let mut before = self.earlier.remove(&t).unwrap_or_default();
            if let Some(old) = self.newest.insert(t, write)
                && others
                && old.0 != write.0
            {
                add_member(&mut before, old);
            }
            for later in earlier.remove(&t).unwrap_or_default() {
                add_member(&mut before, later);
            }
            if !before.is_empty() {
                self.earlier.insert(t, before);
            }
        }
    }
}

fn tail(key: &BlockKey) -> u64 {
    let mut t = [0u8; 8];
    t.copy_from_slice(&key[8..]);
    u64::from_le_bytes(t)
}

impl Memtable {
    /// Adds a `ran` to the open batch (clocks only grow). With `others`, a block whose node
    /// changes keeps the one before.
    pub(crate) fn push(&mut self, clock: u64, blocks: &[BlockKey], node: u32, others: bool) {
        self.open.put(blocks, node, clock, others);
        self.open_blocks += blocks.len();
    }

    /// Closes the open batch: the commit thread has taken its `ran`s. They join the frozen map
    /// of the batch not yet committed, if there is one (the commit thread takes the queue as
    /// it comes, many times a commit): one map a commit, so a lookup that misses reads one or
    /// two maps, not one per `ran` since the last commit. Everything in the frozen map is
    /// committed by the same commit: the takes and the commit all hold the writer's lock.
    pub(crate) fn freeze(&mut self, others: bool) {
        if self.open_blocks == 0 {
            return;
        }
        // The next open map starts with the room this one needed: grown from empty, each
        // batch's first `ran`s would rehash it several times.
        match self.frozen.as_mut() {
            Some((blocks, map)) => {
                map.absorb(&mut self.open, others);
                self.open.earlier = Tails::default();
                *blocks += self.open_blocks;
            }
            None => {
                // Bounded: one take of a far-behind queue must not size every open map after it.
                let room = self.open.newest.len().min(MAX_ROOM);
                let next = self.spare.take().unwrap_or_else(|| Map::with_room(room));
                let open = std::mem::replace(&mut self.open, next);
                self.frozen = Some((self.open_blocks, open));
            }
        }
        self.open_blocks = 0;
    }

    /// The node index and clock of the newest pending `ran` that wrote `key` (at any depth: a
    /// key names its depth).
    pub(crate) fn get(&self, key: &BlockKey) -> Option<(u32, u64)> {
        let t = tail(key);
        if let Some(&found) = self.open.newest.get(&t) {
            return Some(found);
        }
        self.frozen.as_ref().and_then(|(_, map)| map.newest.get(&t).copied())
    }

    /// Every pending write of `key`, (node id, clock), in no order, pushed onto `into`.
    #[cfg(test)]
    pub(crate) fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) {
        for map in self.maps() {
            if let Some(found) = map.newest(key) {
                into.push(found);
                into.extend_from_slice(map.earlier(key));
            }
        }
    }

    /// The batches' maps, oldest first, the open one last.
    pub(crate) fn maps(&self) -> impl Iterator<Item = &Map> {
        self.frozen.iter().map(|(_, m)| m).chain([&self.open])
    }

    /// Takes out the frozen map: the commit that holds what it holds is installed. The caller
    /// drops it (outside its lock).
    pub(crate) fn drop_frozen(&mut self) -> Option<Map> {
        self.frozen.take().map(|(_, map)| map)
    }

    /// Takes back a map [`Memtable::drop_frozen`] gave out, emptied by the caller outside its
    /// lock, as the next open map; given back (for the caller to drop outside its lock) if one
    /// is kept already, or if its batch used under a quarter of its room (a burst's room is not
    /// held for good).
    pub(crate) fn reuse(&mut self, map: Map, used: usize) -> Option<Map> {
        if self.spare.is_none() && used >= map.newest.capacity() / 4 {
            self.spare = Some(map);
            return None;
        }
        Some(map)
    }

    /// Bytes its maps hold.
    pub(crate) fn bytes(&self) -> usize {
        self.maps().map(Map::bytes).sum()
    }

    /// Blocks held, counting each `ran`'s.
    pub(crate) fn blocks(&self) -> usize {
        self.open_blocks + self.frozen.as_ref().map_or(0, |(n, _)| *n)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn chain(seed: u8, n: usize) -> Vec<BlockKey> {
        let ns = crate::keys::Namespace::new("m").ok();
        let tokens: Vec<u32> = (0..n as u32 * 64).map(|t| t * 7 + u32::from(seed)).collect();
        ns.map(|ns| ns.chain(&tokens)).unwrap_or_default()
    }

    #[test]
    fn the_newest_pending_ran_answers_and_a_committed_batch_goes_whole() {
        let mut memtable = Memtable::default();
        let a = chain(1, 40);
        memtable.push(1, &a, 0, true);
        memtable.freeze(true);
        memtable.push(2, &a[..20], 1, true);
        memtable.push(3, &a[..10], 2, true);
        assert_eq!(memtable.get(&a[5]), Some((2, 3)), "the open batch is newer than the frozen one");
        assert_eq!(memtable.get(&a[15]), Some((1, 2)));
        assert_eq!(memtable.get(&a[30]), Some((0, 1)));
        let mut writes = Vec::new();
        memtable.writes(&a[5], &mut writes);
        writes.sort_unstable();
        assert_eq!(writes, vec![(0, 1), (1, 2), (2, 3)], "every node that wrote it, in either batch");
        assert_eq!(memtable.get(&chain(2, 1)[0]), None);
        assert_eq!(memtable.blocks(), 70);
        assert!(memtable.drop_frozen().is_some(), "batch 1's commit is installed");
        assert_eq!(memtable.get(&a[30]), None, "a's own blocks went with its batch");
        assert_eq!(memtable.get(&a[5]), Some((2, 3)), "the open batch stays");
        assert_eq!(memtable.blocks(), 30);
        assert!(memtable.drop_frozen().is_none(), "an open batch is never dropped");
        assert_eq!(memtable.get(&a[5]), Some((2, 3)));
        memtable.freeze(true);
        assert!(memtable.drop_frozen().is_some());
        assert_eq!((memtable.get(&a[5]), memtable.blocks()), (None, 0));
    }

    /// Takes before a commit join one frozen map, keeping every node that wrote a key; the
    /// commit of the newest drops it whole.
    #[test]
    fn takes_between_commits_share_one_frozen_map() {
        let mut memtable = Memtable::default();
        let a = chain(3, 12);
        for (clock, node) in [(1, 0), (2, 1), (3, 0), (4, 2)] {
            memtable.push(clock, &a[..(clock as usize * 3)], node, true);
            memtable.freeze(true);
        }
        assert!(memtable.frozen.is_some(), "one map a commit");
        assert_eq!(memtable.get(&a[0]), Some((2, 4)));
        assert_eq!(memtable.get(&a[8]), Some((2, 4)));
        let mut writes = Vec::new();
        memtable.writes(&a[0], &mut writes);
        writes.sort_unstable();
        assert_eq!(writes, vec![(0, 3), (1, 2), (2, 4)], "each node once, with its newest write");
        assert!(memtable.drop_frozen().is_some());
        assert_eq!(memtable.blocks(), 0);
    }

    /// Along a chain, the blocks with earlier writers in a batch are a prefix of it (what the
    /// read path's binary search for them relies on), through the takes that join maps too.
    #[test]
    fn blocks_with_earlier_writers_are_a_prefix_of_the_chain() {
        let a = chain(4, 64);
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        for round in 0..200u64 {
            let mut memtable = Memtable::default();
            for clock in 1..=12 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let len = 1 + (state % 64) as usize;
                memtable.push(clock + round * 100, &a[..len], (state >> 32) as u32 % 4, true);
                if state >> 60 == 0 {
                    memtable.freeze(true);
                }
                for map in memtable.maps() {
                    let several: Vec<bool> = a.iter().map(|k| !map.earlier(k).is_empty()).collect();
                    let prefix = several.iter().take_while(|&&s| s).count();
                    assert!(several[prefix..].iter().all(|&s| !s), "round {round}: {several:?}");
                }
            }
        }
    }

    /// A committed batch's map, emptied, is the next open map: none of its keys answer, and
    /// a map its batch barely used is not kept.
    #[test]
    fn a_committed_map_is_reused_empty() {
        let mut memtable = Memtable::default();
        let a = chain(7, 300);
        memtable.push(1, &a, 0, true);
        memtable.push(2, &a[..5], 1, true);
        memtable.freeze(true);
        let Some(mut map) = memtable.drop_frozen() else { panic!("a frozen map") };
        let used = map.clear();
        assert_eq!(used, 300);
        assert!(map.earlier(&a[0]).is_empty() && map.newest(&a[0]).is_none(), "emptied");
        assert!(memtable.reuse(map, used).is_none(), "kept as the next open map");
        let b = chain(8, 10);
        memtable.push(3, &b, 2, true);
        memtable.freeze(true);
        assert_eq!(memtable.get(&a[0]), None, "nothing of the committed batch answers");
        assert_eq!(memtable.get(&b[9]), Some((2, 3)));
        assert!(memtable.spare.is_none(), "the spare became the open map, then the frozen one");
        let Some(mut sized_for_a) = memtable.drop_frozen() else { panic!("a frozen map") };
        let used = sized_for_a.clear();
        assert_eq!(used, 10);
        assert!(memtable.reuse(sized_for_a, used).is_some(), "10 keys in room for 300: not kept");
        let mut full = Map::with_room(16);
        full.put(&chain(9, 16), 0, 1, true);
        let used = full.clear();
        assert!(memtable.reuse(full, used).is_none(), "a map its batch filled is kept");
    }

    /// What the back-pressure counts: the bytes grow with the keys written, and go with the
    /// batch that held them, whatever room the next open map keeps.
    #[test]
    fn its_bytes_follow_the_keys_it_holds() {
        let mut memtable = Memtable::default();
        assert_eq!(memtable.bytes(), 0);
        let a = chain(5, 200);
        memtable.push(1, &a, 0, true);
        let one = memtable.bytes();
        assert!(one >= 200 * std::mem::size_of::<(u64, (u32, u64))>(), "{one} bytes for 200 keys");
        memtable.freeze(true);
        memtable.push(2, &chain(6, 200), 1, true);
        assert!(memtable.bytes() > one, "two batches hold more than one");
        let gone = memtable.drop_frozen();
        assert!(gone.is_some());
        assert!(memtable.bytes() < 2 * one + 64, "the committed batch's map went");
    }
}
