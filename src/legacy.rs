//! The upgrade from superfluid 0.1.7: its `warm.json` (`{"prefixes": [[hash, node, clock], …]}`)
//! brought into the index under FNV keys, answered until they age out. The JSON file is only read.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use redb::{Database, ReadableTable};
use serde::Deserialize;

use crate::chain::legacy_key;
use crate::error::{Error, Result, redb_err};
use crate::records::Import;
use crate::state::{State, leave, list};
use crate::tables::{Entry, LEGACY_NAMESPACE, PREFIXES, stored};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Stored {
    prefixes: Vec<(u64, String, u64)>,
}

/// What an import did.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ImportReport {
    /// Entries in the file.
    pub in_file: u64,
    /// Entries written (an entry already there with a newer clock is kept).
    pub imported: u64,
    /// True when this very file (same bytes) was imported before: nothing was done.
    pub already_imported: bool,
    /// Entries evicted to stay within capacity afterwards.
    pub evicted: u64,
}

/// A parsed 0.1.7 file.
pub(crate) struct LegacyFile {
    entries: Vec<(u64, String, u64)>,
    source: [u8; 32],
}

/// Reads and checks a 0.1.7 `warm.json`.
///
/// # Errors
/// [`Error::Io`] if it cannot be read, [`Error::LegacyJson`] if it is not a valid 0.1.7 file.
pub(crate) fn read(path: &Path) -> Result<LegacyFile> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let stored: Stored = serde_json::from_slice(&bytes)
        .map_err(|e| Error::LegacyJson { path: path.to_path_buf(), detail: e.to_string() })?;
    for (_, node, _) in &stored.prefixes {
        if node.is_empty() || node.len() > crate::state::MAX_NODE_BYTES {
            return Err(Error::LegacyJson {
                path: path.to_path_buf(),
                detail: format!("a node name of {} bytes (1 to {} allowed)", node.len(), crate::state::MAX_NODE_BYTES),
            });
        }
    }
    // A hash listed twice (0.1.7 never wrote one) keeps its newest clock.
    let mut newest: HashMap<u64, (String, u64)> = HashMap::with_capacity(stored.prefixes.len());
    for (hash, node, at) in stored.prefixes {
        match newest.get(&hash) {
            Some((_, seen)) if *seen >= at => {}
            _ => {
                newest.insert(hash, (node, at));
            }
        }
    }
    let mut entries: Vec<(u64, String, u64)> = newest.into_iter().map(|(h, (n, at))| (h, n, at)).collect();
    entries.sort_unstable_by_key(|&(h, _, at)| (at, h));
    Ok(LegacyFile { entries, source: *blake3::hash(&bytes).as_bytes() })
}

impl State {
    /// Writes a parsed 0.1.7 file into the batch (the caller commits it).
    pub(crate) fn import(&mut self, db: &Database, file: &LegacyFile) -> Result<ImportReport> {
        let mut report =
            ImportReport { in_file: file.entries.len() as u64, imported: 0, already_imported: false, evicted: 0 };
        if self.meta.imports.iter().any(|i| i.source == file.source) {
            report.already_imported = true;
            return Ok(report);
        }
        match self.import_in_batch(db, file, &mut report) {
            Ok(()) => Ok(report),
            Err(e) => Err(self.lose(db, e).error),
        }
    }

    fn import_in_batch(&mut self, db: &Database, file: &LegacyFile, report: &mut ImportReport) -> Result<()> {
        let nodes = file.entries.iter().map(|(_, node, _)| self.intern_node(db, node)).collect::<Result<Vec<_>>>()?;
        let (mut added, mut max_clock) = (0, 0);
        {
            let txn = self.batch(db)?;
            let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            let mut left: HashMap<u64, u32> = HashMap::new();
            let mut listed: BTreeMap<u64, Vec<u8>> = BTreeMap::new();
            for ((hash, _, at), node) in file.entries.iter().zip(nodes) {
                let key = legacy_key(*hash);
                let old = primary
                    .get(stored(&key))
                    .map_err(redb_err("reading a prefix"))?
                    .map(|g| Entry::from_tuple(g.value()));
                match old {
                    Some(old) if old.clock >= *at => continue,
                    Some(old) => *left.entry(old.clock).or_default() += 1,
                    None => added += 1,
                }
                let entry = Entry { node, namespace: LEGACY_NAMESPACE, depth: 0, clock: *at };
                primary.insert(stored(&key), entry.tuple()).map_err(redb_err("writing a prefix"))?;
                listed.entry(*at).or_default().extend_from_slice(&key);
                report.imported += 1;
                max_clock = max_clock.max(*at);
            }
            drop(primary);
            leave(txn, &left)?;
            for (clock, keys) in &listed {
                list(txn, *clock, keys)?;
            }
        }
        self.meta.entries += added;
        self.meta.legacy_entries += added;
        self.meta.clock = self.meta.clock.max(max_clock);
        self.meta.imports.push(Import { source: file.source, entries: report.imported });
        report.evicted = self.evict(db)?;
        Ok(())
    }
}
