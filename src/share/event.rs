//! The events heads share: a `ran`, a forget, a node's cache size, or a batch of an engine's KV
//! cache events, with where it came from. Encoded by the one codec module (bincode, like the cold
//! records); see `docs/design.md`, "Shared events".

use serde::{Deserialize, Serialize};

use crate::decided::engines::{CacheGroup, EngineBatch, EngineEvent, EngineStored, GroupKind, Medium};
use crate::error::Result;
use crate::keys::{BlockKey, Namespace};
use crate::store::codec;

/// The version of the event encoding; an event of another version is skipped by every head.
pub(crate) const EVENT_VERSION: u32 = 1;

/// Largest event accepted (a prompt of 2^16 blocks is 1 MiB of keys).
pub(crate) const MAX_EVENT_BYTES: usize = 2 << 20;

/// One shared change.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Event {
    pub version: u32,
    pub origin: Origin,
    pub what: What,
}

/// Which head made an event: its name, which run of its process (`boot`), the event's number
/// in that run, and when (ns since the Unix epoch, the head's clock: for the lag only).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Origin {
    pub head: String,
    pub boot: u64,
    pub local: u64,
    pub at_unix_ns: u64,
}

/// What changed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum What {
    /// `node` ran a prompt whose block keys are `keys`, in a namespace (model, whether it is a
    /// tenant's, public id), hashed in scheme `scheme`.
    Ran { model: String, tenant: bool, namespace: [u8; 8], scheme: String, node: String, keys: Vec<BlockKey> },
    /// `forget_node(node)`.
    Forget { node: String },
    /// `set_node_capacity(node, blocks)`: the size of that name's KV cache, in blocks (`None`:
    /// the head's default). Last, so that a head of an earlier build skips only these (it cannot
    /// decode them) and counts them.
    Capacity { node: String, blocks: Option<u64> },
    /// A batch of node `node`'s engine's KV cache events, as a head received it from the
    /// engine. Last, so that a head of an earlier build skips only these.
    Engine { node: String, batch: WireBatch },
}

/// An engine batch as heads share it ([`EngineBatch`], its publish time as the bits of the
/// `f64`, so that events compare exactly).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct WireBatch {
    pub seq: u64,
    pub ts_bits: u64,
    pub events: Vec<WireEvent>,
}

/// One engine event on the wire ([`EngineEvent`]); a medium is its tier (0 GPU, 1 CPU, 2
/// storage, 3 another).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) enum WireEvent {
    /// Blocks stored, keyed in (model, cache salt) when a prompt's first block is among them:
    /// every head hashes the tokens in that namespace (the salt is the engine's, as it
    /// published it).
    Stored {
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        medium: u8,
        namespace: Option<(String, Option<Vec<u8>>)>,
    },
    Removed {
        hashes: Vec<u64>,
        medium: u8,
    },
    Cleared,
    /// [`WireEvent::Stored`] in a KV cache group: `(index, kind, window)` (kind 0 full, 1
    /// sliding window, 2 chunked local, 3 Mamba, 4 another). Last, so that a head of an
    /// earlier build skips only batches that carry groups.
    StoredInGroup {
        parent: Option<u64>,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        medium: u8,
        namespace: Option<(String, Option<Vec<u8>>)>,
        group: (u32, u8, u32),
    },
    /// [`WireEvent::Removed`] from the KV cache group of that index.
    RemovedInGroup {
        hashes: Vec<u64>,
        medium: u8,
        group: u32,
    },
}

/// A group as the wire carries it (see [`WireEvent::StoredInGroup`]).
fn group_code(g: CacheGroup) -> (u32, u8, u32) {
    let (kind, window) = match g.kind {
        GroupKind::Full => (0, 0),
        GroupKind::SlidingWindow { window } => (1, window),
        GroupKind::ChunkedLocal => (2, 0),
        GroupKind::Mamba => (3, 0),
        _ => (4, 0),
    };
    (g.index, kind, window)
}

fn group_of((index, kind, window): (u32, u8, u32)) -> CacheGroup {
    let kind = match kind {
        0 => GroupKind::Full,
        1 => GroupKind::SlidingWindow { window },
        2 => GroupKind::ChunkedLocal,
        3 => GroupKind::Mamba,
        _ => GroupKind::Other,
    };
    CacheGroup { index, kind }
}

fn medium_code(m: Medium) -> u8 {
    m.tier().unwrap_or(3)
}

fn medium_of(code: u8) -> Medium {
    match code {
        0..=2 => Medium::of_tier(code),
        _ => Medium::Other,
    }
}

