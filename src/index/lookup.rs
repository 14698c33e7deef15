//! `warmest`'s search: the longest remembered prefix of a chain, over the memtable of uncommitted
//! `ran`s and the last commit.
//!
//! Every `ran` writes all the blocks of its prompt at one clock, and eviction removes whole clock
//! ranges oldest first, so a block's ancestors are never older than it and never evicted before
//! it: along a chain, the remembered blocks are always a prefix (ARCHITECTURE.md, invariant 3).
//! The longest remembered prefix is therefore found by binary search, in about log2(blocks)
//! reads instead of one per block, after one of the first block (a prompt most nodes do not
//! hold is answered in that one). 0.1.7's imported entries promise no such thing, so their
//! chain is walked block by block as 0.1.7 did.

// The hot path of every answer: each index below comes from a search bounded by the chain's
// length (or a run found inside it), so bounds checks that cannot fail stay out of it.
#![allow(clippy::indexing_slicing)]

use std::convert::Infallible;

use super::front::Front;
use super::layer::{Found, Layers, OWN_NODES, settle};
use super::view_read::ViewRead;
use crate::decided::engines::{Medium, Reused};
use crate::decided::node_set::keep;
use crate::error::Result;
use crate::keys::{BLOCK_TOKENS, BlockKey, Prefix};

/// The longest prefix of `keys` some engine holds (by its KV events), with the newest of the
/// nodes holding its last block. Each node's held blocks are prefix-closed (an engine block is
/// held only when its whole chain is), so their union is too, and a binary search finds it.
/// `hybrid`: what each hybrid engine reuses of it ([`hybrid_reuses`]).
pub(crate) fn engine_search(front: &Front, prefix: &Prefix, hybrid: &[(u32, Reused)]) -> Option<Found> {
    let engines = &front.decided.engines;
    if !engines.any() {
        return None;
    }
    let held = found(search(&prefix.blocks, |k| Ok::<_, Infallible>(engines.holders(k))).unwrap_or(None), false);
    settle([held].into_iter().chain(hybrid_found(hybrid).map(Some)))
}

/// What each hybrid engine reuses of `prefix` (its events per KV cache group, by vLLM's rule),
/// worked out once for an answer.
pub(crate) fn hybrid_reuses(front: &Front, prefix: &Prefix) -> Vec<(u32, Reused)> {
    match prefix.fine.is_empty() {
        true => Vec::new(),
        false => front.decided.engines.hybrid_depths(&prefix.fine, prefix.len),
    }
}

/// The hybrid engines that reuse a block of ours or more, as answers (their hits rounded down
/// to our blocks).
fn hybrid_found(hybrid: &[(u32, Reused)]) -> impl Iterator<Item = Found> + '_ {
    hybrid
        .iter()
        .map(|&(node, r)| Found { node, blocks: r.tokens / BLOCK_TOKENS, clock: r.clock, legacy: false })
        .filter(|f| f.blocks > 0)
}

/// A search's answer as a [`Found`].
pub(crate) fn found(longest: Longest<(u32, u64)>, legacy: bool) -> Option<Found> {
    longest.map(|((node, clock), blocks)| Found { node, blocks, clock, legacy })
}

/// How much of `keys` each node with an engine stream holds, by its events (nodes holding none
/// left out); `hybrid` as [`engine_search`]'s.
pub(crate) fn engine_depths(front: &Front, prefix: &Prefix, hybrid: &[(u32, Reused)]) -> Vec<Found> {
    let engines = &front.decided.engines;
    engines
        .nodes()
        .filter_map(|node| {
            let found = search(&prefix.blocks, |k| Ok::<_, Infallible>(engines.held_by(k, node))).unwrap_or(None);
            found.map(|(clock, blocks)| Found { node, blocks, clock, legacy: false })
        })
        .chain(hybrid_found(hybrid))
        .collect()
}

/// The tier node `node` keeps the first `blocks` blocks of `keys` in, by its engine's events,
/// and how many of them from the start are in GPU memory: ([`Medium::Gpu`], `blocks`) for a node
/// without a stream, or a depth its engine does not hold (a claim: a `ran` just placed there).
pub(crate) fn engine_tiers(front: &Front, keys: &[BlockKey], node: u32, blocks: usize) -> (Medium, usize) {
    let engines = &front.decided.engines;
    let Some(tier) = keys.get(..blocks).and_then(<[BlockKey]>::last).and_then(|k| engines.tier(k, node)) else {
        return (Medium::Gpu, blocks);
    };
    if tier == 0 {
        return (Medium::Gpu, blocks);
    }
    let on_gpu = keys.get(..blocks).unwrap_or_default();
    let gpu = search(on_gpu, |k| Ok::<_, Infallible>(engines.held_on_gpu(k, node))).unwrap_or(None);
    (Medium::of_tier(tier), gpu.map_or(0, |(_, n)| n))
}

