//! An engine block's row: what the store keeps of each block a stream holds, and the one codec
//! of it (the holdings are derived from the rows at load).
//!
//! Row layouts, all integers little-endian. `engine_blocks/v7`, key `(node id, store clock,
//! engine hash)`: `flags: u8` (bit 0: has a parent; bit 1: keyed, a namespace follows; bit 2:
//! opaque, it hashes more than its tokens and keys nothing; bit 3: copies offloaded), `parent:
//! u64` (if bit 0), `refs: u32` (copies in any medium), with bit 3 `cpu: u32` and `storage: u32`
//! (of those), `tokens: u32` count then each token as `u32`, and for a keyed first block (no
//! parent): `model: u16` length and bytes, `tenant: u16` length and bytes. Schema 6's
//! `engine_blocks/v6`, key `(node id, engine hash)`: the same without bit 3, with `clock: u64`
//! after `refs` (read from schema 6 files, and by the upgrade).
//!
//! A hybrid engine's blocks (schema 8), `engine_group_blocks/v8`, key `(node id, clock of the
//! block's first store, engine hash)`: `clock: u64` (its newest store), `block_size: u16`,
//! `groups: u8` then per group holding copies `(group: u32, copies: u32)`, and where the prompt
//! stands after the block: the chain state (`blocks: u64` chained, the namespace's key, the
//! chaining value, the segment's first 8 bytes: 80 bytes) and the tokens past its last whole
//! block of ours (`count: u8`, each `u32`). Self-contained, so that a block whose parent has
//! gone (a sliding window keeps the last few) is placed again at an open. `engine_groups/v8`,
//! key `(node id, group index)`: the group's kind (see [`encode_kind`]).

use std::sync::Arc;

use super::blocks::Blocks;
use super::event::GroupKind;
use super::gpu_copies;
use crate::error::{Error, Result};
use crate::keys::{BLOCK_TOKENS, CHAIN_STATE_BYTES, FinePosition, Namespace};

/// The key of an `engine_blocks/v7` row: (node id, the clock of the block's store, its engine
/// hash). Ordered by store, so that a batch's new rows sit together at the end of a node's
/// range and the LRU's evictions take rows from its start.
pub(crate) type BlockRowKey = (u32, u64, u64);

impl Row {
    /// The clock of the block's store.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// Its parent's engine hash (`None`: a prompt's first block).
    pub(crate) fn parent(&self) -> Option<u64> {
        self.parent
    }

    /// Its copies in GPU memory, CPU memory and on storage.
    pub(crate) fn copies(&self) -> [u32; 3] {
        let [cpu, storage] = self.offload;
        [gpu_copies(self.refs, self.offload), cpu, storage]
    }

    /// How many tokens it holds.
    pub(crate) fn token_count(&self) -> usize {
        self.tokens.len()
    }

    /// For a first block, its namespace's model (`None`: not a first block, or unkeyed).
    pub(crate) fn model(&self) -> Option<&str> {
        self.root.as_ref().and_then(Option::as_ref).map(Namespace::model)
    }
}
const HAS_PARENT: u8 = 1;
const KEYED: u8 = 2;
const OPAQUE: u8 = 4;
const OFFLOADED: u8 = 8;

/// A block's row (see the module docs), from its slot, written through `scratch` (kept by the
/// caller, so that a row costs one allocation).
pub(super) fn encode_row(blocks: &Blocks, i: u32, namespaces: &[Namespace], scratch: &mut Vec<u8>) -> Arc<[u8]> {
    let Some(block) = blocks.get(i) else { return Arc::from(&[][..]) };
    let ns = block.root.flatten().and_then(|n| namespaces.get(usize::from(n)));
    scratch.clear();
    write(scratch, block.opaque, block.parent, block.refs, block.offload, blocks.tokens(i), ns);
    Arc::from(&scratch[..])
}

/// A row in the layout of `engine_blocks/v7` (the clock is in its key).
pub(super) fn encode(row: &Row) -> Arc<[u8]> {
    let mut out = Vec::with_capacity(32 + 4 * row.tokens.len());
    let ns = row.root.as_ref().and_then(Option::as_ref);
    write(&mut out, row.opaque, row.parent, row.refs, row.offload, &row.tokens, ns);
    out.into()
}

