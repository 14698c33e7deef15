//! A head's engines as sources of truth: `Warm::engine_batch` applies one batch of an engine's
//! KV cache events (vLLM's, SGLang's), decided once like a `ran` and committed with the same
//! atomicity and durability, with the engine's position in its stream.

use super::front::Front;
use super::warm::Warm;
use crate::error::Result;
use crate::keys::check_node;
#[cfg(feature = "nats")]
use crate::store::engines::Applied;
use crate::store::engines::{EngineBatch, EngineCounts, EngineOutcome, EngineStats};
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
    /// commit, at most about a sync window); a `ran` does not. A batch that
    /// does not follow the last one applied is not applied: see [`EngineOutcome`].
    ///
    /// # Errors
    /// [`crate::Error::InvalidName`] for an empty or over-long node name; as [`Warm::ran`] otherwise.
    pub fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome> {
        self.in_owner()?;
        check_node(node)?;
        self.wait_for_engine_room()?;
        let (outcome, _) = self.change_now(
            0,
            |front| {
                let before = front.decided.engine_counts(node);
                let (outcome, effects) = front.decided.engine_batch(node, batch)?;
                Ok(((outcome, Counted::since(front, node, before)), effects))
            },
            |(outcome, counted)| {
                let gap = match *outcome {
                    EngineOutcome::Gap { from } => Some(from),
                    _ => None,
                };
                counted.record(node, batch.seq, gap);
            },
        )?;
        Ok(outcome)
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
        self.wait_for_engine_room()?;
        self.change_now(
            0,
            |front| {
                let before = front.decided.engine_counts(node);
                let effects = front.decided.engine_resync(node, batch)?;
                Ok((Counted::since(front, node, before), effects))
            },
            |counted| counted.record(node, batch.seq, None),
        )?;
        Ok(())
    }

    #[cfg(feature = "nats")]
    /// Applies node `node`'s engine batch at stream position `position` (a sharing head, in
    /// stream order): as [`Warm::engine_batch`], and a batch after a gap starts the stream again
    /// ([`Warm::engine_resync`]): every head decides the same from the same stream.
    pub(crate) fn engine_batch_at(&self, node: &str, batch: &EngineBatch, position: u64) -> Result<()> {
        check_node(node)?;
        self.wait_for_engine_room()?;
        self.change_now(
            position,
            |front| {
                let before = front.decided.engine_counts(node);
                let (outcome, mut effects) = front.decided.engine_batch(node, batch)?;
                let gap = match outcome {
                    EngineOutcome::Gap { from } => {
                        effects.extend(front.decided.engine_resync(node, batch)?);
                        Some(from)
                    }
                    _ => None,
                };
                Ok(((gap, Counted::since(front, node, before)), effects))
            },
            |(gap, counted)| counted.record(node, batch.seq, *gap),
        )?;
        Ok(())
    }

    /// Where node `node`'s engine stream stands: the last batch applied (its number and publish
    /// time), if any.
    #[cfg(all(feature = "nats", feature = "tools", feature = "engines"))]
    pub(crate) fn engine_position(&self, node: &str) -> Result<Option<(u64, f64)>> {
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

/// An engine change's counts before and after it, taken under the front lock and recorded
/// (metrics and log) once it is released.
struct Counted {
    before: EngineCounts,
    after: EngineCounts,
    engine_blocks: usize,
}

impl Counted {
    fn since(front: &Front, node: &str, (before, _): (EngineCounts, usize)) -> Counted {
        let (after, engine_blocks) = front.decided.engine_counts(node);
        Counted { before, after, engine_blocks }
    }

    fn record(&self, node: &str, seq: u64, gap: Option<u64>) {
        telemetry::engine_decided(node, seq, gap, (&self.before, &self.after), self.engine_blocks);
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
}

impl EngineSink for Warm {
    fn engine_batch(&self, node: &str, batch: &EngineBatch) -> Result<EngineOutcome> {
        Warm::engine_batch(self, node, batch)
    }

    fn engine_resync(&self, node: &str, batch: &EngineBatch) -> Result<()> {
        Warm::engine_resync(self, node, batch)
    }
}
