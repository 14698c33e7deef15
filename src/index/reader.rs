//! `Reader`: the answers of a file's last commit without a head, for a process that only asks
//! (`superfluid-warm ask`), on a closed file or one a head is writing. The same read path as a
//! head's (`answer.rs`), over the decided state and the committed view read from one snapshot.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::answer;
use super::front::{Front, Published, View};
use super::layer::Layers;
use super::others::OthersCache;
use super::read_index::ReadIndex;
use super::warm::Hit;
use crate::error::{Error, Result, redb_err};
use crate::file::owner::Owner;
use crate::file::snapshot::Snapshot;
use crate::keys::{Namespace, Prefix, Scheme};
use crate::store::schema;
use crate::store::tables::{OTHERS, PREFIXES};
use crate::store::writer::MAX_NODES_PER_PREFIX;

/// A file's answers as of its last commit, read-only: what a head would answer had it just
/// opened the file (a `ran`'s claim on a node with an engine stream has expired; the node
/// caches and engine streams are the file's). Open another to see later commits.
pub struct Reader {
    front: Mutex<Front>,
    /// Its copy of the others it has read.
    others: Mutex<OthersCache>,
    scheme: Scheme,
    legacy: bool,
    /// The block sizes of the hybrid engines' holdings (a prompt's fine keys are made at each).
    hybrid_sizes: Vec<usize>,
    /// The process that opened it: a fork's child finds its locks as the parent's threads left
    /// them, so it is refused ([`Error::Forked`]).
    owner: Owner,
    /// The snapshot the answers are read from (its lock keeps a head from rewriting the file
    /// under a reader of a closed one).
    _snapshot: Snapshot,
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader").field("scheme", &self.scheme.name()).finish_non_exhaustive()
    }
}

impl Reader {
    /// Opens `path` read-only at its last commit (verified first as [`Snapshot::open`] does).
    ///
    /// # Errors
    /// As [`Snapshot::open`]; [`Error::UnknownFormat`] for a file older than schema 4 (a head
    /// upgrades it when it opens it).
    pub fn open(path: impl AsRef<Path>) -> Result<Reader> {
        let snapshot = Snapshot::open(path)?;
        let (read, meta) = snapshot.read();
        let scheme = schema::check(meta)?;
        if meta.schema < 4 {
            return Err(Error::unknown_format(format!(
                "schema {} (open it with a head once: it is upgraded in place)",
                meta.schema
            )));
        }
        let decided = crate::store::load::read_decided(read, scheme)?;
        let prefixes = read.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
        let others = read.open_table(OTHERS).map_err(redb_err("opening the others"))?;
        let published = Published {
            entries: meta.entries,
            legacy_entries: meta.legacy_entries,
            capacity: meta.capacity,
            held: Arc::from(Vec::new()),
        };
        let view = View { version: 0, tables: Arc::new((prefixes, others)), presence: None, published };
        let legacy = meta.legacy_entries > 0;
        // Every node a block keeps is read: how many a head keeps is its own setting.
        let others = Mutex::new(OthersCache::of(&view.tables));
        let hybrid_sizes = decided.engines.hybrid_sizes();
        let front = Front::new(decided, view, MAX_NODES_PER_PREFIX, crate::DEFAULT_ENGINE_GRACE);
        Ok(Reader {
            front: Mutex::new(front),
            others,
            scheme,
            legacy,
            hybrid_sizes,
            owner: Owner::current(),
            _snapshot: snapshot,
        })
    }
}

impl Reader {
    /// As [`crate::Builder::attention_chunk`], for this reader's answers.
    pub fn set_attention_chunk(&self, tokens: usize) {
        let mut front = self.front.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        front.decided.engines.set_attention_chunk(Some(tokens));
    }
}

impl ReadIndex for Reader {
    fn prefix(&self, namespace: &Namespace, tokens: &[u32]) -> Prefix {
        answer::prefix(self.scheme, self.legacy, &self.hybrid_sizes, namespace, tokens)
    }

    fn warmest_prefix(&self, prefix: &Prefix) -> Result<Option<Hit>> {
        self.owner.check()?;
        answer::same_scheme(self.scheme, prefix)?;
        answer::answer_with(&self.front, &self.others, prefix, false, |front, read| {
            answer::warmest(front, &Layers::new(front, None), prefix, read)
        })
    }

    fn warm_nodes_prefix(&self, prefix: &Prefix) -> Result<Vec<Hit>> {
        self.owner.check()?;
        answer::same_scheme(self.scheme, prefix)?;
        answer::answer_with(&self.front, &self.others, prefix, true, |front, read| {
            answer::warm_nodes(front, &Layers::new(front, None), prefix, read)
        })
    }
}
