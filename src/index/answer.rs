//! The answers: `warmest` and `warm_nodes` over a front (the decided state, the memtable, the
//! committed view, and a sharing head's own events first), for a `Warm`, a `SharedWarm` and a
//! read-only `Reader` alike.

use super::front::Front;
use super::lookup::{self, NodeDepth};
use super::pending::{PENDING_NODES, Pending};
use super::warm::Hit;
use crate::error::{Error, Result};
use crate::keys::{BLOCK_TOKENS, BlockKey, MIN_BLOCKS, Namespace, Prefix, Scheme, legacy_chain};

/// The prefix of `tokens` in `namespace` for a file of `scheme`, with the 0.1.7 chain while the
/// file holds 0.1.7's entries (`legacy`).
pub(crate) fn prefix(scheme: Scheme, legacy: bool, namespace: &Namespace, tokens: &[u32]) -> Prefix {
    let mut prefix = Prefix::in_scheme(scheme, namespace, tokens);
    if legacy && !namespace.has_tenant() && tokens.len() >= BLOCK_TOKENS {
        prefix.legacy = legacy_chain(namespace.model(), tokens);
    }
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

/// [`ReadIndex::warmest_prefix`] over `own`'s writes first (a sharing head's own events not
/// yet back from the stream), then the memtable and the last commit: one read path.
pub(crate) fn warmest(front: &mut Front, own: Option<&dyn Pending>, prefix: &Prefix) -> Result<Option<Hit>> {
    if prefix.blocks.len() < MIN_BLOCKS && prefix.legacy.len() < MIN_BLOCKS {
        return Ok(None);
    }
    front.expire_claims();
    let found = lookup::answer_search(front, own, &prefix.blocks)?;
    // The last block's node was forgotten, or its cache no longer holds it: the next node
    // that ran the most of the prompt.
    let found = match found {
        Some(((node, clock), _)) if !lookup::answered(front, own, node, clock) => {
            lookup::warm_nodes(front, own, &prefix.blocks)?.first().map(|d| ((d.node, d.clock), d.blocks))
        }
        found => found,
    };
    // What the engines hold, by their events.
    let found = lookup::better(found, lookup::engine_search(front, &prefix.blocks));
    let found = if prefix.legacy.is_empty() {
        found
    } else {
        lookup::longer(found, lookup::walk(&prefix.legacy, |k| lookup::answer_probe(front, k))?)
    };
    Ok(found
        .filter(|&(_, blocks)| blocks >= MIN_BLOCKS)
        .map(|((node, _), blocks)| hit(front, own, node, &prefix.blocks, blocks)))
}

/// Node `node`'s hit of `blocks` blocks of `keys`, with the tiers its engine keeps them in.
fn hit(front: &Front, own: Option<&dyn Pending>, node: u32, keys: &[BlockKey], blocks: usize) -> Hit {
    let (tier, gpu) = lookup::engine_tiers(front, keys, node, blocks);
    Hit { node: node_name(front, own, node), tokens: blocks * BLOCK_TOKENS, tier, gpu_tokens: gpu * BLOCK_TOKENS }
}

/// [`ReadIndex::warm_nodes_prefix`] over `own`'s writes first, as [`Warm::warmest_with`].
pub(crate) fn warm_nodes(front: &mut Front, own: Option<&dyn Pending>, prefix: &Prefix) -> Result<Vec<Hit>> {
    front.expire_claims();
    let mut found: Vec<NodeDepth> = lookup::warm_nodes(front, own, &prefix.blocks)?;
    if front.decided.engines.any() {
        // What each engine holds, by its events, where more than its claims.
        for held in lookup::engine_depths(front, &prefix.blocks) {
            match found.iter_mut().find(|d| d.node == held.node) {
                Some(d) if (d.blocks, d.clock) >= (held.blocks, held.clock) => {}
                Some(d) => *d = held,
                None => found.push(held),
            }
        }
        found.sort_by(NodeDepth::longest_first);
    }
    if !prefix.legacy.is_empty()
        && let Some(((node, clock), blocks)) = lookup::walk(&prefix.legacy, |k| lookup::answer_probe(front, k))?
    {
        // 0.1.7's entries lose a tie to the new chain's, as in `warmest`.
        match found.iter_mut().find(|d| d.node == node) {
            Some(d) if d.blocks >= blocks => {}
            Some(d) => *d = NodeDepth { node, blocks, clock },
            None => found.push(NodeDepth { node, blocks, clock }),
        }
        found.sort_by(NodeDepth::longest_first);
    }
    // Longest first, ties newest first: a node named twice (a file's incarnation and `own`'s
    // write of the same name) is listed once, where it comes first.
    let mut hits: Vec<Hit> = Vec::with_capacity(found.len());
    for d in found.into_iter().filter(|d| d.blocks >= MIN_BLOCKS) {
        let hit = hit(front, own, d.node, &prefix.blocks, d.blocks);
        if !hits.iter().any(|h| h.node == hit.node) {
            hits.push(hit);
        }
    }
    Ok(hits)
}

/// The name of node `node`: the file's, or `own`'s for its own nodes.
fn node_name(front: &Front, own: Option<&dyn Pending>, node: u32) -> String {
    match own.filter(|_| node >= PENDING_NODES).and_then(|o| o.name(node)) {
        Some(name) => name.to_string(),
        None => front.decided.nodes.name(node),
    }
}