impl WireBatch {
    pub(crate) fn of(batch: &EngineBatch) -> WireBatch {
        let events = batch
            .events
            .iter()
            .map(|e| match e {
                EngineEvent::Stored(s) => {
                    let namespace =
                        s.namespace.as_ref().map(|n| (n.model().to_string(), n.tenant().map(<[u8]>::to_vec)));
                    let (parent, hashes, tokens) = (s.parent, s.hashes.clone(), s.tokens.clone());
                    let (block_size, medium) = (s.block_size, medium_code(s.medium));
                    match s.group {
                        None => WireEvent::Stored { parent, hashes, tokens, block_size, medium, namespace },
                        Some(g) => WireEvent::StoredInGroup {
                            parent,
                            hashes,
                            tokens,
                            block_size,
                            medium,
                            namespace,
                            group: group_code(g),
                        },
                    }
                }
                EngineEvent::Removed { hashes, medium, group: None } => {
                    WireEvent::Removed { hashes: hashes.clone(), medium: medium_code(*medium) }
                }
                EngineEvent::Removed { hashes, medium, group: Some(group) } => {
                    WireEvent::RemovedInGroup { hashes: hashes.clone(), medium: medium_code(*medium), group: *group }
                }
                EngineEvent::Cleared => WireEvent::Cleared,
            })
            .collect();
        WireBatch { seq: batch.seq, ts_bits: batch.ts.to_bits(), events }
    }

    /// The batch; `None` if a namespace in it is not one this build accepts.
    pub(crate) fn batch(&self) -> Option<EngineBatch> {
        let mut events = Vec::with_capacity(self.events.len());
        for e in &self.events {
            // A store, in a group or not: its namespace must be one this build accepts.
            let stored = |parent: &Option<u64>,
                          hashes: &Vec<u64>,
                          tokens: &Vec<u32>,
                          (block_size, medium): (u32, u8),
                          namespace: &Option<(String, Option<Vec<u8>>)>,
                          group: Option<CacheGroup>| {
                let namespace = match namespace {
                    Some((model, tenant)) => Some(Namespace::of(model, tenant.as_deref()).ok()?),
                    None => None,
                };
                Some(EngineEvent::Stored(EngineStored {
                    parent: *parent,
                    hashes: hashes.clone(),
                    tokens: tokens.clone(),
                    block_size,
                    medium: medium_of(medium),
                    namespace,
                    group,
                }))
            };
            events.push(match e {
                WireEvent::Stored { parent, hashes, tokens, block_size, medium, namespace } => {
                    stored(parent, hashes, tokens, (*block_size, *medium), namespace, None)?
                }
                WireEvent::StoredInGroup { parent, hashes, tokens, block_size, medium, namespace, group } => {
                    stored(parent, hashes, tokens, (*block_size, *medium), namespace, Some(group_of(*group)))?
                }
                WireEvent::Removed { hashes, medium } => {
                    EngineEvent::Removed { hashes: hashes.clone(), medium: medium_of(*medium), group: None }
                }
                WireEvent::RemovedInGroup { hashes, medium, group } => {
                    EngineEvent::Removed { hashes: hashes.clone(), medium: medium_of(*medium), group: Some(*group) }
                }
                WireEvent::Cleared => EngineEvent::Cleared,
            });
        }
        Some(EngineBatch { seq: self.seq, ts: f64::from_bits(self.ts_bits), events })
    }
}

