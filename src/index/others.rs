//! The callers' copy of what they need of the last commit's others table (`others/v4`): which
//! segments have rows at all, and the rows of segments read lately, decoded. `warm_nodes` reads
//! a conversation's segments at every turn, and a turn on the same node changes none of them,
//! so most reads are answered here. Kept in step with each commit: the writer lists the keys
//! whose rows a batch changed, and the entries of those keys go when the commit that holds
//! them becomes the callers' view.

// Read by every `warm_nodes`: each index is inside a segment range that `segments` cut from
// the same slice of keys.
#![allow(clippy::indexing_slicing)]

use std::collections::{HashMap, HashSet};

use super::front::CommittedOthers;
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
    /// The segments (first half of their keys) that have a row, or more; `None` until the
    /// commit thread has read them (then every segment is read).
    pub segments: Option<HashSet<u64>>,
    /// Every row of a segment with few, by segment.
    by_segment: HashMap<u64, Vec<(u128, Row)>>,
    /// The row (or its absence) of single keys of segments with many.
    by_key: HashMap<u128, Option<Row>>,
}

impl OthersCache {
    /// A commit whose batch changed the rows of `changed` is now the callers' view.
    pub(crate) fn committed(&mut self, changed: &[u128]) {
        for &key in changed {
            let hi = (key >> 64) as u64;
            if let Some(segments) = self.segments.as_mut() {
                segments.insert(hi);
            }
            self.by_segment.remove(&hi);
            self.by_key.remove(&key);
        }
    }

    /// Reads into the copy what it lacks of the others of `keys`, as of `table`'s commit: a
    /// segment in one range read, or a read a block if it has many rows.
    pub(crate) fn fill(&mut self, table: &CommittedOthers, keys: &[BlockKey]) -> Result<()> {
        if self.by_segment.len() + self.by_key.len() > MAX_CACHED {
            self.by_segment.clear();
            self.by_key.clear();
        }
        for segment in segments(keys) {
            let hi = table_key(&keys[segment.start]) >> 64;
            let short = hi as u64;
            if !self.may_have(short) || self.by_segment.contains_key(&short) {
                continue;
            }
            if !self.by_key.contains_key(&table_key(&keys[segment.start])) {
                let mut rows = Vec::new();
                let range = table
                    .range((hi << 64)..=((hi << 64) | u128::from(u64::MAX)))
                    .map_err(redb_err("reading the others"))?;
                for item in range.take(SEGMENT_ROWS + 1) {
                    let (key, row) = item.map_err(redb_err("reading the others"))?;
                    rows.push((key.value(), members(row.value()).collect::<Row>()));
                }
                if rows.len() <= SEGMENT_ROWS {
                    self.by_segment.insert(short, rows);
                    continue;
                }
            }
            for i in segment {
                let key = table_key(&keys[i]);
                if let std::collections::hash_map::Entry::Vacant(slot) = self.by_key.entry(key) {
                    let row = table.get(key).map_err(redb_err("reading the others"))?;
                    slot.insert(row.map(|g| members(g.value()).collect()));
                }
            }
        }
        Ok(())
    }

    /// The others of each block of `keys` (`None` where it has none), from the copy (after
    /// [`OthersCache::fill`] of the same keys).
    pub(crate) fn rows(&self, keys: &[BlockKey]) -> Vec<Option<&[(u32, u64)]>> {
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
