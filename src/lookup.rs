//! `warmest`'s search: the longest remembered prefix of a chain, over the overlay of uncommitted
//! `ran`s and the last committed snapshot.
//!
//! Every `ran` writes all the blocks of its prompt at one clock, and eviction removes whole clock
//! ranges oldest first, so a block's ancestors are never older than it and never evicted before
//! it: along a chain, the remembered blocks are always a prefix (ARCHITECTURE.md, invariant 3).
//! The longest remembered prefix is therefore found by binary search, in about log2(blocks)
//! reads instead of one per block. 0.1.7's imported entries promise no such thing, so their
//! chain is walked block by block as 0.1.7 did.

use crate::chain::BlockKey;
use crate::error::{Result, redb_err};
use crate::front::Front;
use crate::tables::{Entry, stored};

/// Who ran a block: a name from the overlay, or a node id from the file.
#[derive(Clone, Debug)]
pub(crate) enum Owner {
    Pending(u32),
    Stored(u32),
}

/// The longest remembered prefix: who ran its last block, and its length in blocks.
pub(crate) type Found = Option<(Owner, usize)>;

fn probe(front: &Front, key: &BlockKey) -> Result<Option<Owner>> {
    if let Some(node) = front.overlay.get(key) {
        return Ok(Some(Owner::Pending(node)));
    }
    let found = front.snapshot.get(stored(key)).map_err(redb_err("reading a prefix"))?;
    Ok(found.map(|g| Owner::Stored(Entry::from_tuple(g.value()).node)))
}

/// The longest prefix of `keys` remembered, by binary search (the chain is prefix-closed).
pub(crate) fn search(front: &Front, keys: &[BlockKey]) -> Result<Found> {
    // Invariant: keys[..lo] are remembered (with `best` the owner of keys[lo - 1]); keys[hi..] are not.
    let (mut lo, mut hi, mut best) = (0, keys.len(), None);
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        match probe(front, &keys[mid - 1])? {
            Some(owner) => {
                lo = mid;
                best = Some(owner);
            }
            None => hi = mid - 1,
        }
    }
    Ok(best.map(|owner| (owner, lo)))
}

/// The longest prefix of `keys` remembered, walking from the first block until one is missing.
pub(crate) fn walk(front: &Front, keys: &[BlockKey]) -> Result<Found> {
    let mut best = None;
    for (i, key) in keys.iter().enumerate() {
        match probe(front, key)? {
            Some(owner) => best = Some((owner, i + 1)),
            None => break,
        }
    }
    Ok(best)
}

/// The longer of the two; the first wins a tie.
pub(crate) fn longer(new: Found, old: Found) -> Found {
    match (new, old) {
        (Some(n), Some(o)) if o.1 > n.1 => Some(o),
        (None, o) => o,
        (n, _) => n,
    }
}
