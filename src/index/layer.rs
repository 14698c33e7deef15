//! The layers of writes an answer reads above the committed view, newest first: a sharing
//! head's own events not yet back from the stream (`share/own_events.rs`), then each batch of the
//! memtable, newest first. Each is a [`Layer`]; [`Layers`] is the list one answer reads, built
//! once per answer under the callers' lock. The one read path (`lookup.rs`) reads every layer
//! alike and settles what they say with one tie rule ([`settle`]). Nothing is decided from a
//! sharing head's own events (a `ran` decides from the memtable and the committed view alone, so
//! that every head of a stream decides alike).

use super::front::Front;
use super::memtable::Map;
use crate::keys::BlockKey;

/// Node ids from this one up name a layer's own nodes (in its own numbering), never a file's.
pub(crate) const OWN_NODES: u32 = 1 << 31;

/// Clocks from this one up are a sharing head's own events': newer than any a file holds (at
/// most `MAX_CLOCK`, 2^62), as its events not yet applied are the newest it knows.
#[cfg_attr(not(feature = "nats"), allow(dead_code))] // a sharing head's own writes only
pub(crate) const OWN_CLOCKS: u64 = 1 << 63;

/// Writes answered above the committed view. Each layer's writes are prefix-closed along a
/// chain (a `ran` writes every block of its prompt at one clock), so a binary search finds the
/// longest prefix it holds.
pub(crate) trait Layer {
    /// The newest write of `key` still answered: its node and clock.
    fn newest(&self, key: &BlockKey) -> Option<(u32, u64)>;

    /// If more than one write of `key` is still answered: pushes every one (each node once, its
    /// newest clock) onto `into` and returns true. Else pushes nothing and returns false.
    fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) -> bool;

    /// Whether some key may have more than one write (else [`Layer::writes`] need not be asked).
    fn has_earlier(&self) -> bool {
        true
    }

    /// Whether `key` may have more than one write here (else [`Layer::writes`] need not be
    /// asked). Along a chain, true for a prefix of it and false past it: a block with two
    /// writers here has them on every block before it too (each `ran` writes its prompt's
    /// blocks from the first), so the blocks to ask are found by binary search.
    fn may_have_several(&self, _key: &BlockKey) -> bool {
        true
    }

    /// Whether the node named `name` was forgotten here: the file's incarnation of it is not
    /// answered.
    fn forgets(&self, _name: &str) -> bool {
        false
    }

    /// The name of its node `node` (from [`OWN_NODES`] up), if it has its own nodes.
    fn name(&self, _node: u32) -> Option<&str> {
        None
    }
}

/// Pushes `writes` onto `into` if there are more than one (what [`Layer::writes`] does).
pub(crate) fn several(into: &mut Vec<(u32, u64)>, writes: impl Iterator<Item = (u32, u64)>) -> bool {
    let before = into.len();
    into.extend(writes);
    if into.len() - before > 1 {
        return true;
    }
    into.truncate(before);
    false
}

/// One batch of the memtable as a layer: its writes above the callers' eviction floor (an
/// evicted write is not answered, whether the commit thread has removed it yet or not).
struct Batch<'a> {
    map: &'a Map,
    front: &'a Front,
}

impl Layer for Batch<'_> {
    fn newest(&self, key: &BlockKey) -> Option<(u32, u64)> {
        self.map.newest(key).filter(|&(_, clock)| self.front.holds(clock))
    }

    fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) -> bool {
        // Most keys of a batch have one writer: the small table of earlier writers is asked
        // first, and the large one only for a key that has some.
        let earlier = self.map.earlier(key);
        if earlier.is_empty() {
            return false;
        }
        let Some(newest) = self.map.newest(key) else { return false };
        several(
            into,
            std::iter::once(newest).chain(earlier.iter().copied()).filter(|&(_, clock)| self.front.holds(clock)),
        )
    }

    fn has_earlier(&self) -> bool {
        self.map.has_earlier()
    }

    fn may_have_several(&self, key: &BlockKey) -> bool {
        !self.map.earlier(key).is_empty()
    }
}

