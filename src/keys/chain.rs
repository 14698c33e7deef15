//! Prefix hashing: the chain of 64-token blocks, seeded by the namespace's key.
//!
//! A block's bytes are its 64 tokens as 3 bytes LE each when all are below 2^24 (every real
//! vocabulary: 192 bytes), else as 4 bytes LE each (256 bytes); the two lengths never collide.
//! The chain starts from `cv[-1] = ns_key = blake3::derive_key(NS_CONTEXT, len(model) ‖ model ‖
//! len(tenant) ‖ tenant)`. Two chains, one per file ([`Scheme`], recorded in its meta):
//!
//! - **v3** ([`HASH_SCHEME`], schema 3): `leaf[i]` is the BLAKE3 chunk chaining value of block
//!   `i`'s bytes in keyed mode with `ns_key` (chunk counter 0: what
//!   `Hasher::new_keyed(ns_key).update(bytes).finalize_non_root()` gives), and `cv[i]` the BLAKE3
//!   parent node of `(cv[i-1], leaf[i])` in the same mode (`hazmat::merge_subtrees_non_root`).
//!   The leaves do not depend on each other, so they are hashed 16 at a time in SIMD lanes; only
//!   the one-compression parent step is sequential.
//! - **v2** ([`HASH_SCHEME_V2`], schema 2): `cv[i] = blake3::keyed_hash(cv[i-1], bytes)`,
//!   every compression sequential. Kept for the files that use it.
//!
//! Either way the key of block `i` is `cv[s][..8] ‖ cv[i][..8]`, with `s` the first block of its
//! segment of [`SEGMENT_BLOCKS`]: the blocks of one segment of one conversation share their first
//! 8 bytes, so they sit side by side in the B-tree and a `ran` touches a few leaf pages instead of
//! one per block. A key names the model, the tenant and every token before it.

/// Tokens per block a prefix is matched in (as in 0.1.7).
pub const BLOCK_TOKENS: usize = 64;
/// A prefix shorter than this many blocks is not worth routing for (as in 0.1.7).
pub const MIN_BLOCKS: usize = 2;
/// The hash scheme of files this build creates (schema 3), as its meta record names it.
pub const HASH_SCHEME: &str = "blake3-tree-chain-seg16/v3";
/// The hash scheme of schema 2 files, still read and written.
pub(crate) const HASH_SCHEME_V2: &str = "blake3-keyed-chain-seg16/v2";
/// Blocks per segment: the blocks of a segment share the first half of their keys.
pub(crate) const SEGMENT_BLOCKS: usize = 16;

/// A key of the prefix table: 16 bytes of a block's chained hash.
pub type BlockKey = [u8; 16];

/// The key of every whole block of `tokens`, in order, chained from `ns_key` in `scheme`.
pub(crate) fn block_keys(scheme: Scheme, ns_key: &[u8; 32], tokens: &[u32]) -> Vec<BlockKey> {
    let cvs = match scheme {
        Scheme::KeyedChain => keyed_chain(ns_key, tokens),
        Scheme::TreeChain => tree_chain(ns_key, tokens),
    };
    let mut segment = [0u8; 8];
    cvs.iter()
        .enumerate()
        .map(|(i, cv)| {
            if i % SEGMENT_BLOCKS == 0 {
                segment.copy_from_slice(&cv[..8]);
            }
            let mut out = [0u8; 16];
            out[..8].copy_from_slice(&segment);
            out[8..].copy_from_slice(&cv[..8]);
            out
        })
        .collect()
}

/// How a file's keys are made from tokens (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheme {
    /// v2: `cv[i] = keyed_hash(cv[i-1], bytes)`.
    KeyedChain,
    /// v3: leaves hashed in parallel, chained by parent nodes.
    TreeChain,
}

impl Scheme {
    /// The scheme a meta record names, if this build knows it.
    pub(crate) fn named(name: &str) -> Option<Scheme> {
        match name {
            HASH_SCHEME => Some(Scheme::TreeChain),
            HASH_SCHEME_V2 => Some(Scheme::KeyedChain),
            _ => None,
        }
    }

    /// Its name in a meta record.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scheme::TreeChain => HASH_SCHEME,
            Scheme::KeyedChain => HASH_SCHEME_V2,
        }
    }
}

/// Whether a block's tokens are written 3 bytes each (all below 2^24) rather than 4.
fn narrow(block: &[u32]) -> bool {
    block.iter().all(|&t| t < 1 << 24)
}

