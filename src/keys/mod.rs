//! The keys layer: namespaces, the block chains that turn tokens into keys, and 0.1.7's keys.
//! Depends on nothing in the crate but `error`.

mod chain;
mod fine;
mod key_hasher;
mod legacy;
mod namespace;
mod prefix;

#[cfg(test)]
pub(crate) use chain::HASH_SCHEME_V2;
pub use chain::{BLOCK_TOKENS, BlockKey, HASH_SCHEME, MIN_BLOCKS};
pub(crate) use chain::{CHAIN_STATE_BYTES, ChainState, Scheme};
pub(crate) use fine::{FinePosition, fine_keys};
pub(crate) use key_hasher::KeyMap;
pub(crate) use legacy::{is_legacy, legacy_chain, legacy_key};
pub(crate) use namespace::check_node;
pub use namespace::{MAX_MODEL_BYTES, MAX_NODE_BYTES, MAX_TENANT_BYTES, Namespace};
pub use prefix::Prefix;

/// Lower-case hex of some bytes (a key, an id), for messages and `Debug`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
