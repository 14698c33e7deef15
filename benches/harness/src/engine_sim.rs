//! A simulated inference engine that publishes vLLM's KV cache events: an LRU of engine blocks
//! (prefix caching as vLLM's block pool does it) whose stores and evictions are vLLM 0.33.0's
//! event batches, in the library's form and on the wire (msgpack map events over a ZMQ PUB,
//! with a ROUTER answering replays from its last 10,000 batches). For the replay and the tests.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::hybrid_sim::{self, HybridCache};
use crate::trace::splitmix64;
use superfluid_warm::{EngineBatch, EngineEvent, EngineStored, Error, GroupKind, Medium, Namespace, Result};

/// Batches an engine keeps for replays (vLLM's `buffer_steps`).
pub const REPLAY_BUFFER: usize = 10_000;
/// Bytes of batches an engine keeps for replays, besides their count. vLLM's buffer holds
/// `buffer_steps` engine steps of a few blocks each; a simulated batch is a whole request's new
/// blocks (up to ~100 KiB), so a count alone kept gigabytes over the conversation trace.
pub const REPLAY_BUFFER_BYTES: usize = 8 << 20;

/// What an engine keeps for replays: its newest items, at most [`REPLAY_BUFFER`] of them (or
/// fewer, [`Kept::at_most`]) and [`REPLAY_BUFFER_BYTES`] (the newest is always kept).
#[derive(Debug)]
pub struct Kept<T> {
    items: VecDeque<(T, usize)>,
    bytes: usize,
    most: usize,
}

impl<T> Default for Kept<T> {
    fn default() -> Self {
        Kept::at_most(REPLAY_BUFFER)
    }
}

impl<T> Kept<T> {
    /// Keeping at most `items` items (at least one).
    pub fn at_most(items: usize) -> Kept<T> {
        Kept { items: VecDeque::new(), bytes: 0, most: items.max(1) }
    }

    /// Keeps `item` of `bytes` bytes; the oldest go past either bound.
    pub fn push(&mut self, item: T, bytes: usize) {
        self.items.push_back((item, bytes));
        self.bytes += bytes;
        while self.items.len() > 1 && (self.items.len() > self.most || self.bytes > REPLAY_BUFFER_BYTES) {
            if let Some((_, b)) = self.items.pop_front() {
                self.bytes -= b;
            }
        }
    }

    /// The newest.
    pub fn back(&self) -> Option<&T> {
        self.items.back().map(|(item, _)| item)
    }

    /// Oldest first.
    pub fn iter(&self) -> impl Iterator<Item = &T> {
        self.items.iter().map(|(item, _)| item)
    }

    /// Bytes of the items kept (as pushed).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Items kept.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Forgets every item (a restarted engine's buffer starts empty).
    pub fn clear(&mut self) {
        self.items.clear();
        self.bytes = 0;
    }
}

/// About what a batch takes in memory: its token ids and hashes.
fn batch_bytes(batch: &EngineBatch) -> usize {
    let event = |e: &EngineEvent| match e {
        EngineEvent::Stored(s) => 64 + 4 * s.tokens.len() + 8 * s.hashes.len(),
        EngineEvent::Removed { hashes, .. } => 32 + 8 * hashes.len(),
        _ => 16,
    };
    32 + batch.events.iter().map(event).sum::<usize>()
}

/// What a heap allocation of `bytes` takes from the allocator (glibc's chunks: 8 bytes of header,
/// 16-byte steps, 32 at least).
fn allocation(bytes: usize) -> usize {
    match bytes {
        0 => 0,
        n => (n + 8).next_multiple_of(16).max(32),
    }
}