/// A block's bytes (see the module docs), written into `buf`; returns the part of `buf` they fill.
fn block_bytes<'a>(block: &[u32], buf: &'a mut [u8; 4 * BLOCK_TOKENS]) -> &'a [u8] {
    if narrow(block) {
        if let Some(bytes) = buf.first_chunk_mut::<{ 3 * BLOCK_TOKENS }>() {
            pack(block, bytes);
        }
        &buf[..3 * BLOCK_TOKENS]
    } else {
        pack(block, buf);
        buf
    }
}

/// The v2 chain: every block one keyed hash, keyed by the one before.
fn keyed_chain(ns_key: &[u8; 32], tokens: &[u32]) -> Vec<[u8; 32]> {
    let mut cv = *ns_key;
    let mut buf = [0u8; 4 * BLOCK_TOKENS];
    tokens
        .chunks_exact(BLOCK_TOKENS)
        .map(|block| {
            cv = *blake3::keyed_hash(&cv, block_bytes(block, &mut buf)).as_bytes();
            cv
        })
        .collect()
}

/// The v3 chain: the leaves of all blocks (SIMD, see [`leaves`]), then one parent node a block.
fn tree_chain(ns_key: &[u8; 32], tokens: &[u32]) -> Vec<[u8; 32]> {
    let mut cvs = leaves(ns_key, tokens);
    let mode = blake3::hazmat::Mode::KeyedHash(ns_key);
    let mut cv = *ns_key;
    for leaf in &mut cvs {
        cv = blake3::hazmat::merge_subtrees_non_root(&cv, leaf, mode);
        *leaf = cv;
    }
    cvs
}

/// Where a chain stands after some whole blocks: enough to key the blocks that follow without
/// their predecessors' tokens. Engine events store a prompt a few engine blocks at a time, so
/// the keys of a prompt are made one 64-token block at a time as its tokens arrive; they are the
/// keys [`block_keys`] gives the whole prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChainState {
    /// The namespace's key (v3 leaves are keyed with it).
    ns_key: [u8; 32],
    /// The chaining value of the last block (`ns_key` before the first).
    cv: [u8; 32],
    /// The first 8 bytes of the chaining value of the current segment's first block.
    segment: [u8; 8],
    /// Whole blocks chained so far.
    blocks: u64,
}

impl ChainState {
    /// Before the first block of a chain seeded by `ns_key`.
    pub(crate) fn start(ns_key: &[u8; 32]) -> ChainState {
        ChainState { ns_key: *ns_key, cv: *ns_key, segment: [0; 8], blocks: 0 }
    }

    /// Whole blocks chained so far.
    pub(crate) fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Chains one whole block (`BLOCK_TOKENS` tokens) in `scheme` and returns its key.
    pub(crate) fn push(&mut self, scheme: Scheme, block: &[u32; BLOCK_TOKENS]) -> BlockKey {
        let mut buf = [0u8; 4 * BLOCK_TOKENS];
        let bytes = block_bytes(block, &mut buf);
        self.cv = match scheme {
            Scheme::KeyedChain => *blake3::keyed_hash(&self.cv, bytes).as_bytes(),
            Scheme::TreeChain => {
                let mode = blake3::hazmat::Mode::KeyedHash(&self.ns_key);
                let leaf =
                    blake3::hazmat::HasherExt::finalize_non_root(blake3::Hasher::new_keyed(&self.ns_key).update(bytes));
                blake3::hazmat::merge_subtrees_non_root(&self.cv, &leaf, mode)
            }
        };
        if self.blocks.is_multiple_of(SEGMENT_BLOCKS as u64) {
            self.segment.copy_from_slice(&self.cv[..8]);
        }
        self.blocks += 1;
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.segment);
        out[8..].copy_from_slice(&self.cv[..8]);
        out
    }
}

impl ChainState {
    /// The namespace's key the chain is seeded and keyed with.
    pub(crate) fn ns_key(&self) -> &[u8; 32] {
        &self.ns_key
    }

    /// The key of the last block chained (`None` before the first): what [`ChainState::push`]
    /// returned for it.
    pub(crate) fn last_key(&self) -> Option<BlockKey> {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&self.segment);
        out[8..].copy_from_slice(&self.cv[..8]);
        (self.blocks > 0).then_some(out)
    }

    /// Appends its [`CHAIN_STATE_BYTES`] bytes: blocks chained (`u64` little-endian), the
    /// namespace's key, the chaining value, the segment's first 8 bytes.
    pub(crate) fn write(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.blocks.to_le_bytes());
        out.extend_from_slice(&self.ns_key);
        out.extend_from_slice(&self.cv);
        out.extend_from_slice(&self.segment);
    }

    /// Reads what [`ChainState::write`] wrote at the start of `bytes`; `None` if too short.
    pub(crate) fn read(bytes: &[u8]) -> Option<ChainState> {
        let blocks = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?);
        let ns_key = bytes.get(8..40)?.try_into().ok()?;
        let cv = bytes.get(40..72)?.try_into().ok()?;
        let segment = bytes.get(72..CHAIN_STATE_BYTES)?.try_into().ok()?;
        Some(ChainState { ns_key, cv, segment, blocks })
    }
}

