//! The decided state: the one copy of what the index has decided, on the callers' side. The
//! clock, the node registry (names, ids, forgotten incarnations), 0.1.7's eviction (live counts
//! per clock and the low-water mark, `horizon.rs`), the node caches (`caches.rs`) and what each
//! engine holds (`engines/`). It knows no storage: the store loads it whole at open
//! (`store/load.rs`) and persists what it decides.
//!
//! Every change (a `ran`, a forget, a cache size, an import's nodes, an eviction to a new
//! capacity, an engine batch) is decided here once, under the front lock, in memory only, and
//! yields its effects (`effect.rs`): what it changed, stated as results. The writer persists
//! them; a rolled-back batch's effects are applied again as they are.

pub(crate) mod caches;
pub(crate) mod effect;
pub(crate) mod engines;
pub(crate) mod horizon;
pub(crate) mod namespaces;
pub(crate) mod node_set;
pub(crate) mod registry;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use caches::NodeCaches;
use effect::Effect;
use engines::{Cursor, EngineBatch, EngineCounts, EngineGauges, EngineOutcome, Engines, PART_BLOCKS};
use horizon::Horizon;
use namespaces::Namespaces;
use registry::Registry;

use crate::error::{Error, Result};
use crate::keys::{BlockKey, Namespace, Scheme};

/// What the callers have decided.
pub(crate) struct Decided {
    /// The clock of the last change (the next `ran` gets one more).
    pub clock: u64,
    pub nodes: Registry,
    /// The namespace ids handed out.
    pub namespaces: Namespaces,
    /// What is live by 0.1.7's eviction rule.
    pub horizon: Horizon,
    /// Each node's cache.
    pub caches: NodeCaches,
    /// What each engine with an event stream holds.
    pub engines: Engines,
    /// The hash scheme of the file's keys (engine events are keyed in it).
    pub scheme: Scheme,
}

impl Decided {
    /// Whether an entry of `clock` is live (not evicted by 0.1.7's rule).
    pub(crate) fn holds(&self, clock: u64) -> bool {
        self.horizon.holds(clock)
    }

    /// Whether node `node`'s pair of `clock` is answered: not forgotten, still in its cache, and
    /// for a node whose engine reports what it holds, a claim still standing (newer than its
    /// grace window and than its engine's last removal).
    pub(crate) fn answered(&self, node: u32, clock: u64) -> bool {
        !self.nodes.is_retired(node) && clock > self.caches.floor(node) && clock > self.engines.claim_floor(node)
    }

    /// Decides one batch of node `name`'s engine events (see [`Engines::batch_part`]): the
    /// whole of a small batch; of a batch of more than [`PART_BLOCKS`] blocks, a part, or the
    /// next part after `from`. Returns the outcome, where the rest starts (`None`: the batch is
    /// done) and the effects.
    ///
    /// # Errors
    /// As [`Decided::ran`]. Nothing is decided then.
    pub(crate) fn engine_batch(
        &mut self,
        name: &str,
        batch: &EngineBatch,
        from: Option<Cursor>,
    ) -> Result<(EngineOutcome, Option<Cursor>, Vec<Effect>)> {
        let clock = next_clock(self.clock)?;
        let mut effects = Vec::new();
        let (id, _) = self.nodes.id(name, &mut effects)?;
        self.clock = clock;
        let (outcome, rest) = match from {
            None => self.engines.batch_part(self.scheme, id, batch, clock, PART_BLOCKS),
            Some(from) => (EngineOutcome::Applied, self.engines.rest(self.scheme, id, batch, clock, from, PART_BLOCKS)),
        };
        effects.append(&mut self.engines.take_effects());
        Ok((outcome, rest, effects))
    }

    /// Node `name`'s engine stream's counts and the engine blocks it holds (0 without a stream).
    pub(crate) fn engine_counts(&self, name: &str) -> (EngineCounts, EngineGauges) {
        match self.nodes.current(name) {
            Some(id) => (self.engines.counts(id), self.engines.gauges(id)),
            None => (EngineCounts::default(), EngineGauges::default()),
        }
    }

