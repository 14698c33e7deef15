//! 0.1.7's keys: its FNV-1a chain, and how its `u64` hashes are stored beside blake3 keys.

use super::chain::{BLOCK_TOKENS, BlockKey};

const FNV_OFFSET: u64 = 0xCBF2_9CE4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01B3;

/// Tag that starts every key holding a 0.1.7 FNV-1a hash. A blake3 key starts with these 8 bytes
/// with probability 2^-64.
pub(crate) const LEGACY_TAG: [u8; 8] = *b"fnv1a64\0";

/// The key a 0.1.7 `u64` hash is stored under.
pub(crate) fn legacy_key(hash: u64) -> BlockKey {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&LEGACY_TAG);
    key[8..].copy_from_slice(&hash.to_be_bytes());
    key
}

/// Whether a key holds a 0.1.7 hash.
pub(crate) fn is_legacy(key: &BlockKey) -> bool {
    key[..8] == LEGACY_TAG
}

/// 0.1.7's chain: FNV-1a 64 of the model, then of every whole block's token bytes (LE).
pub(crate) fn fnv_chain<'a>(model: &str, tokens: &'a [u32]) -> impl Iterator<Item = u64> + 'a {
    let seed = model.bytes().fold(FNV_OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(FNV_PRIME));
    tokens.chunks_exact(BLOCK_TOKENS).scan(seed, |h, block| {
        for t in block {
            for b in t.to_le_bytes() {
                *h = (*h ^ u64::from(b)).wrapping_mul(FNV_PRIME);
            }
        }
        Some(*h)
    })
}

/// The 0.1.7 chain, as stored keys.
pub(crate) fn legacy_chain(model: &str, tokens: &[u32]) -> Vec<BlockKey> {
    fnv_chain(model, tokens).map(legacy_key).collect()
}