/// The layers one answer reads above the committed view, newest first.
pub(crate) struct Layers<'a> {
    own: Option<&'a dyn Layer>,
    batches: Vec<Batch<'a>>,
}

impl<'a> Layers<'a> {
    /// `own` (a sharing head's own events), then the memtable's batches, newest first.
    pub(crate) fn new(front: &'a Front, own: Option<&'a dyn Layer>) -> Layers<'a> {
        let mut batches: Vec<Batch<'a>> = front.memtable().maps().map(|map| Batch { map, front }).collect();
        batches.reverse();
        Layers { own, batches }
    }

    /// Every layer, newest first.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &dyn Layer> {
        self.own.into_iter().chain(self.batches.iter().map(|b| b as &dyn Layer))
    }

    /// Whether some layer forgot the node named `name`.
    pub(crate) fn forgets(&self, name: &str) -> bool {
        self.iter().any(|l| l.forgets(name))
    }

    /// The name a layer gives its node `node`.
    pub(crate) fn name(&self, node: u32) -> Option<&str> {
        self.iter().find_map(|l| l.name(node))
    }
}

/// What one source answers for a prompt: a node, how many blocks of it, the clock of the deepest
/// of them, and whether it comes from 0.1.7's imported entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Found {
    pub node: u32,
    pub blocks: usize,
    pub clock: u64,
    pub legacy: bool,
}

impl Found {
    /// The one tie rule of every answer, as a sort key (greater wins): the longer; at equal
    /// length the new chain's over 0.1.7's imported entries (which promise no prefix); then the
    /// newer. Newer covers every source: a sharing head's own events (clocks from
    /// [`OWN_CLOCKS`]) over the memtable's batches, newest first, over the committed view,
    /// and a claim against an engine's holding by when each was made.
    pub(crate) fn rank(&self) -> (usize, bool, u64) {
        (self.blocks, !self.legacy, self.clock)
    }
}

/// The answer that wins by [`Found::rank`] (the first of equals).
pub(crate) fn settle(found: impl IntoIterator<Item = Option<Found>>) -> Option<Found> {
    found.into_iter().flatten().fold(None, |best: Option<Found>, f| match best {
        Some(b) if b.rank() >= f.rank() => Some(b),
        _ => Some(f),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(node: u32, blocks: usize, clock: u64, legacy: bool) -> Option<Found> {
        Some(Found { node, blocks, clock, legacy })
    }

    /// The one tie rule: the longer; at equal length the new chain's over 0.1.7's; then the
    /// newer; the first of equals.
    #[test]
    fn the_longer_wins_then_the_new_chain_then_the_newer() {
        assert_eq!(settle([at(1, 3, 9, false), at(2, 4, 1, false)]), at(2, 4, 1, false), "longer");
        assert_eq!(settle([at(1, 4, 1, false), at(2, 4, 9, false)]), at(2, 4, 9, false), "newer at equal length");
        let own = at(3, 4, OWN_CLOCKS, false);
        assert_eq!(settle([at(1, 4, 9, false), own]), own, "a head's own event over a committed write");
        assert_eq!(settle([at(1, 4, 1, false), at(2, 4, 9, true)]), at(1, 4, 1, false), "0.1.7's lose a tie");
        assert_eq!(settle([at(1, 4, 9, true), at(2, 5, 1, true)]), at(2, 5, 1, true), "and win by length");
        assert_eq!(settle([at(1, 4, 9, false), at(2, 4, 9, false)]), at(1, 4, 9, false), "the first of equals");
        assert_eq!(settle([None, at(2, 1, 1, true), None]), at(2, 1, 1, true));
        assert_eq!(settle([None, None]), None);
    }
}