impl Event {
    /// # Errors
    /// [`crate::Error::Codec`].
    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        codec::encode("shared event", self)
    }

    /// `None` for bytes that are not a whole event of this version (or too many).
    pub(crate) fn decode(bytes: &[u8]) -> Option<Event> {
        if bytes.len() > MAX_EVENT_BYTES {
            return None;
        }
        codec::decode::<Event>("shared event", bytes).ok().filter(|e| e.version == EVENT_VERSION)
    }

    /// The header that makes a retried publish stored once (`Nats-Msg-Id`). An engine batch's
    /// names the batch, not the head: every head that receives it from the engine publishes it,
    /// and the stream stores it once (an engine process is told from the one before it by the
    /// publish time: its numbers start again at 0).
    pub(crate) fn message_id(&self) -> String {
        match &self.what {
            What::Engine { node, batch } => format!("engine.{node}.{}.{:016x}", batch.seq, batch.ts_bits),
            _ => format!("{}.{:016x}.{}", self.origin.head, self.origin.boot, self.origin.local),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    fn ran() -> Event {
        Event {
            version: EVENT_VERSION,
            origin: Origin { head: "a".into(), boot: 7, local: 3, at_unix_ns: 11 },
            what: What::Ran {
                model: "m".into(),
                tenant: false,
                namespace: [1; 8],
                scheme: "s".into(),
                node: "n".into(),
                keys: vec![[2; 16], [3; 16]],
            },
        }
    }

    #[test]
    fn an_event_comes_back_as_it_went_and_garbage_is_refused() -> Result<()> {
        let bytes = ran().encode()?;
        assert_eq!(Event::decode(&bytes), Some(ran()));
        assert_eq!(Event::decode(&bytes[..bytes.len() - 1]), None, "a cut event");
        let mut longer = bytes.clone();
        longer.push(0);
        assert_eq!(Event::decode(&longer), None, "trailing bytes");
        let mut other = ran();
        other.version = EVENT_VERSION + 1;
        assert_eq!(Event::decode(&other.encode()?), None, "another version");
        assert_eq!(Event::decode(&vec![0xff; MAX_EVENT_BYTES + 1]), None);
        assert_eq!(ran().message_id(), "a.0000000000000007.3");
        Ok(())
    }

    #[test]
    fn an_engine_batch_comes_back_whole_under_an_id_of_the_batch_not_the_head() -> Result<()> {
        let ns = Namespace::of("m", Some(b"salt"))?;
        let batch = EngineBatch {
            seq: 9,
            ts: 1_796_000_000.25,
            events: vec![
                EngineEvent::Stored(EngineStored {
                    parent: None,
                    hashes: vec![1, u64::MAX],
                    tokens: (0..32).collect(),
                    block_size: 16,
                    medium: Medium::Gpu,
                    namespace: Some(ns.clone()),
                    group: None,
                }),
                EngineEvent::Removed { hashes: vec![1], medium: Medium::Cpu, group: None },
                EngineEvent::Stored(EngineStored {
                    parent: Some(1),
                    hashes: vec![3],
                    tokens: (0..32).collect(),
                    block_size: 16,
                    medium: Medium::Gpu,
                    namespace: None,
                    group: Some(CacheGroup { index: 2, kind: GroupKind::SlidingWindow { window: 128 } }),
                }),
                EngineEvent::Removed { hashes: vec![3], medium: Medium::Gpu, group: Some(2) },
                EngineEvent::Cleared,
            ],
        };
        let mut event = ran();
        event.what = What::Engine { node: "gpu-0".into(), batch: WireBatch::of(&batch) };
        let back = Event::decode(&event.encode()?).expect("decodes");
        let What::Engine { batch: wire, .. } = &back.what else { panic!("an engine event") };
        assert_eq!(wire.batch(), Some(batch.clone()));
        let id = event.message_id();
        event.origin.head = "b".into();
        assert_eq!(event.message_id(), id, "every head publishes it under one id");
        assert_eq!(id, format!("engine.gpu-0.9.{:016x}", batch.ts.to_bits()));
        let earlier = codec::decode::<EarlierEvent>("earlier event", &event.encode()?);
        assert!(earlier.is_err(), "a head of an earlier build cannot decode it, and skips it");
        Ok(())
    }

    /// The events of 0.6.0, which had no `Capacity`.
    #[derive(Debug, Deserialize, PartialEq, Eq)]
    struct EarlierEvent {
        version: u32,
        origin: Origin,
        what: EarlierWhat,
    }

    #[derive(Debug, Deserialize, PartialEq, Eq)]
    enum EarlierWhat {
        Ran { model: String, tenant: bool, namespace: [u8; 8], scheme: String, node: String, keys: Vec<BlockKey> },
        Forget { node: String },
    }

    #[test]
    fn a_cache_size_event_comes_back_and_a_head_of_the_earlier_build_skips_only_it() -> Result<()> {
        let mut sized = ran();
        sized.what = What::Capacity { node: "n".into(), blocks: Some(4096) };
        let bytes = sized.encode()?;
        assert_eq!(Event::decode(&bytes), Some(sized.clone()));
        let earlier = |e: &Event| e.encode().and_then(|b| codec::decode::<EarlierEvent>("earlier event", &b));
        assert!(earlier(&sized).is_err(), "the earlier build cannot decode it, and skips it");
        let mut forget = ran();
        forget.what = What::Forget { node: "n".into() };
        let got = earlier(&forget)?;
        assert_eq!(
            (got.version, got.origin, got.what),
            (EVENT_VERSION, forget.origin, EarlierWhat::Forget { node: "n".into() })
        );
        assert!(
            matches!(earlier(&ran())?.what, EarlierWhat::Ran { ref node, ref keys, .. } if node == "n" && keys.len() == 2)
        );
        Ok(())
    }
}
