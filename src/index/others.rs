//! The callers' copy of what they need of the last commit's others table (`others/v4`): which
//! segments have rows at all, and the rows of segments read lately, decoded. `warm_nodes` reads
//! a conversation's segments at every turn, and a turn on the same node changes none of them,
//! so most reads are answered here. Kept in step with each commit: the writer lists the keys
//! whose rows a batch changed, and the entries of those keys go when the commit that holds
//! them becomes the callers' view. The copy has a lock of its own, held only to look up and to
//! keep rows: the file is read with no lock held (`view_read.rs`).

// Read by every `warm_nodes`: each index is inside a segment range that `segments` cut from
// the same slice of keys.
#![allow(clippy::indexing_slicing)]

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::{Arc, Weak};

use super::front::{Committed, CommittedOthers};
use super::view_read::Tables;
use crate::error::{Result, redb_err};
use crate::keys::BlockKey;
use crate::store::tables::{members, table_key};

/// Rows a segment's range read may meet before its blocks are read one by one instead (a
/// system prompt's segment is every conversation's).
const SEGMENT_ROWS: usize = 32;

/// Entries kept (segments and single keys) before the copy starts over.
const MAX_CACHED: usize = 1 << 16;

/// A block's others: (node id, clock), as stored.
pub(crate) type Row = Vec<(u32, u64)>;

/// What the callers know of the last commit's others.
#[derive(Default)]
pub(crate) struct OthersCache {
    /// The commit (its tables) the copy is of: rows read from another are not kept.
    tables: Weak<(Committed, CommittedOthers)>,
    /// The segments (first half of their keys) that have a row, or more; `None` until the
    /// commit thread has read them (then every segment is read).
    pub segments: Option<HashSet<u64>>,
    /// Every row of a segment with few, by segment.
    by_segment: HashMap<u64, Vec<(u128, Row)>>,
    /// The row (or its absence) of single keys of segments with many.
    by_key: HashMap<u128, Option<Row>>,
}

/// What the copy lacks of one segment of a chain.
pub(crate) struct Lack {
    /// The segment's blocks in the chain.
    segment: Range<usize>,
    /// Whether the segment is read in one range read first.
    whole: bool,
    /// The blocks of it read one by one (if the range read finds too many rows).
    blocks: Vec<usize>,
}

/// What was read of one segment for the copy.
pub(crate) struct Fetched {
    short: u64,
    /// Every row of the segment, if it has few.
    segment: Option<Vec<(u128, Row)>>,
    /// Otherwise the row (or its absence) of each block read.
    keys: Vec<(u128, Option<Row>)>,
}

impl OthersCache {
    /// An empty copy of the others of the commit whose tables are `tables`.
    pub(crate) fn of(tables: &Tables) -> OthersCache {
        OthersCache { tables: Arc::downgrade(tables), ..OthersCache::default() }
    }

    /// The commit whose tables are `tables`, whose batch changed the rows of `changed`, is now
    /// the callers' view.
    pub(crate) fn committed(&mut self, tables: &Tables, changed: &[u128]) {
        self.tables = Arc::downgrade(tables);
        for &key in changed {
            let hi = (key >> 64) as u64;
            if let Some(segments) = self.segments.as_mut() {
                segments.insert(hi);
            }
            self.by_segment.remove(&hi);
            self.by_key.remove(&key);
        }
    }

    /// What the copy lacks of the others of `keys` (every segment, if `all`).
    pub(crate) fn lacking(&self, keys: &[BlockKey], all: bool) -> Vec<Lack> {
        let mut lacking = Vec::new();
        for segment in segments(keys) {
            let key = table_key(&keys[segment.start]);
            let short = (key >> 64) as u64;
            if !all && (!self.may_have(short) || self.by_segment.contains_key(&short)) {
                continue;
            }
            let whole = all || !self.by_key.contains_key(&key);
            let blocks: Vec<usize> =
                segment.clone().filter(|&i| all || !self.by_key.contains_key(&table_key(&keys[i]))).collect();
            if whole || !blocks.is_empty() {
                lacking.push(Lack { segment, whole, blocks });
            }
        }
        lacking
    }

