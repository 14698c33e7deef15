//! The engine events the index takes (decoded from vLLM's and SGLang's wire formats by
//! `engine/`, or built by a caller), what it does with a batch, and its counts of a stream.

use serde::{Deserialize, Serialize};

use crate::keys::Namespace;

/// Where the engine keeps a block ("medium" in vLLM's events).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Medium {
    /// GPU memory (vLLM's `"GPU"`, or no medium given).
    Gpu,
    /// CPU memory, by an offloading connector (`"CPU"`).
    Cpu,
    /// Disk or remote storage, by an offloading connector (`"STORAGE"`).
    Storage,
    /// A medium this build does not know.
    Other,
}

impl Medium {
    /// Its tier, fastest first (0 GPU, 1 CPU, 2 storage); `None` for a medium this build does
    /// not know.
    pub(crate) fn tier(self) -> Option<u8> {
        match self {
            Medium::Gpu => Some(0),
            Medium::Cpu => Some(1),
            Medium::Storage => Some(2),
            Medium::Other => None,
        }
    }

    /// The medium of a tier (see [`Medium::tier`]).
    pub(crate) fn of_tier(tier: u8) -> Medium {
        match tier {
            0 => Medium::Gpu,
            1 => Medium::Cpu,
            _ => Medium::Storage,
        }
    }

    /// The medium an event names (`None`: the GPU, as vLLM before offloading sent).
    pub fn named(name: Option<&str>) -> Medium {
        match name {
            None => Medium::Gpu,
            Some(n) if n.eq_ignore_ascii_case("gpu") => Medium::Gpu,
            // SGLang names its host tier CPU_PINNED, and its disk and remote tiers DISK and EXTERNAL.
            Some(n) if n.eq_ignore_ascii_case("cpu") || n.eq_ignore_ascii_case("cpu_pinned") => Medium::Cpu,
            Some(n) if ["storage", "disk", "external"].iter().any(|m| n.eq_ignore_ascii_case(m)) => Medium::Storage,
            Some(_) => Medium::Other,
        }
    }
}

/// The KV cache group of a hybrid-attention engine that blocks are stored in (vLLM's
/// `group_idx`, `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`). vLLM keeps one group
/// per kind of attention layer, each with its own blocks, and reuses a prefix only as far as
/// every group can serve it. An engine of one kind of attention has one group, 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheGroup {
    /// The group's index in the engine (`group_idx`).
    pub index: u32,
    /// Its kind of attention.
    pub kind: GroupKind,
}

/// The kind of attention of a KV cache group, which decides what of a prefix it must hold for
/// the engine to reuse the prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GroupKind {
    /// Full attention (vLLM's `full_attention`, `mla_attention`, `sink_full_attention`): every
    /// block of the prefix.
    Full,
    /// Sliding-window attention of `window` tokens (`sliding_window`, `sliding_window_mla`):
    /// only the blocks covering the last window before the prefix's end.
    SlidingWindow {
        /// The window, in tokens.
        window: u32,
    },
    /// Chunked local attention (`chunked_local_attention`): the blocks of the prefix's last
    /// chunk. Its chunk size is not in the events.
    ChunkedLocal,
    /// A Mamba-like state (`mamba`): the state at the prefix's end.
    Mamba,
    /// A kind this build does not know, or none named.
    Other,
}

impl GroupKind {
    /// Its short name, as `stats` and the Python package show it: `full`, `sliding_window`,
    /// `chunked_local`, `mamba` or `other`.
    pub fn name(&self) -> &'static str {
        match self {
            GroupKind::Full => "full",
            GroupKind::SlidingWindow { .. } => "sliding_window",
            GroupKind::ChunkedLocal => "chunked_local",
            GroupKind::Mamba => "mamba",
            GroupKind::Other => "other",
        }
    }

    /// Its window in tokens (a sliding window's).
    pub fn window(&self) -> Option<u32> {
        match self {
            GroupKind::SlidingWindow { window } => Some(*window),
            _ => None,
        }
    }

    /// The kind vLLM names (`kv_cache_spec_kind`), with its window if it named one.
    pub fn named(kind: Option<&str>, window: Option<u32>) -> GroupKind {
        match (kind, window) {
            (Some("full_attention" | "mla_attention" | "sink_full_attention"), _) => GroupKind::Full,
            (Some("sliding_window" | "sliding_window_mla"), Some(window)) => GroupKind::SlidingWindow { window },
            (Some("chunked_local_attention"), _) => GroupKind::ChunkedLocal,
            (Some("mamba"), _) => GroupKind::Mamba,
            _ => GroupKind::Other,
        }
    }
}

