//! Prefix hashing: the chain of 64-token blocks, seeded by the model (and tenant).
//!
//! Block `i`'s chained value is `cv[i] = blake3::keyed_hash(cv[i-1], bytes(block i))`: the
//! previous block's 32-byte output is the key of the next. `bytes` is each token as 3 bytes LE
//! when all 64 tokens are below 2^24 (every real vocabulary: 192 bytes, three blake3
//! compressions), else each as 4 bytes LE (256 bytes); the two lengths never collide. The chain starts from `cv[-1] = ns_key =
//! blake3::derive_key(NS_CONTEXT, len(model) ‖ model ‖ len(tenant) ‖ tenant)`. Its key is
//! `cv[s][..8] ‖ cv[i][..8]`, with `s` the first block of its segment of [`SEGMENT_BLOCKS`]: the
//! blocks of one segment of one conversation share their first 8 bytes, so they sit side by side
//! in the B-tree and a `ran` touches a few leaf pages instead of one per block. A key names the
//! model, the tenant and every token before it.

use std::sync::Arc;

use crate::error::{Error, Result};

/// Tokens per block a prefix is matched in (as in 0.1.7).
pub const BLOCK_TOKENS: usize = 64;
/// A prefix shorter than this many blocks is not worth routing for (as in 0.1.7).
pub const MIN_BLOCKS: usize = 2;
/// Longest model name accepted, in bytes.
pub const MAX_MODEL_BYTES: usize = 1024;
/// Longest tenant salt accepted, in bytes.
pub const MAX_TENANT_BYTES: usize = 1024;
/// The name of the hash scheme written in the meta record.
pub const HASH_SCHEME: &str = "blake3-keyed-chain-seg16/v2";
/// Blocks per segment: the blocks of a segment share the first half of their keys.
pub const SEGMENT_BLOCKS: usize = 16;

const NS_CONTEXT: &str = "superfluid-warm 2026-12 prefix namespace v1";

/// A key of the prefix table: 16 bytes of a block's chained hash.
pub type BlockKey = [u8; 16];

/// Where a prefix lives: a model, and optionally a tenant whose prefixes nobody else shares.
/// Cheap to clone.
#[derive(Clone, PartialEq, Eq)]
pub struct Namespace {
    inner: Arc<NamespaceInner>,
}

#[derive(PartialEq, Eq)]
struct NamespaceInner {
    model: String,
    tenant: Option<Vec<u8>>,
    key: [u8; 32],
    id: [u8; 8],
}

impl std::fmt::Debug for Namespace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the tenant salt or the key.
        f.debug_struct("Namespace")
            .field("model", &self.inner.model)
            .field("tenant", &self.inner.tenant.is_some())
            .field("id", &crate::inspect::hex(&self.inner.id))
            .finish()
    }
}

impl Namespace {
    /// The namespace of a model shared by everyone.
    ///
    /// # Errors
    /// [`Error::InvalidName`] if `model` is empty or over [`MAX_MODEL_BYTES`].
    pub fn new(model: &str) -> Result<Namespace> {
        Self::build(model, None)
    }

    /// The namespace of a model for one tenant: two tenants never share a prefix, even for the
    /// same model and tokens.
    ///
    /// # Errors
    /// [`Error::InvalidName`] if `model` or `tenant` is empty or over its limit.
    pub fn with_tenant(model: &str, tenant: &[u8]) -> Result<Namespace> {
        check_len("tenant", tenant.len(), MAX_TENANT_BYTES)?;
        Self::build(model, Some(tenant))
    }

    fn build(model: &str, tenant: Option<&[u8]>) -> Result<Namespace> {
        check_len("model", model.len(), MAX_MODEL_BYTES)?;
        let mut material = Vec::with_capacity(16 + model.len() + tenant.map_or(0, <[u8]>::len));
        material.extend_from_slice(&(model.len() as u64).to_le_bytes());
        material.extend_from_slice(model.as_bytes());
        match tenant {
            Some(t) => {
                material.push(1);
                material.extend_from_slice(&(t.len() as u64).to_le_bytes());
                material.extend_from_slice(t);
            }
            None => material.push(0),
        }
        let key = blake3::derive_key(NS_CONTEXT, &material);
        let mut id = [0; 8];
        id.copy_from_slice(&blake3::hash(&key).as_bytes()[..8]);
        Ok(Namespace {
            inner: Arc::new(NamespaceInner { model: model.to_string(), tenant: tenant.map(<[u8]>::to_vec), key, id }),
        })
    }

    /// The model name.
    pub fn model(&self) -> &str {
        &self.inner.model
    }

    /// Whether this namespace is a tenant's own.
    pub fn has_tenant(&self) -> bool {
        self.inner.tenant.is_some()
    }

