//! `Warm`: the index a head links. Shared by reference (`&self`), `Send + Sync`.

use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use redb::Database;

use crate::builder::Builder;
use crate::chain::{BLOCK_TOKENS, MIN_BLOCKS, Namespace, Prefix, legacy_chain};
use crate::error::{Error, Result};
use crate::legacy::{self, ImportReport};
use crate::state::State;

/// The node that ran the longest remembered prefix of a prompt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hit {
    /// The node's name.
    pub node: String,
    /// How many tokens of the prompt that prefix is (a multiple of 64, at least 128).
    pub tokens: usize,
}

/// What the index holds, as of the last `ran` (committed or not).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Entries (block hashes) held.
    pub entries: u64,
    /// Of those, imported from 0.1.7 and not yet evicted.
    pub legacy_entries: u64,
    /// Most entries kept.
    pub capacity: u64,
    /// The clock of the last `ran`.
    pub clock: u64,
    /// Every node ever seen, by id.
    pub nodes: Vec<String>,
    /// Whether changes are waiting for a commit.
    pub pending: bool,
}

pub(crate) struct Inner {
    pub db: Database,
    pub state: Mutex<State>,
    pub wake: Condvar,
    pub window: Duration,
}

/// Which node last ran each prompt prefix, kept in a redb file.
///
/// ```no_run
/// # fn main() -> Result<(), superfluid_warm::Error> {
/// let warm = superfluid_warm::Warm::open("warm.redb")?;
/// let prompt: Vec<u32> = (0..300).collect();
/// warm.ran("llama-3-8b", &prompt, "node-a")?;
/// let hit = warm.warmest("llama-3-8b", &prompt)?;
/// assert_eq!(hit.map(|h| h.tokens), Some(256));
/// warm.sync()?; // durable now; otherwise within the sync window
/// # Ok(()) }
/// ```
pub struct Warm {
    inner: Arc<Inner>,
    flusher: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Warm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Warm").field("window", &self.inner.window).finish_non_exhaustive()
    }
}

impl Warm {
    /// Opens (or creates) the index at `path` with the default settings.
    ///
    /// # Errors
    /// See [`Builder::open`].
    pub fn open(path: impl AsRef<Path>) -> Result<Warm> {
        Builder::new().open(path)
    }

    /// A builder for the settings.
    pub fn builder() -> Builder {
        Builder::new()
    }

