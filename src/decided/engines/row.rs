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

use std::sync::Arc;

use super::blocks::Blocks;
use super::gpu_copies;
use crate::error::{Error, Result};
use crate::keys::Namespace;

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

/// A block's row (see the module docs), from its slot.
pub(super) fn encode_row(blocks: &Blocks, i: u32, namespaces: &[Namespace]) -> Arc<[u8]> {
    let Some(block) = blocks.get(i) else { return Arc::from(&[][..]) };
    let root = block.root.map(|r| r.and_then(|n| namespaces.get(usize::from(n))).cloned());
    let row = Row {
        opaque: block.opaque,
        parent: block.parent,
        refs: block.refs,
        offload: block.offload,
        clock: block.clock,
        tokens: blocks.tokens(i).to_vec(),
        root,
    };
    encode(&row)
}

/// A row in the layout of `engine_blocks/v7` (the clock is in its key).
pub(super) fn encode(row: &Row) -> Arc<[u8]> {
    let ns = row.root.as_ref().and_then(Option::as_ref);
    let mut out = Vec::with_capacity(32 + 4 * row.tokens.len());
    out.push(
        (u8::from(row.parent.is_some()) * HAS_PARENT)
            | (u8::from(ns.is_some()) * KEYED)
            | (u8::from(row.opaque) * OPAQUE)
            | (u8::from(row.offload != [0; 2]) * OFFLOADED),
    );
    if let Some(p) = row.parent {
        out.extend_from_slice(&p.to_le_bytes());
    }
    out.extend_from_slice(&row.refs.to_le_bytes());
    if row.offload != [0; 2] {
        for c in row.offload {
            out.extend_from_slice(&c.to_le_bytes());
        }
    }
    out.extend_from_slice(&u32::try_from(row.tokens.len()).unwrap_or(u32::MAX).to_le_bytes());
    for t in &row.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    if let Some(ns) = ns {
        for part in [ns.model().as_bytes(), ns.tenant().unwrap_or_default()] {
            out.extend_from_slice(&u16::try_from(part.len()).unwrap_or(u16::MAX).to_le_bytes());
            out.extend_from_slice(part);
        }
    }
    out.into()
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
