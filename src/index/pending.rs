//! Changes a head answers before its memtable and its committed view that are not its own
//! decisions: a sharing head's own events not yet back from the stream (`share/pending.rs`).
//! The one read path (`lookup.rs`) reads them through this trait as one more memtable, the
//! newest; nothing is ever decided from them (a `ran` decides from the memtable and the
//! committed view alone, so that every head of a stream decides alike).

use crate::keys::BlockKey;

/// Node ids from this one up name a pending layer's own nodes (in its own numbering), never a
/// file's.
pub(crate) const PENDING_NODES: u32 = 1 << 31;

/// Clocks from this one up are a pending layer's: newer than any a file holds (at most
/// `MAX_CLOCK`, 2^62), as the head's own events not yet applied are the newest it knows.
#[cfg_attr(not(feature = "nats"), allow(dead_code))] // a sharing head's own writes only
pub(crate) const PENDING_CLOCKS: u64 = 1 << 63;

/// Writes answered first, then the memtable's, then the committed view's.
pub(crate) trait Pending {
    /// The newest write of `key` still answered: its node (from [`PENDING_NODES`] up) and clock
    /// (from [`PENDING_CLOCKS`] up).
    fn newest(&self, key: &BlockKey) -> Option<(u32, u64)>;

    /// Every write of `key` still answered (each node once, its newest clock), pushed onto
    /// `into`; whether there was more than one.
    fn writes(&self, key: &BlockKey, into: &mut Vec<(u32, u64)>) -> bool;

    /// Whether the node named `name` was forgotten here: the file's incarnation of it is not
    /// answered.
    fn forgets(&self, name: &str) -> bool;

    /// The name of its node `node`.
    fn name(&self, node: u32) -> Option<&str>;
}