    pub(crate) fn start(db: Database, state: State, window: Duration) -> Result<Warm> {
        let inner = Arc::new(Inner { db, state: Mutex::new(state), wake: Condvar::new(), window });
        let flusher = if window.is_zero() {
            None
        } else {
            let for_thread = Arc::clone(&inner);
            let handle = std::thread::Builder::new()
                .name("superfluid-warm-commit".into())
                .spawn(move || flush_loop(&for_thread))
                .map_err(|source| Error::Io { path: "<commit thread>".into(), source })?;
            Some(handle)
        };
        Ok(Warm { inner, flusher })
    }

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
        self.inner.state.lock().map_err(|_| Error::Poisoned)
    }

    /// Hashes `tokens` in `namespace` once, for [`Warm::warmest_prefix`] and [`Warm::ran_prefix`].
    /// While entries imported from 0.1.7 remain, the 0.1.7 chain is computed too.
    ///
    /// # Errors
    /// [`Error::Poisoned`] only.
    pub fn prefix(&self, namespace: &Namespace, tokens: &[u32]) -> Result<Prefix> {
        let mut prefix = Prefix::new(namespace, tokens);
        if !namespace.has_tenant() && tokens.len() >= BLOCK_TOKENS && self.lock()?.meta.legacy_entries > 0 {
            prefix.legacy = legacy_chain(namespace.model(), tokens);
        }
        Ok(prefix)
    }

    /// The node that ran the longest remembered prefix of `tokens` for `model`, and how many
    /// tokens that prefix is; `None` under two blocks (128 tokens). Sees every `ran` that returned.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long model name; [`Error::Storage`] if the
    /// file cannot be read.
    pub fn warmest(&self, model: &str, tokens: &[u32]) -> Result<Option<Hit>> {
        let prefix = self.prefix(&Namespace::new(model)?, tokens)?;
        self.warmest_prefix(&prefix)
    }

    /// [`Warm::warmest`] for a prefix hashed by [`Warm::prefix`].
    ///
    /// # Errors
    /// [`Error::Storage`] if the file cannot be read.
    pub fn warmest_prefix(&self, prefix: &Prefix) -> Result<Option<Hit>> {
        if prefix.blocks.len() < MIN_BLOCKS {
            return Ok(None);
        }
        let state = self.lock()?;
        let found = state.lookup(&self.inner.db, prefix)?;
        Ok(found.filter(|&(_, blocks)| blocks >= MIN_BLOCKS).map(|(entry, blocks)| Hit {
            node: state.nodes.name(entry.node).unwrap_or("?").to_string(),
            tokens: blocks * BLOCK_TOKENS,
        }))
    }

    /// Records that `node` ran `tokens` for `model`: every whole block of it now points at
    /// `node`. Atomic: after any crash either all of its blocks are there or none. Durable after
    /// the next [`Warm::sync`], or at most the sync window after it returns.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long model or node name;
    /// [`Error::CommitFailed`] if a background commit failed since the last call (this call did
    /// nothing); [`Error::Storage`] if the file cannot be written (this call did nothing, and the
    /// rans not yet committed were lost).
    pub fn ran(&self, model: &str, tokens: &[u32], node: &str) -> Result<()> {
        let prefix = self.prefix(&Namespace::new(model)?, tokens)?;
        self.ran_prefix(&prefix, node)
    }

    /// [`Warm::ran`] for a prefix hashed by [`Warm::prefix`].
    ///
    /// # Errors
    /// As [`Warm::ran`].
    pub fn ran_prefix(&self, prefix: &Prefix, node: &str) -> Result<()> {
        let mut state = self.lock()?;
        if let Some(detail) = state.failed.take() {
            return Err(Error::CommitFailed { detail });
        }
        let was_clean = state.dirty_since.is_none();
        state.ran(&self.inner.db, prefix, node)?;
        if self.flusher.is_none() {
            state.commit(&self.inner.db)?;
        } else if was_clean {
            self.inner.wake.notify_one();
        }
        Ok(())
    }

    /// Makes every `ran` so far durable (0.1.7's `save`). Cheap when nothing changed.
    ///
    /// # Errors
    /// [`Error::CommitFailed`] if a background commit failed since the last call;
    /// [`Error::Storage`] if this commit fails. Either way what was committed before is intact.
    pub fn sync(&self) -> Result<()> {
        let mut state = self.lock()?;
        if let Some(detail) = state.failed.take() {
            return Err(Error::CommitFailed { detail });
        }
        state.commit(&self.inner.db)
    }

    /// Imports a 0.1.7 `warm.json` in one transaction, committed before it returns: its prefixes
    /// are answered (through the 0.1.7 hash) until they age out. Importing the same file twice
    /// does nothing the second time. The JSON file is only read.
    ///
    /// # Errors
    /// [`Error::Io`] or [`Error::LegacyJson`] for a file that cannot be read or parsed (the
    /// index is unchanged); [`Error::Storage`] if the commit fails.
    pub fn import_json(&self, path: impl AsRef<Path>) -> Result<ImportReport> {
        let file = legacy::read(path.as_ref())?;
        let mut state = self.lock()?;
        state.commit(&self.inner.db)?;
        let report = state.import(&self.inner.db, &file)?;
        state.commit(&self.inner.db)?;
        Ok(report)
    }

    /// Counts and settings, as of the last `ran`.
    ///
    /// # Errors
    /// [`Error::Poisoned`] only.
    pub fn stats(&self) -> Result<Stats> {
        let state = self.lock()?;
        Ok(Stats {
            entries: state.meta.entries,
            legacy_entries: state.meta.legacy_entries,
            capacity: state.meta.capacity,
            clock: state.meta.clock,
            nodes: state.nodes.names.clone(),
            pending: state.dirty_since.is_some(),
        })
    }

    /// Commits what is pending, marks the file cleanly closed and closes it.
    ///
    /// # Errors
    /// As [`Warm::sync`].
    pub fn close(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        if let Ok(mut state) = self.inner.state.lock() {
            state.closing = true;
        }
        self.inner.wake.notify_all();
        if let Some(handle) = self.flusher.take() {
            // A flusher that panicked has nothing left to commit for us.
            let _ = handle.join();
        }
        let mut state = self.lock()?;
        if state.closing && state.meta.writer.is_some() {
            state.meta.writer = None;
            state.touch();
        }
        let failed = state.failed.take();
        state.commit(&self.inner.db)?;
        match failed {
            Some(detail) => Err(Error::CommitFailed { detail }),
            None => Ok(()),
        }
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        // Best effort: a caller who needs to know uses `close`.
        let _ = self.shutdown();
    }
}

/// The commit thread: commits the batch once its oldest change is a window old.
fn flush_loop(inner: &Inner) {
    let Ok(mut state) = inner.state.lock() else { return };
    loop {
        if state.closing {
            return;
        }
        let wait = match state.dirty_since {
            None => None,
            Some(since) => {
                let age = since.elapsed();
                if age >= inner.window {
                    if let Err(e) = state.commit(&inner.db) {
                        state.failed = Some(e.to_string());
                    }
                    continue;
                }
                Some(inner.window - age)
            }
        };
        let next = match wait {
            None => inner.wake.wait(state),
            Some(d) => inner.wake.wait_timeout(state, d).map(|(guard, _)| guard).map_err(|e| {
                let (guard, _) = e.into_inner();
                std::sync::PoisonError::new(guard)
            }),
        };
        match next {
            Ok(guard) => state = guard,
            Err(_) => return,
        }
    }
}
