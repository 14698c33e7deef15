//! The index layer: `Warm` and its `Builder`, the caller's side (decided state, memtable, queue,
//! committed view, lookup) and the commit thread. Depends on `file`, `store` and `keys`.

pub(crate) mod answer;
pub(crate) mod builder;
pub(crate) mod commit;
pub(crate) mod engine_events;
pub(crate) mod front;
pub(crate) mod layer;
pub(crate) mod lookup;
pub(crate) mod memtable;
pub(crate) mod others;
pub(crate) mod presence;
pub(crate) mod queue;
pub(crate) mod read_index;
pub(crate) mod reader;
pub(crate) mod view_read;
pub(crate) mod warm;
