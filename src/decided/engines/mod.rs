//! What each engine holds, as its KV cache events report it (vLLM, SGLang): per node with an
//! event stream, every engine block it holds, by the engine's hash, and the 64-token blocks of
//! ours that those blocks cover whole, from the prompt's first token ("held").
//!
//! An engine's blocks are usually 16 tokens, ours 64, and an event's blocks start anywhere in a
//! prompt (a decode step stores one block at any depth). So each engine block keeps its own
//! tokens and its parent's hash; a block is *attached* when every block before it, back to the
//! prompt's first, is held (what the engine's own prefix lookup can reach), and an attached
//! block keys the 64-token blocks of ours that end inside it, chaining from where its ancestors
//! left the chain ([`ChainState`]). A block whose parent is missing (removed, or a store this
//! index never saw) is kept, detached, and attached again if the parent comes back. Removing a
//! block detaches everything below it. So per node the held blocks of ours are prefix-closed,
//! as `warmest`'s binary search needs, and never more than the engine can serve.
//!
//! One copy, in the decided state ([`super::Decided`]). A change's rows leave as effects;
//! attachment, chain states, children and the held map are derived, at load, from the rows
//! (which the store reads: `store/load.rs`).
//!
//! Tiers: an engine block's copies are counted by medium (GPU, and an offloading connector's CPU
//! memory and storage). A block is held while any copy is; its tier is the fastest medium
//! holding one, and a block of ours is warm in the slowest tier along its chain (where the
//! engine loads the whole prefix from). An offload store without tokens adds a copy to a block
//! this index holds, and names nothing otherwise.
//!
//! The parts: the events it takes (`event.rs`), how a batch follows a stream (`stream.rs`), the
//! blocks of a stream (`blocks.rs`) and their rows (`row.rs`).

mod blocks;
mod event;
mod hybrid;
mod offload;
mod reuse;
mod row;
mod stream;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

pub use event::{
    CacheGroup, EngineBatch, EngineCounts, EngineEvent, EngineOutcome, EngineStats, EngineStored, GroupKind, Medium,
};
pub(crate) use row::{
    BlockRowKey, GroupedRow, Layout, Row, decode_grouped, decode_kind, decode_row, encode_kind, upgrade_row,
};
pub(crate) use stream::{Applied, Follows, StreamRecord};

use super::effect::Effect;
use crate::error::Result;
use crate::keys::{BLOCK_TOKENS, BlockKey, ChainState, KeyMap, Namespace, Scheme};
use blocks::{Blocks, Completed, Slot};
use hybrid::Hybrid;
pub(crate) use hybrid::Reused;
#[cfg(test)]
pub(crate) use reuse::{Need, Spec, reuse as vllm_reuse};
use row::encode_row;

/// Blocks one part of a batch applies at most (an event without blocks counts as one): a
/// larger batch is decided and committed in parts, so that what waits for a commit (the
/// decision's rows, the writer's batch, redb's dirty pages) stays bounded in bytes whatever an
/// engine sends in one batch. A part of 16-token blocks is about 4 MiB of tokens.
pub(crate) const PART_BLOCKS: usize = 1 << 16;

/// Whether what is left of `batch` from `from` fits in `budget` blocks, counted as
/// [`Engines::batch_part`] counts them: an event's blocks (in a medium the index follows), or
/// one for an event without.
pub(crate) fn ends_within(batch: &EngineBatch, from: Cursor, budget: usize) -> bool {
    let cost = |event: &EngineEvent, block: usize| match event {
        EngineEvent::Stored(s) if s.medium.tier().is_some() => s.hashes.len().saturating_sub(block).max(1),
        EngineEvent::Removed { hashes, medium, .. } if medium.tier().is_some() => {
            hashes.len().saturating_sub(block).max(1)
        }
        _ => 1,
    };
    let mut left = budget;
    for (i, event) in batch.events.iter().enumerate().skip(from.event) {
        let block = if i == from.event { from.block } else { 0 };
        match left.checked_sub(cost(event, block)) {
            Some(rest) => left = rest,
            None => return false,
        }
    }
    true
}

/// Where applying a batch stands: its next event, and that event's next block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Cursor {
    event: usize,
    block: usize,
}

/// One node's engine stream.
#[derive(Clone, Debug, Default)]
struct Stream {
    record: StreamRecord,
    blocks: Blocks,
    /// The namespaces its first blocks are keyed in.
    namespaces: Vec<Namespace>,
    /// Derived: blocks of ours it holds (keys of attached blocks).
    ours: usize,
    /// Memory only: claims (`ran`s) on the node at or below this clock are not answered (a
    /// removal or clear since, or the grace window passed).
    claim_floor: u64,
    /// Memory only: the last batches applied, to tell copies from a restarted engine's.
    applied: Applied,
    /// The KV cache groups its events named (`engine_groups/v8`).
    groups: Groups,
    /// A hybrid engine's holdings, per group (`engine_group_blocks/v8`; `None`: one group, in
    /// `blocks`).
    hybrid: Option<Box<Hybrid>>,
}

/// The KV cache groups an engine's events named (their kinds in the file; how often they changed
/// in memory only). An engine of one full-attention group (or that names none) is followed in
/// its blocks; an engine of several groups, or of another kind of attention, is hybrid
/// ([`Hybrid`]).
#[derive(Clone, Debug, Default)]
struct Groups {
    /// Each group's kind, by index, as its stores named it.
    kinds: BTreeMap<u32, GroupKind>,
    /// Times a group changed kind (the engine was restarted with another model or layout).
    changes: u64,
}

impl Groups {
    /// Whether the engine is hybrid: more than one group, or a group that is not full
    /// attention.
    fn hybrid(&self) -> bool {
        self.kinds.len() > 1 || self.kinds.values().any(|k| *k != GroupKind::Full)
    }
}

/// A node holding a block of ours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    node: u32,
    /// Engine blocks keying it (almost always one), by the tier each can be loaded from (0 GPU,
    /// 1 CPU, 2 storage: the slowest along its chain).
    by_tier: [u32; 3],
    /// The newest clock of those.
    clock: u64,
}

impl Holder {
    /// The fastest tier the node can load the block from.
    fn tier(&self) -> u8 {
        match self.by_tier {
            [0, 0, _] => 2,
            [0, _, _] => 1,
            _ => 0,
        }
    }
}

/// The nodes holding a block of ours: almost always one, kept inline (a map entry with a
/// vector of one would cost an allocation a block on the ingest path).
#[derive(Clone, Debug, PartialEq, Eq)]
enum Holders {
    One(Holder),
    Many(Vec<Holder>),
}

impl Holders {
    fn as_slice(&self) -> &[Holder] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(v) => v,
        }
    }

    fn get_mut(&mut self, node: u32) -> Option<&mut Holder> {
        match self {
            Holders::One(h) => Some(h).filter(|h| h.node == node),
            Holders::Many(v) => v.iter_mut().find(|h| h.node == node),
        }
    }

    /// Adds `holder` (of a node not holding it yet).
    fn push(&mut self, holder: Holder) {
        match self {
            Holders::One(h) => *self = Holders::Many(vec![*h, holder]),
            Holders::Many(v) => v.push(holder),
        }
    }

    /// Removes node `node`'s holding; whether none is left.
    fn remove(&mut self, node: u32) -> bool {
        match self {
            Holders::One(h) => h.node == node,
            Holders::Many(v) => {
                v.retain(|h| h.node != node);
                match *v.as_slice() {
                    [] => true,
                    [one] => {
                        *self = Holders::One(one);
                        false
                    }
                    _ => false,
                }
            }
        }
    }
}

/// An engine's figures a gauge shows: its engine blocks, and its KV cache groups.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct EngineGauges {
    pub(crate) engine_blocks: usize,
    pub(crate) groups: usize,
}

/// Every engine stream, and the blocks of ours each holds.
#[derive(Clone, Debug, Default)]
pub(crate) struct Engines {
    streams: BTreeMap<u32, Stream>,
    held: KeyMap<BlockKey, Holders>,
    /// Nodes whose engine's stream has a gap being covered (memory only): what they hold is
    /// not answered until it is (their batches may have removed some of it).
    in_doubt: BTreeSet<u32>,
    effects: Vec<Effect>,
    /// The clock of the decision in progress.
    clock: u64,
    /// Where rows are written before they are copied out whole (memory reused across rows).
    scratch: Vec<u8>,
    /// A setting: the attention chunk of chunked local groups, in tokens (the model's; not in
    /// the events). `None`: such a group is answered as holding nothing.
    attention_chunk: Option<usize>,
}

impl Engines {
    /// Sets the attention chunk of chunked local groups (a setting, not decided state).
    pub(crate) fn set_attention_chunk(&mut self, tokens: Option<usize>) {
        self.attention_chunk = tokens.filter(|&t| t > 0);
    }

    /// The attention chunk of chunked local groups, if set.
    pub(crate) fn attention_chunk(&self) -> Option<usize> {
        self.attention_chunk
    }

    /// Whether any node has an event stream.
    pub(crate) fn any(&self) -> bool {
        !self.streams.is_empty()
    }

    /// Whether node `node` has an event stream (its answers are what its engine holds).
    pub(crate) fn streams(&self, node: u32) -> bool {
        self.streams.contains_key(&node)
    }