/// Blocks an engine stored: vLLM's `BlockStored`.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineStored {
    /// The hash of the block before the first one (`None`: the first is the prompt's first).
    pub parent: Option<u64>,
    /// The engine's hash of each block, in chain order.
    pub hashes: Vec<u64>,
    /// Every token of the blocks: `block_size` per hash.
    pub tokens: Vec<u32>,
    /// Tokens per engine block.
    pub block_size: u32,
    /// Where the engine keeps them: GPU memory, or an offloading connector's CPU memory or
    /// storage (such a store may carry no tokens: it then names blocks stored on the GPU
    /// before).
    pub medium: Medium,
    /// The namespace the blocks are keyed in (the model the endpoint serves, or its LoRA, and a
    /// cache salt as the tenant). Read for a first block (`parent` `None`): the others continue
    /// their parent's chain. `None`: the blocks key nothing, nor does anything stored below
    /// them (no namespace of this index matches, or they hash more than their tokens: images,
    /// prompt embeddings); they are kept, so that their children are not taken for orphans.
    pub namespace: Option<Namespace>,
    /// The KV cache group they are stored in (`None`: the engine named none, as vLLM before
    /// hybrid models and SGLang do: its one group).
    pub group: Option<CacheGroup>,
}

/// One event of an engine's batch.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum EngineEvent {
    /// Blocks stored.
    Stored(EngineStored),
    /// Blocks removed (evicted), by hash: vLLM's `BlockRemoved`.
    Removed {
        /// The engine's hashes.
        hashes: Vec<u64>,
        /// Where they were.
        medium: Medium,
        /// The index of the KV cache group they left (`None`: the engine named none).
        group: Option<u32>,
    },
    /// Everything the engine held is gone: vLLM's `AllBlocksCleared`.
    Cleared,
}

/// One batch of an engine's events, as its publisher numbers them.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineBatch {
    /// The engine's sequence number: from 0 per engine process, one more per batch.
    pub seq: u64,
    /// When the engine published it (seconds since the Unix epoch).
    pub ts: f64,
    /// Its events, in order.
    pub events: Vec<EngineEvent>,
}

/// What [`crate::Warm::engine_batch`] did with a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineOutcome {
    /// Applied: it was the next batch (or the first of a new engine process, whose restart
    /// cleared what the node held).
    Applied,
    /// Already applied (a replay's overlap, a late copy): nothing changed.
    Duplicate,
    /// Not applied: batches before it are missing. Ask the engine to replay from `from` (the
    /// last batch applied, to prove it is the same engine process, or 0), apply what comes
    /// back, and if its first batch is later than `from`, call
    /// [`crate::Warm::engine_resync`] with it.
    Gap {
        /// The sequence number to replay from.
        from: u64,
    },
}

/// An engine stream's counts (`Stats::engines`, `SnapshotStats::engines`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct EngineCounts {
    /// Batches applied.
    pub batches: u64,
    /// Blocks stored (copies in any medium, keyed or not).
    pub stored: u64,
    /// Blocks removed (copies in any medium).
    pub removed: u64,
    /// Times everything the node held was dropped: the engine said so, restarted, or a gap
    /// could not be covered.
    pub clears: u64,
    /// Engine restarts seen (its numbers started again).
    pub restarts: u64,
    /// Gaps seen (batches missing before one that came).
    pub gaps: u64,
    /// Gaps a replay could not cover (the node was cleared).
    pub lost: u64,
    /// Batches that came twice.
    pub duplicate_batches: u64,
    /// Blocks stored again while held (vLLM stores some blocks twice; each copy is removed).
    pub duplicate_blocks: u64,
    /// Blocks stored under a parent the index does not hold.
    pub unknown_parents: u64,
    /// Removals of blocks the index does not hold.
    pub unknown_removals: u64,
    /// Events not indexed for their medium: a medium this build does not know, or an offload
    /// store without tokens naming a block the index does not hold.
    pub other_medium: u64,
    /// Stores under no namespace of this index (a LoRA or salt it does not route).
    pub unkeyed: u64,
    /// Malformed events (tokens that do not fill the blocks, a block its own parent), skipped.
    pub malformed: u64,
    /// Blocks of a size that does not divide 64 (vLLM's hybrid models, some parallel modes):
    /// kept, but they key nothing. A block of ours would end inside one of them, and the
    /// engine can only reuse it for a prompt that also shares the tokens after that end.
    pub unaligned: u64,
}

/// Where one node's engine event stream stands, and its counts (`Warm::engine_stats`,
/// `SnapshotStats::engines`).
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct EngineStats {
    /// The node's name.
    pub node: String,
    /// The sequence number of the last batch applied (`None`: none since the stream began or
    /// was cleared).
    pub last_seq: Option<u64>,
    /// Its publish time (seconds since the Unix epoch).
    pub last_ts: f64,
    /// Engine blocks the node holds, as its events said.
    pub engine_blocks: usize,
    /// Blocks of 64 tokens (the index's) those cover whole from a prompt's start.
    pub blocks: usize,
    /// Of `engine_blocks`, those held in GPU memory, those only in CPU memory, and those only
    /// on storage (an offloading connector's tiers).
    pub by_tier: [usize; 3],
    /// The stream's counts.
    pub counts: EngineCounts,
    /// The KV cache groups its events named since this head started (none for an engine
    /// that names none: one group). An engine of several groups, or of another kind of
    /// attention than full, is hybrid: held per group, in memory only.
    pub groups: Vec<CacheGroup>,
    /// Of a hybrid engine, blocks whose place in a prompt its events did not give (a parent
    /// not held, a store of a block size not modelled), since this head started.
    pub unplaced_blocks: u64,
    /// Times one of its groups changed kind since this head started (each cleared the node).
    pub group_changes: u64,
}