    /// Decides that node `name`'s engine cannot replay what came before `batch`: what the node
    /// held is dropped and `batch` starts its stream again (in parts, as
    /// [`Decided::engine_batch`]: the rest goes on there).
    ///
    /// # Errors
    /// As [`Decided::ran`]. Nothing is decided then.
    pub(crate) fn engine_resync(&mut self, name: &str, batch: &EngineBatch) -> Result<(Option<Cursor>, Vec<Effect>)> {
        let clock = next_clock(self.clock)?;
        let mut effects = Vec::new();
        let (id, _) = self.nodes.id(name, &mut effects)?;
        self.clock = clock;
        let rest = self.engines.resync_part(self.scheme, id, batch, clock, PART_BLOCKS);
        effects.append(&mut self.engines.take_effects());
        Ok((rest, effects))
    }

    /// Decides a `ran` of `blocks` by `node`: `runs` are the blocks of the prompt already live,
    /// in runs of equal clocks (`(clock, blocks)` from the first block on), `held` those its
    /// node's cache held. Returns its effects.
    ///
    /// # Errors
    /// [`Error::Corrupted`] when the clock cannot advance (past [`MAX_CLOCK`]);
    /// [`Error::InvalidConfig`] past 2^32 node incarnations or namespaces. Nothing is decided
    /// then.
    pub(crate) fn ran(
        &mut self,
        namespace: &Namespace,
        blocks: &Arc<[BlockKey]>,
        node: &str,
        runs: &[(u64, u64)],
        held: &[(u64, u64)],
    ) -> Result<Vec<Effect>> {
        let clock = next_clock(self.clock)?;
        // Both ids are handed out, or neither (a new namespace fails only past 2^32 of them).
        self.namespaces.has_room(namespace)?;
        let mut effects = Vec::with_capacity(4);
        let (id, name) = self.nodes.id(node, &mut effects)?;
        let namespace = self.namespaces.id(namespace, &mut effects)?;
        let before = self.horizon.floor;
        let mut counts = Vec::with_capacity(runs.len() + 1);
        let floor = self.horizon.ran(clock, blocks.len() as u64, runs, &mut counts);
        self.clock = clock;
        effects.push(Effect::Put { namespace, blocks: Arc::clone(blocks), node: id, clock });
        if floor > before {
            effects.push(self.evict_effect());
        }
        effects.push(self.live_effect(counts));
        self.caches.ran((id, &name), clock, blocks.len() as u64, held, floor);
        effects.append(&mut self.caches.take_effects());
        Ok(effects)
    }

    /// Decides a forget of node `name`'s current incarnation: from now on nothing it ran before
    /// is answered. `None` if it has none (nothing to forget).
    pub(crate) fn forget(&mut self, name: &str) -> Option<Vec<Effect>> {
        let (id, name) = self.nodes.forget(name)?;
        self.caches.forget(id);
        self.engines.forget(id);
        let mut effects = vec![Effect::Retire { node: id, name, clock: self.clock }];
        effects.append(&mut self.caches.take_effects());
        effects.append(&mut self.engines.take_effects());
        Some(effects)
    }

    /// The ids of the node caches a change of size starts keeping: node `name` (`Some`) or
    /// every current node (`None`, a new default), with `blocks` the size to set.
    pub(crate) fn caches_to_seed(&self, name: Option<&str>, blocks: Option<u64>) -> Vec<u32> {
        match (name, blocks) {
            (Some(name), _) if self.caches.tracks(name) => Vec::new(),
            (Some(name), _) => self.nodes.current(name).into_iter().collect(),
            (None, Some(_)) => {
                self.nodes.current_ids().into_iter().filter(|(_, n)| !self.caches.tracks(n)).map(|(id, _)| id).collect()
            }
            (None, None) => Vec::new(),
        }
    }

    /// Decides node `name`'s own cache size (`None`: the default again), adding the node if it
    /// is new; `seeds`: what the file names of it by clock, if its cache was not kept.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 node incarnations.
    pub(crate) fn set_capacity(
        &mut self,
        name: &str,
        blocks: Option<u64>,
        seeds: BTreeMap<u32, BTreeMap<u64, u64>>,
    ) -> Result<Vec<Effect>> {
        let mut effects = Vec::new();
        let (id, name) = self.nodes.id(name, &mut effects)?;
        self.caches.set_capacity((id, &name), blocks, seeds);
        effects.append(&mut self.caches.take_effects());
        Ok(effects)
    }

