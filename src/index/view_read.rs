//! What an answer reads of the committed view, read outside the callers' lock: the view's
//! remembered prefix of the prompt's chain as runs of equal clocks, the others rows of its
//! blocks, and 0.1.7's entries along the legacy chain. Under the lock an answer combines it
//! with the memtable and the decided state, which are in memory: the lock never reads the file.
//!
//! Why the parts can be read apart: every `ran` writes all the blocks of its prompt at one
//! clock, so the remembered blocks of the committed view alone are a prefix of the chain, and
//! so are the memtable's alone (ARCHITECTURE.md, invariant 3). The longest remembered prefix of
//! the two together is the longer of the two, and its last block is the newer source's. Clocks
//! never increase along a chain, so a floor raised after the read cuts its runs: the read stays
//! exact until the view is replaced, and an answer under the lock checks that it was not
//! ([`ViewRead::fits`]).

use std::sync::{Arc, Mutex};

use super::front::{Front, View};
use super::lookup::{Longest, runs, search};
use super::others::{OthersCache, Row};
use crate::error::{Error, Result, redb_err};
use crate::keys::{BlockKey, Prefix};
use crate::store::tables::{Entry, table_key};

/// The committed view's part of an answer about one prompt.
pub(crate) struct ViewRead {
    /// The version of the view it was read from.
    version: u64,
    /// The callers' floor when it was read: entries at or below it were not counted.
    floor: u64,
    /// The chains it is of: the last key and length of the prompt's chain and of its 0.1.7 chain.
    chain: [(Option<BlockKey>, usize); 2],
    /// The first block of the chain it was read from: 0 for the whole view, or the end of the
    /// memtable's remembered prefix (before it, the memtable's blocks are the newer).
    from: usize,
    /// The view's remembered prefix of the chain from block `from`, as runs of equal clocks:
    /// (the node and clock of the run, blocks).
    runs: Vec<((u32, u64), u64)>,
    /// Whether it was read whole: from the first block, with the others rows if blocks keep
    /// more than one node (what `warm_nodes` needs).
    whole: bool,
    /// The others rows of the blocks of that prefix (`None` for a block with none), if read.
    rows: Option<Vec<Option<Row>>>,
    /// 0.1.7's entries along the legacy chain, as stored, up to the first block the view lacks.
    legacy: Vec<(u32, u64)>,
}

impl ViewRead {
    /// Reads `view`'s part of an answer about `prefix` at floor `floor`: the `part` it needs.
    ///
    /// # Errors
    /// [`Error::Storage`] if a read of the file fails.
    pub(crate) fn read(view: &View, floor: u64, prefix: &Prefix, part: Part<'_>) -> Result<ViewRead> {
        let (from, whole, others) = match part {
            Part::From(from) => (from, false, None),
            Part::Whole(others) => (0, true, others),
        };
        // The view's remembered blocks past `from` are a prefix of the rest of the chain (its
        // remembered blocks are a prefix of the chain).
        let keys = prefix.blocks.get(from..).unwrap_or_default();
        let live = |key: &BlockKey| Ok::<_, Error>(stored(view, key)?.filter(|&(_, clock)| clock > floor));
        let found = search(keys, live)?;
        let runs = runs(keys, found, live, |&(_, clock)| clock)?;
        let rows = match others {
            Some(others) => {
                let len = found.map_or(0, |(_, n)| n);
                Some(read_rows(view, others, keys.get(..len).unwrap_or_default())?)
            }
            None => None,
        };
        let mut legacy = Vec::new();
        for key in &prefix.legacy {
            match stored(view, key)? {
                Some(entry) => legacy.push(entry),
                None => break,
            }
        }
        Ok(ViewRead { version: view.version, floor, chain: chains(prefix), from, whole, runs, rows, legacy })
    }

    /// Whether this read answers for `prefix` on a view of `version` (the whole view, if
    /// `whole`). A read from a later block stays good while the view is the same: the memtable
    /// only grows until a commit replaces the view, and where a raised floor cut its prefix
    /// short, the view's older blocks are cut too.
    pub(crate) fn is_for(&self, version: u64, prefix: &Prefix, whole: bool) -> bool {
        self.version == version && self.chain == chains(prefix) && (!whole || self.is_whole())
    }

    /// Whether this read still answers under `front`'s lock: the view it was read from is
    /// still the callers', and their floor has not gone below the one it was read with.
    pub(crate) fn fits(&self, front: &Front) -> bool {
        self.version == front.view().version && front.decided.horizon.floor >= self.floor
    }

    /// Whether it was read whole (what `warm_nodes` needs).
    pub(crate) fn is_whole(&self) -> bool {
        self.whole
    }

    /// The first block it was read from.
    pub(crate) fn from(&self) -> usize {
        self.from
    }

    /// The view's remembered prefix from block [`ViewRead::from`] as runs of equal clocks, at
    /// `front`'s floor now.
    pub(crate) fn runs<'a>(&'a self, front: &'a Front) -> impl Iterator<Item = ((u32, u64), u64)> + 'a {
        self.runs.iter().copied().take_while(|&((_, clock), _)| front.holds(clock))
    }

    /// The view's longest remembered prefix at `front`'s floor now, if it reaches past
    /// [`ViewRead::from`]: who ran its last block, and its length.
    pub(crate) fn longest(&self, front: &Front) -> Longest<(u32, u64)> {
        self.runs(front).fold(None, |at, (owner, n)| Some((owner, at.map_or(self.from, |(_, len)| len) + n as usize)))
    }