/// What a batch kept in memory takes, closer than [`batch_bytes`] (which bounds the buffer):
/// its events and each of their vectors as allocated (a clone's, of exact capacity).
fn batch_heap_bytes(batch: &EngineBatch) -> usize {
    let event = |e: &EngineEvent| match e {
        EngineEvent::Stored(s) => allocation(4 * s.tokens.len()) + allocation(8 * s.hashes.len()),
        EngineEvent::Removed { hashes, .. } => allocation(8 * hashes.len()),
        _ => 0,
    };
    allocation(batch.events.len() * size_of::<EngineEvent>()) + batch.events.iter().map(event).sum::<usize>()
}

/// A block's engine hash: its parent's and its tokens' (vLLM chains a hash of each block with
/// its parent's; this is another hash, with the same structure).
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = parent.unwrap_or(0x5eed) ^ 0x9E37_79B9_7F4A_7C15;
    for &t in tokens {
        h = splitmix64(h ^ u64::from(t));
    }
    h
}

/// One held block.
#[derive(Clone, Copy, Debug)]
struct Held {
    /// Copies stored and not yet evicted (vLLM stores some blocks twice).
    refs: u32,
    /// Its place in the LRU.
    tick: u64,
}

/// A simulated engine: its cache and its event stream.
#[derive(Debug)]
pub struct SimEngine {
    /// Tokens per engine block.
    pub block: usize,
    capacity: usize,
    held: HashMap<u64, Held>,
    /// LRU order: tick → hash (one entry per held block, copies share it).
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
    /// Random event boundaries and duplicate stores (the tests' chaos), from this seed.
    chaos: Option<u64>,
    /// The model its blocks are stored under.
    namespace: Namespace,
    /// The next batch's sequence number.
    seq: u64,
    /// Restarts so far (each new process publishes later than the last).
    restarts: u64,
    /// Seconds its clock is off the host's (negative: behind), from a restart with its clock
    /// stepped ([`SimEngine::restart_with_clock`]).
    clock_offset: f64,
    /// The batches this process published that a replay can still give.
    pub published: Kept<EngineBatch>,
    /// Every block this process stored (evicted since or not), unless not kept
    /// ([`SimEngine::without_stored`]): it grows with every new block of the workload.
    stored: std::collections::HashSet<u64>,
    keep_stored: bool,
    /// The offload tier (CPU memory) a block evicted from the GPU moves to: its capacity in
    /// blocks (0: none), its blocks (hash → tick) and their LRU order.
    offload_capacity: usize,
    offloaded: HashMap<u64, u64>,
    offload_by_tick: BTreeMap<u64, u64>,
    /// A hybrid-attention engine's groups and their blocks (`None`: one group, in `held`).
    hybrid: Option<HybridCache>,
}

impl SimEngine {
    /// An engine of `capacity` blocks of `block` tokens serving `model`; with `chaos`, its
    /// events are cut at random places and some blocks are stored twice (seeded).
    ///
    /// # Errors
    /// [`Error::InvalidName`] for an empty or over-long model name.
    pub fn new(block: usize, capacity: usize, model: &str, chaos: Option<u64>) -> Result<SimEngine> {
        Ok(SimEngine {
            block: block.max(1),
            capacity,
            held: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            chaos,
            namespace: Namespace::new(model)?,
            seq: 0,
            restarts: 0,
            clock_offset: 0.0,
            published: Kept::default(),
            stored: std::collections::HashSet::new(),
            keep_stored: true,
            offload_capacity: 0,
            offloaded: HashMap::new(),
            offload_by_tick: BTreeMap::new(),
            hybrid: None,
        })
    }

    /// The same engine with several KV cache groups, as a hybrid-attention model's vLLM keeps
    /// them (full attention and sliding windows: [`HybridCache`]), its events naming each
    /// group; no chaos. Its offload tier ([`SimEngine::with_offload`], before or after) is
    /// vLLM's `OffloadingConnector` over every group ([`HybridCache::with_offload`]). Without
    /// groups, or one full-attention group, it is the engine as before.
    pub fn with_groups(mut self, groups: &[GroupKind]) -> SimEngine {
        if groups.iter().any(|g| *g != GroupKind::Full) || groups.len() > 1 {
            self.hybrid = Some(HybridCache::new(groups.to_vec()).with_offload(self.offload_capacity));
        }
        self
    }

