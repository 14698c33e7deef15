//! The store layer: the file's tables and records, their codec, the open-time schema checks, the
//! effects a change has and the writer that persists them, and the 0.1.7 import. Depends on `keys` (and `error`) only.

pub(crate) mod caches;
pub(crate) mod codec;
pub(crate) mod effect;
pub(crate) mod engine_blocks;
pub(crate) mod engines;
pub(crate) mod import;
pub(crate) mod records;
pub(crate) mod schema;
pub(crate) mod tables;
pub(crate) mod writer;
