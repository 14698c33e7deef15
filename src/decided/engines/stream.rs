//! How a batch follows the last one applied of an engine's stream, the batches remembered to
//! tell copies from a restarted engine's, and a stream's row.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::event::{EngineBatch, EngineCounts};

/// How a batch follows the last one applied of its stream (`last`: its number and publish
/// time): the one rule for a head applying batches and for a sharing head forwarding them.
///
/// Only numbers and the batches remembered ([`Applied`]) tell it, never the clock: an engine
/// that restarts may publish with a clock behind the old process's (an NTP step, a move to
/// another host), and its batches are not copies for that.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Follows {
    /// The next one (or the first of a stream, numbered 0).
    Next,
    /// One of the batches applied last, exactly (its number and publish time): a copy of it (a
    /// replay's overlap, a live batch a replay already gave, another head's late copy).
    Copy,
    /// A number at or before the last applied that is no batch applied: a new engine process
    /// counting from 0 again, whatever its clock says.
    Restart,
    /// Batches are missing before it: replay from `from` (the last applied, or 0).
    Gap { from: u64 },
}

impl Follows {
    pub(crate) fn after(last: Option<(u64, f64)>, applied: &Applied, batch: &EngineBatch) -> Follows {
        let Some((last, last_ts)) = last else {
            return match batch.seq {
                0 => Follows::Next,
                _ => Follows::Gap { from: 0 },
            };
        };
        if batch.seq == last.wrapping_add(1) {
            return Follows::Next;
        }
        let copy = (batch.seq == last && batch.ts.to_bits() == last_ts.to_bits()) || applied.holds(batch);
        match () {
            () if copy => Follows::Copy,
            () if batch.seq <= last => Follows::Restart,
            () => Follows::Gap { from: last },
        }
    }
}

/// How many of a stream's last batches applied are remembered ([`Applied`]): more than a replay
/// gives back or the live batches that come while it is answered, at an engine's rate.
pub(super) const REMEMBERED: usize = 4096;

/// The last batches applied of a stream (number and publish time, the last
/// [`REMEMBERED`]), across its engine's restarts: what tells a copy of one from a batch of a
/// restarted engine with the same number (memory only; after an open, only the stream's
/// position is known, see [`Follows::after`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Applied {
    /// (number, publish time's bits), oldest first.
    pub(super) recent: VecDeque<(u64, u64)>,
}

impl Applied {
    /// Remembers `batch` as applied (the oldest remembered is forgotten past [`REMEMBERED`]).
    pub(crate) fn push(&mut self, batch: &EngineBatch) {
        if self.recent.len() == REMEMBERED {
            self.recent.pop_front();
        }
        self.recent.push_back((batch.seq, batch.ts.to_bits()));
    }

    /// Whether `batch` is one of those remembered, exactly.
    pub(crate) fn holds(&self, batch: &EngineBatch) -> bool {
        let id = (batch.seq, batch.ts.to_bits());
        // Newest first: a copy is most often of a batch just applied.
        self.recent.iter().rev().any(|&r| r == id)
    }
}

/// An engine stream's position and counts: the `engine_streams/v6` row of its node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct StreamRecord {
    /// The sequence number of the last batch applied (`None`: none since the stream began or
    /// was cleared).
    pub last: Option<u64>,
    /// Its publish time.
    pub last_ts: f64,
    /// The counts.
    pub counts: EngineCounts,
}
