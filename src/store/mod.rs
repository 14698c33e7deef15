//! The store layer: the file's tables and records, their codec, the open-time schema checks, the
//! writer that persists the decided state's effects, the loading of that state at open, and the
//! 0.1.7 import. Depends on `decided` and `keys` (and `error`).

pub(crate) mod codec;
pub(crate) mod import;
pub(crate) mod load;
pub(crate) mod records;
pub(crate) mod schema;
pub(crate) mod tables;
pub(crate) mod writer;
