//! The horizon: 0.1.7's eviction rule, decided on the caller's side as each `ran` returns, so
//! that answers never depend on how far the commit thread has got. Its floor is the index's
//! low-water mark: every entry with a clock up to it is evicted.
//!
//! 0.1.7 evicts, whenever it holds more than `capacity` entries after a `ran`, every entry whose
//! clock is at most the clock of the `capacity / 8`-th oldest. Each cut is newer than the one
//! before (everything up to it is gone), so what has been evicted is always "every entry with a
//! clock up to `floor`". The horizon keeps the floor and, per clock, how many live entries have
//! it; `warmest` treats anything at or below the floor as absent, wherever it still is (memtable,
//! last commit), and each queued `ran` carries the floor for the commit thread to apply.

use std::collections::BTreeMap;

use crate::error::{Error, Result};

/// The callers' view of what is live.
#[derive(Debug, Default)]
pub(crate) struct Horizon {
    /// Every entry with a clock up to this one is evicted.
    pub floor: u64,
    /// Live entries per clock (no zero counts), oldest first.
    live: BTreeMap<u64, u64>,
    /// Live entries in all.
    pub entries: u64,
    pub capacity: u64,
    /// Live 0.1.7 entries (imported) per clock (no zero counts): a `ran` never writes one.
    legacy: BTreeMap<u64, u64>,
    /// Live 0.1.7 entries in all.
    pub legacy_entries: u64,
}

impl Horizon {
    /// The horizon of a file as committed, from its live counts per clock and the clock of each
    /// 0.1.7 entry it holds (read by `store/load.rs`), and its floor.
    ///
    /// # Errors
    /// The first error of `live` or `legacy`; [`Error::Corrupted`] if the live counts do not add
    /// up to `entries`, or the 0.1.7 entries to `legacy_entries`.
    pub(crate) fn from_counts(
        live: impl IntoIterator<Item = Result<(u64, u32)>>,
        legacy: impl IntoIterator<Item = Result<u64>>,
        floor: u64,
        (entries, legacy_entries): (u64, u64),
        capacity: u64,
    ) -> Result<Horizon> {
        let mut counts = BTreeMap::new();
        let mut sum = 0u64;
        for item in live {
            let (clock, count) = item?;
            counts.insert(clock, u64::from(count));
            sum += u64::from(count);
        }
        if sum != entries {
            return Err(Error::Corrupted {
                detail: format!("the live counts add up to {sum} entries, the meta record counts {entries}"),
            });
        }
        let mut by_clock: BTreeMap<u64, u64> = BTreeMap::new();
        for clock in legacy {
            *by_clock.entry(clock?).or_default() += 1;
        }
        let found: u64 = by_clock.values().sum();
        if found != legacy_entries {
            return Err(Error::Corrupted {
                detail: format!("the file holds {found} 0.1.7 entries, the meta record counts {legacy_entries}"),
            });
        }
        Ok(Horizon { floor, live: counts, entries, capacity, legacy: by_clock, legacy_entries })
    }

    /// Whether an entry of `clock` is live.
    pub(crate) fn holds(&self, clock: u64) -> bool {
        clock > self.floor
    }

    /// Counts a `ran` at `clock` that writes `blocks` blocks, of which the first ones were live
    /// with the clocks `runs` gives (`(clock, blocks)`, each run of equal clocks once), then
    /// applies 0.1.7's rule once. Returns the floor after it; `counts` gets the live count after
    /// it (0: none left) of each clock above the floor that it changed, oldest first.
    pub(crate) fn ran(&mut self, clock: u64, blocks: u64, runs: &[(u64, u64)], counts: &mut Vec<(u64, u64)>) -> u64 {
        let mut kept = 0;
        for &(old, n) in runs {
            if let Some(count) = self.live.get_mut(&old) {
                let n = n.min(*count);
                *count -= n;
                kept += n;
                counts.push((old, *count));
                if *count == 0 {
                    self.live.remove(&old);
                }
            }
        }
        let now = self.live.entry(clock).or_default();
        *now += blocks;
        counts.push((clock, *now));
        self.entries = self.entries.saturating_sub(kept) + blocks;
        // Once a `ran`, as 0.1.7 does: a `ran` longer than the eviction makes room for may leave
        // more than `capacity` until the next one.
        self.evict_once();
        counts.retain(|&(c, _)| c > self.floor);
        self.floor
    }

    /// Counts an import's entries (after [`Horizon::lower_floor`]): `written` gives each entry
    /// written, with the clock of the entry it replaced (`None`: a new key). Returns the live
    /// count after it of each clock it changed.
    pub(crate) fn import(&mut self, written: impl IntoIterator<Item = (Option<u64>, u64)>) -> Vec<(u64, u64)> {
        let mut changed = std::collections::BTreeSet::new();
        for (old, new) in written {
            // An import writes 0.1.7 keys only, so what it replaced was one too.
            match old {
                Some(old) => {
                    for counts in [&mut self.live, &mut self.legacy] {
                        if let Some(n) = counts.get_mut(&old) {
                            *n = n.saturating_sub(1);
                        }
                    }
                    changed.insert(old);
                }
                None => {
                    self.entries += 1;
                    self.legacy_entries += 1;
                }
            }
            *self.live.entry(new).or_default() += 1;
            *self.legacy.entry(new).or_default() += 1;
            changed.insert(new);
        }
        let counts = changed.into_iter().map(|c| (c, self.live.get(&c).copied().unwrap_or(0))).collect();
        self.live.retain(|_, n| *n > 0);
        self.legacy.retain(|_, n| *n > 0);
        counts
    }