/// Bytes of a written [`ChainState`].
pub(crate) const CHAIN_STATE_BYTES: usize = 80;

/// Each of `inputs` hashed as `blake3::keyed_hash(ns_key, input)` gives (one chunk each, at
/// most 1,024 bytes), as many at once as the CPU has SIMD lanes.
pub(crate) fn keyed_roots<const N: usize>(ns_key: &[u8; 32], inputs: &[[u8; N]]) -> Vec<[u8; 32]> {
    let key = blake3::platform::words_from_le_bytes_32(ns_key);
    let platform = blake3::platform::Platform::detect();
    let refs: Vec<&[u8; N]> = inputs.iter().collect();
    let mut hashed = vec![0u8; 32 * inputs.len()];
    platform.hash_many(
        &refs,
        &key,
        0,
        blake3::IncrementCounter::No,
        KEYED_HASH,
        CHUNK_START,
        CHUNK_END | ROOT,
        &mut hashed,
    );
    hashed.chunks_exact(32).map(|h| <[u8; 32]>::try_from(h).unwrap_or_default()).collect()
}

/// BLAKE3's keyed-mode flag, and the flags of a chunk's first and last block (the BLAKE3 spec,
/// section 2.1). A unit test checks the leaves against the public `hazmat` API.
const KEYED_HASH: u8 = 1 << 4;
const CHUNK_START: u8 = 1;
const CHUNK_END: u8 = 1 << 1;
const ROOT: u8 = 1 << 3;

/// The v3 leaf of every whole block: the chunk chaining value of its bytes in keyed mode,
/// chunk counter 0. Blocks of each width are hashed together by blake3's `hash_many` (as many
/// at once as the CPU has SIMD lanes: 16 with AVX-512), which gives exactly what
/// `Hasher::new_keyed(ns_key).update(bytes).finalize_non_root()` gives one block at a time.
/// `hash_many` is public but undocumented in blake3, which is why the version is pinned and
/// `leaves_match_the_public_api` compares the two.
fn leaves(ns_key: &[u8; 32], tokens: &[u32]) -> Vec<[u8; 32]> {
    let blocks = tokens.chunks_exact(BLOCK_TOKENS);
    let mut out = vec![[0u8; 32]; blocks.len()];
    let key = blake3::platform::words_from_le_bytes_32(ns_key);
    let platform = blake3::platform::Platform::detect();
    // Every real vocabulary: all blocks 3 bytes a token, hashed straight into their places.
    if blocks.clone().all(narrow) {
        hash_width::<{ 3 * BLOCK_TOKENS }>(&platform, &key, blocks, out.as_flattened_mut());
        return out;
    }
    // Each block beside the place of its leaf in `out`, split by width.
    let (narrow_blocks, wide_blocks): (Vec<_>, Vec<_>) = out.iter_mut().zip(blocks).partition(|(_, b)| narrow(b));
    for split in [narrow_blocks, wide_blocks] {
        let mut hashed = vec![0u8; 32 * split.len()];
        let of = split.iter().map(|(_, block)| *block);
        match split.first().is_some_and(|(_, b)| narrow(b)) {
            true => hash_width::<{ 3 * BLOCK_TOKENS }>(&platform, &key, of, &mut hashed),
            false => hash_width::<{ 4 * BLOCK_TOKENS }>(&platform, &key, of, &mut hashed),
        }
        for (leaf, (place, _)) in hashed.chunks_exact(32).zip(split) {
            place.copy_from_slice(leaf);
        }
    }
    out
}

/// Hashes `blocks` (each `N / BLOCK_TOKENS` bytes a token) into `hashed`, 32 bytes a block.
fn hash_width<'b, const N: usize>(
    platform: &blake3::platform::Platform,
    key: &[u32; 8],
    blocks: impl ExactSizeIterator<Item = &'b [u32]>,
    hashed: &mut [u8],
) {
    if blocks.len() == 0 {
        return;
    }
    let mut bytes = vec![[0u8; N]; blocks.len()];
    for (dst, block) in bytes.iter_mut().zip(blocks) {
        pack(block, dst);
    }
    let inputs: Vec<&[u8; N]> = bytes.iter().collect();
    platform.hash_many(&inputs, key, 0, blake3::IncrementCounter::No, KEYED_HASH, CHUNK_START, CHUNK_END, hashed);
}

