//! `ReadIndex`: the read side of an index, what a head asks before it places a request. One
//! trait for a [`crate::Warm`] and a sharing head (`SharedWarm`), each answering in its own way.

use super::warm::Hit;
use crate::error::Result;
use crate::keys::{Namespace, Prefix};

/// What a head asks of an index before it places a request: bring it into scope
/// (`use superfluid_warm::ReadIndex`) to call these on a [`crate::Warm`].
pub trait ReadIndex {
    /// Hashes `tokens` in `namespace` once, for [`ReadIndex::warmest_prefix`],
    /// [`ReadIndex::warm_nodes_prefix`] and the `ran_prefix` of the index. While entries
    /// imported from 0.1.7 remain, the 0.1.7 chain is computed too.
    fn prefix(&self, namespace: &Namespace, tokens: &[u32]) -> Prefix;

    /// [`ReadIndex::warmest`] for a prefix hashed by [`ReadIndex::prefix`].
    ///
    /// # Errors
    /// [`crate::Error::ForeignPrefix`] for a prefix hashed in another scheme than the file's;
    /// [`crate::Error::Storage`] if the file cannot be read.
    fn warmest_prefix(&self, prefix: &Prefix) -> Result<Option<Hit>>;

    /// [`ReadIndex::warm_nodes`] for a prefix hashed by [`ReadIndex::prefix`].
    ///
    /// # Errors
    /// As [`ReadIndex::warmest_prefix`].
    fn warm_nodes_prefix(&self, prefix: &Prefix) -> Result<Vec<Hit>>;

    /// The node that ran the longest remembered prefix of `tokens` for `model`, and how many
    /// tokens that prefix is; `None` under two blocks (128 tokens). Sees every `ran` that
    /// returned.
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] for an empty or over-long model name; as
    /// [`ReadIndex::warmest_prefix`].
    fn warmest(&self, model: &str, tokens: &[u32]) -> Result<Option<Hit>> {
        self.warmest_prefix(&self.prefix(&Namespace::new(model)?, tokens))
    }

    /// Every remembered node that ran a prefix of `tokens` for `model` (at least two blocks),
    /// with how many tokens of it, longest first (ties: the newest first). Its first entry is
    /// [`ReadIndex::warmest`]'s answer. Each block keeps up to
    /// [`crate::Builder::nodes_per_prefix`] nodes; a forgotten node is never listed.
    ///
    /// # Errors
    /// As [`ReadIndex::warmest`].
    fn warm_nodes(&self, model: &str, tokens: &[u32]) -> Result<Vec<Hit>> {
        self.warm_nodes_prefix(&self.prefix(&Namespace::new(model)?, tokens))
    }
}