    /// The nodes with a stream.
    pub(crate) fn nodes(&self) -> impl Iterator<Item = u32> + '_ {
        self.streams.keys().copied()
    }

    /// Where node `node`'s stream stands: the last batch applied (number, publish time).
    pub(crate) fn position(&self, node: u32) -> Option<(u64, f64)> {
        let s = self.streams.get(&node)?;
        s.record.last.map(|seq| (seq, s.record.last_ts))
    }

    /// The last batches node `node`'s stream applied (see [`Applied`]).
    #[cfg(feature = "nats")]
    pub(crate) fn applied(&self, node: u32) -> Applied {
        self.streams.get(&node).map(|s| s.applied.clone()).unwrap_or_default()
    }

    /// Node `node`'s stream's counts (all 0 before its first batch).
    pub(crate) fn counts(&self, node: u32) -> EngineCounts {
        self.streams.get(&node).map(|s| s.record.counts.clone()).unwrap_or_default()
    }

    /// A claim (`ran`) by `node` at or below this clock is not answered. None of a hybrid
    /// engine's is: what it keeps of a prompt (a sliding window's last blocks) is not the
    /// prompt, so only its events say what it reuses.
    pub(crate) fn claim_floor(&self, node: u32) -> u64 {
        self.streams.get(&node).map_or(0, |s| if s.hybrid.is_some() { u64::MAX } else { s.claim_floor })
    }

    /// Claims by `node` at or below `clock` are no longer answered (the grace window passed).
    pub(crate) fn expire_claims(&mut self, node: u32, clock: u64) {
        if let Some(s) = self.streams.get_mut(&node) {
            s.claim_floor = s.claim_floor.max(clock);
        }
    }

    /// The newest of the nodes holding block `key`: (node, clock).
    pub(crate) fn holders(&self, key: &BlockKey) -> Option<(u32, u64)> {
        let holders = self.held.get(key)?.as_slice().iter().filter(|h| self.trusted(h.node));
        holders.max_by_key(|h| (h.clock, h.node)).map(|h| (h.node, h.clock))
    }

    /// The block sizes of the hybrid engines' holdings (a prompt's fine keys are made at each).
    pub(crate) fn hybrid_sizes(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> =
            self.streams.values().filter_map(|s| s.hybrid.as_ref().and_then(|h| h.block_size())).collect();
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    /// What each trusted hybrid engine reuses of a prompt of `prompt` tokens whose fine keys at
    /// each block size are `fine` (see [`crate::keys::Prefix`]), by vLLM's rule, its offloading
    /// connector's included: the whole hit and its GPU part, in tokens, and the clock of the
    /// hit's last block; nothing reused included.
    pub(crate) fn hybrid_depths(&self, fine: &[(usize, Vec<BlockKey>)], prompt: usize) -> Vec<(u32, Reused)> {
        self.streams.keys().filter_map(|&node| Some((node, self.hybrid_reuse(fine, prompt, node)?))).collect()
    }

    /// What hybrid engine `node` reuses of a prompt (as [`Engines::hybrid_depths`]); `None` for
    /// a node that is not a trusted hybrid engine.
    fn hybrid_reuse(&self, fine: &[(usize, Vec<BlockKey>)], prompt: usize, node: u32) -> Option<Reused> {
        let s = self.streams.get(&node).filter(|_| self.trusted(node))?;
        let hybrid = s.hybrid.as_ref()?;
        let size = hybrid.block_size()?;
        let (_, keys) = fine.iter().find(|(at, _)| *at == size)?;
        Some(hybrid.reused(&s.groups.kinds, self.attention_chunk, keys, prompt))
    }

    /// Whether `node` holds block `key`, and from which clock.
    pub(crate) fn held_by(&self, key: &BlockKey, node: u32) -> Option<u64> {
        self.holder(key, node).map(|h| h.clock)
    }

    /// Whether `node` holds block `key` in GPU memory (its whole chain there), and from which
    /// clock.
    pub(crate) fn held_on_gpu(&self, key: &BlockKey, node: u32) -> Option<u64> {
        self.holder(key, node).filter(|h| h.by_tier[0] > 0).map(|h| h.clock)
    }

    /// The tier `node` can load block `key` from (0 GPU, 1 CPU, 2 storage), if it holds it.
    pub(crate) fn tier(&self, key: &BlockKey, node: u32) -> Option<u8> {
        self.holder(key, node).map(Holder::tier)
    }

    /// Node `node`'s holding of block `key`, if it holds it and is not in doubt.
    fn holder(&self, key: &BlockKey, node: u32) -> Option<&Holder> {
        self.held.get(key)?.as_slice().iter().find(|h| h.node == node).filter(|_| self.trusted(node))
    }

    /// Whether what node `node` holds is answered: no gap of its stream is being covered.
    fn trusted(&self, node: u32) -> bool {
        self.in_doubt.is_empty() || !self.in_doubt.contains(&node)
    }

    /// Node `node`'s stream has a gap being covered (`true`), or no longer (`false`): while it
    /// has, what the node holds is not answered (the lost batches may have removed some of it),
    /// and nothing else changes.
    pub(crate) fn set_in_doubt(&mut self, node: u32, in_doubt: bool) {
        if in_doubt {
            self.in_doubt.insert(node);
        } else {
            self.in_doubt.remove(&node);
        }
    }

    /// Node `node`'s engine's figures for its gauges.
    pub(crate) fn gauges(&self, node: u32) -> EngineGauges {
        EngineGauges {
            engine_blocks: self.sizes(node).0,
            groups: self.streams.get(&node).map_or(0, |s| s.groups.kinds.len()),
        }
    }

    /// Node `node`'s engine blocks and blocks of ours held (0 of ours for a hybrid engine: its
    /// answers are not blocks of ours).
    pub(crate) fn sizes(&self, node: u32) -> (usize, usize) {
        self.streams.get(&node).map_or((0, 0), |s| match &s.hybrid {
            Some(h) => (h.len(), 0),
            None => (s.blocks.len(), s.ours),
        })
    }

    /// Each stream's position, sizes and counts, with node names from `name`.
    pub(crate) fn stats(&self, name: impl Fn(u32) -> String) -> Vec<EngineStats> {
        self.streams
            .iter()
            .map(|(&id, s)| {
                let (engine_blocks, blocks) = self.sizes(id);
                let mut by_tier = [0; 3];
                if let Some(h) = &s.hybrid {
                    let offloaded_only = h.offloaded_only();
                    by_tier[0] = h.len() - offloaded_only;
                    by_tier[1] = offloaded_only;
                }
                for b in s.blocks.slots().filter_map(|i| s.blocks.get(i)) {
                    if let Some(n) = by_tier.get_mut(usize::from(b.own_tier())) {
                        *n += 1;
                    }
                }
                EngineStats {
                    node: name(id),
                    last_seq: s.record.last,
                    last_ts: s.record.last_ts,
                    engine_blocks,
                    blocks,
                    by_tier,
                    counts: s.record.counts.clone(),
                    groups: s.groups.kinds.iter().map(|(&index, &kind)| CacheGroup { index, kind }).collect(),
                    unplaced_blocks: s.hybrid.as_ref().map_or(0, |h| h.unplaced),
                    group_changes: s.groups.changes,
                }
            })
            .collect()
    }

    /// The effects decided since the last call.
    pub(crate) fn take_effects(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    /// Decides one batch of node `node`'s engine at `clock`: in order, or a duplicate, or a gap,
    /// or the first batch of a restarted engine (everything the node held is dropped first).
    #[cfg(test)]
    pub(crate) fn batch(&mut self, scheme: Scheme, node: u32, batch: &EngineBatch, clock: u64) -> EngineOutcome {
        self.batch_part(scheme, node, batch, clock, usize::MAX).0
    }

    /// [`Engines::batch`], applying at most `budget` blocks of it: the rest, if any, is where
    /// [`Engines::rest`] goes on.
    pub(crate) fn batch_part(
        &mut self,
        scheme: Scheme,
        node: u32,
        batch: &EngineBatch,
        clock: u64,
        budget: usize,
    ) -> (EngineOutcome, Option<Cursor>) {
        self.clock = clock;
        // A node's first batch: from now on its engine says what it holds, and its `ran`s
        // before are no longer answered.
        let stream = self.streams.entry(node).or_insert_with(|| Stream { claim_floor: clock, ..Stream::default() });
        let (record, applied) = (&stream.record, &stream.applied);
        let outcome = match Follows::after(record.last.map(|l| (l, record.last_ts)), applied, batch) {
            Follows::Next => EngineOutcome::Applied,
            Follows::Copy => EngineOutcome::Duplicate,
            Follows::Restart => {
                self.count_only(node, |c| c.restarts += 1);
                self.clear(node, clock);
                return self.batch_part(scheme, node, batch, clock, budget);
            }
            Follows::Gap { from } => EngineOutcome::Gap { from },
        };
        let rest = match outcome {
            EngineOutcome::Applied => self.apply(scheme, node, batch, clock, Cursor::default(), budget),
            EngineOutcome::Duplicate => {
                self.count(node, |c| c.duplicate_batches += 1);
                None
            }
            EngineOutcome::Gap { .. } => {
                self.count(node, |c| c.gaps += 1);
                None
            }
        };
        (outcome, rest)
    }

    /// Decides that node `node`'s engine cannot give what came before `batch`: everything the
    /// node held is dropped, and `batch` is applied as the stream's new start, at most `budget`
    /// blocks of it (as [`Engines::batch_part`]).
    pub(crate) fn resync_part(
        &mut self,
        scheme: Scheme,
        node: u32,
        batch: &EngineBatch,
        clock: u64,
        budget: usize,
    ) -> Option<Cursor> {
        self.clock = clock;
        self.streams.entry(node).or_insert_with(|| Stream { claim_floor: clock, ..Stream::default() });
        self.count(node, |c| c.lost += 1);
        self.clear(node, clock);
        self.apply(scheme, node, batch, clock, Cursor::default(), budget)
    }

    /// Goes on applying a batch [`Engines::batch_part`] or [`Engines::resync_part`] left at
    /// `from`, at most `budget` blocks more.
    pub(crate) fn rest(
        &mut self,
        scheme: Scheme,
        node: u32,
        batch: &EngineBatch,
        clock: u64,
        from: Cursor,
        budget: usize,
    ) -> Option<Cursor> {
        self.clock = clock;
        self.apply(scheme, node, batch, clock, from, budget)
    }

    /// Decides node `node`'s stream gone (the node was forgotten): its blocks and its row go.
    pub(crate) fn forget(&mut self, node: u32) {
        if self.streams.contains_key(&node) {
            self.drop_holdings(node);
            self.streams.remove(&node);
            self.effects.push(Effect::EngineClear { node, stream: None });
        }
    }

    fn count(&mut self, node: u32, f: impl FnOnce(&mut EngineCounts)) {
        if let Some(s) = self.streams.get_mut(&node) {
            f(&mut s.record.counts);
            self.effects.push(Effect::EngineStream { node, row: Arc::new(s.record.clone()), clock: self.clock });
        }
    }

    /// Applies `batch`'s events from `from` on, at most `budget` blocks (an event without
    /// blocks counts as one); after its last event, the batch is the stream's last. Returns
    /// where it stopped if it did not finish: the stream is then written as unfinished
    /// (no last batch), so that a file closed or crashed before the rest is applied says so
    /// ([`Engines::drop_unfinished`]).
    fn apply(
        &mut self,
        scheme: Scheme,
        node: u32,
        batch: &EngineBatch,
        clock: u64,
        from: Cursor,
        budget: usize,
    ) -> Option<Cursor> {
        let mut at = from;
        let mut left = budget;
        // The groups the batch names, before any of its events: a hybrid engine's first step
        // names its full group first, and its blocks are a hybrid engine's too. Only GPU stores
        // teach a group's kind: an offloading connector's name the group but, by default, not
        // its kind (vLLM 0.33's placeholder stores).
        if from == Cursor::default() {
            for event in &batch.events {
                if let EngineEvent::Stored(s) = event
                    && s.medium == Medium::Gpu
                {
                    self.learn(node, s.group);
                }
            }
        }
        while let Some(event) = batch.events.get(at.event) {
            if left == 0 {
                self.unfinished(node);
                return Some(at);
            }
            let hybrid = self.streams.get(&node).is_some_and(|s| s.hybrid.is_some());
            let (done, whole) = match event {
                _ if hybrid => {
                    self.hybrid_event(scheme, node, batch, at.event, clock);
                    (1, true)
                }
                EngineEvent::Stored(s) => match s.medium.tier() {
                    Some(tier) => {
                        let end = self.store(scheme, node, s, clock, tier, (at.block, left));
                        (end - at.block, end >= s.hashes.len())
                    }
                    None => {
                        self.count_only(node, |c| c.other_medium += 1);
                        (1, true)
                    }
                },
                EngineEvent::Removed { hashes, medium, .. } => match medium.tier() {
                    Some(tier) => {
                        let end = hashes.len().min(at.block.saturating_add(left));
                        for &h in hashes.get(at.block..end).unwrap_or_default() {
                            self.remove(node, h, clock, tier);
                        }
                        (end - at.block, end >= hashes.len())
                    }
                    None => {
                        self.count_only(node, |c| c.other_medium += 1);
                        (1, true)
                    }
                },
                EngineEvent::Cleared => {
                    self.clear(node, clock);
                    (1, true)
                }
            };
            left = left.saturating_sub(done.max(1));
            at = if whole { Cursor { event: at.event + 1, block: 0 } } else { Cursor { block: at.block + done, ..at } };
        }
        if let Some(s) = self.streams.get_mut(&node) {
            s.record.last = Some(batch.seq);
            s.record.last_ts = batch.ts;
            s.record.counts.batches += 1;
            s.applied.push(batch);
            self.effects.push(Effect::EngineStream { node, row: Arc::new(s.record.clone()), clock: self.clock });
        }
        None
    }

    /// Learns the group a store of node `node` names. A group that changes kind, or an engine
    /// that turns out hybrid, clears what the node held: it was kept under another layout.
    fn learn(&mut self, node: u32, group: Option<CacheGroup>) {
        let Some(g) = group else { return };
        let Some(s) = self.streams.get_mut(&node) else { return };
        let before = s.groups.kinds.insert(g.index, g.kind);
        if before != Some(g.kind) {
            let kinds = s.groups.kinds.iter().map(|(&i, &k)| (i, k)).collect();
            self.effects.push(Effect::EngineGroups { node, kinds });
        }
        let changed = before.is_some_and(|before| before != g.kind);
        s.groups.changes += u64::from(changed);
        let hybrid = s.groups.hybrid();
        if changed || hybrid != s.hybrid.is_some() {
            if s.blocks.len() > 0 || s.hybrid.as_ref().is_some_and(|h| h.len() > 0) {
                self.clear(node, self.clock);
            }
            if let Some(s) = self.streams.get_mut(&node) {
                s.hybrid = hybrid.then(Box::default);
            }
        }
    }

    /// Applies event `i` of `batch` to hybrid node `node`'s holdings (every group's copies; a
    /// store that lists only some blocks of its range is placed by one of the batch that lists
    /// them all). GPU copies, and the offloading connector's in CPU memory.
    fn hybrid_event(&mut self, scheme: Scheme, node: u32, batch: &EngineBatch, i: usize, clock: u64) {
        let Some(event) = batch.events.get(i) else { return };
        if let EngineEvent::Cleared = event {
            self.clear(node, clock);
            return;
        }
        let Some(s) = self.streams.get_mut(&node) else { return };
        let Some(hybrid) = s.hybrid.as_mut() else { return };
        match event {
            EngineEvent::Stored(stored) if stored.medium == Medium::Gpu => {
                let Some(group) = stored.group else {
                    hybrid.unplaced += stored.hashes.len() as u64;
                    return;
                };
                let size = stored.block_size as usize;
                let dense = (stored.hashes.len() * size != stored.tokens.len())
                    .then(|| {
                        batch.events.iter().find_map(|e| match e {
                            EngineEvent::Stored(d)
                                if d.parent == stored.parent
                                    && d.block_size == stored.block_size
                                    && d.hashes.len() * size == d.tokens.len()
                                    && d.tokens == stored.tokens =>
                            {
                                Some(d)
                            }
                            _ => None,
                        })
                    })
                    .flatten();
                let placed = hybrid.store(scheme, stored, (group.index, clock), dense, (node, &mut self.effects));
                s.record.counts.stored += placed as u64;
            }
            // A GPU copy, or the offloading connector's in CPU memory, per group.
            EngineEvent::Removed { hashes, medium: medium @ (Medium::Gpu | Medium::Cpu), group: Some(group) } => {
                let mut removed = 0;
                for &hash in hashes {
                    let out = (node, &mut self.effects);
                    let gone = match medium {
                        Medium::Gpu => hybrid.remove(hash, *group, out),
                        _ => hybrid.unload(hash, *group, out),
                    };
                    removed += u64::from(gone);
                }
                s.record.counts.removed += removed;
                s.record.counts.unknown_removals += hashes.len() as u64 - removed;
                if removed > 0 && *medium == Medium::Gpu {
                    s.claim_floor = s.claim_floor.max(clock);
                }
            }
            EngineEvent::Removed { hashes, medium: Medium::Gpu, group: None } => {
                s.record.counts.unknown_removals += hashes.len() as u64;
            }
            // The offloading connector's copies in CPU memory, per group.
            EngineEvent::Stored(stored @ EngineStored { medium: Medium::Cpu, group: Some(group), .. }) => {
                let placed = hybrid.offload(scheme, stored, (group.index, clock), (node, &mut self.effects));
                s.record.counts.stored += placed as u64;
            }
            _ => s.record.counts.other_medium += 1,
        }
    }

    /// Writes node `node`'s stream as in the middle of a batch: no last batch, beside blocks.
    fn unfinished(&mut self, node: u32) {
        if let Some(s) = self.streams.get(&node) {
            let record = StreamRecord { last: None, ..s.record.clone() };
            self.effects.push(Effect::EngineStream { node, row: Arc::new(record), clock: self.clock });
        }
    }

    fn count_only(&mut self, node: u32, f: impl FnOnce(&mut EngineCounts)) {
        if let Some(s) = self.streams.get_mut(&node) {
            f(&mut s.record.counts);
        }
    }

    /// Everything node `node` held is gone; its claims before `clock` too.
    fn clear(&mut self, node: u32, clock: u64) {
        self.drop_holdings(node);
        if let Some(s) = self.streams.get_mut(&node) {
            s.blocks.clear();
            if let Some(h) = s.hybrid.as_mut() {
                h.clear();
            }
            s.namespaces.clear();
            s.ours = 0;
            s.record.last = None;
            s.record.counts.clears += 1;
            s.claim_floor = s.claim_floor.max(clock);
            self.effects.push(Effect::EngineClear { node, stream: Some(Arc::new(s.record.clone())) });
        }
    }

    /// Takes every block of ours node `node` holds out of the held map.
    fn drop_holdings(&mut self, node: u32) {
        let Some(s) = self.streams.get(&node) else { return };
        let keys: Vec<(BlockKey, u8)> = s
            .blocks
            .slots()
            .filter_map(|i| s.blocks.get(i))
            .filter(|b| b.attached)
            .flat_map(|b| keys_of(b).iter().map(|&k| (k, b.tier)))
            .collect();
        for (key, tier) in keys {
            unhold(&mut self.held, &key, node, tier);
        }
    }

    /// Stores the blocks of `stored` from `from` on, at most `budget` of them (the event's own
    /// checks and counts are made at its first block). Returns the index after the last block
    /// it took (every block of an event refused as a whole).
    fn store(
        &mut self,
        scheme: Scheme,
        node: u32,
        stored: &EngineStored,
        clock: u64,
        tier: u8,
        (from, budget): (usize, usize),
    ) -> usize {
        let size = stored.block_size as usize;
        let all = stored.hashes.len();
        let end = all.min(from.saturating_add(budget));
        let Some(stream) = self.streams.get_mut(&node) else { return all };
        if tier > 0 && stored.tokens.is_empty() {
            // An offloading connector's store names blocks first stored on the GPU, without their
            // tokens: a copy of a block this index holds, or nothing it can key.
            for &hash in stored.hashes.get(from..end).unwrap_or_default() {
                let Some(i) = stream.blocks.find(hash) else {
                    stream.record.counts.other_medium += 1;
                    continue;
                };
                stream.record.counts.stored += 1;
                add_copy(stream, &mut self.held, node, i, tier);
                let row = encode_row(&stream.blocks, i, &stream.namespaces, &mut self.scratch);
                let clock = stream.blocks.get(i).map_or(clock, |b| b.clock);
                self.effects.push(Effect::EngineBlock { node, clock, hash, row: Some(row) });
            }
            return end;
        }
        let aligned = size > 0 && BLOCK_TOKENS.is_multiple_of(size);
        if from == 0 {
            // A block its own parent (no engine sends one) would make a cycle of the chain.
            let loops =
                stored.hashes.iter().zip(std::iter::once(stored.parent).chain(stored.hashes.iter().map(|&h| Some(h))));
            let looped = loops.clone().any(|(&h, p)| p == Some(h));
            if size == 0 || stored.tokens.len() != size.saturating_mul(all) || looped {
                stream.record.counts.malformed += 1;
                return all;
            }
            if stored.namespace.is_none() {
                stream.record.counts.unkeyed += 1;
            }
            if !aligned {
                stream.record.counts.unaligned += all as u64;
            }
            if let Some(p) = stored.parent
                && stream.blocks.find(p).is_none()
            {
                stream.record.counts.unknown_parents += 1;
            }
        }
        // The block before the first one taken: the event's parent, or its block before.
        let mut parent = match from.checked_sub(1) {
            None => stored.parent,
            Some(before) => stored.hashes.get(before).copied(),
        };
        let blocks = stored.hashes.iter().zip(stored.tokens.chunks_exact(size.max(1))).take(end).skip(from);
        for (&hash, tokens) in blocks {
            stream.record.counts.stored += 1;
            if let Some(i) = stream.blocks.find(hash) {
                if stream.blocks.get(i).is_some_and(|b| copies(b, tier) > 0) {
                    stream.record.counts.duplicate_blocks += 1;
                }
                add_copy(stream, &mut self.held, node, i, tier);
                let row = encode_row(&stream.blocks, i, &stream.namespaces, &mut self.scratch);
                let clock = stream.blocks.get(i).map_or(clock, |b| b.clock);
                self.effects.push(Effect::EngineBlock { node, clock, hash, row: Some(row) });
                parent = Some(hash);
                continue;
            }
            let root = match parent {
                Some(_) => None,
                None => Some(stored.namespace.as_ref().and_then(|ns| namespace_index(&mut stream.namespaces, ns))),
            };
            let i = stream.blocks.insert(hash, parent, tokens, clock, root);
            // Blocks that hash more than their tokens, or whose ends are not ends of blocks of
            // ours, key nothing, nor does anything below them.
            if let Some(b) = stream.blocks.get_mut(i) {
                b.opaque = stored.namespace.is_none() || !aligned;
                if let Some(c) = b.offload.get_mut(usize::from(tier).wrapping_sub(1)) {
                    *c = 1;
                }
            }
            self.effects.push(Effect::EngineBlock {
                node,
                clock,
                hash,
                row: Some(encode_row(&stream.blocks, i, &stream.namespaces, &mut self.scratch)),
            });
            let parent_attached = parent
                .and_then(|p| stream.blocks.find(p))
                .and_then(|p| stream.blocks.get(p))
                .is_some_and(|b| b.attached);
            if parent.is_none() || parent_attached {
                attach(scheme, stream, &mut self.held, node, i);
            }
            parent = Some(hash);
        }
        end
    }

    fn remove(&mut self, node: u32, hash: u64, clock: u64, tier: u8) {
        let Some(stream) = self.streams.get_mut(&node) else { return };
        // A block, or a copy in a medium, this index never had.
        let Some(i) = stream.blocks.find(hash).filter(|&i| stream.blocks.get(i).is_some_and(|b| copies(b, tier) > 0))
        else {
            stream.record.counts.unknown_removals += 1;
            return;
        };
        stream.record.counts.removed += 1;
        if let Some(b) = stream.blocks.get_mut(i)
            && b.refs > 1
        {
            // One copy of several: the engine still holds the block, maybe in a slower tier.
            let before = b.own_tier();
            b.refs -= 1;
            if let Some(c) = b.offload.get_mut(usize::from(tier).wrapping_sub(1)) {
                *c -= 1;
            }
            if b.own_tier() != before {
                retier(stream, &mut self.held, node, i);
            }
            let row = encode_row(&stream.blocks, i, &stream.namespaces, &mut self.scratch);
            let clock = stream.blocks.get(i).map_or(clock, |b| b.clock);
            self.effects.push(Effect::EngineBlock { node, clock, hash, row: Some(row) });
            return;
        }
        // Removals win over claims: the node's `ran`s before this are no longer answered.
        stream.claim_floor = stream.claim_floor.max(clock);
        detach(stream, &mut self.held, node, i);
        let stored = stream.blocks.remove(i).map_or(clock, |b| b.clock);
        self.effects.push(Effect::EngineBlock { node, clock: stored, hash, row: None });
    }

    /// The streams of a file: its stream rows and block rows, attached and keyed in `scheme`
    /// (as `store/load.rs` reads them).
    ///
    /// # Errors
    /// The first error of `streams` or `blocks`.
    #[cfg(test)]
    pub(crate) fn load(
        scheme: Scheme,
        streams: impl Iterator<Item = Result<(u32, StreamRecord)>>,
        blocks: impl Iterator<Item = Result<(u32, u64, Row)>>,
        clock: u64,
    ) -> Result<Engines> {
        let mut engines = Engines::with_streams(streams, clock)?;
        for item in blocks {
            let (node, hash, row) = item?;
            engines.add_row(node, hash, row);
        }
        engines.finish(scheme);
        Ok(engines)
    }

    /// The streams of stream rows, holding nothing yet.
    pub(crate) fn with_streams(
        streams: impl Iterator<Item = Result<(u32, StreamRecord)>>,
        clock: u64,
    ) -> Result<Engines> {
        let mut engines = Engines::default();
        for item in streams {
            let (node, record) = item?;
            // Claims from before the open are past any grace window.
            engines.streams.insert(node, Stream { record, claim_floor: clock, ..Stream::default() });
        }
        Ok(engines)
    }

    /// One block row read (not attached yet: [`Engines::attach_all`]).
    pub(crate) fn add_row(&mut self, node: u32, hash: u64, row: Row) {
        let stream = self.streams.entry(node).or_default();
        let root = row.root.map(|r| r.and_then(|ns| namespace_index(&mut stream.namespaces, &ns)));
        let i = stream.blocks.insert(hash, row.parent, &row.tokens, row.clock, root);
        if let Some(b) = stream.blocks.get_mut(i) {
            b.refs = row.refs.max(1);
            b.offload = row.offload;
            b.opaque = row.opaque;
        }
    }

    /// One KV cache group read: node `node`'s engine's group `index` is of `kind` (before its
    /// hybrid rows).
    pub(crate) fn add_group(&mut self, node: u32, index: u32, kind: GroupKind) {
        let s = self.streams.entry(node).or_default();
        s.groups.kinds.insert(index, kind);
        if s.groups.hybrid() && s.hybrid.is_none() {
            s.hybrid = Some(Box::default());
        }
    }

    /// One hybrid engine's block row read: node `node`'s block `hash`, first stored at `since`.
    ///
    /// # Errors
    /// [`crate::Error::Corrupted`] for a row of a node whose groups are not hybrid, or that does
    /// not fit the node's others.
    pub(crate) fn add_hybrid_row(&mut self, node: u32, hash: u64, since: u64, row: GroupedRow) -> Result<()> {
        match self.streams.get_mut(&node).and_then(|s| s.hybrid.as_mut()) {
            Some(h) => h.load(hash, since, row),
            None => Err(crate::Error::Corrupted {
                detail: format!("node id {node} has a hybrid engine's block rows but no hybrid groups"),
            }),
        }
    }

    /// Ends a load (after [`Engines::with_streams`] and every [`Engines::add_row`]): drops what
    /// an unfinished stream holds, and attaches every stream's blocks.
    pub(crate) fn finish(&mut self, scheme: Scheme) {
        self.drop_unfinished();
        self.attach_all(scheme);
    }

    /// Drops what a stream written in the middle of a batch holds (no last batch, beside
    /// blocks: a head closed or crashed before it applied the rest): a part of a batch may
    /// miss removals of the rest, so the node is known to hold nothing (the index may know less
    /// than the engine, never more) and its engine starts its stream again, as after a lost
    /// batch. Its rows go with the next engine change.
    fn drop_unfinished(&mut self) {
        for (&node, s) in &mut self.streams {
            if s.record.last.is_none() && (s.blocks.len() > 0 || s.hybrid.as_ref().is_some_and(|h| h.len() > 0)) {
                s.blocks.clear();
                if let Some(h) = s.hybrid.as_mut() {
                    h.clear();
                }
                s.namespaces.clear();
                s.ours = 0;
                s.record.counts.lost += 1;
                self.effects.push(Effect::EngineClear { node, stream: Some(Arc::new(s.record.clone())) });
            }
        }
    }

    /// Attaches every stream's blocks from the prompts' first blocks down.
    fn attach_all(&mut self, scheme: Scheme) {
        let nodes: Vec<u32> = self.streams.keys().copied().collect();
        for node in nodes {
            let Some(stream) = self.streams.get_mut(&node) else { continue };
            let roots: Vec<u32> =
                stream.blocks.slots().filter(|&i| stream.blocks.get(i).is_some_and(|b| b.parent.is_none())).collect();
            for root in roots {
                attach(scheme, stream, &mut self.held, node, root);
            }
        }
    }
}

/// The index of `ns` in a stream's namespaces, added if new; `None` past 65,535 namespaces in
/// one stream (its blocks then key nothing).
fn namespace_index(list: &mut Vec<Namespace>, ns: &Namespace) -> Option<u16> {
    match list.iter().position(|n| n == ns) {
        Some(i) => u16::try_from(i).ok(),
        None if list.len() < usize::from(u16::MAX) => {
            list.push(ns.clone());
            u16::try_from(list.len() - 1).ok()
        }
        None => None,
    }
}

fn hold(held: &mut KeyMap<BlockKey, Holders>, key: BlockKey, node: u32, clock: u64, tier: u8) {
    let fresh = Holder { node, by_tier: [0; 3], clock };
    let holders = held.entry(key).or_insert(Holders::One(fresh));
    if holders.get_mut(node).is_none() {
        holders.push(fresh);
    }
    if let Some(h) = holders.get_mut(node) {
        h.clock = h.clock.max(clock);
        if let Some(n) = h.by_tier.get_mut(usize::from(tier)) {
            *n = n.saturating_add(1);
        }
    }
}

/// One engine block keying `key` for `node` can now be loaded from `to`, not `from`.
fn set_tier(held: &mut KeyMap<BlockKey, Holders>, key: &BlockKey, node: u32, from: u8, to: u8) {
    if let Some(h) = held.get_mut(key).and_then(|h| h.get_mut(node)) {
        if let Some(n) = h.by_tier.get_mut(usize::from(from)) {
            *n = n.saturating_sub(1);
        }
        if let Some(n) = h.by_tier.get_mut(usize::from(to)) {
            *n = n.saturating_add(1);
        }
    }
}

/// Copies of block `b` in `tier`.
fn copies(b: &Slot, tier: u8) -> u32 {
    match tier {
        0 => gpu_copies(b.refs, b.offload),
        1 => b.offload[0],
        _ => b.offload[1],
    }
}

/// Of `refs` copies, those on the GPU: the ones not offloaded.
pub(crate) fn gpu_copies(refs: u32, [cpu, storage]: [u32; 2]) -> u32 {
    refs.saturating_sub(cpu.saturating_add(storage))
}

/// One more copy of the block in slot `i`, in `tier`; its chain's tiers follow if its own
/// (the fastest of its copies) changed.
fn add_copy(stream: &mut Stream, held: &mut KeyMap<BlockKey, Holders>, node: u32, i: u32, tier: u8) {
    let Some(b) = stream.blocks.get_mut(i) else { return };
    let before = b.own_tier();
    if b.refs == u32::MAX {
        // Past what a row can count: the copy is not counted (its removal then finds one less).
        return;
    }
    b.refs += 1;
    if let Some(c) = b.offload.get_mut(usize::from(tier).wrapping_sub(1)) {
        *c += 1;
    }
    if b.own_tier() != before {
        retier(stream, held, node, i);
    }
}

/// The chain tier of an attached block whose parent is `parent` (0 for a first block).
fn parent_tier(stream: &Stream, parent: Option<u64>) -> u8 {
    parent.and_then(|p| stream.blocks.find(p)).and_then(|p| stream.blocks.get(p)).map_or(0, |p| p.tier)
}

/// The block in slot `i` changed its own tier: it and the attached blocks below it take their
/// chain's (the slowest along it), down to where nothing changes.
fn retier(stream: &mut Stream, held: &mut KeyMap<BlockKey, Holders>, node: u32, i: u32) {
    let Some(b) = stream.blocks.get(i).filter(|b| b.attached) else { return };
    let mut todo = vec![(i, parent_tier(stream, b.parent), true)];
    while let Some((i, above, first)) = todo.pop() {
        let Some(b) = stream.blocks.get_mut(i).filter(|b| b.attached) else { continue };
        let tier = above.max(b.own_tier());
        if tier == b.tier && !first {
            continue;
        }
        let was = std::mem::replace(&mut b.tier, tier);
        for key in keys_of(b) {
            set_tier(held, key, node, was, tier);
        }
        todo.extend(stream.blocks.children(i).map(|c| (c, tier, false)));
    }
}

/// One engine block keying `key` for `node`, loadable from `tier`, no longer does.
fn unhold(held: &mut KeyMap<BlockKey, Holders>, key: &BlockKey, node: u32, tier: u8) {
    let Some(holders) = held.get_mut(key) else { return };
    let Some(h) = holders.get_mut(node) else { return };
    if let Some(n) = h.by_tier.get_mut(usize::from(tier)) {
        *n = n.saturating_sub(1);
    }
    if h.by_tier == [0; 3] && holders.remove(node) {
        held.remove(key);
    }
}

/// The blocks of ours block `b` keys (none before it was first attached).
fn keys_of(b: &Slot) -> &[BlockKey] {
    b.completed.as_deref().map_or(&[], |c| &c.keys)
}

/// Attaches the block in slot `i` (its parent is attached, or it is a first block) and every
/// detached block below it: each holds the blocks of ours that end inside it, derived the first
/// time it is attached.
fn attach(scheme: Scheme, stream: &mut Stream, held: &mut KeyMap<BlockKey, Holders>, node: u32, i: u32) {
    // The first block is kept out of the list, which a block without children (the usual
    // one, at the end of its chain) never allocates.
    let (mut first, mut todo) = (Some(i), Vec::new());
    while let Some(i) = first.take().or_else(|| todo.pop()) {
        if !stream.blocks.get(i).is_some_and(|b| b.derived) {
            let Some((ns, end, completed)) = derive(scheme, stream, i) else { continue };
            if let Some(b) = stream.blocks.get_mut(i) {
                (b.ns, b.end, b.completed, b.derived) = (ns, end, completed, true);
            }
        }
        let above = stream.blocks.get(i).map_or(0, |b| parent_tier(stream, b.parent));
        let Some(b) = stream.blocks.get_mut(i) else { continue };
        b.attached = true;
        b.tier = above.max(b.own_tier());
        for &key in keys_of(b) {
            hold(held, key, node, b.clock, b.tier);
        }
        let n = keys_of(b).len();
        stream.ours += n;
        todo.extend(stream.blocks.children(i).filter(|&c| stream.blocks.get(c).is_some_and(|b| !b.attached)));
    }
}

/// What the block in slot `i` keys, from its parent's chain state and the tokens since,
/// continued through its own tokens: (namespace, end, what it completes). `None` if its parent
/// is not attached.
fn derive(scheme: Scheme, stream: &Stream, i: u32) -> Option<(Option<u16>, u64, Option<Box<Completed>>)> {
    let block = stream.blocks.get(i)?;
    let own = stream.blocks.tokens(i);
    if block.opaque {
        // Keys nothing: its ancestors' chain does not name what it holds.
        let start = match block.parent {
            Some(p) => stream.blocks.find(p).and_then(|p| stream.blocks.get(p)).filter(|b| b.attached)?.end,
            None => 0,
        };
        return Some((None, start + own.len() as u64, None));
    }
    // The chain state at or before the parent's end, and the tokens after it up to the parent's
    // end, found by walking up to the nearest block that keeps a state.
    let (ns, start, mut state, mut pending) = match (block.parent, block.root) {
        (None, Some(ns)) => {
            let state = ns.and_then(|n| stream.namespaces.get(usize::from(n))).map(|n| ChainState::start(n.key()));
            (ns, 0u64, state, Vec::new())
        }
        (None, None) => return None,
        (Some(p), _) => {
            let mut cursor = stream.blocks.find(p)?;
            let parent = stream.blocks.get(cursor).filter(|b| b.attached)?;
            let (ns, end) = (parent.ns, parent.end);
            // The tokens since the state, gathered backwards and turned round once: fewer than
            // one block of ours, so with the block's own they fit one allocation.
            let mut pending = Vec::with_capacity(BLOCK_TOKENS + own.len());
            let state = loop {
                let at = stream.blocks.get(cursor)?;
                if let Some(c) = at.completed.as_deref() {
                    // The tokens of `cursor` after the state's last block.
                    let boundary = c.state.blocks() * BLOCK_TOKENS as u64;
                    let after = usize::try_from(at.end.saturating_sub(boundary)).unwrap_or(usize::MAX);
                    let tokens = stream.blocks.tokens(cursor);
                    pending.extend(tokens.get(tokens.len().saturating_sub(after)..).unwrap_or(&[]).iter().rev());
                    break Some(c.state);
                }
                if at.ns.is_none() {
                    break None;
                }
                pending.extend(stream.blocks.tokens(cursor).iter().rev());
                cursor = stream.blocks.find(at.parent?)?;
            };
            pending.reverse();
            (ns, end, state, pending)
        }
    };
    let end = start + own.len() as u64;
    let mut completed = None;
    if let Some(s) = state.as_mut() {
        pending.extend_from_slice(own);
        let mut keys = Vec::with_capacity(pending.len() / BLOCK_TOKENS);
        for chunk in pending.chunks_exact(BLOCK_TOKENS) {
            if let Ok(whole) = <&[u32; BLOCK_TOKENS]>::try_from(chunk) {
                keys.push(s.push(scheme, whole));
            }
        }
        if !keys.is_empty() || block.parent.is_none() {
            completed = Some(Box::new(Completed { state: *s, keys: keys.into() }));
        }
    }
    Some((ns.filter(|_| state.is_some()), end, completed))
}

/// Detaches the block in slot `i` and every attached block below it: their blocks of ours are
/// no longer held by `node`.
fn detach(stream: &mut Stream, held: &mut KeyMap<BlockKey, Holders>, node: u32, i: u32) {
    // The first block is kept out of the list, which a block without children (the usual
    // one, at the end of its chain) never allocates.
    let (mut first, mut todo) = (Some(i), Vec::new());
    while let Some(i) = first.take().or_else(|| todo.pop()) {
        let Some(b) = stream.blocks.get_mut(i).filter(|b| b.attached) else { continue };
        b.attached = false;
        for key in keys_of(b) {
            unhold(held, key, node, b.tier);
        }
        let n = keys_of(b).len();
        stream.ours = stream.ours.saturating_sub(n);
        todo.extend(stream.blocks.children(i));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]
    use std::collections::BTreeMap;

    use super::row::encode;
    use super::stream::REMEMBERED;
    use super::*;

    fn ns() -> Namespace {
        Namespace::new("m").expect("namespace")
    }

    fn stored(parent: Option<u64>, hashes: &[u64], tokens: &[u32], size: u32) -> EngineEvent {
        EngineEvent::Stored(EngineStored {
            parent,
            hashes: hashes.to_vec(),
            tokens: tokens.to_vec(),
            block_size: size,
            medium: Medium::Gpu,
            namespace: Some(ns()),
            group: None,
        })
    }

    fn batch(seq: u64, events: Vec<EngineEvent>) -> EngineBatch {
        EngineBatch { seq, ts: seq as f64, events }
    }

    /// Our keys of `tokens` that `engines` says node 0 holds, counted from the first.
    fn held_prefix(engines: &Engines, tokens: &[u32]) -> usize {
        let keys = ns().chain_in(Scheme::TreeChain, tokens);
        keys.iter().take_while(|k| engines.held_by(k, 0).is_some()).count()
    }

    #[test]
    fn engine_blocks_of_16_key_our_blocks_of_64_whatever_the_event_boundaries() {
        let tokens: Vec<u32> = (0..64 * 3 + 16).collect();
        let mut e = Engines::default();
        // 13 engine blocks of 16 stored as 5, then 1 (a decode step), then 7.
        let h: Vec<u64> = (100..113).collect();
        let out = e.batch(Scheme::TreeChain, 0, &batch(0, vec![stored(None, &h[..5], &tokens[..80], 16)]), 1);
        assert_eq!(out, EngineOutcome::Applied);
        assert_eq!(held_prefix(&e, &tokens), 1);
        e.batch(Scheme::TreeChain, 0, &batch(1, vec![stored(Some(104), &h[5..6], &tokens[80..96], 16)]), 2);
        e.batch(Scheme::TreeChain, 0, &batch(2, vec![stored(Some(105), &h[6..], &tokens[96..208], 16)]), 3);
        assert_eq!(held_prefix(&e, &tokens), 3);
        assert_eq!(e.sizes(0), (13, 3));
        // Removing the block in the middle of our second block drops it and everything after.
        e.batch(
            Scheme::TreeChain,
            0,
            &batch(3, vec![EngineEvent::Removed { hashes: vec![106], medium: Medium::Gpu, group: None }]),
            4,
        );
        assert_eq!(held_prefix(&e, &tokens), 1);
        // Stored again, everything below it is reachable again.
        e.batch(Scheme::TreeChain, 0, &batch(4, vec![stored(Some(105), &[106], &tokens[96..112], 16)]), 5);
        assert_eq!(held_prefix(&e, &tokens), 3);
    }

    /// A hybrid engine stores every block once per KV cache group, a sliding-window group only
    /// the last few of a request (its store lists those, over the whole range of tokens, and is
    /// placed by the full group's store of the same step, which comes after it). What it
    /// reuses is vLLM's rule over every group: a sliding window needs its last 8 blocks (window
    /// 128, blocks of 16) before the hit's end; a removal counts in its own group only. A group
    /// that changes kind clears the node; an engine that names no group is followed as before.
    #[test]
    fn a_hybrid_engine_reuses_what_every_group_holds() {
        let tokens: Vec<u32> = (0..64 * 3).collect();
        let prompt: Vec<u32> = (0..64 * 3 + 40).collect();
        let fine = vec![(
            16,
            crate::keys::fine_keys(
                ns().key(),
                &ns().chain_in(Scheme::TreeChain, &prompt),
                &prompt,
                16,
                (prompt.len() - 1) / 16,
            ),
        )];
        let h: Vec<u64> = (200..212).collect();
        let sliding = CacheGroup { index: 0, kind: GroupKind::SlidingWindow { window: 128 } };
        let full = CacheGroup { index: 1, kind: GroupKind::Full };
        let in_group = |event: EngineEvent, group: CacheGroup| match event {
            EngineEvent::Stored(s) => EngineEvent::Stored(EngineStored { group: Some(group), ..s }),
            other => other,
        };
        let sparse = |hashes: &[u64]| {
            let EngineEvent::Stored(s) = stored(None, &[], &tokens, 16) else { unreachable!() };
            EngineEvent::Stored(EngineStored { hashes: hashes.to_vec(), group: Some(sliding), ..s })
        };
        let removed = |hash: u64, group: u32| EngineEvent::Removed {
            hashes: vec![hash],
            medium: Medium::Gpu,
            group: Some(group),
        };
        let depth = |e: &Engines| e.hybrid_depths(&fine, prompt.len()).first().map_or(0, |d| d.1.tokens / BLOCK_TOKENS);
        let mut e = Engines::default();
        e.batch(
            Scheme::TreeChain,
            0,
            &batch(0, vec![sparse(&h[4..]), in_group(stored(None, &h, &tokens, 16), full)]),
            1,
        );
        assert_eq!(depth(&e), 3, "full holds 12 blocks, the window its 8 last: 192 tokens");
        assert_eq!(held_prefix(&e, &tokens), 0, "none of it in the one-group holdings");
        let stats = &e.stats(|n| n.to_string())[0];
        assert_eq!((&stats.groups, stats.engine_blocks, stats.unplaced_blocks), (&vec![sliding, full], 12, 0));
        // The window's copy of the last block leaves: no run of 8 before the end, none from the
        // first block either. The full copies are all there, yet the engine reuses nothing.
        e.batch(Scheme::TreeChain, 0, &batch(1, vec![removed(h[11], 0)]), 2);
        assert_eq!(depth(&e), 0);
        let back = in_group(stored(Some(h[10]), &h[11..], &tokens[176..], 16), sliding);
        e.batch(Scheme::TreeChain, 0, &batch(2, vec![back]), 3);
        assert_eq!(depth(&e), 3);
        // The full copy of block 9 leaves: the hit is 9 blocks at most, and the window holds
        // only 4-8 of the 8 before it.
        e.batch(Scheme::TreeChain, 0, &batch(3, vec![removed(h[9], 1)]), 4);
        assert_eq!(depth(&e), 0);
        // Group 1 comes back as a sliding window: another layout, so the node is cleared.
        let relaid = CacheGroup { index: 1, kind: GroupKind::SlidingWindow { window: 512 } };
        e.batch(Scheme::TreeChain, 0, &batch(4, vec![in_group(stored(None, &h[..4], &tokens[..64], 16), relaid)]), 5);
        let stats = &e.stats(|n| n.to_string())[0];
        assert_eq!((stats.engine_blocks, stats.group_changes, stats.counts.clears), (4, 1, 1));
        // An engine that names no group is followed whole, as before.
        let mut plain = Engines::default();
        plain.batch(Scheme::TreeChain, 0, &batch(0, vec![stored(None, &h, &tokens, 16)]), 1);
        assert_eq!((held_prefix(&plain, &tokens), plain.hybrid_sizes().len()), (3, 0));
        assert!(plain.stats(|n| n.to_string())[0].groups.is_empty());
    }

    /// vLLM 0.33's offloading connector names a block's group but, by default, not its kind
    /// (`kv_cache_spec_kind` nil on its placeholder stores, scheduler.py `_placeholder_stored`):
    /// such a store says nothing of the group's kind. It neither clears the node nor turns a
    /// one-group engine hybrid; its tiers are followed as before.
    #[test]
    fn an_offloaded_store_that_names_no_kind_changes_no_group() {
        let tokens: Vec<u32> = (0..64 * 3).collect();
        let h: Vec<u64> = (300..312).collect();
        let full = CacheGroup { index: 0, kind: GroupKind::Full };
        let on_gpu = match stored(None, &h, &tokens, 16) {
            EngineEvent::Stored(s) => EngineEvent::Stored(EngineStored { group: Some(full), ..s }),
            other => other,
        };
        let placeholder = |hash: u64| {
            EngineEvent::Stored(EngineStored {
                parent: None,
                hashes: vec![hash],
                tokens: Vec::new(),
                block_size: 0,
                medium: Medium::Cpu,
                namespace: None,
                group: Some(CacheGroup { index: 0, kind: GroupKind::Other }),
            })
        };
        let mut e = Engines::default();
        e.batch(Scheme::TreeChain, 0, &batch(0, vec![on_gpu]), 1);
        e.batch(Scheme::TreeChain, 0, &batch(1, h.iter().map(|&x| placeholder(x)).collect()), 2);
        let stats = &e.stats(|n| n.to_string())[0];
        assert_eq!((stats.group_changes, stats.counts.clears, e.hybrid_sizes().len()), (0, 0, 0), "{stats:?}");
        assert_eq!(stats.groups, vec![full]);
        assert_eq!(held_prefix(&e, &tokens), 3);
        // The GPU copies leave; the CPU copies hold the prefix, in tier 1.
        let gone = EngineEvent::Removed { hashes: h.clone(), medium: Medium::Gpu, group: Some(0) };
        e.batch(Scheme::TreeChain, 0, &batch(2, vec![gone]), 3);
        assert_eq!(held_prefix(&e, &tokens), 3);
        let keys = ns().chain_in(Scheme::TreeChain, &tokens);
        assert!(keys.iter().all(|k| e.tier(k, 0) == Some(1)));
    }

    /// Block rows as written: (node, hash) to (store clock, row).
    type Rows = BTreeMap<(u32, u64), (u64, Arc<[u8]>)>;

    /// The rows and stream rows `effects` leave, written in order as the writer writes them.
    fn written(effects: Vec<Effect>, rows: &mut Rows, streams: &mut BTreeMap<u32, StreamRecord>) {
        for effect in effects {
            match effect {
                Effect::EngineBlock { node, clock, hash, row: Some(row) } => {
                    rows.insert((node, hash), (clock, row));
                }
                Effect::EngineBlock { node, hash, row: None, .. } => {
                    rows.remove(&(node, hash));
                }
                Effect::EngineStream { node, row, .. } => {
                    streams.insert(node, (*row).clone());
                }
                Effect::EngineClear { node, stream } => {
                    rows.retain(|&(n, _), _| n != node);
                    match stream {
                        Some(s) => streams.insert(node, (*s).clone()),
                        None => streams.remove(&node),
                    };
                }
                _ => {}
            }
        }
    }

    fn load(rows: &Rows, streams: &BTreeMap<u32, StreamRecord>) -> Engines {
        let rows = rows
            .iter()
            .map(|(&(node, hash), (clock, row))| decode_row(row, Layout::V7, *clock).map(|row| (node, hash, row)));
        let streams = streams.iter().map(|(&n, s)| Ok((n, s.clone())));
        Engines::load(Scheme::TreeChain, streams, rows, 1000).expect("the rows load")
    }

    /// A batch decided in parts of any size holds, counts and writes what it does decided
    /// whole: a long event cut inside it (its blocks chained across parts), removals in the
    /// same batch, a clear, a malformed event. Between parts the stream is written unfinished,
    /// and a file left there is loaded holding nothing of the node (its batch lost).
    #[test]
    fn a_batch_in_parts_is_the_batch_whole_and_a_file_left_between_parts_holds_nothing() {
        let tokens: Vec<u32> = (0..16 * 40).collect();
        let h: Vec<u64> = (1000..1040).collect();
        let other: Vec<u32> = (5000..5000 + 16 * 6).collect();
        let batches = [
            batch(0, vec![stored(None, &h[..30], &tokens[..16 * 30], 16), stored(None, &[1, 2], &other[..32], 16)]),
            batch(
                1,
                vec![
                    stored(Some(h[29]), &h[30..], &tokens[16 * 30..], 16),
                    EngineEvent::Removed { hashes: vec![h[35], 2, 77], medium: Medium::Gpu, group: None },
                    stored(Some(2), &[3, 4, 5, 6], &other[..10], 16),
                    stored(Some(2), &[3, 4, 5, 6], &other[32..], 16),
                ],
            ),
            batch(2, vec![EngineEvent::Cleared, stored(None, &h[..12], &tokens[..16 * 12], 16)]),
        ];
        for upto in 1..=batches.len() {
            let mut whole = Engines::default();
            let (mut rows, mut streams) = (BTreeMap::new(), BTreeMap::new());
            for (i, b) in batches.iter().take(upto).enumerate() {
                assert_eq!(whole.batch(Scheme::TreeChain, 0, b, i as u64 + 1), EngineOutcome::Applied);
            }
            written(whole.take_effects(), &mut rows, &mut streams);
            for budget in [1, 2, 3, 5, 7, 29, 31, 1000] {
                let mut parts = Engines::default();
                let (mut part_rows, mut part_streams) = (BTreeMap::new(), BTreeMap::new());
                let mut unfinished = 0;
                for (i, b) in batches.iter().take(upto).enumerate() {
                    let clock = i as u64 + 1;
                    let (outcome, mut rest) = parts.batch_part(Scheme::TreeChain, 0, b, clock, budget);
                    assert_eq!(outcome, EngineOutcome::Applied);
                    assert_eq!(rest.is_none(), ends_within(b, Cursor::default(), budget), "budget {budget}");
                    while let Some(from) = rest {
                        written(parts.take_effects(), &mut part_rows, &mut part_streams);
                        // A file as of this part: the node's stream is unfinished, it holds nothing.
                        assert_eq!(part_streams.get(&0).map(|s| s.last), Some(None), "budget {budget}");
                        let left = load(&part_rows, &part_streams);
                        assert_eq!(left.sizes(0), (0, 0), "budget {budget}: a file between parts");
                        // (Its batch is counted lost where the file had something of it.)
                        let had = u64::from(!part_rows.is_empty());
                        assert_eq!(left.counts(0).lost, part_streams[&0].counts.lost + had, "budget {budget}");
                        unfinished += 1;
                        let next = ends_within(b, from, budget);
                        rest = parts.rest(Scheme::TreeChain, 0, b, clock, from, budget);
                        assert_eq!(rest.is_none(), next, "budget {budget}");
                    }
                }
                written(parts.take_effects(), &mut part_rows, &mut part_streams);
                assert!(budget >= 1000 || unfinished > 0, "budget {budget}: the batches were cut");
                for prompt in [&tokens[..], &other[..]] {
                    assert_eq!(held_prefix(&parts, prompt), held_prefix(&whole, prompt), "budget {budget}");
                }
                assert_eq!((parts.sizes(0), parts.counts(0)), (whole.sizes(0), whole.counts(0)), "budget {budget}");
                assert_eq!(part_streams, streams, "budget {budget}");
                let rows_of = |r: &Rows| -> Vec<(u64, Vec<u8>)> {
                    r.iter().map(|(&(_, hash), (_, row))| (hash, row.to_vec())).collect()
                };
                assert_eq!(rows_of(&part_rows), rows_of(&rows), "budget {budget}");
                let reloaded = load(&part_rows, &part_streams);
                assert_eq!(reloaded.sizes(0), whole.sizes(0), "budget {budget}: a finished file loads whole");
            }
        }
    }

    #[test]
    fn duplicates_restarts_and_gaps_are_told_apart() {
        let tokens: Vec<u32> = (0..128).collect();
        let mut e = Engines::default();
        let first = batch(0, vec![stored(None, &[1, 2], &tokens, 64)]);
        assert_eq!(e.batch(Scheme::TreeChain, 0, &first, 1), EngineOutcome::Applied);
        // The same block stored twice is removed twice.
        e.batch(Scheme::TreeChain, 0, &batch(1, vec![stored(None, &[1], &tokens[..64], 64)]), 2);
        let remove = |seq| batch(seq, vec![EngineEvent::Removed { hashes: vec![1], medium: Medium::Gpu, group: None }]);
        e.batch(Scheme::TreeChain, 0, &remove(2), 3);
        assert_eq!(held_prefix(&e, &tokens), 2, "one copy is left");
        assert_eq!(e.batch(Scheme::TreeChain, 0, &remove(2), 4), EngineOutcome::Duplicate, "a late copy");
        assert_eq!(held_prefix(&e, &tokens), 2);
        assert_eq!(e.batch(Scheme::TreeChain, 0, &remove(5), 5), EngineOutcome::Gap { from: 2 });
        // A new process counts from 0 again, published later: the node is cleared first.
        let restarted = EngineBatch { seq: 0, ts: 100.0, events: vec![] };
        assert_eq!(e.batch(Scheme::TreeChain, 0, &restarted, 6), EngineOutcome::Applied);
        assert_eq!(held_prefix(&e, &tokens), 0);
        let counts = &e.streams.get(&0).expect("a stream").record.counts;
        assert_eq!((counts.restarts, counts.gaps, counts.duplicate_batches, counts.duplicate_blocks), (1, 1, 1, 1));
    }

    /// A block that hashes more than its tokens (an image after a cached text prefix) keys
    /// nothing, nor does anything below it, across a reload; a block its own parent is refused;
    /// removing one copy of a block stored twice leaves the node's claims standing.
    #[test]
    fn opaque_blocks_key_nothing_and_loops_are_refused() {
        let tokens: Vec<u32> = (0..64 * 4).collect();
        let mut e = Engines::default();
        e.batch(Scheme::TreeChain, 0, &batch(0, vec![stored(None, &[1, 2], &tokens[..128], 64)]), 1);
        let mut image = stored(Some(2), &[3], &tokens[128..192], 64);
        if let EngineEvent::Stored(s) = &mut image {
            s.namespace = None;
        }
        e.batch(Scheme::TreeChain, 0, &batch(1, vec![image, stored(Some(3), &[4], &tokens[192..], 64)]), 2);
        assert_eq!(held_prefix(&e, &tokens), 2, "the text before the image, not the image nor after");
        let mut rows = Vec::new();
        let mut stream = None;
        for effect in e.take_effects() {
            match effect {
                Effect::EngineBlock { node, clock, hash, row: Some(row) } => {
                    rows.push((node, hash, decode_row(&row, Layout::V7, clock).expect("a row")));
                }
                Effect::EngineStream { row, .. } => stream = Some(row),
                _ => {}
            }
        }
        let stream = (*stream.expect("a stream row")).clone();
        let loaded = Engines::load(Scheme::TreeChain, std::iter::once(Ok((0, stream))), rows.into_iter().map(Ok), 2)
            .expect("the rows load");
        assert_eq!(held_prefix(&loaded, &tokens), 2, "the same after a reload");
        e.batch(Scheme::TreeChain, 0, &batch(2, vec![stored(Some(9), &[9], &tokens[..64], 64)]), 3);
        e.batch(Scheme::TreeChain, 0, &batch(3, vec![stored(None, &[7, 7], &tokens[..128], 64)]), 4);
        assert_eq!(e.streams.get(&0).map(|s| s.record.counts.malformed), Some(2), "a block its own parent");
        assert_eq!(e.sizes(0).0, 4, "nothing of them kept");
        // Stored twice, removed once: the engine still holds it, and claims stand.
        e.batch(Scheme::TreeChain, 0, &batch(4, vec![stored(None, &[1], &tokens[..64], 64)]), 5);
        let floor = e.claim_floor(0);
        e.batch(
            Scheme::TreeChain,
            0,
            &batch(5, vec![EngineEvent::Removed { hashes: vec![1], medium: Medium::Gpu, group: None }]),
            6,
        );
        assert_eq!((e.claim_floor(0), held_prefix(&e, &tokens)), (floor, 2));
        e.batch(
            Scheme::TreeChain,
            0,
            &batch(6, vec![EngineEvent::Removed { hashes: vec![1], medium: Medium::Gpu, group: None }]),
            7,
        );
        assert_eq!((e.claim_floor(0), held_prefix(&e, &tokens)), (7, 0), "the last copy: claims end");
    }

    /// Two engine blocks of one node key the same block of ours (two hashes of the same
    /// tokens): the node loads it from the faster of them, and when that one goes, from the
    /// other.
    #[test]
    fn a_block_of_ours_keyed_twice_is_loaded_from_the_fastest_that_is_left() {
        let tokens: Vec<u32> = (0..64).collect();
        let key = ns().chain_in(Scheme::TreeChain, &tokens)[0];
        let mut e = Engines::default();
        let gpu = |h: u64| stored(None, &[h], &tokens, 64);
        let mut cpu = gpu(2);
        if let EngineEvent::Stored(s) = &mut cpu {
            s.medium = Medium::Cpu;
        }
        e.batch(Scheme::TreeChain, 0, &batch(0, vec![gpu(1), cpu]), 1);
        assert_eq!((e.tier(&key, 0), e.held_on_gpu(&key, 0).is_some()), (Some(0), true));
        let remove = |h: u64| EngineEvent::Removed { hashes: vec![h], medium: Medium::Gpu, group: None };
        e.batch(Scheme::TreeChain, 0, &batch(1, vec![remove(1)]), 2);
        assert_eq!((e.tier(&key, 0), e.held_on_gpu(&key, 0)), (Some(1), None), "the CPU copy is left");
        let remove_cpu = EngineEvent::Removed { hashes: vec![2], medium: Medium::Cpu, group: None };
        e.batch(Scheme::TreeChain, 0, &batch(2, vec![remove_cpu]), 3);
        assert_eq!(e.tier(&key, 0), None, "nothing is left");
    }

    /// Copies are told by identity (number and publish time of a batch applied), never by the
    /// clock: a number going back is a restart whatever its publish time, a number ahead a gap.
    #[test]
    fn copies_are_batches_applied_and_a_number_going_back_is_a_restart_whatever_the_clock() {
        let b = |seq, ts| EngineBatch { seq, ts, events: Vec::new() };
        let mut applied = Applied::default();
        for seq in 0..=5 {
            applied.push(&b(seq, 5.0 + seq as f64));
        }
        let last = Some((5, 10.0));
        assert_eq!(Follows::after(last, &applied, &b(6, 11.0)), Follows::Next);
        assert_eq!(Follows::after(last, &applied, &b(9, 11.0)), Follows::Gap { from: 5 });
        assert_eq!(Follows::after(last, &applied, &b(5, 10.0)), Follows::Copy, "the last one again");
        assert_eq!(Follows::after(last, &applied, &b(3, 8.0)), Follows::Copy, "a replay's overlap");
        assert_eq!(Follows::after(last, &Applied::default(), &b(5, 10.0)), Follows::Copy, "after an open");
        assert_eq!(Follows::after(last, &applied, &b(0, 12.0)), Follows::Restart);
        // A new process whose clock is behind the old one's: a restart, not copies.
        assert_eq!(Follows::after(last, &applied, &b(0, -50.0)), Follows::Restart);
        assert_eq!(Follows::after(last, &applied, &b(3, 9.0)), Follows::Restart, "same number, not that batch");
        assert_eq!(Follows::after(last, &applied, &b(9, 9.0)), Follows::Gap { from: 5 }, "ahead, clock behind");
        assert_eq!(Follows::after(None, &applied, &b(0, 1.0)), Follows::Next);
        assert_eq!(Follows::after(None, &applied, &b(4, 1.0)), Follows::Gap { from: 0 });
        // A late copy of the old process's batch after the restart is still a copy.
        applied.push(&b(0, -50.0));
        assert_eq!(Follows::after(Some((0, -50.0)), &applied, &b(4, 9.0)), Follows::Copy);
    }

    /// An engine restarts with its clock 60 s behind the old process's: the node is cleared
    /// and the new process's batches applied, none taken for a copy; the window stays bounded.
    #[test]
    fn a_restart_with_the_clock_behind_clears_the_node() {
        let tokens: Vec<u32> = (0..128).collect();
        let mut e = Engines::default();
        let at = |seq, ts, events| EngineBatch { seq, ts, events };
        e.batch(Scheme::TreeChain, 0, &at(0, 1000.0, vec![stored(None, &[1, 2], &tokens, 64)]), 1);
        for seq in 1..10 {
            e.batch(Scheme::TreeChain, 0, &at(seq, 1000.0 + seq as f64, vec![]), 1 + seq);
        }
        assert_eq!(held_prefix(&e, &tokens), 2);
        for seq in 0..10 {
            let out = e.batch(Scheme::TreeChain, 0, &at(seq, 950.0 + seq as f64, vec![]), 20 + seq);
            assert_eq!(out, EngineOutcome::Applied, "seq {seq}");
        }
        assert_eq!(held_prefix(&e, &tokens), 0, "the old process's blocks are gone");
        let counts = &e.streams.get(&0).expect("a stream").record.counts;
        assert_eq!((counts.restarts, counts.duplicate_batches), (1, 0));
        for seq in 10..(REMEMBERED as u64 + 20) {
            e.batch(Scheme::TreeChain, 0, &at(seq, 960.0 + seq as f64, vec![]), 30 + seq);
        }
        assert_eq!(e.streams.get(&0).map(|s| s.applied.recent.len()), Some(REMEMBERED));
    }

    #[test]
    fn rows_decode_to_what_was_stored_and_reload_to_the_same_holdings() {
        let tokens: Vec<u32> = (0..64 * 4).map(|t| t * 3 + (1 << 25) * (t % 2)).collect();
        let mut e = Engines::default();
        e.batch(Scheme::TreeChain, 7, &batch(0, vec![stored(None, &[1, 2, 3], &tokens[..96], 32)]), 1);
        e.batch(Scheme::TreeChain, 7, &batch(1, vec![stored(Some(3), &[4, 5, 6, 7, 8], &tokens[96..], 32)]), 2);
        let mut rows: BTreeMap<BlockRowKey, Option<Arc<[u8]>>> = BTreeMap::new();
        let mut stream = None;
        for effect in e.take_effects() {
            match effect {
                Effect::EngineBlock { node, clock, hash, row } => {
                    rows.insert((node, clock, hash), row);
                }
                Effect::EngineStream { row, .. } => stream = Some(row),
                _ => {}
            }
        }
        let stream = stream.expect("a stream row");
        let blocks = rows.into_iter().filter_map(|((node, clock, hash), v)| {
            v.map(|v| decode_row(&v, Layout::V7, clock).map(|r| (node, hash, r)))
        });
        let loaded = Engines::load(Scheme::TreeChain, std::iter::once(Ok((7, (*stream).clone()))), blocks, 2)
            .expect("the rows load");
        assert_eq!(loaded.held, e.held);
        assert_eq!(loaded.sizes(7), (8, 4));
        assert!(decode_row(&[1, 2, 3], Layout::V7, 0).is_err(), "a short row is an error, not a panic");
        // A row with offloaded copies comes back whole; schema 6 had none, and its layout
        // refuses one; copies offloaded past the copies held are corrupt.
        let row = Row {
            opaque: false,
            parent: None,
            refs: 3,
            offload: [1, 1],
            clock: 9,
            tokens: tokens[..32].to_vec(),
            root: Some(Some(Namespace::new("m").expect("namespace"))),
        };
        let bytes = encode(&row);
        assert_eq!(decode_row(&bytes, Layout::V7, 9).expect("a row"), row);
        assert!(decode_row(&bytes, Layout::V6, 9).is_err());
        let mut over = bytes.to_vec();
        over[1] = 1;
        assert!(decode_row(&over, Layout::V7, 9).is_err(), "2 offloaded of 1 copy");
    }
}
