//! The upgrade from superfluid 0.1.7: its `warm.json` (`{"prefixes": [[hash, node, clock], …]}`)
//! brought into the index under FNV keys, answered until they age out. The JSON file is only read.

use std::path::Path;

use redb::{Database, ReadableTable};
use serde::Deserialize;

use crate::chain::legacy_key;
use crate::error::{Error, Result, redb_err};
use crate::records::Import;
use crate::state::State;
use crate::tables::{BY_CLOCK, Entry, LEGACY_NAMESPACE, PREFIXES};

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
    Ok(LegacyFile { entries: stored.prefixes, source: *blake3::hash(&bytes).as_bytes() })
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
        let result = self.import_in_batch(db, file, &mut report);
        if result.is_err() {
            self.reload(db)?;
        }
        result.map(|()| report)
    }

    fn import_in_batch(&mut self, db: &Database, file: &LegacyFile, report: &mut ImportReport) -> Result<()> {
        let nodes = file.entries.iter().map(|(_, node, _)| self.intern_node(db, node)).collect::<Result<Vec<_>>>()?;
        let (mut added, mut max_clock) = (0, 0);
        {
            let txn = self.batch(db)?;
            let mut primary = txn.open_table(PREFIXES).map_err(redb_err("opening the prefix table"))?;
            let mut by_clock = txn.open_table(BY_CLOCK).map_err(redb_err("opening the clock table"))?;
            for ((hash, _, at), node) in file.entries.iter().zip(nodes) {
                let key = legacy_key(*hash);
                let old = primary.get(key).map_err(redb_err("reading a prefix"))?.map(|g| Entry::from_tuple(g.value()));
                match old {
                    Some(old) if old.clock >= *at => continue,
                    Some(old) => {
                        by_clock.remove((old.clock, key)).map_err(redb_err("writing the clock table"))?;
                    }
                    None => added += 1,
                }
                let entry = Entry { node, namespace: LEGACY_NAMESPACE, depth: 0, clock: *at };
                primary.insert(key, entry.tuple()).map_err(redb_err("writing a prefix"))?;
                by_clock.insert((*at, key), ()).map_err(redb_err("writing the clock table"))?;
                report.imported += 1;
                max_clock = max_clock.max(*at);
            }
        }
        self.meta.entries += added;
        self.meta.legacy_entries += added;
        self.meta.clock = self.meta.clock.max(max_clock);
        self.meta.imports.push(Import { source: file.source, entries: report.imported });
        self.touch();
        report.evicted = self.evict(db)?;
        Ok(())
    }
}