/// The longest remembered prefix: who ran its last block, and its length in blocks.
pub(crate) type Longest<T> = Option<(T, usize)>;

/// Who ran `key` last (node id), and when, by the memtable alone: nothing if that is at or
/// below the callers' eviction floor (evicted, whether the commit thread has removed it yet or
/// not). A forgotten node's entries are still found: they count for eviction until they go.
pub(crate) fn in_memtable(front: &Front, key: &BlockKey) -> Option<(u32, u64)> {
    front.memtable().get(key).filter(|&(_, clock)| front.holds(clock))
}

/// The longest remembered prefix of `keys`, over the layers (a sharing head's own events not yet
/// back from the stream, the memtable's batches) and the committed view (`read`, its part): who
/// ran its last block (the newest layer that has it), and its length. Each layer's remembered
/// blocks are a prefix of the chain, so their union's is the longest of them.
pub(crate) fn longest(front: &Front, layers: &Layers, keys: &[BlockKey], read: &ViewRead) -> Option<Found> {
    let above = layers.iter().map(|l| found(search(keys, |k| Ok::<_, Infallible>(l.newest(k))).unwrap_or(None), false));
    settle(above.chain([found(read.longest(front), false)]))
}

/// The remembered prefix of `keys` (the memtable's and the committed view's, `read`) as runs
/// of equal clocks, `((node, clock), blocks)` from the first block on: the memtable's runs, then
/// the view's past them (clocks never increase along a chain).
pub(crate) fn remembered_runs(front: &Front, keys: &[BlockKey], read: &ViewRead) -> Vec<((u32, u64), u64)> {
    let probe = |k: &BlockKey| Ok::<_, Infallible>(in_memtable(front, k));
    let found = search(keys, probe).unwrap_or(None);
    let mut all = runs(keys, found, probe, |&(_, c)| c).unwrap_or_default();
    let mut at = found.map_or(0, |(_, n)| n as u64);
    let mut start = read.from() as u64;
    for (owner, n) in read.runs(front) {
        let end = start + n;
        if end > at {
            let n = end - at.max(start);
            match all.last_mut() {
                Some((last, blocks)) if last.1 == owner.1 => *blocks += n,
                _ => all.push((owner, n)),
            }
            at = end;
        }
        start = end;
    }
    all
}

/// The longest prefix of 0.1.7's chain `keys` that is remembered (by the memtable, else by the
/// view's entries as `read` has them), walked block by block as 0.1.7 did: its entries promise
/// no prefix. A forgotten node's entries are not answered (0.1.7's imported entries are not
/// counted in a node's cache, so its floor does not apply to them).
pub(crate) fn legacy_walk(front: &Front, keys: &[BlockKey], read: &ViewRead) -> Option<Found> {
    let mut at = 0;
    let found = walk(keys, |key| {
        let stored = front.memtable().get(key).or_else(|| read.legacy(at));
        at += 1;
        Ok::<_, Infallible>(stored.filter(|&(node, clock)| front.holds(clock) && !front.decided.nodes.is_retired(node)))
    });
    self::found(found.unwrap_or(None), true)
}

/// Whether `node`'s pair of `clock` is answered: not forgotten (here, or by a layer), and still
/// in its cache. A layer's own nodes' writes are answered (those it no longer answers it does
/// not give).
pub(crate) fn answered(front: &Front, layers: &Layers, node: u32, clock: u64) -> bool {
    if node >= OWN_NODES {
        return true;
    }
    let forgotten = || front.decided.nodes.name_of(node).is_some_and(|name| layers.forgets(name));
    front.decided.answered(node, clock) && !forgotten()
}

