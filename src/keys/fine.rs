//! Keys at an engine's block granularity: where a prompt stands after every multiple of a
//! block size that divides ours (16 or 32 tokens, say), not only after each whole block of 64.
//! At the end of a block of ours the key is that block's ([`super::chain`]); inside one it is the
//! chain's partial key of the tokens since that block began ([`ChainState::partial_key`]). Like
//! a block key, it names the namespace and every token before it. A hybrid-attention engine's
//! groups hold blocks of its own size, some of them alone (a sliding window keeps only the last
//! few), so what it reuses of a prompt is found from these keys.

use super::chain::{BLOCK_TOKENS, BlockKey, ChainState, Scheme};

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

    /// The key of where it stands (`None`: the chain's start).
    pub(crate) fn key(&self) -> Option<BlockKey> {
        match self.partial.is_empty() {
            true => self.last,
            false => Some(self.state.partial_key(&self.partial)),
        }
    }
}

/// The key after each `size` tokens of `tokens` in `scheme` from `ns_key`, for its first
/// `blocks` blocks of `size` (fewer if it has fewer).
pub(crate) fn fine_keys(
    scheme: Scheme,
    ns_key: &[u8; 32],
    tokens: &[u32],
    size: usize,
    blocks: usize,
) -> Vec<BlockKey> {
    let mut at = FinePosition::start(ns_key);
    tokens.chunks_exact(size.max(1)).take(blocks).filter_map(|block| at.advance(scheme, block)).collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;
    use crate::keys::Namespace;

    /// Every 64 tokens the fine key is the block key; in between, keys are new, depend on
    /// every token before them, and do not depend on how the tokens arrived.
    #[test]
    fn fine_keys_are_block_keys_at_our_blocks_and_name_every_earlier_token() {
        let ns = Namespace::new("m").expect("a namespace");
        let tokens: Vec<u32> = (0..64 * 3 + 40).map(|t| t * 7 % 50_000).collect();
        for scheme in [Scheme::TreeChain, Scheme::KeyedChain] {
            let ours = ns.chain_in(scheme, &tokens);
            let fine = fine_keys(scheme, ns.key(), &tokens, 16, usize::MAX);
            assert_eq!(fine.len(), 14);
            for (j, key) in ours.iter().enumerate() {
                assert_eq!(fine[4 * j + 3], *key);
            }
            let mut distinct = fine.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), fine.len());
            // Arrived in uneven pieces, the same keys.
            let mut at = FinePosition::start(ns.key());
            let mut pieces = Vec::new();
            for piece in tokens[..16 * 14].chunks(48) {
                at.advance(scheme, &piece[..16]);
                pieces.push(at.key());
                at.advance(scheme, &piece[16..]);
            }
            assert_eq!(pieces[1], Some(fine[3]), "a piece ending at 64 + 16 tokens");
            assert_eq!(at.key(), fine.last().copied());
            // One token changed changes every key from its block on, none before.
            let mut changed = tokens.clone();
            changed[70] += 1;
            let other = fine_keys(scheme, ns.key(), &changed, 16, usize::MAX);
            assert_eq!(other[..4], fine[..4]);
            assert!(other[4..].iter().zip(&fine[4..]).all(|(a, b)| a != b));
            assert_eq!(fine_keys(scheme, ns.key(), &tokens, 32, 3).len(), 3);
        }
    }
}
