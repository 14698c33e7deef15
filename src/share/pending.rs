//! A head's own events that the stream has not yet brought back: answered at once
//! (read-your-writes), dropped when the head applies them from the stream (or drops them).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::keys::BlockKey;

/// One own event not yet applied.
struct Own {
    local: u64,
    /// `None` for a forget.
    keys: Option<Arc<[BlockKey]>>,
}

/// The head's own unapplied events, by block key.
#[derive(Default)]
pub(crate) struct Pending {
    events: VecDeque<Own>,
    /// Every unapplied own `ran` that wrote the key: (local number, node), oldest first.
    by_key: HashMap<BlockKey, Vec<(u64, Arc<str>)>>,
    /// Unapplied own forgets: (local number, node).
    forgets: Vec<(u64, Arc<str>)>,
}

impl Pending {
    pub(crate) fn ran(&mut self, local: u64, keys: Arc<[BlockKey]>, node: Arc<str>) {
        for key in keys.iter() {
            self.by_key.entry(*key).or_default().push((local, Arc::clone(&node)));
        }
        self.events.push_back(Own { local, keys: Some(keys) });
    }

    pub(crate) fn forget(&mut self, local: u64, node: Arc<str>) {
        self.forgets.push((local, node));
        self.events.push_back(Own { local, keys: None });
    }

    /// Event `local` was applied from the stream, or dropped: it no longer answers here.
    pub(crate) fn settle(&mut self, local: u64) {
        let Some(i) = self.events.iter().position(|e| e.local == local) else { return };
        let Some(own) = self.events.remove(i) else { return };
        match own.keys {
            Some(keys) => {
                for key in keys.iter() {
                    if let Some(writers) = self.by_key.get_mut(key) {
                        writers.retain(|&(l, _)| l != local);
                        if writers.is_empty() {
                            self.by_key.remove(key);
                        }
                    }
                }
            }
            None => self.forgets.retain(|&(l, _)| l != local),
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    /// Nodes forgotten here whose forget is not applied yet: every answer leaves them out.
    pub(crate) fn forgotten(&self) -> Vec<Arc<str>> {
        self.forgets.iter().map(|(_, n)| Arc::clone(n)).collect()
    }

    /// Whether a write of `local` by `node` is hidden by a later own forget of it.
    fn hidden(&self, local: u64, node: &str) -> bool {
        self.forgets.iter().any(|(f, n)| *f > local && &**n == node)
    }

    /// The newest visible writer of `key`.
    fn newest(&self, key: &BlockKey) -> Option<&Arc<str>> {
        self.by_key.get(key)?.iter().rev().find(|(l, n)| !self.hidden(*l, n)).map(|(_, n)| n)
    }

    /// The longest prefix of `keys` the unapplied own `ran`s wrote, in blocks, and the node that
    /// wrote its last block last. The keys they wrote are a prefix along any chain (each `ran`
    /// writes a whole prefix), so this is a binary search.
    pub(crate) fn longest(&self, keys: &[BlockKey]) -> Option<(usize, Arc<str>)> {
        if self.by_key.is_empty() {
            return None;
        }
        let held = keys.partition_point(|k| self.newest(k).is_some());
        let node = self.newest(keys.get(held.checked_sub(1)?)?)?;
        Some((held, Arc::clone(node)))
    }

    /// Every node an unapplied own `ran` names along `keys`, with how many blocks of them.
    pub(crate) fn nodes(&self, keys: &[BlockKey]) -> Vec<(Arc<str>, usize)> {
        let mut found: Vec<(Arc<str>, usize)> = Vec::new();
        for (i, key) in keys.iter().enumerate() {
            let Some(writers) = self.by_key.get(key) else { break };
            for (_, node) in writers.iter().filter(|(l, n)| !self.hidden(*l, n)) {
                match found.iter_mut().find(|(n, _)| n == node) {
                    Some(f) => f.1 = i + 1,
                    None => found.push((Arc::clone(node), i + 1)),
                }
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn keys(n: u8) -> Arc<[BlockKey]> {
        (0..n).map(|i| [i; 16]).collect()
    }

    #[test]
    fn own_runs_answer_until_settled_and_a_forget_hides_only_what_came_before() {
        let mut p = Pending::default();
        p.ran(1, keys(6), "a".into());
        p.ran(2, keys(3), "b".into());
        assert_eq!(p.longest(&keys(9)), Some((6, "a".into())));
        assert_eq!(p.longest(&keys(2)), Some((2, "b".into())));
        let mut nodes = p.nodes(&keys(9));
        nodes.sort();
        assert_eq!(nodes, vec![("a".into(), 6), ("b".into(), 3)]);
        p.forget(3, "a".into());
        assert_eq!(p.longest(&keys(9)), Some((3, "b".into())), "a's run is hidden");
        p.ran(4, keys(5), "a".into());
        assert_eq!(p.longest(&keys(9)), Some((5, "a".into())), "a's new incarnation answers");
        // Settled out of order: the others stay.
        p.settle(2);
        assert_eq!(p.longest(&keys(9)), Some((5, "a".into())));
        p.settle(4);
        assert_eq!(p.longest(&keys(9)), None, "only a's hidden run is left");
        p.settle(3);
        assert_eq!(p.longest(&keys(9)), Some((6, "a".into())));
        p.settle(1);
        assert!(p.is_empty() && p.by_key.is_empty() && p.forgets.is_empty());
    }
}
