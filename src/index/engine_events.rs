//! A head's engines as sources of truth: `Warm::engine_batch` applies one batch of an engine's
//! KV cache events (vLLM's, SGLang's), decided once like a `ran` and committed with the same
//! atomicity and durability, with the engine's position in its stream.

use super::front::Front;
use super::warm::Warm;
#[cfg(feature = "nats")]
use crate::decided::engines::Applied;
use crate::decided::engines::{
    Cursor, EngineBatch, EngineCounts, EngineGauges, EngineOutcome, EngineStats, PART_BLOCKS, ends_within,
};
use crate::error::Result;
use crate::keys::check_node;
use crate::telemetry;

impl Warm {
    /// Applies one batch of node `node`'s engine events, in the order its engine numbered them.
    ///
    /// Once a node has an event stream, its answers are what its engine holds: blocks of 64
    /// tokens whose every engine block, from the prompt's first, is held. A `ran` on it is
    /// answered as a claim until its events confirm it or [`crate::Builder::engine_grace`]
    /// passes; a removal or clear ends its claims at once. Nodes without a stream are answered
    /// as before.
    ///
    /// The batch is decided at once (answers see it when this returns) and committed with the
    /// stream's position, atomically, like a `ran` ([`Warm::sync`] waits for it). While the
    /// engine rows not yet committed pass 16 MiB, it first waits for the commit thread (a
    /// commit, at most about a sync window); a `ran` does not. A batch of more than 65,536
    /// blocks is decided and committed in parts of that many, waiting so before each, so that
    /// its memory while it waits for commits is a part's: a head that closes or crashes between
    /// two parts finds the node's stream unfinished when it opens the file, and knows the node
    /// to hold nothing until its engine's next batch starts the stream again (as after a lost
    /// batch). A batch that does not follow the last one applied is not applied: see
    /// [`EngineOutcome`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] for an empty or over-long node name; as [`Warm::ran`] otherwise.
    pub fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome> {
        self.in_owner()?;
        check_node(node)?;
        self.apply_engine_batch(node, batch, Start::Follow, 0)
    }

    /// Node `node`'s engine cannot give the batches before `batch` (a replay started later
    /// than asked, or there is no replay): everything the node was known to hold is dropped
    /// (the index may know less than the engine, never more) and `batch` starts its stream
    /// again.
    ///
    /// # Errors
    /// As [`Warm::engine_batch`].
    pub fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<()> {
        self.in_owner()?;
        check_node(node)?;
        self.apply_engine_batch(node, batch, Start::Resync, 0).map(drop)
    }

    #[cfg(feature = "nats")]
    /// Applies node `node`'s engine batch at stream position `position` (a sharing head, in
    /// stream order): as [`Warm::engine_batch`], and a batch after a gap starts the stream again
    /// ([`Warm::engine_resync`]): every head decides the same from the same stream.
    pub(crate) fn engine_batch_at(&self, node: &str, batch: &EngineBatch, position: u64) -> Result<()> {
        check_node(node)?;
        self.apply_engine_batch(node, batch, Start::FollowOrResync, position).map(drop)
    }

    /// Decides `batch` part by part ([`PART_BLOCKS`] blocks each; a batch of fewer is one
    /// part), each queued for the commit thread as its own change after waiting for its room,
    /// so that a huge batch holds no more memory than a part's while it waits to be committed.
    /// Answers see each part once it is decided. The stream `position` goes with the last part
    /// only: a sharing head's batch is acknowledged once all of it is. Returns the first part's
    /// outcome (the batch's).
    fn apply_engine_batch(
        &self,
        node: &str,
        batch: &EngineBatch,
        start: Start,
        position: u64,
    ) -> Result<EngineOutcome> {
        let mut from: Option<Cursor> = None;
        let mut first: Option<(EngineOutcome, Option<u64>, EngineCounts)> = None;
        loop {
            self.wait_for_engine_room()?;
            let last = ends_within(batch, from.unwrap_or_default(), PART_BLOCKS);
            let (outcome, gap, rest, counted) = self.change_now(
                if last { position } else { 0 },
                |front| {
                    let before = front.decided.engine_counts(node);
                    let decided = &mut front.decided;
                    let (outcome, gap, rest, effects) = match (from, start) {
                        (Some(_), _) | (None, Start::Follow) => {
                            let (outcome, rest, effects) = decided.engine_batch(node, batch, from)?;
                            let gap = match outcome {
                                EngineOutcome::Gap { from } => Some(from),
                                _ => None,
                            };
                            (outcome, gap, rest, effects)
                        }
                        (None, Start::Resync) => {
                            let (rest, effects) = decided.engine_resync(node, batch)?;
                            (EngineOutcome::Applied, None, rest, effects)
                        }
                        #[cfg(feature = "nats")]
                        (None, Start::FollowOrResync) => match decided.engine_batch(node, batch, None)? {
                            (outcome @ EngineOutcome::Gap { from }, _, mut effects) => {
                                let (rest, resynced) = decided.engine_resync(node, batch)?;
                                effects.extend(resynced);
                                (outcome, Some(from), rest, effects)
                            }
                            (outcome, rest, effects) => (outcome, None, rest, effects),
                        },
                    };
                    self.note_hybrid_sizes(&front.decided.engines.hybrid_sizes());
                    Ok(((outcome, gap, rest, Counted::since(front, node, before)), effects))
                },
                |_| {},
            )?;
            let (outcome, gap, before) = first.get_or_insert_with(|| (outcome, gap, counted.before.clone())).clone();
            match rest {
                Some(rest) => from = Some(rest),
                None => {
                    // Recorded once, for the whole batch.
                    Counted { before, ..counted }.record(node, batch.seq, gap);
                    return Ok(outcome);
                }
            }
        }
    }