    /// The same engine with an offload tier of `blocks` blocks in CPU memory, as vLLM's
    /// offloading connector keeps: a block evicted from the GPU is copied there first (a
    /// `BlockStored` with medium CPU, its hash only, as vLLM's connectors publish it), a
    /// prompt that reaches it loads it back to the GPU (stored there again), and the tier
    /// evicts least recent first (`BlockRemoved`, medium CPU). A hybrid engine's tier is the
    /// connector's as vLLM 0.33 runs it over several groups ([`HybridCache::with_offload`]:
    /// chunks of one block, the prompt's stored as it runs, loaded by the connector's rule).
    pub fn with_offload(mut self, blocks: usize) -> SimEngine {
        self.offload_capacity = blocks;
        self.hybrid = self.hybrid.take().map(|h| h.with_offload(blocks));
        self
    }

    /// The same engine keeping only its last batch in [`SimEngine::published`]: for a replay
    /// whose [`Publisher`] keeps the batches it answers replays from, a second copy of them is
    /// only memory.
    pub fn without_replays(mut self) -> SimEngine {
        self.published = Kept::at_most(1);
        self
    }

    /// The same engine without the set of every block it stored, which only
    /// [`SimEngine::stored_since_restart`] reads (it then knows of no block stored): a replay without
    /// restarts keeps its memory to the cache's.
    pub fn without_stored(mut self) -> SimEngine {
        self.keep_stored = false;
        self.stored = std::collections::HashSet::new();
        self
    }

    /// About the bytes this engine holds in memory: its cache's maps, the set of blocks it
    /// stored, its offload tier and the batches it keeps for replays (hash tables counted at
    /// their capacity, an ordered map at about 32 bytes an entry, each batch as allocated).
    pub fn heap_bytes(&self) -> usize {
        // A hash table of `capacity` entries of `entry` bytes: its buckets (at most 7/8 full),
        // each with a control byte.
        let table = |capacity: usize, entry: usize| capacity.saturating_mul(entry + 1).saturating_mul(8) / 7;
        let ordered = |len: usize| len.saturating_mul(32);
        table(self.held.capacity(), size_of::<(u64, Held)>())
            + ordered(self.by_tick.len())
            + table(self.stored.capacity(), size_of::<u64>())
            + table(self.offloaded.capacity(), size_of::<(u64, u64)>())
            + ordered(self.offload_by_tick.len())
            + self.hybrid.as_ref().map_or(0, HybridCache::heap_bytes)
            + self.published.iter().map(batch_heap_bytes).sum::<usize>()
            + self.published.len() * size_of::<(EngineBatch, usize)>()
    }

    /// Puts (or touches) `hash` in the offload tier; returns whether it was not there.
    fn offload(&mut self, hash: u64) -> bool {
        self.tick += 1;
        let fresh = match self.offloaded.insert(hash, self.tick) {
            Some(old) => {
                self.offload_by_tick.remove(&old);
                false
            }
            None => true,
        };
        self.offload_by_tick.insert(self.tick, hash);
        fresh
    }

    fn coin(&mut self, one_in: u64) -> bool {
        match self.chaos.as_mut() {
            Some(state) => {
                *state = splitmix64(*state);
                *state % one_in == 0
            }
            None => false,
        }
    }

