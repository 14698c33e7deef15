//! The decided state: the one copy of what the index has decided, on the callers' side, loaded
//! whole by `open`. The clock, the node registry (names, ids, forgotten incarnations), 0.1.7's
//! eviction (live counts per clock and the low-water mark, `horizon.rs`) and the node caches.
//!
//! Every change (a `ran`, a forget, a cache size, an import's nodes, an eviction to a new
//! capacity) is decided here once, under the front lock, in memory only, and yields its
//! effects (`store/effect.rs`): what it changed, stated as results. The writer persists them
//! and decides nothing; a rolled-back batch's effects are applied again as they are.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use redb::{Database, ReadableDatabase, ReadableTable};

use super::horizon::Horizon;
use crate::error::{Error, Result, redb_err};
use crate::keys::Scheme;
use crate::keys::{BlockKey, Namespace};
use crate::store::caches::NodeCaches;
use crate::store::effect::Effect;
use crate::store::engines::{Cursor, EngineBatch, EngineCounts, EngineOutcome, Engines, PART_BLOCKS, read_engines};
use crate::store::records::{MAX_CLOCK, NodeRecords, read_meta, read_registry};
use crate::store::tables::{GENERATIONS, LIVE, META, NODE_CAPACITY, NODE_CLOCKS, NODE_FLOORS, STATE};
use crate::store::writer::read_floor;

/// Every node incarnation by id (nodes are few, so all of them are kept in memory).
#[derive(Default)]
pub(crate) struct Registry {
    /// Names by id.
    names: Vec<Arc<str>>,
    /// The current (not forgotten) id of each name.
    ids: HashMap<Arc<str>, u32>,
    /// By id: whether that incarnation was forgotten.
    retired: Vec<bool>,
}

impl Registry {
    /// Whether node id `node` was forgotten.
    pub(crate) fn is_retired(&self, node: u32) -> bool {
        self.retired.get(node as usize).copied().unwrap_or(false)
    }

    /// The name of node id `node`.
    pub(crate) fn name(&self, node: u32) -> String {
        self.name_of(node).map_or_else(|| format!("#{node}"), str::to_string)
    }

    /// The name of node id `node`, if it has one.
    pub(crate) fn name_of(&self, node: u32) -> Option<&str> {
        self.names.get(node as usize).map(|n| n.as_ref())
    }

    /// The current id of node `name`, if it has one.
    pub(crate) fn current(&self, name: &str) -> Option<u32> {
        self.ids.get(name).copied()
    }

    /// Every incarnation by id: its name and whether it was forgotten.
    pub(crate) fn all(&self) -> impl Iterator<Item = (&str, bool)> + '_ {
        self.names.iter().map(|n| n.as_ref()).zip(self.retired.iter().copied())
    }

    /// The current incarnations: (id, name).
    fn current_ids(&self) -> Vec<(u32, Arc<str>)> {
        (0u32..).zip(&self.names).filter(|&(id, _)| !self.is_retired(id)).map(|(id, n)| (id, Arc::clone(n))).collect()
    }

    /// The current id of node `name`, handed out if it has none (then with its effect), and
    /// a shared copy of the name.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] past 2^32 node incarnations.
    fn id(&mut self, name: &str, effects: &mut Vec<Effect>) -> Result<(u32, Arc<str>)> {
        if let Some(&id) = self.ids.get(name)
            && let Some(known) = self.names.get(id as usize)
        {
            return Ok((id, Arc::clone(known)));
        }
        let id = u32::try_from(self.names.len())
            .map_err(|_| Error::InvalidConfig { detail: "more than 2^32 node incarnations".into() })?;
        let shared: Arc<str> = Arc::from(name);
        self.names.push(Arc::clone(&shared));
        self.retired.push(false);
        self.ids.insert(Arc::clone(&shared), id);
        effects.push(Effect::Node { id, name: Arc::clone(&shared) });
        Ok((id, shared))
    }
}

/// What the callers have decided.
pub(crate) struct Decided {
    /// The clock of the last change (the next `ran` gets one more).
    pub clock: u64,
    pub nodes: Registry,
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
    /// The decided state of a committed file, read in one read transaction.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for records that contradict each other (live counts that do not
    /// add up, rows of unknown node ids); [`Error::Codec`]; [`Error::Storage`].
    pub(crate) fn load(db: &Database, scheme: Scheme) -> Result<Decided> {
        Decided::read(&db.begin_read().map_err(redb_err("starting a read"))?, scheme)
    }

