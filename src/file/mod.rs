//! The file layer: what is done to an index file as a whole, beside or without a head: who has
//! it open (the lock), its seal, read-only snapshots and checks, compaction. Depends on `store`
//! and `keys`.

pub(crate) mod check;
pub(crate) mod compact;
pub(crate) mod index_file;
pub(crate) mod listen_status;
pub(crate) mod lock;
pub(crate) mod owner;
pub(crate) mod seal;
pub(crate) mod snapshot;
pub(crate) mod verify;