    /// Runs a prompt, as vLLM's scheduler and block pool do: the blocks it holds are hits, the
    /// others are stored (one event a run of new blocks, cut at random places with chaos), then
    /// the request's blocks are freed last block first (so the LRU evicts a prompt's tail
    /// before its head), and blocks past capacity are evicted least recent first, one removal
    /// each. Returns the batch it publishes.
    pub fn run(&mut self, tokens: &[u32]) -> EngineBatch {
        if let Some(hybrid) = self.hybrid.as_mut() {
            let hashes = hybrid_sim::hashes(tokens, self.block);
            if self.keep_stored {
                self.stored.extend(hashes.iter().copied());
            }
            let events = hybrid.run(tokens, &hashes, self.block, self.capacity, &self.namespace);
            return self.publish(events);
        }
        let mut events = Vec::new();
        let mut parent = None;
        let mut pending: Option<EngineStored> = None;
        let mut chain = Vec::new();
        for block in tokens.chunks_exact(self.block) {
            let hash = engine_hash(parent, block);
            chain.push(hash);
            let again = self.coin(20);
            if self.held.contains_key(&hash) && !again {
                if let Some(p) = pending.take() {
                    events.push(EngineEvent::Stored(p));
                }
            } else {
                self.held.entry(hash).or_insert(Held { refs: 0, tick: 0 }).refs += 1;
                if self.keep_stored {
                    self.stored.insert(hash);
                }
                let cut = self.coin(4);
                if pending.is_none() || cut {
                    if let Some(p) = pending.take() {
                        events.push(EngineEvent::Stored(p));
                    }
                    pending = Some(EngineStored {
                        parent,
                        hashes: Vec::new(),
                        tokens: Vec::new(),
                        block_size: u32::try_from(self.block).unwrap_or(u32::MAX),
                        medium: Medium::Gpu,
                        namespace: Some(self.namespace.clone()),
                        group: None,
                    });
                }
                if let Some(p) = pending.as_mut() {
                    p.hashes.push(hash);
                    p.tokens.extend_from_slice(block);
                }
            }
            parent = Some(hash);
        }
        if let Some(p) = pending.take() {
            events.push(EngineEvent::Stored(p));
        }
        // Freed tail first: the last block is the least recent of the request's.
        for &hash in chain.iter().rev() {
            self.tick += 1;
            if let Some(h) = self.held.get_mut(&hash) {
                self.by_tick.remove(&h.tick);
                h.tick = self.tick;
                self.by_tick.insert(self.tick, hash);
            }
            // A copy in the offload tier was used (loaded back): it is recent there too.
            if self.offloaded.contains_key(&hash) {
                self.offload(hash);
            }
        }
        while self.by_tick.len() > self.capacity {
            let Some((_, victim)) = self.by_tick.pop_first() else { break };
            // Copied to the offload tier before the GPU block is freed.
            if self.offload_capacity > 0 && self.offload(victim) {
                events.push(EngineEvent::Stored(EngineStored {
                    parent: None,
                    hashes: vec![victim],
                    tokens: Vec::new(),
                    block_size: 0,
                    medium: Medium::Cpu,
                    namespace: None,
                    group: None,
                }));
            }
            // One removal a copy.
            let copies = self.held.remove(&victim).map_or(1, |h| h.refs);
            for _ in 0..copies {
                events.push(EngineEvent::Removed { hashes: vec![victim], medium: Medium::Gpu, group: None });
            }
        }
        while self.offload_by_tick.len() > self.offload_capacity {
            let Some((_, victim)) = self.offload_by_tick.pop_first() else { break };
            self.offloaded.remove(&victim);
            events.push(EngineEvent::Removed { hashes: vec![victim], medium: Medium::Cpu, group: None });
        }
        self.publish(events)
    }

    /// Publishes `events` as the next batch.
    pub fn publish(&mut self, events: Vec<EngineEvent>) -> EngineBatch {
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        // A later process always publishes later (its clock, as vLLM's `time.time()`).
        let batch = EngineBatch { seq: self.seq, ts: ts + self.restarts as f64 + self.clock_offset, events };
        self.seq += 1;
        self.published.push(batch.clone(), batch_bytes(&batch));
        batch
    }

    /// A restart: a new process, an empty cache, numbers from 0 again, nothing to replay.
    pub fn restart(&mut self) {
        if let Some(h) = self.hybrid.as_mut() {
            h.clear();
        }
        self.held.clear();
        self.by_tick.clear();
        self.seq = 0;
        self.published.clear();
        self.stored.clear();
        self.offloaded.clear();
        self.offload_by_tick.clear();
        self.restarts += 1;
    }

