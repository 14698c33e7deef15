//! The answers: `warmest` and `warm_nodes` over a front (the decided state, the memtable, the
//! committed view, and a sharing head's own events first), for a `Warm`, a `SharedWarm` and a
//! read-only `Reader` alike.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use super::front::Front;
use super::layer::{Found, Layers, OWN_NODES, settle};
use super::lookup;
use super::others::OthersCache;
use super::view_read::{Part, ViewRead};
use super::warm::Hit;
use crate::decided::engines::{Medium, Reused};
use crate::error::{Error, Result};
use crate::keys::{BLOCK_TOKENS, MIN_BLOCKS, Namespace, Prefix, Scheme, fine_keys, legacy_chain};

/// The prefix of `tokens` in `namespace` for a file of `scheme`, with the 0.1.7 chain while the
/// file holds 0.1.7's entries (`legacy`), and its fine keys at each of `sizes` (the hybrid
/// engines' block sizes), one per whole engine block.
pub(crate) fn prefix(scheme: Scheme, legacy: bool, sizes: &[usize], namespace: &Namespace, tokens: &[u32]) -> Prefix {
    let mut prefix = Prefix::in_scheme(scheme, namespace, tokens);
    if legacy && !namespace.has_tenant() && tokens.len() >= BLOCK_TOKENS {
        prefix.legacy = legacy_chain(namespace.model(), tokens);
    }
    prefix.fine = sizes
        .iter()
        .filter(|&&size| size > 0)
        .map(|&size| (size, fine_keys(namespace.key(), &prefix.blocks, tokens, size, tokens.len() / size)))
        .collect();
    prefix
}

/// A prefix must be hashed in the file's scheme: another scheme's keys would never match.
///
/// # Errors
/// [`Error::ForeignPrefix`].
pub(crate) fn same_scheme(scheme: Scheme, prefix: &Prefix) -> Result<()> {
    if prefix.scheme == scheme || prefix.blocks.is_empty() {
        return Ok(());
    }
    Err(Error::ForeignPrefix { prefix: prefix.scheme.name(), file: scheme.name() })
}

/// Answers `answer` about `prefix` from the callers' side (`front`, under its lock) and the
/// committed view's part, read with no lock held: the lock is taken to see which view is the
/// callers', released while that view is read, and taken again to answer. If the view was
/// replaced in between, or the answer needs the whole view and had less (`answer` gives
/// `None`), it reads again. `whole`: whether it needs the whole view (`warm_nodes`).
///
/// # Errors
/// [`Error::Poisoned`]; [`Error::Storage`] if a read of the file fails.
pub(crate) fn answer_with<T>(
    front: &Mutex<Front>,
    others: &Mutex<OthersCache>,
    prefix: &Prefix,
    whole: bool,
    mut answer: impl FnMut(&Front, &ViewRead) -> Option<T>,
) -> Result<T> {
    let mut whole = whole;
    loop {
        let read = view_read(front, others, prefix, whole)?;
        let mut locked = front.lock().map_err(|_| Error::Poisoned)?;
        if !read.fits(&locked) {
            continue;
        }
        locked.expire_claims();
        #[cfg(test)]
        let _held = super::view_read::probe::held();
        if let Some(out) = answer(&locked, &read) {
            locked.keep_read(read);
            return Ok(out);
        }
        whole = true;
    }
}

/// The committed view's part of an answer about `prefix` (the whole view, if `whole`): the
/// last one read, if it is of the same view and prompt, else read from the callers' view with
/// no lock held.
///
/// # Errors
/// [`Error::Poisoned`]; [`Error::Storage`] if a read of the file fails.
pub(crate) fn view_read(
    front: &Mutex<Front>,
    others: &Mutex<OthersCache>,
    prefix: &Prefix,
    whole: bool,
) -> Result<Arc<ViewRead>> {
    let (view, floor, from, last, keeps_others) = {
        let front = front.lock().map_err(|_| Error::Poisoned)?;
        #[cfg(test)]
        let _held = super::view_read::probe::held();
        let last = front.last_read(prefix, whole);
        // Past the memtable's remembered prefix (in memory: found under the lock).
        let from = match whole || last.is_some() {
            true => 0,
            false => lookup::search(&prefix.blocks, |k| Ok::<_, Infallible>(lookup::in_memtable(&front, k)))
                .unwrap_or(None)
                .map_or(0, |(_, n)| n),
        };
        (Arc::clone(front.view()), front.decided.horizon.floor, from, last, front.nodes_per_prefix > 1)
    };
    if let Some(last) = last {
        return Ok(last);
    }
    let part = match whole {
        true => Part::Whole(Some(others).filter(|_| keeps_others)),
        false => Part::From(from),
    };
    ViewRead::read(&view, floor, prefix, part).map(Arc::new)
}

