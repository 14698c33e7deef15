//! Request traces: the Mooncake JSONL format, its rule for turning a request into tokens, and a
//! built-in synthetic multi-turn conversation workload in the same form.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A trace that cannot be read.
#[derive(Debug)]
#[non_exhaustive]
pub enum TraceError {
    /// The file cannot be read.
    Io {
        /// The trace file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not a Mooncake request.
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        detail: String,
    },
}

impl std::fmt::Display for TraceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TraceError::Io { path, source } => write!(f, "cannot read trace {}: {source}", path.display()),
            TraceError::Line { line, detail } => {
                write!(f, "trace line {line}: {detail}; each line must be a Mooncake request object")
            }
        }
    }
}

impl std::error::Error for TraceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TraceError::Io { source, .. } => Some(source),
            TraceError::Line { .. } => None,
        }
    }
}

/// Tokens per Mooncake hash id.
pub const TOKENS_PER_HASH_ID: usize = 512;
/// The longest prompt a trace line may ask for, in tokens (16 MiB of token ids): four times the
/// longest context window models offer, far past any real request.
pub const MAX_REQUEST_TOKENS: usize = 1 << 22;

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Request {
    /// Arrival time in milliseconds.
    pub timestamp: u64,
    /// Prompt length in tokens.
    pub input_length: usize,
    /// Output length in tokens.
    pub output_length: usize,
    /// One id per 512 prompt tokens; equal ids are a shared prefix block.
    pub hash_ids: Vec<u64>,
}

/// SplitMix64's finalizer, as the trace README defines it.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Request {
    /// The prompt's tokens: token `j` is `splitmix64(hash_ids[j / 512] * 512 + j % 512) >> 32`.
    /// A request whose ids do not cover its length (never one from [`parse`]) is cut short.
    pub fn tokens(&self) -> Vec<u32> {
        let len = self.input_length.min(self.hash_ids.len() * TOKENS_PER_HASH_ID);
        (0..len)
            .map(|j| {
                let id = self.hash_ids.get(j / TOKENS_PER_HASH_ID).copied().unwrap_or_default();
                let x = id.wrapping_mul(TOKENS_PER_HASH_ID as u64).wrapping_add((j % TOKENS_PER_HASH_ID) as u64);
                (splitmix64(x) >> 32) as u32
            })
            .collect()
    }
}

/// Parses a Mooncake JSONL trace (blank lines are skipped).
///
/// # Errors
/// [`TraceError::Line`] for a line that is not a request, or whose `hash_ids` do not cover its
/// `input_length`.
pub fn parse(text: &str) -> Result<Vec<Request>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let request: Request =
            serde_json::from_str(line).map_err(|e| TraceError::Line { line: i + 1, detail: e.to_string() })?;
        if request.input_length > MAX_REQUEST_TOKENS {
            return Err(TraceError::Line {
                line: i + 1,
                detail: format!(
                    "input_length {} is over the {MAX_REQUEST_TOKENS} tokens a request may have",
                    request.input_length
                ),
            });
        }
        if request.hash_ids.len().saturating_mul(TOKENS_PER_HASH_ID) < request.input_length {
            return Err(TraceError::Line {
                line: i + 1,
                detail: format!(
                    "{} hash ids cannot cover {} input tokens",
                    request.hash_ids.len(),
                    request.input_length
                ),
            });
        }
        out.push(request);
    }
    Ok(out)
}

/// Reads and parses a trace file.
///
/// # Errors
/// [`TraceError::Io`] if it cannot be read; as [`parse`].
pub fn read(path: &Path) -> Result<Vec<Request>, TraceError> {
    let text = std::fs::read_to_string(path).map_err(|source| TraceError::Io { path: path.to_path_buf(), source })?;
    parse(&text)
}

/// A built-in multi-turn conversation workload: `sessions` conversations over 4 system prompts,
/// each turn resending the whole conversation so far plus a new user message, interleaved the way
/// concurrent users interleave. Deterministic for a `seed`.
pub fn synthetic(requests: usize, sessions: usize, seed: u64) -> Vec<Request> {
    let sessions = sessions.max(1);
    let mut state = seed;
    let mut next = move || {
        state = splitmix64(state);
        state
    };
    let mut next_id = 4u64; // ids 0..4 are the system prompts
    let mut convs: Vec<(Vec<u64>, usize)> = (0..sessions).map(|_| (Vec::new(), 0)).collect();
    let mut out = Vec::with_capacity(requests);
    for r in 0..requests {
        let s = (next() % sessions as u64) as usize;
        // `s < sessions == convs.len()`: the spare (a new conversation) is never taken.
        let mut spare = (Vec::new(), 0);
        let (ids, len) = convs.get_mut(s).unwrap_or(&mut spare);
        if ids.is_empty() || *len > 60_000 {
            // A new conversation: a system prompt of 1 to 3 blocks.
            let system = next() % 4;
            *ids = vec![system; 1];
            *len = TOKENS_PER_HASH_ID;
        }
        let grow = 200 + (next() % 1800) as usize;
        // Partly filled last block: the new message continues it under a fresh id.
        let full = *len / TOKENS_PER_HASH_ID;
        ids.truncate(full);
        *len += grow;
        while ids.len() * TOKENS_PER_HASH_ID < *len {
            ids.push(next_id);
            next_id += 1;
        }
        let output_length = 100 + (next() % 400) as usize;
        out.push(Request { timestamp: r as u64 * 50, input_length: *len, output_length, hash_ids: ids.clone() });
        // The reply becomes part of the next turn.
        *len += output_length;
        while ids.len() * TOKENS_PER_HASH_ID < *len {
            ids.push(next_id);
            next_id += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]
    use super::*;

    #[test]
    fn the_token_rule_follows_the_readme() {
        let r = Request { timestamp: 0, input_length: 514, output_length: 1, hash_ids: vec![7, 9] };
        let t = r.tokens();
        assert_eq!(t.len(), 514);
        assert_eq!(t[0], (splitmix64(7 * 512) >> 32) as u32);
        assert_eq!(t[513], (splitmix64(9 * 512 + 1) >> 32) as u32);
        assert_eq!(splitmix64(0), 0xE220_A839_7B1D_CDAF, "SplitMix64's first output for seed 0");
    }

    #[test]
    fn synthetic_turns_extend_their_conversation() {
        let reqs = synthetic(200, 10, 1);
        assert_eq!(reqs.len(), 200);
        let extended = reqs
            .iter()
            .enumerate()
            .filter(|(i, r)| reqs[..*i].iter().any(|p| r.hash_ids.len() > 2 && r.hash_ids[..2] == p.hash_ids[..2]))
            .count();
        assert!(extended > 100, "most turns continue an earlier prompt ({extended})");
        assert!(reqs.iter().all(|r| r.hash_ids.len() * 512 >= r.input_length));
    }
}