    /// [`Decided::load`] from a read transaction (a head's, or a reader's of a live file).
    ///
    /// # Errors
    /// As [`Decided::load`].
    pub(crate) fn read(read: &redb::ReadTransaction, scheme: Scheme) -> Result<Decided> {
        let meta = read_meta(&read.open_table(META).map_err(redb_err("reading the meta record"))?)?
            .ok_or_else(|| Error::unknown_format("no meta record"))?;
        let state = read.open_table(STATE).map_err(redb_err("reading the floor"))?;
        let floor = read_floor(&state)?;
        // The clock never goes back, whatever the meta record says.
        let generations = read.open_table(GENERATIONS).map_err(redb_err("reading the generations"))?;
        let newest = generations.last().map_err(redb_err("reading the generations"))?.map_or(0, |(c, _)| c.value());
        let NodeRecords { names, retired, stray } = read_registry(read)?;
        if let Some(id) = stray.first() {
            return Err(Error::Corrupted { detail: format!("node id {id} has a row and no node record") });
        }
        let next_node = u32::try_from(names.len()).unwrap_or(u32::MAX);
        // The registry hands out the next id after the node table's; the meta record must agree.
        if next_node != meta.next_node {
            return Err(Error::Corrupted {
                detail: format!("the node table holds {next_node} nodes, the meta record counts {}", meta.next_node),
            });
        }
        let names: Vec<Arc<str>> = names.into_iter().map(Arc::from).collect();
        // The newest live incarnation of each name is its current id.
        let ids = (0u32..).zip(&names).zip(&retired).filter(|&(_, gone)| !gone).map(|((id, n), _)| (Arc::clone(n), id));
        let nodes = Registry { ids: ids.collect(), names, retired };
        let live = read.open_table(LIVE).map_err(redb_err("opening the live counts"))?;
        let horizon = Horizon::load(&live, floor, meta.entries, meta.capacity)?;
        let caches = NodeCaches::load(
            &read.open_table(NODE_CLOCKS).map_err(redb_err("reading the node caches"))?,
            &read.open_table(NODE_FLOORS).map_err(redb_err("reading the node caches"))?,
            &read.open_table(NODE_CAPACITY).map_err(redb_err("reading the node caches"))?,
            &state,
            (floor, meta.next_node),
        )?;
        let clock = meta.clock.max(newest);
        let engines = read_engines(read, scheme, clock)?;
        Ok(Decided { clock, nodes, horizon, caches, engines, scheme })
    }

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
    pub(crate) fn engine_counts(&self, name: &str) -> (EngineCounts, usize) {
        match self.nodes.current(name) {
            Some(id) => (self.engines.counts(id), self.engines.sizes(id).0),
            None => (EngineCounts::default(), 0),
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
    /// [`Error::InvalidConfig`] past 2^32 node incarnations. Nothing is decided then.
    pub(crate) fn ran(
        &mut self,
        namespace: &Namespace,
        blocks: &Arc<[BlockKey]>,
        node: &str,
        runs: &[(u64, u64)],
        held: &[(u64, u64)],
    ) -> Result<Vec<Effect>> {
        let clock = next_clock(self.clock)?;
        let mut effects = Vec::with_capacity(4);
        let (id, name) = self.nodes.id(node, &mut effects)?;
        let before = self.horizon.floor;
        let floor = self.horizon.ran(clock, blocks.len() as u64, runs);
        self.clock = clock;
        effects.push(Effect::Put { namespace: namespace.clone(), blocks: Arc::clone(blocks), node: id, clock });
        if floor > before {
            effects.push(Effect::Evict { floor });
        }
        self.caches.ran((id, &name), clock, blocks.len() as u64, held, floor);
        effects.append(&mut self.caches.take_effects());
        Ok(effects)
    }

    /// Decides a forget of node `name`'s current incarnation: from now on nothing it ran before
    /// is answered. `None` if it has none (nothing to forget).
    pub(crate) fn forget(&mut self, name: &str) -> Option<Vec<Effect>> {
        let id = self.nodes.ids.remove(name)?;
        let name = self.nodes.names.get(id as usize).map(Arc::clone)?;
        if let Some(r) = self.nodes.retired.get_mut(id as usize) {
            *r = true;
        }
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
        let mut effects = vec![Effect::Evict { floor }];
        effects.append(&mut self.caches.take_effects());
        effects
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

/// The clock of the next `ran` after `clock`: never past [`MAX_CLOCK`] (a file that holds a
/// clock past it, which no build writes, is refused rather than wrapped).
fn next_clock(clock: u64) -> Result<u64> {
    clock.checked_add(1).filter(|&c| c <= MAX_CLOCK).ok_or_else(|| Error::Corrupted {
        detail: format!("its clock is at {clock}, past the {MAX_CLOCK} a file may hold, and cannot advance"),
    })
}
