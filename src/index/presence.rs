//! The presence filter: a Bloom filter of every key of the prefix table as last committed, so
//! that a lookup of a block the file does not hold (the blocks past a prompt's remembered
//! prefix: about half of a search's reads) costs one word instead of a B-tree descent.
//!
//! It never says no to a key the last commit holds: the commit thread adds each batch's keys
//! before committing it, and a key leaves only when the filter is replaced. Evicted keys stay
//! in it, so it fills; once too full it is rebuilt from reads of the committed table, a chunk
//! at a time between batches (every batch meanwhile goes into both), and the callers get the
//! new one when it is whole. Each chunk reads the commit of its time and lets go of it: a read
//! held across the rebuild would keep redb from reusing any page a commit frees meanwhile, and a
//! rebuild can outlast a busy head's whole run. Until the first is whole, and after an import
//! (which writes keys no batch carries), the callers have none and read the file.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use redb::{Database, ReadableDatabase};

use crate::error::{Result, redb_err};
use crate::keys::BlockKey;
use crate::store::tables::{PREFIXES, table_key};

/// Bits a key: 3 bits in one 64-bit word, about 1% false positives when full to capacity.
const BITS_PER_KEY: usize = 16;
/// Words of the smallest filter.
const MIN_WORDS: usize = 4;
/// Rebuilt once this share of its bits is set (about 6% false positives).
const FULL: f64 = 0.4;
/// Keys read per step of a rebuild (about a millisecond with the writer held).
pub(crate) const STEP_KEYS: usize = 1 << 12;

/// A Bloom filter of prefix-table keys, one word a key. Written by one thread at a time (the
/// writer's holder), read by any.
pub(crate) struct Presence {
    words: Box<[AtomicU64]>,
    set: AtomicUsize,
}

impl Presence {
    /// An empty filter sized for `keys` keys.
    pub(crate) fn for_keys(keys: usize) -> Presence {
        let words = (keys.saturating_mul(BITS_PER_KEY) / 64).clamp(MIN_WORDS, u32::MAX as usize);
        Presence { words: (0..words).map(|_| AtomicU64::new(0)).collect(), set: AtomicUsize::new(0) }
    }