    /// Lowers the floor to 0, for an import: 0.1.7's own clocks may be older than it. Nothing
    /// at or below it is live, so nothing comes back.
    pub(crate) fn lower_floor(&mut self) {
        self.floor = 0;
    }

    /// Applies 0.1.7's rule until no more than `capacity` entries are live (a file opened with
    /// a smaller capacity, or over it after an import). Returns the floor after it.
    pub(crate) fn evict_to_capacity(&mut self) -> u64 {
        while self.evict_once() {}
        self.floor
    }

    /// If more than `capacity` entries are live, evicts every entry whose clock is at most the
    /// clock of the `capacity / 8`-th oldest (0.1.7's rule); whether it did.
    fn evict_once(&mut self) -> bool {
        if self.entries <= self.capacity {
            return false;
        }
        let skip = self.capacity / 8;
        let mut seen = 0;
        let Some(cut) = self.live.iter().find_map(|(&c, &n)| {
            seen += n;
            (seen > skip).then_some(c)
        }) else {
            return false;
        };
        let rest = self.live.split_off(&(cut + 1));
        let gone: u64 = std::mem::replace(&mut self.live, rest).values().sum();
        self.entries = self.entries.saturating_sub(gone);
        let rest = self.legacy.split_off(&(cut + 1));
        let legacy_gone: u64 = std::mem::replace(&mut self.legacy, rest).values().sum();
        self.legacy_entries = self.legacy_entries.saturating_sub(legacy_gone);
        self.floor = cut;
        gone > 0
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use std::collections::HashMap;

    use super::*;

    /// 0.1.7's map of key → clock, and its rule, for chains of keys 0..n of a "conversation".
    #[derive(Default)]
    struct Model {
        by_key: HashMap<(u64, u64), u64>,
        clock: u64,
    }

    impl Model {
        fn ran(&mut self, conv: u64, blocks: u64, max: usize) {
            self.clock += 1;
            for b in 0..blocks {
                self.by_key.insert((conv, b), self.clock);
            }
            if self.by_key.len() > max {
                let mut ages: Vec<u64> = self.by_key.values().copied().collect();
                ages.sort_unstable();
                let cut = ages[max / 8];
                self.by_key.retain(|_, at| *at > cut);
            }
        }
    }

    #[test]
    fn it_evicts_exactly_what_0_1_7_evicts() {
        let capacity = 500;
        let mut model = Model::default();
        let mut horizon = Horizon { capacity, ..Horizon::default() };
        let mut state = 7u64;
        let (mut evictions, mut last_floor) = (0, 0);
        for _ in 0..3000 {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            state = (state ^ (state >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            let conv = state % 40;
            let blocks = 1 + (state >> 8) % 60;
            // The live prefix of this chain and its runs of equal clocks, as `ran` finds them.
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for b in 0..blocks {
                match model.by_key.get(&(conv, b)) {
                    Some(&c) => match runs.last_mut() {
                        Some((last, n)) if *last == c => *n += 1,
                        _ => runs.push((c, 1)),
                    },
                    None => break,
                }
            }
            model.ran(conv, blocks, capacity as usize);
            let mut counts = Vec::new();
            let floor = horizon.ran(model.clock, blocks, &runs, &mut counts);
            assert_eq!(horizon.entries, model.by_key.len() as u64, "at clock {}", model.clock);
            // The counts it states are the model's, for every clock it changed.
            assert!(counts.iter().any(|&(c, _)| c == model.clock));
            for (clock, n) in counts {
                assert_eq!(n, model.by_key.values().filter(|&&c| c == clock).count() as u64, "clock {clock}");
            }
            assert!(model.by_key.values().all(|&c| horizon.holds(c)));
            assert!(floor >= last_floor);
            evictions += usize::from(floor > last_floor);
            last_floor = floor;
        }
        assert!(evictions > 20, "{evictions} evictions");
    }

    #[test]
    fn an_import_counts_its_entries_and_eviction_takes_them_by_clock() {
        let mut horizon = Horizon { capacity: 16, floor: 9, ..Horizon::default() };
        horizon.ran(10, 4, &[], &mut Vec::new());
        // 0.1.7's entries at clocks 2, 3 and 12; one of clock 2 replaced again at clock 5.
        horizon.lower_floor();
        let counts = horizon.import([(None, 2), (None, 2), (None, 3), (None, 12), (Some(2), 5)]);
        assert_eq!(horizon.floor, 0, "an import lowers the floor");
        assert_eq!(counts, vec![(2, 1), (3, 1), (5, 1), (12, 1)]);
        assert_eq!((horizon.entries, horizon.legacy_entries), (8, 4));
        // 18 entries, over capacity: 0.1.7's rule cuts at the clock of the third oldest (past
        // the capacity/8 = 2 oldest), 5, taking three 0.1.7 entries and leaving clock 12's.
        horizon.ran(13, 10, &[], &mut Vec::new());
        assert_eq!(horizon.floor, 5);
        assert_eq!((horizon.entries, horizon.legacy_entries), (15, 1));
    }
}