    /// The others of block `i` of the chain, as of the view (`None` past the view's remembered
    /// prefix, where every other is older than the floor).
    pub(crate) fn row(&self, i: usize) -> Option<&[(u32, u64)]> {
        self.rows.as_ref().and_then(|rows| rows.get(i)).and_then(Option::as_deref)
    }

    /// The view's entry of block `i` of the 0.1.7 chain, as stored.
    pub(crate) fn legacy(&self, i: usize) -> Option<(u32, u64)> {
        self.legacy.get(i).copied()
    }
}

/// What an answer needs of the view.
pub(crate) enum Part<'a> {
    /// The view's remembered prefix past block `n` (where the memtable's ends): enough for
    /// `warmest` and a `ran`'s runs.
    From(usize),
    /// The view's remembered prefix from the first block, and the others rows of its blocks
    /// through the copy, if given: what `warm_nodes` needs.
    Whole(Option<&'a Mutex<OthersCache>>),
}

/// The last key and length of `prefix`'s chain and of its 0.1.7 chain.
fn chains(prefix: &Prefix) -> [(Option<BlockKey>, usize); 2] {
    [(prefix.blocks.last().copied(), prefix.blocks.len()), (prefix.legacy.last().copied(), prefix.legacy.len())]
}

/// `key`'s entry in `view`, as stored: its node and clock (a key its filter does not hold is
/// not read).
fn stored(view: &View, key: &BlockKey) -> Result<Option<(u32, u64)>> {
    if view.presence.as_ref().is_some_and(|p| !p.may_hold(key)) {
        return Ok(None);
    }
    #[cfg(test)]
    probe::read();
    let entry = view.prefixes().get(table_key(key)).map_err(redb_err("reading a prefix"))?;
    Ok(entry.map(|g| Entry::from_tuple(g.value())).map(|e| (e.node, e.clock)))
}

/// The others rows of `keys` as of `view`: what the callers' copy lacks is read from the file
/// with no lock held, and kept in the copy if the copy is still of `view`'s commit.
fn read_rows(view: &View, others: &Mutex<OthersCache>, keys: &[BlockKey]) -> Result<Vec<Option<Row>>> {
    let lacking = others.lock().map_err(|_| Error::Poisoned)?.lacking(keys, false);
    let fetched = OthersCache::fetch(view.others(), keys, &lacking)?;
    let kept = others.lock().map_err(|_| Error::Poisoned)?.rows_with(&view.tables, keys, fetched);
    match kept {
        Some(rows) => Ok(rows),
        // The copy is of a newer commit (this read will not fit, but is still exact).
        None => {
            let fetched = OthersCache::fetch(view.others(), keys, &OthersCache::default().lacking(keys, true))?;
            Ok(OthersCache::rows_of(keys, fetched))
        }
    }
}

/// The tables a view reads, for the others' copy to know which commit it is of.
pub(crate) type Tables = Arc<(super::front::Committed, super::front::CommittedOthers)>;

/// Counts this thread's reads of the file, apart those made while it holds the callers' lock
/// (unit tests only: invariant 15).
#[cfg(test)]
pub(crate) mod probe {
    use std::cell::Cell;

    thread_local! {
        static HELD: Cell<bool> = const { Cell::new(false) };
        static READS: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    }

    /// Marks this thread as holding the callers' lock until it is dropped.
    pub(crate) struct Held(bool);

    impl Drop for Held {
        fn drop(&mut self) {
            HELD.set(self.0);
        }
    }

    /// This thread holds the callers' lock until the guard is dropped.
    pub(crate) fn held() -> Held {
        Held(HELD.replace(true))
    }

    /// A read of the file.
    pub(crate) fn read() {
        let (free, held) = READS.get();
        READS.set(if HELD.get() { (free, held + 1) } else { (free + 1, held) });
    }

    /// This thread's reads so far: (with no lock held, with the callers' lock held).
    pub(crate) fn reads() -> (u64, u64) {
        READS.get()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::probe;
    use crate::{ReadIndex, Warm};

    /// Conversations moving between nodes, with node caches and four nodes a block, forgotten
    /// nodes and commits between turns: every answer and every `ran` reads the committed view
    /// (the probe sees the reads), and none of those reads is made with the callers' lock held.
    #[test]
    fn no_file_read_is_made_under_the_callers_lock() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let warm = Warm::builder()
            .nodes_per_prefix(4)
            .node_cache_blocks(96)
            .sync_window(Duration::from_millis(1))
            .open(dir.path().join("w.redb"))?;
        let prompt = |c: u32, turn: u32| -> Vec<u32> { (0..64 * (2 + turn)).map(|t| t * 7 + c * 100_003).collect() };
        let mut warm_answers = 0;
        for turn in 0..12u32 {
            for c in 0..8u32 {
                let tokens = prompt(c, turn);
                let nodes = warm.warm_nodes("m", &tokens)?;
                let best = warm.warmest("m", &tokens)?;
                warm_answers += usize::from(best.is_some()) + usize::from(!nodes.is_empty());
                warm.ran("m", &tokens, &format!("n{}", (c + turn / 3) % 5))?;
            }
            if turn % 4 == 3 {
                warm.forget_node(&format!("n{}", turn % 5))?;
            }
            if turn % 2 == 1 {
                warm.sync()?;
            }
        }
        let (free, held) = probe::reads();
        assert!(warm_answers > 0, "the conversations were answered warm");
        assert!(free > 0, "the committed view was read");
        assert_eq!(held, 0, "reads of the file under the callers' lock ({free} with none held)");
        Ok(())
    }
}
