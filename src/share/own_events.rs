//! A head's own events that the stream has not yet brought back: answered at once
//! (read-your-writes) as the newest memtable of the one read path (`index/pending.rs`), and
//! taken back when the head applies them from the stream (or drops them). Their writes are kept
//! in the memtable's own map type, by this head's own numbering of node names.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::index::layer::{Layer, OWN_CLOCKS, OWN_NODES, several};
use crate::index::memtable::Map;
use crate::keys::BlockKey;

/// One own event not yet applied.
enum Own {
    Ran { local: u64, keys: Arc<[BlockKey]>, node: u32 },
    Forget { local: u64 },
}

impl Own {
    fn local(&self) -> u64 {
        match self {
            Own::Ran { local, .. } | Own::Forget { local } => *local,
        }
    }
}

/// The head's own unapplied events.
#[derive(Default)]
pub(crate) struct OwnEvents {
    events: VecDeque<Own>,
    /// The unapplied own `ran`s' writes: node [`OWN_NODES`] + its index in `names`, clock
    /// [`OWN_CLOCKS`] + the event's local number.
    writes: Map,
    names: Vec<Arc<str>>,
    ids: HashMap<Arc<str>, u32>,
    /// Unapplied own forgets: (local number, node).
    forgets: Vec<(u64, Arc<str>)>,
}

impl OwnEvents {
    pub(crate) fn ran(&mut self, local: u64, keys: Arc<[BlockKey]>, node: &str) {
        let node = self.id(node);
        self.writes.put(&keys, node, OWN_CLOCKS + local, true);
        self.events.push_back(Own::Ran { local, keys, node });
    }

    pub(crate) fn forget(&mut self, local: u64, node: &str) {
        self.forgets.push((local, Arc::from(node)));
        self.events.push_back(Own::Forget { local });
    }

    /// Event `local` was applied from the stream, or dropped: it no longer answers here.
    /// Usually the oldest; when not (an event dropped from a full buffer while older ones wait
    /// to be applied), the same node's older events, which its write had folded in, are
    /// written back.
    pub(crate) fn settle(&mut self, local: u64) {
        let Some(i) = self.events.iter().position(|e| e.local() == local) else { return };
        match self.events.remove(i) {
            Some(Own::Ran { keys, node, .. }) => {
                self.writes.remove(&keys, node, OWN_CLOCKS + local);
                for older in self.events.iter().take(i) {
                    if let Own::Ran { local: l, keys, node: n } = older
                        && *n == node
                    {
                        self.writes.restore(keys, node, OWN_CLOCKS + l);
                    }
                }
            }
            Some(Own::Forget { .. }) => self.forgets.retain(|&(l, _)| l != local),
            None => {}
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    /// Its node number for `name`.
    fn id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.ids.get(name) {
            return id;
        }
        let id = OWN_NODES.saturating_add(u32::try_from(self.names.len()).unwrap_or(u32::MAX));
        let name: Arc<str> = Arc::from(name);
        self.names.push(Arc::clone(&name));
        self.ids.insert(name, id);
        id
    }

    /// Whether a write by `node` at `clock` is hidden by a later own forget of it.
    fn hidden(&self, (node, clock): (u32, u64)) -> bool {
        let Some(name) = self.name(node) else { return false };
        self.forgets.iter().any(|(f, n)| OWN_CLOCKS + *f > clock && &**n == name)
    }
}

impl OwnEvents {
    /// What these events answer for `keys` (a prompt's), copied out so that the prompt is
    /// answered with the lock of the events released: the file is never read under it.
    pub(crate) fn view_of(&self, keys: &[BlockKey]) -> OwnView {
        let mut view = OwnView {
            keys: HashMap::new(),
            forgets: self.forgets.iter().map(|(_, n)| Arc::clone(n)).collect(),
            names: self.names.clone(),
        };
        for key in keys {
            let Some(newest) = self.newest(key) else { continue };
            let mut writes = Vec::new();
            self.writes(key, &mut writes);
            view.keys.insert(*key, (newest, writes));
        }
        view
    }
}

/// A write: its node and clock.
type Write = (u32, u64);

/// A head's own unapplied events as they answer one prompt's keys ([`OwnEvents::view_of`]).
pub(crate) struct OwnView {
    /// Per key: the newest write still answered, and every write still answered if more than
    /// one (else none).
    keys: HashMap<BlockKey, (Write, Vec<Write>)>,
    forgets: Vec<Arc<str>>,
    names: Vec<Arc<str>>,
}

impl Layer for OwnView {
    fn newest(&self, key: &BlockKey) -> Option<(u32, u64)> {
        self.keys.get(key).map(|(newest, _)| *newest)
    }

    fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) -> bool {
        let Some((_, writes)) = self.keys.get(key) else { return false };
        several(into, writes.iter().copied())
    }

    fn forgets(&self, name: &str) -> bool {
        self.forgets.iter().any(|n| &**n == name)
    }

    fn name(&self, node: u32) -> Option<&str> {
        self.names.get(node.checked_sub(OWN_NODES)? as usize).map(|n| n.as_ref())
    }
}

impl Layer for OwnEvents {
    fn newest(&self, key: &BlockKey) -> Option<(u32, u64)> {
        let newest = self.writes.newest(key)?;
        if self.forgets.is_empty() {
            return Some(newest);
        }
        // The newest write still answered: each node's newest write is there once.
        std::iter::once(newest)
            .chain(self.writes.earlier(key).iter().copied())
            .filter(|&w| !self.hidden(w))
            .max_by_key(|w| w.1)
    }

    fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) -> bool {
        let earlier = self.writes.earlier(key);
        if earlier.is_empty() {
            return false;
        }
        let Some(newest) = self.writes.newest(key) else { return false };
        several(into, std::iter::once(newest).chain(earlier.iter().copied()).filter(|&w| !self.hidden(w)))
    }

    fn forgets(&self, name: &str) -> bool {
        self.forgets.iter().any(|(_, n)| &**n == name)
    }

    fn name(&self, node: u32) -> Option<&str> {
        self.names.get(node.checked_sub(OWN_NODES)? as usize).map(|n| n.as_ref())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn keys(n: u8) -> Arc<[BlockKey]> {
        (0..n).map(|i| [i; 16]).collect()
    }

    /// The longest prefix the answered writes cover, and the node of its last block, as the
    /// read path's search finds it.
    fn longest(p: &OwnEvents, chain: &[BlockKey]) -> Option<(usize, String)> {
        let held = chain.partition_point(|k| p.newest(k).is_some());
        let (node, _) = p.newest(chain.get(held.checked_sub(1)?)?)?;
        Some((held, p.name(node)?.to_string()))
    }

    #[test]
    fn own_runs_answer_until_settled_and_a_forget_hides_only_what_came_before() {
        let mut p = OwnEvents::default();
        p.ran(1, keys(6), "a");
        p.ran(2, keys(3), "b");
        assert_eq!(longest(&p, &keys(9)), Some((6, "a".into())));
        assert_eq!(longest(&p, &keys(2)), Some((2, "b".into())));
        let mut writes = Vec::new();
        assert!(p.writes(&keys(1)[0], &mut writes), "a and b wrote block 0");
        let mut names: Vec<&str> = writes.iter().filter_map(|&(n, _)| p.name(n)).collect();
        names.sort_unstable();
        assert_eq!(names, ["a", "b"]);
        p.forget(3, "a");
        assert!(p.forgets("a") && !p.forgets("b"));
        assert_eq!(longest(&p, &keys(9)), Some((3, "b".into())), "a's run is hidden");
        p.ran(4, keys(5), "a");
        assert_eq!(longest(&p, &keys(9)), Some((5, "a".into())), "a's new incarnation answers");
        // Settled in stream order.
        p.settle(1);
        assert_eq!(longest(&p, &keys(9)), Some((5, "a".into())));
        p.settle(2);
        p.settle(3);
        assert!(!p.forgets("a"));
        assert_eq!(longest(&p, &keys(9)), Some((5, "a".into())));
        p.settle(4);
        assert_eq!(longest(&p, &keys(9)), None);
        assert!(p.is_empty() && p.writes.is_empty() && p.forgets.is_empty());
    }

    /// An event dropped from a full buffer is settled while older ones still wait: the older
    /// writes of the same node, folded into it, answer again.
    #[test]
    fn an_event_settled_before_older_ones_leaves_them_answered() {
        let mut p = OwnEvents::default();
        p.ran(1, keys(4), "a");
        p.ran(2, keys(2), "b");
        p.ran(3, keys(8), "a");
        assert_eq!(longest(&p, &keys(9)), Some((8, "a".into())));
        p.settle(3);
        assert_eq!(longest(&p, &keys(9)), Some((4, "a".into())), "event 1 answers again");
        assert_eq!(longest(&p, &keys(2)), Some((2, "b".into())), "b's event is newer on its blocks");
        p.settle(2);
        assert_eq!(longest(&p, &keys(2)), Some((2, "a".into())));
        p.settle(1);
        assert_eq!(longest(&p, &keys(9)), None);
        assert!(p.writes.is_empty());
    }
}