    /// A restart ([`SimEngine::restart`]) whose new process's clock is `step` seconds off the
    /// old one's (negative: behind, as after an NTP step or a move to another host).
    pub fn restart_with_clock(&mut self, step: f64) {
        self.restart();
        self.clock_offset += step;
    }

    /// Whether this process stored every block of the first `n` tokens of `tokens` at some
    /// time (whatever it evicted since): a claim of them comes from its own events, not from
    /// a process before a restart.
    pub fn stored_since_restart(&self, tokens: &[u32], n: usize) -> bool {
        let mut parent = None;
        tokens.chunks_exact(self.block).take(n / self.block).all(|block| {
            let hash = engine_hash(parent, block);
            parent = Some(hash);
            self.stored.contains(&hash)
        })
    }

    /// Tokens of `tokens` the engine can serve from its cache: its blocks from the first, held
    /// on the GPU or in the offload tier.
    pub fn holds(&self, tokens: &[u32]) -> usize {
        self.holds_by_tier(tokens).1
    }

    /// Tokens of `tokens` the engine holds from the first: (on the GPU, on the GPU or in the
    /// offload tier). A hybrid engine's: what vLLM reuses, (its GPU hit, that and what the
    /// offloading connector loads past it).
    pub fn holds_by_tier(&self, tokens: &[u32]) -> (usize, usize) {
        if let Some(hybrid) = &self.hybrid {
            return hybrid.reused(&hybrid_sim::hashes(tokens, self.block), tokens.len(), self.block);
        }
        let mut parent = None;
        let (mut gpu, mut n, mut all_gpu) = (0, 0, true);
        for block in tokens.chunks_exact(self.block) {
            let hash = engine_hash(parent, block);
            let on_gpu = self.held.contains_key(&hash);
            if !on_gpu && !self.offloaded.contains_key(&hash) {
                break;
            }
            all_gpu &= on_gpu;
            n += self.block;
            if all_gpu {
                gpu = n;
            }
            parent = Some(hash);
        }
        (gpu, n)
    }

