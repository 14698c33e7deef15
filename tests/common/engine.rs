//! A simulated inference engine for the engine-event tests: an LRU of engine blocks that
//! publishes vLLM's KV cache events, in the library's form and on the wire (vLLM 0.33.0's
//! msgpack map form over a ZMQ PUB, with a ROUTER answering replays as vLLM's does).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Rng;
use superfluid_warm::{EngineBatch, EngineEvent, EngineStored, Medium, Namespace};

/// One simulated engine: an LRU of engine blocks of `size` tokens, publishing vLLM's events.
pub struct Engine {
    pub size: usize,
    capacity: usize,
    /// Held blocks: hash → (refs, parent).
    held: HashMap<u64, (u32, Option<u64>)>,
    /// LRU order, least recent first (a hash appears once per copy).
    lru: VecDeque<u64>,
    seq: u64,
    ts: f64,
    /// Every batch published by this process (its replay buffer).
    pub published: Vec<EngineBatch>,
}

/// A block's engine hash: its parent's and its tokens' (vLLM's chain, another hash).
pub fn engine_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = parent.unwrap_or(0x5eed) ^ 0x9E37_79B9_7F4A_7C15;
    for &t in tokens {
        h = superfluid_warm::tools::trace::splitmix64(h ^ u64::from(t));
    }
    h
}

impl Engine {
    pub fn new(size: usize, capacity: usize) -> Engine {
        Engine { size, capacity, held: HashMap::new(), lru: VecDeque::new(), seq: 0, ts: 1.0, published: Vec::new() }
    }

