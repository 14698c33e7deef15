//! The hasher of the in-memory maps keyed by block keys and engine block hashes: both are
//! already hashes, so one folded multiplication of their last 8 bytes is all the mixing they
//! need (SipHash, the default, costs several times that on the ingest path). The last 8 bytes,
//! not the first: a 0.1.7 key's first 8 are a constant tag.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A hasher for keys that are hashes already (`u64` engine hashes, 16-byte block keys).
#[derive(Clone, Copy, Default)]
pub(crate) struct KeyHasher(u64);

/// Spreads `v` over all 64 bits (the high half of the 128-bit product folded onto the low), so
/// that keys that differ only in their low or high bits still land far apart.
fn fold(v: u64) -> u64 {
    let product = u128::from(v) * 0x9E37_79B9_7F4A_7C15;
    (product as u64) ^ ((product >> 64) as u64)
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    /// A key's bytes: its last 8 (a shorter write, such as a length, mixed in whole).
    fn write(&mut self, bytes: &[u8]) {
        match bytes.last_chunk::<8>() {
            Some(tail) => self.0 = fold(self.0 ^ u64::from_le_bytes(*tail)),
            None => {
                for &b in bytes {
                    self.0 = fold(self.0 ^ u64::from(b));
                }
            }
        }
    }

    fn write_u64(&mut self, v: u64) {
        self.0 = fold(self.0 ^ v);
    }

    fn write_usize(&mut self, v: usize) {
        self.write_u64(v as u64);
    }
}

/// A map keyed by hashes, with [`KeyHasher`].
pub(crate) type KeyMap<K, V> = HashMap<K, V, BuildHasherDefault<KeyHasher>>;

#[cfg(test)]
mod tests {
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::*;

    #[test]
    fn keys_that_differ_anywhere_in_their_tails_spread_over_every_bucket_bit() {
        let hash = |key: &[u8; 16]| BuildHasherDefault::<KeyHasher>::default().hash_one(key);
        // 0.1.7 keys share their first 8 bytes; engine hashes may be small integers.
        let mut tails = std::collections::HashSet::new();
        let mut tops = std::collections::HashSet::new();
        for i in 0..4096u64 {
            let mut key = *b"fnv1a64\0\0\0\0\0\0\0\0\0";
            key[8..].copy_from_slice(&i.to_be_bytes());
            let h = hash(&key);
            tails.insert(h & 0xFFF);
            tops.insert(h >> 57);
            let small = BuildHasherDefault::<KeyHasher>::default().hash_one(i);
            tails.insert(small & 0xFFF);
        }
        assert!(tails.len() > 3000, "{} of 4096 low 12-bit values", tails.len());
        assert_eq!(tops.len(), 128, "every 7-bit control value is used");
    }
}