/// The blocks of `keys` node `node` holds in its cache, by the clock it last ran them at: runs
/// `(clock, blocks)` from the first block on (`runs_by_writer`: the chain's runs as [`probe`]
/// gives them). Where the newest writer of every remembered block is `node` (a conversation's
/// next turn on the same node), those are its runs. Otherwise they are read from what each
/// block names; a block that no longer names the node (dropped past `nodes_per_prefix`) is
/// counted as new, its old count left where it is (the cache then looks fuller than it is: it
/// evicts early, never late). A node without an id yet holds nothing.
///
/// `None` if `read` is not the whole view this needs (read it again whole).
pub(crate) fn node_runs(
    front: &Front,
    node: Option<u32>,
    keys: &[BlockKey],
    runs_by_writer: &[((u32, u64), u64)],
    read: &ViewRead,
) -> Option<Vec<(u64, u64)>> {
    let Some(node) = node else { return Some(Vec::new()) };
    let floor = front.decided.caches.floor(node);
    if runs_by_writer.iter().all(|&((n, _), _)| n == node) {
        return Some(runs_by_writer.iter().map(|&((_, c), k)| (c, k)).filter(|&(c, _)| c > floor).collect());
    }
    // (blocks, the node's clock on them) per stretch, deepest first.
    let mut start = 0;
    let mut per: Vec<(u64, Option<u64>)> = Vec::new();
    for (i, named) in stretches(front, &Layers::new(front, None), keys, read)? {
        let clock = named.iter().find(|m| m.0 == node).map(|m| m.1).filter(|&c| c > floor);
        per.push(((i + 1 - start) as u64, clock));
        start = i + 1;
    }
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (blocks, clock) in per.into_iter().filter_map(|(b, c)| c.map(|c| (b, c))) {
        match runs.last_mut() {
            Some(last) if last.0 == clock => last.1 += blocks,
            _ => runs.push((clock, blocks)),
        }
    }
    Some(runs)
}

/// Every remembered node that ran a prefix of `keys` (a prefix-closed chain), each with the
/// deepest block it is named on, longest first, ties newest first. A block names the node of the
/// prefix table and its others, pending or committed: each node once, with its newest clock,
/// those above the floor, the `nodes_per_prefix` newest; then forgotten nodes, and nodes whose cache
/// no longer holds the block, are left out. `None` if `read` is not the whole view.
pub(crate) fn warm_nodes(front: &Front, layers: &Layers, keys: &[BlockKey], read: &ViewRead) -> Option<Vec<Found>> {
    let stretches = stretches(front, layers, keys, read)?;
    let mut deepest: Vec<Found> = Vec::new();
    for (i, named) in stretches {
        for &(node, clock) in named.iter().filter(|&&(node, clock)| answered(front, layers, node, clock)) {
            let at = Found { node, blocks: i + 1, clock, legacy: false };
            match deepest.iter_mut().find(|d| d.node == node) {
                Some(d) => *d = at,
                None => deepest.push(at),
            }
        }
    }
    deepest.sort_unstable_by_key(|d| std::cmp::Reverse(d.rank()));
    Some(deepest)
}

/// The last block of a stretch, and the nodes (id, clock) each block of it names.
type Stretch = (usize, Vec<(u32, u64)>);

/// The remembered prefix of `keys` as stretches of blocks that name the same nodes: `(i, named)`
/// for the last block `i` of each, in order, with what each block of it names (each node once
/// with its newest clock, those above the floor, the `nodes_per_prefix` newest; forgotten
/// nodes and caches not filtered yet). `None` if `read` is not the whole view.
fn stretches(front: &Front, layers: &Layers, keys: &[BlockKey], read: &ViewRead) -> Option<Vec<Stretch>> {
    let Some(Found { blocks: len, .. }) = longest(front, layers, keys, read) else { return Some(Vec::new()) };
    if !read.is_whole() {
        return None;
    }
    let keys = &keys[..len];
    // Each source's node of each block, from its runs of equal clocks (one `ran` each, so one
    // node): the last commit, and each layer. Where no source changes and no block has others,
    // every block names the same nodes, so only the last block of such a stretch is looked at.
    let mut looked_at: Vec<usize> = Vec::new();
    let mut sources: Vec<Vec<Option<(u32, u64)>>> = Vec::new();
    let mut committed = vec![None; len];
    let mut start = 0;
    for (owner, n) in read.runs(front) {
        let end = (start + n as usize).min(len);
        committed[start..end].fill(Some(owner));
        looked_at.push(end - 1);
        start = end;
    }
    sources.push(committed);
    // A layer's blocks with more than one write (a batch whose `ran`s moved a block between
    // nodes): each a stretch of its own, with every write.
    // (Every write in one vector, `several` naming each block's range of it: a vector a block
    // would cost an allocation a block.)
    let (mut writes, mut several) = (Vec::new(), Vec::new());
    for layer in layers.iter() {
        let newest = |k: &BlockKey| Ok::<_, Infallible>(layer.newest(k));
        let found = search(keys, newest).unwrap_or(None);
        if layer.has_earlier() {
            let asked = keys[..found.map_or(0, |(_, n)| n)].partition_point(|k| layer.may_have_several(k));
            for (i, key) in keys.iter().enumerate().take(asked) {
                let from = writes.len();
                if layer.writes(key, &mut writes) {
                    looked_at.extend([i.saturating_sub(1), i]);
                    several.push((i, from..writes.len()));
                }
            }
        }
        sources.push(by_runs(keys, found, newest, &mut looked_at));
    }
    // Neighbours with the same others (a moved conversation's blocks mostly list the same
    // nodes) are one stretch.
    looked_at.extend((1..len).filter(|&i| read.row(i) != read.row(i - 1)).map(|i| i - 1));
    looked_at.push(len - 1);
    looked_at.sort_unstable();
    looked_at.dedup();
    // Blocks with several writes in block order (each is looked at), so one pass takes them.
    several.sort_by_key(|(i, _)| *i);
    let mut several = several.into_iter().peekable();
    let mut stretches = Vec::with_capacity(looked_at.len());
    for i in looked_at {
        let mut named: Vec<(u32, u64)> = sources.iter().filter_map(|s| s[i]).collect();
        while let Some((_, range)) = several.next_if(|(at, _)| *at <= i) {
            named.extend_from_slice(&writes[range]);
        }
        if let Some(row) = read.row(i) {
            named.extend_from_slice(row);
        }
        keep(&mut named, |clock| front.holds(clock), front.nodes_per_prefix);
        stretches.push((i, named));
    }
    Some(stretches)
}

