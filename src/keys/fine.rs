//! Keys at an engine's block granularity: where a prompt stands after every multiple of a
//! block size that divides ours (16 or 32 tokens, say), not only after each whole block of 64.
//! At the end of a block of ours the key is that block's ([`super::chain`]); inside one it is a
//! partial key: the namespace's keyed BLAKE3 of a 64-byte header (the key of the last whole
//! block of ours, or zeros before the first, then a domain string padded with zeros) and the
//! tokens since, 4 bytes each little-endian, first 16 bytes. Like a block key, it names the
//! namespace and every token before it. A hybrid-attention engine's groups hold blocks of its
//! own size, some alone (a sliding window keeps only the last few), so what it reuses of a
//! prompt is found from these keys.

use super::chain::{BLOCK_TOKENS, BlockKey, CHAIN_STATE_BYTES, ChainState, Scheme, keyed_roots};

/// The domain string of a partial key's header.
const PARTIAL: &[u8] = b"superfluid-warm partial block";
/// Bytes of a partial key's header.
const HEADER: usize = 64;

/// A partial key's header after block `last` of ours.
fn header(last: Option<&BlockKey>) -> [u8; HEADER] {
    let mut out = [0u8; HEADER];
    let (key, rest) = out.split_at_mut(16);
    if let Some(last) = last {
        key.copy_from_slice(last);
    }
    rest.iter_mut().zip(PARTIAL).for_each(|(d, s)| *d = *s);
    out
}

/// The partial key of `tokens` (fewer than a whole block) past block `last` of ours.
fn partial_key(ns_key: &[u8; 32], last: Option<&BlockKey>, tokens: &[u32]) -> BlockKey {
    let mut bytes = Vec::with_capacity(HEADER + 4 * tokens.len());
    bytes.extend_from_slice(&header(last));
    bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
    first_16(blake3::keyed_hash(ns_key, &bytes).as_bytes())
}

fn first_16(hash: &[u8; 32]) -> BlockKey {
    let mut out = [0u8; 16];
    out.iter_mut().zip(hash).for_each(|(d, s)| *d = *s);
    out
}

/// Where a chain stands after any number of tokens.
#[derive(Clone, Debug)]
pub(crate) struct FinePosition {
    /// After the whole blocks of ours.
    state: ChainState,
    /// The key of the last whole block of ours (`None` before the first).
    last: Option<BlockKey>,
    /// The tokens past it (fewer than a whole block).
    partial: Vec<u32>,
}

impl FinePosition {
    /// Before a chain's first token.
    pub(crate) fn start(ns_key: &[u8; 32]) -> FinePosition {
        FinePosition { state: ChainState::start(ns_key), last: None, partial: Vec::new() }
    }

    /// Takes `tokens` in (whole blocks chained in `scheme`); returns the key where they end,
    /// `None` if that is the chain's start.
    pub(crate) fn advance(&mut self, scheme: Scheme, tokens: &[u32]) -> Option<BlockKey> {
        for &t in tokens {
            self.partial.push(t);
            if let Ok(block) = <&[u32; BLOCK_TOKENS]>::try_from(self.partial.as_slice()) {
                self.last = Some(self.state.push(scheme, block));
                self.partial.clear();
            }
        }
        self.key()
    }

    /// Appends it: the chain state ([`ChainState::write`]), then the tokens past its last
    /// whole block (`u8` count, each `u32` little-endian). The last whole block's key is the
    /// state's.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        self.state.write(out);
        out.push(u8::try_from(self.partial.len()).unwrap_or(u8::MAX));
        self.partial.iter().for_each(|t| out.extend_from_slice(&t.to_le_bytes()));
    }

    /// Reads what [`FinePosition::write`] wrote at the start of `bytes`: the position and the
    /// bytes after it. `None` if they are not one.
    pub(crate) fn read(bytes: &[u8]) -> Option<(FinePosition, &[u8])> {
        let state = ChainState::read(bytes)?;
        let (&count, rest) = bytes.get(CHAIN_STATE_BYTES..)?.split_first()?;
        let (tokens, rest) = rest.split_at_checked(4 * usize::from(count))?;
        let partial: Vec<u32> =
            tokens.chunks_exact(4).filter_map(|t| t.try_into().ok().map(u32::from_le_bytes)).collect();
        if partial.len() >= BLOCK_TOKENS {
            return None;
        }
        Some((FinePosition { state, last: state.last_key(), partial }, rest))
    }

    /// The key of where it stands (`None`: the chain's start).
    pub(crate) fn key(&self) -> Option<BlockKey> {
        match self.partial.is_empty() {
            true => self.last,
            false => Some(partial_key(self.state.ns_key(), self.last.as_ref(), &self.partial)),
        }
    }
}