    /// Node `node`'s engine stream has a gap being covered (a replay asked for, `true`), or no
    /// longer (`false`). While it has, what the node holds by its events is not answered: the
    /// batches lost may have removed some of it. Its claims and everything else are as before,
    /// and nothing is written (a reopened index has no gap being covered). A listener says so
    /// around each replay it waits for.
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] for an empty or over-long node name;
    /// [`crate::Error::Poisoned`] after a panic in another caller.
    pub fn engine_in_doubt(&self, node: &str, in_doubt: bool) -> Result<()> {
        self.in_owner()?;
        check_node(node)?;
        let mut front = self.front()?;
        if let Some(id) = front.decided.nodes.current(node) {
            front.decided.engines.set_in_doubt(id, in_doubt);
        }
        Ok(())
    }

    /// Where node `node`'s engine stream stands: the last batch applied (its sequence number
    /// and publish time, in seconds since the Unix epoch), if any. One lookup, where
    /// [`Warm::engine_stats`] counts every node's blocks.
    ///
    /// # Errors
    /// [`crate::Error::Poisoned`] after a panic in another caller.
    pub fn engine_position(&self, node: &str) -> Result<Option<(u64, f64)>> {
        self.in_owner()?;
        let front = self.front()?;
        let id = front.decided.nodes.current(node);
        Ok(id.and_then(|id| front.decided.engines.position(id)))
    }

    /// Where node `node`'s engine stream stands ([`Warm::engine_position`]) and the last batches
    /// it applied: what a sharing head forwarding its batches follows from.
    #[cfg(feature = "nats")]
    pub(crate) fn engine_followed(&self, node: &str) -> Result<(Option<(u64, f64)>, Applied)> {
        self.in_owner()?;
        let front = self.front()?;
        let Some(id) = front.decided.nodes.current(node) else { return Ok((None, Applied::default())) };
        Ok((front.decided.engines.position(id), front.decided.engines.applied(id)))
    }

    /// The engine streams: where each stands, what each node holds, and the counts, as of the
    /// last batch applied.
    ///
    /// # Errors
    /// [`crate::Error::Poisoned`] after a panic in another caller.
    pub fn engine_stats(&self) -> Result<Vec<EngineStats>> {
        self.in_owner()?;
        let front = self.front()?;
        let nodes = &front.decided.nodes;
        Ok(front.decided.engines.stats(|id| nodes.name(id)))
    }
}

/// How a batch's first part is decided.
#[derive(Clone, Copy)]
enum Start {
    /// As the next batch of its stream ([`Warm::engine_batch`]).
    Follow,
    /// As its stream's new start ([`Warm::engine_resync`]).
    Resync,
    /// As the next, or after a gap as the new start (a sharing head's).
    #[cfg(feature = "nats")]
    FollowOrResync,
}

/// An engine change's counts before and after it, taken under the front lock and recorded
/// (metrics and log) once it is released.
struct Counted {
    before: EngineCounts,
    after: EngineCounts,
    gauges: EngineGauges,
}

impl Counted {
    fn since(front: &Front, node: &str, (before, _): (EngineCounts, EngineGauges)) -> Counted {
        let (after, gauges) = front.decided.engine_counts(node);
        Counted { before, after, gauges }
    }

    fn record(&self, node: &str, seq: u64, gap: Option<u64>) {
        telemetry::engine_decided(node, seq, gap, (&self.before, &self.after), self.gauges);
    }
}

/// Where a [`crate::Listener`] (feature `engines`) applies each engine's batches: a head's own
/// index ([`Warm`]), or, for heads that share one view, the stream they share
/// (`SharedWarm`, feature `nats`): every head then applies them in stream order.
pub trait EngineSink: Send + Sync {
    /// As [`Warm::engine_batch`].
    ///
    /// # Errors
    /// As [`Warm::engine_batch`].
    fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome>;

    /// As [`Warm::engine_resync`].
    ///
    /// # Errors
    /// As [`Warm::engine_resync`].
    fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<()>;

    /// As [`Warm::engine_in_doubt`]: a sink that cannot stop answering for a node (one that
    /// forwards the batches to others) does nothing.
    ///
    /// # Errors
    /// As [`Warm::engine_in_doubt`].
    fn engine_in_doubt(&self, node: &str, in_doubt: bool) -> Result<()> {
        let _ = (node, in_doubt);
        Ok(())
    }
}

impl EngineSink for Warm {
    fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome> {
        Warm::engine_batch(self, node, batch)
    }

    fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<()> {
        Warm::engine_resync(self, node, batch)
    }

    fn engine_in_doubt(&self, node: &str, in_doubt: bool) -> Result<()> {
        Warm::engine_in_doubt(self, node, in_doubt)
    }
}