/// Writes a block's tokens into `dst`, each token's low bytes little-endian: 3 bytes each when
/// `dst` is 3 bytes a token (every token then below 2^24), else 4. Four 3-byte tokens are three
/// little-endian words.
fn pack<const N: usize>(block: &[u32], dst: &mut [u8; N]) {
    if N == 3 * BLOCK_TOKENS {
        for (d, t) in dst.chunks_exact_mut(12).zip(block.chunks_exact(4)) {
            let &[a, b, c, e] = t else { continue };
            let words = [a | b << 24, b >> 8 | c << 16, c >> 16 | e << 8];
            for (d, w) in d.chunks_exact_mut(4).zip(words) {
                d.copy_from_slice(&w.to_le_bytes());
            }
        }
    } else {
        for (d, t) in dst.chunks_exact_mut(4).zip(block) {
            d.copy_from_slice(&t.to_le_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]
    use super::*;
    use crate::keys::Namespace;

    const SCHEMES: [Scheme; 2] = [Scheme::KeyedChain, Scheme::TreeChain];

    fn chain(scheme: Scheme, model: &str, tenant: Option<&[u8]>, tokens: &[u32]) -> Vec<BlockKey> {
        Namespace::of(model, tenant).map(|n| n.chain_in(scheme, tokens)).unwrap_or_default()
    }

    #[test]
    fn chain_depends_on_model_tenant_and_every_earlier_token() {
        for scheme in SCHEMES {
            let tokens: Vec<u32> = (0..256).collect();
            let a = chain(scheme, "m", None, &tokens);
            let b = chain(scheme, "n", None, &tokens);
            let t = chain(scheme, "m", Some(b"t1"), &tokens);
            assert_eq!(a.len(), 4);
            assert!(a.iter().zip(&b).all(|(x, y)| x != y));
            assert!(a.iter().zip(&t).all(|(x, y)| x != y));
            let mut changed = tokens.clone();
            changed[3] = 99;
            let c = chain(scheme, "m", None, &changed);
            assert!(a.iter().zip(&c).all(|(x, y)| x != y), "{scheme:?}: a change in block 0 changes every later key");
            changed[3] = 3;
            changed[200] = 7;
            let d = chain(scheme, "m", None, &changed);
            assert_eq!(a[..3], d[..3]);
            assert_ne!(a[3], d[3]);
            // Swapping two blocks changes both keys from the first swapped block on.
            let mut swapped = tokens.clone();
            swapped[64..128].copy_from_slice(&tokens[128..192]);
            swapped[128..192].copy_from_slice(&tokens[64..128]);
            let e = chain(scheme, "m", None, &swapped);
            assert_eq!(a[0], e[0]);
            assert!(a[1..].iter().zip(&e[1..]).all(|(x, y)| x != y), "{scheme:?}: order matters");
        }
        let tokens: Vec<u32> = (0..256).collect();
        let (v2, v3) = (chain(Scheme::KeyedChain, "m", None, &tokens), chain(Scheme::TreeChain, "m", None, &tokens));
        assert!(v2.iter().zip(&v3).all(|(x, y)| x != y), "the schemes give different keys");
    }

    /// A chain keyed one block at a time from its state gives the keys of the whole prompt, in
    /// both schemes, across segment boundaries and with tokens of both widths.
    #[test]
    fn a_chain_pushed_block_by_block_gives_the_whole_prompts_keys() {
        let tokens: Vec<u32> = (0..64 * 40).map(|i: u32| if i % 97 == 5 { i + (1 << 25) } else { i * 7 }).collect();
        for scheme in SCHEMES {
            let ns = Namespace::with_tenant("m", b"t").expect("namespace");
            let want = ns.chain_in(scheme, &tokens);
            let mut state = ChainState::start(ns.key());
            let got: Vec<BlockKey> = tokens
                .chunks_exact(BLOCK_TOKENS)
                .map(|b| state.push(scheme, b.try_into().expect("a whole block")))
                .collect();
            assert_eq!(got, want, "{scheme:?}");
            assert_eq!(state.blocks(), 40);
        }
    }

    /// The v3 leaves (blake3's undocumented `hash_many`) and chain, recomputed with blake3's
    /// public API one block at a time, over blocks of both widths mixed in one prompt.
    #[test]
    fn leaves_match_the_public_api() {
        use blake3::hazmat::{HasherExt, Mode, merge_subtrees_non_root};
        let ns = Namespace::with_tenant("model", b"tenant").map_err(|e| e.to_string());
        let Ok(ns) = ns else { panic!("namespace") };
        // Pseudo-random ids of a 151,936-token vocabulary, from blake3's output stream.
        let mut stream = blake3::Hasher::new().update(b"leaves").finalize_xof();
        let tokens: Vec<u32> = (0..64 * 37)
            .map(|i| {
                let mut word = [0u8; 4];
                stream.fill(&mut word);
                // Blocks 3, 10, 11 and 36 hold a token above 2^24: 4-byte blocks among 3-byte ones.
                if [3, 10, 11, 36].contains(&(i / 64)) && i % 64 == 17 {
                    1 << 30
                } else {
                    u32::from_le_bytes(word) % 151_936
                }
            })
            .collect();
        let key = ns.key();
        let mut buf = [0u8; 4 * BLOCK_TOKENS];
        let mut cv = *key;
        let mut want = Vec::new();
        for (i, block) in tokens.chunks_exact(BLOCK_TOKENS).enumerate() {
            let bytes = block_bytes(block, &mut buf);
            assert_eq!(bytes.len() == 4 * BLOCK_TOKENS, [3, 10, 11, 36].contains(&i));
            let leaf = blake3::Hasher::new_keyed(key).update(bytes).finalize_non_root();
            assert_eq!(leaves(key, &tokens)[i], leaf, "leaf {i}");
            cv = merge_subtrees_non_root(&cv, &leaf, Mode::KeyedHash(key));
            want.push(cv);
        }
        assert_eq!(tree_chain(key, &tokens), want);
        assert!(leaves(key, &[]).is_empty() && leaves(key, &tokens[..63]).is_empty());
        // A block's bytes are each token's low 3 (or 4) bytes, little-endian, in order.
        let block = &tokens[..BLOCK_TOKENS];
        let want: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes().into_iter().take(3)).collect();
        assert_eq!(block_bytes(block, &mut buf), &want[..]);
        let wide = &tokens[3 * BLOCK_TOKENS..4 * BLOCK_TOKENS];
        let want: Vec<u8> = wide.iter().flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(block_bytes(wide, &mut buf), &want[..]);
        // All 3 bytes a token (the whole prompt hashed at once), a partial block left out.
        let narrow_tokens: Vec<u32> = tokens.iter().map(|t| t % (1 << 24)).chain([7; 13]).collect();
        let all = leaves(key, &narrow_tokens);
        assert_eq!(all.len(), 37);
        for (i, block) in narrow_tokens.chunks_exact(BLOCK_TOKENS).enumerate() {
            let bytes = block_bytes(block, &mut buf);
            assert_eq!(bytes.len(), 3 * BLOCK_TOKENS);
            assert_eq!(all[i], blake3::Hasher::new_keyed(key).update(bytes).finalize_non_root(), "narrow leaf {i}");
        }
    }

    #[test]
    fn blocks_of_a_segment_share_the_first_half_of_their_keys() {
        let tokens: Vec<u32> = (0..64 * 40).collect();
        let keys = chain(Scheme::TreeChain, "m", None, &tokens);
        assert_eq!(keys.len(), 40);
        for (i, key) in keys.iter().enumerate() {
            let first = &keys[i / SEGMENT_BLOCKS * SEGMENT_BLOCKS];
            assert_eq!(key[..8], first[..8], "block {i}");
            assert_eq!(
                key[8..] == key[..8],
                i % SEGMENT_BLOCKS == 0,
                "block {i}: only a segment's first block names itself"
            );
        }
        assert_ne!(keys[0][..8], keys[16][..8], "each segment has its own first half");
        let distinct: std::collections::HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), keys.len());
    }

    #[test]
    fn a_token_above_2_pow_24_changes_the_encoding_not_the_uniqueness() {
        let ns = Namespace::new("m").map_err(|e| e.to_string());
        let Ok(ns) = ns else { panic!("namespace") };
        let narrow: Vec<u32> = (0..128).collect();
        let mut wide = narrow.clone();
        wide[5] = 1 << 24;
        let mut wrapped = narrow.clone();
        wrapped[5] = 0; // 2^24 truncated to 3 bytes would be 0: must not collide
        for scheme in SCHEMES {
            let (a, b, c) = (ns.chain_in(scheme, &narrow), ns.chain_in(scheme, &wide), ns.chain_in(scheme, &wrapped));
            assert_ne!(b[0], c[0]);
            assert_ne!(a[0], b[0]);
            assert_eq!(a.len(), 2);
        }
    }
}