/// The key after each `size` tokens of `tokens` (a size that divides 64), for its first `count`
/// blocks of `size` (fewer if it has fewer), from `blocks`, its keys of whole blocks of ours in
/// namespace `ns_key`. The partial keys of sizes 16 and 32 are hashed many at once.
pub(crate) fn fine_keys(
    ns_key: &[u8; 32],
    blocks: &[BlockKey],
    tokens: &[u32],
    size: usize,
    count: usize,
) -> Vec<BlockKey> {
    if size == 0 || !BLOCK_TOKENS.is_multiple_of(size) {
        return Vec::new();
    }
    let count = count.min(tokens.len() / size);
    let per = BLOCK_TOKENS / size;
    // Each position's key: a whole block's, or the partial key of its place inside one.
    let mut keys = vec![[0u8; 16]; count];
    match size {
        16 => {
            partials::<{ HEADER + 64 }>(ns_key, blocks, tokens, size, 1, &mut keys);
            partials::<{ HEADER + 128 }>(ns_key, blocks, tokens, size, 2, &mut keys);
            partials::<{ HEADER + 192 }>(ns_key, blocks, tokens, size, 3, &mut keys);
        }
        32 => partials::<{ HEADER + 128 }>(ns_key, blocks, tokens, size, 1, &mut keys),
        _ => {
            for (p, key) in keys.iter_mut().enumerate().filter(|(p, _)| (p + 1) % per != 0) {
                let start = (p + 1) * size / BLOCK_TOKENS * BLOCK_TOKENS;
                let last = (start / BLOCK_TOKENS).checked_sub(1).and_then(|j| blocks.get(j));
                *key = partial_key(ns_key, last, tokens.get(start..(p + 1) * size).unwrap_or_default());
            }
        }
    }
    for (p, key) in keys.iter_mut().enumerate().filter(|(p, _)| (p + 1) % per == 0) {
        if let Some(block) = blocks.get((p + 1) / per - 1) {
            *key = *block;
        }
    }
    keys
}

/// The partial keys of the positions `sub` blocks of `size` into a block of ours (inputs of `N`
/// bytes: the header and `sub * size` tokens), into their places in `keys`.
fn partials<const N: usize>(
    ns_key: &[u8; 32],
    blocks: &[BlockKey],
    tokens: &[u32],
    size: usize,
    sub: usize,
    keys: &mut [BlockKey],
) {
    let per = BLOCK_TOKENS / size;
    let places: Vec<usize> = (0..keys.len()).filter(|p| (p + 1) % per == sub).collect();
    let inputs: Vec<[u8; N]> = places
        .iter()
        .map(|&p| {
            let start = (p + 1 - sub) * size;
            let last = (start / BLOCK_TOKENS).checked_sub(1).and_then(|j| blocks.get(j));
            let mut input = [0u8; N];
            let (head, rest) = input.split_at_mut(HEADER);
            head.copy_from_slice(&header(last));
            for (dst, t) in rest.chunks_exact_mut(4).zip(tokens.get(start..start + sub * size).unwrap_or_default()) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            input
        })
        .collect();
    for (&p, hash) in places.iter().zip(keyed_roots(ns_key, &inputs)) {
        if let Some(key) = keys.get_mut(p) {
            *key = first_16(&hash);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;
    use crate::keys::Namespace;

    /// Every 64 tokens the fine key is the block key; in between, keys are new, depend on
    /// every token before them, and are the same whether made a prompt at a time (many at
    /// once) or as an engine's blocks arrive, in any pieces.
    #[test]
    fn fine_keys_are_block_keys_at_our_blocks_and_name_every_earlier_token() {
        let ns = Namespace::new("m").expect("a namespace");
        let tokens: Vec<u32> = (0..64 * 3 + 40).map(|t| t * 7 % 50_000).collect();
        for scheme in [Scheme::TreeChain, Scheme::KeyedChain] {
            let ours = ns.chain_in(scheme, &tokens);
            for size in [4, 8, 16, 32, 64] {
                let fine = fine_keys(ns.key(), &ours, &tokens, size, usize::MAX);
                assert_eq!(fine.len(), tokens.len() / size);
                let per = 64 / size;
                for (j, key) in ours.iter().enumerate() {
                    assert_eq!(fine[per * j + per - 1], *key);
                }
                let mut distinct = fine.clone();
                distinct.sort_unstable();
                distinct.dedup();
                assert_eq!(distinct.len(), fine.len(), "size {size}");
                // As an engine's blocks arrive, in uneven pieces: the same keys.
                let mut at = FinePosition::start(ns.key());
                for (p, block) in tokens.chunks_exact(size).enumerate() {
                    let (a, b) = block.split_at(size / 2);
                    at.advance(scheme, a);
                    assert_eq!(at.advance(scheme, b), Some(fine[p]), "size {size}, block {p}");
                    // Written and read back, it stands where it stood.
                    let mut bytes = Vec::new();
                    at.write(&mut bytes);
                    bytes.push(7);
                    let (mut back, rest) = FinePosition::read(&bytes).expect("reads back");
                    assert_eq!((back.key(), rest), (at.key(), &[7u8][..]));
                    assert!(FinePosition::read(&bytes[..bytes.len() - 2]).is_none(), "cut short");
                    let next = tokens.get((p + 1) * size..(p + 2) * size).unwrap_or_default();
                    assert_eq!(back.advance(scheme, next), at.clone().advance(scheme, next));
                }
                // One token changed changes every key from its block on, none before.
                let mut changed = tokens.clone();
                changed[70] += 1;
                let other = fine_keys(ns.key(), &ns.chain_in(scheme, &changed), &changed, size, usize::MAX);
                let first = 70 / size;
                assert_eq!(other[..first], fine[..first]);
                assert!(other[first..].iter().zip(&fine[first..]).all(|(a, b)| a != b));
            }
            assert_eq!(fine_keys(ns.key(), &ours, &tokens, 32, 3).len(), 3);
            assert!(fine_keys(ns.key(), &ours, &tokens, 48, 3).is_empty(), "a size that does not divide 64");
        }
    }
}
