//! The 0.1.7 design, kept faithfully for comparison: an in-memory `HashMap` of FNV-1a chained
//! block hashes, eviction by sorting every clock, and a `save` that rewrites the whole JSON file.
//! The benchmarks and the `replay` report measure it beside [`superfluid_warm::Warm`] in the same run, and
//! the tests use it as the model of the semantics to keep. Not for production use.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use superfluid_warm::{BLOCK_TOKENS, MIN_BLOCKS};

/// 0.1.7's `warm.json`: every prefix as (FNV hash, node, clock). 0.1.7's own struct, as the
/// model keeps 0.1.7's code rather than the index's reading of it.
#[derive(Serialize, Deserialize)]
struct WarmJson {
    prefixes: Vec<(u64, String, u64)>,
}

/// 0.1.7's chain: FNV-1a 64 of the model, then of every whole block's token bytes
/// (little-endian), one hash per block. 0.1.7's code, kept apart from the index's own copy
/// (`keys/legacy.rs`), so that the two are checked against each other.
pub fn fnv_chain<'a>(model: &str, tokens: &'a [u32]) -> impl Iterator<Item = u64> + 'a {
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    let seed = model.bytes().fold(0xCBF2_9CE4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    tokens.chunks_exact(BLOCK_TOKENS).scan(seed, |h, block| {
        for t in block {
            for b in t.to_le_bytes() {
                *h = (*h ^ u64::from(b)).wrapping_mul(PRIME);
            }
        }
        Some(*h)
    })
}

/// 0.1.7's capacity: prefixes remembered at most.
pub const MAX_0_1_7: usize = 1 << 16;

/// 0.1.7's `Warm`, with its capacity as a parameter.
#[derive(Debug, Default)]
pub struct Baseline {
    by_prefix: HashMap<u64, (String, u64)>,
    clock: u64,
    max: usize,
    path: Option<PathBuf>,
    dirty: bool,
}

impl Baseline {
    /// An empty index holding at most `max` prefixes, kept nowhere.
    pub fn in_memory(max: usize) -> Baseline {
        Baseline { max, ..Baseline::default() }
    }

    /// 0.1.7's `kept_in`: read back from `path` when it is there (an unreadable file is ignored,
    /// as 0.1.7 did).
    pub fn kept_in(path: PathBuf, max: usize) -> Baseline {
        let stored: Option<WarmJson> = std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok());
        let mut warm = Baseline { path: Some(path), max, ..Baseline::default() };
        for (hash, node, at) in stored.map(|s| s.prefixes).unwrap_or_default() {
            warm.clock = warm.clock.max(at);
            warm.by_prefix.insert(hash, (node, at));
        }
        warm
    }

    /// 0.1.7's `warmest`.
    pub fn warmest(&self, model: &str, tokens: &[u32]) -> Option<(&str, usize)> {
        let mut best = None;
        for (n, hash) in fnv_chain(model, tokens).enumerate() {
            match self.by_prefix.get(&hash) {
                Some((node, _)) => best = Some((node.as_str(), (n + 1) * BLOCK_TOKENS)),
                None => break,
            }
        }
        best.filter(|&(_, len)| len >= MIN_BLOCKS * BLOCK_TOKENS)
    }

    /// 0.1.7's `ran`, with its sort-everything eviction of the oldest eighth.
    pub fn ran(&mut self, model: &str, tokens: &[u32], node: &str) {
        self.clock += 1;
        let at = self.clock;
        for hash in fnv_chain(model, tokens) {
            self.by_prefix.insert(hash, (node.to_string(), at));
        }
        if self.by_prefix.len() > self.max {
            let mut ages: Vec<u64> = self.by_prefix.values().map(|&(_, at)| at).collect();
            ages.sort_unstable();
            // `ages` holds more than `max` entries, so the cut is always there.
            if let Some(&cut) = ages.get(self.max / 8) {
                self.by_prefix.retain(|_, &mut (_, at)| at > cut);
            }
        }
        self.dirty = true;
    }

    /// 0.1.7's `save`: the whole map as JSON to a temporary file, then renamed over the old one.
    /// Returns the bytes written (0 when nothing changed). Like 0.1.7 it does not fsync.
    pub fn save(&mut self) -> usize {
        let Some(path) = &self.path else { return 0 };
        if !self.dirty {
            return 0;
        }
        let stored =
            WarmJson { prefixes: self.by_prefix.iter().map(|(&h, (node, at))| (h, node.clone(), *at)).collect() };
        let Ok(bytes) = serde_json::to_vec(&stored) else { return 0 };
        let tmp = path.with_extension("tmp");
        let n = bytes.len();
        if std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path)).is_ok() {
            self.dirty = false;
            return n;
        }
        0
    }

    /// Prefixes held.
    pub fn len(&self) -> usize {
        self.by_prefix.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.by_prefix.is_empty()
    }
}