/// Appends a row of these parts to `out`: the one writer of the layout.
fn write(
    out: &mut Vec<u8>,
    opaque: bool,
    parent: Option<u64>,
    refs: u32,
    offload: [u32; 2],
    tokens: &[u32],
    ns: Option<&Namespace>,
) {
    out.reserve(32 + 4 * tokens.len());
    out.push(
        (u8::from(parent.is_some()) * HAS_PARENT)
            | (u8::from(ns.is_some()) * KEYED)
            | (u8::from(opaque) * OPAQUE)
            | (u8::from(offload != [0; 2]) * OFFLOADED),
    );
    if let Some(p) = parent {
        out.extend_from_slice(&p.to_le_bytes());
    }
    out.extend_from_slice(&refs.to_le_bytes());
    if offload != [0; 2] {
        for c in offload {
            out.extend_from_slice(&c.to_le_bytes());
        }
    }
    out.extend_from_slice(&u32::try_from(tokens.len()).unwrap_or(u32::MAX).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    if let Some(ns) = ns {
        for part in [ns.model().as_bytes(), ns.tenant().unwrap_or_default()] {
            out.extend_from_slice(&u16::try_from(part.len()).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(part);
        }
    }
}

/// A block's row, read.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Row {
    pub(super) opaque: bool,
    pub(super) parent: Option<u64>,
    pub(super) refs: u32,
    pub(super) offload: [u32; 2],
    /// The clock of its store (in `engine_blocks/v7`'s key, in `engine_blocks/v6`'s row).
    pub(super) clock: u64,
    pub(super) tokens: Vec<u32>,
    /// For a first block: its namespace (`None`: unkeyed).
    pub(super) root: Option<Option<Namespace>>,
}

/// The two layouts of a block's row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Schema 6: the clock after the copies, no offloaded copies.
    V6,
    /// Schema 7: offloaded copies with flag bit 3, the clock in the key.
    V7,
}

/// Reads a block's row of `layout`; `clock` is its key's (ignored for [`Layout::V6`], whose row
/// holds it).
///
/// # Errors
/// [`Error::Corrupted`] for bytes that are not such a row.
pub(crate) fn decode_row(bytes: &[u8], layout: Layout, clock: u64) -> Result<Row> {
    let corrupt = || Error::Corrupted { detail: "an engine block row does not decode".into() };
    let mut r = RowCursor(bytes);
    let flags = r.take::<1>().ok_or_else(corrupt)?[0];
    if layout == Layout::V6 && flags & OFFLOADED != 0 {
        return Err(corrupt());
    }
    let parent = match flags & HAS_PARENT {
        0 => None,
        _ => Some(u64::from_le_bytes(r.take().ok_or_else(corrupt)?)),
    };
    let refs = u32::from_le_bytes(r.take().ok_or_else(corrupt)?);
    let offload = match flags & OFFLOADED {
        0 => [0; 2],
        _ => [u32::from_le_bytes(r.take().ok_or_else(corrupt)?), u32::from_le_bytes(r.take().ok_or_else(corrupt)?)],
    };
    if u64::from(offload[0]) + u64::from(offload[1]) > u64::from(refs) {
        return Err(corrupt());
    }
    let clock = match layout {
        Layout::V6 => u64::from_le_bytes(r.take().ok_or_else(corrupt)?),
        Layout::V7 => clock,
    };
    let n = u32::from_le_bytes(r.take().ok_or_else(corrupt)?) as usize;
    let raw = r.bytes(n.checked_mul(4).ok_or_else(corrupt)?).ok_or_else(corrupt)?;
    let tokens: Vec<u32> =
        raw.chunks_exact(4).map(|c| c.try_into().map(u32::from_le_bytes).unwrap_or_default()).collect();
    let root = match (parent, flags & KEYED) {
        (Some(_), _) => None,
        (None, 0) => Some(None),
        (None, _) => {
            let mut part = || -> Option<&[u8]> {
                let len = u16::from_le_bytes(r.take()?);
                r.bytes(usize::from(len))
            };
            let model = part().ok_or_else(corrupt)?;
            let model = std::str::from_utf8(model).map_err(|_| corrupt())?.to_string();
            let tenant = part().ok_or_else(corrupt)?;
            Some(Some(Namespace::of(&model, Some(tenant).filter(|t| !t.is_empty())).map_err(|_| corrupt())?))
        }
    };
    if !r.0.is_empty() {
        return Err(corrupt());
    }
    Ok(Row { opaque: flags & OPAQUE != 0, parent, refs, offload, clock, tokens, root })
}

/// A schema 6 row as schema 7 keys and lays it out: `((node, clock, hash), row)`.
///
/// # Errors
/// As [`decode_row`].
pub(crate) fn upgrade_row(node: u32, hash: u64, bytes: &[u8]) -> Result<(BlockRowKey, Arc<[u8]>)> {
    let row = decode_row(bytes, Layout::V6, 0)?;
    Ok(((node, row.clock, hash), encode(&row)))
}

/// A hybrid engine's block: its `engine_group_blocks/v8` row (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct GroupedRow {
    /// The clock of its newest store.
    pub(super) clock: u64,
    /// The engine's block size, in tokens.
    pub(super) block_size: u16,
    /// Copies by group: (group index, copies).
    pub(super) copies: Vec<(u32, u32)>,
    /// Where the prompt stands after it.
    pub(super) at: FinePosition,
}

impl GroupedRow {
    /// The clock of its newest store.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// Copies by group: (group index, copies).
    pub(crate) fn copies(&self) -> &[(u32, u32)] {
        &self.copies
    }

    /// The engine's block size, in tokens.
    pub(crate) fn block_size(&self) -> usize {
        usize::from(self.block_size)
    }
}