    /// Reads from `table` what `lacking` names: a segment in one range read, or a read a block
    /// if it has many rows.
    ///
    /// # Errors
    /// [`crate::Error::Storage`] if a read fails.
    pub(crate) fn fetch(table: &CommittedOthers, keys: &[BlockKey], lacking: &[Lack]) -> Result<Vec<Fetched>> {
        let mut fetched = Vec::with_capacity(lacking.len());
        for lack in lacking {
            let hi = table_key(&keys[lack.segment.start]) >> 64;
            let short = hi as u64;
            if lack.whole {
                let mut rows = Vec::new();
                let range = table
                    .range((hi << 64)..=((hi << 64) | u128::from(u64::MAX)))
                    .map_err(redb_err("reading the others"))?;
                #[cfg(test)]
                super::view_read::probe::read();
                for item in range.take(SEGMENT_ROWS + 1) {
                    let (key, row) = item.map_err(redb_err("reading the others"))?;
                    rows.push((key.value(), members(row.value()).collect::<Row>()));
                }
                if rows.len() <= SEGMENT_ROWS {
                    fetched.push(Fetched { short, segment: Some(rows), keys: Vec::new() });
                    continue;
                }
            }
            let mut read = Vec::with_capacity(lack.blocks.len());
            for &i in &lack.blocks {
                let key = table_key(&keys[i]);
                #[cfg(test)]
                super::view_read::probe::read();
                let row = table.get(key).map_err(redb_err("reading the others"))?;
                read.push((key, row.map(|g| members(g.value()).collect())));
            }
            fetched.push(Fetched { short, segment: None, keys: read });
        }
        Ok(fetched)
    }

    /// The others of each block of `keys` as of the commit whose tables are `tables`, with
    /// `fetched` (what [`OthersCache::lacking`] named, read from that commit) kept in the copy;
    /// `None` if the copy is of another commit (then read them all, with `all`).
    pub(crate) fn rows_with(
        &mut self,
        tables: &Tables,
        keys: &[BlockKey],
        fetched: Vec<Fetched>,
    ) -> Option<Vec<Option<Row>>> {
        if self.tables.as_ptr() != Arc::as_ptr(tables) {
            return None;
        }
        self.keep(fetched);
        let rows = self.owned_rows(keys);
        if self.by_segment.len() + self.by_key.len() > MAX_CACHED {
            self.by_segment.clear();
            self.by_key.clear();
        }
        Some(rows)
    }

    /// The others of each block of `keys` from `fetched` alone (every segment of them read).
    pub(crate) fn rows_of(keys: &[BlockKey], fetched: Vec<Fetched>) -> Vec<Option<Row>> {
        let mut alone = OthersCache::default();
        alone.keep(fetched);
        alone.owned_rows(keys)
    }

    /// Keeps what was fetched in the copy.
    fn keep(&mut self, fetched: Vec<Fetched>) {
        for f in fetched {
            match f.segment {
                Some(rows) => {
                    self.by_segment.insert(f.short, rows);
                }
                None => self.by_key.extend(f.keys),
            }
        }
    }

    /// [`OthersCache::rows`], copied out of the copy.
    fn owned_rows(&self, keys: &[BlockKey]) -> Vec<Option<Row>> {
        self.rows(keys).into_iter().map(|row| row.map(<[(u32, u64)]>::to_vec)).collect()
    }

    /// The others of each block of `keys` (`None` where it has none), from the copy.
    fn rows(&self, keys: &[BlockKey]) -> Vec<Option<&[(u32, u64)]>> {
        let mut found = vec![None; keys.len()];
        for segment in segments(keys) {
            let short = (table_key(&keys[segment.start]) >> 64) as u64;
            if !self.may_have(short) {
                continue;
            }
            if let Some(rows) = self.by_segment.get(&short) {
                for (key, row) in rows {
                    if let Some(i) = segment.clone().find(|&i| table_key(&keys[i]) == *key) {
                        found[i] = Some(row.as_slice());
                    }
                }
                continue;
            }
            for i in segment {
                if let Some(Some(row)) = self.by_key.get(&table_key(&keys[i])) {
                    found[i] = Some(row.as_slice());
                }
            }
        }
        found
    }

    /// Whether segment `short` may have rows.
    fn may_have(&self, short: u64) -> bool {
        self.segments.as_ref().is_none_or(|known| known.contains(&short))
    }
}

/// The index ranges of `keys` that share a segment (the first half of their keys).
fn segments(keys: &[BlockKey]) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut start = 0;
    std::iter::from_fn(move || {
        if start >= keys.len() {
            return None;
        }
        let hi = table_key(&keys[start]) >> 64;
        let end = start + keys[start..].iter().take_while(|k| table_key(k) >> 64 == hi).count();
        let range = start..end;
        start = end;
        Some(range)
    })
}
