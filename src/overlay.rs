//! The overlay: every `ran` not yet committed, answerable by block key. One small entry per
//! block: the last 8 bytes of its key (already a uniform hash of everything up to it) → the node
//! and the low 32 bits of the clock of the newest pending `ran` that wrote it. 16 bytes an entry,
//! so the map stays dense in cache; the `ran`s' key lists are shared with the queue, not copied.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::chain::BlockKey;
use crate::front::KeyHasher;

/// The `ran`s not yet committed, oldest first.
#[derive(Default)]
pub(crate) struct Overlay {
    rans: VecDeque<(u64, Arc<[BlockKey]>)>,
    /// Block tail → (node index, low 32 bits of the clock) of its newest pending write.
    blocks: HashMap<u64, (u32, u32), std::hash::BuildHasherDefault<KeyHasher>>,
    held: usize,
}

fn tail(key: &BlockKey) -> u64 {
    let mut t = [0u8; 8];
    t.copy_from_slice(&key[8..]);
    u64::from_le_bytes(t)
}

impl Overlay {
    /// Adds a `ran` (clocks only grow).
    pub(crate) fn push(&mut self, clock: u64, blocks: Arc<[BlockKey]>, node: u32) {
        self.blocks.reserve(blocks.len());
        for key in blocks.iter() {
            self.blocks.insert(tail(key), (node, clock as u32));
        }
        self.held += blocks.len();
        self.rans.push_back((clock, blocks));
    }

    /// The node of the newest pending `ran` that wrote `key` (at any depth: a key names its
    /// depth).
    pub(crate) fn get(&self, key: &BlockKey) -> Option<u32> {
        self.blocks.get(&tail(key)).map(|&(node, _)| node)
    }

    /// Forgets every `ran` up to `clock` (committed, or lost); a block a later pending `ran`
    /// rewrote stays.
    pub(crate) fn forget_through(&mut self, clock: u64) {
        while self.rans.front().is_some_and(|(c, _)| *c <= clock) {
            if let Some((c, gone)) = self.rans.pop_front() {
                self.held -= gone.len();
                for key in gone.iter() {
                    let t = tail(key);
                    if self.blocks.get(&t).is_some_and(|&(_, low)| low == c as u32) {
                        self.blocks.remove(&t);
                    }
                }
            }
        }
        if self.rans.is_empty() {
            // Give the memory of a burst back.
            self.blocks = HashMap::default();
        }
    }

    /// Blocks held (counting each `ran`'s).
    pub(crate) fn blocks(&self) -> usize {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(seed: u8, n: usize) -> Arc<[BlockKey]> {
        let ns = crate::chain::Namespace::new("m").ok();
        let tokens: Vec<u32> = (0..n as u32 * 64).map(|t| t * 7 + u32::from(seed)).collect();
        ns.map(|ns| ns.chain(&tokens)).unwrap_or_default().into()
    }

    #[test]
    fn the_newest_pending_ran_answers_and_forgetting_is_by_clock() {
        let mut overlay = Overlay::default();
        let a = chain(1, 40);
        let b: Arc<[BlockKey]> = a[..20].to_vec().into();
        overlay.push(1, Arc::clone(&a), 0);
        overlay.push(2, Arc::clone(&b), 1);
        assert_eq!(overlay.get(&a[5]), Some(1), "b ran the first 20 blocks last");
        assert_eq!(overlay.get(&a[30]), Some(0));
        assert_eq!(overlay.get(&chain(2, 1)[0]), None);
        assert_eq!(overlay.blocks(), 60);
        overlay.forget_through(1);
        assert_eq!(overlay.get(&a[30]), None, "a's own blocks went with it");
        assert_eq!(overlay.get(&a[5]), Some(1), "b's did not");
        overlay.forget_through(2);
        assert_eq!(overlay.get(&a[5]), None);
        assert!(overlay.blocks.is_empty() && overlay.blocks() == 0);
    }
}