    /// Blocks held (a hybrid engine's, once a group).
    pub fn len(&self) -> usize {
        self.hybrid.as_ref().map_or(self.held.len(), HybridCache::len)
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch in vLLM 0.33.0's wire form: `[ts, events, dp_rank]`, each event a map with its
/// `"type"` and its fields by name.
pub fn encode(batch: &EngineBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    // Writing into a `Vec` cannot fail.
    let _ = write_batch(&mut out, batch);
    out
}

fn write_batch(w: &mut Vec<u8>, batch: &EngineBatch) -> std::result::Result<(), Box<dyn std::error::Error>> {
    use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint};
    let len = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    let medium = |m: Medium| match m {
        Medium::Gpu => "GPU",
        Medium::Cpu => "CPU",
        _ => "STORAGE",
    };
    write_array_len(w, 3)?;
    write_f64(w, batch.ts)?;
    write_array_len(w, len(batch.events.len()))?;
    for event in &batch.events {
        match event {
            EngineEvent::Stored(s) => {
                let group_fields = match s.group.map(|g| g.kind) {
                    None => 0,
                    Some(GroupKind::SlidingWindow { .. }) => 3,
                    Some(_) => 2,
                };
                write_map_len(w, 8 + group_fields)?;
                write_str(w, "type")?;
                write_str(w, "BlockStored")?;
                write_str(w, "block_hashes")?;
                write_array_len(w, len(s.hashes.len()))?;
                for &h in &s.hashes {
                    write_uint(w, h)?;
                }
                write_str(w, "parent_block_hash")?;
                match s.parent {
                    Some(p) => drop(write_uint(w, p)?),
                    None => write_nil(w)?,
                }
                write_str(w, "token_ids")?;
                write_array_len(w, len(s.tokens.len()))?;
                for &t in &s.tokens {
                    write_uint(w, u64::from(t))?;
                }
                write_str(w, "block_size")?;
                write_uint(w, u64::from(s.block_size))?;
                write_str(w, "lora_id")?;
                write_nil(w)?;
                write_str(w, "medium")?;
                write_str(w, medium(s.medium))?;
                write_str(w, "lora_name")?;
                write_nil(w)?;
                if let Some(g) = s.group {
                    write_str(w, "group_idx")?;
                    write_uint(w, u64::from(g.index))?;
                    write_str(w, "kv_cache_spec_kind")?;
                    match g.kind {
                        GroupKind::SlidingWindow { window } => {
                            write_str(w, "sliding_window")?;
                            write_str(w, "kv_cache_spec_sliding_window")?;
                            write_uint(w, u64::from(window))?;
                        }
                        // The offloading connector's placeholder names no kind.
                        GroupKind::Other => write_nil(w)?,
                        _ => write_str(w, "full_attention")?,
                    }
                }
            }
            EngineEvent::Removed { hashes, medium: m, group } => {
                write_map_len(w, 3 + u32::from(group.is_some()))?;
                write_str(w, "type")?;
                write_str(w, "BlockRemoved")?;
                write_str(w, "block_hashes")?;
                write_array_len(w, len(hashes.len()))?;
                for &h in hashes {
                    write_uint(w, h)?;
                }
                write_str(w, "medium")?;
                write_str(w, medium(*m))?;
                if let Some(g) = group {
                    write_str(w, "group_idx")?;
                    write_uint(w, u64::from(*g))?;
                }
            }
            _ => {
                write_map_len(w, 1)?;
                write_str(w, "type")?;
                write_str(w, "AllBlocksCleared")?;
            }
        }
    }
    write_uint(w, 0)?;
    Ok(())
}

/// Everything a publisher can still replay: (seq, payload).
type Buffer = Arc<Mutex<Kept<(u64, Vec<u8>)>>>;

/// vLLM's publisher on loopback: a PUB for live batches (`[topic, seq, payload]`) and a ROUTER
/// that answers a replay request (`[b"", start]`) with every buffered batch from `start` on
/// (`[b"", topic, seq, payload]` each) and the end marker, after `replay_delay`.
pub struct Publisher {
    /// The PUB's address.
    pub events: String,
    /// The ROUTER's address.
    pub replay: String,
    socket: zmq::Socket,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
    router: Option<JoinHandle<()>>,
}

fn zmq_err(what: &'static str) -> impl Fn(zmq::Error) -> Error {
    move |e| Error::InvalidConfig { detail: format!("simulated engine: {what}: {e}") }
}

impl Publisher {
    /// Binds both sockets on loopback ports of the system's choice.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if ZMQ cannot bind or start.
    pub fn new(replay_delay: Duration) -> Result<Publisher> {
        Publisher::at(replay_delay, None)
    }

    /// Binds both sockets on loopback: events on port `ports.0`, replays on `ports.1` (`None`:
    /// ports of the system's choice), so that other processes can follow this engine too.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if ZMQ cannot bind (a port taken) or start.
    pub fn at(replay_delay: Duration, ports: Option<(u16, u16)>) -> Result<Publisher> {
        Publisher::on("127.0.0.1", replay_delay, ports)
    }

    /// As [`Publisher::new`], on IPv6's loopback (`tcp://[::1]:P`).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if ZMQ cannot bind (no IPv6 here) or start.
    pub fn ipv6(replay_delay: Duration) -> Result<Publisher> {
        Publisher::on("[::1]", replay_delay, None)
    }