    /// The word and bits of a table key. Its low half is already a uniform hash (8 bytes of a
    /// block's chained BLAKE3 value); the multiply spreads the high half in too.
    fn spot(&self, key: u128) -> (usize, u64) {
        let h = ((key as u64) ^ ((key >> 64) as u64).rotate_left(32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let bits = (1u64 << (h & 63)) | (1u64 << ((h >> 6) & 63)) | (1u64 << ((h >> 12) & 63));
        // The high 32 bits scaled to the word count (a multiply, not a modulo).
        ((((h >> 32) * self.words.len() as u64) >> 32) as usize, bits)
    }

    /// Adds a table key.
    pub(crate) fn insert(&self, key: u128) {
        let (word, bits) = self.spot(key);
        // `spot` scales to the word count: always in bounds.
        let Some(slot) = self.words.get(word) else { return };
        let old = slot.fetch_or(bits, Ordering::Relaxed);
        let new = (bits & !old).count_ones() as usize;
        if new > 0 {
            self.set.fetch_add(new, Ordering::Relaxed);
        }
    }

    /// Adds every key of a chain.
    pub(crate) fn insert_all(&self, keys: &[BlockKey]) {
        for key in keys {
            self.insert(table_key(key));
        }
    }

    /// False only if the key was never added.
    pub(crate) fn may_hold(&self, key: &BlockKey) -> bool {
        let (word, bits) = self.spot(table_key(key));
        // `spot` scales to the word count: always in bounds (an impossible miss says "maybe").
        self.words.get(word).is_none_or(|w| w.load(Ordering::Relaxed) & bits == bits)
    }

    /// Whether enough bits are set that it should be rebuilt.
    pub(crate) fn full(&self) -> bool {
        self.set.load(Ordering::Relaxed) as f64 > FULL * (self.words.len() * 64) as f64
    }
}

/// The writer's side: the filter the callers have, and the one being built.
#[derive(Default)]
pub(crate) struct Filters {
    /// The callers' filter (also in `Front::presence`), once built.
    pub live: Option<Arc<Presence>>,
    pub building: Option<Building>,
    /// Filters built whole since the start (or the last import).
    pub built: u64,
    /// When the next step of a build may run (steps are paced).
    pub due: Option<std::time::Instant>,
}

/// A rebuild in progress: the committed table read up to `next` (each step a read of the last
/// commit as of that step; no read is kept between steps).
pub(crate) struct Building {
    pub filter: Arc<Presence>,
    next: u128,
}

impl Filters {
    /// Adds keys about to be written: to every filter, before the commit that holds them.
    pub(crate) fn insert_all(&self, keys: &[BlockKey]) {
        for filter in self.live.iter().chain(self.building.as_ref().map(|b| &b.filter)) {
            filter.insert_all(keys);
        }
    }

    /// Whether a rebuild should start: none yet, or the callers' is too full.
    pub(crate) fn wants_build(&self) -> bool {
        self.building.is_none() && self.live.as_ref().is_none_or(|f| f.full())
    }

    /// Starts a rebuild, sized for `keys` keys, holding `applied` (the keys written into the
    /// batch and not committed yet; every later batch's keys are added as it is written).
    pub(crate) fn start(&mut self, keys: usize, applied: &[&[BlockKey]]) {
        let filter = Arc::new(Presence::for_keys(keys));
        for keys in applied {
            filter.insert_all(keys);
        }
        self.building = Some(Building { filter, next: 0 });
    }

    /// Reads the next [`STEP_KEYS`] keys of the rebuild from the last commit of `db` (the
    /// caller holds the writer, so none lands meanwhile); returns the new filter once whole (it
    /// is then the live one). Whole, it holds every key of the last commit: a key committed
    /// below `next` after its chunk was read was added with its batch, and one above is read by
    /// a later step (a key evicted meanwhile may be in it or not: either is right).
    ///
    /// # Errors
    /// A failed read: the rebuild is dropped (the callers keep the filter they have).
    pub(crate) fn step(&mut self, db: &Database) -> Result<Option<Arc<Presence>>> {
        let Some(building) = self.building.as_mut() else { return Ok(None) };
        let read = (|| -> Result<Option<u128>> {
            let txn = db.begin_read().map_err(redb_err("starting a read"))?;
            let table = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            let range = table.range(building.next..).map_err(redb_err("reading the prefix table"))?;
            let (mut read, mut last) = (0, 0);
            for item in range.take(STEP_KEYS) {
                let (key, _) = item.map_err(redb_err("reading the prefix table"))?;
                building.filter.insert(key.value());
                (read, last) = (read + 1, key.value());
            }
            // Where the next step starts; none once the table has ended.
            Ok(if read < STEP_KEYS { None } else { last.checked_add(1) })
        })();
        match read {
            Err(e) => {
                self.building = None;
                Err(e)
            }
            Ok(Some(next)) => {
                building.next = next;
                Ok(None)
            }
            Ok(None) => {
                let filter = Arc::clone(&building.filter);
                self.building = None;
                self.live = Some(Arc::clone(&filter));
                self.built += 1;
                Ok(Some(filter))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn key(i: u64) -> u128 {
        let h = i.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ (i >> 7);
        (u128::from(i) << 64) | u128::from(h)
    }

    fn block(k: u128) -> BlockKey {
        k.to_be_bytes()
    }

    /// A rebuild holds no read between its steps: redb reuses no page freed while a read that
    /// sees it is alive, so a rebuild outlasting a replay would grow the file with every commit.
    /// `compact` is refused while any read is alive.
    #[test]
    fn a_rebuild_holds_no_read_between_steps() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = std::env::temp_dir().join(format!("sfw-presence-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let mut db = redb::Database::create(dir.join("p.redb"))?;
        let txn = db.begin_write()?;
        {
            let mut table = txn.open_table(PREFIXES)?;
            for i in 0..(2 * STEP_KEYS as u64) {
                table.insert(key(i), (0, 0, 0, i))?;
            }
        }
        txn.commit()?;
        let mut filters = Filters::default();
        filters.start(2 * STEP_KEYS, &[]);
        assert!(filters.step(&db)?.is_none() && filters.building.is_some(), "a step of two");
        db.compact()?;
        assert!(filters.step(&db)?.is_none(), "the second step reads the rest, the third sees the end");
        let whole = filters.step(&db)?;
        let whole = whole.ok_or("whole after a third step")?;
        assert!((0..(2 * STEP_KEYS as u64)).all(|i| whole.may_hold(&block(key(i)))));
        drop(db);
        let _ = std::fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Every key added is held; keys never added are mostly not, at the sizing rate.
    #[test]
    fn holds_every_key_added_and_few_others() {
        let filter = Presence::for_keys(10_000);
        for i in 0..10_000 {
            filter.insert(key(i));
        }
        assert!((0..10_000).all(|i| filter.may_hold(&block(key(i)))), "no false negative");
        let false_positives = (10_000..110_000).filter(|&i| filter.may_hold(&block(key(i)))).count();
        assert!(false_positives < 3_000, "{false_positives} of 100,000 absent keys said present");
        assert!(!filter.full(), "sized for 10,000 keys, it is not full at 10,000");
        for i in 10_000..60_000 {
            filter.insert(key(i));
        }
        assert!(filter.full(), "five times its keys fill it");
    }
}