/// The (node, clock) `probe` gives each block of a prefix-closed chain whose clocks never
/// increase (`found`: what [`search`] found of it), from its runs of equal clocks (a few probes
/// a run); the last block of each run is pushed onto `ends`.
fn by_runs(
    keys: &[BlockKey],
    found: Longest<(u32, u64)>,
    probe: impl FnMut(&BlockKey) -> Result<Option<(u32, u64)>, Infallible>,
    ends: &mut Vec<usize>,
) -> Vec<Option<(u32, u64)>> {
    let mut owners = vec![None; keys.len()];
    let mut start = 0;
    for (owner, n) in runs(keys, found, probe, |&(_, c)| c).unwrap_or_default() {
        let end = start + n as usize;
        owners[start..end].fill(Some(owner));
        ends.push(end - 1);
        start = end;
    }
    owners
}

/// The remembered prefix of a prefix-closed chain (`found`: what [`search`] found of it) as runs
/// of equal clocks, `(what probe gives the run's first block, blocks)` from the first block on.
/// Clocks never increase along a chain (a `ran` writes every block before the ones it writes),
/// so each run is found by a search for its end: a few probes a run, not one a block.
pub(crate) fn runs<T: Copy, E>(
    keys: &[BlockKey],
    found: Longest<T>,
    mut probe: impl FnMut(&BlockKey) -> Result<Option<T>, E>,
    clock: impl Fn(&T) -> u64,
) -> Result<Vec<(T, u64)>, E> {
    let Some((last, len)) = found else { return Ok(Vec::new()) };
    let mut runs = Vec::new();
    let mut start = 0;
    while start < len {
        let Some(first) = probe(&keys[start])? else { break };
        if clock(&first) == clock(&last) {
            // The search ended on the last remembered block's clock: one run to the end (the
            // usual turn, which re-touches one earlier turn's blocks), with no more probes.
            runs.push((first, (len - start) as u64));
            break;
        }
        // keys[start..=lo] have `first`'s clock; keys[hi + 1..len] have an older one. Galloping
        // first: the runs before the last are usually short (a system prompt's blocks, which
        // every conversation re-touches), found in a few probes rather than log2(blocks).
        let (mut lo, mut hi) = (start, len - 1);
        let mut step = 1;
        while lo + step < hi {
            if probe(&keys[lo + step])?.is_some_and(|v| clock(&v) == clock(&first)) {
                lo += step;
                step *= 2;
            } else {
                hi = lo + step - 1;
                break;
            }
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if probe(&keys[mid])?.is_some_and(|v| clock(&v) == clock(&first)) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        runs.push((first, (lo + 1 - start) as u64));
        start = lo + 1;
    }
    Ok(runs)
}

/// The longest prefix of `keys` that `probe` remembers, by binary search: only for a chain that
/// is prefix-closed (every block before a remembered one is remembered). The first block is
/// probed first: a prompt new to a node (every node but the few that hold it) is answered in
/// one probe, not log2(blocks).
pub(crate) fn search<T, E>(
    keys: &[BlockKey],
    mut probe: impl FnMut(&BlockKey) -> Result<Option<T>, E>,
) -> Result<Longest<T>, E> {
    let Some(first) = keys.first() else { return Ok(None) };
    let Some(owner) = probe(first)? else { return Ok(None) };
    // Invariant: keys[..lo] are remembered (with `best` the owner of keys[lo - 1]); keys[hi..] are not.
    let (mut lo, mut hi, mut best) = (1, keys.len(), Some(owner));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match probe(&keys[mid - 1])? {
            Some(owner) => {
                lo = mid;
                best = Some(owner);
            }
            None => hi = mid - 1,
        }
    }
    Ok(best.map(|owner| (owner, lo)))
}