    /// Runs a prompt: touches the blocks it holds, stores the rest (in events cut at random
    /// places, sometimes a block stored twice), evicts least recent blocks past its capacity.
    pub fn run(&mut self, tokens: &[u32], rng: &mut Rng) -> EngineBatch {
        let mut events = Vec::new();
        let mut parent = None;
        let mut pending: Option<EngineStored> = None;
        for block in tokens.chunks_exact(self.size) {
            let hash = engine_hash(parent, block);
            let again = rng.below(20) == 0;
            if self.held.contains_key(&hash) && !again {
                self.lru.retain(|&h| h != hash);
                self.lru.push_back(hash);
                if let Some(p) = pending.take() {
                    events.push(EngineEvent::Stored(p));
                }
            } else {
                let entry = self.held.entry(hash).or_insert((0, parent));
                entry.0 += 1;
                self.lru.push_back(hash);
                if pending.is_none() || rng.below(4) == 0 {
                    if let Some(p) = pending.take() {
                        events.push(EngineEvent::Stored(p));
                    }
                    pending = Some(EngineStored {
                        parent,
                        hashes: Vec::new(),
                        tokens: Vec::new(),
                        block_size: self.size as u32,
                        medium: Medium::Gpu,
                        namespace: Some(Namespace::new("m").expect("namespace")),
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
        while self.lru.len() > self.capacity {
            let Some(victim) = self.lru.pop_front() else { break };
            let gone = match self.held.get_mut(&victim) {
                Some(entry) if entry.0 > 1 => {
                    entry.0 -= 1;
                    false
                }
                _ => true,
            };
            if gone {
                self.held.remove(&victim);
            }
            events.push(EngineEvent::Removed { hashes: vec![victim], medium: Medium::Gpu });
        }
        self.publish(events)
    }

    pub fn publish(&mut self, events: Vec<EngineEvent>) -> EngineBatch {
        let batch = EngineBatch { seq: self.seq, ts: self.ts, events };
        self.seq += 1;
        self.ts += 1.0;
        self.published.push(batch.clone());
        batch
    }

    /// A restart: a new process, an empty cache, numbers from 0 again.
    pub fn restart(&mut self) {
        self.held.clear();
        self.lru.clear();
        self.seq = 0;
        self.published.clear();
        self.ts += 1000.0;
    }

    /// Tokens of `tokens` the engine can serve from its cache: its held blocks from the first.
    pub fn holds(&self, tokens: &[u32]) -> usize {
        let mut parent = None;
        let mut n = 0;
        for block in tokens.chunks_exact(self.size) {
            let hash = engine_hash(parent, block);
            if !self.held.contains_key(&hash) {
                break;
            }
            n += self.size;
            parent = Some(hash);
        }
        n
    }
}

/// A batch in vLLM 0.33.0's wire form: `[ts, events, dp_rank]`, each event a map with its
/// `"type"`.
pub fn encode(batch: &EngineBatch) -> Vec<u8> {
    use rmp::encode::{write_array_len, write_f64, write_map_len, write_nil, write_str, write_uint};
    let mut out = Vec::new();
    let w = &mut out;
    write_array_len(w, 3).expect("encode");
    write_f64(w, batch.ts).expect("encode");
    write_array_len(w, batch.events.len() as u32).expect("encode");
    let medium = |m: Medium| if m == Medium::Gpu { "GPU" } else { "CPU" };
    for event in &batch.events {
        match event {
            EngineEvent::Stored(s) => {
                write_map_len(w, 8).expect("encode");
                write_str(w, "type").expect("encode");
                write_str(w, "BlockStored").expect("encode");
                write_str(w, "block_hashes").expect("encode");
                write_array_len(w, s.hashes.len() as u32).expect("encode");
                for &h in &s.hashes {
                    write_uint(w, h).expect("encode");
                }
                write_str(w, "parent_block_hash").expect("encode");
                match s.parent {
                    Some(p) => write_uint(w, p).map(drop).expect("encode"),
                    None => write_nil(w).expect("encode"),
                }
                write_str(w, "token_ids").expect("encode");
                write_array_len(w, s.tokens.len() as u32).expect("encode");
                for &t in &s.tokens {
                    write_uint(w, u64::from(t)).expect("encode");
                }
                write_str(w, "block_size").expect("encode");
                write_uint(w, u64::from(s.block_size)).expect("encode");
                write_str(w, "lora_id").expect("encode");
                write_nil(w).expect("encode");
                write_str(w, "medium").expect("encode");
                write_str(w, medium(s.medium)).expect("encode");
                write_str(w, "lora_name").expect("encode");
                write_nil(w).expect("encode");
            }
            EngineEvent::Removed { hashes, medium: m } => {
                write_map_len(w, 3).expect("encode");
                write_str(w, "type").expect("encode");
                write_str(w, "BlockRemoved").expect("encode");
                write_str(w, "block_hashes").expect("encode");
                write_array_len(w, hashes.len() as u32).expect("encode");
                for &h in hashes {
                    write_uint(w, h).expect("encode");
                }
                write_str(w, "medium").expect("encode");
                write_str(w, medium(*m)).expect("encode");
            }
            EngineEvent::Cleared => {
                write_map_len(w, 1).expect("encode");
                write_str(w, "type").expect("encode");
                write_str(w, "AllBlocksCleared").expect("encode");
            }
            _ => unreachable!("no other event"),
        }
    }
    write_uint(w, 0).expect("encode");
    out
}

/// Everything published: (seq, payload), for replays.
type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

/// vLLM's publisher on loopback: a PUB for live batches (`[topic, seq, payload]`) and a ROUTER
/// answering replays from everything published (`[b"", topic, seq, payload]` each, then the
/// end marker), after `replay_delay`.
pub struct Publisher {
    pub events: String,
    pub replay: String,
    pub_socket: zmq::Socket,
    buffer: Buffer,
    stop: Arc<AtomicBool>,
    router: Option<JoinHandle<()>>,
}

impl Publisher {
    pub fn new(replay_delay: Duration) -> Publisher {
        let context = zmq::Context::new();
        let pub_socket = context.socket(zmq::PUB).expect("PUB");
        pub_socket.set_linger(0).expect("linger");
        pub_socket.bind("tcp://127.0.0.1:*").expect("bind PUB");
        let events = pub_socket.get_last_endpoint().expect("endpoint").expect("utf-8");
        let router = context.socket(zmq::ROUTER).expect("ROUTER");
        router.set_linger(0).expect("linger");
        router.set_rcvtimeo(50).expect("timeout");
        router.bind("tcp://127.0.0.1:*").expect("bind ROUTER");
        let replay = router.get_last_endpoint().expect("endpoint").expect("utf-8");
        let buffer: Buffer = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (Arc::clone(&buffer), Arc::clone(&stop));
        let handle = std::thread::spawn(move || {
            while !s.load(Ordering::Acquire) {
                let Ok(frames) = router.recv_multipart(0) else { continue };
                let [identity, _, start] = frames.as_slice() else { continue };
                let start = u64::from_be_bytes(start.as_slice().try_into().unwrap_or([0; 8]));
                std::thread::sleep(replay_delay);
                let answer: Vec<(u64, Vec<u8>)> =
                    b.lock().expect("buffer").iter().filter(|(q, _)| *q >= start).cloned().collect();
                for (seq, payload) in answer {
                    let frames: [&[u8]; 5] = [identity, b"", b"", &seq.to_be_bytes(), &payload];
                    let _ = router.send_multipart(frames, 0);
                }
                let end: [&[u8]; 5] = [identity, b"", b"", &u64::MAX.to_be_bytes(), b""];
                let _ = router.send_multipart(end, 0);
            }
        });
        Publisher { events, replay, pub_socket, buffer, stop, router: Some(handle) }
    }

    /// Publishes `batch` live (unless `drop`, which a slow subscriber would lose) and keeps it
    /// for replays.
    pub fn publish(&self, batch: &EngineBatch, drop: bool) {
        let payload = encode(batch);
        self.buffer.lock().expect("buffer").push((batch.seq, payload.clone()));
        if !drop {
            let frames: [&[u8]; 3] = [b"", &batch.seq.to_be_bytes(), &payload];
            self.pub_socket.send_multipart(frames, 0).expect("publish");
        }
    }

    /// A restarted engine's replay buffer starts empty.
    pub fn restart(&self) {
        self.buffer.lock().expect("buffer").clear();
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
