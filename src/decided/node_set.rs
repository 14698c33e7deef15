//! The node-set rule: which nodes a block keeps, of every write that named it. One rule, used
//! where a change is persisted (the writer stores its result: the newest node as the block's,
//! the rest as its others) and by every answer (which takes it of everything it sees: the
//! memtable's writes, a sharing head's own, the committed rows), so both name the same nodes
//! whatever order the writes came in.

use std::collections::BTreeSet;

/// The nodes a block keeps, of every (node, clock) that named it (`named`, in any order): those
/// whose clock `live` still holds, each node once with its newest clock, the `k` newest, newest
/// first (ties by node id).
pub(crate) fn keep(named: &mut Vec<(u32, u64)>, live: impl Fn(u64) -> bool, k: usize) {
    named.retain(|&(_, clock)| live(clock));
    newest_members(named, k);
}

/// A block's nodes after a write.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Rewrite {
    /// Its others: the nodes it keeps, less the write's own (newest first).
    pub others: Vec<(u32, u64)>,
    /// Nodes it named before and names no more.
    pub gone: Vec<u32>,
    /// Nodes it names now and did not before.
    pub added: Vec<u32>,
}

/// Whether a write of node `new` leaves a block's others as they are: the same node again
/// (`old`, the block's node before), with no earlier writer in the batch. The usual turn: its
/// others never include its own node, and one that aged out stays listed until a write changes
/// them (every reader drops it by [`keep`]), so the row is not even read.
pub(crate) fn leaves_others(old: Option<u32>, new: u32, earlier: &[(u32, u64)]) -> bool {
    earlier.is_empty() && old == Some(new)
}

/// Whether a write names only its own node: a new key (`replaced`: there was an entry before)
/// with no earlier writer in the batch (its rewrite of nothing adds the write's node alone).
pub(crate) fn names_only_its_own(replaced: bool, earlier: &[(u32, u64)]) -> bool {
    !replaced && earlier.is_empty()
}

/// What a block keeps after write `new` (node, clock) replaced its entry `old` (`None`: a new
/// key): of its others before (`before`), `old`, the batch's earlier writers of it (`earlier`)
/// and `new`, the nodes [`keep`] keeps; `new`'s node is the block's own, the rest its others.
/// Which nodes a block names is the same whatever order the writes came in.
pub(crate) fn rewrite(
    before: &[(u32, u64)],
    old: Option<(u32, u64)>,
    new: (u32, u64),
    earlier: &[(u32, u64)],
    live: impl Fn(u64) -> bool,
    k: usize,
) -> Rewrite {
    let mut others: Vec<(u32, u64)> = before.to_vec();
    others.push(new);
    others.extend(old);
    others.extend_from_slice(earlier);
    keep(&mut others, live, k);
    others.retain(|&(node, _)| node != new.0);
    let named_before: BTreeSet<u32> = before.iter().map(|m| m.0).chain(old.map(|o| o.0)).collect();
    let named_after: BTreeSet<u32> = others.iter().map(|m| m.0).chain([new.0]).collect();
    Rewrite {
        gone: named_before.difference(&named_after).copied().collect(),
        added: named_after.difference(&named_before).copied().collect(),
        others,
    }
}

/// Keeps the `k` newest of `members` (node id, clock): each node once, with its newest clock,
/// newest first (ties by node id). What a block names, whatever order its writes came in: the
/// writer stores it, and readers take it of everything they see.
fn newest_members(members: &mut Vec<(u32, u64)>, k: usize) {
    if members.first().is_none_or(|first| members.iter().all(|m| m.0 == first.0)) {
        // One node (the usual block): its newest write.
        if let Some(newest) = members.iter().copied().max_by_key(|m| m.1) {
            members.clear();
            members.push(newest);
        }
    } else {
        members.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        members.dedup_by_key(|m| m.0);
        members.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    }
    members.truncate(k);
}

/// Adds `member` to `list`, which holds each node once with its newest clock.
pub(crate) fn add_member(list: &mut Vec<(u32, u64)>, (node, clock): (u32, u64)) {
    match list.iter_mut().find(|m| m.0 == node) {
        Some(m) => m.1 = m.1.max(clock),
        None => list.push((node, clock)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_names_each_node_once_with_its_newest_clock_whatever_the_order() {
        let writes = [(3, 5), (1, 9), (3, 7), (2, 2), (1, 4), (4, 8)];
        for rotation in 0..writes.len() {
            let mut all: Vec<(u32, u64)> = writes.iter().cycle().skip(rotation).take(writes.len()).copied().collect();
            keep(&mut all, |_| true, 3);
            assert_eq!(all, vec![(1, 9), (4, 8), (3, 7)], "rotation {rotation}");
            let mut listed = Vec::new();
            for &w in writes.iter().cycle().skip(rotation).take(writes.len()) {
                add_member(&mut listed, w);
            }
            listed.sort_unstable();
            assert_eq!(listed, vec![(1, 9), (2, 2), (3, 7), (4, 8)]);
        }
        let mut one = vec![(5, 1), (5, 3), (5, 2)];
        keep(&mut one, |_| true, 4);
        assert_eq!(one, vec![(5, 3)]);
        let mut none: Vec<(u32, u64)> = Vec::new();
        keep(&mut none, |_| true, 4);
        assert!(none.is_empty());
        let mut aged = vec![(1, 9), (2, 3), (3, 5), (2, 6)];
        // A write by node 7 of a block named by 1 (its own) and 2, 3 (others), 3 aged out.
        let live = |clock| clock > 4;
        let after = rewrite(&[(2, 6), (3, 4)], Some((1, 8)), (7, 10), &[(5, 9)], live, 3);
        assert_eq!(after.others, vec![(5, 9), (1, 8)], "the k newest live, less its own node");
        assert_eq!((after.gone, after.added), (vec![2, 3], vec![5, 7]));
        let same = rewrite(&[(2, 6)], Some((1, 8)), (1, 10), &[], live, 3);
        assert_eq!(same, Rewrite { others: vec![(2, 6)], gone: vec![], added: vec![] });
        assert!(leaves_others(Some(1), 1, &[]) && !leaves_others(Some(1), 1, &[(2, 3)]));
        assert!(!leaves_others(None, 1, &[]) && !leaves_others(Some(2), 1, &[]));
        let fresh = rewrite(&[], None, (3, 4), &[], live, 3);
        assert!(names_only_its_own(false, &[]) && (fresh.others.is_empty(), fresh.added) == (true, vec![3]));
        assert!(!names_only_its_own(true, &[]) && !names_only_its_own(false, &[(1, 2)]));
        keep(&mut aged, |clock| clock > 5, 4);
        assert_eq!(aged, vec![(1, 9), (2, 6)], "a node's evicted writes are not kept, its newer ones are");
    }
}
