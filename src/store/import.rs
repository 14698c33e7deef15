//! The upgrade from superfluid 0.1.7: its `warm.json` (`{"prefixes": [[hash, node, clock], …]}`)
//! brought into the index under FNV keys, answered until they age out. The JSON file is only read.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::records::MAX_CLOCK;
use crate::error::{Error, Result};
use crate::keys::MAX_NODE_BYTES;

/// 0.1.7's `warm.json`: every prefix as (FNV hash, node, clock).
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct WarmJson {
    pub prefixes: Vec<(u64, String, u64)>,
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

/// A 0.1.7 `warm.json`, read and checked whole ([`LegacyJson::read`]) before any index is
/// touched, then imported by [`crate::Warm::import`].
#[derive(Clone, Debug)]
pub struct LegacyJson {
    /// (hash, node, clock), each hash once, oldest first.
    entries: Vec<(u64, String, u64)>,
    source: [u8; 32],
}

impl LegacyJson {
    /// Reads and checks a 0.1.7 `warm.json`: its shape, node names, and clocks (at most
    /// [`MAX_CLOCK`], so that the index's clock can go on from the newest).
    ///
    /// # Errors
    /// [`Error::Io`] if it cannot be read, [`Error::LegacyJson`] if it is not a valid 0.1.7 file.
    pub fn read(path: impl AsRef<Path>) -> Result<LegacyJson> {
        read_json(path.as_ref())
    }

    /// Its prefixes (a hash listed twice counts once).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// (hash, node, clock), each hash once, oldest first.
    pub(crate) fn entries(&self) -> &[(u64, String, u64)] {
        &self.entries
    }

    /// The blake3 digest of the file's bytes (the same file is imported once).
    pub(crate) fn source(&self) -> [u8; 32] {
        self.source
    }

    /// Whether it holds no prefix.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Reads and checks a 0.1.7 `warm.json`.
///
/// # Errors
/// [`Error::Io`] if it cannot be read, [`Error::LegacyJson`] if it is not a valid 0.1.7 file.
pub(crate) fn read_json(path: &Path) -> Result<LegacyJson> {
    let bytes = std::fs::read(path).map_err(|source| Error::io(path.to_path_buf(), source))?;
    let stored: WarmJson = serde_json::from_slice(&bytes).map_err(|e| Error::LegacyJson {
        path: path.to_path_buf(),
        detail: "not a 0.1.7 warm.json".into(),
        source: Some(Arc::new(e)),
    })?;
    if let Some((_, node, _)) =
        stored.prefixes.iter().find(|(_, node, _)| node.is_empty() || node.len() > MAX_NODE_BYTES)
    {
        return Err(Error::LegacyJson {
            path: path.to_path_buf(),
            detail: format!("a node name of {} bytes (1 to {MAX_NODE_BYTES} allowed)", node.len()),
            source: None,
        });
    }
    if let Some((hash, _, at)) = stored.prefixes.iter().find(|(_, _, at)| *at > MAX_CLOCK) {
        return Err(Error::LegacyJson {
            path: path.to_path_buf(),
            detail: format!("prefix {hash} has clock {at}, over the {MAX_CLOCK} an index's clock can go on from"),
            source: None,
        });
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
    Ok(LegacyJson { entries, source: *blake3::hash(&bytes).as_bytes() })
}