    /// A short public id of this namespace (never the tenant salt): the first 8 bytes of a hash
    /// of its key.
    pub fn id(&self) -> [u8; 8] {
        self.inner.id
    }

    /// The key of every whole block of `tokens`, in order.
    pub fn chain(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let blocks = tokens.len() / BLOCK_TOKENS;
        let mut out = Vec::with_capacity(blocks);
        let mut cv = self.inner.key;
        let mut segment = [0u8; 8];
        let mut buf = [0u8; 4 * BLOCK_TOKENS];
        for (i, block) in tokens.chunks_exact(BLOCK_TOKENS).enumerate() {
            let bytes = if block.iter().all(|&t| t < 1 << 24) {
                for (dst, t) in buf.chunks_exact_mut(3).zip(block) {
                    dst.copy_from_slice(&t.to_le_bytes()[..3]);
                }
                &buf[..3 * BLOCK_TOKENS]
            } else {
                for (dst, t) in buf.chunks_exact_mut(4).zip(block) {
                    dst.copy_from_slice(&t.to_le_bytes());
                }
                &buf[..]
            };
            cv = *blake3::keyed_hash(&cv, bytes).as_bytes();
            if i % SEGMENT_BLOCKS == 0 {
                segment.copy_from_slice(&cv[..8]);
            }
            let mut key = [0u8; 16];
            key[..8].copy_from_slice(&segment);
            key[8..].copy_from_slice(&cv[..8]);
            out.push(key);
        }
        out
    }
}

/// Checks a name's length against its limit.
pub(crate) fn check_len(what: &'static str, len: usize, max: usize) -> Result<()> {
    if len == 0 || len > max {
        return Err(Error::InvalidName { what, len, max });
    }
    Ok(())
}

/// The hashes of a prompt's whole blocks, computed once and used for both `warmest` and `ran`.
#[derive(Clone, Debug)]
pub struct Prefix {
    pub(crate) namespace: Namespace,
    pub(crate) blocks: Vec<BlockKey>,
    /// The 0.1.7 FNV-1a chain, only while imported 0.1.7 entries remain.
    pub(crate) legacy: Vec<BlockKey>,
}

impl Prefix {
    /// The prefix of `tokens` in `namespace`, without the 0.1.7 chain. Use
    /// [`crate::Warm::prefix`] to get one that also matches entries imported from 0.1.7.
    pub fn new(namespace: &Namespace, tokens: &[u32]) -> Prefix {
        Prefix { namespace: namespace.clone(), blocks: namespace.chain(tokens), legacy: Vec::new() }
    }

    /// Whole blocks in the prompt.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Tokens covered by whole blocks.
    pub fn tokens(&self) -> usize {
        self.blocks.len() * BLOCK_TOKENS
    }

    /// The namespace this prefix was hashed in.
    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }
}

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

/// The 0.1.7 chain (FNV-1a 64 over the model, then every token's LE bytes), as stored keys.
pub(crate) fn legacy_chain(model: &str, tokens: &[u32]) -> Vec<BlockKey> {
    crate::baseline::chain(model, tokens).map(legacy_key).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_depends_on_model_tenant_and_every_earlier_token() {
        let tokens: Vec<u32> = (0..256).collect();
        let a = Namespace::new("m").map(|n| n.chain(&tokens)).unwrap_or_default();
        let b = Namespace::new("n").map(|n| n.chain(&tokens)).unwrap_or_default();
        let t = Namespace::with_tenant("m", b"t1").map(|n| n.chain(&tokens)).unwrap_or_default();
        assert_eq!(a.len(), 4);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert!(a.iter().zip(&t).all(|(x, y)| x != y));
        let mut changed = tokens.clone();
        changed[3] = 99;
        let c = Namespace::new("m").map(|n| n.chain(&changed)).unwrap_or_default();
        assert!(a.iter().zip(&c).all(|(x, y)| x != y), "a change in block 0 changes every later key");
        changed[3] = 3;
        changed[200] = 7;
        let d = Namespace::new("m").map(|n| n.chain(&changed)).unwrap_or_default();
        assert_eq!(a[..3], d[..3]);
        assert_ne!(a[3], d[3]);
    }

    #[test]
    fn blocks_of_a_segment_share_the_first_half_of_their_keys() {
        let tokens: Vec<u32> = (0..64 * 40).collect();
        let keys = Namespace::new("m").map(|n| n.chain(&tokens)).unwrap_or_default();
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
        let (a, b, c) = (ns.chain(&narrow), ns.chain(&wide), ns.chain(&wrapped));
        assert_ne!(b[0], c[0]);
        assert_ne!(a[0], b[0]);
        assert_eq!(a.len(), 2);
    }
}