/// [`ReadIndex::warmest_prefix`] over the layers (a sharing head's own events not yet back from
/// the stream, the memtable's batches) and the committed view (`read`, its part read with no
/// lock held): one read path. `None` if it needs the whole view and `read` is less.
pub(crate) fn warmest(front: &Front, layers: &Layers, prefix: &Prefix, read: &ViewRead) -> Option<Option<Hit>> {
    if prefix.blocks.len() < MIN_BLOCKS && prefix.legacy.len() < MIN_BLOCKS {
        return Some(None);
    }
    // The last block's node was forgotten, or its cache no longer holds it: the next node
    // that ran the most of the prompt.
    let claimed = match lookup::longest(front, layers, &prefix.blocks, read) {
        Some(f) if !lookup::answered(front, layers, f.node, f.clock) => {
            lookup::warm_nodes(front, layers, &prefix.blocks, read)?.first().copied()
        }
        found => found,
    };
    // What the engines hold, by their events; 0.1.7's imported entries (none without a chain).
    let legacy = lookup::legacy_walk(front, &prefix.legacy, read);
    let hybrid = lookup::hybrid_reuses(front, prefix);
    let found = settle([claimed, lookup::engine_search(front, prefix, &hybrid), legacy]);
    Some(found.filter(|f| f.blocks >= MIN_BLOCKS).map(|f| hit(front, layers, f.node, prefix, f.blocks, &hybrid)))
}

/// Node `node`'s hit of the first `blocks` blocks of `prefix`, with the tiers its engine keeps
/// them in (a hybrid engine's, from `hybrid`: its GPU hit, and what its offloading connector
/// loads past it).
fn hit(front: &Front, layers: &Layers, node: u32, prefix: &Prefix, blocks: usize, hybrid: &[(u32, Reused)]) -> Hit {
    let (tier, gpu) = match hybrid.iter().find(|(n, _)| *n == node).map(|(_, r)| r) {
        Some(reused) => {
            let gpu = (reused.gpu_tokens / BLOCK_TOKENS).min(blocks);
            (if gpu < blocks { Medium::Cpu } else { Medium::Gpu }, gpu)
        }
        None => lookup::engine_tiers(front, &prefix.blocks, node, blocks),
    };
    Hit { node: node_name(front, layers, node), tokens: blocks * BLOCK_TOKENS, tier, gpu_tokens: gpu * BLOCK_TOKENS }
}

/// [`ReadIndex::warm_nodes_prefix`] over the layers and the committed view, as [`warmest`].
/// `None` if `read` is not the whole view.
pub(crate) fn warm_nodes(front: &Front, layers: &Layers, prefix: &Prefix, read: &ViewRead) -> Option<Vec<Hit>> {
    let mut found: Vec<Found> = lookup::warm_nodes(front, layers, &prefix.blocks, read)?;
    // What each engine holds, by its events, and 0.1.7's imported entries: each node once, at
    // what wins by the tie rule.
    let legacy = lookup::legacy_walk(front, &prefix.legacy, read);
    let hybrid = lookup::hybrid_reuses(front, prefix);
    for other in lookup::engine_depths(front, prefix, &hybrid).into_iter().chain(legacy) {
        match found.iter_mut().find(|d| d.node == other.node) {
            Some(d) => *d = settle([Some(*d), Some(other)]).unwrap_or(*d),
            None => found.push(other),
        }
    }
    found.sort_by_key(|d| std::cmp::Reverse(d.rank()));
    // Longest first, ties newest first: a node named twice (a file's incarnation and a layer's
    // write of the same name) is listed once, where it comes first.
    let mut hits: Vec<Hit> = Vec::with_capacity(found.len());
    for d in found.into_iter().filter(|d| d.blocks >= MIN_BLOCKS) {
        let hit = hit(front, layers, d.node, prefix, d.blocks, &hybrid);
        if !hits.iter().any(|h| h.node == hit.node) {
            hits.push(hit);
        }
    }
    Some(hits)
}

/// The name of node `node`: the file's, or a layer's for its own nodes.
fn node_name(front: &Front, layers: &Layers, node: u32) -> String {
    match (node >= OWN_NODES).then(|| layers.name(node)).flatten() {
        Some(name) => name.to_string(),
        None => front.decided.nodes.name(node),
    }
}