/// The longest prefix of `keys` that `probe` remembers, walking from the first block until one
/// is missing.
pub(crate) fn walk<T, E>(
    keys: &[BlockKey],
    mut probe: impl FnMut(&BlockKey) -> Result<Option<T>, E>,
) -> Result<Longest<T>, E> {
    let mut best = None;
    for (i, key) in keys.iter().enumerate() {
        match probe(key)? {
            Some(owner) => best = Some((owner, i + 1)),
            None => break,
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use std::collections::HashMap;
    use std::convert::Infallible;

    use super::*;

    fn keys(n: u8) -> Vec<BlockKey> {
        (0..n).map(|i| [i; 16]).collect()
    }

    /// A remembered prefix of every length (0 to all) of chains of every length up to 40: the
    /// search finds it, its owner is the last remembered block's, and it probes about log2 keys
    /// (one, for a chain whose first block is not remembered).
    #[test]
    fn search_finds_the_remembered_prefix_of_every_length_in_log_probes() {
        for n in 0..40u8 {
            let chain = keys(n);
            for remembered in 0..=n as usize {
                let owners: HashMap<BlockKey, usize> =
                    chain[..remembered].iter().zip(0..).map(|(k, i)| (*k, i)).collect();
                let mut probes = 0;
                let found = search(&chain, |k| {
                    probes += 1;
                    Ok::<_, Infallible>(owners.get(k).copied())
                });
                let want = remembered.checked_sub(1).map(|last| (last, remembered));
                assert_eq!(found, Ok(want), "{remembered} of {n}");
                assert!(probes <= (usize::from(n) + 1).ilog2() as usize + 2, "{probes} probes for {n} keys");
                if remembered == 0 {
                    assert_eq!(probes, usize::from(n > 0), "a chain new to the node, {n} keys");
                }
                let walked = walk(&chain, |k| Ok::<_, Infallible>(owners.get(k).copied()));
                assert_eq!(walked, Ok(want), "the walk agrees");
            }
        }
    }

    #[test]
    fn the_walk_stops_at_the_first_gap_and_the_longer_wins() {
        let chain = keys(6);
        // Blocks 0, 1 and 3 remembered: 0.1.7's entries need not be prefix-closed.
        let held = |k: &BlockKey| Ok::<_, Infallible>([0, 1, 3].contains(&k[0]).then_some(k[0]));
        assert_eq!(walk(&chain, held), Ok(Some((1, 2))));
        let failing = |_: &BlockKey| Err::<Option<u8>, &str>("disk");
        assert_eq!(search(&chain, failing), Err("disk"), "a failed probe is the search's error");
    }

    /// Chains whose clocks never increase, in runs of every shape: the runs are found whole, in
    /// a few probes each.
    #[test]
    fn runs_split_a_chain_at_every_change_of_clock() {
        let chain = keys(40);
        for shape in [vec![], vec![(9, 40)], vec![(9, 3), (5, 30)], vec![(9, 1), (8, 1), (7, 1), (2, 20)]] {
            for remembered in [0, 1, 5, 17, 40] {
                let mut clocks = Vec::new();
                for &(clock, n) in &shape {
                    clocks.extend(std::iter::repeat_n(clock, n));
                }
                clocks.truncate(remembered);
                let by_key: HashMap<BlockKey, u64> = chain.iter().copied().zip(clocks.iter().copied()).collect();
                let mut probes = 0;
                let mut clock_of = |k: &BlockKey| {
                    probes += 1;
                    Ok::<_, Infallible>(by_key.get(k).copied())
                };
                let runs = search(&chain, &mut clock_of).and_then(|found| runs(&chain, found, clock_of, |&c| c));
                let mut want: Vec<(u64, u64)> = Vec::new();
                for &c in &clocks {
                    match want.last_mut() {
                        Some((last, n)) if *last == c => *n += 1,
                        _ => want.push((c, 1)),
                    }
                }
                assert_eq!(runs, Ok(want.clone()), "{shape:?}, {remembered} remembered");
                assert!(probes <= 12 * (want.len() + 1), "{probes} probes for {} runs", want.len());
                if want.len() == 1 {
                    assert!(probes <= 8, "a single run costs the search and one probe: {probes}");
                }
            }
        }
    }
}