/// A hybrid engine's block row: newest store, block size, copies by group, position.
pub(super) fn encode_grouped(clock: u64, block_size: usize, copies: &[(u32, u32)], at: &FinePosition) -> Arc<[u8]> {
    let mut out = Vec::with_capacity(8 + 2 + 1 + 8 * copies.len() + CHAIN_STATE_BYTES + 1 + 4 * BLOCK_TOKENS);
    out.extend_from_slice(&clock.to_le_bytes());
    out.extend_from_slice(&u16::try_from(block_size).unwrap_or(u16::MAX).to_le_bytes());
    out.push(u8::try_from(copies.len()).unwrap_or(u8::MAX));
    for &(group, n) in copies.iter().take(usize::from(u8::MAX)) {
        out.extend_from_slice(&group.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
    }
    at.write(&mut out);
    out.into()
}

/// Reads a hybrid engine's block row.
///
/// # Errors
/// [`Error::Corrupted`] for bytes that are not such a row.
pub(crate) fn decode_grouped(bytes: &[u8]) -> Result<GroupedRow> {
    let corrupt = || Error::Corrupted { detail: "a hybrid engine's block row does not decode".into() };
    let mut r = RowCursor(bytes);
    let clock = u64::from_le_bytes(r.take::<8>().ok_or_else(corrupt)?);
    let block_size = u16::from_le_bytes(r.take::<2>().ok_or_else(corrupt)?);
    let [groups] = r.take::<1>().ok_or_else(corrupt)?;
    let mut copies = Vec::with_capacity(usize::from(groups));
    for _ in 0..groups {
        let group = u32::from_le_bytes(r.take::<4>().ok_or_else(corrupt)?);
        let n = u32::from_le_bytes(r.take::<4>().ok_or_else(corrupt)?);
        copies.push((group, n));
    }
    let (at, rest) = FinePosition::read(r.0).ok_or_else(corrupt)?;
    if !rest.is_empty() || block_size == 0 || copies.iter().any(|c| c.1 == 0) {
        return Err(corrupt());
    }
    Ok(GroupedRow { clock, block_size, copies, at })
}

/// A KV cache group's kind: its `engine_groups/v8` row, a tag (0 full attention, 1 sliding
/// window then its window as `u32`, 2 chunked local, 3 Mamba, 4 another kind).
pub(crate) fn encode_kind(kind: GroupKind) -> Vec<u8> {
    match kind {
        GroupKind::Full => vec![0],
        GroupKind::SlidingWindow { window } => {
            let mut out = vec![1];
            out.extend_from_slice(&window.to_le_bytes());
            out
        }
        GroupKind::ChunkedLocal => vec![2],
        GroupKind::Mamba => vec![3],
        GroupKind::Other => vec![4],
    }
}

/// Reads a group's kind.
///
/// # Errors
/// [`Error::Corrupted`] for bytes that are not one.
pub(crate) fn decode_kind(bytes: &[u8]) -> Result<GroupKind> {
    match bytes {
        [0] => Ok(GroupKind::Full),
        &[1, a, b, c, d] => Ok(GroupKind::SlidingWindow { window: u32::from_le_bytes([a, b, c, d]) }),
        [2] => Ok(GroupKind::ChunkedLocal),
        [3] => Ok(GroupKind::Mamba),
        [4] => Ok(GroupKind::Other),
        _ => Err(Error::Corrupted { detail: "a KV cache group's row does not decode".into() }),
    }
}

/// Reads fixed-width fields off the front of a row.
struct RowCursor<'a>(&'a [u8]);

impl<'a> RowCursor<'a> {
    fn take<const N: usize>(&mut self) -> Option<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>()?;
        self.0 = rest;
        Some(*head)
    }

    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;
    use crate::keys::Scheme;

    /// A hybrid engine's block row and a group's kind read back as written; cut or padded
    /// bytes, a count of 0 copies and an unknown kind are refused.
    #[test]
    fn grouped_rows_and_group_kinds_read_back_and_bad_ones_are_refused() {
        let ns = Namespace::new("m").expect("a namespace");
        let tokens: Vec<u32> = (0..64 + 48).collect();
        let mut at = FinePosition::start(ns.key());
        let key = at.advance(Scheme::TreeChain, &tokens);
        let row = encode_grouped(9, 16, &[(0, 2), (3, 1)], &at);
        let back = decode_grouped(&row).expect("reads back");
        assert_eq!((back.clock(), back.block_size(), back.copies()), (9, 16, &[(0, 2), (3, 1)][..]));
        assert_eq!(back.at.key(), key);
        for bad in [&row[..row.len() - 1], &row[..10], &[&row[..], &[0]].concat()[..]] {
            assert!(decode_grouped(bad).is_err(), "{} bytes", bad.len());
        }
        let none = encode_grouped(9, 16, &[(0, 0)], &at);
        assert!(decode_grouped(&none).is_err(), "a group holding no copy");
        let kinds = [
            GroupKind::Full,
            GroupKind::SlidingWindow { window: 128 },
            GroupKind::ChunkedLocal,
            GroupKind::Mamba,
            GroupKind::Other,
        ];
        for kind in kinds {
            assert_eq!(decode_kind(&encode_kind(kind)).ok(), Some(kind));
        }
        for bad in [&[][..], &[5], &[1, 0, 0], &[0, 0]] {
            assert!(decode_kind(bad).is_err(), "{bad:?}");
        }
    }
}