    fn on(host: &str, replay_delay: Duration, ports: Option<(u16, u16)>) -> Result<Publisher> {
        let address =
            |port: Option<u16>| port.map_or_else(|| format!("tcp://{host}:*"), |p| format!("tcp://{host}:{p}"));
        let ipv6 = host.starts_with('[');
        let context = zmq::Context::new();
        let socket = context.socket(zmq::PUB).map_err(zmq_err("PUB"))?;
        socket.set_linger(0).map_err(zmq_err("linger"))?;
        socket.set_ipv6(ipv6).map_err(zmq_err("ipv6"))?;
        socket.set_sndhwm(1_000_000).map_err(zmq_err("hwm"))?;
        socket.bind(&address(ports.map(|p| p.0))).map_err(zmq_err("bind"))?;
        let events = socket.get_last_endpoint().map_err(zmq_err("endpoint"))?.unwrap_or_default();
        let router = context.socket(zmq::ROUTER).map_err(zmq_err("ROUTER"))?;
        router.set_linger(0).map_err(zmq_err("linger"))?;
        router.set_rcvtimeo(50).map_err(zmq_err("timeout"))?;
        router.set_ipv6(ipv6).map_err(zmq_err("ipv6"))?;
        router.bind(&address(ports.map(|p| p.1))).map_err(zmq_err("bind"))?;
        let replay = router.get_last_endpoint().map_err(zmq_err("endpoint"))?.unwrap_or_default();
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (Arc::clone(&buffer), Arc::clone(&stop));
        let handle = std::thread::Builder::new()
            .name("sim-engine-replay".into())
            .spawn(move || answer_replays(&router, &b, &s, replay_delay))
            .map_err(|source| Error::Thread { source: Arc::new(source) })?;
        Ok(Publisher { events, replay, socket, buffer, stop, router: Some(handle) })
    }

    /// Publishes `batch` live (unless `lost`: what a slow subscriber loses) and keeps it for
    /// replays.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if ZMQ cannot send.
    pub fn publish(&self, batch: &EngineBatch, lost: bool) -> Result<()> {
        let payload = encode(batch);
        if let Ok(mut buffer) = self.buffer.lock() {
            buffer.push((batch.seq, payload.clone()), payload.len());
        }
        if !lost {
            let frames: [&[u8]; 3] = [b"", &batch.seq.to_be_bytes(), &payload];
            self.socket.send_multipart(frames, 0).map_err(zmq_err("send"))?;
        }
        Ok(())
    }

    /// About the bytes of the batches kept for replays: their payloads as allocated.
    pub fn buffered_bytes(&self) -> usize {
        self.buffer.lock().map_or(0, |b| {
            b.iter().map(|(_, payload)| allocation(payload.len())).sum::<usize>()
                + b.len() * size_of::<((u64, Vec<u8>), usize)>()
        })
    }

    /// A restarted engine's replay buffer starts empty.
    pub fn restart(&self) {
        if let Ok(mut buffer) = self.buffer.lock() {
            buffer.clear();
        }
    }
}

/// The ROUTER's loop: one answer a request, until `stop`.
fn answer_replays(router: &zmq::Socket, buffer: &Buffer, stop: &AtomicBool, delay: Duration) {
    while !stop.load(Ordering::Acquire) {
        let Ok(frames) = router.recv_multipart(0) else { continue };
        let [identity, _, start] = frames.as_slice() else { continue };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else { continue };
        std::thread::sleep(delay);
        let answer: Vec<(u64, Vec<u8>)> = match buffer.lock() {
            Ok(b) => b.iter().filter(|(q, _)| *q >= start).cloned().collect(),
            Err(_) => Vec::new(),
        };
        for (seq, payload) in answer {
            let frames: [&[u8]; 5] = [identity, b"", b"", &seq.to_be_bytes(), &payload];
            let _ = router.send_multipart(frames, 0);
        }
        let end: [&[u8]; 5] = [identity, b"", b"", &u64::MAX.to_be_bytes(), b""];
        let _ = router.send_multipart(end, 0);
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(h) = self.router.take() {
            let _ = h.join();
        }
    }
}
