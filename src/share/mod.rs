//! Several heads, one view: every head's `ran`s and forgets shared through a NATS JetStream
//! stream (feature `nats`). Each head applies the whole stream, in order, to its own file.

mod event;
mod head;
mod link;
mod outbox;
mod own_events;
mod sharing;

pub use head::{ShareStats, SharedWarm, Ticket};
pub use sharing::{DEFAULT_BUFFER_EVENTS, Sharing};

/// The sharing tests' NATS server (`tests/common/nats.rs`), for this module's own tests.
#[cfg(test)]
#[allow(dead_code, clippy::indexing_slicing, missing_docs)]
#[path = "../../tests/common/nats.rs"]
mod test_nats;