    /// Decides the default cache size; `seeds`: what the file names of each current node whose
    /// cache was not kept.
    pub(crate) fn set_cache_default(
        &mut self,
        blocks: Option<u64>,
        seeds: BTreeMap<u32, BTreeMap<u64, u64>>,
    ) -> Vec<Effect> {
        let current = self.nodes.current_ids();
        self.caches.set_default(blocks, current.iter().map(|(id, n)| (*id, n.as_ref())), seeds);
        self.caches.take_effects()
    }

    /// Decides 0.1.7's eviction of a file over its capacity (opened with a smaller one, or
    /// after an import): while over, the oldest eighth goes.
    pub(crate) fn evict_to_capacity(&mut self) -> Vec<Effect> {
        let before = self.horizon.floor;
        let floor = self.horizon.evict_to_capacity();
        if floor <= before {
            return Vec::new();
        }
        self.caches.drop_through(floor);
        let mut effects = vec![self.evict_effect()];
        effects.append(&mut self.caches.take_effects());
        effects
    }

    /// Decides that an import starts: the floor goes back to 0 (0.1.7's own clocks may be
    /// older than it).
    pub(crate) fn start_import(&mut self) -> Vec<Effect> {
        self.horizon.lower_floor();
        vec![Effect::LowerFloor]
    }

    /// Decides what an import's entries leave live: `written` gives each entry the import wrote
    /// (`(clock it replaced, None for a new key; its clock)`), after [`Decided::start_import`];
    /// 0.1.7's own clocks may be past the clock (raised to the newest).
    pub(crate) fn import_entries(&mut self, written: &[(Option<u64>, u64)]) -> Vec<Effect> {
        let counts = self.horizon.import(written.iter().copied());
        let mut effects = vec![self.live_effect(counts)];
        if let Some(newest) = written.iter().map(|w| w.1).max().filter(|&c| c > self.clock) {
            self.clock = newest;
            effects.push(Effect::Clock { clock: newest });
        }
        effects
    }

    /// The live counts of `counts`' clocks, and the entries in all, as an effect.
    fn live_effect(&self, counts: Vec<(u64, u64)>) -> Effect {
        let (entries, legacy_entries) = (self.horizon.entries, self.horizon.legacy_entries);
        Effect::Live { counts: counts.into(), entries, legacy_entries }
    }

    /// The eviction to the horizon's floor, as an effect. Its clock is the decided one, never
    /// below the floor (every clock up to it was handed out), so a file whose every generation
    /// is evicted still keeps its clock.
    fn evict_effect(&self) -> Effect {
        let h = &self.horizon;
        Effect::Evict { floor: h.floor, entries: h.entries, legacy_entries: h.legacy_entries, clock: self.clock }
    }

    /// The ids of an import's node names (`names`), handed out where new, with their effects.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 node incarnations.
    pub(crate) fn import_nodes<'a>(
        &mut self,
        names: impl Iterator<Item = &'a str>,
    ) -> Result<(HashMap<String, u32>, Vec<Effect>)> {
        let mut effects = Vec::new();
        let mut ids = HashMap::new();
        for name in names {
            if !ids.contains_key(name) {
                let (id, _) = self.nodes.id(name, &mut effects)?;
                ids.insert(name.to_string(), id);
            }
        }
        Ok((ids, effects))
    }
}

/// The import's rule for a key already in the file: its entry stays if its clock is at least
/// as new as the imported entry's (`existing`, `imported`), whichever wrote it.
pub(crate) fn import_keeps(existing: u64, imported: u64) -> bool {
    existing >= imported
}

/// The newest clock a file or an import may hold: a head adds one a `ran`, so a clock past it
/// could wrap (2^62 leaves room for a million `ran`s a second for 146,000 years).
pub const MAX_CLOCK: u64 = 1 << 62;

/// The clock of the next `ran` after `clock`: never past [`MAX_CLOCK`] (a file that holds a
/// clock past it, which no build writes, is refused rather than wrapped).
fn next_clock(clock: u64) -> Result<u64> {
    clock.checked_add(1).filter(|&c| c <= MAX_CLOCK).ok_or_else(|| Error::Corrupted {
        detail: format!("its clock is at {clock}, past the {MAX_CLOCK} a file may hold, and cannot advance"),
    })
}
