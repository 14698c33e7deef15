//! `Prefix`: a prompt's block keys, hashed once per request.

use super::chain::{BLOCK_TOKENS, BlockKey, Scheme};
use super::namespace::Namespace;

/// The hashes of a prompt's whole blocks, computed once and used for both `warmest` and `ran`.
#[derive(Clone, Debug)]
pub struct Prefix {
    pub(crate) namespace: Namespace,
    /// The scheme `blocks` were hashed in (the file's).
    pub(crate) scheme: Scheme,
    pub(crate) blocks: Vec<BlockKey>,
    /// The 0.1.7 FNV-1a chain, only while imported 0.1.7 entries remain.
    pub(crate) legacy: Vec<BlockKey>,
    /// The fine keys (`keys/fine.rs`) at each block size of the index's hybrid engines, one per
    /// whole engine block: none while it follows no hybrid engine.
    pub(crate) fine: Vec<(usize, Vec<BlockKey>)>,
    /// The prompt's length in tokens (what a hybrid engine reuses depends on it).
    pub(crate) len: usize,
}

impl Prefix {
    /// The prefix of `tokens` in `namespace`, in the scheme of new files, without the 0.1.7
    /// chain. Use [`crate::ReadIndex::prefix`] to get one in the scheme of the index's file that also
    /// matches entries imported from 0.1.7.
    pub fn new(namespace: &Namespace, tokens: &[u32]) -> Prefix {
        Prefix::in_scheme(Scheme::TreeChain, namespace, tokens)
    }

    pub(crate) fn in_scheme(scheme: Scheme, namespace: &Namespace, tokens: &[u32]) -> Prefix {
        Prefix {
            namespace: namespace.clone(),
            scheme,
            blocks: namespace.chain_in(scheme, tokens),
            legacy: Vec::new(),
            fine: Vec::new(),
            len: tokens.len(),
        }
    }

    #[cfg(feature = "nats")]
    /// A prefix of keys hashed elsewhere (another head's event), in `scheme`.
    pub(crate) fn from_keys(scheme: Scheme, namespace: Namespace, blocks: Vec<BlockKey>) -> Prefix {
        let len = blocks.len() * BLOCK_TOKENS;
        Prefix { namespace, scheme, blocks, legacy: Vec::new(), fine: Vec::new(), len }
    }

    #[cfg(feature = "nats")]
    /// The block keys, in chain order.
    pub(crate) fn keys(&self) -> &[BlockKey] {
        &self.blocks
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
